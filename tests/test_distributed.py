"""Data parallel on the CPU: 2 gloo processes under torchrun equal one process with the same global batch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).resolve().parent / "ddp_worker.py"


def run_worker(out, processes, accumulation):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] \
        if processes > 1 else [sys.executable]
    done = subprocess.run([*launcher, str(WORKER), str(out), str(accumulation)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    single = run_worker(tmp_path_factory.mktemp("single"), 1, accumulation=2)  # 2 prompts x 4 in one process
    ranks_dir = tmp_path_factory.mktemp("ddp")
    ranks = run_worker(ranks_dir, 2, accumulation=1)  # 1 prompt x 4 on each of 2 ranks
    return single[0], ranks, ranks_dir


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_two_ranks_equal_one_process(runs, loss_type):
    single, ranks, _ = runs
    for rank in ranks:
        ours, theirs = rank[loss_type], single[loss_type]
        for a, b in zip(ours["history"], theirs["history"], strict=True):
            assert a.keys() == b.keys()
            for key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (loss_type, a["step"], key)
        for name, value in theirs["weights"].items():
            torch.testing.assert_close(torch.tensor(ours["weights"][name]), torch.tensor(value), atol=1e-6, rtol=1e-5)
    # Both ranks hold the same weights.
    assert ranks[0][loss_type]["weights"] == ranks[1][loss_type]["weights"]


def test_only_rank_zero_writes(runs):
    _, _, ranks_dir = runs
    out = ranks_dir / "dapo"
    assert (out / "checkpoint-2" / "trainer_state.pt").exists() and (out / "adapter_model.safetensors").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary folders left by a second writer


def test_resume_from_rank_zeros_checkpoint(runs):
    single, ranks, _ = runs
    assert single["resumed_steps"] == [1, 2, 3, 4]
    assert all(rank["resumed_steps"] == [1, 2, 3, 4] for rank in ranks)
