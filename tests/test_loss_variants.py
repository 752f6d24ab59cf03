"""CISPO, SAPO and the rollout log-prob correction: hand-computed gradients, config checks, the step's
wiring (add_logprobs / accumulate_gradients), mask_truncated_completions, and train() on a tiny model.
TRL parity for all three lives in tests/test_trl_parity.py."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_nb import GRPOConfig, train
from grpo_nb.config import TRL_RENAMES
from grpo_nb.loss import grpo_loss, rollout_importance_weights
from grpo_nb.models import prepare_tokenizer
from grpo_nb.rollout import RolloutBatch
from grpo_nb.batch import StepBatch
from grpo_nb.step import accumulate_gradients, add_logprobs, policy_logprobs
from tiny_models import FAST, dataset, lora_model, token_id_reward
from tiny_models import tiny_tokenizer


def close(a, b, atol=1e-6, rtol=1e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def batch_of(b=4, t=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 2 - 0.1
    old = lp + 0.5 * torch.randn(b, t, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.8, -1.2])[:b]
    mask = (torch.arange(t)[None] < torch.tensor([6, 4, 2, 5])[:b, None]).long()
    return lp, old, adv, mask


# --------------------------------------------------------------------------------------
# The definitions, by hand


def test_cispo_gradient_is_the_capped_weight_times_the_policy_gradient():
    lp, old, adv, mask = batch_of()
    lp = lp.clone().requires_grad_()
    loss, metrics = grpo_loss(lp, old, None, adv, mask, loss_type="cispo", epsilon_high=1.2)
    ratio = torch.exp(lp.detach() - old)
    m = mask.float()
    # d/d lp of -sg[min(r, 1.2)] A lp / tokens: the weight is a constant, so every token keeps a gradient.
    close(torch.autograd.grad(loss, lp)[0], -torch.clamp(ratio, max=1.2) * adv[:, None] * m / m.sum())
    capped = ((ratio > 1.2) & (adv[:, None] > 0)).float()
    close(metrics["clip_ratio_high"], (capped * m).sum() / m.sum())
    assert float(metrics["clip_ratio_low"]) == 0 and 0 < float(metrics["clip_ratio"]) < 1


def test_sapo_gate_is_the_policy_gradient_on_policy_and_fades_off_policy():
    lp, old, adv, mask = batch_of()
    m = mask.float()
    # On-policy (ratio 1) the gate's slope is 4 sigmoid'(0) = 1 for any temperature: plain GRPO's gradient.
    for taus in [(1.0, 1.05), (0.3, 4.0)]:
        a = lp.clone().requires_grad_()
        loss, metrics = grpo_loss(a, None, None, adv, mask, loss_type="sapo", sapo_temperature_pos=taus[0],
                                  sapo_temperature_neg=taus[1])
        b = lp.clone().requires_grad_()
        ref, _ = grpo_loss(b, None, None, adv, mask, loss_type="grpo")
        close(torch.autograd.grad(loss, a)[0], torch.autograd.grad(ref, b)[0])
        assert float(metrics["clip_ratio"]) == 0  # no hard clip
    # Off-policy: d/d lp = -4 s (1 - s) r A / (length x B), s = sigmoid(tau (r - 1)), tau by the sign of A.
    a = lp.clone().requires_grad_()
    loss, _ = grpo_loss(a, old, None, adv, mask, loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)
    r = torch.exp(lp - old)
    tau = torch.where(adv[:, None] > 0, 0.5, 2.0)
    s = torch.sigmoid(tau * (r - 1))
    expected = -4 * s * (1 - s) * r * adv[:, None] * m / m.sum(1, keepdim=True) / lp.shape[0]
    close(torch.autograd.grad(loss, a)[0], expected)
    with pytest.raises(ValueError, match="sapo_temperature_pos=0"):
        grpo_loss(lp, old, None, adv, mask, loss_type="sapo", sapo_temperature_pos=0)


def test_rollout_weights_scale_only_the_policy_term():
    lp, old, adv, mask = batch_of()
    ref = lp + 0.2
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(3)) * 2
    kw = dict(beta=0.1, loss_type="dapo")
    weighted, _ = grpo_loss(lp, old, ref, adv, mask, rollout_weights=w, **kw)
    kl_only, _ = grpo_loss(lp, old, ref, torch.zeros_like(adv), mask, rollout_weights=w, **kw)
    policy, _ = grpo_loss(lp, old, None, adv, mask, loss_type="dapo", entropy_mask=w)  # same product, no KL
    close(weighted, policy + kl_only)


def test_rollout_importance_weights_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, -9.0], [-0.3, float("nan"), 0.0]])  # last column of row 0 is padding
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    tok = torch.exp(torch.tensor([[0.5, -1.0, 0.0], [0.0, 0.0, 0.0]]))  # NaN: no difference; padding: 0
    close(rollout_importance_weights(trainer, rollout, mask, mode="token_truncate", clip_max=1.5),
          torch.clamp(tok, max=1.5))
    close(rollout_importance_weights(trainer, rollout, mask, mode="token_mask", clip_min=0.5, clip_max=1.5),
          torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]]))
    seq = torch.exp(torch.tensor([[-0.5], [0.0]]))  # the sum of a row's differences
    close(rollout_importance_weights(trainer, rollout, mask, mode="sequence_truncate", clip_min=0.7, clip_max=None),
          torch.clamp(seq, min=0.7))
    close(rollout_importance_weights(trainer, rollout, mask, mode="sequence_mask", clip_min=0.7),
          torch.tensor([[0.0], [1.0]]))
    with pytest.raises(ValueError, match="mode='token'"):
        rollout_importance_weights(trainer, rollout, mask, mode="token")


# --------------------------------------------------------------------------------------
# Config: TRL's names and defaults, bad values refused naming the option


def test_config_defaults_follow_trl():
    c = GRPOConfig()
    assert (c.sapo_temperature_pos, c.sapo_temperature_neg) == (1.0, 1.05)
    assert (c.rollout_importance_sampling_mode, c.rollout_importance_sampling_clip_max,
            c.rollout_importance_sampling_clip_min) == (None, 3.0, None)  # None: TRL's sequence_mask but for bf16 copies
    # decided per run: on with the bf16 rollout copies cpu_rollout_dtype="auto" picks, else off (TRL's True applies
    # to vLLM only)
    assert c.rollout_importance_sampling_correction is None and c.cpu_rollout_dtype == "auto"


def test_trl_names_are_accepted_by_replace():
    c = GRPOConfig().replace(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_mask",
                             vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)
    assert (c.rollout_importance_sampling_correction, c.rollout_importance_sampling_mode,
            c.rollout_importance_sampling_clip_min, c.rollout_importance_sampling_clip_max) == (True, "token_mask", 0.5,
                                                                                                2.0)
    assert set(TRL_RENAMES.values()) <= set(GRPOConfig.__dataclass_fields__)
    with pytest.raises(ValueError, match="pass only rollout_importance_sampling_mode="):
        GRPOConfig().replace(vllm_importance_sampling_mode="token_mask", rollout_importance_sampling_mode="token_mask")


@pytest.mark.parametrize("overrides,fragment", [
    ({"loss_type": "gspo"}, "loss_type='gspo'"),
    ({"sapo_temperature_pos": 0.0}, "sapo_temperature_pos=0.0"),
    ({"sapo_temperature_neg": -1.0}, "sapo_temperature_neg=-1.0"),
    ({"rollout_importance_sampling_mode": "token"}, "rollout_importance_sampling_mode='token'"),
    ({"rollout_importance_sampling_correction": "yes"}, "rollout_importance_sampling_correction='yes'"),
    ({"rollout_importance_sampling_clip_max": 0.0}, "rollout_importance_sampling_clip_max=0.0"),
    ({"rollout_importance_sampling_clip_min": -0.1}, "rollout_importance_sampling_clip_min=-0.1"),
    ({"rollout_importance_sampling_clip_min": 3.0}, "less than rollout_importance_sampling_clip_max=3.0"),
    ({"rollout_importance_sampling_correction": True, "rollout_importance_sampling_mode": "token_truncate",
      "rollout_importance_sampling_clip_max": None}, "rollout_importance_sampling_clip_max=None"),
])
def test_bad_values_name_the_option(overrides, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        GRPOConfig(**overrides)


def test_cispo_without_a_cap_above_one_warns():
    with pytest.warns(UserWarning, match="epsilon_high=None falls back to epsilon=0.2.*epsilon_high=5.0"):
        GRPOConfig(loss_type="cispo")
    with pytest.warns(UserWarning, match="epsilon_high=0.28"):
        GRPOConfig(loss_type="cispo", epsilon_high=0.28)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig(loss_type="cispo", epsilon_high=5.0)
        GRPOConfig(loss_type="sapo", importance_sampling_level="sequence")  # SAPO averages like GRPO: no warning


# --------------------------------------------------------------------------------------
# The step's wiring


def rollout_batch(truncated=(False, True, False, False), seed=0):
    g = torch.Generator().manual_seed(seed)
    n, tp, tc = 4, 3, 5
    prompt_ids = torch.randint(4, 40, (n, tp), generator=g)
    completion_ids = torch.randint(4, 40, (n, tc), generator=g)
    completion_mask = (torch.arange(tc)[None] < torch.tensor([5, 5, 2, 4])[:, None]).long()
    return RolloutBatch(prompt_ids, torch.ones(n, tp, dtype=torch.long), completion_ids, completion_mask,
                        torch.tensor(truncated))


def test_mask_truncated_completions_drops_them_from_the_loss(monkeypatch):
    from grpo_nb.reward_contract import RewardLog
    from grpo_nb.scoring import ScoredGroups

    rollout = rollout_batch()
    groups = ScoredGroups(rows=[{"prompt": "p"}] * 4, num_generations=4, rollout=rollout, texts=[""] * 4,
                          completions=[""] * 4, completion_ids=[[]] * 4, calls=[], generation_time=0.0,
                          prompts_cut=0, rewards_per_func=torch.tensor([[1.0], [0.0], [2.0], [1.0]]), log=RewardLog(4))
    kept = StepBatch.from_groups(groups, GRPOConfig(num_generations=4, per_device_train_batch_size=4))
    dropped = StepBatch.from_groups(groups, GRPOConfig(num_generations=4, per_device_train_batch_size=4,
                                                       mask_truncated_completions=True))
    assert torch.equal(kept.loss_mask, rollout.completion_mask)
    assert dropped.loss_mask[1].sum() == 0
    assert torch.equal(dropped.loss_mask[[0, 2, 3]], rollout.completion_mask[[0, 2, 3]])
    # ...and the loss sees that mask: the truncated row gets no gradient, the others do.
    model = lora_model()
    params = [p for p in model.parameters() if p.requires_grad]
    seen = []
    real = grpo_loss
    monkeypatch.setattr("grpo_nb.step.grpo_loss", lambda *a, **k: (seen.append(a[4]), real(*a, **k))[1])
    accumulate_gradients(model, params, dropped, GRPOConfig(num_generations=4, per_device_train_batch_size=4,
                                                            mask_truncated_completions=True))
    assert torch.equal(seen[0], dropped.loss_mask[:, : seen[0].shape[1]])


def correction_batch(model, config, shift):
    rollout = rollout_batch(truncated=(False,) * 4)
    batch = StepBatch(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask,
                      rollout.completion_mask, torch.tensor([1.0, -0.5, 0.7, -1.2]), 4, truncated=rollout.truncated)
    exact = policy_logprobs(model, batch, config)
    batch.sampling_logprobs = (exact + shift) * batch.completion_mask  # an engine that is a little off
    return batch, exact


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_correction_weights_the_gradient_by_trainer_over_rollout(num_iterations):
    """With the correction, the gradient is grpo_loss's with the weights from the trainer's log-probs at sampling
    time (this pass's, detached, for one iteration; recomputed by add_logprobs for several) over the engine's."""
    model = lora_model()
    params = [p for p in model.parameters() if p.requires_grad]
    config = GRPOConfig(num_generations=4, per_device_train_batch_size=4, num_iterations=num_iterations,
                        rollout_importance_sampling_correction=True, rollout_importance_sampling_mode="token_truncate",
                        rollout_importance_sampling_clip_max=1.1)
    shift = 0.3 * torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    batch, exact = correction_batch(model, config, shift)
    batch = add_logprobs(model, batch, config)
    assert batch.sampling_logprobs is not None  # kept for the weights
    if num_iterations > 1:  # the trainer's own, not the engine's (TRL's semantics)
        close(batch.old_logprobs, exact)
    metrics = accumulate_gradients(model, params, batch, config)
    ours = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    from grpo_nb.logprobs import completion_logprobs

    lp = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    weights = rollout_importance_weights(exact, batch.sampling_logprobs, batch.loss_mask, mode="token_truncate",
                                         clip_max=1.1)
    loss, _ = grpo_loss(lp, batch.old_logprobs, None, batch.advantages, batch.loss_mask, loss_type="dapo",
                        rollout_weights=weights)
    loss.backward()
    for a, p in zip(ours, params):
        close(a, p.grad, atol=1e-6, rtol=1e-4)
    real = batch.loss_mask.bool()
    assert metrics.rollout_correction["rollout_is_ratio_max"] == pytest.approx(float(weights[real].max()))
    assert metrics.rollout_correction["rollout_is_ratio_min"] == pytest.approx(float(weights[real].min()))
    assert metrics.rollout_correction["rollout_is_ratio_mean"] == pytest.approx(float(weights[real].mean()), rel=1e-5)
    assert metrics.rollout_correction["rollout_logprob_diff_max"] == pytest.approx(float(shift.abs()[real].max()), rel=1e-4)


def test_correction_refuses_a_batch_without_rollout_logprobs():
    model = lora_model()
    config = GRPOConfig(num_generations=4, per_device_train_batch_size=4, rollout_importance_sampling_correction=True)
    batch, _ = correction_batch(model, config, 0.0)
    batch.sampling_logprobs = None
    with pytest.raises(ValueError, match="rollout_importance_sampling_correction=True.*rollout='hf'"):
        add_logprobs(model, batch, config)


# --------------------------------------------------------------------------------------
# train() on a tiny model


@pytest.fixture
def tok():
    return prepare_tokenizer(tiny_tokenizer())


@pytest.mark.filterwarnings("ignore:100% of this step's completions")  # the tiny random model rarely says EOS
@pytest.mark.parametrize("settings", [
    {"loss_type": "cispo", "epsilon_high": 5.0},
    {"loss_type": "sapo"},
    {"loss_type": "dapo", "rollout_importance_sampling_correction": True, "num_iterations": 2},
    {"loss_type": "sapo", "rollout_importance_sampling_correction": True,
     "rollout_importance_sampling_mode": "token_truncate"},
    {"loss_type": "vespo", "num_iterations": 2, "off_policy_mask_threshold": 0.0},
    {"loss_type": "luspo", "importance_sampling_level": "sequence", "entropy_coef": 0.01},
], ids=["cispo", "sapo", "dapo-correction-2iters", "sapo-token-correction", "vespo-off-policy-mask-2iters",
        "luspo-entropy-bonus"])
def test_train_runs_with_each_new_option(tok, tmp_path, settings):
    model = lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    hist = train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=2, verbose=False,
                 live=False, **{**FAST, **settings})
    assert len(hist) == 2 and all(math.isfinite(r["loss"]) for r in hist)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
    if settings.get("rollout_importance_sampling_correction"):
        for r in hist:
            # The native engine samples from the same fp32 weights on the CPU: the ratios are 1 up to rounding.
            assert r["rollout_is_ratio_min"] == pytest.approx(1.0, abs=1e-3)
            assert r["rollout_is_ratio_max"] == pytest.approx(1.0, abs=1e-3)
            assert 0 <= r["rollout_logprob_diff_max"] < 1e-3
    else:
        assert "rollout_is_ratio_mean" not in hist[0]
    if "off_policy_mask_threshold" in settings:  # the share of completions the mask dropped, in every record
        assert all(0 <= r["off_policy_masked"] <= 1 for r in hist)
    if "entropy_coef" in settings:  # TRL's entropy and entropy_coef
        assert all(r["entropy"] > 0 and r["entropy_coef"] == settings["entropy_coef"] for r in hist)


def test_train_refuses_the_correction_with_hf_generate_before_a_rollout(tok, tmp_path, monkeypatch):
    import grpo_nb.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "sample_batch", lambda *a, **k: pytest.fail("rolled out"))
    with pytest.raises(ValueError, match="HFGenerateRollout rollout returns none"):
        train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=1, verbose=False,
              live=False, rollout="hf", rollout_importance_sampling_correction=True, **FAST)


@pytest.mark.filterwarnings("ignore:100% of this step's completions")
def test_train_with_mask_truncated_completions_learns_nothing_from_cut_completions(tok, tmp_path):
    """The tiny random model never says EOS in 6 tokens: every completion is cut, so nothing is left to learn."""
    model = lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    hist = train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=1, verbose=False,
                 live=False, mask_truncated_completions=True, rollout_importance_sampling_correction=True, **FAST)
    assert hist[0]["truncated_fraction"] == 1.0 and hist[0]["loss"] == 0.0
    # sequence_mask (the default): one ratio per completion, over no tokens: exp(0) = 1 (every row counts, as in TRL)
    assert hist[0]["rollout_is_ratio_mean"] == 1.0 and math.isnan(hist[0]["rollout_logprob_diff_mean"])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_trl_runs_correction_logs_land_in_the_same_record_keys():
    from grpo_nb_widgets.trl_callback import record_from_trl_logs

    from grpo_nb.step import ROLLOUT_CORRECTION_METRICS

    logs = {"loss": 0.1, "sampling/importance_sampling_ratio/mean": 0.98, "sampling/importance_sampling_ratio/min": 0.5,
            "sampling/importance_sampling_ratio/max": 1.7, "sampling/sampling_logp_difference/mean": 0.01,
            "sampling/sampling_logp_difference/max": 0.4}
    record = record_from_trl_logs(logs, step=1)
    assert [record[k] for k in ROLLOUT_CORRECTION_METRICS] == [0.98, 0.5, 1.7, 0.01, 0.4]


def test_correction_refuses_a_vllm_rollout_that_cannot_return_exact_logprobs():
    """The vLLM backend returns log-probs only when they are the plain tempered ones (`returns_logprobs`)."""
    from types import SimpleNamespace

    from grpo_nb.step import check_rollout_logprobs

    config = GRPOConfig(rollout_importance_sampling_correction=True)

    class VLLMRollout(SimpleNamespace):  # the backend's seam, as check_rollout_logprobs sees it
        def returns_logprobs(self):
            return self.exact

        def __call__(self, model, tokenizer, prompt_ids, prompt_mask, num_generations):
            raise AssertionError("not called: refused before any rollout")

    check_rollout_logprobs(VLLMRollout(exact=True), config)
    check_rollout_logprobs(VLLMRollout(exact=False), config.replace(rollout_importance_sampling_correction=False))
    with pytest.raises(ValueError, match="VLLMRollout rollout returns none.*top_p/top_k/min_p/repetition_penalty"):
        check_rollout_logprobs(VLLMRollout(exact=False), config)


@pytest.mark.filterwarnings("ignore:100% of this step's completions")
def test_correction_survives_a_resume_in_the_middle_of_a_generation_batch(tok, tmp_path):
    """num_iterations=2: the checkpoint after step 1 holds the pending batch with the engine's log-probs, which
    step 2 still needs for its weights; the resumed run's step 2 is the uninterrupted run's."""
    settings = dict(FAST, num_iterations=2, rollout_importance_sampling_correction=True,
                    rollout_importance_sampling_mode="token_truncate", verbose=False, live=False)
    whole = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path / "a"), max_steps=2,
                  **settings)
    train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path / "b"), max_steps=1, save_steps=1,
          **{k: v for k, v in settings.items() if k != "save_steps"})
    resumed = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path / "b"), max_steps=2,
                    resume_from_checkpoint=True, **settings)
    assert resumed[-1]["loss"] == pytest.approx(whole[-1]["loss"], rel=1e-5, abs=1e-7)
    assert resumed[-1]["rollout_is_ratio_max"] == pytest.approx(whole[-1]["rollout_is_ratio_max"])


@pytest.mark.parametrize("rope", [
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0 + i for i in range(8)],
     "original_max_position_embeddings": 8},  # Phi-3/3.5/4-mini: long factors past 4096 tokens, at every position
    {"rope_type": "dynamic", "factor": 4.0}])  # dynamic NTK: frequencies from the forward pass's length
def test_old_logprobs_of_a_length_dependent_rope_come_from_the_training_forward(rope):
    """The native engine's KV cache keeps the prefill's rotary factors (a prompt below the original window),
    so its log-probs are not the loss's; with several iterations the old policy is recomputed, ratio 1 at first."""
    from grpo_nb.rollout.engine import RolloutEngine
    from tiny_models import tiny_model

    model = tiny_model("llama", initializer_range=0.5)
    model.config.rope_parameters = {"rope_theta": 10000.0, **rope}
    model.config.max_position_embeddings = 8 if rope["rope_type"] == "dynamic" else 256
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    prompt_ids = torch.randint(4, 40, (1, 6), generator=torch.Generator().manual_seed(0))
    out = RolloutEngine(max_completion_length=10, temperature=1.0, seed=1)(model, tiny_tokenizer(), prompt_ids,
                                                                           torch.ones_like(prompt_ids), 2)
    batch = StepBatch(out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, out.completion_mask,
                      torch.tensor([1.0, -1.0]), 2, truncated=out.truncated, sampling_logprobs=out.sampling_logprobs)
    config = GRPOConfig(num_generations=2, per_device_train_batch_size=2, num_iterations=2)
    exact = policy_logprobs(model, batch, config)
    assert ((exact - out.sampling_logprobs) * out.completion_mask).abs().max() > 0.1  # the engine is off here
    close(add_logprobs(model, batch, config).old_logprobs, exact)


@pytest.mark.filterwarnings("ignore:100% of this step's completions")
def test_adaptive_entropy_state_survives_a_resume(tok, tmp_path):
    """use_adaptive_entropy's coefficient moves every step (the tiny model's entropy is below a target of 50, so up
    by delta) and lives in the records: a run resumed at step 2 goes on from the coefficient step 2 left, as the
    uninterrupted run does, not from the starting entropy_coef."""
    settings = dict(FAST, entropy_coef=0.01, use_adaptive_entropy=True, entropy_coef_delta=0.01, entropy_target=50.0,
                    verbose=False, live=False)
    whole = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path / "a"), max_steps=3,
                  **settings)
    assert [r["entropy_coef"] for r in whole] == pytest.approx([0.02, 0.03, 0.04])
    assert all(0 < r["entropy_window"] <= 50 for r in whole)
    train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path / "b"), max_steps=2, save_steps=1,
          **{k: v for k, v in settings.items() if k != "save_steps"})
    resumed = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path / "b"), max_steps=3,
                    resume_from_checkpoint=True, **settings)
    assert resumed[-1]["entropy_coef"] == pytest.approx(0.04)
    assert resumed[-1]["loss"] == pytest.approx(whole[-1]["loss"], rel=1e-5, abs=1e-7)


