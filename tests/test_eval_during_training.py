"""Held-out evaluation during training: train(..., eval_dataset=heldout, eval_steps=N).

The records carry record["eval"] at the steps that evaluated (and record["eval_start"] with eval_on_start); an
evaluation changes nothing the run samples or trains; a resumed run keeps them and goes on evaluating; the trackers,
the checkpoints' schema, the dashboard's panel and the TRL callback read them.
"""

import math
import random
import re
import warnings
from types import SimpleNamespace

import pytest
import torch

from grpo_nb import train
from grpo_nb.checkpoint_schema import Refused, check_history
from grpo_nb.checkpointing import find_checkpoint
from grpo_nb.models import prepare_tokenizer
from grpo_nb.tracking import scalars
from grpo_nb_widgets import dashboard_html, eval_figure
from grpo_nb_widgets.dashboard import summary_line
from grpo_nb_widgets.trl_callback import GrpoNbDashboardCallback
from tiny_models import FAST, count_w7, dataset, lora_model, tiny_tokenizer

HELD_OUT = [{"prompt": "w5 w6", "answer": "7"}, {"prompt": "w8", "answer": "3"}, {"prompt": "w9 w10 w11", "answer": "1"}]


@pytest.fixture(scope="module")
def tok():
    return prepare_tokenizer(tiny_tokenizer())


def noisy_reward(completions, **kwargs):
    """A reward that draws from python's and torch's global generators: what an evaluation draws would shift every
    later training reward (and so the weights) unless the evaluation puts the random states back."""
    return [float(torch.rand(()).item() + 0.1 * random.random()) for _ in completions]


def run(tok, tmp_path, name="run", model=None, **settings):
    settings = {**FAST, "max_steps": 3, "verbose": False, "live": False, "output_dir": str(tmp_path / name),
                **settings}
    random.seed(0)  # train() seeds torch's generator; python's is the caller's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny model's completions all hit the length cap
        return train(model or lora_model(), tok, dataset(), [count_w7, noisy_reward], **settings)


