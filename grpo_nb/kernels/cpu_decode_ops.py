"""The steps between a CPU decode step's bf16 products, in C (`cpu_decode_ops.c`): one call each where the lean
forward ran several torch ops.

At a decode step's few rows a torch op costs more to dispatch (~5-10 us from Python) than to compute, and a layer of
the lean forward ran ~40 of them around its four products: the residual add, the norm and the cast of its rows to
bf16; splitting q / k / v, rotating q and k, casting them, writing k and v into the cache; SiLU(gate) * up and its
cast. `lean_forward` runs these three calls instead where a layer multiplies by fused bf16 copies (the default on
a CPU with bf16 support); each computes what its `reference_*` here computes - the lean forward's own torch ops.

Compiled once per machine beside `cpu_attention.c` (the same builder, no torch headers) and checked once per process
against the references. No compiler (the C attention warns of it), or a failed check (a warning): the lean forward's
torch ops, the same arithmetic. GRPO_NB_CPU_DECODE_OPS=0 switches it off.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from . import native

SOURCE = Path(__file__).with_name("cpu_decode_ops.c")

ENABLED = os.environ.get("GRPO_NB_CPU_DECODE_OPS", "1").strip().lower() not in ("0", "false", "off", "no")
_FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared", "-x", "c"]
_lock = threading.Lock()
_library = None  # the loaded library; False when this machine cannot have it
why_not: str | None = None


def reference_residual_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, the norm of it in `dtype` - the products' -): h [n, D] fp32, delta [n, D] or None, weight [D]
    fp32."""
    if delta is not None:
        h = h + delta
    return h, F.rms_norm(h, h.shape[-1:], weight, eps).to(dtype)


def reference_rope_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                       signed_sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k rotated, v) as [n, heads, head_dim] in q's dtype from one token's q [n, H head_dim], k / v [n, KV
    head_dim]; cos / signed_sin [n, head_dim] fp32 (the lean forward's `_rotary`: sin with its first half negated)."""
    n = q.shape[0]
    c, s = cos[:, None], signed_sin[:, None]

    def rotate(x):
        x = x.float().reshape(n, -1, head_dim)
        return torch.addcmul(x * c, x.roll(head_dim // 2, -1), s).to(q.dtype)

    return rotate(q), rotate(k), v.reshape(n, -1, head_dim)


def reference_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up in fp32, in gate's dtype: gate, up [n, I]."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def _load():
    from ..base_folder import cache_dir

    library = native.load(SOURCE, cache_dir() / "kernels", native.compiler("CC", ("cc", "gcc", "clang")),
                          [["-march=native", *_FLAGS], _FLAGS], ["-lm"], native.cpu_tag(),
                          (SOURCE.with_name("vector.h"),))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.residual_norm.argtypes = [ptr, ptr, i64, ptr, ctypes.c_float, ptr, i64, i64, ctypes.c_int]
    library.rope_qkv.argtypes = [ptr, i64] * 3 + [ptr, ptr, i64, ptr, ptr, i64, i64, ptr] + [i64] * 6 + [ctypes.c_int]
    library.silu_mul.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, ctypes.c_int]
    for fn in (library.residual_norm, library.rope_qkv, library.silu_mul):
        fn.restype = ctypes.c_int
    return library


# The calls below take what `lean_forward` hands them - CPU tensors whose last dimension is contiguous, bf16 or
# fp32 as the products' outputs are - and check nothing more: a decode step makes ~300 of them.

def residual_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  dtype: torch.dtype, library=None) -> torch.Tensor:
    """`reference_residual_norm` with h [n, D] (contiguous fp32) updated in place: the norm's rows."""
    library = library or _library
    n, D = h.shape
    out = torch.empty(n, D, dtype=dtype)
    library.residual_norm(h.data_ptr(), None if delta is None else delta.data_ptr(),
                          0 if delta is None else delta.stride(0), weight.data_ptr(), eps, out.data_ptr(), n, D,
                          dtype == torch.bfloat16)
    return out


def rope_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
             k_out: torch.Tensor, v_out: torch.Tensor, library=None) -> torch.Tensor:
    """`reference_rope_qkv` (q, k, v [n, heads * head_dim], views of one product's rows or three), k and v written
    into k_out / v_out [n, KV, head_dim] (a cache's new column, strided): q [n, H, 1, head_dim]."""
    library = library or _library
    n, KV, head_dim = k_out.shape
    H = q.shape[1] // head_dim
    out = torch.empty(n, H, 1, head_dim, dtype=q.dtype)
    failed = library.rope_qkv(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                              cos.data_ptr(), signed_sin.data_ptr(), cos.stride(0), out.data_ptr(), k_out.data_ptr(),
                              k_out.stride(0), k_out.stride(1), v_out.data_ptr(), v_out.stride(0), v_out.stride(1),
                              n, H, KV, head_dim, q.dtype == torch.bfloat16)
    if failed:
        raise ValueError(f"rope_qkv takes an even head size, not {head_dim}")
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, library=None) -> torch.Tensor:
    """`reference_silu_mul`: [n, I]."""
    library = library or _library
    n, I = gate.shape
    out = torch.empty(n, I, dtype=gate.dtype)
    library.silu_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), n, I,
                     gate.dtype == torch.bfloat16)
    return out


