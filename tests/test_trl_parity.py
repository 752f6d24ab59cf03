"""Parity with TRL's GRPOTrainer (trl 1.16) on one hand-made batch.

The trainer is built around a tiny random Llama saved to a temporary directory (so that
beta > 0, which makes TRL load a reference model from the same path, also works offline).
We call TRL's own `_get_per_token_logps_and_entropies` and `_compute_loss` on a batch we
built, and compare with `completion_logprobs` + `grpo_loss`.

TRL applies the sampling temperature inside the fused LM head it installs at construction,
so each temperature gets its own trainer.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

pytest.importorskip("trl", reason="TRL is the parity oracle (the dev extra installs trl)")

from grpo_nb.logprobs import completion_logprobs  # noqa: E402
from grpo_nb.loss import grpo_loss, high_entropy_mask  # noqa: E402
try:
    from tests.tiny_models import VOCAB_SIZE, tiny_model, tiny_tokenizer
except ImportError:  # tests/ itself on sys.path (plain `pytest`)
    from tiny_models import VOCAB_SIZE, tiny_model, tiny_tokenizer

B, TP, TC = 4, 5, 8
MAX_COMPLETION_LENGTH = 8
ATOL = 1e-5


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def make_trainer(tmp_path_factory):
    """A cached factory: make_trainer(temperature=..., loss_type=..., beta=..., ...) -> GRPOTrainer."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    root = tmp_path_factory.mktemp("trl_parity")
    model_dir = root / "tiny-llama"
    tiny_model("llama", tied=False, seed=0, attn_implementation="sdpa").save_pretrained(model_dir)
    tokenizer = tiny_tokenizer()
    dataset = Dataset.from_dict({"prompt": ["w5 w6 w7 w8 w9", "w10 w11 w12 w13 w14",
                                            "w15 w16 w17 w18 w19", "w20 w21 w22 w23 w24"]})

    @functools.lru_cache(maxsize=None)
    def build(temperature=1.0, loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=None, bias_kl=False,
              level="token", top_entropy_quantile=1.0, sapo_temperatures=(1.0, 1.05), more=()):
        extra = dict(more)  # other TRL settings, as (name, value) pairs
        if "use_bias_correction_kl" in {f.name for f in dataclasses.fields(GRPOConfig)}:
            # TRL 1.16 multiplies the k3 KL by the importance ratio by default (gradient included,
            # even on-policy); grpo-nb defaults to the plain k3 estimator and has the same option.
            extra["use_bias_correction_kl"] = bias_kl
        elif bias_kl:
            pytest.skip("this TRL has no use_bias_correction_kl option")
        args = GRPOConfig(
            **extra,
            output_dir=str(root / f"out-{temperature}-{loss_type}-{beta}-{epsilon_high}-{bias_kl}-{level}-"
                                  f"{top_entropy_quantile}-{sapo_temperatures[0]}-{sapo_temperatures[1]}"
                                  f"{''.join(f'-{k}{v}' for k, v in more)}"),
            sapo_temperature_pos=sapo_temperatures[0],
            sapo_temperature_neg=sapo_temperatures[1],
            importance_sampling_level=level,
            top_entropy_quantile=top_entropy_quantile,
            report_to=[],
            per_device_train_batch_size=B,
            num_generations=4,
            max_completion_length=MAX_COMPLETION_LENGTH,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            temperature=temperature,
            loss_type=loss_type,
            beta=beta,
            epsilon=epsilon,
            epsilon_high=epsilon_high,
            seed=0,
            save_strategy="no",
            logging_steps=1,
        )
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer)
        assert trainer.model.dtype == torch.float32
        assert trainer.temperature == temperature and trainer.loss_type == loss_type and trainer.beta == beta
        trainer.model.train()  # the "train" branch of _compute_loss (dropout is 0 in this config)
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop otherwise
        return trainer

    return build


def make_batch(seed=0, left_pad=False):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(4, VOCAB_SIZE, (B, TP), generator=g)
    prompt_mask = torch.ones(B, TP, dtype=torch.long)
    if left_pad:
        for b, n_real in enumerate([TP, 4, 2, 3]):
            prompt_mask[b, : TP - n_real] = 0
            prompt_ids[b, : TP - n_real] = 0
    completion_ids = torch.randint(4, VOCAB_SIZE, (B, TC), generator=g)
    completion_mask = torch.ones(B, TC, dtype=torch.long)
    for b, n_real in enumerate([TC, 5, 2, 7]):  # right padding after EOS
        completion_mask[b, n_real:] = 0
        completion_ids[b, n_real:] = 0
    advantages = torch.tensor([1.2, -0.7, 0.4, -0.9])
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
    }


def trl_logps(trainer, batch):
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    # (logps, entropies[, aux_loss]) depending on the TRL version
    return trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, TC)[0]


def our_logps(trainer, batch, temperature):
    return completion_logprobs(trainer.model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                               batch["completion_mask"], temperature=temperature)


def probe_params(model):
    named = dict(model.named_parameters())
    names = ["lm_head.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.1.mlp.down_proj.weight", "model.norm.weight"]
    return [named[n] for n in names]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("left_pad", [False, True], ids=["no-pad", "left-pad"])
