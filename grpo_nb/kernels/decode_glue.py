"""Which kernels run the steps between a static decode step's products (`LeanForward.static_step`).

`glue(model, device)` answers an object with `residual_norm`, `rope_write` and `silu_mul` (see `decode_triton`):

* on CUDA, `decode_triton`'s Triton kernels after a one-time self-test against their references for the model's
  dtype and widths (`self_tested`: a failure warns, and the decode step stays the model's own forward);
* on the meta device while `grpo_nb.simulate` stands for a GPU, the same kernels (they report their work to the
  op record and run nothing);
* on the CPU (tests; `lean_forward.LEAN_STATIC_ON_CPU`), the kernels under Triton's interpreter, else their
  PyTorch references (`REFERENCES`: transformers' own ops).

None where triton cannot be imported or the self-test fails. `sampler(device)`: the same for the sampling after
each decode step (`sample_triton`).
"""

from __future__ import annotations

import types

import torch

from . import self_tested

_VERDICTS: dict = {}
# How far a kernel's 16-bit result may be from its reference's (relative and absolute, two units in the last
# place: SiLU's exponential and the norm's sum of squares may round differently); a wrong head, column or half
# of the rotation is off by the values' own size
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2 * 2**-10, torch.bfloat16: 2 * 2**-7}
# the attention's output against the reference's in fp32 (the kernel rounds the softmax weights to the values'
# dtype for their product, as FlashAttention does; measured under the interpreter: fp16 ~3e-4)
ATTENTION_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _references():
    from . import decode_triton

    # (attention: None, the model's own attention function - `decode_attention_reference` is its arithmetic)
    return types.SimpleNamespace(residual_norm=decode_triton.residual_norm_reference,
                                 rope_write=decode_triton.rope_write_reference,
                                 silu_mul=decode_triton.silu_mul_reference, decode_attention=None)


def glue(model, device) -> object | None:
    """The glue for `model`'s static decode steps on `device` (see the module's docstring), or None."""
    device = torch.device(device)
    try:
        from . import decode_triton
    except Exception:  # triton missing or broken: the model's own forward always works
        return None
    if _shapes(model)[0] > decode_triton.MAX_COLUMNS:
        return None  # (a norm's row in one program's registers)
    if device.type == "meta":
        return decode_triton
    if device.type != "cuda":
        # (the interpreter computes in numpy, which has no bf16)
        bf16 = torch.bfloat16 in (model.model.embed_tokens.weight.dtype, model.model.norm.weight.dtype)
        return decode_triton if decode_triton.interpreted() and not bf16 else _references()
    if decode_triton.interpreted() or torch.cuda.get_device_capability(device) < (7, 0):
        return None  # (TRITON_INTERPRET=1 with a GPU: the interpreter takes host memory only; Triton needs sm70+)
    return decode_triton if _passes_self_test(decode_triton, model, device) else None


# The sampling kernels on the CPU (under Triton's interpreter): only where a test asks
SAMPLER_ON_CPU = False


def sampler(device):
    """`sample_triton.sample` for a rollout's decode steps on `device` where it may run - on CUDA after its self-test,
    on the meta device while `grpo_nb.simulate` stands for a GPU, on the CPU where `SAMPLER_ON_CPU` -, else None
    (the engine's PyTorch ops)."""
    from ..attention import simulated_capability

    device = torch.device(device)
    if (device.type not in ("cuda", "meta", "cpu") or (device.type == "meta" and simulated_capability.get() is None)
            or (device.type == "cpu" and not SAMPLER_ON_CPU)):
        return None
    try:
        from . import sample_triton
    except Exception:  # triton missing or broken: the engine's ops always work
        return None
    if device.type == "cuda" and (sample_triton.interpreted() or torch.cuda.get_device_capability(device) < (7, 0)):
        return None
    if device.type == "cpu" and not sample_triton.interpreted():
        return None  # (the CPU runs Triton's kernels only under its interpreter, TRITON_INTERPRET=1)
    if device.type != "cuda" or _sampler_passes_self_test(sample_triton, device):
        return sample_triton.sample
    return None


def _sampler_passes_self_test(kernels, device) -> bool:
    """The sampling kernels against the engine's arithmetic once per device: the same tokens for the same uniforms
    (none near a boundary between two tokens) and their log-probs, rows whose probability sits in the first, a
    middle or the last chunk, logits of -inf among them."""
    def check() -> bool:
        g = torch.Generator(device=device).manual_seed(0)
        vocab = 3 * kernels.CHUNK + 77
        logits = torch.randn(4, vocab, device=device, generator=g) * 3
        logits[0, :50] = logits[1, 1000:5000] = float("-inf")
        logits[2, kernels.CHUNK + 5] = logits[3, vocab - 1] = 40.0  # the mass in a middle chunk, in the last
        uniforms = torch.tensor([0.1, 0.5, 0.93, 0.7], device=device)
        tokens, logp = kernels.sample(logits, 0.7, uniforms)
        ref_tokens, ref_logp = kernels.sample_reference(logits, 0.7, uniforms)
        return bool(torch.equal(tokens, ref_tokens) and torch.allclose(logp, ref_logp, rtol=1e-4, atol=1e-4))

    return self_tested(_VERDICTS, (str(device), "sampling"), "Triton sampling kernels",
                       "PyTorch's ops for the rollout's sampling", check)


