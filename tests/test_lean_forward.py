"""The CPU rollout's lean forward (grpo_nb.rollout.lean_forward): the model's arithmetic without its modules.

It must give the model's own logits (up to float rounding order) over a prefill with left padding, a shared-prefix
cache and decode steps, on every family it takes; say why it does not take the others; and the engine's samples
must not change with it."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from grpo_nb import lora
from grpo_nb.rollout import RolloutEngine, lean_forward
from grpo_nb.rollout.lean_forward import lean_unsupported_reason
from tiny_models import tiny_config, tiny_model


def _mistral(**overrides):
    from transformers import AutoModelForCausalLM, MistralConfig

    kw = tiny_config("llama").to_dict()
    kw = {k: kw[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                             "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id")}
    config = MistralConfig(**{**kw, "sliding_window": None, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _adapted(base, **lora_kw):
    return _changing(get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **lora_kw)))


def _changing(model):
    """lora_B starts at zero: made random, so the adapters change the outputs."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def _both(model, ids, mask, pos, cache_ref=None, cache_lean=None, lean=None, cpu_dtype=None):
    """(the model's own last-position logits and cache, a LeanForward's), inside a rollout's contexts."""
    with torch.no_grad(), lora.rollout_branch(cpu_dtype=cpu_dtype), lora.cpu_output_head(model):
        kw = {} if cache_ref is None else {"past_key_values": cache_ref}
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
        lean, cache = (lean or lean_forward.LeanForward(model))(ids, mask, pos, cache_lean)
    return out.logits[:, -1].float(), out.past_key_values, lean, cache