def test_logprobs_match_trl(make_trainer, temperature, left_pad):
    trainer = make_trainer(temperature=temperature)
    batch = make_batch(left_pad=left_pad)
    m = batch["completion_mask"].bool()
    ref = trl_logps(trainer, batch)
    ours = our_logps(trainer, batch, temperature)
    assert ours.shape == ref.shape == (B, TC)
    torch.testing.assert_close(ours[m], ref[m], atol=ATOL, rtol=1e-5)

    # Gradients of a weighted sum w.r.t. a few weights.
    w = torch.randn(B, TC, generator=torch.Generator().manual_seed(1)) * batch["completion_mask"]
    params = probe_params(trainer.model)
    g_ref = torch.autograd.grad((ref * w).sum(), params)
    g_ours = torch.autograd.grad((ours * w).sum(), params)
    for a, b in zip(g_ours, g_ref):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


def test_temperature_changes_logprobs(make_trainer):
    """Guards the temperature tests above against TRL silently ignoring its temperature."""
    batch = make_batch()
    m = batch["completion_mask"].bool()
    with torch.no_grad():
        t1 = trl_logps(make_trainer(temperature=1.0), batch)
        t07 = trl_logps(make_trainer(temperature=0.7), batch)
    assert (t1[m] - t07[m]).abs().max() > 1e-2


LOSS_CASES = [
    (loss_type, beta, epsilon_high, False, "token")
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo")
    for beta in (0.0, 0.04)
    for epsilon_high in (None, 0.28)
] + [("dapo", 0.04, None, True, "token"), ("grpo", 0.04, 0.28, True, "token")]  # TRL's default bias-corrected KL
# GSPO: one importance ratio per completion (TRL's importance_sampling_level="sequence").
LOSS_CASES += [("grpo", 0.0, None, False, "sequence"), ("grpo", 0.04, 0.28, True, "sequence"),
               ("dapo", 0.0, 0.28, False, "sequence")]


@pytest.mark.filterwarnings("ignore:importance_sampling_level='sequence'")
@pytest.mark.parametrize("with_old", [False, True], ids=["on-policy", "old-logps"])
@pytest.mark.parametrize("loss_type,beta,epsilon_high,bias_kl,level", LOSS_CASES,
                         ids=[f"{lt}-beta{b}-epsh{e}{'-biaskl' if k else ''}-{lv}" for lt, b, e, k, lv in LOSS_CASES])
