"""The main job end to end, shortened: `grpo-nb demo --max-steps 1 --eval-size 2`."""

import json

from grpo_nb.cli import main


def test_demo_runs_and_writes_its_outputs(tmp_path, capsys):
    assert main(["demo", "--output-dir", str(tmp_path), "--max-steps", "1", "--eval-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "step    1/1 | reward" in out and "Before/after" in out and "held-out accuracy" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["eval_size"] == 2
    assert 0 <= summary["heldout_accuracy_before"] <= 1 and 0 <= summary["heldout_format_after"] <= 1
    png = (tmp_path / "reward_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    assert len(json.loads((tmp_path / "history.json").read_text())) == 1
