"""Bad inputs to the inspection helpers (evaluate, sample_and_score, preview_rewards, the reward
functions, weighted_reward, the planner, arithmetic_dataset, the live dashboard): each is refused
with a message naming the argument and the fix, never misread. docs/bad_inputs.md lists them
("Evaluating, prototyping and planning")."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset, DatasetDict

from grpo_nb import (RewardFunctionError, arithmetic_dataset, correctness_reward, evaluate, format_gsm8k,
                     plan_for_gpu, preview_rewards, sample_and_score, strict_format_reward, train, weighted_reward,
                     xml_count_reward)
from grpo_nb.memory import estimate_vram
from grpo_nb.models import prepare_tokenizer
from grpo_nb.reward_calls import call_reward_funcs
from grpo_nb_widgets import LiveDashboard
from tiny_models import FAST, count_w7, dataset, lora_model
from tiny_models import tiny_tokenizer

SHORT = dict(max_completion_length=4)
TINY_CONFIG = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return lora_model()


@pytest.fixture()
def tok():
    return prepare_tokenizer(tiny_tokenizer())


def first_lambda(completions, **kwargs):
    return [1.0] * len(completions)


# ------------------------------------------------------------------------ A: evaluate


def test_evaluate_takes_what_train_takes(model, tok):
    out = evaluate(model, tok, dataset(2), count_w7, **SHORT)  # one function, as train() accepts
    assert set(out["rewards"]) == {"count_w7"} and out["n"] == 2
    # each wrong dataset gets train()'s own message
    for bad, fragments in [
        (["w5 w6", "w7"], ["row 0 is a str", "[{'prompt': p} for p in prompts]"]),
        ({"prompt": ["w5", "w6"]}, ["dict of columns", "Dataset.from_dict"]),
        ({"prompt": "w5"}, ["single row", "[row]"]),
        (({"prompt": "w5"} for _ in range(2)), ["generator", "list(rows)"]),
        ([{"prompt": 5}], ["row 0: 'prompt' must be a string", "got int"]),
        ([{"prompt": None}], ["row 0: its 'prompt' is None, a missing value", "row['prompt'] is not None"]),
        (DatasetDict(test=dataset(2)), ["DatasetDict", "dataset['test']"]),
    ]:
        with pytest.raises(ValueError) as err:
            evaluate(model, tok, bad, **SHORT)
        assert all(f in str(err.value) for f in fragments), (bad, str(err.value))


def test_evaluate_checks_the_tokenizer_like_train(model, tok):
    tok.pad_token = None
    with pytest.raises(ValueError, match=r"evaluate\(tokenizer=.*no pad token.*prepare_tokenizer"):
        evaluate(model, tok, dataset(2), **SHORT)
    with pytest.raises(ValueError, match=r"sample_and_score\(tokenizer=.*no pad token"):
        sample_and_score(model, tok, ["w5"], count_w7, n=2, **SHORT)
    chat_tok = prepare_tokenizer(tiny_tokenizer())
    chat_tok.chat_template = None
    with pytest.raises(ValueError, match=r"evaluate\(tokenizer=.*no chat template.*prepare_tokenizer"):
        evaluate(model, chat_tok, [{"prompt": [{"role": "user", "content": "w5"}]}], **SHORT)


def test_evaluate_answer_check_failures_name_the_row(model, tok):
    with pytest.raises(ValueError, match=r"(?s)evaluate\(answer_check=<lambda>\) raised ZeroDivisionError.*"
                                         r"dataset row 0 \(answer '0'\), whose completion is"):
        evaluate(model, tok, dataset(2), answer_check=lambda text, answer: 1 / 0, **SHORT)
    with pytest.raises(TypeError, match=r"evaluate\(answer_check=<lambda>\) returned 'no' \(str\).*True or False"):
        evaluate(model, tok, dataset(2), answer_check=lambda text, answer: "no", **SHORT)
    ok = evaluate(model, tok, dataset(2), answer_check=lambda text, answer: 0, **SHORT)  # a number is a verdict
    assert ok["correct"] == [False, False]


# ------------------------------------------------------------------------ B: sample_and_score


def test_sample_and_score_refuses_a_dataset_or_its_rows(model, tok):
    ds = dataset(4)
    for bad in (ds, [dict(row) for row in ds], ds[:2]):
        with pytest.raises(TypeError, match=r"sample_and_score\(prompts=.*dataset\['prompt'\]\[:4\], reward_funcs, "
                                            r"answer=dataset\['answer'\]\[:4\]"):
            sample_and_score(model, tok, bad, count_w7, n=2, **SHORT)
    with pytest.raises(ValueError, match=r"sample_and_score\(reward_weights='1'\).*a list of 1 finite number"):
        sample_and_score(model, tok, ["w5"], count_w7, n=2, reward_weights="1", **SHORT)
    table = sample_and_score(model, tok, ds["prompt"][:2], count_w7, n=2, answer=ds["answer"][:2], **SHORT)
    assert len(table.scores["count_w7"]) == 4  # the column of a Dataset is a list of prompts


# ------------------------------------------------------------------------ C: reward helpers


def test_reward_helpers_refuse_a_bare_string():
    for func in (xml_count_reward, strict_format_reward):
        with pytest.raises(TypeError, match=rf"{func.__name__}\(completions='<answer>1</answer>'\).*Wrap it in a "
                                            r"list: completions=\['<answer>1</answer>'\]"):
            func("<answer>1</answer>")
    with pytest.raises(TypeError, match=r"correctness_reward\(answer='12'\).*answer=\['12'\]"):
        correctness_reward(["<answer>1</answer>", "<answer>2</answer>"], "12")
    with pytest.raises(TypeError, match=r"preview_rewards\(prompts='w5'\).*prompts=\['w5'\]"):
        preview_rewards(count_w7, ["a", "b"], prompts="w5")
    with pytest.raises(TypeError, match=r"preview_rewards\(tokenizer='gpt2'\) is a name"):
        preview_rewards(count_w7, ["a", "b"], tokenizer="gpt2")
    with pytest.raises(ValueError, match=r"preview_rewards\(reward_weights=<dict \['f'\]>\).*one per reward function"):
        preview_rewards(count_w7, ["a", "b"], reward_weights={"f": 1})
    with pytest.raises(TypeError, match=r"preview_rewards\(completions=<generator>\).*list\(\.\.\.\)"):
        preview_rewards(count_w7, (c for c in ["a", "b"]))
    assert preview_rewards(count_w7, "w7 w7", prompts="w5").scores == {"count_w7": [2.0]}  # one completion, bare


# ------------------------------------------------------------------------ D: weighted_reward


def test_weighted_reward_arguments_and_signature(tmp_path, tok):
    with pytest.raises(TypeError, match=r"weighted_reward\(reward_funcs=<function count_w7.*weighted_reward\(\[f\], "
                                        r"\[w\]\)"):
        weighted_reward(count_w7, 1.0)
    with pytest.raises(TypeError, match=r"weighted_reward\(reward_funcs=<dict of 1>\).*two lists"):
        weighted_reward({"count": count_w7}, [1.0])

    def needs_answer(completions, answer, **kwargs):
        return [0.0] * len(completions)

    combined = weighted_reward([needs_answer, count_w7], [1.0, 0.5])
    # train() sees the `answer` the wrapped function needs: refused before the first rollout
    with pytest.raises(ValueError, match=r"needs argument\(s\) \['answer'\]"):
        train(lora_model(), tok, Dataset.from_dict({"prompt": ["w5 w6"] * 8}), [combined],
              **{**FAST, "max_steps": 1, "verbose": False, "live": False, "output_dir": str(tmp_path)})
    assert combined(completions=["w7"], answer=["1"]) == [0.5]


# ------------------------------------------------------------------------ E: reward names


def test_reward_functions_of_one_name_keep_their_own_scores(model, tok):
    def second(completions, **kwargs):
        return [2.0] * len(completions)

    second.__name__ = first_lambda.__name__
    out = evaluate(model, tok, dataset(2), [first_lambda, second], **SHORT)
    assert out["rewards"] == {"first_lambda": 1.0, "first_lambda#2": 2.0}
    table = preview_rewards([lambda completions, **k: [1.0] * len(completions),
                             lambda completions, **k: [3.0] * len(completions)], ["a"])
    assert table.scores == {"<lambda>": [1.0], "<lambda>#2": [3.0]}
    assert "<lambda>#2" in str(table) and "&lt;lambda&gt;#2" in table._repr_html_()


def test_train_keeps_each_of_two_same_named_rewards_in_its_history(tok, tmp_path):
    history = train(lora_model(), tok, dataset(), [lambda completions, **k: [1.0] * len(completions),
                                                   lambda completions, **k: [3.0] * len(completions)],
                    **{**FAST, "max_steps": 1}, output_dir=str(tmp_path), verbose=False, live=False)
    assert {k: v["mean"] for k, v in history[0]["rewards"].items()} == {"<lambda>": 1.0, "<lambda>#2": 3.0}
    assert set(history[0]["samples"][0]["rewards"]) == {"<lambda>", "<lambda>#2"}


# ------------------------------------------------------------------------ F: chat completions


def test_a_text_reward_on_chat_completions_points_at_completion_text():
    chat = [[{"role": "assistant", "content": "w7"}]]
    with pytest.raises(RewardFunctionError, match=r"(?s)chat messages.*completion_text\(c\)"):
        call_reward_funcs([count_w7], prompts=[[{"role": "user", "content": "w5"}]], completions=chat,
                          completion_ids=[[7]], columns={})
    collected = call_reward_funcs([count_w7], prompts=[None], completions=chat, completion_ids=[[7]], columns={},
                                  strict=False)
    assert "completion_text(c)" in collected[0].problem
    with pytest.raises(RewardFunctionError) as err:  # text completions: no such hint
        call_reward_funcs([lambda completions, **k: 1 / 0], prompts=["w5"], completions=["w7"],
                          completion_ids=[[7]], columns={})
    assert "completion_text" not in str(err.value)


# ------------------------------------------------------------------------ G: planner


def test_planner_inputs():
    with pytest.raises(ValueError, match=r"plan_for_gpu\(gpu=16000000000.0\).*in GiB.*looks like bytes.*14.9 GiB"):
        plan_for_gpu(16e9, TINY_CONFIG)
    assert plan_for_gpu("Tesla T4", TINY_CONFIG).budget_bytes == plan_for_gpu("T4", TINY_CONFIG).budget_bytes
    assert plan_for_gpu("NVIDIA A100-SXM4-80GB", TINY_CONFIG).budget_bytes == \
        plan_for_gpu("A100-80GB", TINY_CONFIG).budget_bytes
    with pytest.raises(ValueError, match=r"plan_for_gpu\(gpu='NVIDIA RTX A6000'\).*in GiB as a number"):
        plan_for_gpu("NVIDIA RTX A6000", TINY_CONFIG)
    with pytest.raises(ValueError, match=r"hidden_size='64' is a string.*hidden_size=64"):
        estimate_vram({**TINY_CONFIG, "hidden_size": "64"})
    with pytest.raises(TypeError, match=r"plan_for_gpu\(lora_rnk=8\).*Did you mean lora_rank\?"):
        plan_for_gpu("T4", TINY_CONFIG, lora_rnk=8)


# ------------------------------------------------------------------------ H: datasets


def test_arithmetic_dataset_and_format_gsm8k_inputs():
    for system_prompt in (None, ""):
        prompt = arithmetic_dataset(2, system_prompt=system_prompt, few_shot=0)[0]["prompt"]
        assert [m["role"] for m in prompt] == ["user"]
    for n in (2.5, -1, "8"):
        with pytest.raises(ValueError, match=rf"arithmetic_dataset\(n={n!r}\) is invalid: expected an integer >= 1"):
            arithmetic_dataset(n)
    with pytest.raises(ValueError, match=r"arithmetic_dataset\(max_value=10{30}\).*from 2 to 10,000"):
        arithmetic_dataset(4, max_value=10**30)
    with pytest.raises(TypeError, match=r"format_gsm8k\(dataset=<list of 1>\).*Dataset.from_list\(rows\)"):
        format_gsm8k([{"question": "q", "answer": "#### 1"}])


# ------------------------------------------------------------------------ I: dashboard


def test_live_dashboard_refuses_what_it_could_not_draw():
    with pytest.raises(TypeError, match=r"LiveDashboard\(title=None\).*title='GRPO run'"):
        LiveDashboard(notebook=False, title=None)
    for name in ("planned", "trl_estimate"):
        with pytest.raises(TypeError, match=rf"LiveDashboard\({name}='abc'\).*estimate_vram"):
            LiveDashboard(notebook=False, **{name: "abc"})
    assert LiveDashboard(notebook=False, planned=estimate_vram(TINY_CONFIG, num_generations=2)).planned is not None


# ------------------------------------------------------------------------ loading for inference


def test_load_for_inference_names_a_missing_tokenizer_and_odd_devices_and_dtypes(tmp_path, tok):
    from grpo_nb import load_for_inference, save_merged

    path = save_merged(lora_model(), tmp_path / "merged", dtype=torch.float32)  # no tokenizer given
    with pytest.raises(FileNotFoundError, match=r"holds a model but no tokenizer.*save_merged\(model, path, tokenizer\)"):
        load_for_inference(path)
    with pytest.raises(ValueError, match=r"dtype=torch.int8\) is invalid: expected .*floating-point torch.dtype"):
        load_for_inference(path, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"device='mps'\) is invalid: expected None, 'cpu' or 'cuda\[:index\]'"):
        load_for_inference(path, device="mps")


def test_a_reward_function_that_edits_its_lists_does_not_change_what_the_next_one_sees():
    def greedy(completions, answer, **kwargs):
        out = [1.0] * len(completions)
        completions.clear()
        answer.reverse()
        return out

    def reader(completions, answer, **kwargs):
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    calls = call_reward_funcs([greedy, reader], prompts=["p", "q"], completions=["1", "2"],
                              completion_ids=[[1], [2]], columns={"answer": ["1", "2"]})
    assert [c.values for c in calls] == [[1.0, 1.0], [1.0, 1.0]]


def test_evaluate_and_sample_and_score_check_the_context_like_train(tok):
    """The before/after accuracy is measured within the context train() would use: a completion beyond it is
    refused, and prompts over what it leaves are cut as in training, with its warning (probe 3, F13)."""
    from grpo_nb.attachments import attachments

    model = lora_model()
    attachments(model).max_seq_length = 16
    long_prompt = " ".join(["w9"] * 20)
    for call in (lambda: evaluate(model, tok, [{"prompt": long_prompt}], max_completion_length=16),
                 lambda: sample_and_score(model, tok, [long_prompt], count_w7, n=2, max_completion_length=16)):
        with pytest.raises(ValueError, match=r"\(max_completion_length=16\) leaves no room for a prompt in the "
                                             r"model's max_seq_length 16"):
            call()
    with pytest.raises(ValueError, match=r"evaluate\(\): max_prompt_length \+ max_completion_length = 14 \+ 4"):
        evaluate(model, tok, [{"prompt": long_prompt}], max_prompt_length=14, **SHORT)
    for func, call in (("evaluate", lambda: evaluate(model, tok, [{"prompt": long_prompt}], **SHORT)),
                       ("sample_and_score", lambda: sample_and_score(model, tok, [long_prompt], count_w7, n=2, **SHORT))):
        with pytest.warns(UserWarning, match=rf"{func}\(\): 1 prompt\(s\) were longer than max_prompt_length=12 "
                                             r"tokens .*max_prompt_length=None means max_seq_length - "
                                             r"max_completion_length = 16 - 4"):
            call()