def test_loss_matches_trl(make_trainer, loss_type, beta, epsilon_high, bias_kl, level, with_old):
    temperature = 0.7 if loss_type == "grpo" else 1.0  # one loss type also goes through the temperature path
    trainer = make_trainer(temperature=temperature, loss_type=loss_type, beta=beta, epsilon_high=epsilon_high,
                           bias_kl=bias_kl, level=level)
    batch = make_batch(seed=2)
    mask = batch["completion_mask"]
    g = torch.Generator().manual_seed(3)

    with torch.no_grad():
        current = our_logps(trainer, batch, temperature)
    inputs = dict(batch)
    old = None
    if with_old:
        # Large enough perturbations that some tokens fall outside the clip range on both sides.
        old = (current + 0.5 * torch.randn(B, TC, generator=g)) * mask
        inputs["old_per_token_logps"] = old
    ref_logps = None
    if beta > 0:
        ref_logps = (current + 0.3 * torch.randn(B, TC, generator=g)) * mask
        inputs["ref_per_token_logps"] = ref_logps
    inputs["num_items_in_batch"] = mask.sum()  # dapo: tokens of the whole generation batch

    params = probe_params(trainer.model)
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    g_trl = torch.autograd.grad(trl_loss, params)

    lp = our_logps(trainer, batch, temperature)
    ours, metrics = grpo_loss(lp, old, ref_logps, batch["advantages"], mask, beta=beta, epsilon=0.2,
                              epsilon_high=epsilon_high, loss_type=loss_type,
                              max_completion_length=MAX_COMPLETION_LENGTH, use_bias_correction_kl=bias_kl,
                              importance_sampling_level=level)
    g_ours = torch.autograd.grad(ours, params)

    torch.testing.assert_close(ours.detach(), trl_loss.detach(), atol=ATOL, rtol=1e-5)
    for a, b in zip(g_ours, g_trl):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)

    # The clip-ratio metric TRL just logged for this batch is ours too.
    logged = trainer._metrics["train"]
    torch.testing.assert_close(metrics["clip_ratio"].item(), logged["clip_ratio/region_mean"][-1], atol=1e-6, rtol=0)
    torch.testing.assert_close(metrics["clip_ratio_low"].item(), logged["clip_ratio/low_mean"][-1], atol=1e-6, rtol=0)
    torch.testing.assert_close(metrics["clip_ratio_high"].item(), logged["clip_ratio/high_mean"][-1], atol=1e-6,
                               rtol=0)
    if beta > 0:
        torch.testing.assert_close(metrics["kl"].item(), logged["kl"][-1], atol=1e-5, rtol=1e-5)
    if with_old:
        assert metrics["clip_ratio"].item() > 0, "the batch should exercise clipping"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropies_match_trl(make_trainer, temperature):
    trainer = make_trainer(temperature=temperature)
    batch = make_batch(seed=4, left_pad=True)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        theirs = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, TC,
                                                            compute_entropy=True)[1]
        _, ours = completion_logprobs(trainer.model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                      batch["completion_mask"], temperature=temperature, return_entropy=True)
    m = batch["completion_mask"].bool()
    torch.testing.assert_close(ours[m], theirs[m], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_top_entropy_quantile_loss_matches_trl(make_trainer, loss_type):
    """Only the top 40% highest-entropy tokens carry the policy gradient, in both libraries."""
    trainer = make_trainer(loss_type=loss_type, beta=0.04, top_entropy_quantile=0.4)
    batch = make_batch(seed=5)
    mask = batch["completion_mask"]
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        current = our_logps(trainer, batch, 1.0)
    old = (current + 0.5 * torch.randn(B, TC, generator=g)) * mask
    ref = (current + 0.3 * torch.randn(B, TC, generator=g)) * mask
    inputs = {**batch, "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    params = probe_params(trainer.model)
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    g_trl = torch.autograd.grad(trl_loss, params)

    lp, entropies = completion_logprobs(trainer.model, batch["prompt_ids"], batch["prompt_mask"],
                                        batch["completion_ids"], mask, return_entropy=True)
    keep = high_entropy_mask(entropies, mask, 0.4)
    assert 0 < int(keep.sum()) < int(mask.sum())
    ours, _ = grpo_loss(lp, old, ref, batch["advantages"], mask, beta=0.04, loss_type=loss_type,
                        max_completion_length=MAX_COMPLETION_LENGTH, entropy_mask=keep,
                        use_bias_correction_kl=getattr(trainer.args, "use_bias_correction_kl", False))
    torch.testing.assert_close(ours.detach(), trl_loss.detach(), atol=ATOL, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(ours, params), g_trl):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


# --------------------------------------------------------------------------------------
# CISPO and SAPO (TRL's loss_type="cispo" / "sapo"), token and sequence level.

CISPO_SAPO_CASES = [("cispo", 0.0, 1.3, (1.0, 1.05), "token"), ("cispo", 0.04, 5.0, (1.0, 1.05), "token"),
                    ("cispo", 0.0, 1.1, (1.0, 1.05), "sequence"), ("sapo", 0.0, None, (1.0, 1.05), "token"),
                    ("sapo", 0.04, None, (0.5, 2.0), "token"), ("sapo", 0.0, None, (1.0, 1.05), "sequence")]


@pytest.mark.filterwarnings("ignore:importance_sampling_level='sequence'")
@pytest.mark.parametrize("loss_type,beta,epsilon_high,temps,level", CISPO_SAPO_CASES,
                         ids=[f"{lt}-beta{b}-epsh{e}-tau{t[0]}_{t[1]}-{lv}" for lt, b, e, t, lv in CISPO_SAPO_CASES])
def test_cispo_and_sapo_match_trl(make_trainer, loss_type, beta, epsilon_high, temps, level):
    trainer = make_trainer(loss_type=loss_type, beta=beta, epsilon_high=epsilon_high, level=level,
                           sapo_temperatures=temps)
    batch = make_batch(seed=7)
    mask = batch["completion_mask"]
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        current = our_logps(trainer, batch, 1.0)
    old = (current + 0.5 * torch.randn(B, TC, generator=g)) * mask  # off-policy: caps and gates bite
    inputs = {**batch, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    ref_logps = None
    if beta > 0:
        ref_logps = inputs["ref_per_token_logps"] = (current + 0.3 * torch.randn(B, TC, generator=g)) * mask
    params = probe_params(trainer.model)
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    g_trl = torch.autograd.grad(trl_loss, params)

    lp = our_logps(trainer, batch, 1.0)
    ours, metrics = grpo_loss(lp, old, ref_logps, batch["advantages"], mask, beta=beta, epsilon=0.2,
                              epsilon_high=epsilon_high, loss_type=loss_type,
                              max_completion_length=MAX_COMPLETION_LENGTH, importance_sampling_level=level,
                              sapo_temperature_pos=temps[0], sapo_temperature_neg=temps[1])
    torch.testing.assert_close(ours.detach(), trl_loss.detach(), atol=ATOL, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(ours, params), g_trl):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)
    if loss_type == "cispo":  # TRL logs the capped share as cispo_clip_ratio; ours is clip_ratio(_high)
        logged = trainer._metrics["train"]["cispo_clip_ratio"][-1]
        torch.testing.assert_close(metrics["clip_ratio_high"].item(), logged, atol=1e-6, rtol=0)
        torch.testing.assert_close(metrics["clip_ratio"].item(), logged, atol=1e-6, rtol=0)
        if level == "token" and epsilon_high < 2:  # exp(noise) rarely reaches the paper's 5.0
            assert 0 < logged < 1, "the batch should cap some weights and not others"


# --------------------------------------------------------------------------------------
# The rollout log-prob correction (TRL's vllm_importance_sampling_*).


def trl_importance_sampling_ratio(old_per_token_logps, sampling_per_token_logps, mask, mode, clip_min, clip_max):
    """TRL 1.16's ratio, as written inline in GRPOTrainer._generate_and_score_completions (not callable alone)."""
    import math

    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True) if sequence_level_is else per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio


def test_trl_importance_sampling_transcription_is_current():
    """The transcription above is of the TRL that is installed: its lines are still in its source."""
    import inspect

    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for line in ["per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
                 "per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)",
                 "vllm_importance_sampling_ratio = torch.exp(logps_diff)",
                 "invalid_mis_mask, value=0.0"]:
        assert line in source, line


RC_CASES = [("token_truncate", None, 3.0), ("token_truncate", 0.5, 1.5), ("token_mask", 0.7, 1.4),
            ("sequence_truncate", None, 2.0), ("sequence_mask", 0.2, 3.0), ("sequence_mask", None, 3.0)]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo", "sapo"])
@pytest.mark.parametrize("mode,clip_min,clip_max", RC_CASES)
def test_rollout_correction_matches_trl(make_trainer, loss_type, mode, clip_min, clip_max):
    """Our weights equal TRL's ratio formula, and the loss weighted by them equals TRL's _compute_loss with
    its vLLM correction on (the flags set on a built trainer: vLLM itself is not installed here)."""
    from grpo_nb.loss import rollout_correction_stats, rollout_importance_weights

    trainer = make_trainer(loss_type=loss_type, beta=0.04, epsilon_high=1.3 if loss_type == "cispo" else None)
    batch = make_batch(seed=9)
    mask = batch["completion_mask"]
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():
        current = our_logps(trainer, batch, 1.0)
    old = (current + 0.3 * torch.randn(B, TC, generator=g)) * mask  # the trainer's log-probs at sampling time
    sampling = (old + 0.25 * torch.randn(B, TC, generator=g)) * mask  # the engine's, a little off
    ref = (current + 0.3 * torch.randn(B, TC, generator=g)) * mask
    expected = trl_importance_sampling_ratio(old, sampling, mask, mode, clip_min, clip_max)
    weights = rollout_importance_weights(old, sampling, mask, mode=mode, clip_min=clip_min, clip_max=clip_max)
    torch.testing.assert_close(weights, expected, atol=0, rtol=0)
    if mode.endswith("mask"):
        assert (weights == 0).any() and (weights > 0).any(), "the case should mask some ratios and keep others"

    inputs = {**batch, "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum(),
              "importance_sampling_ratio": expected, "sampling_per_token_logps": sampling}
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    try:
        params = probe_params(trainer.model)
        trl_loss = trainer._compute_loss(trainer.model, inputs)
        g_trl = torch.autograd.grad(trl_loss, params)
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = False, False
    lp = our_logps(trainer, batch, 1.0)
    ours, _ = grpo_loss(lp, old, ref, batch["advantages"], mask, beta=0.04, epsilon=0.2,
                        epsilon_high=1.3 if loss_type == "cispo" else None, loss_type=loss_type,
                        max_completion_length=MAX_COMPLETION_LENGTH, rollout_weights=weights,
                        use_bias_correction_kl=getattr(trainer.args, "use_bias_correction_kl", False))
    torch.testing.assert_close(ours.detach(), trl_loss.detach(), atol=ATOL, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(ours, params), g_trl):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)

    # The step record's stats are TRL's sampling/importance_sampling_ratio/{min,mean,max} and
    # sampling/sampling_logp_difference/{mean,max}, over real tokens (every row for one ratio per row).
    stats = rollout_correction_stats(weights, old, sampling, mask)
    flat = expected.flatten() if expected.shape[1] == 1 else expected[mask.bool()]
    delta = (old - sampling).abs()[mask.bool()]
    assert stats["is_ratio_sum"] / stats["is_ratio_count"] == pytest.approx(float(flat.mean()), rel=1e-6)
    assert (stats["is_ratio_min"], stats["is_ratio_max"]) == pytest.approx((float(flat.min()), float(flat.max())))
    assert stats["logprob_diff_sum"] / stats["logprob_diff_count"] == pytest.approx(float(delta.mean()), rel=1e-6)
    assert stats["logprob_diff_max"] == pytest.approx(float(delta.max()))


