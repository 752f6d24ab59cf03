"""A Triton kernel for RMSNorm's forward: transformers' Llama / Qwen2 / Mistral formula in one kernel.

    rstd = rsqrt(mean(x.float() ** 2) + eps)          (per row, fp32)
    out  = weight * (x.float() * rstd).to(x.dtype)    (in result_type(weight, x))

The reference is `grpo_nb.rms_norm._RMSNorm.forward` (`rms_norm_reference` below: the module's own ops), which
launches ~8 kernels per norm call (the cast, the square, the mean, the epsilon, rsqrt, the product, the cast
back, the weight). A decode step of a 28-layer model calls 57 norms: ~450 kernels whose fixed costs, not their
bytes, are what they cost on a GPU (`grpo_nb.simulate.pricing`: a T4 decode step of Qwen2.5-1.5B QLoRA priced at
~1,600 kernels). Here one program normalises one row in registers (the whole hidden size, up to 16K columns) and
writes the row and its rstd, which the backward (`grpo_nb.rms_norm`, PyTorch) reads.

The squares are summed in fp32 in another order than torch's mean, so rstd may differ from torch's in its last
bits (~1e-7 relative); after it the kernel rounds exactly where the module rounds (x * rstd to x's dtype, then
the weight's product): its output is the module's formula applied to its own rstd, bit for bit. Against the
reference's own rstd a 16-bit output can then differ by a unit or two in the last place.

On CUDA `rms_norm` uses it after a one-time self-test per (device, dtype, hidden size), falling back to the
PyTorch ops with a warning if it fails; it has never run on a GPU (written and tested without one, under
`TRITON_INTERPRET=1`, where numpy has no bf16: bf16 is checked by the self-test only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import on_device, report_meta, triton_interpreted

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_COLUMNS = 16384  # a row in one program's registers


@triton.jit
def _rms_norm_fwd(X, W, OUT, RSTD, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2^31 elements on long sequences
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=inside, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)  # rounded to x's dtype, as the module's .to(x.dtype)
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, (w * normed).to(OUT.dtype.element_ty), mask=inside)
    tl.store(RSTD + row, rstd)


def interpreted() -> bool:
    """Whether the kernel runs on Triton's CPU interpreter (TRITON_INTERPRET=1 when it was jitted)."""
    return triton_interpreted(_rms_norm_fwd)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these operands (2D rows of x, a weight of their width)."""
    return (x.dim() == 2 and weight.dim() == 1 and weight.shape[0] == x.shape[1] <= MAX_COLUMNS
            and x.dtype in SUPPORTED_DTYPES and weight.dtype in SUPPORTED_DTYPES and x.device == weight.device
            and x.stride(1) == 1 and weight.stride(0) == 1)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [rows, hidden] in result_type(weight, x), rstd [rows, 1] fp32) for `x` [rows, hidden]. On the meta device
    (`grpo_nb.simulate` standing for a GPU) the kernel's work goes to the op record and nothing runs."""
    rows, cols = x.shape
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    rstd = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if x.device.type == "meta":
        report_meta("rms_norm", 4 * x.numel(), x.numel() * (x.element_size() + out.element_size())
                    + weight.numel() * weight.element_size() + rows * 4, x.dtype, out, rstd)
        return out, rstd
    if rows:
        block = triton.next_power_of_2(cols)
        warps = 4 if block <= 1024 else 8 if block <= 4096 else 16  # a row's values in registers without spills
        with on_device(x.device):
            _rms_norm_fwd[(rows,)](x, weight, out, rstd, x.stride(0), out.stride(0), cols, float(eps),
                                   BLOCK=block, num_warps=warps)
    return out, rstd


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, rstd: torch.Tensor | None = None):
    """The formula as the module computes it, op by op (what the kernel must match): (out, rstd). `rstd` given
    (the kernel's): the rest of the formula on it, which the kernel's output must equal bit for bit."""
    xf = x.to(torch.float32)
    if rstd is None:
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * rstd).to(x.dtype), rstd
