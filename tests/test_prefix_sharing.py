"""The prompt forwarded once per group in the policy update (grpo_nb.prefix_sharing): equal log-probs, gradients
and trained weights to the row-by-row forward, and the rows, models and planners it must leave alone."""

import pytest
import torch

from grpo_nb import prefix_sharing
from grpo_nb.attention import use_gqa_safe_sdpa
from grpo_nb.batch import StepBatch
from grpo_nb.config import GRPOConfig
from grpo_nb.logprobs import completion_logprobs
from grpo_nb.step import accumulate_gradients
from tiny_models import FAST, dataset, tiny_model, token_id_reward


@pytest.fixture
def packed(monkeypatch):
    """The number of packed (shared-prompt) forwards so far: a test of equal results must see the shared path run."""
    calls = []

    def counted(*args, _f=prefix_sharing.hidden_states):
        hidden = _f(*args)
        if hidden is not None:  # every attention layer read the layout
            calls.append(1)
        return hidden

    monkeypatch.setattr(prefix_sharing, "hidden_states", counted)
    return calls


def sdpa_model(arch="llama", seed=0):
    model = tiny_model(arch, seed=seed, attn_implementation="sdpa")
    assert use_gqa_safe_sdpa(model)  # what setup_reasoning_model / prepare_for_training give a model
    return model


def group_rows(k=2, m=3, tp=7, tc=5, seed=0):
    """k prompts (the first left-padded) x m completions each, some ending early (right padding)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(4, 100, (k, tp), generator=g)
    prompt_mask = torch.ones(k, tp, dtype=torch.long)
    prompt_mask[0, :3] = 0
    prompt_ids[prompt_mask == 0] = 0
    completion_ids = torch.randint(4, 100, (k * m, tc), generator=g)
    completion_mask = torch.ones(k * m, tc, dtype=torch.long)
    completion_mask[1, 2:] = 0
    completion_mask[k * m - 2, tc - 1:] = 0
    completion_ids[completion_mask == 0] = 0
    return (prompt_ids.repeat_interleave(m, 0), prompt_mask.repeat_interleave(m, 0), completion_ids,
            completion_mask)


def logprobs_and_grads(model, rows, share):
    model.zero_grad()
    lp = completion_logprobs(model, *rows, share_prefix=share, backend="torch")
    mask = rows[3]
    (lp * mask * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
    return (lp * mask).detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_prompt_gives_the_rows_logprobs_and_gradients(arch, packed):
    model = sdpa_model(arch)
    rows = group_rows()
    calls = packed
    plain, plain_grads = logprobs_and_grads(model, rows, share=False)
    assert not calls
    shared, shared_grads = logprobs_and_grads(model, rows, share=True)
    assert calls  # the packed forward ran
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-5)
    assert shared_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(shared_grads[name], plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("rows", [slice(0, 6), slice(1, 5), slice(2, 3)], ids=["groups", "cut groups", "one row"])
def test_packed_rows_of_any_grouping(rows, packed):
    """Runs of unequal length (a micro-batch that cuts groups), a lone row: packed without padding, still equal."""
    model = sdpa_model("qwen2")
    batch = [t[rows] for t in group_rows(k=2, m=3, tp=9, tc=7)]
    batch[3][0, 1:] = 0  # a short completion: most of its row is padding
    plain, plain_grads = logprobs_and_grads(model, batch, share=False)
    shared, shared_grads = logprobs_and_grads(model, batch, share=True)
    assert packed
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-5)
    for name in plain_grads:
        torch.testing.assert_close(shared_grads[name], plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_group_starts():
    ids, mask, _, _ = group_rows(k=3, m=2)
    assert prefix_sharing.group_starts(ids, mask) == [0, 2, 4]
    assert prefix_sharing.group_starts(ids[1:], mask[1:]) == [0, 1, 3]
    # the same prompt in two groups side by side is one run: still one prompt for all of them
    twice = torch.cat([ids[:2], ids[:2]]), torch.cat([mask[:2], mask[:2]])
    assert prefix_sharing.group_starts(*twice) == [0]
    # equal ids under other padding are other prompts (positions differ)
    other_pad = mask[:2].clone()
    other_pad[1, 0] = 1 - other_pad[1, 0]
    assert prefix_sharing.group_starts(ids[:2], other_pad) == [0, 1]
    assert [prefix_sharing.prompts_per_micro_batch(micro, 8) for micro in (1, 3, 4, 5, 8, 12, 16)] == \
        [1, 2, 1, 2, 1, 2, 2]


def test_rows_and_models_it_leaves_alone():
    rows = group_rows()
    assert prefix_sharing.layout(sdpa_model(), *rows) is not None
    assert prefix_sharing.layout(tiny_model("llama"), *rows) is None  # eager attention reads no layout
    windowed = sdpa_model("qwen2")
    windowed.config.use_sliding_window, windowed.config.sliding_window = True, 4
    assert prefix_sharing.layout(windowed, *rows) is None
    longrope = sdpa_model()
    longrope.config.rope_scaling = {"rope_type": "dynamic", "factor": 2.0}
    assert prefix_sharing.layout(longrope, *rows) is None
    holed = rows[3].clone()
    holed[0, 1] = 0  # a completion mask with a hole: its positions are not a packed row's
    assert prefix_sharing.layout(sdpa_model(), *rows[:3], holed) is None
    distinct = torch.arange(4, 40).view(4, 9)  # nothing shared, no padding: nothing to save
    assert prefix_sharing.layout(sdpa_model(), distinct, torch.ones_like(distinct), distinct,
                                 torch.ones_like(distinct)) is None


@pytest.mark.parametrize("checkpointing", [False, True, "offload"])
def test_update_gradients_equal_under_checkpointing(checkpointing, packed):
    """The layout reaches the attention through the checkpointed layers' recompute (plain and offloaded)."""
    from peft import LoraConfig, get_peft_model

    from grpo_nb.models import prepare_for_training

    model = tiny_model("qwen2", attn_implementation="sdpa")
    if checkpointing == "offload":
        from grpo_nb.offload import enable_offloaded_checkpointing

        model = prepare_for_training(model, lora_rank=None, gradient_checkpointing=True)
        enable_offloaded_checkpointing(model, min_offload_bytes=0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    else:
        model = prepare_for_training(model, lora_rank=4, gradient_checkpointing=checkpointing)
    torch.manual_seed(1)
    for p in model.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.05)  # B = 0 would give A no gradient
    model.train()
    rows = group_rows(k=2, m=4, tp=9, tc=6)
    batch = StepBatch(*rows, rows[3].clone(), torch.linspace(-1, 1, 8), 4)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for share in (False, True):
        config = GRPOConfig(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                            prefix_sharing=share)
        metrics = accumulate_gradients(model, params, batch, config)
        grads.append((metrics.loss, torch.cat([p.grad.flatten() for p in params])))
        for p in params:
            p.grad = None
    assert grads[0][1].abs().max() > 0 and len(packed) == 2  # a packed forward per micro-batch
    assert grads[1][0] == pytest.approx(grads[0][0], rel=1e-5)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-4, atol=1e-6)


