"""A decode step's few-row bf16 products on a CPU with AMX, in C (`cpu_linear.c`).

With bf16 rollout copies (`cpu_rollout_dtype`) a CPU decode step is mostly products of 1-16 rows by the copies, and
torch's kernels for them run well below the memory's speed: over the embedded default's 30 layers, 16 rows ~16 ms
where reading the copies once takes ~9 ms. The C kernel reads each weight once in its own layout with AMX tiles
(benchmarks/cpu_decode.py measures it in a rollout). `lora.skinny_linear` offers it beside torch's two ways of
multiplying a few rows and keeps whichever is fastest on this machine (`lora.ProductChoice`).

`cpu_linear.c` is compiled once per machine with the system's C compiler into grpo-nb's cache folder (with
`-march=native`: the library's name carries the CPU's flags) and checked once per process against `reference`.
Where the CPU has no AMX bf16 tiles (most laptops, AMD), Linux does not grant them, there is no compiler, or the
check fails, `linear` answers None and torch's products run: the same products, other roundings. Only a failed
check warns: a CPU without AMX is the common case. GRPO_NB_CPU_LINEAR=0 switches it off.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from pathlib import Path

import torch

from . import native

SOURCE = Path(__file__).with_name("cpu_linear.c")
MAX_ROWS = 64  # a decode step's rows: past them the product is a prefill's, torch's GEMM
# what holds its own memory (a bf16 model's head weight is a Parameter); subclasses such as FakeTensor may not
_PLAIN = (torch.Tensor, torch.nn.Parameter)

# GRPO_NB_CPU_LINEAR=0 (or false / off / no) switches it off; benchmarks set ENABLED to measure torch's products
ENABLED = os.environ.get("GRPO_NB_CPU_LINEAR", "1").strip().lower() not in ("0", "false", "off", "no")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-x", "c"]  # AMX needs -march=native
_lock = threading.Lock()
_function = None  # the loaded function; False when this machine cannot have it
_process = None  # the process Linux granted AMX's tiles to (a fork inherits the grant; asked again anyway)
why_not: str | None = None  # why not, once known


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in PyTorch: F.linear(x, weight, bias) with the sums in fp64 (autocast off), rounded
    once to x's dtype. The kernel's fp32 sums are within ~1e-6 of them, so its outputs are these or the bf16 value
    next to them - except near fp32's limits: AMX's arithmetic treats subnormal inputs, products and sums as zero
    (below ~1e-38, never an activation's size), and a sum past fp32's range is inf, as torch's bf16 product's."""
    with torch.autocast("cpu", enabled=False):
        out = x.double() @ weight.double().T
        return (out if bias is None else out + bias.double()).to(x.dtype)


def _load():
    from ..base_folder import cache_dir

    library = native.load(SOURCE, cache_dir() / "kernels", native.compiler("CC", ("cc", "gcc", "clang")), [_FLAGS],
                          [], native.cpu_tag())
    fn = library.linear_bf16
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    fn.restype = ctypes.c_int
    library.linear_ready.restype = ctypes.c_int
    return fn, library.linear_ready


def _ready(ready) -> bool:
    """Ask Linux for AMX's tiles in this process (a fork's child, say, if its grant were not inherited)."""
    global _process
    if ready() != 0:
        return False
    _process = os.getpid()
    return True


def _call(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    N, K = weight.shape
    rows = x if x.dim() == 2 else x.reshape(-1, K)
    if rows.stride(-1) != 1 or rows.stride(0) >= 2**26:  # the C code gathers rows by 32-bit byte offsets
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], N), dtype=x.dtype)  # a decode step calls this ~120 times: kept lean
    failed = fn(rows.data_ptr(), rows.stride(0), weight.data_ptr(), weight.stride(0),
                None if bias is None else bias.data_ptr(), out.data_ptr(), N, rows.shape[0], N, K,
                torch.get_num_threads())
    return None if failed else out


