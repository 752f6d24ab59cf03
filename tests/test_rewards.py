"""Tests for grpo_nb.rewards, the reward functions, and for the scoring machinery around them (reward_calls)."""

import functools
import math

import numpy as np
import pytest
import torch

from grpo_nb.reward_calls import call_reward_funcs, combine_rewards, rewards_tensor
from grpo_nb.reward_contract import RewardFunctionError, completion_text, reward_func_name, reward_func_names
from grpo_nb.rewards import (
    STARTER_REWARDS,
    correctness_reward,
    extract_answer,
    integer_answer_reward,
    overlong_penalty,
    proximity_reward,
    soft_format_reward,
    strict_format_reward,
    weighted_reward,
    xml_count_reward,
)

PERFECT = "<reasoning>\n2 + 3 = 5\n</reasoning>\n<answer>\n5\n</answer>"
SQUASHED = "<reasoning>2 + 3 = 5</reasoning> <answer>5</answer>"  # soft format only
CHATTY = PERFECT + "\nHope this helps! Let me know."  # text after </answer>
NO_TAGS = "The answer is 5."
HALF = "<reasoning>\nthinking..."  # cut off mid-reasoning
WORDY = "<reasoning>\nadd them\n</reasoning>\n<answer>\nfive\n</answer>\n"


def score_completions(reward_funcs, *, prompts, completions, completion_ids, columns, trainer_state=None,
                      timeout=None):
    """Every reward function's rewards for every completion, [N, num_funcs] float32, NaN for "no score": the
    strict call train() makes, through the same two functions."""
    calls = call_reward_funcs(reward_funcs, prompts=prompts, completions=completions, completion_ids=completion_ids,
                              columns=columns, trainer_state=trainer_state, timeout=timeout)
    return rewards_tensor(calls, len(completions))


def chat(text):
    return [{"role": "assistant", "content": text}]


def test_completion_text():
    assert completion_text("hi") == "hi"
    assert completion_text(chat("hi")) == "hi"
    assert completion_text([{"role": "assistant", "content": None}]) == ""
    with pytest.raises(TypeError, match="list of messages"):
        completion_text(42)


def test_extract_answer():
    assert extract_answer(PERFECT) == "5"
    assert extract_answer(SQUASHED) == "5"
    assert extract_answer("<answer> 3 </answer> then <answer>\n4\n</answer>") == "4"  # the last one
    assert extract_answer("<answer>\n4\n</answer> then <answer>7") == "4"  # last complete one
    assert extract_answer(NO_TAGS) is None
    assert extract_answer("5</answer>") is None
    assert extract_answer("<answer>5") is None
    assert extract_answer("<answer></answer>") == ""


@pytest.mark.parametrize("wrap", [lambda t: t, chat], ids=["string", "conversational"])
def test_correctness_reward(wrap):
    completions = [wrap(t) for t in [PERFECT, SQUASHED, "<answer>5.0</answer>", "<answer> 5 </answer>",
                                     "<answer>6</answer>", NO_TAGS, HALF, "<answer>1,234</answer>"]]
    answers = ["5", "5", "5", "5", "5", "5", "5", "1234"]
    assert correctness_reward(completions, answers) == [2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 2.0]
    # Non-numbers compare as stripped strings.
    assert correctness_reward([wrap(WORDY), wrap("<answer>Five</answer>")], ["five", "five"]) == [2.0, 0.0]
    # Extra TRL keywords are accepted and ignored.
    assert correctness_reward(completions=[wrap(PERFECT)], answer=["5"], prompts=["p"], completion_ids=[[1]]) == [2.0]


def test_correctness_reward_reads_money_and_percent_answers_as_their_number():
    pairs = [("$18", "18"), ("18", "$18"), ("18%", "18"), ("18", "18%"), ("€1,234.50", "1234.5"), ("-$5", "-5"),
             ("$-5", "-5"), ("£ 7", "7"), ("18 %", "$18")]
    assert correctness_reward([f"<answer>{p}</answer>" for p, _ in pairs], [r for _, r in pairs]) == [2.0] * len(pairs)
    # Not one number, or not these signs: compared as text, as before.
    others = [("1/2", "0.5"), ("1 000", "1000"), ("18 dollars", "18"), ("$$18", "18"), ("18%%", "18"), ("$19", "18"),
              ("$", "0"), ("¥18", "18")]
    assert correctness_reward([f"<answer>{p}</answer>" for p, _ in others], [r for _, r in others]) == [0.0] * len(others)
    assert proximity_reward(["<answer>$9</answer>"], ["$18"]) == [pytest.approx(1 / 1.5)]


