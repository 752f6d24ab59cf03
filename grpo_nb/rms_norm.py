"""RMSNorm whose backward never holds fp32 copies of its whole input.

transformers' Llama / Qwen2 / Mistral / Qwen3 RMSNorm computes in fp32:
`weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`, and autograd keeps the
fp32 copy of `x` and builds several more [tokens, hidden] fp32 tensors in backward (the pow,
the mean, the products). At Llama-3.1-8B's 20K-token micro-batch each is 0.34 GB, and seven of
them live at once are the policy update's peak (`grpo_nb.simulate` shows it).

`rms_norm` computes the same values with one autograd function that keeps the input as it
came (usually bf16, which the layer holds anyway) and the per-token fp32 `rsqrt` factor, and
works in fp32 a tile of tokens at a time in forward and backward. Outputs are bitwise the
module's; gradients equal autograd's up to float rounding (one formula instead of the chain
of ops: r * (g - x_hat * mean(g * x_hat))).

`enable_lean_norms(model)` sets `forward` on each such module of the model instance (names and
parameters unchanged); other norms (Gemma's 1 + weight, LayerNorm) are left alone.

On CUDA the forward is one Triton kernel (`grpo_nb.kernels.rms_norm_triton`, after a one-time self-test) instead
of the ~8 kernels of the formula: a decode step runs two norms a layer, and on a GPU their kernels' fixed costs
are what they cost. The backward stays the tiled PyTorch one above.
"""

from __future__ import annotations

import weakref

import torch

from .attention import simulated_capability
from .lora import row_tiles

# The norms whose forward is exactly the formula above.
NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Qwen2MoeRMSNorm",
                "Qwen3MoeRMSNorm")
TILE_BYTES = 32 * 2**20  # fp32 working memory per tile


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        kernels = triton_kernels(x, weight)
        if kernels is not None:
            out, rstd = kernels.rms_norm_forward(x, weight, eps)
        else:
            out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
            rstd = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
            for t in row_tiles(x.shape[0], x.shape[1], TILE_BYTES):
                xf = x[t].to(torch.float32)
                rstd[t] = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
                out[t] = weight * (xf * rstd[t]).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for t in row_tiles(x.shape[0], x.shape[1], TILE_BYTES):
            x_hat = x[t].to(torch.float32) * rstd[t]
            if need_w:
                grad_w += (grad[t] * x_hat.to(x.dtype)).sum(0, dtype=torch.float32)
            if need_x:
                # Back through weight * (.).to(x.dtype) as autograd does: the product's gradient in the
                # output's dtype, cast to x's, then to fp32 for the normalisation.
                g = (grad[t] * weight).to(x.dtype).to(torch.float32)
                grad_x[t] = (rstd[t] * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, None if grad_w is None else grad_w.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (see the module docstring) of `x` [..., hidden], lean in fp32 memory."""
    shape = x.shape
    if not torch.is_grad_enabled() and (x.is_cuda or x.is_meta):
        rows = x.reshape(-1, shape[-1])
        kernels = triton_kernels(rows, weight)
        if kernels is not None:  # one kernel instead of ~8 (a decode step runs two a layer)
            return kernels.rms_norm_forward(rows, weight, eps)[0].view(shape)
    if not torch.is_grad_enabled() and x.numel() * 4 <= TILE_BYTES:
        # Nothing to keep for backward and one tile (a decode step's rows): the formula itself, without an autograd
        # function's bookkeeping - ~60 calls a decode step of the embedded default.
        xf = x.to(torch.float32)
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return _RMSNorm.apply(x.reshape(-1, shape[-1]), weight, float(eps)).view(shape)


def triton_kernels(x: torch.Tensor, weight: torch.Tensor):
    """`grpo_nb.kernels.rms_norm_triton` where it computes this norm - CUDA rows it takes, after its one-time
    self-test on this device, dtype and width (a failure warns and keeps the PyTorch ops), or meta rows standing
    for a GPU's (the simulation) -, else None."""
    if not (x.is_cuda or (x.is_meta and simulated_capability.get() is not None)):
        return None
    try:
        from .kernels import rms_norm_triton
    except Exception:  # triton missing or broken: the PyTorch ops always work
        return None
    if not rms_norm_triton.supported(x, weight):
        return None
    if x.is_meta:
        return rms_norm_triton
    if rms_norm_triton.interpreted() or not _passes_self_test(rms_norm_triton, x, weight):
        return None
    return rms_norm_triton


_SELF_TESTED: dict = {}


def _passes_self_test(kernels, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel against its reference, once per (device, dtypes, width) before it is trusted
    (`grpo_nb.kernels.self_tested`)."""
    from .kernels import self_tested

    def check() -> bool:
        g = torch.Generator(device=x.device).manual_seed(0)
        rows = (torch.randn(37, x.shape[1], device=x.device, generator=g) * 3).to(x.dtype)
        w = (1 + torch.randn(x.shape[1], device=x.device, generator=g) / 4).to(weight.dtype)
        out, rstd = kernels.rms_norm_forward(rows, w, 1e-6)
        # rstd as torch's up to summation order; after it the module's roundings exactly
        return (torch.allclose(rstd, kernels.rms_norm_reference(rows, w, 1e-6)[1], rtol=1e-5, atol=0)
                and torch.equal(out, kernels.rms_norm_reference(rows, w, 1e-6, rstd)[0]))

    return self_tested(_SELF_TESTED, (str(x.device), x.dtype, weight.dtype, x.shape[1]), "Triton RMSNorm kernel",
                       "the PyTorch ops (the same values, more kernels)", check)


def lean_norms(model) -> list:
    return [m for m in model.modules() if type(m).__name__ in NORM_CLASSES
            and isinstance(getattr(m, "weight", None), torch.Tensor) and hasattr(m, "variance_epsilon")]


def enable_lean_norms(model) -> int:
    """Route every standard RMSNorm of `model` through `rms_norm`; returns how many."""
    norms = lean_norms(model)
    for norm in norms:
        ref = weakref.ref(norm)  # a strong one in the module's own __dict__ would be a reference cycle
        norm.forward = lambda x, _ref=ref: rms_norm(x, _ref().weight, _ref().variance_epsilon)
    return len(norms)


def disable_lean_norms(model) -> None:
    for norm in lean_norms(model):
        norm.__dict__.pop("forward", None)