def trained(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_records_carry_eval_at_the_steps_that_evaluated(tok, tmp_path):
    model = lora_model()
    history = run(tok, tmp_path, model=model, eval_dataset=HELD_OUT, eval_steps=2, eval_on_start=True)
    assert [("eval" in r, "eval_start" in r) for r in history] == [(False, True), (True, False), (True, False)]
    evaluation = history[1]["eval"]  # after step 2, then after the last step (3, not a multiple of 2)
    assert evaluation["n"] == 3 and set(evaluation["rewards"]) == {"count_w7", "noisy_reward"}
    for key in ("accuracy", "lenient_accuracy", "format_rate", "truncation_rate"):
        assert 0 <= evaluation[key] <= 1
        low, high = evaluation["intervals"][key]
        assert 0 <= low <= evaluation[key] <= high <= 1
    assert evaluation["mean_length"] > 0 and evaluation["seconds"] > 0
    assert "completions" not in evaluation and "correct" not in evaluation  # records stay small
    assert model.training  # back in train mode after each evaluation
    check_history(history, 3)  # what a checkpoint holds passes its own check


def test_an_evaluation_changes_nothing_the_run_samples_or_trains(tok, tmp_path):
    plain_model, evaluated_model = lora_model(), lora_model()
    plain = run(tok, tmp_path, "plain", model=plain_model)
    evaluated = run(tok, tmp_path, "evaluated", model=evaluated_model, eval_dataset=HELD_OUT, eval_steps=1,
                    eval_on_start=True)
    assert all("eval" in r for r in evaluated)
    for a, b in zip(plain, evaluated):  # the same rollouts, rewards (drawn from the global generators) and losses
        assert [s["completion"] for s in a["samples"]] == [s["completion"] for s in b["samples"]]
        assert a["rewards"] == b["rewards"] and a["loss"] == pytest.approx(b["loss"], abs=1e-7)
    ours, theirs = trained(plain_model), trained(evaluated_model)
    assert all(torch.allclose(ours[n], theirs[n], atol=1e-6) for n in ours)


def test_a_resumed_run_keeps_its_evaluations_and_goes_on_evaluating(tok, tmp_path):
    unbroken = run(tok, tmp_path, "unbroken", max_steps=4, eval_dataset=HELD_OUT, eval_steps=2)
    run(tok, tmp_path, "resumed", max_steps=2, save_steps=2, eval_dataset=HELD_OUT, eval_steps=2)
    resumed = run(tok, tmp_path, "resumed", max_steps=4, save_steps=2, eval_dataset=HELD_OUT, eval_steps=2,
                  resume_from_checkpoint=True)
    assert [r["step"] for r in resumed if "eval" in r] == [2, 4] == [r["step"] for r in unbroken if "eval" in r]
    for a, b in zip(unbroken, resumed):
        if "eval" in a:
            assert a["eval"]["accuracy"] == b["eval"]["accuracy"]
            assert a["eval"]["rewards"]["count_w7"] == pytest.approx(b["eval"]["rewards"]["count_w7"])


def test_ctrl_c_during_an_evaluation_stops_as_anywhere(tok, tmp_path):
    def stop_in_eval(completions, **kwargs):  # the held-out rows alone have a 3-token prompt "w9 w10 w11"
        if "w9 w10 w11" in kwargs["prompts"]:
            raise KeyboardInterrupt
        return [0.0] * len(completions)

    model = lora_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = train(model, tok, dataset(), [count_w7, stop_in_eval], **FAST, max_steps=3, verbose=False,
                        live=False, output_dir=str(tmp_path / "run"), eval_dataset=HELD_OUT, eval_steps=2)
    assert [r["step"] for r in history] == [1, 2] and "eval" not in history[-1]  # the step kept, not its eval
    assert find_checkpoint(True, tmp_path / "run").name == "checkpoint-2"
    assert model.training


def test_trackers_get_the_numbers_by_name():
    record = {"step": 3, "reward": 0.5, "eval": {"accuracy": 0.5, "lenient_accuracy": None, "n": 4,
                                                 "intervals": {"accuracy": [0.15, 0.85]}, "rewards": {"f": 0.25}},
              "eval_start": {"accuracy": 0.0, "n": 4, "intervals": {}, "rewards": {}}}
    names = scalars(record)
    assert names["eval/accuracy"] == 0.5 and names["eval/rewards/f"] == 0.25 and names["eval/n"] == 4.0
    assert names["eval_start/accuracy"] == 0.0
    assert "eval/lenient_accuracy" not in names  # None: no such accuracy (no point drawn at 0)


@pytest.mark.parametrize("garbage, field", [
    ({"n": 0}, "eval.n"), ({"n": 4, "accuracy": 1.5}, "eval.accuracy"), ({"n": 4, "accuracy": "50%"}, "eval.accuracy"),
    ({"n": 4, "intervals": {"accuracy": [0.9, 0.1]}}, "eval.intervals.accuracy"),
    ({"n": 4, "rewards": {"f": "high"}}, "eval.rewards.f"), ([0.5], "eval")])
def test_a_checkpoint_with_garbage_in_an_evaluation_is_refused(garbage, field):
    record = {"step": 1, "skipped_nonfinite": False, "reward": 0.0}
    check_history([{**record, "eval": {"n": 4, "accuracy": 0.5, "rewards": {"f": math.nan}}}], 1)
    with pytest.raises(Refused, match=rf"history\[0\]\.{re.escape(field)}"):
        check_history([{**record, "eval": garbage}], 1)


def eval_history():
    def evaluation(acc):
        return {"accuracy": acc, "lenient_accuracy": acc + 0.25, "n": 4, "format_rate": 0.5,
                "intervals": {"accuracy": [max(0, acc - 0.3), min(1, acc + 0.3)],
                              "lenient_accuracy": [max(0, acc - 0.05), min(1, acc + 0.5)]},
                "rewards": {"count_w7": acc / 2}}
    history = [{"step": s, "reward": 0.1 * s, "rewards": {"count_w7": {"mean": 0.1, "std": 0.0}}, "samples": []}
               for s in range(1, 5)]
    history[0]["eval_start"], history[1]["eval"], history[3]["eval"] = evaluation(0.0), evaluation(0.25), \
        evaluation(0.5)
    return history


def test_the_dashboard_draws_the_held_out_panel():
    fig = eval_figure(eval_history())
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.lines if line.get_gid()}
    assert list(lines["eval:accuracy"].get_xdata()) == [0, 2, 4]  # eval_start drawn before step 1
    assert list(lines["eval:lenient_accuracy"].get_ydata()) == [0.25, 0.5, 0.75]
    assert list(lines["eval:reward:count_w7"].get_ydata()) == [0.0, 0.125, 0.25]
    bands = {c.get_gid() for ax in fig.axes for c in ax.collections if c.get_gid()}
    assert {"eval:accuracy:interval", "eval:lenient_accuracy:interval"} <= bands
    assert 'alt="held-out evaluation"' in dashboard_html(eval_history())
    assert 'alt="held-out evaluation"' not in dashboard_html([{k: v for k, v in r.items() if "eval" not in k}
                                                             for r in eval_history()])
    assert "eval acc 50% (lenient 75%)" in summary_line(eval_history())
    assert eval_figure([{"step": 1}]).texts  # no evaluations: a message, not an error


