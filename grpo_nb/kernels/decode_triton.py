"""Triton kernels for the steps between a GPU decode step's products: transformers' arithmetic, fewer kernels.

A graph-replayed decode step of Qwen2.5-1.5B QLoRA at 8 rows on a T4 launches ~1,190 kernels (priced by
`grpo_nb.simulate`): its products read the weights (~6.4 ms of rooflines), and each kernel adds ~3.4 us of fixed
costs (launch latency, tail, its node of the graph), ~4 ms in all. Between the products a layer runs ~20 small
kernels through transformers' modules: the residual adds, the rotation of q and k (two muls, a neg, a cat and an
add each), the cache's two column writes, SiLU and the gate's product. Three kernels here do a layer's share in
four launches (`LeanForward.static_step` calls them):

    residual_norm(h, delta, w)    h += delta (in h's dtype); out = w * (h.float() * rstd).to(h.dtype)
    rope_write(q, k, v, cos, sin, keys, values, column, adds)
                                  q, k rotated as transformers' apply_rotary_pos_emb (q * cos + rotate_half(q) * sin,
                                  each product and the sum rounded to the dtype as torch's ops round them); k and v
                                  written into the static cache at `column` (a device tensor: the write is in the
                                  graph); returns q [n, heads, 1, head_dim]
    silu_mul(gate, up, adds)      SiLU(gate) * up, each rounded to the dtype as torch's two ops

`adds` (or None): the adapters' branches of the projections the kernel reads, [(branch, scaling)], each added
first as y + scaling * branch (in fp32, rounded once) - the branches of q / k / v and of gate / up
come from one product each (`lean_forward._b_products`), so their adds cost no kernel of their own.

Each sits with its PyTorch reference below (`*_reference`: transformers' own op sequence), which the tests hold it
to under TRITON_INTERPRET=1 (fp32 and fp16; numpy has no bf16) and which `gpu_decode_ops` runs wherever the kernels
do not (the CPU, a failed self-test). Rounding: the 16-bit results are the reference's but for the exponential in
SiLU and the sum of squares' order in the norm (a unit in the last place, rarely); fp32 may differ in the last bits
(the compiler may fuse a product and a sum). **Never run on a GPU**: written and tested without one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import on_device, report_meta, triton_interpreted

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_COLUMNS = 16384  # a row in one program's registers


@triton.jit
def _residual_norm(H, D, W, OUT, stride_h, stride_d, stride_out, n_cols, eps, HAS_DELTA: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    h = tl.load(H + row * stride_h + cols, mask=inside, other=0.0)
    if HAS_DELTA:
        d = tl.load(D + row * stride_d + cols, mask=inside, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(H.dtype.element_ty)  # torch's add: opmath, one rounding
        tl.store(H + row * stride_h + cols, h, mask=inside)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)
    normed = (hf * rstd).to(H.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, (w * normed).to(OUT.dtype.element_ty), mask=inside)


@triton.jit
def _rotated(x1, x2, c1, c2, s1, s2, dtype):
    """transformers' x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], rounded per op to `dtype`."""
    a1 = (x1 * c1).to(dtype).to(tl.float32)
    a2 = (x2 * c2).to(dtype).to(tl.float32)
    b1 = (-x2 * s1).to(dtype).to(tl.float32)
    b2 = (x1 * s2).to(dtype).to(tl.float32)
    return (a1 + b1).to(dtype), (a2 + b2).to(dtype)


@triton.jit
def _plus(x, D, offsets, inside, scaling, HAS_ADDS: tl.constexpr, dtype: tl.constexpr):
    """x + scaling * branch in fp32, rounded to `dtype` once, where there are `adds`."""
    if HAS_ADDS:
        branch = tl.load(D + offsets, mask=inside, other=0.0).to(tl.float32)
        x = (x + scaling * branch).to(dtype).to(tl.float32)
    return x


