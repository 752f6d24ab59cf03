"""report_to (TensorBoard, W&B offline, Trackio) and log_completions_path, read back from what they wrote.

Each service's own files are read back (TensorBoard's event files, W&B's offline run file and
table files, Trackio's local database, the JSON lines) and matched to the history train() returns.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import pytest

import grpo_nb.trainer as trainer_mod
from grpo_nb import GRPOConfig, RewardFunctionError, train
from grpo_nb.tracking import completion_rows, markdown_table, scalars, tracker_names
from tiny_models import FAST, count_w7, dataset, lora_model

LOGGED = dict(FAST, verbose=False, live=False, num_completions_to_print=3)


def run(tok, tmp_path, reward=count_w7, **overrides):
    return train(lora_model(), tok, dataset(), [reward, length_reward],
                 **{**LOGGED, "output_dir": str(tmp_path / "out"), **overrides})


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def logged_steps(history, logging_steps):
    last = history[-1]["step"]
    return [r["step"] for r in history if r["step"] % logging_steps == 0 or r["step"] == last]


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def expected_rows(history, steps) -> list[dict]:
    return [row for r in history if r["step"] in steps for row in completion_rows(r)]


# ----------------------------------------------------------------------------- records to tracker data

def test_a_record_becomes_scalars_and_completion_rows():
    record = {"step": 7, "loss": 0.5, "skipped_nonfinite": False, "device": "cpu",
              "rewards": {"fmt": {"mean": 0.25, "std": 0.0}}, "memory": {"kv_cache": 1024, "peak": 4096},
              "samples": [{"prompt": "2+2?", "completion": "<answer>4</answer> | done\nok",
                           "rewards": {"fmt": float("nan"), "step": 1.0}, "reward": 1.0, "advantage": -0.5,
                           "answer": "4"}]}
    assert scalars(record) == {"loss": 0.5, "skipped_nonfinite": 0.0, "rewards/fmt/mean": 0.25,
                               "rewards/fmt/std": 0.0, "memory/kv_cache": 1024.0, "memory/peak": 4096.0}
    # NaN ("no score") is null in JSON; a reward function named like a fixed column does not overwrite it
    assert completion_rows(record) == [{"step": 7, "prompt": "2+2?", "completion": "<answer>4</answer> | done\nok",
                                        "fmt": None, "step (reward)": 1.0, "reward": 1.0, "advantage": -0.5}]
    table = markdown_table(completion_rows(record))
    assert "&lt;answer&gt;4&lt;/answer&gt; &#124; done<br>ok" in table and table.count("\n") == 2
    assert completion_rows({**record, "samples": []}) == []


def test_report_to_names_follow_transformers():
    assert tracker_names("none") == tracker_names(None) == tracker_names([]) == tracker_names(["none"]) == []
    assert tracker_names("wandb") == ["wandb"] and tracker_names(["tensorboard", "tensorboard"]) == ["tensorboard"]
    assert set(tracker_names("all")) <= {"tensorboard", "wandb", "trackio"}
    assert "tensorboard" in tracker_names(["all"])  # installed with the dev extra
    for good in ("tensorboard", ["wandb", "trackio"], ("tensorboard",), "all", "none", None):
        GRPOConfig(report_to=good)
    assert GRPOConfig(log_completions_path=Path("a/b.jsonl")).log_completions_path == "a/b.jsonl"  # JSON-able


def test_bad_tracking_settings_name_the_option(tmp_path):
    (tmp_path / "a_file").write_text("")
    (tmp_path / "gone").symlink_to(tmp_path / "missing")
    for settings, fragment in [
        (dict(report_to="tensorbord"), "Did you mean 'tensorboard'?"),
        (dict(report_to=["wandb", "mlflow"]), "'mlflow' is not a tracker grpo-nb reports to"),
        (dict(report_to="mlflow"), "callbacks=[fn]"),
        (dict(report_to=3), "expected a name or a list of names"),
        (dict(report_to=["wandb", None]), "expected a name or a list of names"),
        (dict(report_to=["all", "wandb"]), "stand alone"),
        (dict(log_completions_path=tmp_path), "this is a folder"),
        (dict(log_completions_path=str(tmp_path / "new_dir") + "/"), "this is a folder"),
        (dict(log_completions_path=""), "empty"),
        (dict(log_completions_path=3), "expected a path"),
        (dict(log_completions_path="c.jsonl", log_completions=False), "log_completions=True"),
        (dict(logging_dir=tmp_path / "a_file"), "this is a file"),
        (dict(logging_dir="/dev/null"), "this is not a folder"),
        (dict(logging_dir=tmp_path / "gone"), "which does not exist"),
        (dict(output_dir=str(tmp_path / "out\x00put")), "NUL character"),
        (dict(log_completions_path=str(tmp_path / "c\ud800.jsonl")), "lone surrogate"),
        (dict(run_name=""), "non-empty string"),
        (dict(project=3), "non-empty string"),
    ]:
        with pytest.raises(ValueError) as err:
            GRPOConfig(**settings)
        name = next(k for k in settings if k != "log_completions")
        assert f"GRPOConfig.{name}=" in str(err.value) and fragment in str(err.value), (settings, err.value)


def test_tensorboards_default_folder_is_never_made_through_a_link_and_its_name_is_bounded(tmp_path):
    from grpo_nb.tracking import TensorBoard, default_runs_folder

    pytest.importorskip("torch.utils.tensorboard", reason="tensorboard is in the dev extra")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "runs").symlink_to(tmp_path / "elsewhere")  # planted after train()'s own check
    with pytest.raises(ValueError, match=r"runs is a link, where TensorBoard's event files go.*logging_dir"):
        default_runs_folder(tmp_path / "out")
    assert not list((tmp_path / "elsewhere").iterdir())
    config = GRPOConfig(output_dir=str(tmp_path / "run"), report_to="tensorboard", run_name="r" * 300)
    board = TensorBoard(config, "20250101-000000-abcdef")  # a run name longer than a file name may be
    board.close()
    assert board.log_dir.name == "r" * 48 + "-20250101-000000-abcdef" and board.log_dir.is_dir()
    (tmp_path / "a_file").write_text("")
    config = GRPOConfig(output_dir=str(tmp_path / "run"), report_to="tensorboard", logging_dir=tmp_path / "a_file" / "tb")
    with pytest.raises(OSError, match=r"GRPOConfig.logging_dir=.*TensorBoard cannot make its folder"):
        TensorBoard(config, "20250101-000000-abcdef")  # when trackers start, before the first step


def test_a_missing_tracker_package_says_how_to_install_it_before_any_rollout(tok, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    rollouts = []
    monkeypatch.setattr(trainer_mod, "sample_batch", lambda *a, **k: rollouts.append(1))
    with pytest.raises(ImportError, match=r"report_to='wandb' needs the wandb package.*`pip install wandb`"):
        run(tok, tmp_path, max_steps=1, report_to=["tensorboard", "wandb"])
    assert not rollouts


def test_a_tracker_that_fails_to_start_is_named_and_the_ones_before_it_leave_nothing(tmp_path, monkeypatch):
    """A service library's own start failing (a Space that does not exist, no network): the error names report_to
    and chains the library's; TensorBoard, started before it, is closed and its new run folder removed."""
    from types import SimpleNamespace

    from grpo_nb.tracking import start_trackers

    error = RuntimeError("space not found")

    def init(**kwargs):
        raise error

    monkeypatch.setitem(sys.modules, "trackio", SimpleNamespace(init=init))
    config = GRPOConfig(output_dir=str(tmp_path / "run"), report_to=["tensorboard", "trackio"])
    with pytest.raises(RuntimeError, match=r"report_to='trackio': trackio could not start its run \(RuntimeError: "
                                           r"space not found\)") as err:
        start_trackers(config, "20250101-000000-abcdef")
    assert err.value.__cause__ is error
    assert not [p for p in (tmp_path / "run" / "runs").iterdir()]


