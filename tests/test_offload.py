"""Offloaded gradient checkpointing (grpo_nb.offload) on the CPU, plus one CUDA-only check.

On the CPU the side stream, pinning and events are no-ops, but the same code path runs: layer
inputs are copied off (a detached clone), restored, prefetched and freed, so gradients and
the bookkeeping are tested here. Gradients are compared with `torch.equal` (bitwise): the
recompute runs exactly the forward's ops on the same inputs with the same RNG state, and the
backward runs the same ops in the same order as plain checkpointing's, so nothing is merely
close. The overlap itself is measured on a GPU by benchmarks/offload.py.
"""

import gc

import pytest
import torch

from grpo_nb.attachments import attachments
from grpo_nb.models import resolve_gradient_checkpointing, setup_reasoning_model
from grpo_nb.offload import (
    ActivationOffloader,
    disable_offloaded_checkpointing,
    enable_offloaded_checkpointing,
    find_checkpointing_layers,
)
from tiny_models import HIDDEN_SIZE, tiny_config, tiny_tokenizer

B, T = 2, 12


def enable_plain_checkpointing(model):
    """transformers' non-reentrant checkpointing, under its 5.2x name or the older one."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build(arch="llama", *, mode="offload", lora=True, dropout=0.0, layers=2, tied=False):
    """A tiny fp32 model in train mode: LoRA (non-zero B so every adapter has a gradient) or full training."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, tied=tied)
    cfg.num_hidden_layers = layers
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if mode in ("plain", "offload"):
        enable_plain_checkpointing(model)
    if lora:
        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear",
                                                 init_lora_weights=False))
    offloader = enable_offloaded_checkpointing(model, min_offload_bytes=0) if mode == "offload" else None
    model.train()
    return model, offloader


def batch():
    return torch.randint(3, 500, (B, T), generator=torch.Generator().manual_seed(0))


def loss_and_grads(model, *, use_autograd_grad=False, seed=5):
    ids = batch()
    torch.manual_seed(seed)  # the dropout masks
    loss = model(input_ids=ids, labels=ids).loss
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if use_autograd_grad:
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    else:
        loss.backward()
        grads = {n: p.grad.clone() for n, p in params.items()}
    return loss.detach(), grads


def assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert grads_a[name] is not None and torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_gradients_equal_plain_and_no_checkpointing_exactly(arch, dropout):
    reference = loss_and_grads(build(arch, mode=None, dropout=dropout)[0])
    plain = loss_and_grads(build(arch, mode="plain", dropout=dropout)[0])
    model, offloader = build(arch, mode="offload", dropout=dropout)
    offloaded = loss_and_grads(model)
    assert offloader.stats()["copies"] == 2  # the offloaded path really ran
    assert_same(offloaded, plain)
    assert_same(offloaded, reference)  # with dropout too: the recompute replays the forward's RNG state
    assert any(g.abs().sum() > 0 for g in offloaded[1].values())


@pytest.mark.parametrize("tied", [True, False])
def test_full_parameter_gradients_equal_exactly(tied):
    plain = loss_and_grads(build(mode="plain", lora=False, tied=tied)[0])
    offloaded = loss_and_grads(build(mode="offload", lora=False, tied=tied)[0])
    assert len(offloaded[1]) == len(list(build(mode=None, lora=False, tied=tied)[0].parameters()))
    assert_same(offloaded, plain)


def test_autograd_grad_equals_backward():
    plain = loss_and_grads(build(mode="plain", dropout=0.1)[0])
    model, offloader = build(mode="offload", dropout=0.1)
    offloaded = loss_and_grads(model, use_autograd_grad=True)
    assert_same(offloaded, plain)
    assert all(p.grad is None for p in model.parameters())  # autograd.grad accumulates nothing
    assert offloader.stats()["offloaded_bytes"] == 0