# --------------------------------------------------------------------------------------
# Advantages with unscorable completions (every reward function returned None), against TRL's own
# _generate_and_score_completions: left out of their group's mean and std, advantage 0.

G_UNSCORED = 4
FIRST_SCORES = {0, 1, 2, 3, 4, 5, 8, 12}  # completion indices each function scores (None elsewhere): group 0
SECOND_SCORES = {0, 2, 5, 6, 10}  # all scored, group 1 one unscored, group 2 two, group 3 one scored, group 4 none


@pytest.fixture(scope="module")
def unscored_rewards():
    """Two reward functions returning None by position; `seen` keeps what each returned last."""
    seen = {}

    def first(completions, **kwargs):
        seen["first"] = [float(len(c) % 5) if i in FIRST_SCORES else None for i, c in enumerate(completions)]
        return seen["first"]

    def second(completions, **kwargs):
        seen["second"] = [float(len(c) % 3) - 1 if i in SECOND_SCORES else None for i, c in enumerate(completions)]
        return seen["second"]

    return first, second, seen


def _scored_inputs_and_per_func(trainer, seen):
    prompts = [f"w{5 + 3 * i} w6 w7" for i in range(5)]
    out = trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(G_UNSCORED)])
    per_func = torch.tensor([[math.nan if v is None else v for v in seen[name]] for name in ("first", "second")]).T
    return out, per_func


