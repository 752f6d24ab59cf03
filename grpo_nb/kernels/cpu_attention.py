"""Attention for one new token per row on the CPU: a decode step's, with grouped KV heads, in C (`cpu_attention.c`).

torch's CPU `scaled_dot_product_attention` computes a decode step's attention (one query per row and head) far from
the bytes it reads: at 16 rows of the embedded default (9 query heads over 3 KV heads of 64, ~290 cached columns,
30 layers, bf16) ~11 ms a step, a fifth of the step, where reading the keys and values takes ~4.5 ms. The C kernel
takes the keys in blocks and the values once for several heads (1.2-1.9x faster than SDPA; benchmarks/
cpu_decode_attention.py), and reads the columns every row shares - a prompt prefix the engine prefilled once and
repeated to every row - from one row: with the offline prompts' 191 shared columns of 290, 6.0 vs 12.7 ms at 16 rows.

`cpu_attention.c` is compiled once per machine with the system's C compiler ($CC, else cc / gcc / clang) into
grpo-nb's cache folder (about a second, no torch headers; `-march=native`, so the library's name carries the CPU's
model and flags) and loaded with ctypes; it runs on torch's OpenMP threads. It is checked once against `reference`
(the same arithmetic in PyTorch). Where there is no compiler or OpenMP, or the check fails, `attention` answers None
(with one warning saying why) and the caller keeps torch's SDPA: the same attention, other roundings.
GRPO_NB_CPU_ATTENTION=0 switches it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_attention.c")
MAX_GROUP = 64  # query heads per KV head the C code holds
MAX_HEAD_DIM = 256

ENABLED = os.environ.get("GRPO_NB_CPU_ATTENTION", "1") != "0"  # benchmarks switch it off to measure SDPA
_lock = threading.Lock()
_function = None  # the loaded function; False when this machine cannot have it
why_not: str | None = None  # why not, once known


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """What the kernel computes, in PyTorch: q [n, H, 1, D], k / v [n, KV, S, D], mask [n, 1, 1, S] booleans (True:
    attend) or None -> [n, H, 1, D] in q's dtype, the arithmetic in fp32."""
    n, H, _, D = q.shape
    KV = k.shape[1]
    scores = (q.float().view(n, KV, H // KV, D) @ k.float().transpose(-1, -2)) * scale  # [n, KV, G, S]
    if mask is not None:
        scores = scores.masked_fill(~mask.view(n, 1, 1, -1), float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    return ((p @ v.float()) / p.sum(-1, keepdim=True)).view(n, H, 1, D).to(q.dtype)


def _cpu_tag() -> str:
    """What `-march=native` compiled for: the CPU's model and flags (a cache folder may be shared by machines)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = "".join(sorted({line for line in f if line.startswith(("model name", "flags", "Features"))}))
    except OSError:
        info = platform.processor()
    return f"{platform.machine()}|{info}"


def _build(folder: Path) -> Path:
    """The library's path, compiled into `folder` unless it is there; raises with the compiler's words."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang, or $CC)")
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + compiler.encode() + _cpu_tag().encode()).hexdigest()[:16]
    path = folder / f"cpu_attention-{tag}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = Path(tmp) / path.name
        errors = ""
        for arch in (["-march=native"], []):  # a compiler without -march=native still builds it
            result = subprocess.run([compiler, "-O3", *arch, "-fopenmp", "-fPIC", "-shared", str(SOURCE), "-o",
                                     str(out), "-lm"], capture_output=True, text=True, timeout=300)
            if result.returncode == 0:
                break
            errors = result.stderr.strip()[-300:]
        else:
            raise RuntimeError(f"{os.path.basename(compiler)} could not build it: {errors}")
        out.rename(path)  # atomic: a concurrent build never loads half a library
    return path


def _load():
    from ..base_folder import cache_dir

    fn = ctypes.CDLL(str(_build(cache_dir() / "kernels"))).decode_attention
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
    for dtype in (torch.float32, torch.bfloat16):
        for n, H, KV, S, D, shared in ((3, 6, 2, 37, 64, 0), (2, 4, 4, 5, 128, 0), (4, 9, 3, 50, 64, 20),
                                       (2, 14, 2, 16, 64, 16), (1, 8, 8, 33, 128, 0)):
            q = torch.randn(n, H, 1, D, generator=g).to(dtype)
            k, v = (torch.randn(n, KV, S + 3, D, generator=g).to(dtype)[:, :, :S] for _ in range(2))
            k[:, :, :shared], v[:, :, :shared] = k[:1, :, :shared].clone(), v[:1, :, :shared].clone()
            mask = torch.rand(n, 1, 1, S, generator=g) < 0.7
            mask[..., -1] = True
            for m in (None, mask):
                got = _call(fn, q, k, v, m, D**-0.5, shared)
                want = reference(q, k, v, m, D**-0.5)
                tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's one rounding
                if got is None or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
                    return False
    return True


def available() -> bool:
    """Whether the kernel runs here: compiled (or found compiled), loaded and checked - once per process."""
    global _function, why_not
    if _function is None:
        with _lock:
            if _function is None:
                try:
                    fn = _load()
                    ok = _self_test(fn)
                    why_not = None if ok else "its results differ from the PyTorch reference"
                except Exception as e:  # no compiler, no OpenMP, a platform it does not build on
                    fn, ok, why_not = None, False, f"{type(e).__name__}: {str(e)[:300]}"
                if not ok:
                    warnings.warn(f"grpo-nb's C attention for CPU decode steps is not used ({why_not}); CPU rollouts "
                                  "use torch's scaled_dot_product_attention (the same attention, slower at many "
                                  "rows).", RuntimeWarning, stacklevel=3)
                _function = fn if ok else False
    return bool(_function)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `attention` takes these operands (else the caller's SDPA does)."""
    if q.device.type != "cpu" or q.dim() != 4 or q.shape[2] != 1 or q.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (k.dtype == v.dtype == q.dtype and k.device.type == v.device.type == "cpu" and k.dim() == v.dim() == 4):
        return False
    n, H, _, D = q.shape
    if k.shape != v.shape or k.shape[0] != n or k.shape[3] != D or D % 16 or D > MAX_HEAD_DIM or k.shape[2] == 0:
        return False
    if H % k.shape[1] or H // k.shape[1] > MAX_GROUP or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (n, 1, 1, k.shape[2])):
        return False
    return not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              shared: int = 0) -> torch.Tensor | None:
    """`reference`'s result from the C kernel, or None where it does not run (switched off, `supports`,
    `available`). `shared`: how many first columns hold the same keys and values in every row (read from row 0).
    A row whose mask hides every column gets NaN."""
    if not ENABLED or not supports(q, k, v, mask) or not available():
        return None
    return _call(_function, q, k, v, mask, scale, max(0, min(int(shared), k.shape[2])))
