"""evaluate(): greedy completions (equal to HF generate's), accuracy, format rate and mean rewards."""

import copy
import math

import datasets
import pytest
import torch

from grpo_nb.evaluation import compare, default_answer_check, evaluate
from grpo_nb.models import prepare_tokenizer
from grpo_nb.rewards import correctness_reward, soft_format_reward
from tiny_models import tiny_model, tiny_tokenizer

PROMPTS = ["w5 w6 w7", "w8 w9", "w10", "w11 w12 w13 w14", "w15 w16"]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 2
    return model, tok


def reference_texts(model, tok, prompts, max_new_tokens):
    """HF generate, greedy, one prompt at a time (no padding to get wrong)."""
    texts, lengths = [], []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=2, pad_token_id=0)
        texts.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        lengths.append(out.shape[1] - ids.shape[1])  # new tokens, the EOS included
    return texts, lengths


def test_default_answer_check():
    assert default_answer_check("<reasoning>\nx\n</reasoning>\n<answer>\n1,234\n</answer>", "1234")
    assert default_answer_check("<answer> 5.0 </answer>", 5)
    assert not default_answer_check("<answer>6</answer>", "5")
    assert not default_answer_check("the answer is 5", "5")


def test_reward_functions_taking_trainer_state_work_as_in_train(model_and_tokenizer):
    def step(completions, trainer_state, **kwargs):  # TRL always passes trainer_state
        return [float(trainer_state.global_step)] * len(completions)

    result = evaluate(*model_and_tokenizer, [{"prompt": "w5"}], [step], max_completion_length=2)
    assert result["rewards"] == {"step": 0.0}  # a TrainerState that has not trained, as TRL's before training