def test_first_layer_input_without_grad_still_gives_lora_grads():
    ids = batch()

    def run(model):
        # inputs_embeds from the frozen embedding bypass the hook that makes them require grad.
        embeds = model.get_input_embeddings()(ids).detach()
        assert not embeds.requires_grad
        loss = model(inputs_embeds=embeds, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    model, offloader = build(mode="offload")
    offloaded = run(model)
    assert offloader.stats()["copies"] == 2
    assert_same(offloaded, run(build(mode="plain")[0]))
    layer0 = {n: g for n, g in offloaded[1].items() if ".layers.0." in n}
    assert layer0 and all(g.abs().sum() > 0 for g in layer0.values())


def test_bookkeeping_bytes_prefetch_chain_and_no_growth_over_steps():
    layers = 4
    model, offloader = build(mode="offload", layers=layers)
    assert offloader.stats()["layers"] == layers
    layer_input_bytes = B * T * HIDDEN_SIZE * 4  # fp32 hidden states
    ids = batch()
    for step in range(3):
        offloader.reset_stats()
        offloader.trace = []
        loss = model(input_ids=ids, labels=ids).loss
        s = offloader.stats()
        assert s["offloaded_bytes"] == s["peak_offloaded_bytes"] == layers * layer_input_bytes
        assert s["copies"] == layers and s["prefetches"] == 0
        loss.backward()
        s = offloader.stats()
        assert s["offloaded_bytes"] == 0, f"step {step}: {s}"
        assert s["peak_offloaded_bytes"] == layers * layer_input_bytes
        assert s["prefetch_hits"] == layers - 1 and s["sync_restores"] == 1 and s["prefetches"] == layers - 1
        # Each layer's backward restores its input, then starts the previous layer's copy
        # before recomputing, so that copy overlaps the recompute.
        expected = [("offload", i, layer_input_bytes) for i in range(layers)]
        for i in reversed(range(layers)):
            expected.append(("restore", i, i != layers - 1))
            if i:
                expected.append(("prefetch", i - 1))
            expected.append(("recompute", i))
        assert offloader.trace == expected
        model.zero_grad()


def test_nothing_is_kept_without_backward_or_without_grad():
    model, offloader = build(mode="offload")
    ids = batch()
    with torch.no_grad():  # e.g. old log-probs, in train mode
        model(input_ids=ids)
    assert offloader.stats()["copies"] == 0
    loss = model(input_ids=ids, labels=ids).loss
    assert offloader.stats()["offloaded_bytes"] > 0
    del loss  # the graph is dropped without backward
    gc.collect()
    assert offloader.stats()["offloaded_bytes"] == 0


def test_second_backward_through_the_same_graph_is_refused():
    model, _ = build(mode="offload")
    loss = model(input_ids=batch(), labels=batch()).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        loss.backward()


class _TupleLayer(torch.nn.Module):
    """Returns (tensor, None, integer tensor, tensor), like older transformers layers' tuples."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x, scale, mask=None):
        h = self.drop(self.lin(x)) * scale
        return h + mask, None, torch.arange(3), h.sum(-1)


def test_tuple_outputs_none_grads_and_non_tensor_args():
    layer = _TupleLayer()
    x = torch.randn(4, 8, requires_grad=True)
    mask = torch.randn(4, 8)

    def run(checkpointed):
        layer.zero_grad()
        x.grad = None
        offloader = ActivationOffloader(min_offload_bytes=0)
        torch.manual_seed(3)
        if checkpointed:
            out = offloader.checkpoint(0, layer, lambda x_, s: layer(x_, s, mask=mask), x, 2.0)
        else:
            out = layer(x, 2.0, mask=mask)
        assert isinstance(out, tuple) and out[1] is None and out[2].dtype == torch.long and not out[2].requires_grad
        out[0].sum().backward()  # out[3] is unused: its gradient is None
        return offloader, [x.grad.clone(), layer.lin.weight.grad.clone(), layer.lin.bias.grad.clone()]

    offloader, got = run(True)
    _, want = run(False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert offloader.stats()["copies"] == 1 and offloader.stats()["offloaded_bytes"] == 0


def test_tensor_bound_by_keyword_that_requires_grad_is_refused():
    layer = _TupleLayer()
    mask = torch.randn(4, 8, requires_grad=True)
    from functools import partial

    with pytest.raises(RuntimeError, match="only positional inputs receive gradients"):
        ActivationOffloader().checkpoint(0, layer, partial(layer.forward, mask=mask), torch.randn(4, 8), 1.0)


def test_enable_is_idempotent_and_disable_restores_plain_checkpointing():
    model, first = build(mode="offload")
    second = enable_offloaded_checkpointing(model, min_offload_bytes=0)
    assert attachments(model).offloader is second and first.stats()["layers"] == 0
    disable_offloaded_checkpointing(model)
    assert attachments(model).offloader is None
    assert all(layer.gradient_checkpointing for layer in find_checkpointing_layers(model))
    assert_same(loss_and_grads(model), loss_and_grads(build(mode="plain")[0]))
    assert second.stats()["copies"] == 0


def test_enable_turns_checkpointing_on_and_refuses_models_without_layers():
    model, _ = build(mode=None)
    offloader = enable_offloaded_checkpointing(model, min_offload_bytes=0)
    assert all(layer.gradient_checkpointing for layer in find_checkpointing_layers(model))
    loss_and_grads(model)
    assert offloader.stats()["copies"] == 2
    with pytest.raises(ValueError, match="Sequential has no transformers GradientCheckpointingLayer"):
        enable_offloaded_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("lora", [False, True])
def test_model_is_freed_without_the_cyclic_gc(lora):
    import weakref

    model, offloader = build(mode="offload", lora=lora)
    loss_and_grads(model)
    layer = weakref.ref(find_checkpointing_layers(model)[0])
    gc.collect()
    gc.disable()
    try:
        del model  # GPU memory comes back at once, even while the offloader object lives on
        assert layer() is None
    finally:
        gc.enable()
    assert offloader.stats()["offloaded_bytes"] == 0


def test_gradient_checkpointing_values_are_validated_before_loading(monkeypatch):
    import grpo_nb.models as models

    def no_loading():
        raise AssertionError("validation must come before loading")

    monkeypatch.setattr(models, "embedded_default_path", no_loading)
    for bad in ("yes", "Offload", 1, None):
        with pytest.raises(ValueError, match=f"gradient_checkpointing={bad!r} is invalid: expected 'auto', 'offload', "
                                             "True or False"):
            setup_reasoning_model(gradient_checkpointing=bad)
    assert resolve_gradient_checkpointing("auto", "cuda") == "offload"
    assert resolve_gradient_checkpointing("auto", torch.device("cuda", 1)) == "offload"
    assert resolve_gradient_checkpointing("auto", "cpu") is True
    assert resolve_gradient_checkpointing("offload", "cpu") == "offload"
    assert resolve_gradient_checkpointing(False, "cuda") is False


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("value, resolved", [("auto", True), ("offload", "offload"), (True, True), (False, False)])
def test_setup_reasoning_model_modes_on_the_cpu(tiny_folder, value, resolved):
    model, tok = setup_reasoning_model(tiny_folder, lora_rank=4, gradient_checkpointing=value, device="cpu")
    base = model.get_base_model()
    assert attachments(base).gradient_checkpointing == resolved
    assert all(layer.gradient_checkpointing == bool(resolved) for layer in find_checkpointing_layers(model))
    offloader = attachments(model).offloader
    assert (offloader is not None) == (resolved == "offload")
    ids = tok(["w5 w6 w7 w8 w9"] * 2, return_tensors="pt")["input_ids"]
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_B" in n)
    if offloader is not None:
        # Default min_offload_bytes (1 KiB): the 2 x 5 x 64 fp32 inputs (2.5 KiB) are offloaded.
        assert offloader.stats()["copies"] == 2 and offloader.stats()["offloaded_bytes"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side stream, pinned memory and the overlap")
def test_cuda_offload_lowers_peak_memory_and_matches_gradients():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_nb.architectures import known_config
    from grpo_nb.logprobs import decoder_hidden_states

    cfg = known_config("HuggingFaceTB/SmolLM2-135M-Instruct")  # 30 layers, hidden 576: a real shape
    cfg._attn_implementation = "eager"  # a deterministic backward
    ids = torch.randint(0, cfg.vocab_size, (4, 1024), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)

    def run(offload):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).cuda()
        enable_plain_checkpointing(model)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear",
                                                 init_lora_weights=False))
        offloader = enable_offloaded_checkpointing(model) if offload else None
        model.train()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for _ in range(2):  # the second step reuses pinned buffers; nothing may grow
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            decoder_hidden_states(model, ids, mask).float().pow(2).mean().backward()
        torch.cuda.synchronize()
        grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
        return torch.cuda.max_memory_allocated() - base, grads, offloader

    plain_peak, plain_grads, _ = run(False)
    off_peak, off_grads, offloader = run(True)
    s = offloader.stats()
    assert s["offloaded_bytes"] == 0 and s["prefetch_hits"] == 2 * 29
    layer_inputs = 30 * 4 * 1024 * 576 * 4
    assert s["peak_offloaded_bytes"] == layer_inputs
    # Plain checkpointing keeps 30 layer inputs on the GPU; offloading keeps about 2.
    assert plain_peak - off_peak > 0.8 * (layer_inputs - 2 * layer_inputs / 30), (plain_peak, off_peak)
    # Same kernels on the same stream, so normally bitwise equal; a small tolerance keeps the
    # test about the offloading logic (wrong input or RNG state would be far off), not cuBLAS.
    for name, g in plain_grads.items():
        torch.testing.assert_close(off_grads[name], g, rtol=1e-5, atol=1e-8, msg=name)


@pytest.mark.parametrize("mode", ["offload", True])
def test_prepare_for_training_leaves_the_embedding_output_without_grad(mode):
    """transformers' and peft's checkpointing make the embedding output require grad (for reentrant checkpoints);
    grpo-nb's need not, and with it the offloaded step keeps that output (and a gradient as large) to the end."""
    import weakref

    from grpo_nb.attachments import base_model
    from grpo_nb.models import prepare_for_training
    from tiny_models import tiny_model

    def prepared():
        torch.manual_seed(0)
        model = prepare_for_training(tiny_model("llama"), max_seq_length=64, lora_rank=4, gradient_checkpointing=mode)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_()  # every adapter weight gets a gradient
        return model

    model, with_input_grads = prepared(), prepared()
    assert not base_model(model).get_input_embeddings()._forward_hooks
    base_model(with_input_grads).enable_input_require_grads()  # what transformers and peft leave on

    def run(m):
        outputs = []
        hook = base_model(m).get_input_embeddings().register_forward_hook(lambda mod, i, o: outputs.append(weakref.ref(o)))
        loss = m(input_ids=batch(), labels=batch()).loss
        gc.collect()
        alive = outputs[0]() is not None
        loss.backward()
        hook.remove()
        return alive, loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    alive, *ours = run(model)
    alive_with, *theirs = run(with_input_grads)
    assert_same(ours, theirs)
    assert alive_with  # held by its AccumulateGrad node through the backward
    if mode == "offload":
        assert not alive  # the offloader holds its own copy; nothing else keeps the output