def _self_test(fn) -> bool:
    """The kernel against `reference`: 1-40 rows (one chunk of 16, several, a partial last one), an odd count of
    16-row weight blocks, strided rows, a weight that is a view with a longer row stride, with and without bias."""
    g = torch.Generator().manual_seed(0)
    cpu = dict(device="cpu")  # whatever the default device (meta would hand the kernel null pointers)
    for M, N, K, strided in ((1, 48, 64, False), (3, 32, 96, True), (16, 80, 576, False), (17, 16, 32, True),
                             (40, 96, 128, False)):
        weight = torch.randn(N, K + (32 if strided else 0), generator=g, **cpu).bfloat16()[:, :K]
        x = torch.randn(M, K + 7, generator=g, **cpu).bfloat16()[:, :K]
        if not strided:
            x = x.contiguous()
        for bias in (None, torch.randn(N, generator=g, **cpu).bfloat16()):
            got = _call(fn, x, weight, bias)
            want = reference(x, weight, bias).float()
            if got is None or got.dtype != torch.bfloat16:
                return False
            # the output's one rounding, or the sums' last fp32 bits tipping it to the next bf16 value
            if not torch.allclose(got.float(), want, rtol=2**-7, atol=1e-3):
                return False
    return True


@torch.compiler.disable  # built and checked eagerly, not traced
def available() -> bool:
    """Whether the kernel runs here: compiled (or found compiled), loaded, granted AMX and checked - once per
    process."""
    global _function, _process, why_not
    if type(torch.empty(0)) is not torch.Tensor:
        return False  # a FakeTensorMode (tracing): its tensors hold no memory to check with; asked again later
    if _function is None:
        with _lock:
            if _function is None:
                warn = False
                try:
                    fn, ready = _load()
                    code = ready()
                    if code:
                        why_not = ("this CPU or compiler has no AMX bf16 tiles" if code == 1 else
                                   "Linux did not grant this process AMX's tiles (arch_prctl; kernel 5.16+)")
                        ok = False
                    else:
                        _process = os.getpid()
                        ok = _self_test(fn)
                        why_not, warn = (None, False) if ok else ("its results differ from the PyTorch reference", True)
                except Exception as e:  # no compiler, a platform it does not build on
                    fn, ready, ok, why_not = None, None, False, f"{type(e).__name__}: {str(e)[:300]}"
                _function = (fn, ready) if ok else False  # decided before the warning, which may be an error
                if warn:
                    warnings.warn(f"grpo-nb's AMX products for CPU decode steps are not used ({why_not}); CPU "
                                  "rollouts use torch's products.", RuntimeWarning, stacklevel=3)
    return bool(_function)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` takes these operands (else the caller's torch product does): plain CPU bf16 tensors or
    Parameters (no other subclass - a FakeTensor says "cpu" and holds no memory), 1-MAX_ROWS rows, a weight of
    N % 16 == 0 rows of K % 32 == 0 contiguous columns, a contiguous bias of N, no gradient wanted."""
    if type(x) not in _PLAIN or type(weight) not in _PLAIN:
        return False
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or not x.is_cpu or not weight.is_cpu:
        return False
    if weight.dim() != 2 or x.dim() < 1:
        return False
    N, K = weight.shape
    if N == 0 or N % 16 or K == 0 or K % 32 or x.shape[-1] != K or weight.stride(1) != 1 or weight.stride(0) < K:
        return False
    if not 0 < x.numel() // K <= MAX_ROWS:
        return False
    if bias is not None and (type(bias) not in _PLAIN or bias.dtype != torch.bfloat16 or not bias.is_cpu
                             or bias.shape != (N,) or bias.stride(0) != 1):
        return False
    return not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad
                                               or (bias is not None and bias.requires_grad))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`reference`'s result from the C kernel ([..., N] bf16), or None where it does not run (switched off,
    `supports`, `available`)."""
    if not ENABLED or not supports(x, weight, bias) or not available():
        return None
    fn, ready = _function
    if _process != os.getpid() and not _ready(ready):
        return None
    return _call(fn, x, weight, bias)
