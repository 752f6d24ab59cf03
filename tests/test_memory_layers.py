"""Memory-only changes to the training forward must leave outputs and gradients as they were.

`grpo_nb.lora` (LoRA layers without fp32 copies of their inputs/outputs) is held against peft's own
layers, `grpo_nb.tiled_mlp` (MLPs a tile of tokens at a time) against the whole-batch MLP; and
`grpo_nb.simulate` shows what each saves at full size.
"""

import copy
import time

import pytest
import torch
from peft import LoraConfig, get_peft_model

from grpo_nb import lora as fast_lora
from grpo_nb import rms_norm
from grpo_nb.models import prepare_for_training
from grpo_nb.rms_norm import disable_lean_norms, enable_lean_norms, lean_norms
from grpo_nb.tiled_mlp import decoder_mlps, disable_tiled_mlp, enable_tiled_mlp
from tiny_models import tiny_model


def peft_pair(base, dropout=0.0):
    """peft's LoRA model and grpo-nb's, with the same (non-zero) adapter weights."""
    config = dict(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear")
    ref = get_peft_model(copy.deepcopy(base), LoraConfig(**config))
    fast_config = LoraConfig(**config)
    fast_lora.register(fast_config)
    fast = get_peft_model(copy.deepcopy(base), fast_config)
    torch.manual_seed(3)
    with torch.no_grad():
        for (name, p), (name2, q) in zip(ref.named_parameters(), fast.named_parameters()):
            assert name == name2
            if "lora_B" in name:
                p.normal_(std=0.1)
            q.copy_(p)
    return ref.train(), fast.train()


def outputs_and_grads(model, ids):
    logits = model(ids).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tile_bytes", [fast_lora.TILE_BYTES, 2048], ids=["one-tile", "many-tiles"])
def test_fast_lora_equals_peft(dtype, tile_bytes, monkeypatch):
    one_tile = tile_bytes == fast_lora.TILE_BYTES  # (asked before the patch below makes them equal in every case)
    monkeypatch.setattr(fast_lora, "TILE_BYTES", tile_bytes)
    ref, fast = peft_pair(tiny_model("llama").to(dtype))
    assert type(fast.base_model.model.model.layers[0].mlp.up_proj).__name__ == "FastLoraLinear"
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    out_ref, grads_ref = outputs_and_grads(ref, ids)
    out, grads = outputs_and_grads(fast, ids)
    # One tile: the very same forward products as peft's. Gradients sum the same products in
    # another order (addmm into zeros, tiles): float rounding apart, equal.
    if one_tile:
        assert torch.equal(out, out_ref)
    grad_tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=1e-5)
    torch.testing.assert_close(out, out_ref, **grad_tol)
    assert grads.keys() == grads_ref.keys() and len(grads) == 2 * 7 * 2
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], **grad_tol)
    with fast.disable_adapter(), ref.disable_adapter():  # peft's own paths still work
        torch.testing.assert_close(fast(ids).logits, ref(ids).logits)
    with torch.no_grad():  # rollouts and evaluation: the same arithmetic without autograd's bookkeeping
        if one_tile:
            assert torch.equal(fast(ids).logits, ref(ids).logits)
        torch.testing.assert_close(fast(ids).logits, ref(ids).logits, **grad_tol)


def test_fast_lora_over_4bit_equals_peft(tmp_path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama").save_pretrained(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(  # a real NF4 model on the CPU, as load_in_4bit loads it
        tmp_path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                         bnb_4bit_use_double_quant=True,
                                                         bnb_4bit_compute_dtype=torch.float32),
        device_map={"": "cpu"}, dtype=torch.float32)
    ref, fast = peft_pair(base)
    assert type(fast.base_model.model.model.layers[0].mlp.up_proj).__name__ == "FastLoraLinear4bit"
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    out_ref, grads_ref = outputs_and_grads(ref, ids)
    out, grads = outputs_and_grads(fast, ids)
    assert torch.equal(out, out_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-6)