@pytest.mark.parametrize("wrap", [lambda t: t, chat], ids=["string", "conversational"])
def test_integer_answer_reward(wrap):
    texts = [PERFECT, "<answer>-3</answer>", "<answer>+7</answer>", "<answer>5.5</answer>",
             WORDY, NO_TAGS, "<answer></answer>", "<answer>1,234</answer>"]
    assert integer_answer_reward([wrap(t) for t in texts]) == [0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("wrap", [lambda t: t, chat], ids=["string", "conversational"])
def test_strict_format_reward(wrap):
    texts = {
        PERFECT: 0.5,
        PERFECT + "\n": 0.5,
        WORDY: 0.5,
        "<reasoning>\na\nb\n</reasoning>\n<answer>\n5\n</answer>": 0.5,  # multi-line reasoning
        PERFECT + "\n\n": 0.0,
        CHATTY: 0.0,
        "Sure!\n" + PERFECT: 0.0,
        SQUASHED: 0.0,
        NO_TAGS: 0.0,
        HALF: 0.0,
        "<reasoning>\n2\n</reasoning>\n\n<answer>\n5\n</answer>": 0.0,  # blank line between blocks
    }
    assert strict_format_reward([wrap(t) for t in texts]) == list(texts.values())


@pytest.mark.parametrize("wrap", [lambda t: t, chat], ids=["string", "conversational"])
def test_soft_format_reward(wrap):
    texts = {
        PERFECT: 0.5,
        SQUASHED: 0.5,
        CHATTY: 0.5,
        "Sure! " + SQUASHED: 0.5,
        "<reasoning>\nx\n</reasoning>\n\n\n<answer>5</answer>": 0.5,
        NO_TAGS: 0.0,
        HALF: 0.0,
        "<answer>5</answer><reasoning>x</reasoning>": 0.0,  # wrong order
        "<reasoning>x</reasoning> so <answer>5</answer>": 0.0,  # text between blocks
    }
    assert soft_format_reward([wrap(t) for t in texts]) == list(texts.values())


@pytest.mark.parametrize("wrap", [lambda t: t, chat], ids=["string", "conversational"])
def test_xml_count_reward(wrap):
    rewards = xml_count_reward([wrap(t) for t in [PERFECT, PERFECT + "\n", CHATTY, SQUASHED, NO_TAGS, HALF]])
    trailing = len("Hope this helps! Let me know.")
    expected = [0.5, 0.5, 0.5 - 0.001 * trailing, 0.0, 0.0, 0.125]
    assert rewards == pytest.approx(expected)
    # A tag repeated earns nothing for that tag.
    twice = "<reasoning>\n<reasoning>\nx\n</reasoning>\n<answer>\n5\n</answer>"
    assert xml_count_reward([wrap(twice)]) == pytest.approx([0.375])
    # Partial formats earn partial, graded credit: the point of this reward.
    assert len(set(xml_count_reward([PERFECT, CHATTY, HALF, NO_TAGS]))) == 4


@pytest.mark.parametrize("wrap", [lambda t: t, chat], ids=["string", "conversational"])
def test_proximity_reward(wrap):
    texts = [PERFECT, "<answer>6</answer>", "<answer>4</answer>", "<answer>10</answer>", "<answer>105</answer>",
             "<answer>1,000</answer>", WORDY, NO_TAGS, HALF, "<answer></answer>"]
    rewards = proximity_reward([wrap(t) for t in texts], ["5"] * len(texts))
    # exact, off by 1 either way (1/(1+1/5)), off by the answer's size, far away, then nothing to parse
    assert rewards[:6] == pytest.approx([1.0, 5 / 6, 5 / 6, 0.5, 1 / 21, 5 / 1000])
    assert rewards[6:] == [0.0, 0.0, 0.0, 0.0]
    assert all(r > 0 for r in rewards[:6])  # any number beats no number
    # Nearer scores higher, on both sides of the answer.
    near_to_far = ["<answer>100</answer>", "<answer>90</answer>", "<answer>50</answer>", "<answer>-100</answer>"]
    scores = proximity_reward(near_to_far, ["100"] * 4)
    assert scores == sorted(scores, reverse=True) and scores[0] == 1.0
    # Small answers are compared on an absolute scale (no division by zero at 0).
    assert proximity_reward(["<answer>1</answer>", "<answer>0.5</answer>"], ["0", "0"]) == pytest.approx([0.5, 2 / 3])
    with pytest.raises(ValueError, match="numeric answers"):
        proximity_reward([PERFECT], ["five"])


def test_overlong_penalty():
    penalty = overlong_penalty(100, buffer=20)
    lengths = [0, 50, 80, 81, 90, 100, 130]
    assert penalty(completion_ids=[[7] * n for n in lengths], completions=[""] * 7) == pytest.approx(
        [0.0, 0.0, 0.0, -0.05, -0.5, -1.0, -1.0]
    )
    assert overlong_penalty(8)(completion_ids=[[1] * 6, [1] * 7, [1] * 8]) == pytest.approx([0.0, -0.5, -1.0])  # buffer 2
    assert "80" in penalty.__doc__ and penalty.__name__ == "overlong_penalty"
    for bad in [dict(max_completion_length=0), dict(max_completion_length=10, buffer=0),
                dict(max_completion_length=10, buffer=11), dict(max_completion_length=10.5)]:
        with pytest.raises(ValueError):
            overlong_penalty(**bad)
    # It runs through the scoring machinery like any TRL reward function.
    scores = score_completions([penalty], prompts=["p"] * 2, completions=["a", "b"],
                               completion_ids=[[1] * 10, [1] * 95], columns={})
    assert scores[:, 0].tolist() == pytest.approx([0.0, -0.75])


def test_weighted_reward():
    combined = weighted_reward([correctness_reward, soft_format_reward], [1.0, 0.5])
    completions = [PERFECT, SQUASHED, "<answer>6</answer>", NO_TAGS]
    assert combined(completions=completions, answer=["5", "5", "5", "5"], prompts=["p"] * 4) == pytest.approx(
        [2.25, 2.25, 0.0, 0.0]
    )
    assert combined.__name__ == "1*correctness_reward+0.5*soft_format_reward"
    assert weighted_reward([correctness_reward], [2], name="right").__name__ == "right"

    # None from one function leaves the others' weighted sum; None from all stays None.
    def only_first(completions, **kwargs):
        return [1.0] + [None] * (len(completions) - 1)

    def never(completions, **kwargs):
        return [None] * len(completions)

    assert weighted_reward([only_first, never], [3, 1])(completions=["a", "b"]) == [3.0, None]
    # A penalty combines with a negative or positive weight alike.
    with_penalty = weighted_reward([soft_format_reward, overlong_penalty(10, buffer=5)], [1, 1])
    assert with_penalty(completions=[SQUASHED, SQUASHED], completion_ids=[[1] * 5, [1] * 10]) == [0.5, -0.5]
    # Through score_completions, the combined function is one column; a part's bad output is
    # reported under the part's own name.
    scores = score_completions([combined], prompts=["p"] * 2, completions=[PERFECT, NO_TAGS],
                               completion_ids=[[1], [1]], columns={"answer": ["5", "5"]})
    assert scores.shape == (2, 1) and scores[:, 0].tolist() == [2.25, 0.0]

    def broken(completions, **kwargs):
        return ["x"] * len(completions)

    with pytest.raises(RewardFunctionError, match="'broken'"):
        weighted_reward([broken], [1])(completions=["a"])
    with pytest.raises(ValueError, match="one weight per reward function"):
        weighted_reward([correctness_reward, soft_format_reward], [1.0])
    with pytest.raises(ValueError, match="finite"):
        weighted_reward([correctness_reward], [float("nan")])


def test_starter_rewards_on_a_perfect_and_a_bad_completion():
    scores = score_completions(
        STARTER_REWARDS,
        prompts=["p", "p"],
        completions=[chat(PERFECT), chat(NO_TAGS)],
        completion_ids=[[1, 2], [3]],
        columns={"answer": ["5", "5"], "question": ["q", "q"]},
    )
    assert scores.tolist() == [[0.5, 0.5, 0.5, 0.5, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0]]
    assert combine_rewards(scores).tolist() == [4.0, 0.0]


# ----------------------------------------------------------------------------------------
# score_completions and combine_rewards


def score(funcs, completions, **columns):
    n = len(completions)
    columns = columns or {"answer": ["5"] * n}
    return score_completions(
        funcs, prompts=[f"prompt {i}" for i in range(n)], completions=completions,
        completion_ids=[[i] for i in range(n)], columns=columns,
    )


def test_trl_style_functions_run_unmodified():
    def length_reward(completions, **kwargs):
        return [float(len(completion_text(c))) for c in completions]

    seen = {}

    def answer_in_prompt(prompts, completions, answer, **kwargs):
        seen.update(kwargs)
        return [1.0 if a in p else 0.0 for p, a in zip(prompts, answer)]

    scores = score_completions(
        [length_reward, answer_in_prompt],
        prompts=["what is 2+3", "what is 7"],
        completions=["abc", "de"],
        completion_ids=[[1, 2, 3], [4, 5]],
        columns={"answer": ["5", "7"], "level": ["easy", "easy"]},
    )
    assert scores.dtype == torch.float32
    assert scores.shape == (2, 2)
    assert scores.tolist() == [[3.0, 0.0], [2.0, 1.0]]
    assert seen["completion_ids"] == [[1, 2, 3], [4, 5]]
    assert seen["level"] == ["easy", "easy"]


def test_accepted_return_types():
    funcs = [
        lambda completions, **kw: torch.tensor([1.0, 2.0, 3.0]),
        lambda completions, **kw: np.array([1, 2, 3]),
        lambda completions, **kw: (True, False, np.float32(0.5)),
        lambda completions, **kw: [torch.tensor(1.5), np.int64(2), 3],
        lambda completions, **kw: torch.tensor([1, 0, 1], dtype=torch.bool),
    ]
    scores = score(funcs, ["a", "b", "c"])
    assert scores.tolist() == [
        [1.0, 1.0, 1.0, 1.5, 1.0],
        [2.0, 2.0, 0.0, 2.0, 0.0],
        [3.0, 3.0, 0.5, 3.0, 1.0],
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_tensor_rewards_are_moved_to_cpu():
    scores = score([lambda completions, **kw: torch.ones(2, device="cuda")], ["a", "b"])
    assert scores.device.type == "cpu" and scores.tolist() == [[1.0], [1.0]]


def test_none_means_no_score():
    def only_first(completions, **kwargs):
        return [1.0] + [None] * (len(completions) - 1)

    def never(completions, **kwargs):
        return [None] * len(completions)

    scores = score([only_first, never], ["a", "b"])
    assert scores[0, 0] == 1.0
    assert torch.isnan(scores[0, 1]) and torch.isnan(scores[1]).all()
    # A row no function scored is "unscorable": its total is NaN, as in TRL (group_advantages leaves it out).
    total = combine_rewards(scores)
    assert total[0] == 1.0 and torch.isnan(total[1])
    # A batch nobody scored is no error here: train() stops only after max_unscored_steps such steps.
    assert torch.isnan(score([never], ["a", "b"])).all()


def test_reward_timeout():
    import threading
    import time

    release = threading.Event()

    def stuck(completions, **kwargs):
        release.wait(30)
        return [0.0] * len(completions)

    def quick(completions, **kwargs):
        return [1.0] * len(completions)

    start = time.perf_counter()
    with pytest.raises(RewardFunctionError, match=r"'stuck' did not return within reward_timeout=0.2 s for 2 "):
        score_completions([quick, stuck], prompts=["p"] * 2, completions=["a", "b"], completion_ids=[[1], [2]],
                          columns={}, timeout=0.2)
    assert time.perf_counter() - start < 5
    release.set()
    # Within the limit, results and errors are the same as without one.
    assert score_completions([quick], prompts=["p"], completions=["a"], completion_ids=[[1]], columns={},
                             timeout=5).tolist() == [[1.0]]
    with pytest.raises(RewardFunctionError, match="ZeroDivisionError"):
        score_completions([lambda completions, **kw: [1 / 0]], prompts=["p"], completions=["a"],
                          completion_ids=[[1]], columns={}, timeout=5)


def test_raising_function_names_the_failing_completion():
    def parse_answer(completions, **kwargs):
        return [float(extract_answer(completion_text(c))) for c in completions]

    completions = [chat(PERFECT), chat(PERFECT), chat("I refuse to answer " + "x" * 1000)]
    with pytest.raises(RewardFunctionError) as info:
        score([parse_answer], completions)
    message = str(info.value)
    assert "'parse_answer'" in message
    assert "TypeError" in message  # float(None)
    assert "sample 2 of 3" in message
    assert "I refuse to answer" in message
    assert len(message) < 1000  # the completion is truncated
    assert isinstance(info.value.__cause__, TypeError)
    assert isinstance(info.value, ValueError)
    assert "signature" not in message  # no misleading hint: the signature was fine


def test_function_failing_only_on_the_batch():
    def batch_of_one_only(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("batch too big")
        return [0.0]

    with pytest.raises(RewardFunctionError, match=r"'batch_of_one_only' raised RuntimeError: batch too big") as info:
        score([batch_of_one_only], ["a", "b"])
    assert "whole batch" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_missing_column_hint():
    def needs_solution(completions, solution, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match="solution") as info:
        score([needs_solution], ["a"])
    assert "called by keyword with prompts, completions, completion_ids, answer" in str(info.value)

    def no_kwargs(completions):
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match="(?s)unexpected keyword argument.*accept the rest with"):
        score([no_kwargs], ["a"])


def test_wrong_number_of_rewards():
    with pytest.raises(RewardFunctionError, match=r"'too_few'.*expected 3, got 2.*one reward per completion"):
        def too_few(completions, **kwargs):
            return [1.0, 1.0]

        score([too_few], ["a", "b", "c"])


@pytest.mark.parametrize(
    "returned, expected",
    [
        (1.0, r"returned float 1.0"),
        ({"a": 1}, r"returned dict"),
        ("0.5", r"returned str"),
        (torch.tensor(1.0), r"tensor of shape \(\)"),
        (torch.ones(2, 1), r"tensor of shape \(2, 1\)"),
    ],
)
def test_not_a_list(returned, expected):
    with pytest.raises(RewardFunctionError, match=expected):
        score([lambda completions, **kw: returned], ["a", "b"])


@pytest.mark.parametrize(
    "bad, expected",
    [("1.0", r"'1.0' \(str\) at index 1, which is not a number"), ([1.0], r"\[1.0\] \(list\) at index 1")],
)
def test_non_number_value(bad, expected):
    def sloppy(completions, **kwargs):
        return [1.0, bad]

    with pytest.raises(RewardFunctionError, match=expected) as info:
        score([sloppy], ["a", "second completion"])
    assert "'sloppy'" in str(info.value)
    assert "second completion" in str(info.value)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, torch.tensor(math.nan)])