def _trl_trainer(tmp_path_factory, trainer_cls, config_cls, reward_funcs, **settings):
    from datasets import Dataset

    root = tmp_path_factory.mktemp(trainer_cls.__name__)
    tiny_model("llama", tied=False, seed=0, attn_implementation="sdpa").save_pretrained(root / "model")
    args = config_cls(output_dir=str(root / "out"), report_to=[], per_device_train_batch_size=G_UNSCORED,
                      num_generations=G_UNSCORED, max_completion_length=MAX_COMPLETION_LENGTH, use_cpu=True,
                      bf16=False, save_strategy="no", seed=0, reward_weights=[1.0, 0.5], **settings)
    trainer = trainer_cls(model=str(root / "model"), reward_funcs=list(reward_funcs), args=args,
                          processing_class=tiny_tokenizer(),
                          train_dataset=Dataset.from_dict({"prompt": ["w5 w6 w7"] * G_UNSCORED}))
    trainer.model.train()  # the "train" branch: num_generations and the train metrics
    return trainer


def test_unscorable_completions_match_trl_advantages(tmp_path_factory, unscored_rewards):
    from trl import GRPOConfig, GRPOTrainer

    from grpo_nb.loss import group_advantages, informative_groups
    from grpo_nb.reward_calls import combine_rewards

    first, second, seen = unscored_rewards
    trainer = _trl_trainer(tmp_path_factory, GRPOTrainer, GRPOConfig, (first, second))
    for scale in ("group", "batch", "none"):
        trainer.scale_rewards = scale
        out, per_func = _scored_inputs_and_per_func(trainer, seen)
        rewards = combine_rewards(per_func, [1.0, 0.5])
        assert rewards.isnan().tolist() == [i not in FIRST_SCORES | SECOND_SCORES for i in range(20)]
        ours = group_advantages(rewards, G_UNSCORED, scale_rewards=scale)
        torch.testing.assert_close(ours, out["advantages"], atol=1e-5, rtol=1e-5)
        assert (ours[4:8] != 0).sum() >= 2 and (ours[12:] == 0).all(), "the case should keep signal in group 1"
        # The logged mean reward is over the scored completions (TRL's nanmean), as the record's "reward".
        assert float(rewards.nanmean()) == pytest.approx(trainer._metrics["train"]["reward"][-1], rel=1e-6)
    assert informative_groups(rewards, G_UNSCORED).tolist()[3:] == [False, False]  # one scored, none scored


def test_unscorable_completions_match_trl_rloo(tmp_path_factory, unscored_rewards):
    """Our "rloo" estimator unscaled is TRL's RLOOTrainer without normalize_advantages (beta=0)."""
    from trl import RLOOConfig, RLOOTrainer

    from grpo_nb.loss import group_advantages
    from grpo_nb.reward_calls import combine_rewards

    first, second, seen = unscored_rewards
    trainer = _trl_trainer(tmp_path_factory, RLOOTrainer, RLOOConfig, (first, second), beta=0.0,
                           normalize_advantages=False)
    out, per_func = _scored_inputs_and_per_func(trainer, seen)
    ours = group_advantages(combine_rewards(per_func, [1.0, 0.5]), G_UNSCORED, scale_rewards="none", estimator="rloo")
    torch.testing.assert_close(ours, out["advantages"], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- multi-turn (tools)

@pytest.mark.parametrize("mask_truncated", [False, True])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_multi_turn_loss_masks_tool_tokens_as_trl(make_trainer, loss_type, mask_truncated):
    """An episode batch: completions in which a tool's result sits between the model's turns. grpo-nb's StepBatch
    (from the rollout's env_mask) trains exactly the tokens TRL's _compute_loss trains with its tool_mask, and the
    loss and gradients are TRL's."""
    from grpo_nb.batch import StepBatch
    from grpo_nb.config import GRPOConfig as OurConfig
    from grpo_nb.reward_contract import RewardLog
    from grpo_nb.rollout import RolloutBatch
    from grpo_nb.scoring import ScoredGroups

    trainer = make_trainer(loss_type=loss_type)
    batch = make_batch(seed=5)
    tool_mask = torch.ones(B, TC, dtype=torch.long)
    tool_mask[0, 2:5] = 0  # a tool's result in the middle of row 0, another at the end of row 3's real tokens
    tool_mask[3, 4:6] = 0
    truncated = torch.tensor([False, False, True, False])
    rollout = RolloutBatch(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"],
                           truncated, None, tool_mask)
    n = B
    groups = ScoredGroups([{"prompt": "w5"}] * n, 4, rollout, [""] * n, [""] * n, [[]] * n, [], 0.0, 0,
                          torch.tensor([[1.0], [0.0], [2.0], [0.5]]), RewardLog(n))
    ours_batch = StepBatch.from_groups(groups, OurConfig(num_generations=4, per_device_train_batch_size=4,
                                                         gradient_accumulation_steps=1, loss_type=loss_type,
                                                         mask_truncated_completions=mask_truncated))
    # TRL's mask_truncated_completions zeroes truncated rows of completion_mask and tool_mask; its loss masks with
    # their product
    kept = (~truncated).long()[:, None] if mask_truncated else torch.ones(B, 1, dtype=torch.long)
    trl_completion_mask, trl_tool_mask = batch["completion_mask"] * kept, tool_mask * kept
    trl_mask = trl_completion_mask * trl_tool_mask
    assert torch.equal(ours_batch.loss_mask, trl_mask)
    assert ours_batch.completion_lengths.tolist() == (batch["completion_mask"] * tool_mask).sum(1).tolist()

    inputs = {**batch, "completion_mask": trl_completion_mask, "advantages": ours_batch.advantages,
              "tool_mask": trl_tool_mask, "num_items_in_batch": trl_mask.sum()}
    params = probe_params(trainer.model)
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    g_trl = torch.autograd.grad(trl_loss, params)
    ours, _ = grpo_loss(our_logps(trainer, batch, 1.0), None, None, ours_batch.advantages, ours_batch.loss_mask,
                        beta=0.0, epsilon=0.2, loss_type=loss_type, max_completion_length=MAX_COMPLETION_LENGTH)
    torch.testing.assert_close(ours.detach(), trl_loss.detach(), atol=ATOL, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(ours, params), g_trl):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


# --------------------------------------------------------------------------------------
# LUSPO and VESPO (TRL's loss_type="luspo" / "vespo"), the off-policy sequence mask (off_policy_mask_threshold)
# and the entropy bonus (entropy_coef, use_adaptive_entropy), against TRL's own _compute_loss.

def _off_policy_inputs(trainer, seed, old_scale=0.5):
    batch = make_batch(seed=seed)
    mask = batch["completion_mask"]
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        current = our_logps(trainer, batch, 1.0)
    old = (current + old_scale * torch.randn(B, TC, generator=g)) * mask
    ref = (current + 0.3 * torch.randn(B, TC, generator=g)) * mask
    return batch, {**batch, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}, old, ref


def _same_loss_and_grads(trainer, inputs, ours_fn):
    params = probe_params(trainer.model)
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    g_trl = torch.autograd.grad(trl_loss, params)
    ours, metrics = ours_fn()
    torch.testing.assert_close(ours.detach(), trl_loss.detach(), atol=ATOL, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(ours, params), g_trl):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)
    return metrics


