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


def _close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 2**-7 if want.dtype == torch.bfloat16 else 1e-5  # bf16: the output's one rounding
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,D", [(1, 8), (2, 17), (4, 64), (16, 576)])
def test_residual_norm(n, D, dtype):
    g = torch.Generator().manual_seed(D)
    h = torch.randn(n, D, generator=g) * 3
    weight = torch.rand(D, generator=g) + 0.5
    delta = torch.randn(n, D + 5, generator=g).to(dtype)[:, :D]  # strided rows
    for d in (None, delta):
        want_h, want = O.reference_residual_norm(h, d, weight, 1e-6, dtype)
        mine = h.clone()
        _close(O.residual_norm(mine, d, weight, 1e-6, dtype), want)
        torch.testing.assert_close(mine, want_h, rtol=1e-6, atol=1e-6)
        assert d is not None or torch.equal(mine, h)
    # the reference is transformers' RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(D, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(weight)
        torch.testing.assert_close(O.reference_residual_norm(h, None, weight, 1e-6, torch.float32)[1], norm(h))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,H,KV,hd", [(1, 1, 1, 2), (3, 4, 2, 16), (2, 9, 3, 64), (4, 6, 6, 40)])
def test_rope_qkv_writes_q_and_the_caches_column(n, H, KV, hd, dtype):
    g = torch.Generator().manual_seed(hd)
    fused = torch.randn(n, (H + 2 * KV) * hd + 3, generator=g).to(dtype)[:, :(H + 2 * KV) * hd]
    q, k, v = fused.split([H * hd, KV * hd, KV * hd], dim=-1)  # views of one product's rows
    angles = torch.rand(n, hd // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    signed = torch.cat([-sin[:, :hd // 2], sin[:, hd // 2:]], -1)
    keys = torch.full((n, KV, 9, hd), 7.0, dtype=dtype)
    values = keys.clone()
    got = O.rope_qkv(q, k, v, cos, signed, keys[:, :, 5], values[:, :, 5])
    want_q, want_k, want_v = O.reference_rope_qkv(q, k, v, cos, signed, hd)
    assert got.shape == (n, H, 1, hd)
    _close(got[:, :, 0], want_q)
    _close(keys[:, :, 5], want_k)
    assert torch.equal(values[:, :, 5], want_v)
    others = torch.arange(9) != 5
    assert (keys[:, :, others] == 7).all() and (values[:, :, others] == 7).all()  # nothing else written
    # three separate products: the same
    separate = [t.clone() for t in (q, k, v)]
    torch.testing.assert_close(O.rope_qkv(*separate, cos, signed, keys[:, :, 6], values[:, :, 6]), got, rtol=0,
                               atol=0)
    # the reference is transformers' rotary formula
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = q.float().view(n, 1, H, hd).transpose(1, 2)
    rotated, _ = apply_rotary_pos_emb(x, x, cos[:, None], sin[:, None])
    _close(want_q, rotated[:, :, 0].to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,I", [(1, 5), (3, 16), (2, 40), (16, 1536)])
def test_silu_mul(n, I, dtype):
    g = torch.Generator().manual_seed(I)
    gate_up = (torch.randn(n, 2 * I + 1, generator=g) * 6).to(dtype)[:, :2 * I]
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's overflow and underflow
    gate, up = gate_up.chunk(2, dim=-1)
    _close(O.silu_mul(gate, up), O.reference_silu_mul(gate, up))
    torch.testing.assert_close(O.reference_silu_mul(gate, up).float(),
                               (torch.nn.SiLU()(gate.float()) * up.float()).to(dtype).float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_steps_with_them_equal_the_torch_ops(arch, dtype, monkeypatch):
    """A tiny model's decode steps with bf16 copies (fused q / k / v and gate / up) or fp32 ones (one product
    each) through `_decode_layers` (the C calls) and through the loop of torch ops: the same logits and cache to
    the copies' rounding, and the C path did run."""
    from tiny_models import adapted_tiny_model

    g = torch.Generator().manual_seed(1)
    model = adapted_tiny_model(arch, g)
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
        copies = None if dtype == torch.float32 else dtype  # None: the model's own dtype, as train() does
        with torch.no_grad(), lora.rollout_branch(cpu_dtype=copies), lora.cpu_output_head(model):
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
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    for got, want in zip(results[True][0], results[False][0]):
        torch.testing.assert_close(got, want, rtol=0, atol=(3 * tol) * want.abs().max())
    for (k, v), (wk, wv) in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(k, wk, rtol=tol, atol=tol)
        torch.testing.assert_close(v, wv, rtol=tol, atol=tol)


def test_positions_given_once_for_every_row(monkeypatch):
    """position_ids of one row for all rows (transformers broadcasts them): the rotation reads that row for each."""
    from grpo_nb.models import prepare_for_training
    from tiny_models import tiny_model

    model = prepare_for_training(tiny_model("llama"), lora_rank=4, gradient_checkpointing=False).eval()
    ids = torch.randint(4, 500, (3, 7), generator=torch.Generator().manual_seed(0))
    logits = {}
    for enabled in (True, False):
        monkeypatch.setattr(O, "ENABLED", enabled)
        call = lean_forward.LeanForward(model)
        with torch.no_grad(), lora.rollout_branch(cpu_dtype=torch.bfloat16), lora.cpu_output_head(model):
            _, cache = call(ids, None, torch.arange(7)[None], None)
            logits[enabled], _ = call(torch.tensor([[5], [6], [7]]), None, torch.tensor([[7]]), cache)
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=0.02 * logits[False].abs().max())