MODELS = {
    "llama": lambda: tiny_model("llama"),
    "llama-tied-sdpa": lambda: tiny_model("llama", tied=True, attn_implementation="sdpa"),
    "qwen2": lambda: tiny_model("qwen2"),  # biases on q, k, v
    "mistral": _mistral,
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_prefill_and_decode_equal_the_models_forward(name):
    model = _adapted(MODELS[name]())
    assert lean_unsupported_reason(model) is None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 500, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :7] = 0
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    ref, ref_cache, lean, cache = _both(model, ids, mask, pos)
    torch.testing.assert_close(lean, ref, rtol=1e-4, atol=1e-4)
    assert ref.abs().max() > 1  # not trivially small
    real = mask.bool()  # a padding column's keys are never attended to (each library computes its own there)
    for layer_ref, layer in zip(ref_cache.layers, cache.layers):
        for ours, theirs in ((layer.keys, layer_ref.keys), (layer.values, layer_ref.values)):
            torch.testing.assert_close(ours.transpose(1, 2)[real], theirs.transpose(1, 2)[real], rtol=1e-4, atol=1e-4)
    next_pos = pos[:, -1]
    lean_forward_call = lean_forward.LeanForward(model)  # one engine call's: its cache layers keep spare columns
    where = []
    for step in range(4):  # decode steps on both caches; the second half after dropping a row (compaction)
        if step == 2:
            keep = torch.tensor([0, 2])
            ref_cache.batch_select_indices(keep)
            cache.batch_select_indices(keep)
            ref, mask, next_pos = ref[keep], mask[keep], next_pos[keep]
        token = ref.argmax(-1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        next_pos = next_pos + 1
        ref, ref_cache, lean, cache = _both(model, token[:, None], mask, next_pos[:, None], ref_cache, cache,
                                            lean_forward_call)
        torch.testing.assert_close(lean, ref, rtol=1e-4, atol=1e-4)
        where.append(cache.layers[0].keys.data_ptr())
    assert where[0] == where[1] and where[2] == where[3]  # written in place, not copied, from one step to the next
    for layer_ref, layer in zip(ref_cache.layers, cache.layers):
        torch.testing.assert_close(layer.values.transpose(1, 2)[mask.bool()],
                                   layer_ref.values.transpose(1, 2)[mask.bool()], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_rollout_copies_equal_the_models_forward_on_them(name):
    """cpu_rollout_dtype="bfloat16": the same bf16 copies (q/k/v biases too) as the modules multiply by; the lean
    forward keeps the cache and attention in bf16 as well, so the logits agree to bf16 rounding, over a padded
    prefill and decode steps. grpo-nb's own LoRA layers, whose module forward multiplies by the same copies (a plain
    peft layer's computes its fp32 branch)."""
    from grpo_nb.models import prepare_for_training

    model = _changing(prepare_for_training(MODELS[name](), lora_rank=4, gradient_checkpointing=False))
    assert {type(m).__name__ for m in model.modules() if hasattr(m, "lora_A")} == {"FastLoraLinear"}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 500, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    ref, ref_cache, lean, cache = _both(model, ids, mask, pos, cpu_dtype=torch.bfloat16)
    assert {layer.keys.dtype for layer in cache.layers} == {torch.bfloat16}
    scale = ref.abs().max()
    torch.testing.assert_close(lean, ref, rtol=0, atol=0.03 * scale)
    next_pos, call = pos[:, -1], lean_forward.LeanForward(model)
    for _ in range(3):
        token = ref.argmax(-1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        next_pos = next_pos + 1
        ref, ref_cache, lean, cache = _both(model, token[:, None], mask, next_pos[:, None], ref_cache, cache, call,
                                            cpu_dtype=torch.bfloat16)
        torch.testing.assert_close(lean, ref, rtol=0, atol=0.03 * scale)
    assert {layer.keys.dtype for layer in cache.layers} == {torch.bfloat16}


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_bf16_copies_of_projections_that_share_an_input_multiply_as_one(name):
    """With bf16 copies, q / k / v (Qwen2: with their biases) and gate / up multiply as one product each: the same
    logits as one product each (the rows of a product do not depend on the others'), no memory beyond the separate
    copies (each layer's copy becomes a view of the fused weight), and the cache holds v alone, not a view of the
    whole q / k / v product. A layer whose k_proj has no adapter keeps three products (its weight is the model's);
    fp32 copies are not fused (measured no faster)."""
    from grpo_nb.models import prepare_for_training

    model = _changing(prepare_for_training(MODELS[name](), lora_rank=4, gradient_checkpointing=False))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 500, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    runs = {}
    for fuse in (True, False):
        lean_forward.FUSE = fuse
        try:
            with torch.no_grad(), lora.rollout_branch(cpu_dtype=torch.bfloat16), lora.cpu_output_head(model):
                call = lean_forward.LeanForward(model)
                logits, cache = call(ids, mask, pos, None)
                layer = model.base_model.model.model.layers[0]
                shared = {lora.rollout_weight(getattr(layer.self_attn, n))[0].untyped_storage().data_ptr()
                          for n in ("q_proj", "k_proj", "v_proj")}
                fused = call._projections[0]["qkv"], call._projections[0]["gate_up"]
                if fuse:  # a second engine call in the same rollout takes the fused weight as it is
                    again = lean_forward.LeanForward(model)
                    again(ids, mask, pos, None)
                    assert again._projections[0]["qkv"][0][0] is fused[0][0][0]
            runs[fuse] = logits, lora.last_merged_bytes, shared, fused, cache
        finally:
            lean_forward.FUSE = True
    (logits, merged_bytes, shared, fused, cache), (own, own_bytes, own_shared, unfused, _) = runs[True], runs[False]
    assert all(f is not None for f in fused) and unfused == (None, None)
    assert fused[0][1] == [64, 32, 32] and (fused[0][0][1] is not None) == (name == "qwen2")
    assert len(shared) == 1 and len(own_shared) == 3  # the three copies are views of one weight
    assert merged_bytes == own_bytes
    torch.testing.assert_close(logits, own, rtol=0, atol=1e-3 * own.abs().max())
    for layer in cache.layers:
        assert layer.values.untyped_storage().nbytes() == layer.values.numel() * layer.values.element_size()

    # q's adapter edited in place, then the model's own forward in the same rollout: q's copy is made again alone,
    # and k / v leave the rollout's copies with it (made again at their next use), so nothing keeps the old fused
    # weight alive uncounted (hostile probe X)
    with torch.no_grad(), lora.rollout_branch(cpu_dtype=torch.bfloat16), lora.cpu_output_head(model):
        lean_forward.LeanForward(model)(ids, mask, pos, None)
        for layer in model.base_model.model.model.layers:
            layer.self_attn.q_proj.lora_B["default"].weight.mul_(3)
        model(input_ids=ids, attention_mask=mask, position_ids=pos)
        copies = [copy for _, _, copy in lora._merged.values()]
        held = {c.untyped_storage().data_ptr(): c.untyped_storage().nbytes() for c in copies}
        assert sum(held.values()) == sum(c.numel() * c.element_size() for c in copies)

    # k_proj without an adapter, and fp32 copies: nothing fused, logits still the modules'
    base = MODELS[name]()
    partial = _changing(get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])))
    for dtype in (torch.bfloat16, None):
        with torch.no_grad(), lora.rollout_branch(cpu_dtype=dtype), lora.cpu_output_head(partial):
            call = lean_forward.LeanForward(partial)
            call(ids, mask, pos, None)
            assert call._projections[0]["qkv"] is None and call._projections[0]["gate_up"] is None
    fp32 = _changing(prepare_for_training(MODELS[name](), lora_rank=4, gradient_checkpointing=False))
    with torch.no_grad(), lora.rollout_branch(), lora.cpu_output_head(fp32):
        call = lean_forward.LeanForward(fp32)
        call(ids, mask, pos, None)
        assert call._projections[0]["qkv"] is None


