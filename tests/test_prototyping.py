"""Reward prototyping: preview_rewards / sample_and_score and their table (HTML + text)."""

import math

import numpy as np
import pytest
import torch

from grpo_nb import correctness_reward, preview_rewards, sample_and_score, xml_count_reward
from grpo_nb.models import prepare_tokenizer
from grpo_nb_widgets import RewardTable
from tiny_models import tiny_model, tiny_tokenizer

GOOD = "<reasoning>\n2+2\n</reasoning>\n<answer>\n4\n</answer>"


def boom(completions, **kwargs):
    raise KeyError("no_such_column")


def first_only(completions, **kwargs):
    return [1.0]


def odd(completions, **kwargs):
    return [None, math.nan, "high"]


def seen_kwargs(prompts, completions, completion_ids, answer, **kwargs):
    return [float(len(ids)) if ids is not None else -1.0 for ids in completion_ids]


def test_good_functions_scores_html_and_text():
    table = preview_rewards([xml_count_reward, correctness_reward], [GOOD, "4"], answer=["4", "4"],
                            prompts=["2+2?", "2+2?"])
    assert isinstance(table, RewardTable)
    assert table.scores == {"xml_count_reward": [0.5, 0.0], "correctness_reward": [2.0, 0.0]}
    assert table.totals == [2.5, 0.0]  # two functions: the unweighted total train() would use
    assert table.errors == {"xml_count_reward": None, "correctness_reward": None}
    html = table._repr_html_()
    assert "<table" in html and "correctness_reward" in html and "&lt;answer&gt;" in html and "2.5" in html
    text = str(table)
    assert text == repr(table) and "xml_count_reward" in text and "2.5" in text and "<table" not in text


def test_raising_function_keeps_the_table_complete():
    table = preview_rewards([xml_count_reward, boom, correctness_reward], [GOOD, "x", "4"], answer="4")
    assert table.scores["boom"] == [None, None, None]
    assert table.scores["correctness_reward"] == [2.0, 0.0, 0.0]  # the functions after it still ran
    assert "KeyError" in table.errors["boom"]
    html = table.html()
    assert html.count("KeyError: &#x27;no_such_column&#x27;") >= 3 and html.count('class="reward-error"') == 3
    text = table.text()
    assert text.count("KeyError") >= 3 and "boom, sample(s) 0-2" in text
    assert table.totals == [None, None, None]  # a total without one of the functions would mislead


def test_function_failing_on_one_sample_shows_the_others():
    def strict(completions, **kwargs):
        return [1.0 / len(c) for c in completions]

    table = preview_rewards(strict, ["ab", "", "abcd"])
    assert table.scores["strict"] == [0.5, None, 0.25]
    assert "ZeroDivisionError" in table.cells["strict"][1]["error"]
    assert "ZeroDivisionError" in table.errors["strict"]


def test_wrong_count_none_nan_and_non_numbers():
    table = preview_rewards([first_only, odd], ["a", "b", "c"])
    assert table.scores["first_only"] == [None] * 3
    assert "returned 1 values for 3 completions" in table.errors["first_only"]
    assert all("1 values for 3" in c["note"] for c in table.cells["first_only"])
    cells = table.cells["odd"]
    assert cells[0] == {"value": None}  # None: no score, not a problem
    assert "not finite" in cells[1]["note"] and "not a number" in cells[2]["note"]
    text = table.text()
    assert "None (no score)" in text and "not finite" in text and "not a number: str" in text
    html = table.html()
    assert html.count('class="reward-note"') == 5 and 'class="reward-none"' in html