@triton.jit
def _rope_write(Q, K, V, COS, SIN, KEYS, VALUES, COLUMN, QOUT, DQ, DK, DV, stride_q, stride_k, stride_v, stride_cs,
                stride_dq, stride_dk, stride_dv, sq, sk, sv, sk0, sk1, sk2, sv0, sv1, sv2, heads, half,
                HALF: tl.constexpr, HAS_ADDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, HALF)
    inside = i < half
    c1 = tl.load(COS + row * stride_cs + i, mask=inside, other=0.0).to(tl.float32)
    c2 = tl.load(COS + row * stride_cs + half + i, mask=inside, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + row * stride_cs + i, mask=inside, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + row * stride_cs + half + i, mask=inside, other=0.0).to(tl.float32)
    dtype = QOUT.dtype.element_ty
    if head < heads:  # a query head: rotated into q's output [n, heads, 1, head_dim]
        col = head * 2 * half + i
        x1 = tl.load(Q + row * stride_q + col, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(Q + row * stride_q + half + col, mask=inside, other=0.0).to(tl.float32)
        x1 = _plus(x1, DQ, row * stride_dq + col, inside, sq, HAS_ADDS, dtype)
        x2 = _plus(x2, DQ, row * stride_dq + half + col, inside, sq, HAS_ADDS, dtype)
        o1, o2 = _rotated(x1, x2, c1, c2, s1, s2, dtype)
        dst = QOUT + (row * heads + head) * 2 * half
        tl.store(dst + i, o1, mask=inside)
        tl.store(dst + half + i, o2, mask=inside)
    else:  # a key/value head: the key rotated and the value as it is, into the cache's column
        kv = head - heads
        column = tl.load(COLUMN).to(tl.int64)
        col = kv * 2 * half + i
        x1 = tl.load(K + row * stride_k + col, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(K + row * stride_k + half + col, mask=inside, other=0.0).to(tl.float32)
        x1 = _plus(x1, DK, row * stride_dk + col, inside, sk, HAS_ADDS, dtype)
        x2 = _plus(x2, DK, row * stride_dk + half + col, inside, sk, HAS_ADDS, dtype)
        o1, o2 = _rotated(x1, x2, c1, c2, s1, s2, dtype)
        dst = KEYS + row * sk0 + kv * sk1 + column * sk2
        tl.store(dst + i, o1.to(KEYS.dtype.element_ty), mask=inside)
        tl.store(dst + half + i, o2.to(KEYS.dtype.element_ty), mask=inside)
        y1 = tl.load(V + row * stride_v + col, mask=inside, other=0.0).to(tl.float32)
        y2 = tl.load(V + row * stride_v + half + col, mask=inside, other=0.0).to(tl.float32)
        y1 = _plus(y1, DV, row * stride_dv + col, inside, sv, HAS_ADDS, dtype)
        y2 = _plus(y2, DV, row * stride_dv + half + col, inside, sv, HAS_ADDS, dtype)
        dst = VALUES + row * sv0 + kv * sv1 + column * sv2
        tl.store(dst + i, y1.to(VALUES.dtype.element_ty), mask=inside)
        tl.store(dst + half + i, y2.to(VALUES.dtype.element_ty), mask=inside)


@triton.jit
def _silu_mul(G, U, OUT, DG, DU, stride_g, stride_u, stride_out, stride_dg, stride_du, sg, su, n_cols,
              BLOCK: tl.constexpr, HAS_ADDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    dtype = OUT.dtype.element_ty
    g = tl.load(G + row * stride_g + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=inside, other=0.0).to(tl.float32)
    g = _plus(g, DG, row * stride_dg + cols, inside, sg, HAS_ADDS, dtype)
    u = _plus(u, DU, row * stride_du + cols, inside, su, HAS_ADDS, dtype)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # torch's silu, then its product
    tl.store(OUT + row * stride_out + cols, (s * u).to(dtype), mask=inside)


@triton.jit
def _attention_split(Q, KEYS, VALUES, MASK, COLUMN, PART, LSE, sk0, sk1, sk2, sv0, sv1, sv2, stride_mask,
                     kv_heads, group, head_dim, chunk, scale, GROUP: tl.constexpr, DIM: tl.constexpr,
                     BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """One (row, kv head, split) program: its `group` query heads over the split's columns below the one written
    this step (included), in blocks - softmax statistics online -; the split's partial output and log-sum-exp."""
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    row, kv = pid // kv_heads, pid % kv_heads
    g = tl.arange(0, GROUP)
    dim = tl.arange(0, DIM)
    g_in, dim_in = g < group, dim < head_dim
    heads = kv_heads * group
    q = tl.load(Q + (row * heads + kv * group + g)[:, None] * head_dim + dim[None, :],
                mask=g_in[:, None] & dim_in[None, :], other=0.0)
    length = tl.load(COLUMN).to(tl.int32) + 1  # the columns written so far, this step's included
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    m = tl.full([GROUP], float("-inf"), tl.float32)
    total = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, DIM], tl.float32)
    cols = tl.arange(0, BLOCK)
    for first in range(start, end, BLOCK):
        c = first + cols
        c_in = c < end
        k = tl.load(KEYS + row * sk0 + kv * sk1 + c[:, None] * sk2 + dim[None, :],
                    mask=c_in[:, None] & dim_in[None, :], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        bias = tl.load(MASK + row * stride_mask + c, mask=c_in, other=0.0).to(tl.float32)
        scores = tl.where(c_in[None, :], scores * scale + bias[None, :], float("-inf"))
        new_m = tl.maximum(m, tl.max(scores, axis=1))
        safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)  # (a block whose columns a -inf mask hides)
        alpha = tl.exp(m - safe_m)
        weights = tl.exp(scores - safe_m[:, None])
        total = total * alpha + tl.sum(weights, axis=1)
        v = tl.load(VALUES + row * sv0 + kv * sv1 + c[:, None] * sv2 + dim[None, :],
                    mask=c_in[:, None] & dim_in[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v)
        m = new_m
    # a split with no columns (past the ones written): log-sum-exp -inf, weight 0 in the combination
    lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    head = kv * group + g
    base = (row * heads + head) * splits + split
    tl.store(PART + base[:, None] * head_dim + dim[None, :], out, mask=g_in[:, None] & dim_in[None, :])
    tl.store(LSE + base, lse, mask=g_in)


@triton.jit
def _attention_combine(PART, LSE, OUT, head_dim, SPLITS: tl.constexpr, DIM: tl.constexpr):
    """One (row, head) program: the splits' partial outputs weighted by their share of the softmax."""
    pid = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS)
    dim = tl.arange(0, DIM)
    lse = tl.load(LSE + pid * SPLITS + s)
    weights = tl.exp(lse - tl.max(lse, axis=0))
    part = tl.load(PART + (pid * SPLITS + s)[:, None] * head_dim + dim[None, :], mask=dim[None, :] < head_dim,
                   other=0.0)
    out = tl.sum(part * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(OUT + pid * head_dim + dim, out.to(OUT.dtype.element_ty), mask=dim < head_dim)


def interpreted() -> bool:
    """Whether the kernels run on Triton's CPU interpreter (TRITON_INTERPRET=1 when they were jitted)."""
    return triton_interpreted(_silu_mul)


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """t with a contiguous last dimension (the kernels step through it by 1): itself, as the decode step's tensors
    come, else a copy."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def residual_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h [rows, hidden] += delta (None: nothing to add), in place; returns RMSNorm(h) in result_type(weight, h)."""
    rows, cols = h.shape
    if h.stride(1) != 1:
        raise ValueError("residual_norm writes h in place: its rows must be contiguous")
    delta, weight = _rows(delta), _rows(weight)
    out = torch.empty(h.shape, dtype=torch.result_type(weight, h), device=h.device)
    if h.device.type == "meta":  # the simulation standing for a GPU: the kernel's work to the op record
        moved = h.numel() * h.element_size() * (3 if delta is not None else 1) + out.numel() * out.element_size()
        report_meta("residual_norm", 5 * h.numel(), moved + weight.numel() * weight.element_size(), h.dtype, out, h)
        return out
    if rows:
        block = triton.next_power_of_2(cols)
        with on_device(h.device):
            _residual_norm[(rows,)](h, h if delta is None else delta, weight, out, h.stride(0),
                                    0 if delta is None else delta.stride(0), out.stride(0), cols, float(eps),
                                    HAS_DELTA=delta is not None, BLOCK=block,
                                    num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16)
    return out


def _adds(adds, *like: torch.Tensor) -> tuple:
    """`adds` ([(branch, scaling)] per tensor of `like`, each branch of its tensor's shape, or None) as the kernels
    take them: the branches with contiguous rows, their row strides, their scalings (stand-ins where there are
    none)."""
    if adds is None:
        return (*like, *(0 for _ in like), *(0.0 for _ in like))
    if len(adds) != len(like):
        raise ValueError(f"adds: expected one (branch, scaling) for each of the {len(like)} tensors, got {len(adds)}")
    branches = [_rows(d) for d, _ in adds]
    for d, t in zip(branches, like):
        if d.shape != t.shape:
            raise ValueError(f"adds: a branch of shape {tuple(d.shape)} for an output of shape {tuple(t.shape)}")
    return (*branches, *(d.stride(0) for d in branches), *(float(s) for _, s in adds))


def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor, adds=None) -> torch.Tensor:
    """q [n, heads * d], k and v [n, kv_heads * d] (rows of the projections), cos / sin [n, d]: q rotated
    [n, heads, 1, d]; k rotated and v written into keys / values [n, kv_heads, L, d] at `column` ([1] long).
    `adds`: [(branch, scaling)] for q, k, v - their adapters' branches, added first (one rounding each)."""
    n, d = q.shape[0], keys.shape[-1]
    heads, kv_heads = q.shape[1] // d, keys.shape[1]
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("rope_write writes the cache in place: its head_dim must be contiguous")
    q, k, v, cos, sin = (_rows(t) for t in (q, k, v, cos, sin))
    branches = _adds(adds, q, k, v)
    out = torch.empty(n, heads, 1, d, dtype=q.dtype, device=q.device)
    if q.device.type == "meta":
        item = q.element_size()
        moved = (2 * q.numel() + 2 * (k.numel() + v.numel()) + 2 * cos.numel()) * item
        if adds is not None:
            moved += sum(t.numel() * t.element_size() for t in branches[:3])
        report_meta("rope_write", 6 * (q.numel() + k.numel()), moved, q.dtype, out, keys, values)
        return out
    if n:
        with on_device(q.device):
            _rope_write[(n, heads + kv_heads)](
                q, k, v, cos, sin, keys, values, column, out, *branches[:3], q.stride(0), k.stride(0), v.stride(0),
                cos.stride(0), *branches[3:], keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0),
                values.stride(1), values.stride(2), heads, d // 2, HALF=triton.next_power_of_2(d // 2),
                HAS_ADDS=adds is not None, num_warps=1 if d <= 128 else 2)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, adds=None) -> torch.Tensor:
    """SiLU(gate) * up for [rows, intermediate] rows, in their dtype. `adds`: [(branch, scaling)] for gate and up
    - their adapters' branches, added first (one rounding each)."""
    rows, cols = gate.shape
    gate, up = _rows(gate), _rows(up)
    branches = _adds(adds, gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.device.type == "meta":
        moved = 3 * gate.numel() * gate.element_size()
        if adds is not None:
            moved += sum(t.numel() * t.element_size() for t in branches[:2])
        report_meta("silu_mul", 5 * gate.numel(), moved, gate.dtype, out)
        return out
    if rows:
        block = min(1024, triton.next_power_of_2(cols))
        with on_device(gate.device):
            _silu_mul[(rows, triton.cdiv(cols, block))](gate, up, out, *branches[:2], gate.stride(0), up.stride(0),
                                                        out.stride(0), *branches[2:], cols, BLOCK=block,
                                                        HAS_ADDS=adds is not None, num_warps=4)
    return out


ATTENTION_BLOCK = 32  # columns a program takes at once
ATTENTION_PROGRAMS = 160  # at least this many programs a step where the columns allow it (a T4 has 40 SMs)
MAX_SPLITS = 64  # the combining kernel holds [splits, head_dim] values in registers


def attention_splits(rows: int, kv_heads: int, columns: int) -> int:
    """How many splits of the columns each (row, kv head) is read in: enough programs to keep the card's SMs
    reading, a power of two (the combination's width), at most one block of columns each."""
    wanted = triton.cdiv(ATTENTION_PROGRAMS, max(1, rows * kv_heads))
    return max(1, min(triton.next_power_of_2(wanted), triton.next_power_of_2(triton.cdiv(columns, ATTENTION_BLOCK)),
                      MAX_SPLITS))


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     column: torch.Tensor, scaling: float, priced_columns: int | None = None) -> torch.Tensor:
    """Softmax attention of one query per row, q [n, heads, 1, d], over the static cache's keys / values
    [n, kv_heads, L, d] up to `column` ([1] long: the one written this step, included; the columns after it are
    never read), with the additive mask [n, 1, 1, L] (0: attend) - grouped heads read their keys once -:
    [n, 1, heads, d], the layout the output projection takes. `priced_columns`: on the meta device, the columns a
    step reads on average (the simulation records one step for all)."""
    n, heads, _, d = q.shape
    kv_heads, L = keys.shape[1], keys.shape[2]
    q, keys, values, mask = q.contiguous(), _rows(keys), _rows(values), _rows(mask)
    out = torch.empty(n, 1, heads, d, dtype=q.dtype, device=q.device)
    splits = attention_splits(n, kv_heads, L)
    part = torch.empty(n, heads, splits, d, dtype=torch.float32, device=q.device)  # each split's output
    lse = torch.empty(n, heads, splits, dtype=torch.float32, device=q.device)  # and its log-sum-exp
    if q.device.type == "meta":
        read = L if priced_columns is None else min(L, int(priced_columns))
        moved = (2 * n * kv_heads * read * d) * keys.element_size() + 2 * q.numel() * q.element_size() \
            + n * read * mask.element_size()
        partial = (part.numel() + lse.numel()) * 4
        report_meta("decode_attention", 4 * n * heads * read * d, moved + partial, q.dtype, part, lse)
        report_meta("decode_attention_combine", 3 * part.numel(), partial + out.numel() * out.element_size(),
                    q.dtype, out)
        return out
    if n:
        group = heads // kv_heads
        chunk = triton.cdiv(triton.cdiv(L, splits), ATTENTION_BLOCK) * ATTENTION_BLOCK
        dim = max(16, triton.next_power_of_2(d))
        with on_device(q.device):
            _attention_split[(n * kv_heads, splits)](
                q, keys, values, mask, column, part, lse, keys.stride(0), keys.stride(1), keys.stride(2),
                values.stride(0), values.stride(1), values.stride(2), mask.stride(0), kv_heads, group, d, chunk,
                float(scaling), GROUP=max(16, triton.next_power_of_2(group)), DIM=dim, BLOCK=ATTENTION_BLOCK,
                IEEE=q.dtype == torch.float32, num_warps=4)
            _attention_combine[(n * heads,)](part, lse, out, d, SPLITS=splits, DIM=dim,
                                             num_warps=1 if splits * dim <= 2048 else 4)
    return out


