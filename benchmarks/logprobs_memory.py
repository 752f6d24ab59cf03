"""Peak memory of per-token log-probs: grpo-nb's chunked `selective_logprobs` vs full logits.

Each path runs forward + backward in a fresh subprocess; we report the rise of peak RSS
(CPU) or of the CUDA allocator's peak over what the inputs already use.

    python benchmarks/logprobs_memory.py [--rows 8192] [--vocab 49152] [--hidden 576] [--device cpu]
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
import sys, time, torch
from grpo_nb import selective_logprobs
path, rows, vocab, hidden, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
dtype = torch.float32 if device == "cpu" else torch.bfloat16
g = torch.Generator().manual_seed(0)
h = torch.randn(rows, hidden, generator=g).to(device, dtype).requires_grad_()
w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, dtype).requires_grad_()
t = torch.randint(0, vocab, (rows,), generator=g).to(device)
def peak():
    if device != "cpu":
        return torch.cuda.max_memory_allocated()
    # VmHWM, not ru_maxrss: the latter starts from the parent's peak after fork+exec.
    return int([l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]) * 1024
if device == "cpu":
    open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark
    import psutil; base = psutil.Process().memory_info().rss
else:
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
t0 = time.perf_counter()
if path == "chunked":
    lp = selective_logprobs(h, w, t)
else:
    lp = torch.log_softmax((h @ w.t()).float(), -1).gather(1, t[:, None]).squeeze(1)
lp.sum().backward()
if device != "cpu":
    torch.cuda.synchronize()
print(peak() - base, time.perf_counter() - t0)
"""


def measure(path, rows, vocab, hidden, device):
    out = subprocess.run([sys.executable, "-c", CODE, path, str(rows), str(vocab), str(hidden), device],
                         env=MEASURE_ENV, capture_output=True, text=True, check=True)
    extra, seconds = out.stdout.split()
    return int(extra), float(seconds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    result = {"benchmark": "logprobs_memory", "rows": args.rows, "vocab": args.vocab, "hidden": args.hidden,
              "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d")}
    for path in ("full_logits", "chunked"):
        extra, seconds = measure(path, args.rows, args.vocab, args.hidden, args.device)
        result[path] = {"peak_extra_mib": round(extra / 2**20, 1), "seconds": round(seconds, 2)}
        print(f"{path:12s} peak +{extra / 2**20:8.1f} MiB  {seconds:6.2f} s", flush=True)
    result["memory_ratio"] = round(result["full_logits"]["peak_extra_mib"] / result["chunked"]["peak_extra_mib"], 1)
    print(f"full logits need {result['memory_ratio']}x the memory of selective_logprobs")
    out = Path(args.out or Path(__file__).parent / "results" / f"logprobs_memory_{args.device}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