def test_a_cached_prefix_then_padded_rows():
    """The engine's shared-prefix prefill: a prefix cached once (no mask), repeated, then each row's rest with its
    padding between the prefix and its tokens."""
    model = _adapted(tiny_model("llama", seed=2))
    g = torch.Generator().manual_seed(3)
    prefix, rest = torch.randint(4, 500, (1, 6), generator=g), torch.randint(4, 500, (2, 4), generator=g)
    ref_logits, ref_cache, lean_logits, cache = _both(model, prefix, None, torch.arange(6)[None])
    torch.testing.assert_close(lean_logits, ref_logits, rtol=1e-4, atol=1e-4)
    for c in (ref_cache, cache):
        for layer in c.layers:
            layer.keys, layer.values = layer.keys.repeat(2, 1, 1, 1), layer.values.repeat(2, 1, 1, 1)
    rest_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    layout = torch.cat([torch.ones(2, 6, dtype=torch.long), rest_mask], dim=1)
    pos = (6 + rest_mask.cumsum(-1) - 1).masked_fill(rest_mask == 0, 1)
    ref, _, lean, _ = _both(model, rest, layout, pos, ref_cache, cache)
    torch.testing.assert_close(lean, ref, rtol=1e-4, atol=1e-4)


def test_the_engine_samples_the_same_with_and_without_it(tok, monkeypatch):
    model = _adapted(tiny_model("qwen2", seed=4))
    ids, mask = tok(["w5 w6 w7 w8 w9", "w10", "w11 w12 w13"], return_tensors="pt", padding=True).values()
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(lean_forward, "LEAN_ON_CPU", on)
        engine = RolloutEngine(max_completion_length=8, seed=5, _compact_fraction=0.01)
        runs[on] = engine(model, tok, ids, mask, 3), engine.last_stats["forward"]
    (lean, how_lean), (own, how_own) = runs[True], runs[False]
    assert (how_lean, how_own) == ("lean", "model")
    assert torch.equal(lean.completion_ids, own.completion_ids)
    torch.testing.assert_close(lean.sampling_logprobs, own.sampling_logprobs, rtol=1e-4, atol=1e-4)


