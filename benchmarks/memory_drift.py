"""Does memory creep up over a long run? Many train() steps of the embedded default, memory per step.

Users of other GRPO stacks report memory that grows every step until an OOM hours in. This
runs `--steps` GRPO steps of the embedded SmolLM2-135M-Instruct (LoRA r=16, gradient
checkpointing, the native rollout engine, arithmetic prompts, short completions so that
steps are cheap) in a fresh process and records, after every step, what stays allocated
between steps: the record's `memory["current"]` (CUDA allocated on a GPU, resident memory on
the CPU) and the process's RSS (host memory, which matters on a GPU too: offload buffers). The figure of merit is the drift from step 10
(warm: allocator pools and caches filled) to the last step; the test suite holds the same
figure within 2% on a tiny model over 1000 steps (`tests/test_reliability.py`).

    python benchmarks/memory_drift.py                 # 1000 steps (hours on a CPU; minutes on a GPU)
    python benchmarks/memory_drift.py --steps 60      # shorter

Results: benchmarks/results/memory_drift_<cpu|cuda>.json (every step's numbers, device,
versions, settings) and a markdown line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, sys, tempfile
import torch
from grpo_nb import STARTER_REWARDS, arithmetic_dataset, setup_reasoning_model, train

spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"]) if spec["threads"] else None
model, tokenizer = setup_reasoning_model(None, max_seq_length=spec["max_seq_length"], lora_rank=16)
rss = []

def record_rss(record):
    rss.append(int(open("/proc/self/statm").read().split()[1]) * 4096)
    if record["step"] % 10 == 0:
        print(f"step {record['step']}: {record['memory']['current'] / 2**20:.1f} MiB, {record['step_time']:.1f} s",
              file=sys.stderr, flush=True)

with tempfile.TemporaryDirectory() as out:
    history = train(model, tokenizer, arithmetic_dataset(512, seed=0), STARTER_REWARDS,
                    output_dir=out, callbacks=[record_rss], verbose=False, live=False, **spec["train"])
print(json.dumps({
    "current": [r["memory"]["current"] for r in history],
    "peak": [r["peak_memory_bytes"] for r in history],
    "rss": rss,
    "step_time": [r["step_time"] for r in history],
    "reward": [r["reward"] for r in history],
}))
"""


def drift(values, at=10):
    return (values[-1] - values[at - 1]) / values[at - 1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--completion-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.steps < 20:
        ap.error("--steps must be at least 20: the drift is measured from step 10")

    settings = dict(max_steps=args.steps, num_generations=4, per_device_train_batch_size=4,
                    max_completion_length=args.completion_len, max_prompt_length=256, save_steps=0,
                    learning_rate=2e-5, seed=0)
    spec = {"max_seq_length": 256 + args.completion_len, "threads": args.threads, "train": settings}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps(spec)], stdout=subprocess.PIPE, text=True,
                          env=env)  # the worker's progress lines go straight to stderr
    if proc.returncode:
        sys.exit("worker failed (its error is above)")
    data = json.loads(proc.stdout.strip().splitlines()[-1])

    import torch
    import transformers

    import grpo_nb

    cuda = torch.cuda.is_available()
    current, rss = data["current"], data["rss"]
    summary = {
        "what": "memory left between steps (record memory['current']) and process RSS, step 10 vs the last step",
        "steps": len(current),
        "current_step10_mib": current[9] / 2**20, "current_last_mib": current[-1] / 2**20,
        "current_drift": drift(current),
        "current_max_after_step10_mib": max(current[9:]) / 2**20,
        # Between-step memory jumps with each step's shapes (the allocator keeps freed blocks); its
        # floor over the first and the last 20 steps shows a trend that single steps hide.
        "current_floor_first20_mib": min(current[:20]) / 2**20, "current_floor_last20_mib": min(current[-20:]) / 2**20,
        "rss_step10_mib": rss[9] / 2**20, "rss_last_mib": rss[-1] / 2**20, "rss_drift": drift(rss),
        "median_step_time_s": sorted(data["step_time"])[len(current) // 2],
        "wall_time_s": time.time() - t0,
    }
    result = {
        "summary": summary,
        "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores, {platform.processor()})",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "grpo_nb": grpo_nb.__version__, "python": platform.python_version()},
        "config": {"model": "embedded SmolLM2-135M-Instruct, LoRA r=16, gradient checkpointing", **spec},
        "per_step": data,
    }
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"memory_drift_{'cuda' if cuda else 'cpu'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    s = summary
    print(f"| {s['steps']} steps | {s['current_step10_mib']:,.1f} MiB | {s['current_last_mib']:,.1f} MiB | "
          f"{s['current_drift']:+.2%} | {s['rss_step10_mib']:,.1f} MiB | {s['rss_last_mib']:,.1f} MiB | "
          f"{s['rss_drift']:+.2%} | {s['median_step_time_s']:.2f} s |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