def test_adaptive_entropy_coefficient_read_back_within_the_runs_bounds():
    """A resumed run whose bounds are narrower than its records' coefficient (or a step whose entropy was not
    finite) keeps the coefficient within [entropy_coef_min, entropy_coef_max] and moves it on finite steps only."""
    import math

    from grpo_nb import GRPOConfig
    from grpo_nb.step import entropy_control, entropy_control_step

    config = GRPOConfig(use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_min=0.0, entropy_coef_max=0.1,
                        entropy_target=0.5)
    assert entropy_control(config, [{"entropy_coef": 5.0, "entropy_window": 0.2}]) == (0.1, 0.1)
    assert entropy_control(config, [{"entropy_coef": 0.05, "entropy_window": 0.9}]) == (0.05, 0.0)  # above target
    assert entropy_control(config, [{"entropy_coef": 0.05, "entropy_window": math.nan}]) == (0.05, 0.0)
    stepped = entropy_control_step(config, 0.05, math.nan, 10.0)
    assert stepped["entropy_coef"] == 0.05 and math.isnan(stepped["entropy_window"])


def test_auto_rollout_dtype_picks_bf16_with_the_correction_only_where_it_pays(monkeypatch):
    """cpu_rollout_dtype="auto" (the default): bf16 copies with the correction on (token-level truncation) for an
    fp32 model of AUTO_BF16_MIN_BYTES+ on a CPU with native bf16, through grpo-nb's engine; the model's dtype and no
    correction anywhere else; a user's own choice stays, and brings the correction only where the copies are used."""
    import grpo_nb.rollout as rollout_mod
    from grpo_nb.config import correction_mode
    from grpo_nb.rollout import rollout_precision

    model = lora_model()
    decided = lambda kind="auto", rollout_func=None, **settings: (lambda c: (
        c.cpu_rollout_dtype, c.rollout_importance_sampling_correction))(
        rollout_precision(GRPOConfig(**settings), model, kind, rollout_func))
    assert decided() == (None, False)  # a tiny model: its step costs its ops, not its bytes
    monkeypatch.setattr(rollout_mod, "AUTO_BF16_MIN_BYTES", 0)
    monkeypatch.setattr(rollout_mod, "cpu_has_bf16", lambda: True)
    assert decided() == decided("native") == decided(None) == ("bfloat16", True)
    assert decided(rollout_importance_sampling_correction=True) == ("bfloat16", True)
    assert decided(loss_type="vespo") == ("bfloat16", True)  # its correction takes the token-level mode
    assert decided(num_iterations=2) == ("bfloat16", True)
    for why in (dict(kind="hf"), dict(kind=lambda *a: None), dict(rollout_func=lambda *a: None),
                dict(rollout_importance_sampling_correction=False), dict(cpu_rollout_dtype=None),
                dict(loss_type="vespo", rollout_importance_sampling_mode="sequence_mask"),  # refused: left fp32
                dict(generation_kwargs={"no_repeat_ngram_size": 3})):  # "auto" then picks HF generate
        assert decided(**why) == (None, False), why
    # bf16 asked for: the correction comes with it where the copies are used, not where they are not
    assert decided(cpu_rollout_dtype="bfloat16", loss_type="vespo") == ("bfloat16", True)
    for elsewhere in (dict(kind="hf"), dict(rollout_func=lambda *a: None)):
        assert decided(cpu_rollout_dtype="bfloat16", **elsewhere) == ("bfloat16", False), elsewhere
    # the mode left at None: token-level truncation with bf16 copies (a sequence's weight would compound their
    # rounding over its length), TRL's sequence mask otherwise; a mode set stays
    config = rollout_precision(GRPOConfig(), model, "auto")
    assert correction_mode(config) == "token_truncate"
    assert correction_mode(GRPOConfig(rollout_importance_sampling_correction=True, cpu_rollout_dtype=None)) \
        == "sequence_mask"
    assert correction_mode(rollout_precision(GRPOConfig(rollout_importance_sampling_mode="sequence_truncate"),
                                             model, "auto")) == "sequence_truncate"
    monkeypatch.setattr(rollout_mod, "cpu_has_bf16", lambda: False)
    assert decided() == (None, False)
    monkeypatch.setattr(rollout_mod, "cpu_has_bf16", lambda: True)
    model.to(torch.bfloat16)  # a bf16 model: nothing to halve
    assert decided() == (None, False)