def _self_test(library) -> bool:
    """Each call against its reference, bf16 and fp32, on odd sizes (a vector's 16 lanes and a tail), strided rows
    (views of one product's rows), a cache's strided column."""
    g = torch.Generator().manual_seed(0)
    cpu = dict(device="cpu")  # whatever the default device (meta would hand the C code null pointers)

    def close(got, want):
        tol = 2**-7 if want.dtype == torch.bfloat16 else 1e-5
        return got.dtype == want.dtype and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)

    for dtype in (torch.bfloat16, torch.float32):
        for n, D in ((1, 40), (3, 64), (5, 576)):
            h = torch.randn(n, D, generator=g, **cpu) * 3
            delta = torch.randn(n, D + 8, generator=g, **cpu).to(dtype)[:, :D]
            weight = torch.rand(D, generator=g, **cpu) + 0.5
            for d in (None, delta):
                want_h, want = reference_residual_norm(h, d, weight, 1e-5, dtype)
                mine = h.clone()
                got = residual_norm(mine, d, weight, 1e-5, dtype, library)
                if not (torch.allclose(mine, want_h, rtol=1e-6, atol=1e-6) and close(got, want)):
                    return False
        for n, H, KV, hd in ((1, 2, 1, 16), (3, 9, 3, 64), (2, 4, 4, 24)):
            qkv = torch.randn(n, (H + 2 * KV) * hd + 5, generator=g, **cpu).to(dtype)
            q, k, v = qkv[:, :-5].split([H * hd, KV * hd, KV * hd], dim=-1)
            angles = torch.rand(n, hd // 2, generator=g, **cpu) * 6
            cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
            signed = torch.cat([-sin[:, :hd // 2], sin[:, hd // 2:]], -1)
            cache_k = torch.zeros(n, KV, 7, hd, dtype=dtype, **cpu)
            cache_v = torch.zeros_like(cache_k)
            got = rope_qkv(q, k, v, cos, signed, cache_k[:, :, 4], cache_v[:, :, 4], library)
            wq, wk, wv = reference_rope_qkv(q, k, v, cos, signed, hd)
            if not (close(got.view(n, H, hd), wq) and close(cache_k[:, :, 4], wk)
                    and torch.equal(cache_v[:, :, 4], wv)):
                return False
            if cache_k[:, :, :4].any() or cache_k[:, :, 5:].any() or cache_v[:, :, 5:].any():
                return False  # wrote past its column
        for n, I in ((1, 24), (4, 1536)):
            gate, up = (torch.randn(n, 2 * I + 3, generator=g, **cpu) * 4).to(dtype)[:, :2 * I].chunk(2, dim=-1)
            if not close(silu_mul(gate, up, library), reference_silu_mul(gate, up)):
                return False
    return True


@torch.compiler.disable  # built and checked eagerly, not traced
def available() -> bool:
    """Whether the calls run here: compiled (or found compiled), loaded and checked - once per process."""
    global _library, why_not
    if type(torch.empty(0)) is not torch.Tensor:
        return False  # a FakeTensorMode (tracing): its tensors hold no memory to check with; asked again later
    if _library is None:
        with _lock:
            if _library is None:
                warn = False
                try:
                    library = _load()
                    ok = _self_test(library)
                    why_not, warn = (None, False) if ok else ("its results differ from the PyTorch reference", True)
                except Exception as e:  # no compiler (cpu_attention, built the same way, says so), another platform
                    library, ok, why_not = None, False, f"{type(e).__name__}: {str(e)[:300]}"
                _library = library if ok else False  # decided before the warning, which may be raised as an error
                if warn:
                    warnings.warn(f"grpo-nb's C steps between a CPU decode step's products are not used ({why_not}); "
                                  "the lean forward runs torch's ops for them (the same arithmetic, slower).",
                                  RuntimeWarning, stacklevel=3)
    return bool(_library)
