"""TRL's reward-function contract, case by case: rewards as float32 holds them, completions no function
scored, async reward functions, log_extra / log_metric, trainer_state, and weighted_reward's keywords.

Unit tests on the functions; the whole run is covered by the catalog (tests/test_bad_inputs.py,
section "reward values and TRL's reward contract")."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
import time
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch

from grpo_nb import GRPOConfig, RewardFunctionError, preview_rewards, weighted_reward
from grpo_nb.distributed import World
from grpo_nb.records import make_record
from grpo_nb.reward_calls import call_reward_funcs, is_async_reward
from grpo_nb.reward_contract import RewardLog
from grpo_nb.batch import StepBatch, StepMetrics
from grpo_nb.step import keep_informative_groups, reward_trainer_state
from grpo_nb.tracking import completion_rows, scalars
from grpo_nb.streaks import check_unscored_streak


def call(funcs, completions=("a", "b"), strict=True, **kwargs):
    n = len(completions)
    return call_reward_funcs(funcs, prompts=["p"] * n, completions=list(completions), completion_ids=[[1]] * n,
                             columns={}, strict=strict, **kwargs)


# ----------------------------------------------------------------------------------------
# Values as the float32 rewards tensor holds them


def test_values_beyond_float32_are_named_per_function_and_index():
    biggest = float(np.finfo(np.float32).max)
    assert call([lambda completions, **kw: [biggest, -biggest]])[0].rewards == [biggest, -biggest]  # the edge fits
    for value in (1e39, -1e39, 3.5e38):
        message = re.escape(f"'scale' returned {value:g} at index 1, beyond float32")
        with pytest.raises(RewardFunctionError, match=message):
            call([_named("scale", [0.0, value])])
    # In a tensor or an array too (float64 holds it; the rewards tensor would not).
    with pytest.raises(RewardFunctionError, match="index 0, beyond float32"):
        call([_named("scale", torch.tensor([1e39, 0.0], dtype=torch.float64))])
    [collected] = call([_named("scale", np.array([1e39, 1.0]))], strict=False)
    assert collected.notes[0].startswith("overflows float32") and collected.rewards[1] == 1.0
    assert math.isnan(collected.rewards[0])


def test_ints_too_big_for_a_float_are_a_contract_failure_not_an_overflow_error():
    with pytest.raises(RewardFunctionError, match=r"'count' returned an int of about 401 digits at index 1, too big"):
        call([_named("count", [1, 10**400])])
    with pytest.raises(RewardFunctionError, match="about 5001 digits"):  # str() of it would raise ValueError
        call([_named("count", [-10**5000, 1])])
    with pytest.raises(RewardFunctionError, match="a Fraction beyond any float at index 0"):
        call([_named("count", [Fraction(10**400, 3), 1])])
    with pytest.raises(RewardFunctionError, match="'count'"):  # inside weighted_reward, the part is named
        weighted_reward([_named("count", [10**400, 1])], [1.0])(completions=["a", "b"])
    table = preview_rewards(_named("count", [10**400, 1.5]), ["a", "b"])  # prototyping shows it in its cell
    assert table.scores["count"] == [None, 1.5] and "inf (too big for a float)" in table.text()


def test_zero_d_arrays_and_one_element_values_are_numbers():
    values = [np.array(1.0), np.array(2, dtype=np.int64), np.array([3.0]), torch.tensor(4.0), np.float32(5)]
    assert call([_named("f", values)], completions="abcde")[0].rewards == [1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(RewardFunctionError, match="not a number"):
        call([_named("f", [np.array("x"), 1.0])])


# What make_record needs of an update when the test is about the batch's scores.
NO_UPDATE = StepMetrics(loss=0.0, kl=0.0, clip_ratio=0.0, clip_ratio_low=0.0, clip_ratio_high=0.0, finite=True,
                        gradient_bytes=0, grad_norm=0.0)


def _named(name, values):
    def func(completions, **kwargs):
        return values
    func.__name__ = name
    return func


# ----------------------------------------------------------------------------------------
# Completions no reward function scored


def test_records_leave_unscored_completions_out_and_count_them():
    config = GRPOConfig(num_generations=2, per_device_train_batch_size=6, output_dir="unused", log_completions=True,
                        num_completions_to_print=6)
    nan = math.nan
    rewards_per_func = torch.tensor([[1.0, nan], [nan, 3.0], [nan, nan], [2.0, nan], [nan, nan], [nan, nan]])
    batch = StepBatch(torch.ones(6, 1, dtype=torch.long), torch.ones(6, 1, dtype=torch.long),
                      torch.ones(6, 2, dtype=torch.long), torch.ones(6, 2, dtype=torch.long),
                      torch.ones(6, 2, dtype=torch.long), None, 2, rewards_per_func=rewards_per_func,
                      rewards=torch.tensor([1.0, 3.0, nan, 2.0, nan, nan]), truncated=torch.zeros(6, dtype=torch.bool),
                      rows=[{"prompt": "p", "answer": "?"}] * 6, texts=list("abcdef"),
                      extras=[{"parsed": i} for i in range(6)], logged_metrics={"parsed_fraction": [0.5, 1.0]})
    batch = batch.with_advantages(config)
    assert batch.advantages.tolist()[2:] == [0.0] * 4  # one scored completion per group, or none: no signal
    assert batch.informative().tolist() == [True, False, False]
    record = make_record(1, batch, NO_UPDATE, config=config, reward_funcs=[_named("f", []), _named("g", [])],
                         lr=1e-3, step_time=1.0, device="cpu", memory={"peak": 0})
    assert record["reward"] == 2.0 and record["reward_std"] == 1.0  # over the 3 scored completions (TRL's nanmean)
    assert record["unscored_completions"] == 3 and record["frac_reward_zero_std"] == pytest.approx(2 / 3)
    assert record["rewards"]["g"] == {"mean": 3.0, "std": 0.0} and record["metrics"] == {"parsed_fraction": 0.75}
    assert record["samples"][4]["extra"] == {"parsed": 4} and math.isnan(record["samples"][4]["reward"])
    # The trackers: metrics as scalars, the extra column and "no score" (null) in the completions table.
    assert scalars(record)["metrics/parsed_fraction"] == 0.75 and scalars(record)["unscored_completions"] == 3
    rows = completion_rows(record)
    assert rows[2]["reward"] is None and rows[2]["parsed"] == 2
    assert json.loads(json.dumps(rows[2])) == rows[2]
    # The dashboard's traces show the logged column beside the scores.
    from grpo_nb_widgets import traces_html, traces_text
    assert "logged: parsed 0" in traces_text([record]) and "parsed: 0</span>" in str(traces_html([record]))


def test_unscored_steps_warn_once_then_stop_after_max_unscored_steps():
    config = GRPOConfig(max_unscored_steps=2, output_dir="unused")

    def record(step, reward, unscored):
        sample = {"prompt": "p", "completion": "c", "answer": "1/0", "rewards": {"acc": reward}, "reward": reward,
                  "advantage": 0.0, "extra": {}}
        return {"step": step, "reward": reward, "unscored_completions": unscored, "rewards": {"acc": {}},
                "samples": [sample]}

    warned, history = set(), [record(1, 1.0, 0)]
    check_unscored_streak(history, config, warned)  # all scored: nothing to say
    history.append(record(2, math.nan, 8))
    with pytest.warns(UserWarning, match=r"8 completion\(s\) of step 2 got no score.*acc.*answer='1/0'"):
        check_unscored_streak(history, config, warned)
    history.append(record(3, 1.0, 4))  # scored again: the streak is broken; no second warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_unscored_streak(history, config, warned)
        history.append(record(4, math.nan, 8))
        check_unscored_streak(history, config, warned)
        history.append(record(5, math.nan, 8))
        with pytest.raises(RewardFunctionError, match=r"last 2 step\(s\) \(4 to 5\).*max_unscored_steps=2"):
            check_unscored_streak(history, config, warned)


def test_evaluate_and_sample_and_score_take_a_batch_nobody_scored():
    from grpo_nb import evaluate, sample_and_score
    from grpo_nb.models import prepare_tokenizer
    from tiny_models import tiny_model, tiny_tokenizer

    model, tok = tiny_model("llama"), prepare_tokenizer(tiny_tokenizer())

    def never(completions, **kwargs):
        return [None] * len(completions)

    result = evaluate(model, tok, [{"prompt": "w5 w6", "answer": "1"}], [never], max_completion_length=3)
    assert math.isnan(result["rewards"]["never"]) and result["n"] == 1
    table = sample_and_score(model, tok, ["w5 w6"], [never], n=2, max_completion_length=3)
    assert table.totals == [None, None] and table.unscored == [True, True]
    assert any("no reward function scored them" in line for line in table.footer)


# ----------------------------------------------------------------------------------------
# Async reward functions


async def slow_one(completions, **kwargs):
    await asyncio.sleep(0.3)
    return [1.0] * len(completions)


class SlowJudge:
    async def __call__(self, completions, **kwargs):
        await asyncio.sleep(0.3)
        return [2.0] * len(completions)


def test_async_functions_are_awaited_together_also_where_a_loop_runs():
    assert is_async_reward(slow_one) and is_async_reward(SlowJudge()) and is_async_reward(
        functools.partial(slow_one)) and not is_async_reward(_named("f", []))

    def score():
        started = time.perf_counter()
        calls = call([slow_one, SlowJudge(), _named("plain", [3.0, 3.0])])
        return [c.rewards for c in calls], time.perf_counter() - started

    rewards, seconds = score()
    assert rewards == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]] and seconds < 0.55  # two 0.3 s functions at once

    async def notebook_cell():  # Jupyter: the main thread's loop is running while train() blocks in it
        return score()

    assert asyncio.run(notebook_cell())[0] == rewards


def test_async_functions_keep_the_timeout_and_the_failing_sample():
    async def stuck(completions, **kwargs):
        await asyncio.sleep(3)  # then it ends, on grpo-nb's loop, where the timed-out call left it

    with pytest.raises(RewardFunctionError, match="'stuck' did not return within reward_timeout=0.2"):
        call([stuck], timeout=0.2)

    async def parse(completions, **kwargs):
        return [float(c) for c in completions]

    with pytest.raises(RewardFunctionError, match=r"(?s)'parse' raised ValueError.*sample 1 of 2.*'x'"):
        call([parse], completions=["1", "x"])
    [collected] = call([parse], completions=["1", "x"], strict=False)
    assert collected.rewards[0] == 1.0 and "ValueError" in collected.errors[1]
    assert weighted_reward([slow_one, parse], [1.0, 2.0])(completions=["2"]) == [5.0]  # awaited inside it too


# ----------------------------------------------------------------------------------------
# log_extra and log_metric, trainer_state, weighted_reward's keywords


def test_log_extra_and_log_metric_collect_what_the_batch_call_logged():
    def logging(completions, log_extra, log_metric, **kwargs):
        if len(completions) > 1 and "x" in completions:
            raise ValueError("fails on the batch")
        log_extra("length", np.array([len(c) for c in completions]))
        log_metric("calls", torch.tensor(1.0))
        log_metric("calls", np.float32(3))
        return [0.0] * len(completions)

    log = RewardLog(2)
    call([logging], completions=["ab", "c"], log=log)
    assert log.extra == {"length": [2, 1]} and log.metrics == {"calls": [1.0, 3.0]}
    log = RewardLog(2)  # the batch call fails: one-at-a-time calls find where; what they log is not kept
    call([logging], completions=["ab", "x"], log=log, strict=False)
    assert log.extra == {} and log.metrics == {}

    def wrong(completions, log_extra, log_metric, **kwargs):
        log_metric("accuracy", "high")

    with pytest.raises(RewardFunctionError, match=r"log_metric\('accuracy', 'high'\) in reward function 'wrong'"):
        call([wrong])


def test_reward_trainer_state_is_transformers_trainer_state():
    from transformers import TrainerState

    config = GRPOConfig(max_steps=30, num_generations=4, per_device_train_batch_size=8, num_iterations=2,
                        logging_steps=5, save_steps=10, output_dir="unused")
    state = reward_trainer_state(config, 12, World(rank=1, size=2), dataset_size=40)
    # 2 prompts per rollout x 2 ranks, each rollout serving 2 steps: 2 prompts per step, 40 of them an epoch
    assert isinstance(state, TrainerState) and (state.global_step, state.max_steps) == (12, 30)
    assert (state.epoch, state.num_train_epochs) == (0.6, 2) and (state.logging_steps, state.save_steps) == (5, 10)
    assert state.train_batch_size == 8 and not state.is_world_process_zero


def test_weighted_reward_passes_each_function_only_what_it_accepts():
    def words(completions):
        return [float(len(c.split())) for c in completions]

    def matches(completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    combined = weighted_reward([words, matches, _named("rest", [1.0])], [1.0, 10.0, 0.5])
    n = 1
    [scored] = call_reward_funcs([combined], prompts=["p"] * n, completions=["4"], completion_ids=[[1]],
                                 columns={"answer": ["4"]}, trainer_state=object())
    assert scored.rewards == [11.5]


def test_step_batch_keeps_extras_and_metrics_through_dynamic_sampling():
    def part(rewards, extra, metric):
        n = len(rewards)
        ones = torch.ones(n, 2, dtype=torch.long)
        return StepBatch(ones, ones, ones, ones, ones, torch.zeros(n), 2, rewards=torch.tensor(rewards),
                         rewards_per_func=torch.tensor(rewards)[:, None], truncated=torch.zeros(n, dtype=torch.bool),
                         rows=[{"prompt": "p"}] * n, texts=["t"] * n, extras=[{"k": e} for e in extra],
                         logged_metrics={"m": [metric]})

    config = GRPOConfig(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        scale_rewards="none", output_dir="unused")
    batch = keep_informative_groups([part([1.0, 0.0, 3.0, 3.0], "abcd", 1.0), part([2.0, 2.0, 0.0, 4.0], "efgh", 3.0)],
                                    config)
    assert [e["k"] for e in batch.extras] == list("abgh") and batch.logged_metrics == {"m": [1.0, 3.0]}


# ----------------------------------------------------------------------------------------
# What each call is handed, what log_extra keeps, trainer_state outside train(), the shared event loop


def test_each_function_gets_its_own_copies_of_messages_lists_and_columns():
    prompts = [[{"role": "user", "content": "hi"}]] * 2
    completions = [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]]
    tags, ids = [["t"], ["t"]], [[1, 2], [3]]

    def edits(prompts, completions, completion_ids, tags, **kwargs):  # e.g. a strip() or an append done in place
        prompts[0][-1]["content"] += " w7"
        for c, t, i in zip(completions, tags, completion_ids):
            c[0]["content"] = c[0]["content"].upper()
            t.append("seen")
            i.clear()
        return [0.0] * len(completions)

    seen = []

    def reads(completions, completion_ids, tags, **kwargs):
        seen.append(([c[0]["content"] for c in completions], completion_ids, tags))
        return [0.0] * len(completions)

    call_reward_funcs([edits, reads, weighted_reward([edits, reads], [1.0, 1.0])], prompts=prompts,
                      completions=completions, completion_ids=ids, columns={"tags": tags})
    assert prompts[0] == [{"role": "user", "content": "hi"}] and tags == [["t"], ["t"]] and ids == [[1, 2], [3]]
    assert completions[0] == [{"role": "assistant", "content": "a"}]
    assert seen == [(["a", "b"], [[1, 2], [3]], [["t"], ["t"]])] * 2  # after edits, inside weighted_reward too


def test_log_extra_keeps_values_the_completions_table_can_store():
    class Tag:
        def __str__(self):
            return "tag"

    def logs(completions, log_extra, **kwargs):
        log_extra("n", [np.int64(3), torch.tensor(0.5)])  # what list(np.array(...)) and a tensor's items give
        log_extra("mixed", [np.bool_(True), Tag()])
        log_extra("odd", ["\ud800x", 10**5000])  # a lone surrogate, an int str() refuses
        return [0.0] * len(completions)

    log = RewardLog(2)
    call([logs], log=log)
    assert log.extra == {"n": [3, 0.5], "mixed": [True, "tag"], "odd": ["\\ud800x", "an int of about 5001 digits"]}
    assert type(log.extra["n"][0]) is int and json.loads(json.dumps(log.extra)) == log.extra


def test_log_extra_misuse_counts_the_batch_and_is_not_rerun_per_sample():
    def as_text(completions, log_extra, **kwargs):
        log_extra("x", "ab")
        return [0.0] * len(completions)

    def one_value(completions, log_extra, **kwargs):
        log_extra("tag", ["one"])
        return [0.0] * len(completions)

    for func, got in ((as_text, "got str"), (one_value, "got 1 values")):
        with pytest.raises(RewardFunctionError) as err:
            call([func], completions=list("abcdefgh"))
        assert f"{got}: pass a list with one value per completion (8)" in str(err.value)
        assert "sample" not in str(err.value) and "whole batch" not in str(err.value)
    [collected] = call([one_value], completions=list("abcd"), strict=False)
    assert collected.problem.startswith("raised LoggingError: log_extra('tag', values)") and "(4)" in collected.problem


def test_log_calls_after_the_function_returned_warn_instead_of_vanishing():
    kept = {}

    def leaves_a_thread(completions, log_extra, log_metric, **kwargs):
        kept.update(log_extra=log_extra, log_metric=log_metric)
        return [0.0] * len(completions)

    log = RewardLog(2)
    call([leaves_a_thread], log=log)
    with pytest.warns(UserWarning, match=r"log_metric\('late', ...\) in reward function 'leaves_a_thread' came after"):
        kept["log_metric"]("late", 1.0)
    with pytest.warns(UserWarning, match="the value is dropped"):
        kept["log_extra"]("late", [1, 2])
    assert log.metrics == {} and log.extra == {}


def test_trainer_state_is_passed_outside_train_too():
    from transformers import TrainerState

    states = []

    def curriculum(completions, trainer_state, **kwargs):
        states.append(trainer_state)
        return [trainer_state.global_step / trainer_state.max_steps for _ in completions]

    with pytest.raises(RewardFunctionError, match=r"(?s)ZeroDivisionError.*Outside train\(\).*max_steps=0"):
        call([curriculum])
    assert isinstance(states[0], TrainerState) and states[0].global_step == 0

    def reads_the_step(completions, trainer_state, **kwargs):
        return [float(trainer_state.global_step)] * len(completions)

    assert preview_rewards(reads_the_step, ["a"]).scores == {"reads_the_step": [0.0]}


def test_a_weighted_total_beyond_float32_is_refused_naming_the_weights():
    from grpo_nb.reward_calls import combine_rewards

    with pytest.raises(RewardFunctionError, match=r"completion 1 is 4e\+38.*\[2, 2\].*reward_weights=\[1e\+38, 1e\+38\]"):
        combine_rewards(torch.tensor([[0.0, 0.0], [2.0, 2.0]]), [1e38, 1e38])
    # summed in float64: products beyond float32 that cancel are fine, as is the float32 edge itself
    assert combine_rewards(torch.tensor([[3e38, -3e38]]), [2.0, 2.0]).tolist() == [0.0]
    biggest = float(np.finfo(np.float32).max)
    assert combine_rewards(torch.tensor([[biggest / 2, biggest / 2]])).tolist() == [biggest]


def test_weighted_reward_names_the_part_that_raised():
    def bad_on_b(completions, **kwargs):
        return [1 / 0 if c == "b" else 1.0 for c in completions]

    combined = weighted_reward([_named("fine", [1.0]), bad_on_b], [1.0, 2.0])
    with pytest.raises(RewardFunctionError, match=r"ZeroDivisionError: division by zero \(raised by 'bad_on_b', "
                                                  r"weight 2, inside weighted_reward\)"):
        call([combined])


def test_decimal_and_pandas_na_rewards():
    from decimal import Decimal

    pd = pytest.importorskip("pandas", reason="pandas comes with datasets")
    assert call([_named("f", [Decimal("1.5"), pd.NA])])[0].rewards[0] == 1.5  # a finite Decimal is a number
    assert math.isnan(call([_named("f", [Decimal("1.5"), pd.NA])])[0].rewards[1])  # NA: no score, like None
    with pytest.raises(RewardFunctionError, match="returned nan at index 0"):
        call([_named("f", [Decimal("NaN"), 1.0])])


def test_a_loaded_model_is_refused_as_a_reward_function():
    from grpo_nb.reward_contract import check_reward_funcs
    from tiny_models import tiny_model

    model = tiny_model("llama")
    for refused in (lambda: check_reward_funcs([model], ["prompt"]), lambda: preview_rewards(model, ["a"]),
                    lambda: weighted_reward([model], [1.0])):
        with pytest.raises(TypeError, match=r"(?s)<LlamaForCausalLM> is a loaded model.*def rm_reward"):
            refused()


def test_a_function_blocking_the_shared_loop_is_named_and_a_fresh_loop_serves_later_calls(monkeypatch):
    import threading

    from grpo_nb import reward_calls

    monkeypatch.setattr(reward_calls, "_LOOP_PROBE_S", 0.1)
    release = threading.Event()

    async def judge(completions, **kwargs):
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    async def blocking_judge(completions, **kwargs):
        release.wait(10)  # a synchronous call inside async def: the loop cannot run anything else
        return [1.0] * len(completions)

    try:
        with pytest.raises(RewardFunctionError) as err:
            call([judge, blocking_judge], timeout=0.6)
        message = str(err.value)
        assert "'judge', 'blocking_judge' did not return" in message and "asyncio.to_thread" in message
        assert "and 'blocking_judge' (line" in message  # the function holding the loop, not the first waited on
        started = time.perf_counter()
        assert call([SlowJudge()], timeout=5)[0].rewards == [2.0, 2.0]  # not stuck behind the blocked loop
        assert time.perf_counter() - started < 2
        interrupted = KeyboardInterrupt()  # Ctrl-C while waiting on a blocked loop: said, and replaced
        loop = reward_calls._event_loop()
        loop.call_soon_threadsafe(release.wait, 10)
        reward_calls._note_blocked_loop(interrupted)
        assert "blocked by" in interrupted.__notes__[0] and reward_calls._event_loop() is not loop
    finally:
        release.set()


# ----------------------------------------------------------------------------------------
# Odd reward values (probe round 2): read once, masked as no score, unreadable ones named, messages that fit


def test_a_value_is_read_once_and_numpys_masked_value_is_no_score():
    class Drifting(float):  # its float() is 1.0 twice, then inf: checked once, stored once
        reads = 0

        def __float__(self):
            Drifting.reads += 1
            return math.inf if Drifting.reads % 3 == 0 else 1.0

    with pytest.raises(RewardFunctionError, match=r"returned 1.0 \(Drifting, whose float\(\) is inf\) at index 2"):
        call([_named("drift", [Drifting(1.0)] * 3)], completions="abc")
    masked = np.ma.masked_invalid([np.nan, 2.0, np.nan])
    [result] = call([_named("parse", [masked[0], masked[1], np.ma.array([5.0], mask=[True])])], completions="abc")
    assert np.isnan(result.rewards).tolist() == [True, False, True] and result.rewards[1] == 2.0  # not 0.0
    assert result.notes == [None, None, None]  # "no score", like None


def test_values_that_cannot_be_read_are_named_with_the_function_and_index():
    from decimal import Decimal

    class Raising(int):
        def __float__(self):
            raise ValueError("no float here")

    class Lying(list):  # says 2, holds 3: counted by what is read
        def __len__(self):
            return 2

    for values, message in [
            ([Decimal("sNaN"), 1.0], r"returned Decimal\('sNaN'\) \(Decimal\) at index 0, which cannot be read as a "
                                     r"number \(ValueError: cannot convert signaling NaN"),
            ([1.0, Raising(1)], r"returned 1 \(Raising\) at index 1, which cannot be read as a number \(ValueError: no "
                                r"float here\)"),
            (Lying([1.0, 2.0, 3.0]), "returned 3 values for 2 completions"),
            ([Decimal("1e400"), 1.0], r"returned Decimal\('1E\+400'\) \(Decimal\) at index 0, too big for a float"),
            ([math.nan, 1.0], r"returned nan at index 0\. Rewards must be finite")]:
        with pytest.raises(RewardFunctionError, match=message):
            call([_named("f", values)])
    sympy = pytest.importorskip("sympy", reason="symbolic checkers return sympy numbers (installed with torch)")
    assert call([_named("f", [sympy.sqrt(4), sympy.Rational(1, 2)])])[0].rewards == [2.0, 0.5]  # float() reads them
    with pytest.raises(RewardFunctionError, match=r"returned oo \(Infinity, whose float\(\) is inf\) at index 0\. "
                                                  r"Rewards must be finite"):
        call([_named("f", [sympy.oo, 1.0])])
    with pytest.raises(RewardFunctionError, match=r"returned x \(Symbol\) at index 1, which cannot be read as a number"):
        call([_named("f", [1.0, sympy.Symbol("x")])])


def test_reward_function_names_are_always_text():
    from grpo_nb.reward_contract import reward_func_name

    class Judge:
        __name__ = 42  # a callable object whose __name__ is not text

        def __call__(self, completions, **kwargs):
            return [1.0] * len(completions)
    assert reward_func_name(Judge()) == "Judge" and call([Judge()])[0].name == "Judge"
    with pytest.raises(TypeError, match=r"weighted_reward\(name=7\) is invalid: expected a string"):
        weighted_reward([Judge()], [1.0], name=7)


def test_each_call_copies_values_nested_deep_or_holding_themselves():
    from grpo_nb.reward_calls import own_copies

    deep = leaf = []
    for _ in range(3000):  # a parse tree: deeper than Python's recursion limit
        leaf.append([])
        leaf = leaf[0]
    loop = {"name": "a"}
    loop["self"] = loop
    shared = [1]
    copied = own_copies({"tree": [deep], "doc": [loop], "pair": [(shared, shared)]})
    inner, original = copied["tree"][0], deep
    for _ in range(3000):
        assert inner is not original
        inner, original = inner[0], original[0]
    assert copied["doc"][0]["self"] is copied["doc"][0] is not loop  # a loop stays a loop, in the copy
    first, second = copied["pair"][0]
    assert first is second and first is not shared  # shared parts stay shared


def test_records_keep_what_the_views_show_and_what_the_rollouts_produced():
    from grpo_nb.records import MAX_SAMPLE_PROMPT, sample_of_row

    row = {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 1+3?"},
                      {"role": "assistant", "content": "<reasoning>\n"}],  # a prefill the model continues
           "answer": "4", "context": "x" * 5000, "id": 10**5000, "meta": [[1]], "completion": "stored"}
    assert sample_of_row(row) == {"answer": "4", "id": "an int of about 5001 digits", "prompt": "What is 1+3?",
                                  "prefill": "<reasoning>\n", "left_out": ["context (5,000 characters)"]}
    prompt = sample_of_row({"prompt": "d" * 10**6 + " question?"})["prompt"]
    assert prompt.startswith("[... 998,010 earlier characters cut]\n") and prompt.endswith(" question?")
    assert len(prompt) < MAX_SAMPLE_PROMPT + 50
    # dynamic sampling: the record says what every rollout produced beside the kept groups' values
    config = GRPOConfig(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        scale_rewards="none", output_dir="unused", log_completions=True, num_completions_to_print=1)

    def part(rewards):
        n = len(rewards)
        ones = torch.ones(n, 2, dtype=torch.long)
        return StepBatch(ones, ones, ones, ones, ones, torch.zeros(n), 2, rewards=torch.tensor(rewards),
                         rewards_per_func=torch.tensor(rewards)[:, None], truncated=torch.zeros(n, dtype=torch.bool),
                         rows=[row] * n, texts=["t"] * n)

    batch = keep_informative_groups([part([1.0, 1.0, 3.0, 3.0]), part([2.0, 2.0, 0.0, 4.0])], config)
    record = make_record(1, batch, NO_UPDATE, config=config, reward_funcs=[_named("f", [])], lr=1e-3, step_time=1.0,
                         device="cpu", memory={"peak": 0})
    assert record["reward"] == 1.5 and record["frac_reward_zero_std"] == 0.5  # kept: [0, 4], then [1, 1]
    assert record["rolled_out_reward"] == 2.0 and record["rolled_out_frac_reward_zero_std"] == 0.75
    assert record["rolled_out_groups"] == 4 and scalars(record)["rolled_out_frac_reward_zero_std"] == 0.75
    assert record["samples"][0]["prefill"] == "<reasoning>\n"
    assert list(completion_rows(record)[0])[:4] == ["step", "prompt", "prefill", "completion"]