def test_the_trl_callback_shows_trls_eval_logs():
    callback = GrpoNbDashboardCallback(live=False)
    args, control = SimpleNamespace(log_completions=False), SimpleNamespace()
    callback.on_log(args, SimpleNamespace(global_step=0), control,  # eval_on_start: no step logged yet
                    logs={"eval_loss": 0.0, "eval_reward": 0.2, "eval_rewards/org/rm/mean": 0.2, "epoch": 0.0})
    for step in (1, 2):
        callback.on_log(args, SimpleNamespace(global_step=step), control,
                        logs={"loss": 0.1, "reward": 0.5, "rewards/org/rm/mean": 0.5, "rewards/org/rm/std": 0.1})
    callback.on_log(args, SimpleNamespace(global_step=2), control,
                    logs={"eval_loss": 0.0, "eval_reward": 0.7, "eval_rewards/org/rm/mean": 0.7,
                          "eval_completions/mean_length": 12.0, "eval_runtime": 1.5})
    assert [(r["step"], "eval" in r) for r in callback.history] == [(0, True), (1, False), (2, True)]
    evaluation = callback.history[-1]["eval"]
    assert (evaluation["reward"], evaluation["rewards"], evaluation["mean_length"], evaluation["seconds"]) == (
        0.7, {"org/rm": 0.7}, 12.0, 1.5)
    fig = eval_figure(callback.history)
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.lines if line.get_gid()}
    assert list(lines["eval:reward"].get_ydata()) == [0.2, 0.7] and "eval:accuracy" not in lines
    assert callback.history[1]["reward"] == 0.5  # a training record is not changed by an evaluation


# --------------------------------------------------------------------------------------
# Memory, out of memory, data parallel, the eval set's checks


