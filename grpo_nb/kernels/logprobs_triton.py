"""Triton kernels for `selective_logprobs`: log-probs of sampled tokens without [N, V] logits.

Computes, for every row n,

    logp[n] = z[n, tok[n]] - logsumexp_v z[n, v],   z = transform(h @ W.T) / temperature,
    transform(x) = tanh(x * scale / softcap) * softcap   (or x * scale without a soft-cap),

and its gradients in `h` and `W`. The PyTorch code in `grpo_nb/logprobs.py` is the reference;
this file must match it.

Forward (`_fwd_kernel`): a program owns BLOCK_M rows and a contiguous slice of the vocabulary.
It walks that slice BLOCK_V columns at a time, builds each logits tile with a K-loop over the
hidden size (tl.dot, fp32 accumulation), applies the transform and keeps an online
(streaming) max / sum-exp, and picks out the sampled token's logit when it falls in the tile.
It writes three floats per (row, slice); a few torch ops merge the slices into lse and logp.
Splitting the vocabulary into slices is there for occupancy: with BLOCK_M = 128 a batch of
4,096 rows is only 32 row blocks, too few programs for a GPU's 100+ SMs, and one program
walking 151,936 columns alone would run far longer than the rest. The slice count depends
on the number of SMs, never on V, so the scratch is [N, slices] and not [N, V].

Backward (`_bwd_kernel`, Cut-Cross-Entropy style): a program owns one [BLOCK_M, BLOCK_V] tile.
It recomputes the logits tile from h and W (once: O(1) recompute per tile), forms

    dz = g * (onehot(tok) - exp(z - lse)) / temperature * (1 - tanh^2) * scale

in registers and, looping over the hidden size, atomically adds dz @ W[vtile] into an fp32
grad_h [N, H] and dz^T @ h[mtile] into an fp32 grad_W [V, H]. The atomics are what keeps the
recompute at one logits tile per (row block, vocab block): an atomic-free grad_h would need
each program to own whole rows of grad_h, i.e. either a [BLOCK_M, H] accumulator (too big for
registers at H = 1536+) or one pass over the vocabulary per hidden-dim block (recomputing the
logits H / BLOCK_K times), or storing dz, which is [N, V]. The price is that fp32 addition
order varies from run to run: gradients are not bitwise deterministic (errors ~1e-7 relative).

Scratch: forward [N, slices] x 3 floats; backward the fp32 gradient buffers, which are
the size of the inputs (the reference keeps an fp32 grad_W too). Nothing scales with N * V.

The kernels run on the CPU under `TRITON_INTERPRET=1` (set before this module is imported),
which is how the tests check them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import on_device, triton_interpreted

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Defaults sized for an H100 / A100 (bf16 tensor cores, >= 164 KiB of shared memory per SM):
# 128 x 128 logits tiles (64 fp32 registers per thread at 8 warps) and 64-wide K steps.
# No autotuning: the backward kernel accumulates with atomics, so every autotune trial would
# add into the gradients again, and one fixed config keeps the interpreter tests simple.
DEFAULT_BLOCK_M = 128
DEFAULT_BLOCK_V = 128
DEFAULT_BLOCK_K = 64
NUM_WARPS = 8
GROUP_M = 8  # backward: row blocks that walk the vocabulary together (W tiles stay in L2)
# The dots use input_precision="ieee": fp32 inputs then match torch's default fp32 matmul
# (TF32 would cost ~1e-3 relative); bf16 / fp16 products are exact either way and still run
# on tensor cores. Every backend accepts "ieee" ("tf32" is NVIDIA-only).


# --------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _tanh(x):
    # triton.language has no tanh of its own (only the backend-specific libdevice one, which
    # the interpreter lacks); this exp form never overflows (exp of a non-positive number) and
    # is exact to ~1e-7 absolute.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # UPCAST is only set under the CPU interpreter for bf16: its tl.dot multiplies bf16's raw
    # uint16 storage (numpy has no bf16). bf16 -> fp32 is exact, so the result is the same as
    # the GPU's bf16 tensor-core product with fp32 accumulation.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _logits_tile(h_ptr, w_ptr, offs_m, offs_v, row_ok, col_ok, D, stride_h, stride_w,
                 scale, softcap, temperature,
                 HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_V] tile of transform(h @ W.T) / temperature, -inf past the vocab.

    Also returns tanh(pre / softcap) (the soft-cap derivative needs it; unused without one).
    """
    offs_k = tl.arange(0, BLOCK_K)
    # int64 row offsets: V * H passes 2**31 for large vocabularies x wide models.
    h_rows = h_ptr + offs_m.to(tl.int64)[:, None] * stride_h
    w_rows = w_ptr + offs_v.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < D
        a = tl.load(h_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += _dot(a, tl.trans(b), UPCAST)
    z = acc * scale
    t = z
    if HAS_SOFTCAP:
        t = _tanh(z / softcap)
        z = t * softcap
    z = z / temperature
    z = tl.where(col_ok[None, :], z, float("-inf"))
    return z, t


@triton.jit
def _fwd_kernel(h_ptr, w_ptr, tok_ptr, max_ptr, sum_ptr, tgt_ptr,
                N, V, D, stride_h, stride_w, v_per_split, n_splits,
                scale, softcap, temperature,
                HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)  # which vocabulary slice
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N
    tok = tl.load(tok_ptr + offs_m, mask=row_ok, other=-1).to(tl.int32)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max
    s_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # running sum of exp(z - m_i)
    z_tok = tl.zeros((BLOCK_M,), dtype=tl.float32)  # the sampled token's logit, if in this slice
    v_lo = pid_s * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        col_ok = offs_v < v_hi
        z, _t = _logits_tile(h_ptr, w_ptr, offs_m, offs_v, row_ok, col_ok, D, stride_h, stride_w,
                             scale, softcap, temperature, HAS_SOFTCAP, UPCAST,
                             BLOCK_M, BLOCK_V, BLOCK_K)
        # Every tile has a valid column, so m_new is finite and exp(-inf - m_new) = 0 on the
        # first tile and on the masked columns.
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m_i = m_new
        z_tok += tl.sum(tl.where(offs_v[None, :] == tok[:, None], z, 0.0), axis=1)

    out = offs_m.to(tl.int64) * n_splits + pid_s
    tl.store(max_ptr + out, m_i, mask=row_ok)
    tl.store(sum_ptr + out, s_i, mask=row_ok)
    tl.store(tgt_ptr + out, z_tok, mask=row_ok)


@triton.jit
def _bwd_kernel(h_ptr, w_ptr, tok_ptr, lse_ptr, g_ptr, gh_ptr, gw_ptr,
                N, V, D, stride_h, stride_w,
                scale, softcap, temperature,
                HAS_SOFTCAP: tl.constexpr, NEED_H: tl.constexpr, NEED_W: tl.constexpr,
                UPCAST: tl.constexpr, GROUP_M: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    # Grouped ordering (as in Triton's matmul tutorial): GROUP_M row blocks walk the vocabulary
    # side by side, so each W tile is read from HBM once per group rather than once per row block.
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BLOCK_M)
    num_v = tl.cdiv(V, BLOCK_V)
    per_group = GROUP_M * num_v
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_v = (pid % per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = offs_m < N
    col_ok = offs_v < V
    tok = tl.load(tok_ptr + offs_m, mask=row_ok, other=-1).to(tl.int32)
    lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + offs_m, mask=row_ok, other=0.0)  # 0 on padding rows: dz = 0 there

    z, t = _logits_tile(h_ptr, w_ptr, offs_m, offs_v, row_ok, col_ok, D, stride_h, stride_w,
                        scale, softcap, temperature, HAS_SOFTCAP, UPCAST,
                        BLOCK_M, BLOCK_V, BLOCK_K)
    # d logp / d z = onehot(tok) - softmax(z); exp(-inf) = 0 past the vocabulary.
    p = tl.exp(z - lse[:, None])
    onehot = (offs_v[None, :] == tok[:, None]).to(tl.float32)
    dz = g[:, None] * (onehot - p)
    # Back through the temperature, the soft-cap and the logit scale.
    dz = dz / temperature
    if HAS_SOFTCAP:
        dz = dz * (1.0 - t * t)
    dz = dz * scale
    # Tensor-core operands in the input dtype (bf16 / fp16), accumulation in fp32.
    dz_c = dz.to(h_ptr.dtype.element_ty)

    offs_k = tl.arange(0, BLOCK_K)
    offs_m64 = offs_m.to(tl.int64)
    offs_v64 = offs_v.to(tl.int64)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < D
        if NEED_H:
            w = tl.load(w_ptr + offs_v64[:, None] * stride_w + k[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            gh = _dot(dz_c, w, UPCAST)  # [BLOCK_M, BLOCK_K]
            tl.atomic_add(gh_ptr + offs_m64[:, None] * D + k[None, :], gh,
                          mask=row_ok[:, None] & k_ok[None, :], sem="relaxed")
        if NEED_W:
            h = tl.load(h_ptr + offs_m64[:, None] * stride_h + k[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            gw = _dot(tl.trans(dz_c), h, UPCAST)  # [BLOCK_V, BLOCK_K]
            tl.atomic_add(gw_ptr + offs_v64[:, None] * D + k[None, :], gw,
                          mask=col_ok[:, None] & k_ok[None, :], sem="relaxed")


# --------------------------------------------------------------------------------------
# Launchers


def interpreted() -> bool:
    """True when the kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return triton_interpreted(_fwd_kernel)


def check_inputs(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise a ValueError / RuntimeError naming the fix when the kernels cannot take these tensors."""
    if hidden.dtype != weight.dtype:
        raise ValueError(f"triton_selective_logprobs: hidden ({hidden.dtype}) and weight ({weight.dtype}) "
                         "must share a dtype; selective_logprobs casts hidden to the head's dtype")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"triton_selective_logprobs: dtype {weight.dtype} is not supported "
                         "(float32, bfloat16, float16); use backend='torch'")
    if hidden.device != weight.device:
        raise ValueError(f"triton_selective_logprobs: hidden on {hidden.device}, weight on {weight.device}")
    if hidden.device.type == "cpu" and not interpreted():
        raise RuntimeError(
            "backend='triton' got CPU tensors, but the Triton kernels were not built for Triton's CPU "
            "interpreter: set TRITON_INTERPRET=1 before importing triton and grpo_nb.kernels, "
            "move the tensors to a GPU, or use backend='torch'"
        )
    if hidden.device.type not in ("cpu", "cuda", "meta"):
        raise RuntimeError(f"backend='triton' does not support {hidden.device.type} tensors; use backend='torch'")


def _launch_options(device: torch.device) -> dict:
    if device.type != "cuda":  # the CPU interpreter, or the meta device
        return {"num_warps": NUM_WARPS}
    # Three pipeline stages of 128x64 + 128x64 bf16 tiles need ~96 KiB of shared memory: fine on
    # A100 / H100, too much for the 100 KiB parts (sm86 / sm89) once the epilogue's is added.
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", 0)
    return {"num_warps": NUM_WARPS, "num_stages": 3 if smem >= 160 * 1024 else 2}


def _upcast(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and interpreted()


def _launch(kernel, grid, device: torch.device, work: tuple = ()):
    """The kernel bound to its grid; on the meta device (the memory simulation, `grpo_nb.simulate`) a
    no-op: the kernels only fill buffers their callers allocated, so there is nothing to count, and
    their `work` (name, FLOPs, bytes, dtype) goes to the time simulation's op record."""
    if device.type == "meta":
        from ..simulate import ops
        from ..simulate.device import written_by_kernel

        ops.kernel(*work)
        return lambda *args, **kwargs: written_by_kernel(*args)
    return kernel[grid]


def _num_splits(n_rows: int, vocab: int, block_m: int, block_v: int, device: torch.device) -> int:
    """Vocabulary slices per row block: enough programs for ~2 waves over the SMs."""
    if device.type not in ("cuda", "meta"):
        return 1
    # The meta device (the memory simulation) stands for an A100-class GPU.
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 108
    wanted = triton.cdiv(2 * sms, triton.cdiv(n_rows, block_m))
    return max(1, min(wanted, triton.cdiv(vocab, block_v)))


def _forward(hidden, weight, tokens, temperature, scale, softcap, block_m, block_v, block_k, num_splits):
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    if num_splits is None:
        num_splits = _num_splits(n, v, block_m, block_v, dev)
    # Each slice is a whole number of vocab tiles; recount so that no slice is empty.
    v_per_split = triton.cdiv(triton.cdiv(v, num_splits), block_v) * block_v
    num_splits = triton.cdiv(v, v_per_split)
    part_max = torch.empty(n, num_splits, dtype=torch.float32, device=dev)
    part_sum = torch.empty_like(part_max)
    part_tgt = torch.empty_like(part_max)
    grid = (triton.cdiv(n, block_m), num_splits)
    # As a tiled GEMM: the logits' FLOPs, each operand read once (tiles re-read hit the L2 cache)
    work = ("selective log-probs forward (Triton)", 2 * n * d * v, (n * d + v * d) * hidden.element_size() + 12 * n * num_splits,
            hidden.dtype)
    with on_device(dev):
        _launch(_fwd_kernel, grid, dev, work)(
            hidden, weight, tokens, part_max, part_sum, part_tgt,
            n, v, d, hidden.stride(0), weight.stride(0), v_per_split, num_splits,
            float(scale), float(softcap or 1.0), float(temperature),
            HAS_SOFTCAP=softcap is not None, UPCAST=_upcast(hidden),
            BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_K=block_k, **_launch_options(dev),
        )
    # Merge the slices' streaming logsumexps (exactly one slice saw the sampled token; the
    # others wrote 0).
    m = part_max.amax(dim=1, keepdim=True)
    lse = m.squeeze(1) + torch.log((part_sum * torch.exp(part_max - m)).sum(dim=1))
    return part_tgt.sum(dim=1) - lse, lse


def _backward(hidden, weight, tokens, lse, grad_out, temperature, scale, softcap, need_h, need_w,
              block_m, block_v, block_k):
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    # fp32 accumulators for the atomics; zero-filled because every tile adds into them.
    grad_h = torch.zeros(n, d, dtype=torch.float32, device=dev) if need_h else None
    grad_w = torch.zeros(v, d, dtype=torch.float32, device=dev) if need_w else None
    dummy = lse  # any fp32 tensor stands in for the gradient that is not computed
    grid = (triton.cdiv(n, block_m) * triton.cdiv(v, block_v),)
    # The logits recomputed, then one GEMM per gradient asked for; fp32 accumulators read and written
    work = ("selective log-probs backward (Triton)", 2 * n * d * v * (1 + need_h + need_w),
            (n * d + v * d) * hidden.element_size() + 8 * (n * d * need_h + v * d * need_w), hidden.dtype)
    with on_device(dev):
        _launch(_bwd_kernel, grid, dev, work)(
            hidden, weight, tokens, lse, grad_out,
            grad_h if need_h else dummy, grad_w if need_w else dummy,
            n, v, d, hidden.stride(0), weight.stride(0),
            float(scale), float(softcap or 1.0), float(temperature),
            HAS_SOFTCAP=softcap is not None, NEED_H=need_h, NEED_W=need_w,
            UPCAST=_upcast(hidden), GROUP_M=GROUP_M,
            BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_K=block_k, **_launch_options(dev),
        )
    if need_h:
        grad_h = grad_h.to(hidden.dtype)
    if need_w:
        grad_w = grad_w.to(weight.dtype)
    return grad_h, grad_w


class _TritonSelectiveLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, scale, softcap, blocks, num_splits):
        if hidden.shape[0] == 0:  # nothing to launch (a grid of size 0 is an error)
            logp = lse = hidden.new_empty(0, dtype=torch.float32)
        else:
            logp, lse = _forward(hidden, weight, tokens, temperature, scale, softcap, *blocks, num_splits)
        ctx.save_for_backward(hidden, weight, tokens, lse)
        ctx.params = (temperature, scale, softcap, blocks)
        return logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, tokens, lse = ctx.saved_tensors
        temperature, scale, softcap, blocks = ctx.params
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = grad_w = None
        if need_h or need_w:
            if hidden.shape[0] == 0:
                grad_h = torch.zeros_like(hidden) if need_h else None
                grad_w = torch.zeros_like(weight) if need_w else None
            else:
                grad_h, grad_w = _backward(hidden, weight, tokens, lse, grad_out.float().contiguous(),
                                           temperature, scale, softcap, need_h, need_w, *blocks)
        return grad_h, grad_w, None, None, None, None, None, None


def triton_selective_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    scale: float = 1.0,
    softcap: float | None = None,
    *,
    block_m: int | None = None,
    block_v: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """fp32 [N] log-probs of `tokens` [N] under softmax(transform(hidden [N, H] @ weight [V, H].T) / T).

    Differentiable in `hidden` and `weight`. `hidden` must already have `weight`'s dtype
    (float32, bfloat16 or float16). Block sizes (powers of two, >= 16) and the number of
    vocabulary slices in the forward pass default to values for a datacenter GPU; the tests
    pass small ones to keep the CPU interpreter fast.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or tokens.dim() != 1:
        raise ValueError("triton_selective_logprobs expects hidden [N, H], weight [V, H] and tokens [N]")
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != tokens.shape[0]:
        raise ValueError(f"triton_selective_logprobs: shapes {tuple(hidden.shape)}, {tuple(weight.shape)}, "
                         f"{tuple(tokens.shape)} do not fit [N, H], [V, H], [N]")
    if temperature <= 0:
        raise ValueError(f"triton_selective_logprobs: temperature must be > 0, got {temperature}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"triton_selective_logprobs: logit_softcap must be > 0 or None, got {softcap}")
    check_inputs(hidden, weight)
    blocks = (block_m or DEFAULT_BLOCK_M, block_v or DEFAULT_BLOCK_V, block_k or DEFAULT_BLOCK_K)
    for b in blocks:
        if b < 16 or b & (b - 1):
            raise ValueError(f"triton_selective_logprobs: block sizes must be powers of two >= 16, got {blocks}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"triton_selective_logprobs: num_splits must be >= 1, got {num_splits}")
    tokens = tokens.to(device=hidden.device, dtype=torch.long).contiguous()
    n, v = hidden.shape[0], weight.shape[0]
    if n and bool(((tokens < 0) | (tokens >= v)).any()):
        raise ValueError(f"triton_selective_logprobs: token ids must lie in [0, {v})")
    # The kernels index rows with one stride and unit column stride.
    hidden = hidden.contiguous()
    weight = weight.contiguous()
    return _TritonSelectiveLogprobs.apply(hidden, weight, tokens, float(temperature), float(scale),
                                          None if softcap is None else float(softcap), blocks, num_splits)