def test_greedy_completions_accuracy_and_rewards(model_and_tokenizer):
    model, tok = model_and_tokenizer
    expected, lengths = reference_texts(model, tok, PROMPTS, 6)
    # Half the references are the greedy completions themselves, so an exact-match check knows
    # which rows must count as right.
    answers = [expected[i] if i % 2 == 0 else "never" for i in range(len(PROMPTS))]
    dataset = datasets.Dataset.from_dict({"prompt": PROMPTS, "answer": answers, "bonus": [1.0, 2.0, 3.0, 4.0, 5.0]})

    def length(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    def bonus(completions, bonus, **kwargs):
        return list(bonus)

    def odd_only(completions, bonus, **kwargs):  # None = no score: left out of the mean
        return [b if b % 2 else None for b in bonus]

    result = evaluate(model, tok, dataset, [length, bonus, odd_only], answer_check=lambda text, ref: text == ref,
                      max_completion_length=6, batch_size=2)
    assert result["completions"] == expected
    assert result["correct"] == [True, False, True, False, True] and result["accuracy"] == pytest.approx(0.6)
    assert result["n"] == 5 and result["format_rate"] == 0.0
    assert result["rewards"]["length"] == pytest.approx(sum(lengths) / 5)
    assert result["rewards"]["bonus"] == pytest.approx(3.0)
    assert result["rewards"]["odd_only"] == pytest.approx(3.0)  # mean of 1, 3, 5
    # limit, and the default check without <answer> tags: nothing is right.
    first_two = evaluate(model, tok, dataset, max_completion_length=6, limit=2)
    assert first_two["completions"] == expected[:2] and first_two["accuracy"] == 0.0 and first_two["rewards"] == {}


def test_chat_prompts_and_no_answer_column(model_and_tokenizer):
    model, tok = model_and_tokenizer
    tok = tok.__class__.from_pretrained(tok.name_or_path) if tok.name_or_path else tok
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    dataset = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS[:3]]})
    seen = []

    def record(completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    result = evaluate(model, tok, dataset, [record], max_completion_length=4)
    assert result["accuracy"] is None and result["correct"] is None
    # Chat prompts give chat completions to reward functions, as in training.
    assert [c[0]["content"] for c in seen] == result["completions"] and seen[0][0]["role"] == "assistant"


def test_bad_datasets(model_and_tokenizer):
    model, tok = model_and_tokenizer
    with pytest.raises(ValueError, match="empty dataset"):
        evaluate(model, tok, datasets.Dataset.from_dict({"prompt": []}))
    with pytest.raises(ValueError, match="'prompt' column"):
        evaluate(model, tok, datasets.Dataset.from_dict({"question": ["w5"]}))


def test_compare():
    before = {"accuracy": 0.25, "format_rate": 0.5, "rewards": {"f": 0.1}, "n": 8}
    after = {"accuracy": 0.5, "format_rate": 1.0, "rewards": {"f": 0.7}, "n": 8}
    lines = compare(before, after).splitlines()
    assert lines[1].split() == ["accuracy", "25.0%", "50.0%"] and lines[3].split() == ["f", "0.100", "0.700"]
    assert not math.isnan(after["rewards"]["f"])


def test_compare_pairs_only_evaluations_of_the_same_problems():
    before = {"accuracy": 0.5, "n": 2, "correct": [True, False], "problems": "a"}
    after = {"accuracy": 1.0, "n": 2, "correct": [True, True], "problems": "a"}
    assert "paired test (strict, same problems): p = 1" in compare(before, after)
    other = compare(before, {**after, "problems": "b"})  # two held-out sets of one size
    assert "no paired test (strict): the two evaluations ran on other problems" in other and "p =" not in other
    smaller = compare(before, {**after, "n": 1, "correct": [True], "problems": "c"})  # evaluate(..., limit=1)
    assert "no paired test (strict): the two evaluations ran on 2 and 1 problems" in smaller
    with pytest.raises(ValueError, match=r"compare\(before=.*expected what evaluate\(model"):
        compare({}, after)
    with pytest.raises(TypeError, match=r"compare\(after='<NoneType>'\)"):
        compare(before, None)


def test_strict_and_lenient_checks_on_hand_written_completions():
    from grpo_nb.evaluation import lenient_answer_check
    from grpo_nb.rewards import correctness_reward

    cases = [  # (completion, strict right?, lenient right?) for the reference 12
        ("<reasoning>\n5 + 7 = 12\n</reasoning>\n<answer>\n12\n</answer>", True, True),
        ("5 + 7 = 12", False, True),                                   # right number, no tags
        ("<reasoning>\n5 + 7 = 12\n</reasoning>\n<answer>\n13\n</answer>", False, False),  # tags hold a wrong one
        ("<answer>12</answer> because 5 + 7", True, False),            # the last number is 7
        ("The total is 1,2 or 12.", False, True),
        ("<reasoning>\n12 apples\n</reasoning>\n<answer>\ntwelve\n</answer>", False, True),
        ("no number here", False, False),
    ]
    for text, strict, lenient in cases:
        assert default_answer_check(text, "12") is strict, text
        assert (correctness_reward([text], ["12"])[0] > 0) is strict, text  # exactly what the reward pays for
        assert lenient_answer_check(text, "12") is lenient, text
    assert lenient_answer_check("so -3.50 is left", "-3.5") and lenient_answer_check("total: 1,234.", "1234")


def test_intervals_and_paired_test():
    from grpo_nb.evaluation import paired_test, wilson_interval

    low, high = wilson_interval(79, 100)
    assert low == pytest.approx(0.7002, abs=1e-3) and high == pytest.approx(0.8583, abs=1e-3)
    assert wilson_interval(0, 24)[0] == 0.0 and 0.13 < wilson_interval(0, 24)[1] < 0.15
    assert wilson_interval(24, 24)[1] == 1.0
    assert paired_test([True] * 10, [True] * 10) == 1.0
    # 10 problems gained, none lost: p = 2 / 2**10.
    assert paired_test([False] * 10 + [True] * 5, [True] * 15) == pytest.approx(2 / 1024)
    assert paired_test([False, True], [True, False]) == 1.0
    with pytest.raises(ValueError, match="same problems"):
        paired_test([True], [True, False])


def test_truncation_length_and_both_accuracies_counted(model_and_tokenizer):
    model, tok = model_and_tokenizer
    texts, lengths = reference_texts(model, tok, PROMPTS, 3)
    ended = []  # HF generate: did the completion end with EOS within 3 tokens?
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=3,
                             eos_token_id=2, pad_token_id=0)
        ended.append(2 in out[0, ids.shape[1]:].tolist())
    dataset = datasets.Dataset.from_dict({"prompt": PROMPTS, "answer": ["1"] * len(PROMPTS)})
    result = evaluate(model, tok, dataset, max_completion_length=3,
                      lenient_check=lambda text, ref: text == texts[0])
    assert result["truncated"] == [not e for e in ended] and any(result["truncated"])
    assert result["truncation_rate"] == pytest.approx(sum(result["truncated"]) / 5)
    assert result["mean_length"] == pytest.approx(sum(lengths) / 5)
    assert result["accuracy"] == 0.0 and result["lenient_accuracy"] == pytest.approx(
        sum(t == texts[0] for t in texts) / 5)
    low, high = result["intervals"]["lenient_accuracy"]
    assert low <= result["lenient_accuracy"] <= high
    assert set(result["intervals"]) == {"accuracy", "lenient_accuracy", "format_rate", "truncation_rate"}


