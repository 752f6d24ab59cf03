"""rollout_func.to_batch: what a user's rollout function returns, read as TRL reads it (probe P37 F1, F2, F4)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from grpo_nb.rollout_func import to_batch
from tiny_models import byte_tokenizer

EOS = 258


def rows(**changes):
    """Two prompts ([1, 2] and [3, 4]), two completions each, in TRL's prompt-major order."""
    out = {"prompt_ids": [[1, 2], [1, 2], [3, 4], [3, 4]], "completion_ids": [[65, 66, 67, EOS]] * 4,
           "logprobs": [[-1.0] * 4] * 4}
    out.update(changes)
    return out


def batch(out, correction=False):
    return to_batch(out, 4, "f", byte_tokenizer(), "cpu", [EOS], 512, num_generations=2, correction=correction)


def test_placeholders_on_the_environments_tokens_keep_the_log_probs():
    """F1 addendum 2: NaN / None (vLLM's NaN) on env_mask=0 tokens are never used: the sampled tokens' log-probs are
    kept (the placeholders made 0, so that no NaN reaches the correction's masked sums), even with the correction."""
    for placeholder in (math.nan, None, -math.inf):
        out = rows(env_mask=[[1, 0, 0, 1]] * 4, logprobs=[[-1.0, placeholder, placeholder, -1.0]] * 4)
        b, _ = batch(out, correction=True)
        assert b.sampling_logprobs.tolist()[0] == [-1.0, 0.0, 0.0, -1.0]


def test_a_non_finite_sampled_log_prob_is_named_with_its_row_and_token():
    out = rows(logprobs=[[-1.0] * 4, [-1.0] * 4, [-1.0, -1.0, -math.inf, -1.0], [-1.0] * 4])
    with pytest.raises(ValueError, match=r"logprobs\[2\]\[2\] = -inf \(for completion_ids\[2\]\[2\] = 67"):
        batch(out, correction=True)
    with pytest.warns(UserWarning, match=r"logprobs\[2\]\[2\] = -inf"):
        b, _ = batch(out)
    assert b.sampling_logprobs is None  # not used without the correction: the step computes its own
    # one row given as None among lists: its values are missing, not the whole batch's
    with pytest.raises(ValueError, match=r"logprobs\[3\]\[0\] = None/NaN"):
        batch(rows(logprobs=[[-1.0] * 4] * 3 + [None]), correction=True)
    # no log-probs at all, with the correction: named here, not blamed on the engine
    with pytest.raises(ValueError, match="'logprobs' that are None, while rollout_importance_sampling_correction"):
        batch(rows(logprobs=[None] * 4), correction=True)
    assert batch(rows(logprobs=[None] * 4))[0].sampling_logprobs is None


def test_numpy_rows_are_read_as_tensors_are():
    """F2: numpy arrays (what many samplers and environments return) as rows, like torch tensors."""
    out = rows(prompt_ids=[np.array(p) for p in rows()["prompt_ids"]],
               completion_ids=[np.array([65, 66, 67, EOS])] * 4, logprobs=[np.full(4, -1.0)] * 4,
               env_mask=[np.array([True, False, False, True])] * 4)
    b, _ = batch(out)
    assert b.completion_ids.tolist()[0] == [65, 66, 67, EOS] and b.env_mask.tolist()[0] == [1, 0, 0, 1]
    assert b.sampling_logprobs.tolist()[0] == [-1.0] * 4
    # one padded 2-D array for a key: its pads would be tokens, so it is refused with the fix
    with pytest.raises(ValueError, match=r"'prompt_ids' as one Tensor of shape \(4, 2\), not a list"):
        batch(rows(prompt_ids=torch.ones(4, 2, dtype=torch.long)))