def test_projections_it_cannot_merge_run_their_module():
    """DoRA, and LoRA dropout in train mode, are not a merged weight: those projections run their own forward
    (and the logits still equal the model's); dropout in eval mode is the identity, so it merges."""
    dora = _adapted(tiny_model("llama"), use_dora=True)
    layer = dora.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad(), lora.rollout_branch():
        assert lora.rollout_weight(layer) is None
    ids = torch.randint(4, 500, (2, 5), generator=torch.Generator().manual_seed(0))
    ref, _, lean, _ = _both(dora, ids, None, torch.arange(5)[None].expand(2, 5))
    torch.testing.assert_close(lean, ref, rtol=1e-4, atol=1e-4)

    dropped = _adapted(tiny_model("llama"), lora_dropout=0.1)
    layer = dropped.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad(), lora.rollout_branch():
        merged = lora.rollout_weight(layer)
        assert merged is not None and not torch.equal(merged[0], layer.base_layer.weight)
    layer.lora_dropout["default"].train()
    with torch.no_grad(), lora.rollout_branch():
        assert lora.rollout_weight(layer) is None
    layer.lora_dropout["default"].eval()
    with torch.no_grad(), lora.rollout_branch():
        with dropped.disable_adapter():
            assert lora.rollout_weight(layer)[0] is layer.base_layer.weight
    assert lora.rollout_weight(layer) is None  # outside a rollout: the module's forward


def test_what_it_does_not_take_and_why():
    from transformers import AutoModelForCausalLM, Qwen3Config

    assert "sliding window" in (lean_unsupported_reason(_mistral(sliding_window=4)) or "")
    kw = {k: v for k, v in tiny_config("qwen2").to_dict().items() if k in Qwen3Config().to_dict()}
    qwen3 = AutoModelForCausalLM.from_config(Qwen3Config(**kw))
    assert "Qwen3DecoderLayer" in lean_unsupported_reason(qwen3)
    model = tiny_model("llama")
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert "hooks" in lean_unsupported_reason(model)
    handle.remove()
    assert lean_unsupported_reason(model) is None
    assert lean_forward.usable(model, exact_adapters=False) and not lean_forward.usable(model, exact_adapters=True)
    model.config.hidden_act = "gelu"
    assert "activation" in lean_unsupported_reason(model)