def test_fast_lora_defers_to_peft_where_it_does_not_apply():
    ref, fast = peft_pair(tiny_model("llama"), dropout=0.1)  # dropout: peft's forward (its masks, its RNG)
    ids = torch.randint(0, 500, (1, 8))
    torch.manual_seed(0)
    a = ref(ids).logits
    torch.manual_seed(0)
    b = fast(ids).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "view"])
def test_lora_add_keeps_no_view_for_autograd_to_guard(layout):
    """The branch is added into the base output itself (3-D, as a layer gives it): a flattened view there made
    autograd copy every incoming gradient in backward (CopySlices). Outputs a view or strided (bitsandbytes' 4-bit
    product returns a view) get a new tensor instead; values and gradients equal peft's expression in every case."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 5, 12, generator=g)
    w, a0, b0 = torch.randn(10, 12, generator=g), torch.randn(4, 12, generator=g), torch.randn(10, 4, generator=g)
    grads = {}
    for fast in (True, False):
        x, a, b = (t.clone().requires_grad_() for t in (x0, a0, b0))
        base = x @ w.t()
        if layout == "transposed":
            base = (w @ x.transpose(1, 2)).transpose(1, 2)
        elif layout == "view":
            base = (x @ w.t()).view(2, 5, 10)
        if fast:
            out = fast_lora.lora_add(base, x, a, b, 0.5, add_in_fp32=True)
            if layout == "contiguous":
                assert out is base and type(out.grad_fn).__name__ == "_LoraAddBackward"
        else:
            out = base + (x @ a.t()) @ b.t() * 0.5
        (out * torch.arange(100.0).view(2, 5, 10)).sum().backward()
        grads[fast] = out.detach(), x.grad, a.grad, b.grad
    assert torch.equal(grads[True][0], grads[False][0])
    for fast_grad, ref_grad in zip(grads[True][1:], grads[False][1:]):
        torch.testing.assert_close(fast_grad, ref_grad, rtol=1e-5, atol=1e-5)


def test_what_the_lora_add_probe_found():
    """A hostile probe of the LoRA add (2026-11-29), each case against peft's own arithmetic."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 8, generator=g), torch.randn(6, 8, generator=g)
    a, b = torch.randn(2, 8, generator=g), torch.randn(6, 2, generator=g)
    # A second derivative through it would be wrong (x @ A.T is kept without its graph): it raises instead.
    xg, ag, bg = (t.clone().requires_grad_() for t in (x, a, b))
    out = fast_lora.lora_add(xg @ w.t(), xg, ag, bg, 0.5, add_in_fp32=True)
    (grad_b,) = torch.autograd.grad((out ** 2).sum(), bg, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_b.sum().backward()
    # Adapters narrower than the base output (an fp32 base, bf16 adapters): peft sums in the wider dtype.
    a16, b16 = a.bfloat16(), b.bfloat16()
    with torch.no_grad():
        expected = x @ w.t() + (x.bfloat16() @ a16.t() @ b16.t()) * 0.5
        assert expected.dtype == torch.float32
        assert torch.equal(fast_lora.lora_add(x @ w.t(), x, a16, b16, 0.5, add_in_fp32=True), expected)
        # A base output that shares memory between its elements (expanded) is not written in place.
        shared = torch.ones(1, 6).expand(3, 6)
        assert torch.equal(fast_lora.lora_add(shared, x, a, b, 0.5, add_in_fp32=True),
                           torch.ones(3, 6) + (x @ a.t() @ b.t()) * 0.5)
    # A base layer that returns its input (an identity wrapper): the branch is not written into the caller's tensor.
    b8 = torch.randn(8, 2, generator=g)
    kept = x.clone()
    with torch.no_grad():
        out = fast_lora.lora_add(x, x, a, b8, 0.5, add_in_fp32=True)
    assert torch.equal(x, kept) and torch.equal(out, kept + (kept @ a.t() @ b8.t()) * 0.5)
    for fast in (True, False):
        xg = kept.clone().requires_grad_()
        inner = xg * 1.0  # the layer's input, as the previous layer hands it over
        out = fast_lora.lora_add(inner, inner, a, b8, 0.5, add_in_fp32=True) if fast \
            else inner + (inner @ a.t() @ b8.t()) * 0.5
        (out * torch.arange(24.0).view(3, 8)).sum().backward()
        assert torch.equal(inner.detach(), kept)
        grads = xg.grad if fast else grads
    torch.testing.assert_close(grads, xg.grad)
    # The same memory behind another storage object (a NumPy or DLPack round trip): still the caller's tensor.
    for other_storage in (lambda t: torch.from_numpy(t.numpy()), lambda t: torch.from_dlpack(t)):
        kept_a = a.clone().requires_grad_()
        xc = kept.clone()
        out = fast_lora.lora_add(other_storage(xc), xc, kept_a, b8, 0.5, add_in_fp32=True)
        assert torch.equal(xc, kept)
        out.sum().backward()
        reference = a.clone().requires_grad_()
        (kept + (kept @ reference.t() @ b8.t()) * 0.5).sum().backward()
        torch.testing.assert_close(kept_a.grad, reference.grad)
    # On the meta device (the simulation) a base output of its own is still written in place: every meta tensor's
    # storage address is 0, so an address test would have taken each for an alias (a copy the real step never makes).
    base = torch.empty(3, 6, device="meta")
    with torch.no_grad():
        out = fast_lora.lora_add(base, x.to("meta"), a.to("meta"), b.to("meta"), 0.5, add_in_fp32=True)
    assert torch._C._is_alias_of(out, base)
    xm = torch.empty(3, 8, device="meta", requires_grad=True)
    base = xm @ w.t().to("meta")
    out = fast_lora.lora_add(base, xm, a.to("meta"), b.to("meta"), 0.5, add_in_fp32=True)
    assert out.grad_fn.name() == "_LoraAddBackward" and torch._C._is_alias_of(out, base)


def test_16_bit_adapters_gradients_do_not_lose_accuracy_over_tiles(monkeypatch):
    """bf16 adapters: the adapters' gradients summed over 128 tiles stay as accurate (against fp64) as peft's one
    product - summed tile by tile in bf16 their error grew 3.7x."""
    g = torch.Generator().manual_seed(0)
    x, w, grad_out = torch.randn(2048, 256, generator=g), torch.randn(512, 256, generator=g) * 0.05, \
        torch.randn(2048, 512, generator=g)
    a, b = (torch.randn(8, 256, generator=g) * 0.05).bfloat16(), (torch.randn(512, 8, generator=g) * 0.05).bfloat16()
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    ((x.double() @ a64.t() @ b64.t()) * (7 / 3) * grad_out.double()).sum().backward()
    monkeypatch.setattr(fast_lora, "TILE_BYTES", 2**15)  # 16 rows of 512 fp32 a tile: 128 tiles
    errors = []
    for fast in (True, False):
        ag, bg = a.clone().requires_grad_(), b.clone().requires_grad_()
        base = x @ w.t()
        out = (fast_lora.lora_add(base, x, ag, bg, 7 / 3, add_in_fp32=True) if fast
               else base + (x.bfloat16() @ ag.t() @ bg.t()) * (7 / 3))  # peft's expression
        (out * grad_out).sum().backward()
        errors.append([float((p.grad.double() - ref).norm() / ref.norm()) for p, ref in ((ag, a64.grad), (bg, b64.grad))])
    (fast_a, fast_b), (peft_a, peft_b) = errors
    assert fast_a <= 1.2 * peft_a and fast_b <= 1.2 * peft_b


def test_lora_layers_defer_to_peft_for_hooks_subclassed_bases_and_mixed_dtype_adapters():
    ref, fast = peft_pair(tiny_model("llama"))
    ids = torch.randint(0, 500, (2, 6), generator=torch.Generator().manual_seed(0))
    fast_layer = fast.base_model.model.model.layers[0].mlp.up_proj
    ref_layer = ref.base_model.model.model.layers[0].mlp.up_proj
    # A hook on the base layer sees the base output alone, as under peft (the branch was added into it in place).
    kept = {}
    for name, layer in (("ref", ref_layer), ("fast", fast_layer)):
        layer.base_layer.register_forward_hook(lambda m, i, o, name=name: kept.__setitem__(name, (o, o.clone())))
    with torch.no_grad():
        assert torch.equal(fast(ids).logits, ref(ids).logits)
    assert torch.equal(kept["fast"][0], kept["fast"][1]) and torch.equal(kept["fast"][1], kept["ref"][1])

    # A base that subclasses nn.Linear with a forward of its own: a CPU rollout does not merge past it.
    class Clamped(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x).clamp(-0.01, 0.01)

    layer = fast.base_model.model.model.layers[0].mlp.down_proj
    layer.base_layer.__class__ = Clamped
    with torch.no_grad():
        own = fast(ids).logits
        with fast_lora.rollout_branch():  # (the other layers' merged copies round differently: ~1e-7)
            torch.testing.assert_close(fast(ids).logits, own, rtol=1e-5, atol=1e-5)

    # Two active adapters over a bf16 base: peft sums both in fp32 and rounds once.
    ref, fast = peft_pair(tiny_model("llama").to(torch.bfloat16))
    for model in (ref, fast):
        model.add_adapter("other", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
        model.base_model.set_adapter(["default", "other"])
    with torch.no_grad():
        for (name, p), (_, q) in zip(ref.named_parameters(), fast.named_parameters()):
            q.copy_(p)
        assert torch.equal(fast(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("checkpointing", [True, "offload", False])
def test_tiled_mlp_equals_whole_mlp(checkpointing):
    def prepared(tile):
        torch.manual_seed(0)
        model = prepare_for_training(tiny_model("llama"), lora_rank=4, gradient_checkpointing=checkpointing)
        if tile:
            assert enable_tiled_mlp(model, tile_tokens=5) == 2  # 24 tokens: 5 tiles per MLP
        else:
            disable_tiled_mlp(model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.1, generator=torch.Generator().manual_seed(1))
        return model

    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    whole, tiled = prepared(False), prepared(True)
    assert all("forward" not in vars(m) for m in decoder_mlps(whole))
    out_ref, grads_ref = outputs_and_grads(whole, ids)
    out, grads = outputs_and_grads(tiled, ids)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # rollouts and log-prob passes: tiles one after the other
        torch.testing.assert_close(tiled(ids).logits, whole(ids).logits, rtol=1e-5, atol=1e-6)
    assert [n for n, _ in tiled.named_parameters()] == [n for n, _ in whole.named_parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tile_bytes", [rms_norm.TILE_BYTES, 1024], ids=["one-tile", "many-tiles"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_norm_equals_the_models_norm(arch, dtype, tile_bytes, monkeypatch):
    monkeypatch.setattr(rms_norm, "TILE_BYTES", tile_bytes)
    model = tiny_model(arch).to(dtype)
    norm = lean_norms(model)[0]
    assert len(lean_norms(model)) == 2 * 2 + 1  # two per layer and the final one
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 7, 64, dtype=dtype, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(3, 7, 64, dtype=dtype, generator=torch.Generator().manual_seed(2))
    norm.weight.requires_grad_(True)
    ref = norm(x)
    ref_grads = torch.autograd.grad(ref, (x, norm.weight), g)
    assert enable_lean_norms(model) == 5
    out = norm(x)
    grads = torch.autograd.grad(out, (x, norm.weight), g)
    assert torch.equal(out, ref)  # the same roundings, in the same order
    with torch.no_grad():  # without gradients too (one tile: the formula itself; many: the tiled function)
        assert torch.equal(norm(x), ref) and torch.equal(norm(x[:1, :1]), ref[:1, :1])
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **tol)
    disable_lean_norms(model)
    assert "forward" not in vars(norm)


def test_memory_layers_lower_the_simulated_peak(monkeypatch):
    """What each change saves, at Qwen2.5-0.5B's shapes (short sequences here; the benchmark has the seeds')."""
    from grpo_nb import models
    from grpo_nb.simulate import simulate_step

    def update_peak():
        step = simulate_step("Qwen/Qwen2.5-0.5B-Instruct", max_prompt_length=64, max_completion_length=1024,
                             num_generations=4, rollout=False, gradient_checkpointing="offload")
        return step.phases["policy update"]["peak"]

    lean = update_peak()
    monkeypatch.setattr(models, "prepare_for_training", _without(models.prepare_for_training, disable_lean_norms))
    no_norms = update_peak()
    monkeypatch.setattr(models, "prepare_for_training", _without(models.prepare_for_training, disable_tiled_mlp))
    no_tiling = update_peak()
    monkeypatch.setattr(fast_lora, "register", lambda config: None)
    none = update_peak()
    assert lean < no_norms < no_tiling < none
    assert none - lean > 0.15e9  # 0.21 GB at 4 x 1088 tokens; 1.4 GB at Qwen2.5-1.5B's 8 x 1280


def _without(prepare, disable):
    def wrapped(model, **kwargs):
        model = prepare(model, **kwargs)
        disable(model)
        return model
    return wrapped


def test_rollout_branch_in_the_model_dtype(monkeypatch):
    """Inside rollout_branch() a 16-bit model's no-grad forward runs the LoRA branch in its dtype from copies of
    the adapters (remade when an adapter changes in place); forwards with gradients and fp32 models keep peft's
    exact arithmetic. (The GPU's path: on the CPU a rollout merges the adapters instead, tested below.)"""
    monkeypatch.setattr(fast_lora, "MERGE_ON_CPU", False)
    ref, fast = peft_pair(tiny_model("llama").to(torch.bfloat16))
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = ref(ids).logits
        with fast_lora.rollout_branch():
            quick = fast(ids).logits
            copies = dict(fast_lora._rollout_copies)
            assert len(copies) == 2 * 7 * 2 and {c.dtype for _, _, c in copies.values()} == {torch.bfloat16}
        assert fast_lora._rollout_copies is None  # released with the rollout
    assert not torch.equal(quick, exact)  # another rounding ...
    torch.testing.assert_close(quick, exact, rtol=0.05, atol=0.1)  # ... of the same function
    # an adapter changed in place inside the rollout: its copy is made again
    with torch.no_grad(), fast_lora.rollout_branch():
        fast(ids)
        for (n, p), (_, q) in zip(ref.named_parameters(), fast.named_parameters()):
            if "lora_B" in n:
                p.mul_(-1), q.mul_(-1)
        torch.testing.assert_close(fast(ids).logits, ref(ids).logits, rtol=0.05, atol=0.1)
        assert not torch.equal(fast(ids).logits, quick)
    with fast_lora.rollout_branch():  # a forward with gradients: the exact path
        assert torch.equal(fast(ids).logits, ref(ids).logits)
    ref32, fast32 = peft_pair(tiny_model("llama"))
    with torch.no_grad(), fast_lora.rollout_branch():  # fp32 model: nothing to gain, the exact path
        assert torch.equal(fast32(ids).logits, ref32(ids).logits)
        assert fast_lora._rollout_copies == {}
    with torch.no_grad(), fast_lora.rollout_branch(enabled=False):
        assert torch.equal(fast(ids).logits, ref(ids).logits)
    with torch.no_grad(), fast_lora.rollout_branch():  # an exact engine called inside a rollout: exact inside
        with fast_lora.rollout_branch(enabled=False):
            assert torch.equal(fast(ids).logits, ref(ids).logits)
        assert not torch.equal(fast(ids).logits, ref(ids).logits) and fast_lora._rollout_copies


def test_cpu_rollout_merges_the_adapters(monkeypatch):
    """On the CPU a rollout's no-grad forward multiplies by merged copies W + s * B @ A, made at a layer's first
    call, made again when an adapter changes in place, released with the rollout; the training weights untouched;
    forwards with gradients, exact engines and a full memory budget keep peft's arithmetic."""
    ref, fast = peft_pair(tiny_model("llama"))
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in fast.named_parameters()}
    with torch.no_grad():
        exact = ref(ids).logits
        with fast_lora.rollout_branch():
            merged = fast(ids).logits
            assert len(fast_lora._merged) == 2 * 7  # every adapted linear layer of the 2-layer model
            assert {m.dtype for _, _, m in fast_lora._merged.values()} == {torch.float32}
            for (n, p), (_, q) in zip(ref.named_parameters(), fast.named_parameters()):
                if "lora_B" in n:
                    p.mul_(-1), q.mul_(-1)  # in place: the merged copies are made again
            flipped = fast(ids).logits
            torch.testing.assert_close(flipped, ref(ids).logits, rtol=1e-4, atol=1e-5)
        assert fast_lora._merged is None  # released with the rollout
    assert not torch.equal(merged, exact)  # another rounding ...
    torch.testing.assert_close(merged, exact, rtol=1e-4, atol=1e-5)  # ... of the same function
    assert not torch.allclose(flipped, merged, rtol=1e-4, atol=1e-5)
    for n, p in fast.named_parameters():  # the training weights: only the flipped adapters changed
        assert torch.equal(p, -before[n] if "lora_B" in n else before[n]), n
    for (n, p), (_, q) in zip(ref.named_parameters(), fast.named_parameters()):
        if "lora_B" in n:
            p.data.mul_(-1), q.data.mul_(-1)
    with fast_lora.rollout_branch():  # a forward with gradients: the exact path
        assert torch.equal(fast(ids).logits, ref(ids).logits)
    with torch.no_grad(), fast_lora.rollout_branch(enabled=False):  # an exact engine
        assert torch.equal(fast(ids).logits, exact)
    monkeypatch.setattr(fast_lora, "available_host_bytes", lambda: 0)  # no room for copies: the branch
    with torch.no_grad(), fast_lora.rollout_branch():
        assert torch.equal(fast(ids).logits, exact) and fast_lora._merged == {}


@pytest.mark.parametrize("rows", [1, 4, 16, 17])
def test_skinny_linear_equals_linear(rows):
    """A CPU decode step's few rows multiply as F.linear or W @ x.T, whichever is faster here; every call (the timed
    ones of both products, then the chosen one's) is F.linear's product, contiguous."""
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(1, rows, 48, generator=g), torch.randn(80, 48, generator=g), torch.randn(80, generator=g)
    for bias in (None, b):
        for _ in range(2 * fast_lora._PRODUCTS.trials + 1):
            out = fast_lora.skinny_linear(x, w, bias)
            assert out.shape == (1, rows, 80) and out.is_contiguous()
            torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    if rows <= fast_lora.SKINNY_ROWS:
        assert fast_lora._PRODUCTS.chosen[(rows, torch.Size([80, 48]), torch.float32)] in fast_lora._PRODUCTS.products


def test_product_choice_keeps_the_faster_product():
    calls = []

    def slow(v):
        calls.append("slow")
        time.sleep(0.02)
        return v + 1

    def fast(v):
        calls.append("fast")
        return v + 1

    choice = fast_lora.ProductChoice({"slow": slow, "fast": fast}, trials=3)
    assert [choice.run("k", 1) for _ in range(10)] == [2] * 10
    assert choice.chosen == {"k": "fast"} and calls[:6].count("slow") == 3 and calls[6:] == ["fast"] * 4
    choice.run("other", 1)  # another key times its own
    assert "other" not in choice.chosen


def test_cpu_rollout_merges_into_bf16_when_asked():
    """cpu_dtype=bfloat16: the rollout's merged copies and the output head's in bf16 (half the bytes), rows cast to
    them and back, logits the fp32 model's to bf16 rounding; the training weights and the fp32 path untouched."""
    ref, fast = peft_pair(tiny_model("llama"))
    ids = torch.randint(0, 500, (3, 12), generator=torch.Generator().manual_seed(1))
    before = {n: p.detach().clone() for n, p in fast.named_parameters()}
    with torch.no_grad():
        exact = ref(ids, logits_to_keep=1).logits
        with fast_lora.rollout_branch(), fast_lora.cpu_output_head(fast):
            merged32 = fast(ids, logits_to_keep=1).logits
        fp32_bytes = fast_lora.last_merged_bytes
        with fast_lora.rollout_branch(cpu_dtype=torch.bfloat16), fast_lora.cpu_output_head(fast):
            merged16 = fast(ids, logits_to_keep=1).logits
            assert {m.dtype for _, _, m in fast_lora._merged.values()} == {torch.bfloat16}
            assert len(fast_lora._merged) == 2 * 7 + 1  # the adapted layers and the output head
            with fast_lora.rollout_branch():  # an inner rollout keeps the outer one's dtype
                assert fast_lora._merge_dtype == torch.bfloat16
        head = fast.get_output_embeddings().weight
        assert fast_lora.last_merged_bytes == fp32_bytes // 2 + head.numel() * 2
        assert fast_lora._merge_dtype is None
    assert merged16.dtype == torch.float32 and not torch.allclose(merged16, exact, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(merged16, exact, rtol=0.05, atol=0.05)  # bf16's rounding of the same function
    torch.testing.assert_close(merged32, exact, rtol=1e-4, atol=1e-5)
    for n, p in fast.named_parameters():
        assert torch.equal(p, before[n]) and p.dtype == torch.float32, n


def test_engine_cpu_dtype_is_checked_and_reaches_the_merge(monkeypatch):
    from grpo_nb import GRPOConfig
    from grpo_nb.rollout import RolloutEngine
    from grpo_nb.rollout import engine as engine_module

    for bad in ("fp16", torch.float16, "float32", 16):
        with pytest.raises(ValueError, match="cpu_dtype=.*expected None .* or 'bfloat16'"):
            RolloutEngine(max_completion_length=4, cpu_dtype=bad)
    assert RolloutEngine(max_completion_length=4, cpu_dtype="bfloat16").cpu_dtype == torch.bfloat16
    engine_module.cpu_has_bf16.cache_clear()
    with monkeypatch.context() as patch:
        patch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
        with pytest.warns(RuntimeWarning, match="no bf16 instructions"):
            RolloutEngine(max_completion_length=4, cpu_dtype=torch.bfloat16)
    engine_module.cpu_has_bf16.cache_clear()
    with pytest.raises(ValueError, match="GRPOConfig.cpu_rollout_dtype='float16'.*allowed: None"):
        GRPOConfig(cpu_rollout_dtype="float16")
    with pytest.raises(ValueError, match="cpu_rollout_dtype='None'.*None itself, not the text"):
        GRPOConfig(cpu_rollout_dtype="None")  # a config file's string
    assert GRPOConfig(cpu_rollout_dtype=torch.bfloat16,
                      rollout_importance_sampling_correction=True).cpu_rollout_dtype == "bfloat16"
    seen = []
    real = fast_lora._merged_weight
    monkeypatch.setattr(fast_lora, "_merged_weight", lambda layer, active: seen.append(fast_lora._merge_dtype)
                        or real(layer, active))
    from tiny_models import tiny_tokenizer

    model, tok = prepare_for_training(tiny_model("llama"), lora_rank=4, gradient_checkpointing=False), tiny_tokenizer()
    ids = torch.randint(5, 100, (2, 6))
    batch = RolloutEngine(max_completion_length=3, cpu_dtype="bfloat16", seed=0)(
        model, tok, ids, torch.ones_like(ids), 2)
    assert batch.completion_ids.shape[0] == 4 and set(seen) == {torch.bfloat16}


def test_cpu_rollout_dtype_says_when_it_does_nothing_or_nothing_corrects_it():
    import warnings

    from grpo_nb import GRPOConfig
    from grpo_nb.rollout import make_rollout

    model = prepare_for_training(tiny_model("llama"), lora_rank=4, gradient_checkpointing=False)
    settings = dict(num_generations=2, per_device_train_batch_size=2, max_completion_length=4,
                    cpu_rollout_dtype="bfloat16")
    corrected = dict(settings, rollout_importance_sampling_correction=True)
    uncorrected = dict(settings, rollout_importance_sampling_correction=False)
    with pytest.warns(UserWarning, match="samples from bf16-rounded weights.*set rollout_importance_sampling_correction"):
        make_rollout("native", model, None, GRPOConfig(**uncorrected))
    for kind, config, why in (("hf", corrected, "rollout='hf' generates with its own arithmetic"),
                              ("native", dict(uncorrected, num_iterations=2),
                               "with num_iterations=2 and no rollout correction")):
        with pytest.warns(UserWarning, match=f"cpu_rollout_dtype='bfloat16' has no effect in this run: {why}"):
            make_rollout(kind, model, None, GRPOConfig(**config))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_rollout("native", model, None, GRPOConfig(**corrected)).cpu_dtype == torch.bfloat16
        # bf16 asked for, the correction left to its default: it comes on with it
        assert make_rollout("native", model, None, GRPOConfig(**settings)).cpu_dtype == torch.bfloat16


def test_merged_copies_follow_the_active_adapters_and_their_scaling():
    """A rollout's merged copy is made again when set_adapter() or a scaling changes inside it (hostile probe)."""
    model = prepare_for_training(tiny_model("llama"), lora_rank=4, gradient_checkpointing=False)
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    ids = torch.randint(5, 100, (2, 6))
    expect = {}
    with torch.no_grad():
        for name in ("default", "b"):
            model.set_adapter(name)
            expect[name] = model(ids).logits
        with fast_lora.rollout_branch():
            for name in ("default", "b", "default"):
                model.set_adapter(name)
                torch.testing.assert_close(model(ids).logits, expect[name], rtol=1e-4, atol=1e-5)
            layer = model.get_base_model().model.layers[0].self_attn.q_proj
            merged = fast_lora._merged_weight(layer, ["default"])
            layer.scaling["default"] *= 0
            torch.testing.assert_close(fast_lora._merged_weight(layer, ["default"]), layer.base_layer.weight)
            assert not torch.equal(merged, layer.base_layer.weight)
    assert fast_lora.skinny_linear(torch.randn(3, 0), torch.randn(80, 0), torch.ones(80)).equal(torch.ones(3, 80))


def test_cpu_output_head_is_set_for_the_rollout_only():
    model = tiny_model("llama")
    head = model.get_output_embeddings()
    ids = torch.randint(5, 100, (2, 6))
    ref = model(ids).logits
    with fast_lora.cpu_output_head(model):
        assert "forward" in head.__dict__
        torch.testing.assert_close(model(ids, logits_to_keep=1).logits, ref[:, -1:], rtol=1e-5, atol=1e-5)
    assert "forward" not in head.__dict__
    head.register_forward_hook(lambda *a: None)  # someone else's hook on the head: left alone
    with fast_lora.cpu_output_head(model):
        assert "forward" not in head.__dict__