def test_conversational_completions_tokenizer_and_weights():
    tok = prepare_tokenizer(tiny_tokenizer())
    completions = [[{"role": "assistant", "content": GOOD}], [{"role": "assistant", "content": "w5 w6"}]]
    table = preview_rewards([correctness_reward, seen_kwargs], completions, tokenizer=tok, answer=["4", "5"],
                            reward_weights=[2.0, 0.5])
    assert table.scores["correctness_reward"] == [2.0, 0.0]
    assert table.scores["seen_kwargs"][1] == 2.0  # completion_ids from the tokenizer
    assert table.totals[1] == pytest.approx(1.0) and table.totals[0] == pytest.approx(4.0 + 0.5 * table.scores["seen_kwargs"][0])
    assert "×2" in table.text() and "×0.5" in table.html()
    # Without a tokenizer completion_ids are None for every completion.
    assert preview_rewards(seen_kwargs, ["a"], answer="x").scores["seen_kwargs"] == [-1.0]


def test_columns_from_a_dataset_array_or_tensor():
    import datasets

    data = datasets.Dataset.from_dict({"answer": ["4", "5"]})
    for answers in (data["answer"], np.array(["4", "5"]), ("4", "5")):
        table = preview_rewards(correctness_reward, [GOOD, GOOD], answer=answers)
        assert table.scores["correctness_reward"] == [2.0, 0.0], type(answers)
    # Zero-dimensional arrays and tensors are one value for every row.
    seen = []

    def record(completions, bonus, **kwargs):
        seen.extend(bonus)
        return [0.0] * len(completions)

    preview_rewards(record, ["a", "b"], bonus=torch.tensor(3.0))
    preview_rewards(record, ["a", "b"], bonus=np.float64(2.0))
    assert [float(v) for v in seen] == [3.0, 3.0, 2.0, 2.0]


def test_bad_calls_raise():
    with pytest.raises(ValueError, match="one per completion"):
        preview_rewards(xml_count_reward, ["a", "b"], answer=["1"])
    with pytest.raises(ValueError, match="clash"):
        preview_rewards(xml_count_reward, ["a"], completion_ids=[[1]])


def test_missing_answers_and_too_many_samples_are_refused_like_sample_and_score_refuses_them():
    for answer in ([None], [""], None):  # a missing reference, or a blank one, would score 0 or 2.0 silently
        with pytest.raises(ValueError, match=r"completion 0: its 'answer' is .*, a missing value"):
            preview_rewards(correctness_reward, ["<answer></answer>"], answer=answer)
    with pytest.raises(ValueError, match=r"sample_and_score\(n=1000000\) is invalid: expected at most 256"):
        sample_and_score(None, None, ["w5"], [xml_count_reward], n=10**6)  # refused before any generation


def test_sample_and_score_on_tiny_model():
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 2

    def count_w7(completions, answer, **kwargs):
        return [float(c.split().count("w7")) + float(a) for c, a in zip(completions, answer)]

    def length(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    table = sample_and_score(model, tok, ["w5 w6 w7", "w8 w9"], [count_w7, length, boom], n=3,
                             max_completion_length=5, answer=["10", "20"])
    assert len(table.samples) == 6 and [s["group"] for s in table.samples] == [0, 0, 0, 1, 1, 1]
    assert all(s["prompt"] == "w5 w6 w7" for s in table.samples[:3])
    assert all(v >= 10 for v in table.scores["count_w7"][:3]) and all(v >= 20 for v in table.scores["count_w7"][3:])
    assert all(1 <= v <= 5 for v in table.scores["length"])
    assert table.scores["boom"] == [None] * 6 and "KeyError" in table.text()
    assert "<table" in table._repr_html_()
    def step(completions, trainer_state, **kwargs):  # TRL passes trainer_state; outside train() too
        return [float(trainer_state.global_step)] * len(completions)

    assert sample_and_score(model, tok, ["w5"], [step], n=2, max_completion_length=2).scores == {"step": [0.0, 0.0]}
    again = sample_and_score(model, tok, ["w5 w6 w7", "w8 w9"], [length], n=3, max_completion_length=5)
    assert [s["completion"] for s in again.samples] == [s["completion"] for s in table.samples]  # seeded