# ----------------------------------------------------------------------------- TensorBoard and the JSON lines

def tensorboard_series(log_dir):
    """tag -> [(step, value)], read as TensorBoard's server reads event files (purged steps left out)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()

    def series(tag):
        values = [(e.step, make_ndarray(e.tensor_proto).item()) for e in events.Tensors(tag)]
        return [(step, v.decode() if isinstance(v, bytes) else v) for step, v in values]
    return series


def flaky_reward(fail_at_call):
    calls = []

    def count_w7(completions, **kwargs):  # the same name (and scores) as the healthy run's reward
        calls.append(1)
        if len(calls) >= fail_at_call:
            raise RuntimeError("the grader's server went away")
        return [float(c.split().count("w7")) for c in completions]
    return count_w7


def test_tensorboard_and_completions_file_survive_an_error_and_a_resume(tok, tmp_path):
    """A run that stops on an error still flushes both; resumed from an older checkpoint, it appends to the same
    TensorBoard folder and file, and what the first attempt logged after that checkpoint is replaced."""
    path = tmp_path / "logs" / "completions.jsonl"
    settings = dict(report_to="tensorboard", log_completions_path=str(path), logging_steps=2, run_name="my run/1")
    with pytest.raises(RewardFunctionError, match="went away"):
        run(tok, tmp_path, reward=flaky_reward(fail_at_call=5), max_steps=5, save_steps=2, **settings)
    (log_dir,) = (tmp_path / "out" / "runs").iterdir()
    assert log_dir.name.startswith("my-run-1-")
    first = read_lines(path)
    assert sorted({row["step"] for row in first}) == [2, 4]  # steps 1-4 trained, the error was in step 5's rollout
    series = tensorboard_series(log_dir)  # flushed and closed although the run stopped on an error
    assert [step for step, _ in series("loss")] == [step for step, _ in series("completions/text_summary")] == [2, 4]

    shutil.rmtree(tmp_path / "out" / "checkpoint-4")  # resuming behind a later checkpoint is refused: set it aside
    history = run(tok, tmp_path, max_steps=5, save_steps=2, resume_from_checkpoint=tmp_path / "out" / "checkpoint-2",
                  **settings)
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5]
    assert [p.name for p in (tmp_path / "out" / "runs").iterdir()] == [log_dir.name]  # the same run, appended to
    steps = logged_steps(history, 2)
    assert steps == [2, 4, 5]
    rows = read_lines(path)
    assert len({row.pop("run_id") for row in rows}) == 1
    assert rows == expected_rows(history, steps)  # the first attempt's step 4 was dropped, not kept twice
    assert set(rows[0]) == {"step", "prompt", "completion", "count_w7", "length_reward", "reward", "advantage"}

    series = tensorboard_series(log_dir)
    for tag, value in [("loss", lambda r: r["loss"]), ("reward", lambda r: r["reward"]),
                       ("rewards/count_w7/mean", lambda r: r["rewards"]["count_w7"]["mean"]),
                       ("memory/peak", lambda r: r["memory"]["peak"]),
                       ("memory/optimizer", lambda r: r["memory"]["optimizer"])]:
        got = series(tag)  # each step once: what the first attempt logged for step 4 is purged
        want = [(r["step"], float(value(r))) for r in history if r["step"] in steps]
        assert [s for s, _ in got] == steps and all(math.isclose(a[1], b[1], rel_tol=1e-6) for a, b in zip(got, want))
    texts = series("completions/text_summary")
    assert [step for step, _ in texts] == steps
    sample, last = history[-1]["samples"][0], texts[-1][1]
    assert f"| {sample['prompt']} |" in last and "| count_w7 |" in last


# ----------------------------------------------------------------------------- W&B, offline

def wandb_records(run_file: Path) -> list:
    """The records of a W&B run file (a LevelDB-style log of protobuf records in 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, out = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full, first | middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def finished_wandb_records(run_file: Path, wait_s: float = 60.0) -> list:
    """The run file's records once W&B's service process has written its last ("exit") record: run.finish()
    can return before that process has flushed the file (seen once on a loaded CI machine)."""
    deadline = time.monotonic() + wait_s
    while True:
        records = wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


@pytest.mark.parametrize("how", ["no_api_key", "WANDB_MODE=offline", "the_users_offline_run"])
def test_wandb_logs_offline_without_a_login(tok, tmp_path, monkeypatch, how):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (the dev extra has it): pip install wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))  # no saved settings,
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no ~/.netrc,
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # no key: never a login prompt
    if how == "no_api_key":
        monkeypatch.delenv("WANDB_MODE", raising=False)
        with pytest.warns(UserWarning, match="no W&B API key.*logs offline"):
            history = run(tok, tmp_path, max_steps=3, logging_steps=2, report_to="wandb", run_name="tiny")
    elif how == "WANDB_MODE=offline":
        monkeypatch.setenv("WANDB_MODE", "offline")
        history = run(tok, tmp_path, max_steps=3, logging_steps=2, report_to=["wandb"], project="grpo-nb-tests")
    else:  # a run the user started (wandb.init(mode="offline")) is logged to, and left for them to finish
        users_run = wandb.init(mode="offline", project="mine", dir=str(tmp_path))
        history = run(tok, tmp_path, max_steps=3, logging_steps=2, report_to="wandb", project="grpo-nb-tests")
        assert wandb.run is users_run and users_run.config["max_steps"] == 3
        users_run.finish()
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    (run_file,) = folder.glob("run-*.wandb")
    records = finished_wandb_records(run_file)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert len(runs) == 1, f"{run_file} holds records {[r.WhichOneof('record_type') for r in records]}"
    run_record = runs[0]
    assert {"no_api_key": run_record.display_name == "tiny",
            "WANDB_MODE=offline": run_record.project == "grpo-nb-tests",
            "the_users_offline_run": run_record.project == "mine"}[how]
    rows = []
    for record in (r for r in records if r.WhichOneof("record_type") == "history"):
        rows.append({})
        for item in record.history.item:  # a table's fields come as nested keys: ("completions", "path")
            *outer, key = [item.key] if item.key else item.nested_key
            target = rows[-1]
            for name in outer:
                target = target.setdefault(name, {})
            target[key] = json.loads(item.value_json)
    steps = logged_steps(history, 2)
    assert [row["_step"] for row in rows] == steps == [2, 3]
    for row, record in zip(rows, [r for r in history if r["step"] in steps]):
        assert math.isclose(row["loss"], record["loss"], rel_tol=1e-6)
        assert row["memory/peak"] == record["memory"]["peak"]
        assert math.isclose(row["rewards/length_reward/mean"], record["rewards"]["length_reward"]["mean"])
        table = json.loads((folder / "files" / row["completions"]["path"]).read_text())
        assert table["columns"] == list(completion_rows(record)[0])
        assert table["data"] == [list(r.values()) for r in completion_rows(record)]