VESPO = (("vespo_k_pos", 1.5), ("vespo_lambda_pos", 2.5), ("vespo_k_neg", 2.0), ("vespo_lambda_neg", 1.0))
LUSPO_VESPO_CASES = [("luspo", 0.0, "sequence", ()), ("luspo", 0.04, "token", ()), ("vespo", 0.0, "token", ()),
                     ("vespo", 0.04, "token", VESPO)]


@pytest.mark.filterwarnings("ignore:loss_type='luspo'")
@pytest.mark.parametrize("loss_type,beta,level,more", LUSPO_VESPO_CASES,
                         ids=[f"{lt}-beta{b}-{lv}{'-k_lambda' if m else ''}" for lt, b, lv, m in LUSPO_VESPO_CASES])
def test_luspo_and_vespo_match_trl(make_trainer, loss_type, beta, level, more):
    trainer = make_trainer(loss_type=loss_type, beta=beta, level=level, more=more)
    batch, inputs, old, ref = _off_policy_inputs(trainer, seed=11, old_scale=0.3)
    if beta > 0:
        inputs["ref_per_token_logps"] = ref
    bias_kl = getattr(trainer.args, "use_bias_correction_kl", False)
    metrics = _same_loss_and_grads(trainer, inputs, lambda: grpo_loss(
        our_logps(trainer, batch, 1.0), old, ref if beta > 0 else None, batch["advantages"], batch["completion_mask"],
        beta=beta, loss_type=loss_type, importance_sampling_level=level, use_bias_correction_kl=bias_kl,
        max_completion_length=MAX_COMPLETION_LENGTH, **dict(more)))
    logged = trainer._metrics["train"]
    if loss_type == "vespo":
        phi = logged["vespo/phi_seq_mean"][-1]
        assert 0 < phi and abs(phi - 1) > 1e-3, "the batch should weigh completions by something other than 1"
        torch.testing.assert_close(metrics["vespo_phi_mean"].item(), phi, atol=1e-6, rtol=1e-5)
    else:
        torch.testing.assert_close(metrics["clip_ratio"].item(), logged["clip_ratio/region_mean"][-1], atol=1e-6,
                                   rtol=0)


@pytest.mark.parametrize("mode,clip_min,clip_max", [("token_truncate", None, 3.0), ("token_mask", 0.7, 1.4)])
def test_vespo_takes_the_rollout_correction_into_its_weight_as_trl(make_trainer, mode, clip_min, clip_max):
    from grpo_nb.loss import rollout_importance_weights

    trainer = make_trainer(loss_type="vespo", beta=0.0, level="token", more=())  # the case above's (cached)
    batch, inputs, old, _ = _off_policy_inputs(trainer, seed=12, old_scale=0.2)
    mask = batch["completion_mask"]
    sampling = (old + 0.25 * torch.randn(B, TC, generator=torch.Generator().manual_seed(13))) * mask
    weights = rollout_importance_weights(old, sampling, mask, mode=mode, clip_min=clip_min, clip_max=clip_max)
    inputs.update(importance_sampling_ratio=weights, sampling_per_token_logps=sampling)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    try:
        _same_loss_and_grads(trainer, inputs, lambda: grpo_loss(
            our_logps(trainer, batch, 1.0), old, None, batch["advantages"], mask, loss_type="vespo",
            rollout_weights=weights))
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = False, False
    with pytest.raises(ValueError, match="token-level rollout_weights only"):
        grpo_loss(old, old, None, batch["advantages"], mask, loss_type="vespo", rollout_weights=weights[:, :1])