def test_each_evaluations_memory_peak_is_in_its_steps_record(tok, tmp_path):
    """record["memory"]["evaluation_peak"] where the step evaluated (eval_on_start's in step 1's), nowhere else; the
    memory view marks it as the run's peak when it is the highest."""
    history = run(tok, tmp_path, max_steps=4, eval_dataset=HELD_OUT, eval_steps=3, eval_on_start=True)
    assert [("eval_start" in r or "eval" in r, "evaluation_peak" in r["memory"]) for r in history] == [
        (True, True), (False, False), (True, True), (True, True)]
    assert all(r["memory"]["evaluation_peak"] > 2**20 for r in history if "evaluation_peak" in r["memory"])
    import grpo_nb.memory.tracker as tracker_mod
    from grpo_nb.memory import MemoryTracker, reset_peak_memory

    # The tracker's own logic on a stand-in peak counter: whether 64 MiB of real memory raises this process's RSS
    # depends on what the allocator still holds from earlier tests (in the full suite it did not).
    device = {"now": 100, "peak": 100}

    def reset(_):
        device["peak"] = device["now"]
        return True

    tracker = MemoryTracker(None, None, torch.device("cpu"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tracker_mod, "reset_peak_memory", reset)
        mp.setattr(tracker_mod, "peak_memory_bytes", lambda _: device["peak"])
        device["peak"] = 500  # a peak before the evaluation
        with tracker.measure_evaluation():
            device["peak"] = 164  # 64 more for a moment
        assert tracker.evaluation_peak == 164  # not the earlier 500
        tracker.evaluation_peak = 0
        with tracker.measure_evaluation():  # its own peak, not the one before it
            pass
        assert tracker.evaluation_peak == 100 and tracker.peaks_reset
    taken = {}
    tracker.take_evaluation_peak(taken)
    assert taken["evaluation_peak"] == 100 and tracker.evaluation_peak == 0
    assert reset_peak_memory("cpu") in (True, False)  # a device's name, as torch's own functions take it

    from grpo_nb_widgets import vram_figure

    # an OS that keeps the lifetime peak (CI's sandbox): the tracker says so in the record, the view on the peak
    kept = MemoryTracker(None, None, torch.device("cpu"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tracker_mod, "reset_peak_memory", lambda device: False)
        with kept.measure_evaluation():
            pass
    assert not kept.peaks_reset
    upper = {"step": 1, "memory": {"peak": 100 * 2**20, "base_weights": 50 * 2**20, "other": 50 * 2**20,
                                   "peaks_upper_bound": True}}
    (ax,) = vram_figure([upper]).axes
    assert [line.get_label() for line in ax.lines if line.get_gid() == "peak"] == [
        "run peak 100 MiB (at most: this OS keeps the process's peak)"]

    memory = {"peak": 100 * 2**20, "base_weights": 50 * 2**20, "other": 50 * 2**20}
    records = [{"step": 1, "memory": dict(memory, evaluation_peak=300 * 2**20)}, {"step": 2, "memory": memory}]
    (ax,) = vram_figure(records).axes
    (peak,) = [line for line in ax.lines if line.get_gid() == "peak"]
    assert list(peak.get_xdata()) == pytest.approx([300, 300]) and "(held-out evaluation)" in peak.get_label()
    (ax,) = vram_figure(records[1:]).axes
    assert [line.get_label() for line in ax.lines if line.get_gid() == "peak"] == ["run peak 100 MiB"]


@pytest.mark.parametrize("when", ["start", "after"])
def test_out_of_memory_in_an_evaluation_says_what_to_change(tok, tmp_path, monkeypatch, when):
    import grpo_nb.evaluation as evaluation_mod
    from grpo_nb.checkpointing import checkpoints

    real, calls = evaluation_mod.generate_and_judge, []

    def runs_out(*args, **kwargs):
        calls.append(1)
        if len(calls) == (1 if when == "start" else 2):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation_mod, "generate_and_judge", runs_out)
    with pytest.raises(torch.cuda.OutOfMemoryError) as err:
        run(tok, tmp_path, save_steps=0, eval_dataset=HELD_OUT, eval_steps=1, eval_on_start=when == "start",
            per_device_eval_batch_size=2)
    message = str(err.value)
    said = "before the first step" if when == "start" else "after step 2"
    assert f"Out of memory during the evaluation {said}." in message
    assert "lower per_device_eval_batch_size" in message and "per_device_eval_batch_size=2" in message
    assert "num_generations" not in message  # the training steps fit: their settings are not the advice
    assert "Tried to allocate 2.00 GiB" in message
    if when == "after":  # the step it followed is complete, and kept
        assert [p.name for p in checkpoints(tmp_path / "run")] == ["checkpoint-2"]


def test_data_parallel_ranks_evaluate_their_shares_of_the_whole_set(tmp_path):
    """2 gloo processes: each generates and judges its share of the 5 rows (2 and 3), and both record the whole set's
    numbers - those evaluate() gives in one process before training. Other eval rows on another rank, and fsdp=True
    (ranks would have to generate in lockstep), are refused on every rank."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from ddp_eval_worker import HELD_OUT as ROWS, WIDTH, model, squared_index, token_id_reward

    from grpo_nb import evaluate

    worker = Path(__file__).resolve().parent / "ddp_eval_worker.py"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(worker), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["seen"] for r in ranks] == [[100, 101] * 2, [102, 103, 104] * 2]  # before and after the step
    for key in ("eval_start", "eval"):
        ours, theirs = ({k: v for k, v in r[key].items() if k != "seconds"} for r in ranks)
        assert ours == theirs and ours["n"] == 5 and ours["rewards"]["squared_index"] == 6.0  # each row once
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = evaluate(model(), prepare_tokenizer(tiny_tokenizer()), ROWS, [token_id_reward, squared_index],
                         batch_size=1, max_completion_length=WIDTH, max_prompt_length=16)
    start = ranks[0]["eval_start"]
    assert start["rewards"] == pytest.approx(alone["rewards"]) and start["mean_length"] == alone["mean_length"]
    for key in ("accuracy", "lenient_accuracy", "format_rate", "truncation_rate"):
        assert start[key] == alone[key] and start["intervals"][key] == pytest.approx(alone["intervals"][key])
    assert all(r["evaluation_peak"] > 0 for r in ranks)
    for r in ranks:
        assert "different eval_dataset rows" in r["other_rows"] and "on rank 1" in r["other_rows"]
        assert "fsdp=True across processes is not supported" in r["fsdp"]


def test_the_eval_sets_errors_name_it_and_others_pass_through(tok, monkeypatch):
    """One checker for evaluate() and train(eval_dataset=...): the checks' own errors say "train(eval_dataset=...)"
    (a new error of the same kind, from the original); an error of another kind (a tokenizer's, a template's)
    keeps its type and message, with a note."""
    import grpo_nb.evaluation as evaluation_mod
    from grpo_nb import GRPOConfig

    model, config = lora_model(), GRPOConfig()
    with pytest.raises(ValueError, match=r"^train\(\) got an empty eval_dataset: pass at least one row"):
        evaluation_mod.checked_eval_dataset(model, tok, [], [count_w7], config, None)
    with pytest.raises(ValueError, match=r"^train\(eval_dataset=\.\.\.\): .*no 'prompt' column") as err:
        evaluation_mod.checked_eval_dataset(model, tok, [{"question": "w5"}], [count_w7], config, None)
    assert isinstance(err.value.__cause__, ValueError) and "train(eval_dataset" not in str(err.value.__cause__)

    class TemplateBroke(ValueError):
        def __init__(self, code):  # not a message: its args are not text to prefix
            super().__init__(code)

    for raised, args in ((RuntimeError("the tokenizer broke"), ("the tokenizer broke",)), (TemplateBroke(7), (7,))):
        def fails(*args, **kwargs):
            raise raised
        monkeypatch.setattr(evaluation_mod, "check_prompts", fails)
        with pytest.raises(type(raised)) as err:
            evaluation_mod.checked_eval_dataset(model, tok, HELD_OUT, [count_w7], config, None)
        assert err.value is raised and err.value.args == args  # not rewritten
        assert any("eval_dataset" in note for note in err.value.__notes__)
        with pytest.raises(type(raised)) as err:  # evaluate(): the same checker, its errors as they are
            evaluation_mod.evaluate(model, tok, HELD_OUT)
        assert err.value is raised


def test_eval_prompts_cut_said_once_a_run(tok, tmp_path):
    """Eval prompts longer than max_prompt_length are cut and said so once, not at every evaluation."""
    long_rows = [{"prompt": " ".join(f"w{4 + j % 40}" for j in range(30)), "answer": "1"}]
    settings = {**FAST, "max_steps": 3, "verbose": False, "live": False, "output_dir": str(tmp_path / "cut"),
                "eval_dataset": long_rows, "eval_steps": 1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = train(lora_model(), tok, dataset(), [count_w7], **settings)
    assert sum("eval" in r for r in history) == 3
    assert sum("train(eval_dataset=...)" in str(w.message) and "max_prompt_length" in str(w.message)
               for w in caught) == 1