# -- the references: transformers' own ops, what the kernels must match ------------------------------------------

def residual_norm_reference(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                            eps: float) -> torch.Tensor:
    """The decoder layer's `residual + hidden_states` (in place here), then the RMSNorm module's formula."""
    if delta is not None:
        h.add_(delta)
    hf = h.to(torch.float32)
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def _added(tensors, adds) -> tuple:
    """Each tensor + scaling * its branch, in fp32 and rounded once (CUDA's add with alpha; the CPU's rounds the
    product to a 16-bit dtype first), where there are `adds`."""
    if adds is None:
        return tensors
    return tuple((t.float() + d.float() * s).to(t.dtype) for t, (d, s) in zip(tensors, adds))


def rope_write_reference(q, k, v, cos, sin, keys, values, column, adds=None) -> torch.Tensor:
    """The adapters' branches added (`adds`), apply_rotary_pos_emb on q and k ([n, heads, 1, d] views of the
    rows), then the static cache's index_copy_."""
    n, d = q.shape[0], keys.shape[-1]
    q, k, v = _added((q, k, v), adds)
    q, k, v = (t.view(n, -1, 1, d) for t in (q, k, v))
    cos, sin = cos[:, None, None], sin[:, None, None]

    def rotate_half(x):
        return torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1)

    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    keys.index_copy_(2, column, k_embed.to(keys.dtype))
    values.index_copy_(2, column, v.to(values.dtype))
    return q_embed


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor, adds=None) -> torch.Tensor:
    """The MLP's act_fn(gate_proj(x)) * up_proj(x) between its products (their adapters' branches added first)."""
    gate, up = _added((gate, up), adds)
    return F.silu(gate) * up


def decode_attention_reference(q, keys, values, mask, column, scaling, priced_columns=None) -> torch.Tensor:
    """transformers' SDPA attention over every column of the static cache, the mask hiding those not written."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (t.repeat_interleave(group, dim=1) for t in (keys, values))
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)
