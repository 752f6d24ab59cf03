"""Attention for one new token per row on the CPU: a decode step's, with grouped KV heads, in C (`cpu_attention.c`).

torch's CPU `scaled_dot_product_attention` computes a decode step's attention (one query per row and head) far from
the bytes it reads: at 16 rows of the embedded default (9 query heads over 3 KV heads of 64, ~290 cached columns,
30 layers, bf16) ~11 ms a step, a fifth of the step, where reading the keys and values takes ~4.5 ms. The C kernel
takes the keys in blocks and the values once for several heads (1.2-1.9x faster than SDPA; benchmarks/
cpu_decode_attention.py), and reads the columns every row shares - a prompt prefix the engine prefilled once and
repeated to every row - from one row: with the offline prompts' 191 shared columns of 290, 4.0 vs 8.2 ms at 16 rows
(a decode step 54.2 -> 48.3 ms, benchmarks/cpu_decode.py).

`cpu_attention.c` is compiled once per machine with the system's C compiler ($CC, else cc / gcc / clang) into
grpo-nb's cache folder (about a second, no torch headers; `-march=native`, so the library's name carries the CPU's
model and flags) and loaded with ctypes; it runs on torch's OpenMP threads. It is checked once against `reference`
(the same arithmetic in PyTorch). Where there is no compiler or OpenMP, or the check fails, `attention` answers None
(with one warning saying why) and the caller keeps torch's SDPA: the same attention, other roundings.
GRPO_NB_CPU_ATTENTION=0 switches it off.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from pathlib import Path

import torch

from . import native

SOURCE = Path(__file__).with_name("cpu_attention.c")
MAX_GROUP = 64  # query heads per KV head the C code holds
MAX_HEAD_DIM = 256

# GRPO_NB_CPU_ATTENTION=0 (or false / off / no) switches it off; benchmarks set ENABLED to measure SDPA
ENABLED = os.environ.get("GRPO_NB_CPU_ATTENTION", "1").strip().lower() not in ("0", "false", "off", "no")
_lock = threading.Lock()
_function = None  # the loaded function; False when this machine cannot have it
why_not: str | None = None  # why not, once known


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """What the kernel computes, in PyTorch: q [n, H, 1, D], k / v [n, KV, S, D], mask [n, 1, 1, S] booleans (True:
    attend) or None -> [n, H, 1, D] in q's dtype. The arithmetic in fp64 with autocast off, whatever the caller's
    numeric settings (a lower fp32 matmul precision, CPU autocast), so the reference is the exact one: the kernel's
    fp32 arithmetic is within ~1e-6 of it."""
    n, H, _, D = q.shape
    KV = k.shape[1]
    with torch.autocast("cpu", enabled=False):
        scores = (q.double().view(n, KV, H // KV, D) @ k.double().transpose(-1, -2)) * scale  # [n, KV, G, S]
        if mask is not None:
            scores = scores.masked_fill(~mask.view(n, 1, 1, -1), float("-inf"))
        p = torch.exp(scores - scores.amax(-1, keepdim=True))
        return ((p @ v.double()) / p.sum(-1, keepdim=True)).view(n, H, 1, D).to(q.dtype)


# where the C compiler is asked for by name (g++ would mangle the function's name: `-x c` keeps it C)
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-x", "c"]


def _load():
    from ..base_folder import cache_dir

    fn = native.load(SOURCE, cache_dir() / "kernels", native.compiler("CC", ("cc", "gcc", "clang")),
                     [["-march=native", *_FLAGS], _FLAGS], ["-lm"], native.cpu_tag(),
                     (SOURCE.with_name("vector.h"),)).decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr] * 5 + [i64] * 12 + [ctypes.c_float, ctypes.c_int, ctypes.c_int, i64]
    fn.restype = ctypes.c_int
    return fn


def _call(fn, q, k, v, mask, scale, shared):
    n, H, _, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    m = None if mask is None else mask.reshape(n, S)
    if m is not None and m.stride(-1) != 1:
        m = m.contiguous()
    failed = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), None if m is None else m.data_ptr(), out.data_ptr(),
                n, H, KV, S, D, *k.stride()[:3], *v.stride()[:3], 0 if m is None else m.stride(0), float(scale),
                int(q.dtype == torch.bfloat16), torch.get_num_threads(), int(shared))
    return None if failed else out


def _self_test(fn) -> bool:
    """The kernel against `reference`: both dtypes, grouped and plain heads, head sizes 64 and 128, strided caches,
    masks, column counts below, at and past a block of 16, shared columns."""
    g = torch.Generator().manual_seed(0)
    cpu = dict(device="cpu")  # whatever the default device (meta would hand the kernel null pointers)
    for dtype in (torch.float32, torch.bfloat16):
        for n, H, KV, S, D, shared in ((3, 6, 2, 37, 64, 0), (2, 4, 4, 5, 128, 0), (4, 9, 3, 50, 64, 20),
                                       (2, 14, 2, 16, 64, 16), (1, 8, 8, 33, 128, 0)):
            q = torch.randn(n, H, 1, D, generator=g, **cpu).to(dtype)
            k, v = (torch.randn(n, KV, S + 3, D, generator=g, **cpu).to(dtype)[:, :, :S] for _ in range(2))
            k[:, :, :shared], v[:, :, :shared] = k[:1, :, :shared].clone(), v[:1, :, :shared].clone()
            mask = torch.rand(n, 1, 1, S, generator=g, **cpu) < 0.7
            mask[..., -1] = True
            for m in (None, mask):
                got = _call(fn, q, k, v, m, D**-0.5, shared)
                want = reference(q, k, v, m, D**-0.5)
                tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's one rounding
                if got is None or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
                    return False
    return True


@torch.compiler.disable  # built and checked eagerly, not traced
def available() -> bool:
    """Whether the kernel runs here: compiled (or found compiled), loaded and checked - once per process."""
    global _function, why_not
    if type(torch.empty(0)) is not torch.Tensor:
        return False  # a FakeTensorMode (tracing): its tensors hold no memory to check with; asked again later
    if _function is None:
        with _lock:
            if _function is None:
                try:
                    fn = _load()
                    ok = _self_test(fn)
                    why_not = None if ok else "its results differ from the PyTorch reference"
                except Exception as e:  # no compiler, no OpenMP, a platform it does not build on
                    fn, ok, why_not = None, False, f"{type(e).__name__}: {str(e)[:300]}"
                _function = fn if ok else False  # decided before the warning, which may be raised as an error
                if not ok:
                    warnings.warn(f"grpo-nb's C attention for CPU decode steps is not used ({why_not}); CPU rollouts "
                                  "use torch's scaled_dot_product_attention (the same attention, slower at many "
                                  "rows).", RuntimeWarning, stacklevel=3)
    return bool(_function)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `attention` takes these operands (else the caller's SDPA does): plain CPU tensors (no subclass - a
    FakeTensor says "cpu" and holds no memory), bf16 or fp32, one query per row."""
    if any(type(t) is not torch.Tensor for t in (q, k, v) + (() if mask is None else (mask,))):
        return False
    if q.device.type != "cpu" or q.dim() != 4 or q.shape[2] != 1 or q.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (k.dtype == v.dtype == q.dtype and k.device.type == v.device.type == "cpu" and k.dim() == v.dim() == 4):
        return False
    n, H, _, D = q.shape
    if k.shape != v.shape or k.shape[0] != n or k.shape[3] != D or D % 16 or not 0 < D <= MAX_HEAD_DIM:
        return False
    if k.shape[2] == 0 or k.shape[1] == 0 or H % k.shape[1] or H // k.shape[1] > MAX_GROUP:
        return False
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (n, 1, 1, k.shape[2])):
        return False
    return not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float | None = None, shared: int = 0) -> torch.Tensor | None:
    """`reference`'s result from the C kernel, or None where it does not run (switched off, `supports`,
    `available`). `scale`: None for 1 / sqrt(head size), as SDPA. `shared`: how many first columns hold the same keys
    and values in every row (read from row 0). A row whose mask hides every column gets NaN (the lean forward's
    never does: each token sees itself)."""
    if not ENABLED or not supports(q, k, v, mask) or not available():
        return None
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _call(_function, q, k, v, mask, scale, max(0, min(int(shared or 0), k.shape[2])))