def test_rows_must_be_prompt_major():
    """F4: generation-major rows (p0g0, p1g0, p0g1, p1g1) would mix prompts in every group: refused. Prompt_ids that
    differ within a group without that pattern may be per-episode observations: said once."""
    major = rows(prompt_ids=[[1, 2], [3, 4], [1, 2], [3, 4]])
    with pytest.raises(ValueError, match=r"prompt_ids\[1\], which differs from prompt_ids\[0\] of the same group.*"
                                         r"rows must be prompt-major.*generation-major"):
        batch(major)
    observed = rows(prompt_ids=[[1, 2], [1, 2, 9], [3, 4], [3, 4]])
    with pytest.warns(UserWarning, match=r"prompt_ids\[1\], which differs from prompt_ids\[0\]"):
        batch(observed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch(rows())  # prompt-major: no word
        # one generation per prompt: any order is its own group
        to_batch(rows(prompt_ids=[[1, 2], [3, 4], [1, 2], [3, 4]]), 4, "f", byte_tokenizer(), "cpu", [EOS], 512,
                 num_generations=1)


def three_token_rows(tok, prompts, G):
    """What a rollout_func returns: G completions [5 + k, 7, EOS] per prompt, in prompt order."""
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for p in prompts:
        for k in range(G):
            out["prompt_ids"].append(tok(p, add_special_tokens=False)["input_ids"])
            out["completion_ids"].append([5 + k, 7, 2])
            out["logprobs"].append([-1.0] * 3)
    return out


def test_writes_into_trainer_args_do_not_change_the_run(tmp_path):
    """P37 F16: trainer.args is a copy; a rollout_func that writes into it is told, and the run's settings (its
    saved grpo_config.json too) stay train()'s."""
    import json

    from grpo_nb import train
    from grpo_nb.models import prepare_tokenizer
    from tiny_models import FAST, count_w7, dataset, lora_model, tiny_tokenizer

    tok = prepare_tokenizer(tiny_tokenizer())

    def f(prompts, trainer):
        trainer.args.learning_rate = 5.0
        return three_token_rows(tok, prompts, trainer.num_generations)

    with pytest.warns(UserWarning, match=r"changed trainer.args \(learning_rate\): ignored"):
        train(lora_model(), tok, dataset(), count_w7, rollout_func=f, verbose=False, live=False,
              output_dir=str(tmp_path / "run"), **{**FAST, "max_steps": 1, "save_steps": 1})
    saved = json.loads(next((tmp_path / "run").rglob("grpo_config.json")).read_text())
    assert saved["learning_rate"] == FAST["learning_rate"]


def test_completions_beyond_the_cap_and_keys_named_like_columns_are_said(tmp_path):
    """P37 F3 / F10: what TRL accepts too, said once: completions longer than max_completion_length (the run was
    sized for it) and a returned key that takes a dataset column's place for the reward functions."""
    from grpo_nb import train
    from grpo_nb.models import prepare_tokenizer
    from tiny_models import FAST, count_w7, dataset, lora_model, tiny_tokenizer

    tok = prepare_tokenizer(tiny_tokenizer())
    seen = []

    def f(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "answer": []}
        for p in prompts:
            for k in range(trainer.num_generations):
                out["prompt_ids"].append(tok(p, add_special_tokens=False)["input_ids"])
                out["completion_ids"].append([5 + k, 7, 8, 2])
                out["logprobs"].append([-1.0] * 4)
                out["answer"].append("mine")
        return out

    def reward(completions, answer, **kwargs):
        seen.extend(answer)
        return [0.0] * len(completions)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(lora_model(), tok, dataset(), [count_w7, reward], rollout_func=f, verbose=False, live=False,
              output_dir=str(tmp_path / "run"), **{**FAST, "max_steps": 2, "max_completion_length": 3})
    said = [str(w.message) for w in caught]
    assert sum("up to 4 tokens, beyond max_completion_length=3" in m for m in said) == 1
    assert sum("returned ['answer'], named like the dataset's column" in m for m in said) == 1
    assert seen and set(seen) == {"mine"}  # as TRL: the function's values reach the rewards


def test_groups_must_come_in_the_order_the_prompts_were_given():
    """P40 F1: groups kept together but in another order than the prompts (episodes collected as they finish) would
    be scored against other dataset rows: refused, naming the group and the prompt it holds. A prompt the function
    rewrote (no given prompt's text in it) and two rows with the same prompt text are not refused."""
    tok = byte_tokenizer()
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    given = ["w39 w40 w41", "w32 w33"]
    swapped = rows(prompt_ids=[enc(given[1])] * 2 + [enc(given[0])] * 2)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] \(group 0: rows 0 to 1, num_generations=2\) holding the "
                                         r"prompt of prompts\[1\] \('w32 w33'\), not that of prompts\[0\].*sorted by it"):
        to_batch(swapped, 4, "f", tok, "cpu", [EOS], 512, num_generations=2, given=given)
    # in order, inside a template with special tokens and other spacing: accepted
    templated = rows(prompt_ids=[enc(f"<|im_start|>user\n{p}  <|im_end|>") for p in given for _ in range(2)])
    to_batch(templated, 4, "f", tok, "cpu", [EOS], 512, num_generations=2, given=given)
    # chat prompts: their messages' text is looked for
    chats = [[{"role": "user", "content": p}] for p in given]
    with pytest.raises(ValueError, match=r"holding the prompt of prompts\[1\]"):
        to_batch(swapped, 4, "f", tok, "cpu", [EOS], 512, num_generations=2, given=chats)
    # with a system message: each message's text is looked for (the template writes its markers between them)
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}] for p in given]
    chat_ids = [enc(f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{p}<|im_end|>") for p in given]
    to_batch(rows(prompt_ids=[chat_ids[0]] * 2 + [chat_ids[1]] * 2), 4, "f", tok, "cpu", [EOS], 512,
             num_generations=2, given=chats)
    with pytest.raises(ValueError, match=r"holding the prompt of prompts\[1\]"):
        to_batch(rows(prompt_ids=[chat_ids[1]] * 2 + [chat_ids[0]] * 2), 4, "f", tok, "cpu", [EOS], 512,
                 num_generations=2, given=chats)
    # the same text twice (two dataset rows): either order is that prompt's
    to_batch(rows(prompt_ids=[enc("w5")] * 4), 4, "f", tok, "cpu", [EOS], 512, num_generations=2,
             given=["w5", "w5"])
    # an environment's observation in place of the prompt: no given prompt's text, nothing to compare
    to_batch(rows(prompt_ids=[enc("board 1")] * 2 + [enc("board 2")] * 2), 4, "f", tok, "cpu", [EOS], 512,
             num_generations=2, given=given)


def test_groups_in_order_are_not_refused_on_ambiguous_evidence():
    """P42 F4: groups in the right order were refused as out of order when a row lost its own prompt's text but held
    another's: a long prompt cut from the left (as TRL truncates) whose tail is a shorter prompt of the batch, and
    a prompt whose words decode as the unknown token. Refused now only when the other prompt is not part of the
    row's own; a real swap still is."""
    from grpo_nb.models import prepare_tokenizer
    from tiny_models import tiny_tokenizer

    tok = prepare_tokenizer(tiny_tokenizer())
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    given = ["w5 w6 w7", "w9 w5 w6 w7"]  # the second cut to its last 3 tokens: "w5 w6 w7", the first's text
    cut = rows(prompt_ids=[enc(p)[-3:] for p in given for _ in range(2)])
    to_batch(cut, 4, "f", tok, "cpu", [EOS], 512, num_generations=2, given=given)
    given = ["w5", "hello w5"]  # "hello" is not in the vocabulary: decoded "<unk> w5"
    to_batch(rows(prompt_ids=[enc(p) for p in given for _ in range(2)]), 4, "f", tok, "cpu", [EOS], 512,
             num_generations=2, given=given)
    given = ["w39 w40", "w9 w10"]  # a swap, decoded faithfully: refused
    with pytest.raises(ValueError, match=r"holding the prompt of prompts\[1\]"):
        to_batch(rows(prompt_ids=[enc(given[1])] * 2 + [enc(given[0])] * 2), 4, "f", tok, "cpu", [EOS], 512,
                 num_generations=2, given=given)


def test_trainer_args_equal_their_copies():
    """P42 F5: trainer.args (a view of a hidden subclass) was unequal to its own copy and to GRPOConfig(**vars(args)),
    a dataclass's == wanting the same class: a function that re-creates a client when the settings change
    (`if trainer.args != self.seen:`) re-did it every step."""
    import copy
    import pickle

    from grpo_nb.config import GRPOConfig
    from grpo_nb.rollout_func import _args_view

    args = _args_view(GRPOConfig(max_steps=3))
    assert args == copy.copy(args) and copy.copy(args) == args and args == GRPOConfig(**vars(args))
    assert args == pickle.loads(pickle.dumps(args)) and not args != copy.deepcopy(args)
    assert args != GRPOConfig(max_steps=4) and GRPOConfig(max_steps=4) != args


def test_numpy_columns_and_numpy_bools_are_read_by_what_they_are():
    """P40 F7 / F8: an extra column as a 1-D numpy array or tensor reaches the rewards as a list; env_mask rows
    made of numpy bools (a list comprehension over a numpy mask) are 1 and 0."""
    for column in (np.array([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 3.0, 4.0])):
        _, extra = batch(rows(score=column))
        assert extra["score"] == [1.0, 2.0, 3.0, 4.0] and isinstance(extra["score"], list)
    with pytest.raises(ValueError, match=r"'score' with 3 entries, where 4"):
        batch(rows(score=np.array([1.0, 2.0, 3.0])))
    b, _ = batch(rows(env_mask=[[np.True_, np.False_, np.False_, np.True_]] * 4))
    assert b.env_mask.tolist()[0] == [1, 0, 0, 1]


def test_trainer_is_one_object_and_names_what_it_lacks(tmp_path):
    """P40 F4 / F5: as TRL's trainer, the view is the same object at every step (state a function keeps on it
    survives; args and state are refreshed); a TRL-only attribute (trainer.vllm_client, trainer.args.vllm_mode)
    raises an AttributeError that says grpo-nb has none and what to use instead."""
    from grpo_nb import train
    from grpo_nb.models import prepare_tokenizer
    from tiny_models import FAST, count_w7, dataset, lora_model, tiny_tokenizer

    tok = prepare_tokenizer(tiny_tokenizer())
    calls, steps, views = [], [], []

    def f(prompts, trainer):
        trainer.n_calls = getattr(trainer, "n_calls", 0) + 1
        calls.append(trainer.n_calls)
        steps.append(trainer.state.global_step)
        views.append(trainer)
        assert not hasattr(trainer, "vllm_client") and not hasattr(trainer.args, "use_vllm")
        return three_token_rows(tok, prompts, trainer.num_generations)

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # reading the view's args does not count as a change
        train(lora_model(), tok, dataset(), count_w7, rollout_func=f, verbose=False, live=False,
              output_dir=str(tmp_path / "run"), **{**FAST, "max_steps": 3})
    assert calls == [1, 2, 3] and steps == [0, 1, 2] and all(v is views[0] for v in views)
    with pytest.raises(AttributeError, match=r"trainer.vllm_client: grpo-nb has no attribute 'vllm_client'.*not "
                                             r"TRL's GRPOTrainer.*trainer.rollout\("):
        views[0].vllm_client
    with pytest.raises(AttributeError, match=r"trainer.args.vllm_mode \(GRPOConfig.*no vLLM server"):
        views[0].args.vllm_mode
    import pickle

    from grpo_nb.config import GRPOConfig

    # the args copy pickles (a process pool) as the run's own config class
    assert type(pickle.loads(pickle.dumps(views[0].args))) is GRPOConfig
