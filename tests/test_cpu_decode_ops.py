"""The C steps between a CPU decode step's products (grpo_nb/kernels/cpu_decode_ops.c) against their PyTorch
references, and the lean forward's decode steps with them against its torch ops."""

from __future__ import annotations

import pytest
import torch

from grpo_nb import lora
from grpo_nb.kernels import cpu_decode_ops as O
from grpo_nb.rollout import lean_forward

if not O.available():
    # calls that build and compute other numbers are a failure, never a skip
    assert "differ from the PyTorch reference" not in (O.why_not or ""), O.why_not
    pytest.skip(f"no C compiler here to build grpo-nb's decode-step calls ({O.why_not})", allow_module_level=True)


def _bf16_close(got, want):
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("n,D", [(1, 8), (2, 17), (4, 64), (16, 576)])
def test_residual_norm(n, D):
    g = torch.Generator().manual_seed(D)
    h = torch.randn(n, D, generator=g) * 3
    weight = torch.rand(D, generator=g) + 0.5
    delta = torch.randn(n, D + 5, generator=g).bfloat16()[:, :D]  # strided rows
    for d in (None, delta):
        want_h, want = O.reference_residual_norm(h, d, weight, 1e-6)
        mine = h.clone()
        _bf16_close(O.residual_norm(mine, d, weight, 1e-6), want)
        torch.testing.assert_close(mine, want_h, rtol=0, atol=0)  # the add is exact either way
        assert d is not None or torch.equal(mine, h)


@pytest.mark.parametrize("n,H,KV,hd", [(1, 1, 1, 2), (3, 4, 2, 16), (2, 9, 3, 64), (4, 6, 6, 40)])
def test_rope_qkv_writes_q_and_the_caches_column(n, H, KV, hd):
    g = torch.Generator().manual_seed(hd)
    qkv = torch.randn(n, (H + 2 * KV) * hd + 3, generator=g).bfloat16()[:, :(H + 2 * KV) * hd]
    angles = torch.rand(n, hd // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    signed = torch.cat([-sin[:, :hd // 2], sin[:, hd // 2:]], -1)
    keys = torch.full((n, KV, 9, hd), 7.0, dtype=torch.bfloat16)
    values = keys.clone()
    q = O.rope_qkv(qkv, cos, signed, keys[:, :, 5], values[:, :, 5], H)
    want_q, want_k, want_v = O.reference_rope_qkv(qkv, cos, signed, H, KV, hd)
    assert q.shape == (n, H, 1, hd)
    _bf16_close(q[:, :, 0], want_q)
    _bf16_close(keys[:, :, 5], want_k)
    assert torch.equal(values[:, :, 5], want_v)
    others = torch.arange(9) != 5
    assert (keys[:, :, others] == 7).all() and (values[:, :, others] == 7).all()  # nothing else written
    # the reference is transformers' rotary formula
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = qkv[:, :H * hd].float().view(n, 1, H, hd).transpose(1, 2)
    rotated, _ = apply_rotary_pos_emb(x, x, cos[:, None], sin[:, None])
    _bf16_close(want_q, rotated[:, :, 0].bfloat16())


@pytest.mark.parametrize("n,I", [(1, 5), (3, 16), (2, 40), (16, 1536)])
def test_silu_mul(n, I):
    g = torch.Generator().manual_seed(I)
    gate_up = (torch.randn(n, 2 * I + 1, generator=g) * 6).bfloat16()[:, :2 * I]
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's overflow and underflow
    _bf16_close(O.silu_mul(gate_up), O.reference_silu_mul(gate_up))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_steps_with_them_equal_the_torch_ops(arch, monkeypatch):
    """A tiny model's decode steps with bf16 copies through `_decode_layers` (the C calls) and through the loop of
    torch ops: the same logits to bf16 rounding, the same cache, and the C path did run."""
    from grpo_nb.models import prepare_for_training
    from tiny_models import tiny_model

    model = prepare_for_training(tiny_model(arch), lora_rank=4, gradient_checkpointing=False).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ids = torch.randint(4, 500, (3, 7), generator=g)
    steps = torch.randint(4, 500, (4, 3, 1), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    calls = []
    monkeypatch.setattr(lean_forward.LeanForward, "_decode_layers",
                        lambda self, *a, real=lean_forward.LeanForward._decode_layers: calls.append(1) or real(self, *a))
    results = {}
    for enabled in (True, False):
        monkeypatch.setattr(O, "ENABLED", enabled)
        call, m, p, out = lean_forward.LeanForward(model), mask, pos[:, -1:], []
        with torch.no_grad(), lora.rollout_branch(cpu_dtype=torch.bfloat16), lora.cpu_output_head(model):
            last, cache = call(ids, m, pos, None)
            for i, step in enumerate(steps):
                if i == 2:  # the engine drops a finished row: the cache's buffers are made again
                    cache.batch_select_indices(torch.tensor([0, 2]))
                    m, p = m[[0, 2]], p[[0, 2]]
                m, p = torch.cat([m, torch.ones_like(m[:, :1])], 1), p + 1
                last, cache = call(step if i < 2 else step[[0, 2]], m, p, cache)
                out.append(last)
        results[enabled] = out, [(layer.keys.float(), layer.values.float()) for layer in cache.layers]
    assert len(calls) == len(steps)  # every decode step, none without the switch
    for got, want in zip(results[True][0], results[False][0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0.02 * want.abs().max())
    for (k, v), (wk, wv) in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(k, wk, rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(v, wv, rtol=2**-7, atol=1e-3)
