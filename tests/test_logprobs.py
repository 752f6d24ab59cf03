"""selective_logprobs / completion_logprobs against the plain full-logits computation."""

from __future__ import annotations

import pytest
import torch

from grpo_nb.logprobs import (completion_logprobs, decoder_hidden_states, output_head, selective_logprobs,
                              token_entropies)
try:
    from tests.tiny_models import MODEL_CASES, MODEL_IDS, VOCAB_SIZE, tiny_model
except ImportError:  # tests/ itself on sys.path (plain `pytest`)
    from tiny_models import MODEL_CASES, MODEL_IDS, VOCAB_SIZE, tiny_model

ATOL = 1e-5
RTOL = 1e-5


def close(actual, expected, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------
# selective_logprobs


def reference_logprobs(h, w, tokens, temperature=1.0, scale=1.0, softcap=None):
    z = (h @ w.t()).float()
    z = z * scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def make_inputs(shape, hidden=32, vocab=101, seed=0, std=1.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=g) * std
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    tokens = torch.randint(0, vocab, shape, generator=g)
    upstream = torch.randn(*shape, generator=g)  # a non-trivial incoming gradient
    return h, w, tokens, upstream


def check_against_reference(shape, *, temperature=1.0, chunk_size=None, scale=1.0, softcap=None,
                            h_grad=True, w_grad=True, seed=0, std=1.0):
    h, w, tokens, upstream = make_inputs(shape, seed=seed, std=std)
    h1, w1 = h.clone().requires_grad_(h_grad), w.clone().requires_grad_(w_grad)
    h2, w2 = h.clone().requires_grad_(h_grad), w.clone().requires_grad_(w_grad)

    ours = selective_logprobs(h1, w1, tokens, temperature=temperature, chunk_size=chunk_size,
                              logit_scale=scale, logit_softcap=softcap)
    ref = reference_logprobs(h2, w2, tokens, temperature, scale, softcap)
    assert ours.shape == tokens.shape
    assert ours.dtype == torch.float32
    close(ours, ref)

    (ours * upstream).sum().backward()
    (ref * upstream).sum().backward()
    if h_grad:
        close(h1.grad, h2.grad)
    else:
        assert h1.grad is None
    if w_grad:
        close(w1.grad, w2.grad)
    else:
        assert w1.grad is None


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_size", [None, 1, 5, 8, 37, 1000])
@pytest.mark.parametrize("shape", [(37,), (3, 13)], ids=["2d", "3d"])
def test_matches_full_logits(shape, chunk_size, temperature):
    # 37 rows (2-D) and 39 rows (3-D): chunk sizes 5 and 8 leave a ragged last chunk.
    check_against_reference(shape, temperature=temperature, chunk_size=chunk_size)


@pytest.mark.parametrize("scale,softcap", [(0.25, None), (1.0, 5.0), (2.0, 3.0), (0.0625, 30.0)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_logit_scale_and_softcap(scale, softcap, temperature, chunk_size):
    # Large hidden states so the soft-cap's tanh is well into its non-linear range.
    check_against_reference((2, 11), temperature=temperature, chunk_size=chunk_size,
                            scale=scale, softcap=softcap, std=3.0)


@pytest.mark.parametrize("temperature,scale,softcap", [(1.0, 1.0, None), (0.7, 0.5, 4.0)])
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_token_entropies_match_full_softmax(temperature, scale, softcap, chunk_size):
    h, w, _, _ = make_inputs((3, 13), std=2.0)
    z = (h @ w.t()) * scale
    z = (torch.tanh(z / softcap) * softcap if softcap else z) / temperature
    reference = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    ours = token_entropies(h, w, temperature=temperature, chunk_size=chunk_size, logit_scale=scale,
                           logit_softcap=softcap)
    close(ours, reference)
    assert ours.shape == (3, 13) and not ours.requires_grad


@pytest.mark.parametrize("h_grad,w_grad", [(True, False), (False, True)])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_only_one_input_requires_grad(h_grad, w_grad, softcap):
    check_against_reference((4, 9), temperature=0.8, chunk_size=6, softcap=softcap, scale=1.5,
                            h_grad=h_grad, w_grad=w_grad, std=2.0)


def test_no_grad_inputs_give_plain_tensor():
    h, w, tokens, _ = make_inputs((5, 3))
    out = selective_logprobs(h, w, tokens, chunk_size=4)
    assert not out.requires_grad
    close(out, reference_logprobs(h, w, tokens))


def test_int32_tokens_and_extreme_logits_are_finite():
    h, w, tokens, _ = make_inputs((2, 7), std=200.0)  # logits in the thousands
    out = selective_logprobs(h, w, tokens.int(), chunk_size=3)
    assert torch.isfinite(out).all()
    close(out, reference_logprobs(h, w, tokens), atol=1e-3, rtol=1e-5)


def test_noncontiguous_inputs():
    h, w, tokens, upstream = make_inputs((3, 10))
    h_t = h.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # non-contiguous view
    w_t = w.t().contiguous().t().requires_grad_()
    assert not h_t.is_contiguous() and not w_t.is_contiguous()
    ours = selective_logprobs(h_t[:, 1:], w_t, tokens[:, 1:], chunk_size=4)
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = reference_logprobs(h2[:, 1:], w2, tokens[:, 1:])
    close(ours, ref)
    (ours * upstream[:, 1:]).sum().backward()
    (ref * upstream[:, 1:]).sum().backward()
    close(h_t.grad, h2.grad)
    close(w_t.grad, w2.grad)


def test_bad_shapes_raise():
    h, w, tokens, _ = make_inputs((2, 5))
    with pytest.raises(ValueError):
        selective_logprobs(h, w, tokens[:, :4])  # token_ids shorter than hidden_states
    with pytest.raises(ValueError):
        selective_logprobs(h, w, tokens.reshape(-1))  # [N] tokens for [B, T, H] hidden
    with pytest.raises(ValueError):
        selective_logprobs(h, w[:, :-1], tokens)  # hidden size mismatch
    with pytest.raises(ValueError):
        selective_logprobs(h, w.t(), tokens)  # weight passed as [H, V]
    with pytest.raises(ValueError):
        selective_logprobs(h, w, tokens, temperature=0.0)


# --------------------------------------------------------------------------------------
# completion_logprobs on tiny models

B, TP, TC = 3, 5, 6


def make_batch(seed=0, left_pad=False):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(4, VOCAB_SIZE, (B, TP), generator=g)
    prompt_mask = torch.ones(B, TP, dtype=torch.long)
    if left_pad:
        for b, n_real in enumerate([TP, 3, 1]):
            prompt_mask[b, : TP - n_real] = 0
            prompt_ids[b, : TP - n_real] = 0  # pad id
    completion_ids = torch.randint(4, VOCAB_SIZE, (B, TC), generator=g)
    completion_mask = torch.ones(B, TC, dtype=torch.long)
    for b, n_real in enumerate([TC, 4, 1]):  # right padding
        completion_mask[b, n_real:] = 0
        completion_ids[b, n_real:] = 0
    upstream = torch.randn(B, TC, generator=g)
    return prompt_ids, prompt_mask, completion_ids, completion_mask, upstream


def reference_completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                  temperature=1.0, explicit_positions=False):
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    kwargs = {}
    if explicit_positions:
        kwargs["position_ids"] = attention_mask.long().cumsum(-1) - 1
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
    logits = logits[:, TP - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def probe_params(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    named = dict(base.named_parameters())
    wanted = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ]
    return {k: named[k] for k in wanted if k in named and named[k].requires_grad}


def grads(loss, params):
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def check_completion_logprobs(model, left_pad, temperature, chunk_size=None):
    prompt_ids, prompt_mask, completion_ids, completion_mask, upstream = make_batch(left_pad=left_pad)
    ours = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                               temperature=temperature, chunk_size=chunk_size)
    ref = reference_completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                        temperature=temperature, explicit_positions=left_pad)
    m = completion_mask.bool()
    assert ours.shape == (B, TC)
    assert torch.isfinite(ours).all()
    close(ours[m], ref[m])

    params = probe_params(model)
    assert len(params) >= 3
    g_ours = grads((ours * upstream * completion_mask).sum(), params)
    g_ref = grads((ref * upstream * completion_mask).sum(), params)
    for name in params:
        assert g_ref[name].abs().sum() > 0, name
        close(g_ours[name], g_ref[name], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module", params=MODEL_CASES, ids=MODEL_IDS)
def model(request):
    arch, tied = request.param
    return tiny_model(arch, tied=tied)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_right_padded(model, temperature):
    check_completion_logprobs(model, left_pad=False, temperature=temperature)


def test_completion_logprobs_left_padded_prompts(model):
    check_completion_logprobs(model, left_pad=True, temperature=0.9, chunk_size=4)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_completion_logprobs_sdpa_and_eager(attn):
    model = tiny_model("qwen2", tied=False, attn_implementation=attn, seed=1)
    check_completion_logprobs(model, left_pad=True, temperature=1.0, chunk_size=5)


def test_completion_logprobs_never_builds_full_logits(model):
    """The lm_head module is never called (its weight is used directly, chunk by chunk)."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, upstream = make_batch()

    def boom(*args, **kwargs):
        raise AssertionError("lm_head forward called: full logits were materialised")

    handle = model.get_output_embeddings().register_forward_pre_hook(boom)
    try:
        out = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        (out * completion_mask).sum().backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)


def test_decoder_hidden_states_is_final_normed_state(model):
    prompt_ids, prompt_mask, completion_ids, completion_mask, _ = make_batch()
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        ours = decoder_hidden_states(model, ids, mask)
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    m = mask.bool()
    close(ours[m], ref[m])


def test_output_head_plain_model(model):
    head = output_head(model)
    assert head["lm_head_weight"] is model.lm_head.weight
    assert head["logit_scale"] == 1.0
    assert head["logit_softcap"] is None


# --------------------------------------------------------------------------------------
# Models whose config transforms the logits (soft-cap / scale): output_head must read it.


def _small(cls_name, config_name, **extra):
    import transformers

    cfg = getattr(transformers, config_name)(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(cfg).eval()


@pytest.mark.parametrize(
    "cls_name,config_name,extra",
    [
        ("Gemma2ForCausalLM", "Gemma2Config", {"final_logit_softcapping": 2.0}),
        ("CohereForCausalLM", "CohereConfig", {"logit_scale": 0.5}),
        ("GraniteForCausalLM", "GraniteConfig", {"logits_scaling": 4.0}),
    ],
    ids=["gemma2-softcap", "cohere-scale", "granite-scaling"],
)
def test_completion_logprobs_logit_transforms(cls_name, config_name, extra):
    import transformers

    if not hasattr(transformers, cls_name):
        pytest.skip(f"{cls_name} not in this transformers")
    model = _small(cls_name, config_name, **extra)
    check_completion_logprobs(model, left_pad=False, temperature=0.8)


# --------------------------------------------------------------------------------------
# PEFT


def test_lora_all_linear_model():
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama", tied=False, seed=3)
    # init_lora_weights=False: a random (non-zero) adapter, so it changes the outputs.
    peft_model = get_peft_model(base, LoraConfig(target_modules="all-linear", r=4, lora_alpha=8,
                                                 lora_dropout=0.0, init_lora_weights=False))
    peft_model.eval()
    assert not hasattr(base.lm_head, "base_layer"), "all-linear must leave lm_head alone"
    prompt_ids, prompt_mask, completion_ids, completion_mask, upstream = make_batch(left_pad=True)

    ours = completion_logprobs(peft_model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                               temperature=0.9)
    ref = reference_completion_logprobs(peft_model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                        temperature=0.9, explicit_positions=True)
    m = completion_mask.bool()
    close(ours[m], ref[m])
    with torch.no_grad(), peft_model.disable_adapter():
        no_adapter = completion_logprobs(peft_model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                         temperature=0.9)
    assert (no_adapter[m] - ours[m]).abs().max() > 1e-3, "adapter had no effect: is it being bypassed?"

    lora = {n: p for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" in n}
    assert lora and all(p.requires_grad for p in lora.values())
    picked = dict(list(lora.items())[:2] + list(lora.items())[-2:])
    g_ours = grads((ours * upstream * completion_mask).sum(), picked)
    g_ref = grads((ref * upstream * completion_mask).sum(), picked)
    for name in picked:
        assert g_ref[name].abs().sum() > 0
        close(g_ours[name], g_ref[name], atol=1e-5, rtol=1e-4)


def test_output_head_refuses_lora_lm_head():
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama", tied=False, seed=4)
    peft_model = get_peft_model(base, LoraConfig(target_modules=["q_proj", "lm_head"], r=2))
    with pytest.raises(ValueError, match="lm_head"):
        output_head(peft_model)
    prompt_ids, prompt_mask, completion_ids, completion_mask, _ = make_batch()
    with pytest.raises(ValueError):
        completion_logprobs(peft_model, prompt_ids, prompt_mask, completion_ids, completion_mask)


def test_completion_logprobs_with_gradient_checkpointing():
    model = tiny_model("qwen2", tied=True, seed=5)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing is only active in training mode; dropout is 0 in these configs
    assert model.is_gradient_checkpointing
    check_completion_logprobs(model, left_pad=True, temperature=1.0, chunk_size=3)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_chunk_size_is_an_error(bad):
    h, w, t = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    with pytest.raises(ValueError, match="chunk_size"):
        selective_logprobs(h, w, t, chunk_size=bad)


def test_fp32_activations_with_a_half_precision_head():
    h, w, t = torch.randn(4, 8), torch.randn(16, 8).bfloat16(), torch.randint(0, 16, (4,))
    out = selective_logprobs(h, w, t)
    ref = torch.log_softmax((h.bfloat16() @ w.t()).float(), -1).gather(1, t[:, None]).squeeze(1)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


def test_float64_stays_float64():
    """Computed in the wider of the inputs' dtype and float32: float64 agrees with a float64 reference."""
    h, w, tokens, upstream = make_inputs((3, 13), seed=3)
    h, w, upstream = h.double(), w.double(), upstream.double()
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ours = selective_logprobs(h1, w1, tokens, temperature=0.7, chunk_size=5, logit_softcap=3.0)
    z = torch.tanh((h2 @ w2.t()) / 3.0) * 3.0 / 0.7
    ref = torch.log_softmax(z, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert ours.dtype == torch.float64
    close(ours, ref, atol=1e-12, rtol=1e-12)
    (ours * upstream).sum().backward()
    (ref * upstream).sum().backward()
    assert h1.grad.dtype == w1.grad.dtype == torch.float64
    close(h1.grad, h2.grad, atol=1e-12, rtol=1e-12)
    close(w1.grad, w2.grad, atol=1e-12, rtol=1e-12)
    entropy = token_entropies(h, w, chunk_size=5)
    p = torch.softmax(h @ w.t(), -1)
    close(entropy, -(p * p.log()).sum(-1), atol=1e-12, rtol=1e-12)