# ----------------------------------------------------------------------------- Trackio, local

def test_trackio_logs_locally(tok, tmp_path, monkeypatch):
    folder = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(folder))  # read when trackio is imported...
    pytest.importorskip("trackio", reason="trackio is not installed (the dev extra has it): pip install trackio")
    # ...which another test (or a library) may have done already: its modules keep the folder as constants
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "trackio":
            for constant, under in (("TRACKIO_DIR", ""), ("MEDIA_DIR", "media"), ("ARTIFACTS_DIR", "artifacts")):
                if hasattr(module, constant):
                    monkeypatch.setattr(module, constant, folder / under if under else folder)
    monkeypatch.delenv("TRACKIO_SPACE_ID", raising=False)
    from trackio.sqlite_storage import SQLiteStorage

    history = run(tok, tmp_path, max_steps=3, logging_steps=2, report_to="trackio", project="grpo-nb-tests",
                  run_name="tiny")
    logs = SQLiteStorage.get_logs("grpo-nb-tests", "tiny")
    steps = logged_steps(history, 2)
    by_step = {}
    for entry in logs:
        by_step.setdefault(entry["step"], {}).update(entry)
    assert sorted(s for s in by_step if "loss" in by_step[s]) == steps
    for record in (r for r in history if r["step"] in steps):
        logged = by_step[record["step"]]
        assert math.isclose(logged["loss"], record["loss"], rel_tol=1e-6)
        assert logged["memory/peak"] == record["memory"]["peak"]
        assert logged["completions"]["_value"] == completion_rows(record)
    # where the README says it is (probe P29-12: it said output_dir/runs/, where Trackio writes nothing)
    assert list(folder.glob("grpo-nb-tests*")) and not (tmp_path / "out" / "runs").exists()
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "Trackio to its own folder\n(`$TRACKIO_DIR`, default `$HF_HOME/trackio`" in readme