@pytest.mark.parametrize("loss_type,with_sampling", [("dapo", False), ("cispo", True)])
def test_off_policy_mask_matches_trl(make_trainer, loss_type, with_sampling):
    from trl import GRPOTrainer

    from grpo_nb.loss import off_policy_mask

    threshold = 0.1
    trainer = make_trainer(loss_type=loss_type, epsilon_high=1.3 if loss_type == "cispo" else None,
                           more=(("off_policy_mask_threshold", threshold),))
    batch, inputs, old, _ = _off_policy_inputs(trainer, seed=14)
    mask, adv = batch["completion_mask"], batch["advantages"]
    sampling = None
    if with_sampling:  # the engine's log-probs: the mask reads them, not the old policy's (TRL's vLLM path)
        sampling = (old + 0.4 * torch.randn(B, TC, generator=torch.Generator().manual_seed(15))) * mask
        inputs["sampling_per_token_logps"] = sampling
    lp = our_logps(trainer, batch, 1.0)
    against = old if sampling is None else sampling
    kept = off_policy_mask(adv, lp, against, mask, threshold)
    expected = GRPOTrainer.get_off_policy_mask(adv.unsqueeze(1), lp, against, mask, threshold)
    torch.testing.assert_close(kept, expected.to(kept.dtype), atol=0, rtol=0)
    assert 0 < kept.sum() < B and (kept[adv >= 0] == 1).all(), "the case should drop a negative-advantage completion"
    metrics = _same_loss_and_grads(trainer, inputs, lambda: grpo_loss(
        our_logps(trainer, batch, 1.0), old, None, adv, mask, loss_type=loss_type,
        epsilon_high=1.3 if loss_type == "cispo" else None, max_completion_length=MAX_COMPLETION_LENGTH,
        off_policy_mask_threshold=threshold, sampling_logprobs=sampling))
    assert metrics["off_policy_masked"].item() == pytest.approx(1 - float(kept.mean()))
    # without the threshold the loss differs: the mask is what made them equal
    unmasked, _ = grpo_loss(lp, old, None, adv, mask, loss_type=loss_type,
                            epsilon_high=1.3 if loss_type == "cispo" else None,
                            max_completion_length=MAX_COMPLETION_LENGTH)
    masked, _ = grpo_loss(lp, old, None, adv, mask, loss_type=loss_type,
                          epsilon_high=1.3 if loss_type == "cispo" else None,
                          max_completion_length=MAX_COMPLETION_LENGTH, off_policy_mask_threshold=threshold,
                          sampling_logprobs=sampling)
    assert abs(float(unmasked) - float(masked)) > 1e-4


def _logprobs_and_entropies(trainer, batch):
    """What accumulate_gradients computes for the entropy bonus: log-probs and entropies with their gradient."""
    from types import SimpleNamespace

    from grpo_nb.step import logprobs_and_entropies

    settings = SimpleNamespace(temperature=1.0, logprob_chunk_size=7,  # 7: several chunks
                               logprob_backend="torch", prefix_sharing=False)
    return logprobs_and_entropies(trainer.model, SimpleNamespace(**batch), settings)


@pytest.mark.parametrize("loss_type,quantile", [("dapo", 1.0), ("grpo", 0.4), ("vespo", 1.0)])
def test_entropy_bonus_matches_trl(make_trainer, loss_type, quantile):
    trainer = make_trainer(loss_type=loss_type, top_entropy_quantile=quantile, more=(("entropy_coef", 0.05),))
    batch, inputs, old, _ = _off_policy_inputs(trainer, seed=16, old_scale=0.2)
    mask = batch["completion_mask"]

    def ours():
        lp, entropies = _logprobs_and_entropies(trainer, batch)
        keep = high_entropy_mask(entropies, mask, quantile) if quantile < 1 else None
        return grpo_loss(lp, old, None, batch["advantages"], mask, loss_type=loss_type, entropy_mask=keep,
                         max_completion_length=MAX_COMPLETION_LENGTH, entropies=entropies, entropy_coef=0.05)

    metrics = _same_loss_and_grads(trainer, inputs, ours)
    assert metrics["entropy"].item() > 0
    assert trainer._metrics["train"]["entropy_coef"][-1] == 0.05


def test_adaptive_entropy_control_matches_trl(make_trainer):
    """Two optimizer steps of TRL's Skywork-OR1 control against entropy_control / entropy_control_step: the first
    applies no bonus (no measurement yet), moves the coefficient by delta and remembers the entropy; the second
    applies the moved coefficient while the entropy is below the target."""
    from grpo_nb.config import GRPOConfig as OurConfig
    from grpo_nb.step import entropy_control, entropy_control_step

    settings = dict(entropy_coef=0.02, use_adaptive_entropy=True, entropy_coef_delta=0.01, entropy_target=50.0,
                    entropy_coef_min=0.0, entropy_coef_max=0.025)
    trainer = make_trainer(more=tuple(settings.items()))
    trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = 0.02, math.inf, None
    config = OurConfig(num_generations=4, per_device_train_batch_size=4, **settings)
    batch, inputs, old, _ = _off_policy_inputs(trainer, seed=17, old_scale=0.2)
    mask = batch["completion_mask"]
    history = []
    for _ in range(2):
        coef, applied = entropy_control(config, history)

        def ours():
            lp, entropies = _logprobs_and_entropies(trainer, batch)
            return grpo_loss(lp, old, None, batch["advantages"], mask, entropies=entropies, entropy_coef=applied)

        metrics = _same_loss_and_grads(trainer, inputs, ours)
        record = entropy_control_step(config, coef, float(metrics["entropy"] * metrics["entropy_tokens"]),
                                      float(metrics["entropy_tokens"]))
        assert record["entropy_coef"] == pytest.approx(trainer.entropy_coef)
        assert record["entropy_window"] == pytest.approx(trainer._last_world_entropy, rel=1e-6)
        history.append(record)
    assert [r["entropy_coef"] for r in history] == pytest.approx([0.025, 0.025])  # up by delta, capped at max
    assert entropy_control(config, history) == pytest.approx((0.025, 0.025))
    assert entropy_control(config.replace(entropy_target=0.1), history) == pytest.approx((0.025, 0.0))