def test_train_takes_the_auto_decision(tok, tmp_path, monkeypatch):
    """The run's config is the decided one: the engine's copies in bf16 and the correction's metrics in the
    record."""
    import grpo_nb.rollout as rollout_mod
    from grpo_nb import lora

    monkeypatch.setattr(rollout_mod, "AUTO_BF16_MIN_BYTES", 0)
    monkeypatch.setattr(rollout_mod, "cpu_has_bf16", lambda: True)
    seen = []
    real = lora._merged_weight
    monkeypatch.setattr(lora, "_merged_weight", lambda layer, active: seen.append(lora._merge_dtype)
                        or real(layer, active))
    hist = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=1,
                 verbose=False, live=False, **FAST)
    assert set(seen) == {torch.bfloat16} and math.isfinite(hist[0]["rollout_is_ratio_mean"])
    seen.clear()
    hist = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path / "b"), max_steps=1,
                 verbose=False, live=False, rollout_importance_sampling_correction=False, **FAST)
    assert set(seen) <= {None} and "rollout_is_ratio_mean" not in hist[0]


@pytest.mark.filterwarnings("ignore:100% of this step's completions")
def test_a_resume_says_when_auto_decided_otherwise_than_for_the_checkpoint(tok, tmp_path, monkeypatch):
    """A checkpoint of a run whose "auto" kept fp32 rollouts (another CPU, or grpo-nb before "auto"), resumed where
    it picks bf16 copies: the warning names those settings as grpo-nb's decision, not the user's change, and how to
    keep the checkpoint's; a setting the user changed is still reported as such."""
    import grpo_nb.rollout as rollout_mod

    monkeypatch.setattr(rollout_mod, "AUTO_BF16_MIN_BYTES", 0)
    monkeypatch.setattr(rollout_mod, "cpu_has_bf16", lambda: False)
    settings = dict(FAST, verbose=False, live=False)
    train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=1, save_steps=1,
          **{k: v for k, v in settings.items() if k != "save_steps"})
    monkeypatch.setattr(rollout_mod, "cpu_has_bf16", lambda: True)
    with pytest.warns(UserWarning) as caught:
        train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=2,
              resume_from_checkpoint=True, **dict(settings, learning_rate=2e-5))
    said = [str(w.message) for w in caught]
    auto = [m for m in said if "You left these to grpo-nb" in m]
    assert len(auto) == 1, said
    assert "cpu_rollout_dtype None -> 'bfloat16'" in auto[0] and "pass cpu_rollout_dtype=None" in auto[0]
    assert "rollout_importance_sampling_correction False -> True" in auto[0]
    user = [m for m in said if "settings that differ from the ones it was trained with" in m]
    assert len(user) == 1 and "learning_rate" in user[0] and "cpu_rollout_dtype" not in user[0], said