def test_tensorboards_table_shows_the_text_as_written():
    text_plugin = pytest.importorskip("tensorboard.plugins.text.text_plugin",
                                      reason="renders the table as TensorBoard's text tab does (the dev extra)")
    import numpy as np

    completion = "<answer>2*3*4 = 24</answer> **bold** C:\\new\\_dir_ ![](http://x.example/p.png) `code`\r\nnext"
    rows = [{"step": 1, "prompt": "line one\rline two", "completion": completion, "a|b": 1.0, "_x_": 0.5}]
    shown = text_plugin.text_array_to_html(np.array(markdown_table(rows)), enable_markdown=True)
    assert not any(tag in shown for tag in ("<em>", "<strong>", "<img", "<code>", "<a ")), shown
    assert shown.count("<tr>") == 2 and shown.count("<td>") == 5 and shown.count("<th>") == 5  # no cell split
    assert "C:&#92;new&#92;&#95;dir&#95;" in shown and "2&#42;3&#42;4" in shown and "line one<br>line two" in shown
    assert "<th>a&#124;b</th>" in shown and "<th>&#95;x&#95;</th>" in shown


def test_a_resume_drops_this_runs_later_rows_whatever_line_separators_their_text_holds(tmp_path):
    from grpo_nb.tracking import drop_lines_after

    rows = [{"step": step, "prompt": "w5\x85w9\u2028w20\r", "run_id": "r"} for step in (1, 2, 3)]
    path = tmp_path / "c.jsonl"
    path.write_bytes("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8"))
    drop_lines_after(path, "r", 2)
    assert path.read_bytes().decode("utf-8").split("\n") == [json.dumps(r, ensure_ascii=False) for r in rows[:2]] + [""]