def test_train_gives_the_same_weights(tok, tmp_path, packed):
    """Two steps of train() with and without the shared prompt: the same adapter weights."""
    from peft import LoraConfig, get_peft_model

    from grpo_nb import train

    weights = []
    for share in (False, True):
        model = sdpa_model("llama")
        model.generation_config.eos_token_id = 2
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        model.train()
        train(model, tok, dataset(), token_id_reward, GRPOConfig(**FAST, max_steps=2, prefix_sharing=share),
              verbose=False, live=False, output_dir=str(tmp_path / str(share)))
        weights.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        assert bool(packed) == share
    assert any((weights[0][n] != 0).any() for n in weights[0] if "lora_B" in n)  # it trained
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_planner_and_simulation_count_the_shared_prompt():
    """estimate_vram follows the simulated step (which runs the real shared forward on the meta device) when a
    long prompt is shared, and both count less than without sharing."""
    from grpo_nb.memory import estimate_vram
    from grpo_nb.simulate import simulate_step

    kw = dict(max_prompt_length=512, max_completion_length=64, num_generations=4, per_device_train_batch_size=4,
              rollout=False)
    sims = {share: simulate_step("Qwen/Qwen2.5-0.5B-Instruct", prefix_sharing=share, **kw) for share in (False, True)}
    kw.pop("rollout")
    ests = {share: estimate_vram("Qwen/Qwen2.5-0.5B-Instruct", prefix_sharing=share, **kw) for share in (False, True)}
    assert sims[True]["activations"] < 0.8 * sims[False]["activations"]
    assert ests[True]["activations"] < 0.8 * ests[False]["activations"]
    for share in (False, True):
        assert ests[share]["activations"] == pytest.approx(sims[share]["activations"], rel=0.15)


def test_a_model_whose_layers_lose_the_layout_goes_unpacked(packed):
    """StableLM's decoder layers call their attention without the keyword arguments the layout travels in: the
    packed forward is caught (not every attention layer read it) and the rows go as they are, with one warning."""
    from transformers import AutoModelForCausalLM, StableLmConfig

    cfg = StableLmConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert use_gqa_safe_sdpa(model) and prefix_sharing.shareable(model)
    rows = group_rows()
    plain = completion_logprobs(model, *rows, backend="torch") * rows[3]
    prefix_sharing._REFUSED.discard(type(model))
    with pytest.warns(RuntimeWarning, match="do not pass their keyword arguments on to attention"):
        shared = completion_logprobs(model, *rows, backend="torch", share_prefix=True) * rows[3]
    torch.testing.assert_close(shared, plain)
    assert not packed and prefix_sharing.layout(model, *rows) is None  # not tried again
    prefix_sharing._REFUSED.discard(type(model))


def test_odd_rows_packed_or_left_alone():
    """An empty completion in the last row, float masks: packed and equal; a prompt of no token: left alone."""
    model = sdpa_model()
    rows = list(group_rows(k=2, m=3))
    rows[3] = rows[3].clone()
    rows[3][-1] = 0  # the last completion has no token
    plain, _ = logprobs_and_grads(model, rows, share=False)
    shared, _ = logprobs_and_grads(model, rows, share=True)
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-5)
    floats = [rows[0], rows[1].float(), rows[2], rows[3].float()]
    assert prefix_sharing.layout(model, *floats) is not None
    empty = rows[1].clone()
    empty[:3] = 0
    assert prefix_sharing.layout(model, rows[0], empty, rows[2], rows[3]) is None