def test_format_and_strict_accuracy_read_the_answer_behind_an_assistant_prefill(model_and_tokenizer):
    """A chat prompt ending with the assistant's prefill: format_rate and both accuracies judge the prefill and the
    completion together, as the reward functions of the same evaluation do (rewards.answer_texts; P16-6)."""
    model, tok = model_and_tokenizer[0], copy.deepcopy(model_and_tokenizer[1])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    # The tiny model writes words, never tags: the prefill holds the well-formed answer, the completion follows it
    prefill = "<reasoning>\nw5\n</reasoning>\n<answer>\n5\n</answer>\n"
    rows = [{"prompt": [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": prefill}],
             "answer": "5"}]
    seen = []
    result = evaluate(model, tok, rows, [soft_format_reward, correctness_reward], max_completion_length=2,
                      lenient_check=lambda text, reference: seen.append(text) or True)
    assert result["rewards"] == {"soft_format_reward": 0.5, "correctness_reward": 2.0}
    assert result["format_rate"] == 1.0 and result["accuracy"] == 1.0 and result["correct"] == [True]
    assert seen == [prefill + result["completions"][0]] and not result["completions"][0].startswith(prefill)


def test_compare_gives_no_paired_test_for_evaluations_under_other_settings(model_and_tokenizer):
    """Another max_completion_length or answer_check changes the numbers of one model: compare() names the settings
    and pairs nothing they touch (P16-3)."""
    model, tok = model_and_tokenizer
    rows = [{"prompt": p, "answer": "1"} for p in PROMPTS[:3]]
    short = evaluate(model, tok, rows, max_completion_length=2)
    assert short["settings"] == {"max_completion_length": 2, "max_prompt_length": None,
                                 "answer_check": "default_answer_check", "lenient_check": "lenient_answer_check",
                                 "tools": [], "environment": None, "max_tool_calling_iterations": None}
    assert "paired test (strict, same problems): p = 1" in compare(short, evaluate(model, tok, rows,
                                                                                  max_completion_length=2))
    lenient = compare(short, evaluate(model, tok, rows, max_completion_length=2, answer_check=lambda c, r: True))
    assert "other settings: answer_check 'default_answer_check' vs '<lambda>'" in lenient
    assert "no paired test (strict): the two evaluations used other settings (answer_check)" in lenient
    assert "paired test (lenient, same problems)" in lenient  # the lenient check and the completions are the same
    longer = compare(short, evaluate(model, tok, rows, max_completion_length=3))
    assert "max_completion_length 2 vs 3" in longer and "p =" not in longer
    assert "no paired test (lenient): the two evaluations used other settings (max_completion_length)" in longer


class _Board:
    """An environment with a per-run parameter, for the settings evaluate() records of its factory."""

    def __init__(self, start=0, *, size=3):
        self.start, self.size = start, size

    def reset(self, **row):
        return None

    def move(self, x: int) -> int:
        """
        Moves.

        Args:
            x: Where.
        """
        return x


def test_an_environment_factory_is_recorded_by_the_class_it_builds_and_what_it_binds():
    """Probe P37 F8: lambdas and partials were all recorded as '<lambda>' / 'partial', so compare() paired evaluations
    of other environments (or other parameters) as the same settings."""
    import functools
    from types import SimpleNamespace

    from grpo_nb.evaluation import environment_names

    def built(factory):
        return environment_names(factory, SimpleNamespace(pools={None: [factory()]}))

    assert built(_Board) == "_Board"
    assert built(functools.partial(_Board, 0, size=5)) == "_Board(0, size=5)"
    assert built(lambda: _Board(0)) != built(lambda: _Board(100))
    assert built(lambda: _Board(100)) == "_Board from <lambda> with 100"
    start = 7
    assert built(lambda: _Board(start)) == "_Board from <lambda> with 7"  # a closure's value
    assert built(functools.partial(_Board)) != built(functools.partial(type("Other", (_Board,), {})))
    assert built(lambda: _Board(object())) == "_Board from <lambda>"  # no memory address in the record
    assert environment_names({"a": lambda: _Board(1)}, SimpleNamespace(pools={"a": [_Board(1)]})) == {
        "a": "_Board from <lambda> with 1"}


def test_compare_keeps_evaluations_with_other_environment_parameters_apart():
    import warnings

    from tiny_models import byte_tokenizer, chat

    tok = byte_tokenizer()
    model = tiny_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.max_position_embeddings = 2048
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small, large = (evaluate(model, tok, chat(2), environment_factory=lambda: _Board(size), max_completion_length=4)
                        for size in (3, 9))
    assert small["settings"]["environment"] == "_Board from <lambda> with 3"
    assert "other settings: environment '_Board from <lambda> with 3' vs '_Board from <lambda> with 9'" in compare(
        small, large)


def test_evaluate_refuses_one_tool_given_without_a_list():
    """P37 F12: the settings were recorded before the tools were checked (a raw TypeError from iterating a function)."""
    from grpo_nb import evaluate
    from tiny_models import byte_tokenizer, chat, multiply, tiny_model

    tok, model = byte_tokenizer(), tiny_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    with pytest.raises(TypeError, match=r"must be a list of functions, e.g. tools=\[multiply\]"):
        evaluate(model, tok, chat(2), tools=multiply, max_completion_length=8)


def test_evaluate_records_the_tools_of_an_iterator():
    """P39 F4: tools=<a generator> was read to its end by make_agent, then read again for the record: [] recorded,
    so compare() paired evaluations made with other tools as one setting."""
    import warnings

    from tiny_models import byte_tokenizer, chat, multiply, tiny_model

    def add(a: int, b: int) -> int:
        """
        Adds.

        Args:
            a: One.
            b: Two.
        """
        return a + b

    tok, model = byte_tokenizer(), tiny_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.max_position_embeddings = 2048
    outs = []
    for tools in ((f for f in [multiply]), map(lambda f: f, [add])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs.append(evaluate(model, tok, chat(1), tools=tools, max_tool_calling_iterations=1,
                                 max_completion_length=4))
    assert [o["settings"]["tools"] for o in outs] == [["multiply"], ["add"]]
    assert "other settings: tools ['multiply'] vs ['add']" in compare(*outs)


def test_evaluate_names_its_own_argument_for_a_bad_tool_setting():
    """P37 F13: GRPOConfig's message names its field; evaluate() names its argument (as play() does)."""
    from tiny_models import byte_tokenizer, chat, multiply, tiny_model

    tok, model = byte_tokenizer(), tiny_model()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    with pytest.raises(ValueError, match=r"evaluate\(\) argument max_tool_calling_iterations=-1") as err:
        evaluate(model, tok, chat(2), tools=[multiply], max_tool_calling_iterations=-1, max_completion_length=8)
    assert "GRPOConfig" not in str(err.value)


def test_auto_batch_size_fits_the_kv_cache_in_the_memory_it_is_given(monkeypatch):
    import grpo_nb.evaluation as evaluation_mod
    from grpo_nb.memory.accounting import kv_cache_bytes, sampling_bytes

    model = tiny_model()
    per_row = kv_cache_bytes(model.config, 1, 96, 4) + sampling_bytes(model.config.vocab_size, 1)
    monkeypatch.setattr(evaluation_mod, "available_host_bytes", lambda: 8 * 10 * per_row)
    assert evaluation_mod.auto_batch_size(model, 500, 96) == 10  # an eighth of the host's memory on the CPU
    assert evaluation_mod.auto_batch_size(model, 7, 96) == 7  # never more than the rows
    monkeypatch.setattr(evaluation_mod, "available_host_bytes", lambda: 0)
    assert evaluation_mod.auto_batch_size(model, 500, 96) == 1
    monkeypatch.setattr(evaluation_mod, "available_host_bytes", lambda: 2**50)
    assert evaluation_mod.auto_batch_size(model, 500, 96) == evaluation_mod.EVAL_MAX_ROWS