def test_non_finite_value(bad):
    def unstable(completions, **kwargs):
        return [0.0, 1.0, bad]

    with pytest.raises(RewardFunctionError, match=r"'unstable' returned .* at index 2.*return None") as info:
        score([unstable], ["a", "b", "c"])
    assert "finite" in str(info.value)


def test_reward_func_name():
    class JudgeReward:
        def __call__(self, completions, **kwargs):
            raise KeyError("boom")

    def weighted(completions, weight, **kwargs):
        return [weight] * len(completions)

    assert reward_func_name(correctness_reward) == "correctness_reward"
    assert reward_func_name(JudgeReward()) == "JudgeReward"
    # a partial is named by the function it wraps, as TRL names it; two of them stay apart in the records
    half, double = functools.partial(weighted, weight=0.5), functools.partial(functools.partial(weighted), weight=2.0)
    assert reward_func_name(double) == "weighted"
    assert reward_func_names([half, double]) == ["weighted", "weighted#2"]
    with pytest.raises(RewardFunctionError, match="'JudgeReward' raised KeyError"):
        score([JudgeReward()], ["a"])
    assert score([functools.partial(weighted, weight=2.0)], ["a"]).tolist() == [[2.0]]


def test_inconsistent_inputs():
    with pytest.raises(ValueError, match="'answer' has 1 entries but there are 2 completions"):
        score([xml_count_reward], ["a", "b"], answer=["5"])
    with pytest.raises(ValueError, match="clash"):
        score_completions(
            [xml_count_reward], prompts=["p"], completions=["a"], completion_ids=[[1]], columns={"completions": ["x"]}
        )


