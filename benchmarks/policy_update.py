"""The GRPO policy update side by side: TRL's GRPOTrainer loss vs grpo-nb's, on one identical batch.

Same model (the embedded SmolLM2-135M-Instruct, or a random model built from a config),
same LoRA adapter, same gradient checkpointing, same completions (random tokens of forced
length, so both sides do the same work). Each implementation runs forward + backward of the
GRPO loss in its own fresh subprocess; we report the peak memory rise over the loaded model
and the time, plus their ratios.

    python benchmarks/policy_update.py [--completions 8] [--prompt-len 128] [--completion-len 512]
"""

from __future__ import annotations

import argparse
import json
import platform
import os
import subprocess
import sys
import time
from pathlib import Path

# Large allocations straight from mmap, so memory freed by torch goes back to the OS at once
# and the CPU's peak RSS follows the live tensors instead of glibc's cached heap.
MEASURE_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}

CODE = r"""
import json, sys, time, torch
impl, B, TP, TC = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
from grpo_nb import setup_reasoning_model, completion_logprobs, grpo_loss
model, tok = setup_reasoning_model(seed=0, max_seq_length=TP + TC)
cuda = next(model.parameters()).is_cuda
dev = next(model.parameters()).device
g = torch.Generator().manual_seed(0)
V = model.get_base_model().config.vocab_size
batch = {
    "prompt_ids": torch.randint(0, V, (B, TP), generator=g).to(dev),
    "prompt_mask": torch.ones(B, TP, dtype=torch.long, device=dev),
    "completion_ids": torch.randint(0, V, (B, TC), generator=g).to(dev),
    "completion_mask": torch.ones(B, TC, dtype=torch.long, device=dev),
    "advantages": torch.randn(B, generator=g).to(dev),
}
if impl == "trl":
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    args = GRPOConfig(output_dir="/tmp/bench_trl", report_to=[], per_device_train_batch_size=B, num_generations=B,
                      max_completion_length=TC, use_cpu=not cuda, bf16=False, gradient_checkpointing=False,
                      loss_type="dapo", beta=0.0, save_strategy="no")
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["hi"] * B}), processing_class=tok)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = dict(batch, num_items_in_batch=batch["completion_mask"].sum())
    step = lambda: trainer._compute_loss(trainer.model, inputs)
else:
    def step():
        lp = completion_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                 batch["completion_mask"])
        return grpo_loss(lp, None, None, batch["advantages"], batch["completion_mask"], loss_type="dapo")[0]
def peak():
    if cuda:
        return torch.cuda.max_memory_allocated()
    # VmHWM, not ru_maxrss: the latter starts from the parent's peak after fork+exec.
    return int([l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]) * 1024
import gc; gc.collect()
if cuda:
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
else:
    open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark
    import psutil; base = psutil.Process().memory_info().rss
t0 = time.perf_counter()
loss = step()
loss.backward()
if cuda:
    torch.cuda.synchronize()
seconds = time.perf_counter() - t0
print(json.dumps({"peak_extra_mib": (peak() - base) / 2**20, "seconds": seconds, "loss": float(loss)}))
"""


def run(impl, b, tp, tc):
    out = subprocess.run([sys.executable, "-c", CODE, impl, str(b), str(tp), str(tc)], env=MEASURE_ENV,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--completions", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--completion-len", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    import transformers
    import trl

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor() or 'x86_64'})"
    results = {"benchmark": "policy_update", "model": "SmolLM2-135M-Instruct (embedded), LoRA r=16 all-linear, "
               "gradient checkpointing", "device": device, "torch": torch.__version__,
               "transformers": transformers.__version__, "trl": trl.__version__,
               "date": time.strftime("%Y-%m-%d"), "runs": []}
    for tc in args.completion_len:
        row = {"completions": args.completions, "prompt_len": args.prompt_len, "completion_len": tc}
        for impl in ("trl", "grpo_nb"):
            row[impl] = run(impl, args.completions, args.prompt_len, tc)
            print(tc, impl, row[impl], flush=True)
        row["memory_ratio_trl_over_grpo_nb"] = round(row["trl"]["peak_extra_mib"] / row["grpo_nb"]["peak_extra_mib"], 2)
        row["time_ratio_trl_over_grpo_nb"] = round(row["trl"]["seconds"] / row["grpo_nb"]["seconds"], 2)
        row["loss_abs_diff"] = abs(row["trl"]["loss"] - row["grpo_nb"]["loss"])
        results["runs"].append(row)
    tag = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out or Path(__file__).parent / "results" / f"policy_update_{tag}.json")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["runs"], indent=1))


if __name__ == "__main__":
    main()
