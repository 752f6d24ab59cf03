"""The main job end to end, shortened: `grpo-nb demo --max-steps 1 --eval-size 2`."""

import json

from grpo_nb.cli import main


def test_demo_runs_and_writes_its_outputs(tmp_path, capsys):
    assert main(["demo", "--output-dir", str(tmp_path), "--max-steps", "1", "--eval-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "step    1/1 | reward" in out and "Before/after" in out and "Held-out accuracy on 2 problems" in out
    assert "(strict, p = " in out and "(lenient)" in out and "cut off at" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["eval_size"] == 2
    assert 0 <= summary["heldout_accuracy_before"] <= 1 and 0 <= summary["heldout_format_rate_after"] <= 1
    assert 0 <= summary["heldout_lenient_accuracy_after"] <= 1 and 0 <= summary["paired_p_strict"] <= 1
    low, high = summary["heldout_intervals_after"]["accuracy"]
    assert low <= summary["heldout_accuracy_after"] <= high
    png = (tmp_path / "reward_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    assert len(json.loads((tmp_path / "history.json").read_text())) == 1


def test_summary_lines_say_before_after_with_n_and_warn_on_truncation():
    from grpo_nb.demo import summary_lines

    def result(correct, truncated):
        from grpo_nb.evaluation import wilson_interval

        n = len(correct)
        rates = {"accuracy": sum(correct) / n, "lenient_accuracy": sum(correct) / n, "format_rate": 0.5,
                 "truncation_rate": truncated}
        return {**rates, "n": n, "correct": correct, "correct_lenient": correct,
                "intervals": {k: wilson_interval(round(v * n), n) for k, v in rates.items()}}

    lines = summary_lines(result([False] * 60 + [True] * 40, 0.1), result([False] * 30 + [True] * 70, 0.2), 48)
    assert len(lines) == 2 and "on 100 problems" in lines[0] and "40% (31%-50%) -> 70% (60%-78%)" in lines[0]
    assert "p = 1.9e-09" in lines[0] and "cut off at 48 tokens: 10% -> 20%" in lines[1]
    warned = summary_lines(result([True] * 10, 0.2), result([True] * 10, 0.8), 48)
    assert len(warned) == 3 and "raise max_completion_length" in warned[2]


def test_the_demo_folder_is_checked_before_the_model_loads(tmp_path, monkeypatch):
    import pytest

    import grpo_nb.demo as demo

    monkeypatch.setattr(demo, "setup_reasoning_model", lambda **kw: pytest.fail("the model was loaded"))
    for name in ("history.json", "summary.json", "reward_curve.png"):  # the user's own, at the demo's names
        (tmp_path / name).write_text("mine")
    with pytest.raises(ValueError, match=r"demo output_dir=.* holds other files \(history.json, reward_curve.png, "
                                         r"summary.json\), and the demo writes .* there"):
        demo.run_demo(tmp_path)
    assert all((tmp_path / name).read_text() == "mine" for name in ("history.json", "summary.json", "reward_curve.png"))
    summary = {"adapter": str(tmp_path / "adapter"), "reward_curve": str(tmp_path / "reward_curve.png"),
               "paired_p_strict": 0.5}
    (tmp_path / "summary.json").write_text(json.dumps(summary))  # a demo's own folder: run again into it
    demo.check_demo_folder(tmp_path)
    demo.check_demo_folder(tmp_path / "new")


def test_the_cli_refuses_odd_demo_arguments_before_any_work(tmp_path, monkeypatch, capsys):
    import pytest

    import grpo_nb.demo as demo
    from grpo_nb import cli

    monkeypatch.setattr(demo, "setup_reasoning_model", lambda **kw: pytest.fail("the model was loaded"))
    for argv, said in ((["--max-steps", "0"], "--max-steps: 0 is below 1"), (["--eval-size", "-5"], "-5 is below 1"),
                       (["--seed", "-1"], "--seed: -1 is below 0"), (["--output-dir", ""], "output_dir=''"),
                       (["--eval-size", str(10**9)], "at most 10,000 held-out problems"),
                       (["--long", "--max-steps", "5"], "--long runs 40 steps and --max-steps 5"),
                       (["--seed", str(2**63)], "--seed: 9223372036854775808 is too large"),  # torch's 64 bits
                       (["--output-dir", "~no_such_user_x/d"], "names no home folder"),
                       (["--output-dir", str(tmp_path / "file" / "d")], "cannot be made or written there")):
        (tmp_path / "file").write_text("")
        with pytest.raises(SystemExit):
            cli.main(["demo", *argv])
        assert said in capsys.readouterr().err, argv

    def read_only(*args, **kwargs):  # a folder that exists and cannot be written (root ignores chmod: stood in)
        raise PermissionError(13, "Permission denied")

    ran = []
    monkeypatch.setattr(demo, "run_demo", lambda out, **kw: ran.append(kw))
    for argv, steps in ((["--long"], demo.DEMO_LONG_STEPS), ([], demo.DEMO_STEPS), (["--max-steps", "3"], 3)):
        cli.main(["demo", "--output-dir", str(tmp_path / "d"), *argv])
        assert ran.pop()["max_steps"] == steps, argv

    monkeypatch.setattr(demo.tempfile, "TemporaryFile", read_only)
    with pytest.raises(SystemExit):
        cli.main(["demo", "--output-dir", str(tmp_path / "ro")])
    assert "cannot be made or written there (Permission denied)" in capsys.readouterr().err


def test_the_demo_says_its_sampled_truncation_in_place_of_the_trainers_warning():
    """The main job knowingly samples many completions past its cap at first (demo.py): train()'s warning would read
    as a fault there, so the demo filters that one warning - whose text CUT_WARNING must keep matching - and its
    summary gives the sampled share per step instead."""
    import re
    import warnings
    from types import SimpleNamespace

    import torch

    from grpo_nb.config import GRPOConfig
    from grpo_nb.demo import CUT_WARNING, summary_lines
    from grpo_nb.trainer import warn_once

    batch = SimpleNamespace(prompts_cut=0, truncated=torch.tensor([True] * 10 + [False] * 6), size=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_once(batch, GRPOConfig(), set())
    assert len(caught) == 1 and re.match(CUT_WARNING, str(caught[0].message))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=CUT_WARNING, category=UserWarning)
        warn_once(batch, GRPOConfig(), set())
    assert not caught

    result = {"accuracy": 0.5, "lenient_accuracy": 0.5, "format_rate": 0.5, "truncation_rate": 0.1, "n": 2,
              "correct": [True, False], "correct_lenient": [True, False],
              "intervals": {k: (0.1, 0.9) for k in ("accuracy", "lenient_accuracy")}}
    history = [{"truncated_fraction": f} for f in (0.3125, 0.625, 0.1875)]
    lines = summary_lines(result, result, 64, history)
    assert "Sampled completions (temperature 1) cut at 64 tokens during training: 31% at step 1, 62% at most, " \
           "19% at the last step." in lines