def test_combine_rewards():
    rewards = torch.tensor([[1.0, 2.0, math.nan], [math.nan, math.nan, math.nan], [0.5, 0.0, 4.0]])
    nan = math.nan  # the middle row: no function scored it (NaN, as TRL's total)
    torch.testing.assert_close(combine_rewards(rewards), torch.tensor([3.0, nan, 4.5]), equal_nan=True)
    torch.testing.assert_close(combine_rewards(rewards, [2.0, 0.5, 1.0]), torch.tensor([3.0, nan, 5.0]), equal_nan=True)
    torch.testing.assert_close(combine_rewards(rewards, torch.tensor([0.0, 1.0, -1.0])), torch.tensor([2.0, nan, -4.0]),
                               equal_nan=True)
    with pytest.raises(ValueError, match="reward_weights has 2 entries but there are 3 reward functions"):
        combine_rewards(rewards, [1.0, 1.0])


def test_one_reward_contract_strict_raises_what_collecting_shows():
    """Training (strict) and prototyping (collecting) call reward functions through one contract."""
    from types import SimpleNamespace

    from grpo_nb.prototyping import preview_rewards
    from grpo_nb.reward_calls import call_reward_funcs

    def odd(completions, **kwargs):
        return [1.0, float("nan"), "x"]

    batch = dict(prompts=[None] * 3, completions=["a", "b", "c"], completion_ids=[[1]] * 3, columns={})
    [call] = call_reward_funcs([odd], strict=False, **batch)
    assert call.rewards[0] == 1.0 and math.isnan(call.rewards[1]) and math.isnan(call.rewards[2])
    assert call.notes == [None, "not finite; return None for 'no score'", "not a number: str"] and call.problem is None
    with pytest.raises(RewardFunctionError, match=r"'odd' returned nan at index 1"):
        call_reward_funcs([odd], **batch)

    def by_progress(completions, trainer_state, **kwargs):  # TRL passes trainer_state; so do both modes
        return [float(trainer_state.global_step)] * len(completions)

    state = SimpleNamespace(global_step=3, max_steps=5)
    for strict in (True, False):
        [call] = call_reward_funcs([by_progress], strict=strict, trainer_state=state, **batch)
        assert call.rewards == [3.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="clash"):  # a column may not shadow any argument reward functions get
        preview_rewards(odd, ["a"], trainer_state=1)


def test_answer_rewards_take_any_number_a_model_writes_and_one_reference():
    import decimal

    huge = ["<answer>1e1000000</answer>", "<answer>-9.9e999999</answer>", "<answer>1e99999999999999999999</answer>"]
    assert proximity_reward(huge, ["5", "9.9e999999", "5"]) == [0.0, pytest.approx(1 / 3), 0.0]  # no Overflow
    with decimal.localcontext() as ctx:  # the caller's context changes nothing
        ctx.prec = 1
        assert proximity_reward(["<answer>6</answer>"], ["5"]) == [pytest.approx(0.8333333)]
    for reward in (correctness_reward, proximity_reward):  # aliases would be compared as their text: never equal
        with pytest.raises(TypeError, match=rf"{reward.__name__} got the answer \['5', 'five'\], a list"):
            reward(["<answer>5</answer>"], [["5", "five"]])