def test_a_run_sharing_the_completions_file_keeps_its_rows_when_another_resumes(tmp_path):
    """Runs may share log_completions_path; a resume rewrites the file (renamed over it, dropping its own later rows),
    and a run that kept the old file open went on appending to a file no name leads to: its later rows were lost."""
    from grpo_nb.tracking import CompletionsFile, drop_lines_after

    class Config:
        logging_steps, max_steps, log_completions_path = 1, 5, str(tmp_path / "shared.jsonl")

    def record(step):
        return {"step": step, "samples": [{"prompt": "w5", "completion": "w7", "rewards": {}, "reward": 1.0,
                                           "advantage": 0.0}]}

    logger = CompletionsFile(Config, "a")
    logger(record(1))
    drop_lines_after(tmp_path / "shared.jsonl", "b", 1)  # run b resumes at step 1, meanwhile
    logger(record(2))
    logger.close()
    assert [(row["run_id"], row["step"]) for row in read_lines(tmp_path / "shared.jsonl")] == [("a", 1), ("a", 2)]


def test_runs_sharing_a_logging_dir_each_keep_their_curves(tmp_path):
    """logging_dir="./logs" for every experiment (HF's habit): each run writes a folder of its own there, so a second
    run's start (or a resume's purge of its own later steps) never hides another run's curves in TensorBoard."""
    pytest.importorskip("torch.utils.tensorboard", reason="tensorboard is in the dev extra")
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    from grpo_nb.tracking import TensorBoard

    def logged(run_id, steps, resumed_step=0):
        config = GRPOConfig(output_dir=str(tmp_path / run_id), report_to="tensorboard", logging_dir=tmp_path / "logs",
                            max_steps=3)
        board = TensorBoard(config, run_id, resumed_step)
        for step in steps:
            board({"step": step, "reward": float(step) + (10 if resumed_step else 0)})
        board.close()

    first, second = "20250101-000000-aaaaaa", "20250101-000001-bbbbbb"
    logged(first, [1, 2, 3])
    logged(second, [1, 2])  # another experiment, same logging_dir
    # TensorBoard orders a folder's event files by name: the time in seconds, then a per-process counter compared as
    # text ("10" < "9"), so a resume in the same second could sort first. A real resume is seconds later.
    time.sleep(1.05)
    logged(first, [3], resumed_step=2)  # the first one resumed at step 2: its step 3 trained again
    runs = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "logs"))
    runs.Reload()
    curves = {run: [(e.step, float(e.tensor_proto.float_val[0])) for e in runs.Tensors(run, "reward")]
              for run in runs.Runs()}
    assert curves == {first: [(1, 1.0), (2, 2.0), (3, 13.0)], second: [(1, 1.0), (2, 2.0)]}