def test_what_it_must_not_take_silently():
    """A hostile probe's findings: each of these changes what the model computes, and the lean path must refuse."""
    import types

    from peft import PromptTuningConfig
    from transformers.models.llama import modeling_llama

    prompt = get_peft_model(tiny_model("llama"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    assert "prompt-learning" in lean_unsupported_reason(prompt)
    wrapped = _adapted(tiny_model("llama"))
    wrapped.register_forward_hook(lambda *a: None)  # on the peft wrapper, not the transformers model
    assert "hooks" in lean_unsupported_reason(wrapped)
    model = tiny_model("llama")
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()
    assert "activation" in lean_unsupported_reason(model)
    model = tiny_model("llama")
    mlp = model.model.layers[1].mlp
    mlp.forward = types.MethodType(lambda self, x: 2 * modeling_llama.LlamaMLP.forward(self, x), mlp)
    assert "instance" in lean_unsupported_reason(model)
    model = tiny_model("llama")
    copied = type("LlamaDecoderLayer", (modeling_llama.LlamaDecoderLayer,), {"__module__": "my_remote_code"})
    model.model.layers[0].__class__ = copied
    assert "not transformers' own" in lean_unsupported_reason(model)


def test_the_memory_estimate_counts_its_spare_columns(tok, monkeypatch):
    """On the CPU the estimate's rollout holds the lean forward's keys/values buffers with their spare columns (the
    planner's and train()'s memory check read it): for a class it runs, at least what the real buffers hold at the
    end of a rollout of that shape; nothing more for the modules' path."""
    from grpo_nb import estimate_vram
    from grpo_nb.memory.accounting import kv_cache_bytes

    cfg = tiny_config("llama")
    prompt, completion, rows = 8, 40, 4
    settings = dict(max_prompt_length=prompt, max_completion_length=completion, num_generations=rows, device="cpu",
                    lora_rank=4, dtype="float32")
    lean_kv = estimate_vram(cfg, **settings).categories["kv_cache"]
    monkeypatch.setattr(lean_forward, "LEAN_ON_CPU", False)
    modules_kv = estimate_vram(cfg, **settings).categories["kv_cache"]
    monkeypatch.setattr(lean_forward, "LEAN_ON_CPU", True)
    spare = kv_cache_bytes(cfg, rows, lean_forward.spare_columns(prompt + completion), 4)
    assert lean_kv - modules_kv == spare > 0

    made = []

    class Recorded(lean_forward.LeanForward):
        def __init__(self, model):
            super().__init__(model)
            made.append(self)

    monkeypatch.setattr(lean_forward, "LeanForward", Recorded)
    model = _adapted(tiny_model("llama", seed=2))
    ids, mask = tok(["w5 w6 w7 w8 w9 w10 w11 w12"], return_tensors="pt").values()
    assert ids.shape[1] == prompt
    RolloutEngine(max_completion_length=completion, min_new_tokens=completion, seed=0)(model, tok, ids, mask, rows)
    held = sum(k.nbytes + v.nbytes for _, k, v in made[-1]._room.values())
    assert kv_cache_bytes(cfg, rows, prompt + completion, 4) < held <= kv_cache_bytes(cfg, rows, prompt + completion,
                                                                                         4) + spare


def test_watching_hooks_are_called_not_refused(tok, monkeypatch):
    """simulate_step's time pass hooks the model to see where each rollout call starts (its op recorder); hooks
    marked `observing` leave a CPU rollout on the lean forward, which calls them around each forward - so the step
    priced is the one that runs. Any other hook still sends the rollout through the model's modules."""
    from grpo_nb.simulate import simulate_step

    model = _adapted(tiny_model("llama", seed=1))
    seen = []
    handle = model.get_base_model().register_forward_pre_hook(
        lean_forward.observing(lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape)), with_kwargs=True)
    assert lean_unsupported_reason(model) is None
    ids, mask = tok(["w5 w6 w7"], return_tensors="pt").values()
    engine = RolloutEngine(max_completion_length=4, min_new_tokens=4, seed=0)
    engine(model, tok, ids, mask, 2)
    assert engine.last_stats["forward"] == "lean" and seen[0] == (1, 3) and len(seen) == 4
    handle.remove()
    layer_handle = model.get_base_model().model.layers[0].register_forward_pre_hook(  # not called by it: refused
        lean_forward.observing(lambda module, args, kwargs: None), with_kwargs=True)
    assert "hooks" in lean_unsupported_reason(model)
    layer_handle.remove()
    model.get_base_model().register_forward_pre_hook(lambda module, args: None)
    assert "hooks" in lean_unsupported_reason(model)

    forwards = []
    original = lean_forward.LeanForward._forward
    monkeypatch.setattr(lean_forward.LeanForward, "_forward", lambda self, *a: forwards.append(1) or original(self, *a))
    step = simulate_step(tiny_config("llama"), max_prompt_length=16, max_completion_length=8, num_generations=2,
                         device="cpu", dtype="fp32")
    forwards.clear()
    trace = step.record_ops()
    assert {kind for kind, _, _ in trace.calls.values()} == {"prefill", "decode"}
    assert len(forwards) == len(trace.calls)


def test_a_simulated_decode_step_builds_no_mask_where_the_real_one_does_not():
    """Every column real (the simulation's forced rollouts): the real CPU decode step passes no mask to attention,
    and the simulated one, whose mask values the simulation knows, prices none either (it built one every step)."""
    from grpo_nb.simulate import simulate_step

    step = simulate_step(tiny_config("llama"), device="cpu", dtype="fp32", max_prompt_length=16,
                         max_completion_length=8, num_generations=4)
    step.time("T4")
    decode = [op.name for op in step._trace.ops if op.stage == "decode"]
    assert decode and "_scaled_dot_product_flash_attention_for_cpu" in decode
    assert "masked_fill_" not in decode and "le" not in decode  # the mask: causal (le), then masked_fill_