# --------------------------------------------------------------------------------------
# TRL's two-sided clipping (delta, INTELLECT-2): the unclipped ratio term capped at delta, for the clipped loss types.

DELTA = 1.5  # above 1 + epsilon_high (TRL's advice), below the ratios the negative-advantage rows are given below
DELTA_CASES = [("grpo", 0.0, "token", DELTA), ("bnpo", 0.0, "token", DELTA), ("dr_grpo", 0.0, "token", DELTA),
               ("dapo", 0.04, "token", DELTA), ("dapo", 0.0, "sequence", DELTA), ("luspo", 0.0, "sequence", DELTA),
               # below 1 + epsilon_high (GRPOConfig warns): TRL reads the clip metrics from the capped ratio
               ("dapo", 0.0, "token", 1.1)]


@pytest.mark.filterwarnings("ignore:importance_sampling_level='sequence'")
@pytest.mark.parametrize("loss_type,beta,level,delta", DELTA_CASES,
                         ids=[f"{lt}-beta{b}-{lv}-delta{d}" for lt, b, lv, d in DELTA_CASES])
def test_two_sided_clipping_matches_trl(make_trainer, loss_type, beta, level, delta):
    trainer = make_trainer(loss_type=loss_type, beta=beta, epsilon_high=0.28, bias_kl=beta > 0, level=level,
                           more=(("delta", delta),))
    assert trainer.args.delta == delta
    batch = make_batch(seed=21)
    mask, adv = batch["completion_mask"], batch["advantages"]
    g = torch.Generator().manual_seed(22)
    with torch.no_grad():
        current = our_logps(trainer, batch, 1.0)
    # the rows sampled at lower probability than now: ratios around e^0.6 > DELTA for the negative advantages (per
    # token and per completion, so the cap binds), around e^0.3 > 1 + epsilon_high for some of the positive ones
    old = (current + 0.3 * torch.randn(B, TC, generator=g) - torch.where(adv < 0, 0.6, 0.3).unsqueeze(1)) * mask
    ref = (current + 0.3 * torch.randn(B, TC, generator=g)) * mask
    inputs = {**batch, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    if beta > 0:
        inputs["ref_per_token_logps"] = ref
    settings = dict(beta=beta, epsilon_high=0.28, loss_type=loss_type, importance_sampling_level=level,
                    use_bias_correction_kl=beta > 0, max_completion_length=MAX_COMPLETION_LENGTH)
    metrics = _same_loss_and_grads(trainer, inputs, lambda: grpo_loss(
        our_logps(trainer, batch, 1.0), old, ref if beta > 0 else None, adv, mask, delta=delta, **settings))
    logged = trainer._metrics["train"]
    for ours, theirs in (("clip_ratio", "region_mean"), ("clip_ratio_low", "low_mean"),
                         ("clip_ratio_high", "high_mean")):
        torch.testing.assert_close(metrics[ours].item(), logged[f"clip_ratio/{theirs}"][-1], atol=1e-6, rtol=0)
    # the cap is what made them equal: without it the loss differs
    with torch.no_grad():
        lp = our_logps(trainer, batch, 1.0)
        capped, _ = grpo_loss(lp, old, ref if beta > 0 else None, adv, mask, delta=delta, **settings)
        uncapped, plain = grpo_loss(lp, old, ref if beta > 0 else None, adv, mask, **settings)
    assert abs(float(capped) - float(uncapped)) > 1e-4
    if delta < 1.28:  # no capped ratio is above 1 + epsilon_high, though some plain ones are
        assert metrics["clip_ratio_high"].item() == 0 < plain["clip_ratio_high"].item()


def test_delta_is_ignored_where_trl_ignores_it():
    """cispo / sapo / vespo have no unclipped ratio term: delta changes nothing, in TRL and here (GRPOConfig warns)."""
    batch = make_batch(seed=21)
    mask, adv = batch["completion_mask"], batch["advantages"]
    lp = torch.randn(B, TC, generator=torch.Generator().manual_seed(23)) * mask
    old = lp - 0.6 * (adv < 0).unsqueeze(1) * mask
    for loss_type in ("cispo", "sapo", "vespo"):
        plain, _ = grpo_loss(lp, old, None, adv, mask, loss_type=loss_type, epsilon_high=5.0)
        with_delta, _ = grpo_loss(lp, old, None, adv, mask, loss_type=loss_type, epsilon_high=5.0, delta=1.1)
        assert float(plain) == float(with_delta), loss_type
    with pytest.raises(ValueError, match=r"grpo_loss: delta=0 must be a finite number > 0"):
        grpo_loss(lp, old, None, adv, mask, delta=0)