def _shapes(model) -> tuple:
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    attn = model.model.layers[0].self_attn
    heads = attn.q_proj.out_features // attn.head_dim if hasattr(attn.q_proj, "out_features") else \
        config.num_attention_heads
    kv_heads = attn.k_proj.out_features // attn.head_dim if hasattr(attn.k_proj, "out_features") else \
        config.num_key_value_heads
    return config.hidden_size, attn.head_dim, heads, kv_heads, config.intermediate_size


def _passes_self_test(kernels, model, device) -> bool:
    """The three kernels against their references at the model's dtype and widths, once per (device, dtypes,
    widths) before they are trusted."""
    decoder = model.model
    dtype = decoder.embed_tokens.weight.dtype
    norm_dtype = decoder.norm.weight.dtype
    hidden, d, heads, kv_heads, intermediate = _shapes(model)

    def check() -> bool:
        g = torch.Generator(device=device).manual_seed(0)

        def rand(*shape, scale=1.0, dt=dtype):
            return (torch.randn(*shape, device=device, generator=g) * scale).to(dt)

        def close(a, b) -> bool:
            tol = TOLERANCE.get(a.dtype, 1e-5)
            return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=tol,
                                                                                 atol=tol)

        n, L, column = 3, 5, torch.tensor([2], device=device)
        h, delta, w = rand(n, hidden, scale=3), rand(n, hidden), rand(hidden, dt=norm_dtype) / 4 + 1
        h2 = h.clone()
        ok = close(kernels.residual_norm(h, delta, w, 1e-6), kernels.residual_norm_reference(h2, delta, w, 1e-6))
        ok = ok and close(h, h2) and close(kernels.residual_norm(h, None, w, 1e-6),
                                           kernels.residual_norm_reference(h2, None, w, 1e-6))
        q, k, v = rand(n, heads * d, scale=2), rand(n, kv_heads * d, scale=2), rand(n, kv_heads * d)
        angles = rand(n, d // 2, scale=3, dt=torch.float32)
        cos, sin = (torch.cat([t, t], dim=-1).to(dtype) for t in (angles.cos(), angles.sin()))
        caches = [rand(n, kv_heads, L, d) for _ in range(2)]
        copies = [c.clone() for c in caches]
        # the adapters' branches as `lean_forward._b_products` hands them: views of one product's wider rows
        branches = rand(n, (heads + 2 * kv_heads) * d + 5).split([heads * d, kv_heads * d, kv_heads * d, 5], dim=1)
        for adds in (None, list(zip(branches[:3], (0.5, 2.0, 0.25)))):
            ok = ok and close(kernels.rope_write(q, k, v, cos, sin, *caches, column, adds),
                              kernels.rope_write_reference(q, k, v, cos, sin, *copies, column, adds).contiguous())
            ok = ok and all(close(a, b) for a, b in zip(caches, copies))
        gate, up = rand(n, intermediate, scale=3), rand(n, intermediate)
        adds = list(zip(rand(2, n, intermediate).unbind(0), (2.0, 0.5)))
        ok = ok and close(kernels.silu_mul(gate, up), kernels.silu_mul_reference(gate, up))
        ok = ok and close(kernels.silu_mul(gate, up, adds), kernels.silu_mul_reference(gate, up, adds))
        # attention over the columns up to the one written this step (some hidden, those after it never read): one
        # split, several splits of one block, several splits of several blocks (the softmax carried across them)
        for L, written in ((20, 19), (77, 59), (2200, 2000)):
            column = torch.tensor([written], device=device)
            keys, values = rand(n, kv_heads, L, d), rand(n, kv_heads, L, d)
            mask = torch.zeros(n, 1, 1, L, dtype=dtype, device=device)
            mask[..., written + 1:] = mask[0, 0, 0, :3] = mask[1, 0, 0, 7] = torch.finfo(dtype).min
            out = kernels.decode_attention(q.view(n, heads, 1, d), keys, values, mask, column, d ** -0.5)
            keys[:, :, written + 1:] = values[:, :, written + 1:] = 0
            ref = kernels.decode_attention_reference(
                *(t.float() for t in (q.view(n, heads, 1, d), keys, values, mask)), column, d ** -0.5)
            tol = ATTENTION_TOLERANCE[dtype]
            ok = ok and out.shape == ref.shape and out.dtype == dtype and torch.allclose(out.float(), ref, rtol=tol,
                                                                                         atol=tol)
        return bool(ok)

    key = (str(device), dtype, norm_dtype, hidden, d, heads, kv_heads, intermediate)
    return self_tested(_VERDICTS, key, "Triton decode-step kernels", "the model's own forward for decode steps",
                       check)
