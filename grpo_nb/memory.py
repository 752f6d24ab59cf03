"""Memory measurement for history records.

On CUDA: the allocator's peak since the last reset. On the CPU (Linux): the process's peak
resident set size since the last reset (VmHWM, reset through /proc/self/clear_refs); where
that cannot be reset, the peak over the process's life, an upper bound for the step.
"""

from __future__ import annotations

import resource
import sys

import torch


def _vm_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # high-water mark := current RSS
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _vm_hwm_bytes()
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB
