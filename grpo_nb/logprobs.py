"""Per-token log-probs of sampled tokens without ever building [batch, seq, vocab] logits.

GRPO needs log p(token_t | prefix) only for the tokens that were sampled. The usual way
(`model(...).logits.log_softmax(-1).gather(...)`) materialises the full logits tensor,
which at 8 generations x 1024 tokens x 151,936 vocab is ~5 GB in fp32, plus as much
again for its gradient. Here the lm_head projection, the logsumexp and the gather run
chunk of rows by chunk of rows inside one autograd function, and the backward pass
recomputes each chunk's logits instead of storing them. Peak scratch is
`chunk_size x vocab` floats, whatever the sequence length.

This file is the PyTorch reference and the CPU path. On CUDA, `selective_logprobs` runs the
Triton kernels in `grpo_nb/kernels/logprobs_triton.py` instead (backend="auto"), which must
match it; backend="torch" forces this code.
"""

from __future__ import annotations

import torch

from . import prefix_sharing
from .attachments import base_model, text_config
from .hardware import native_bf16

# Scratch budget for one chunk's fp32 logits (and its softmax in backward).
_CHUNK_BYTES = 64 * 2**20

LOGPROB_BACKENDS = ("auto", "torch", "triton")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def default_chunk_size(vocab_size: int) -> int:
    return max(16, _CHUNK_BYTES // (4 * vocab_size))


def _chunk_logits(h, weight, scale, softcap, temperature):
    """fp32 logits of one chunk, with the model's output transform and the sampling temperature.

    Returns the final logits and the pre-softcap logits (needed for the softcap derivative).
    """
    z = (h @ weight.t()).to(compute_dtype(weight.dtype))
    if scale != 1.0:
        z = z * scale
    pre = z
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z / temperature, pre


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype log-probs are computed and returned in: the wider of the weights' and float32
    (16-bit weights compute in float32; float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


class _SelectiveLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, chunk_size, scale, softcap):
        n, dtype = hidden.shape[0], compute_dtype(weight.dtype)
        out = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        for s in range(0, n, chunk_size):
            z, _ = _chunk_logits(hidden[s : s + chunk_size], weight, scale, softcap, temperature)
            lse[s : s + chunk_size] = torch.logsumexp(z, dim=-1)
            out[s : s + chunk_size] = z.gather(1, tokens[s : s + chunk_size, None]).squeeze(1) - lse[s : s + chunk_size]
        ctx.save_for_backward(hidden, weight, tokens, lse)
        ctx.params = (temperature, chunk_size, scale, softcap)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, tokens, lse = ctx.saved_tensors
        temperature, chunk_size, scale, softcap = ctx.params
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        dtype = compute_dtype(weight.dtype)
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], chunk_size):
            h = hidden[s : s + chunk_size]
            z, pre = _chunk_logits(h, weight, scale, softcap, temperature)
            g = grad_out[s : s + chunk_size, None].to(dtype)
            # d logp[t] / d z = onehot(t) - softmax(z); scaled by the incoming gradient.
            dz = torch.exp(z - lse[s : s + chunk_size, None]).mul_(-g)
            dz.scatter_add_(1, tokens[s : s + chunk_size, None], g)
            # Back through the temperature, the soft-cap and the logit scale.
            dz.div_(temperature)
            if softcap is not None:
                dz.mul_(1 - torch.tanh(pre / softcap) ** 2)
            if scale != 1.0:
                dz.mul_(scale)
            if need_h:
                grad_h[s : s + chunk_size] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(dz.t(), h.to(dtype))
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def selective_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Log-probs of `token_ids` under `softmax(transform(hidden_states @ lm_head_weight.T) / temperature)`.

    Args:
        hidden_states: [B, T, H] (or [N, H]) final hidden states, after the model's last norm.
        lm_head_weight: [V, H] output projection (the tied embedding matrix for tied models).
        token_ids: [B, T] (or [N]); `token_ids[b, t]` is the token whose log-prob is read from
            `hidden_states[b, t]`. Callers do the usual shift by one.
        temperature: the sampling temperature the tokens were drawn with.
        chunk_size: rows per chunk of the torch backend; default keeps one chunk's fp32 logits
            near 64 MiB. The Triton kernels tile by themselves and ignore it.
        logit_scale: multiplies the logits before soft-capping (Cohere's `logit_scale`,
            1/`logits_scaling` for Granite).
        logit_softcap: `tanh(z / c) * c` soft-capping (Gemma 2's `final_logit_softcapping`).
        backend: "torch" runs the chunked PyTorch code in this file (the reference);
            "triton" the fused Triton kernels (CUDA tensors, or CPU tensors under
            TRITON_INTERPRET=1; an error names the fix otherwise); "auto" picks "triton" for
            float32 / float16 tensors on a CUDA GPU of compute capability >= 7.0 (bfloat16:
            >= 8.0, `hardware.native_bf16`) when triton imports and the kernels pass a one-time
            self-test against this file's code, and "torch" everywhere else.

    Returns:
        A tensor shaped like `token_ids`, float32 (float64 for a float64 head: `compute_dtype`),
        differentiable in `hidden_states` and `lm_head_weight`.
        The full logits tensor never exists, in forward or backward.
    """
    if backend not in LOGPROB_BACKENDS:
        raise ValueError(f"selective_logprobs: backend must be one of {LOGPROB_BACKENDS}, got {backend!r}")
    if hidden_states.shape[:-1] != token_ids.shape:
        raise ValueError(
            f"selective_logprobs: hidden_states {tuple(hidden_states.shape)} and token_ids "
            f"{tuple(token_ids.shape)} must agree on every dimension but the hidden size"
        )
    if hidden_states.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"selective_logprobs: hidden size {hidden_states.shape[-1]} does not match "
            f"lm_head_weight {tuple(lm_head_weight.shape)} (expected [vocab, hidden])"
        )
    if temperature <= 0:
        raise ValueError(f"selective_logprobs: temperature must be > 0, got {temperature}")
    if chunk_size is None:
        chunk_size = default_chunk_size(lm_head_weight.shape[0])
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"selective_logprobs: chunk_size must be a positive integer or None, got {chunk_size!r}")
    # Mixed precision callers (fp32 activations, bf16 head) compute in the head's dtype.
    flat_h = hidden_states.reshape(-1, hidden_states.shape[-1]).to(lm_head_weight.dtype)
    flat_t = token_ids.reshape(-1).long()
    kernels = triton_kernels(backend, lm_head_weight)
    if kernels is not None:
        out = kernels.triton_selective_logprobs(
            flat_h, lm_head_weight, flat_t, float(temperature), float(logit_scale), logit_softcap
        )
        return out.view(token_ids.shape)
    out = _SelectiveLogprobs.apply(
        flat_h, lm_head_weight, flat_t, float(temperature), int(chunk_size), float(logit_scale), logit_softcap
    )
    return out.view(token_ids.shape)


@torch.no_grad()
def token_entropies(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Entropy of each position's next-token distribution (the one `selective_logprobs` reads), no grad.

    Chunk by chunk like `selective_logprobs`, so the full logits never exist either:
    H = logsumexp(z) - sum(softmax(z) * z). Used to keep only high-entropy tokens in the
    loss (`top_entropy_quantile`); a separate pass because no gradient flows through it.
    """
    flat_h = hidden_states.reshape(-1, hidden_states.shape[-1]).to(lm_head_weight.dtype)
    chunk_size = chunk_size or default_chunk_size(lm_head_weight.shape[0])
    out = torch.empty(flat_h.shape[0], dtype=compute_dtype(lm_head_weight.dtype), device=flat_h.device)
    for s in range(0, flat_h.shape[0], chunk_size):
        out[s : s + chunk_size] = _chunk_entropies(flat_h[s : s + chunk_size], lm_head_weight, logit_scale,
                                                   logit_softcap, temperature)
    return out.view(hidden_states.shape[:-1])


def _chunk_entropies(h, weight, scale, softcap, temperature) -> torch.Tensor:
    """H = logsumexp(z) - sum(softmax(z) * z) of one chunk's logits z."""
    z, _ = _chunk_logits(h, weight, scale, softcap, temperature)
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def entropies_with_grad(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """`token_entropies` with their gradient (the entropy bonus, `entropy_coef`): each chunk's entropies under
    activation checkpointing, so a chunk's logits are recomputed in backward and the full logits never exist."""
    from torch.utils.checkpoint import checkpoint

    flat_h = hidden_states.reshape(-1, hidden_states.shape[-1]).to(lm_head_weight.dtype)
    chunk_size = chunk_size or default_chunk_size(lm_head_weight.shape[0])
    parts = [checkpoint(_chunk_entropies, flat_h[s : s + chunk_size], lm_head_weight, logit_scale, logit_softcap,
                        temperature, use_reentrant=False) for s in range(0, flat_h.shape[0], chunk_size)]
    return torch.cat(parts).view(hidden_states.shape[:-1])


def triton_kernels(backend: str, weight: torch.Tensor):
    """The Triton kernel module when `backend` resolves to "triton", else None (torch path)."""
    if backend == "torch":
        return None
    if backend == "auto":
        if not (weight.is_cuda and weight.dtype in _TRITON_DTYPES):
            return None  # CPU, float64
        # bf16 needs native bf16 (Ampere or newer); fp16/fp32 run on Volta/Turing too (the T4 trains in fp16).
        if weight.dtype == torch.bfloat16 and not native_bf16(weight.device):
            return None
        if torch.cuda.get_device_capability(weight.device) < (7, 0):
            return None
        try:
            from .kernels import logprobs_triton
        except Exception:  # triton missing or broken: the torch path always works
            return None
        # Under TRITON_INTERPRET=1 the kernels would run on the CPU interpreter: far too slow.
        if logprobs_triton.interpreted() or not _kernels_pass_self_test(logprobs_triton, weight):
            return None
        return logprobs_triton
    try:
        from .kernels import logprobs_triton
    except Exception as e:
        raise RuntimeError(
            f"selective_logprobs(backend='triton') could not import triton ({type(e).__name__}: {e}); "
            "install it (pip install triton, Linux + NVIDIA/AMD GPU) or use backend='torch'"
        ) from e
    return logprobs_triton


_SELF_TESTED: dict = {}


def _kernels_pass_self_test(kernels, weight: torch.Tensor) -> bool:
    """The kernels' forward and backward against `_SelectiveLogprobs`, once per (device, dtype, hidden size)
    before "auto" trusts them (`grpo_nb.kernels.self_tested`)."""
    from .kernels import self_tested

    def check() -> bool:
        g = torch.Generator(device=weight.device).manual_seed(0)
        n, v, hdim = 48, 300, weight.shape[1]
        h = (torch.randn(n, hdim, device=weight.device, generator=g) / hdim**0.5).to(weight.dtype)
        w = torch.randn(v, hdim, device=weight.device, generator=g).to(weight.dtype)
        t = torch.randint(0, v, (n,), device=weight.device, generator=g)
        upstream = torch.randn(n, device=weight.device, generator=g)
        results = []
        for fn in (lambda a, b: kernels.triton_selective_logprobs(a, b, t, 0.7, 1.0, None),
                   lambda a, b: _SelectiveLogprobs.apply(a, b, t, 0.7, 16, 1.0, None)):
            a, b = h.detach().float().requires_grad_(), w.detach().requires_grad_()
            out = fn(a.to(weight.dtype), b)
            gh, gw = torch.autograd.grad((out * upstream).sum(), (a, b))
            results.append((out.detach().float(), gh.float(), gw.float()))
        tol = 1e-4 if weight.dtype == torch.float32 else 3e-2
        return all(torch.allclose(x, y, rtol=tol, atol=tol * max(1.0, float(y.abs().max())))
                   for x, y in zip(*results))

    return self_tested(_SELF_TESTED, (str(weight.device), weight.dtype, weight.shape[1]),
                       "Triton log-prob kernels", "the PyTorch path (same results, more memory traffic)", check)


# --------------------------------------------------------------------------------------
# From a causal LM to completion log-probs


def output_head(model) -> dict:
    """The lm_head weight and the model's logit transform, read from its config.

    Works for plain transformers models and for peft-wrapped ones (the head is not a LoRA
    target by default; if it is, we refuse rather than silently drop the adapter).
    """
    base = base_model(model)
    head = base.get_output_embeddings()
    if hasattr(head, "base_layer"):
        raise ValueError(
            "The lm_head carries a LoRA adapter, which grpo-nb's log-prob path does not read. "
            "Leave lm_head out of target_modules (the default)."
        )
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            f"{type(base).__name__}'s lm_head has a bias, which selective_logprobs does not support yet."
        )
    cfg = text_config(base)
    scale = float(getattr(cfg, "logit_scale", None) or 1.0)
    if getattr(cfg, "logits_scaling", None):  # Granite divides
        scale /= float(cfg.logits_scaling)
    softcap = getattr(cfg, "final_logit_softcapping", None)
    return {"lm_head_weight": head.weight, "logit_scale": scale, "logit_softcap": softcap}


def decoder_hidden_states(model, input_ids, attention_mask):
    """Last hidden states of the decoder stack (after its final norm), never the logits."""
    base = base_model(model)
    # Positions count real tokens only, as generate() does for left-padded prompts.
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = base.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    return out.last_hidden_state


def completion_hidden_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *,
                             share_prefix: bool = False) -> torch.Tensor:
    """[B, Tc, H]: the last hidden states that predict each completion token. With `share_prefix`, the rows go
    through the decoder packed: each run of rows with one prompt (a group's completions) forwards it once, and no
    padding is forwarded (grpo_nb.prefix_sharing), where the model allows and it pays; the states are the same."""
    packed = prefix_sharing.layout(model, prompt_ids, prompt_mask, completion_ids, completion_mask) \
        if share_prefix else None
    if packed is not None:
        hidden = prefix_sharing.hidden_states(base_model(model).get_decoder(), packed,
                                              text_config(model).num_hidden_layers)
        if hidden is not None:
            return hidden
        prefix_sharing.refuse(model)  # its layers lost the layout on the way to attention: as the rows are
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    tc = completion_ids.shape[1]
    # The state at position i predicts token i+1: keep the Tc states ending one before the last.
    return decoder_hidden_states(model, input_ids, attention_mask)[:, -tc - 1 : -1]


def completion_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    backend: str = "auto",
    return_entropy: bool = False,
    share_prefix: bool = False,
):
    """[B, Tc] log-probs of each completion token given the prompt and the completion so far.

    Only the hidden states that predict completion tokens are projected to the vocabulary;
    prompt positions never are. Padding positions get a (meaningless) finite value: mask them.
    `backend` is passed to `selective_logprobs` ("auto", "torch" or "triton").
    With `return_entropy`, returns (log-probs, [B, Tc] entropies of the same distributions).
    `share_prefix`: forward a prompt once for the rows that repeat it (`completion_hidden_states`).
    """
    hidden = completion_hidden_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                      share_prefix=share_prefix)
    head = output_head(model)
    logprobs = selective_logprobs(hidden, token_ids=completion_ids, temperature=temperature, chunk_size=chunk_size,
                                  backend=backend, **head)
    if not return_entropy:
        return logprobs
    return logprobs, token_entropies(hidden, temperature=temperature, chunk_size=chunk_size, **head)
