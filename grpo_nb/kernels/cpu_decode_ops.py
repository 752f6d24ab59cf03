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


def reference_residual_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, the norm of it cast to bf16): h [n, D] fp32, delta [n, D] bf16 or None, weight [D] fp32."""
    if delta is not None:
        h = h + delta
    return h, F.rms_norm(h, h.shape[-1:], weight, eps).to(torch.bfloat16)


def reference_rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, H: int, KV: int,
                       head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k rotated, v) as [n, heads, head_dim] bf16 from one token's qkv [n, (H + 2 KV) head_dim] bf16; cos /
    signed_sin [n, head_dim] fp32 (the lean forward's `_rotary`: sin with its first half negated)."""
    n = qkv.shape[0]
    q, k, v = qkv.split([H * head_dim, KV * head_dim, KV * head_dim], dim=-1)
    c, s = cos[:, None], signed_sin[:, None]

    def rotate(x):
        x = x.float().view(n, -1, head_dim)
        return torch.addcmul(x * c, x.roll(head_dim // 2, -1), s).to(torch.bfloat16)

    return rotate(q), rotate(k), v.reshape(n, KV, head_dim)


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up in fp32, cast to bf16: gate_up [n, 2 I] bf16, gate first."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(torch.bfloat16)


def _load():
    from ..base_folder import cache_dir

    path = native.build(SOURCE, cache_dir() / "kernels", native.compiler("CC", ("cc", "gcc", "clang")),
                        [["-march=native", *_FLAGS], _FLAGS], ["-lm"], native.cpu_tag(),
                        (SOURCE.with_name("vector.h"),))
    library = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.residual_norm.argtypes = [ptr, ptr, i64, ptr, ctypes.c_float, ptr, i64, i64]
    library.rope_qkv.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64]
    library.silu_mul.argtypes = [ptr, i64, i64, ptr, i64]
    for fn in (library.residual_norm, library.rope_qkv, library.silu_mul):
        fn.restype = ctypes.c_int
    return library


def residual_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  library=None) -> torch.Tensor:
    """`reference_residual_norm` with h [n, D] updated in place (contiguous, fp32): the norm's bf16 rows."""
    library = library or _library
    n, D = h.shape
    out = torch.empty(n, D, dtype=torch.bfloat16)
    library.residual_norm(h.data_ptr(), None if delta is None else delta.data_ptr(),
                          0 if delta is None else delta.stride(0), weight.data_ptr(), eps, out.data_ptr(), n, D)
    return out


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, k_out: torch.Tensor,
             v_out: torch.Tensor, H: int, library=None) -> torch.Tensor:
    """`reference_rope_qkv`, k and v written into k_out / v_out [n, KV, head_dim] (a cache's new column, strided):
    q [n, H, 1, head_dim]."""
    library = library or _library
    n, KV, head_dim = k_out.shape
    q = torch.empty(n, H, 1, head_dim, dtype=torch.bfloat16)
    failed = library.rope_qkv(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), signed_sin.data_ptr(), cos.stride(0),
                              q.data_ptr(), k_out.data_ptr(), k_out.stride(0), k_out.stride(1), v_out.data_ptr(),
                              v_out.stride(0), v_out.stride(1), n, H, KV, head_dim)
    if failed:
        raise ValueError(f"rope_qkv takes an even head size, not {head_dim}")
    return q


def silu_mul(gate_up: torch.Tensor, library=None) -> torch.Tensor:
    """`reference_silu_mul`: [n, I] bf16."""
    library = library or _library
    n, I2 = gate_up.shape
    out = torch.empty(n, I2 // 2, dtype=torch.bfloat16)
    library.silu_mul(gate_up.data_ptr(), gate_up.stride(0), I2 // 2, out.data_ptr(), n)
    return out


def _self_test(library) -> bool:
    """Each call against its reference on odd sizes (a vector's 16 lanes and a tail), strided rows and columns."""
    g = torch.Generator().manual_seed(0)
    cpu = dict(device="cpu")  # whatever the default device (meta would hand the C code null pointers)

    def close(got, want, tol=2**-7):
        return got.dtype == want.dtype and torch.allclose(got.float(), want.float(), rtol=tol, atol=1e-3)

    for n, D in ((1, 40), (3, 64), (5, 576)):
        h = torch.randn(n, D, generator=g, **cpu) * 3
        delta = torch.randn(n, D + 8, generator=g, **cpu).bfloat16()[:, :D]
        weight = torch.rand(D, generator=g, **cpu) + 0.5
        for d in (None, delta):
            want_h, want = reference_residual_norm(h, d, weight, 1e-5)
            mine = h.clone()
            got = residual_norm(mine, d, weight, 1e-5, library)
            if not (torch.allclose(mine, want_h, rtol=1e-6, atol=1e-6) and close(got, want)):
                return False
    for n, H, KV, hd in ((1, 2, 1, 16), (3, 9, 3, 64), (2, 4, 4, 24)):
        qkv = torch.randn(n, (H + 2 * KV) * hd + 5, generator=g, **cpu).bfloat16()[:, :(H + 2 * KV) * hd]
        angles = torch.rand(n, hd // 2, generator=g, **cpu) * 6
        cos = torch.cat([angles.cos()] * 2, -1)
        sin = torch.cat([angles.sin()] * 2, -1)
        signed = torch.cat([-sin[:, :hd // 2], sin[:, hd // 2:]], -1)
        cache_k = torch.zeros(n, KV, 7, hd, dtype=torch.bfloat16)
        cache_v = torch.zeros_like(cache_k)
        q = rope_qkv(qkv, cos, signed, cache_k[:, :, 4], cache_v[:, :, 4], H, library)
        wq, wk, wv = reference_rope_qkv(qkv, cos, signed, H, KV, hd)
        if not (close(q.view(n, H, hd), wq) and close(cache_k[:, :, 4], wk) and torch.equal(cache_v[:, :, 4], wv)):
            return False
        if cache_k[:, :, :4].any() or cache_k[:, :, 5:].any() or cache_v[:, :, 5:].any():
            return False  # wrote past its column
    for n, I in ((1, 24), (4, 1536)):
        gate_up = (torch.randn(n, 2 * I + 3, generator=g, **cpu) * 4).bfloat16()[:, :2 * I]
        if not close(silu_mul(gate_up, library), reference_silu_mul(gate_up)):
            return False
    return True


@torch.compiler.disable  # built and checked eagerly, not traced
def available() -> bool:
    """Whether the calls run here: compiled (or found compiled), loaded and checked - once per process."""
    global _library, why_not
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
