"""Group-relative advantages and the clipped GRPO surrogate loss.

Definitions follow TRL's GRPOTrainer so that settings and results carry over; the tests
check both against a direct computation and against TRL itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# How the rollout engine's log-probs are reconciled with the trainer's (TRL's vllm_importance_sampling_mode):
# one ratio per token or per completion, ratios outside [clip_min, clip_max] clipped ("truncate") or zeroed ("mask").
ROLLOUT_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def check_groups(num_generations, total: int, *, minimum: int = 1, total_is: str = "the batch", fix: str = "") -> None:
    """The group rule: `num_generations` is an integer >= `minimum` and `total` completions are whole groups."""
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < minimum:
        need = ("at least 2 generations per prompt: GRPO compares completions within a group" if minimum >= 2
                else "a positive integer")
        raise ValueError(f"num_generations={num_generations!r} is invalid: expected {need}")
    if total % num_generations:
        raise ValueError(f"{total_is} = {total} completions is not divisible by num_generations={num_generations}: "
                         f"each prompt's group must be whole. {fix or f'Use a multiple of {num_generations}.'}")


def informative_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[groups] bool: the group's rewards are not all equal. A group whose rewards are all equal
    gets zero advantages: it carries no learning signal (and dynamic sampling drops it). NaN
    rewards (completions no reward function scored) are left out, as `group_advantages` does."""
    grouped = rewards.view(-1, num_generations)
    unscored = grouped.isnan()
    return grouped.masked_fill(unscored, -math.inf).amax(1) > grouped.masked_fill(unscored, math.inf).amin(1)


def group_advantages(rewards: torch.Tensor, num_generations: int, *, scale_rewards: str = "group",
                     estimator: str = "grpo") -> torch.Tensor:
    """Advantage of each completion over a baseline from its group.

    `rewards` is [N] with the `num_generations` completions of one prompt next to each other.
    `estimator`: "grpo" takes the group's mean reward as the baseline; "rloo" (REINFORCE
    leave-one-out) the mean of the *other* completions' rewards, which keeps a completion's
    own reward out of its baseline: r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean), so RLOO is
    GRPO's advantage scaled by G/(G-1) before `scale_rewards` applies.
    `scale_rewards`: "group" divides by each group's std, "batch" by the std of the whole
    batch, "none" leaves the difference unscaled (Dr. GRPO's advice; TRL's RLOO default). A
    group whose rewards are all equal gets zero advantages (see `informative_groups`).

    A NaN reward marks an unscorable completion (no reward function scored it). As in TRL's
    GRPOTrainer and RLOOTrainer, it is left out of the means and stds (G above counts the scored
    completions only) and its advantage is 0. Where a std or a leave-one-out baseline has fewer
    than two scored completions to work from, the advantages it would scale are 0 too.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {SCALE_REWARDS}")
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not one of {ADVANTAGE_ESTIMATORS}")
    if estimator == "rloo" and num_generations < 2:
        raise ValueError("the leave-one-out baseline needs num_generations >= 2")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    check_groups(num_generations, rewards.numel(), total_is="rewards")

    def nanstd(x: torch.Tensor, dim=None) -> torch.Tensor:
        """The unbiased std of the non-NaN values (TRL's nanstd): NaN with fewer than two."""
        scored = (~x.isnan()).sum(dim=dim)
        squares = (x - x.nanmean(dim=dim, keepdim=dim is not None)).square().nansum(dim=dim)
        return (squares / (scored - 1)).sqrt().masked_fill(scored < 2, math.nan)

    grouped = rewards.view(-1, num_generations)
    advantages = grouped - grouped.nanmean(dim=1, keepdim=True)
    if estimator == "rloo":
        scored = (~grouped.isnan()).sum(dim=1, keepdim=True)
        advantages = advantages * scored / (scored - 1)  # one scored completion: 0 * inf, NaN, so 0 below
    advantages = advantages.view(-1)
    if scale_rewards == "group":
        # A single value has no spread: std 0 (not NaN), so its advantage is simply 0.
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations) if num_generations > 1 else (
            torch.zeros_like(rewards))
        advantages = advantages / (std + 1e-4)
    elif scale_rewards == "batch":
        std = nanstd(rewards) if rewards.numel() > 1 else rewards.new_zeros(())
        advantages = advantages / (std + 1e-4)
    # Unscorable completions, and groups without the two scored completions a std or baseline needs, teach nothing.
    return advantages.masked_fill(advantages.isnan(), 0.0)


def high_entropy_mask(entropies: torch.Tensor, completion_mask: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """[B, T] bool: real tokens whose entropy is in the top `top_quantile` share of this batch's.

    The threshold is the (1 - top_quantile) quantile of the real tokens' entropies, as in
    TRL's `top_entropy_quantile` ("Beyond the 80/20 rule": the policy gradient of the
    high-entropy "forking" tokens carries most of the learning). 1.0 keeps every token.
    """
    real = completion_mask.bool()
    values = entropies[real].float()
    if values.numel() == 0:
        return torch.zeros_like(real)
    threshold = torch.quantile(values, 1.0 - top_quantile)
    return (entropies >= threshold) & real


def rollout_importance_weights(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                               completion_mask: torch.Tensor, *, mode: str = "sequence_mask",
                               clip_min: float | None = None, clip_max: float | None = 3.0) -> torch.Tensor:
    """Weights that correct for a rollout engine whose log-probs differ from the trainer's (TRL's
    `vllm_importance_sampling_*`): the tokens were drawn from the engine's distribution, the loss
    is the trainer's, so each token's policy-gradient term is weighted by p_trainer / p_rollout.

    `mode` (ROLLOUT_CORRECTION_MODES): "token_*" gives one ratio per token, [B, T]:
    exp(lp_trainer - lp_rollout); "sequence_*" one per completion, [B, 1]: exp of the sum of its
    tokens' log-prob differences (the completion's probability ratio, not GSPO's mean). "*_truncate"
    clamps ratios to [clip_min, clip_max]; "*_mask" sets ratios outside it to 0 (drops the token or
    completion from the policy gradient). A None bound is no bound. Padding contributes 0 to the
    sums, and a NaN log-prob (a token the engine could not score) counts as no difference.
    """
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(f"mode={mode!r} is not one of {ROLLOUT_CORRECTION_MODES}")
    diff = torch.nan_to_num((trainer_logprobs - rollout_logprobs) * completion_mask.to(trainer_logprobs.dtype), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def rollout_correction_stats(weights: torch.Tensor, trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                             completion_mask: torch.Tensor) -> dict:
    """Sums, counts and extremes (detached) of the correction's ratios and of |lp_trainer - lp_rollout|, over
    real tokens (every completion for one-per-completion ratios), as TRL logs them under sampling/: the
    caller adds them up over micro-batches and ranks."""
    real = completion_mask.bool()
    ratios = weights.flatten() if weights.shape[1] == 1 else weights[real]
    delta = (trainer_logprobs - rollout_logprobs).abs()[real]
    delta = delta[~torch.isnan(delta)]
    ratios, delta = ratios.detach().double(), delta.detach().double()

    def extreme(x, fn, empty):
        return float(fn(x)) if x.numel() else empty

    return {"is_ratio_sum": float(ratios.sum()), "is_ratio_count": ratios.numel(),
            "is_ratio_min": extreme(ratios, torch.min, math.inf), "is_ratio_max": extreme(ratios, torch.max, -math.inf),
            "logprob_diff_sum": float(delta.sum()), "logprob_diff_count": delta.numel(),
            "logprob_diff_max": extreme(delta, torch.max, -math.inf)}


def off_policy_mask(advantages: torch.Tensor, logprobs: torch.Tensor, sampling_logprobs: torch.Tensor,
                    completion_mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """[B, 1] 1.0 to keep a completion, 0.0 to drop it: DeepSeek-V3.2's off-policy sequence mask (TRL's
    `off_policy_mask_threshold`). A completion is dropped when its advantage is negative and the mean over its
    tokens of log p_sampling - log p_current (a forward-KL estimate of how far the policy has moved since it
    was sampled) is above `threshold`: pushing down a completion the policy no longer resembles teaches noise.
    A NaN sampling log-prob (a token the engine could not score) counts as no difference, as in TRL."""
    mask = completion_mask.to(logprobs.dtype)
    kl = torch.nan_to_num(sampling_logprobs - logprobs.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    adv = advantages.reshape(-1, 1)
    return ((adv >= 0) | (mean_kl <= threshold)).to(mask.dtype)


@torch.no_grad()
def vespo_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, completion_mask: torch.Tensor,
                  rollout_weights: torch.Tensor | None = None, *, k_pos: float = 2.0, lambda_pos: float = 3.0,
                  k_neg: float = 3.0, lambda_neg: float = 2.0) -> torch.Tensor:
    """[B, 1] VESPO's gamma weight phi(w) = e^lambda w^k e^(-lambda w) (phi(1) = 1) of each completion's
    importance ratio w = exp(sum of its tokens' log-ratios) (a product, not GSPO's geometric mean), with k and
    lambda by the advantage's sign (>= 0: the _pos pair), computed in log space with TRL 1.16's clamps.
    `rollout_weights` ([B, T], token-level rollout correction): their logs join the sum, so w is p_current /
    p_rollout; VESPO takes the correction this way instead of multiplying the loss by it. Detached: phi only
    scales A x grad log p."""
    lower = math.log(1e-8)
    mask = completion_mask.to(log_ratio.dtype)
    seq = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if rollout_weights is not None:
        seq = seq + torch.clamp(torch.log(rollout_weights.to(log_ratio.dtype)), lower, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(seq, lower, 20.0)
    nonneg = advantages.reshape(-1, 1) >= 0
    k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@dataclass(frozen=True)
class LossSettings:
    """The loss's settings for a whole run, under GRPOConfig's names (`LossSettings.of(config)`), checked once.
    What each one does is in `grpo_loss`'s docstring."""
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    delta: float | None = None  # TRL's two-sided clip: the unclipped ratio term capped at delta; None: no cap
    loss_type: str = "dapo"
    max_completion_length: int | None = None  # dr_grpo's denominator
    use_bias_correction_kl: bool = False
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    entropy_coef: float = 0.0  # the coefficient this step applies (the adaptive control's, when it is on)

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not one of {LOSS_TYPES}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level={self.importance_sampling_level!r} is not one of "
                             f"{IMPORTANCE_SAMPLING_LEVELS}")
        if self.loss_type == "sapo" and not (self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0):
            raise ValueError(f"grpo_loss: sapo_temperature_pos={self.sapo_temperature_pos!r} and sapo_temperature_neg="
                             f"{self.sapo_temperature_neg!r} must both be > 0 (SAPO divides by them)")
        if self.delta is not None and not (isinstance(self.delta, (int, float)) and not isinstance(self.delta, bool)
                                           and math.isfinite(self.delta) and self.delta > 0):
            raise ValueError(f"grpo_loss: delta={self.delta!r} must be a finite number > 0 (TRL recommends more than "
                             f"1 + epsilon_high), or None for no cap")
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise ValueError("grpo_loss: loss_type='dr_grpo' needs max_completion_length")
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold >= 0:
            raise ValueError(f"grpo_loss: off_policy_mask_threshold={self.off_policy_mask_threshold!r} must be >= 0 "
                             f"(a mean KL per token), or None for no mask")

    @classmethod
    def of(cls, config) -> "LossSettings":
        """The settings of a GRPOConfig (or anything with these attributes)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    settings: LossSettings | None = None,
    *,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    entropy_mask: torch.Tensor | None = None,
    rollout_weights: torch.Tensor | None = None,
    sampling_logprobs: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    entropy_share: float = 1.0,
    **options,
) -> tuple[torch.Tensor, dict]:
    """The policy-gradient surrogate (clipped, CISPO's, SAPO's or VESPO's) with an optional k3 KL penalty and
    entropy bonus, as a loss to minimise.

    Args:
        settings: the run's `LossSettings`; keyword `options` (e.g. `loss_type="grpo", beta=0.04`) are a
            shorthand for them, on top of `settings` (default: LossSettings()).
        logprobs: [B, T] current policy log-probs of the completion tokens (with grad).
        old_logprobs: [B, T] log-probs of the policy that sampled the tokens; None means
            "the current policy" (one optimisation pass per generation batch), ratio 1.
        ref_logprobs: [B, T] reference policy log-probs; needed when beta > 0.
        advantages: [B] one advantage per completion.
        completion_mask: [B, T] 1 on real completion tokens.
        loss_type: the per-token term and how per-token losses are averaged. With ratio
            r = exp(logprobs - old_logprobs) and advantage A (TRL 1.16's definitions):
            "grpo"   -min(r A, clip(r, 1-epsilon, 1+epsilon_high) A); mean over each sequence's
                     tokens, then over sequences. With `delta` set (TRL's two-sided clip, INTELLECT-2),
                     the unclipped term is min(r, delta) A: a negative-advantage token far off-policy
                     (r > delta) no longer pushes with its whole ratio. The same for bnpo, dr_grpo,
                     dapo and luspo; cispo, sapo and vespo have no unclipped term and ignore it (as TRL);
            "bnpo"   the same term; mean over all tokens of the batch;
            "dr_grpo" the same term; sum over tokens / (sequences x max_completion_length);
            "dapo"   the same term; sum over tokens / tokens of the whole generation batch;
            "cispo"  (MiniMax-M1) -sg[min(r, epsilon_high)] A logprobs: the importance weight is
                     capped and detached instead of the update being clipped, so every token keeps
                     a gradient. epsilon_high is the cap itself here (TRL: ScaleRL recommends 5.0),
                     not 1 + epsilon_high; averaged like "dapo";
            "sapo"   (Soft Adaptive Policy Optimization) -sigmoid(tau (r - 1)) 4 / tau A, with
                     tau = sapo_temperature_pos where A > 0 else sapo_temperature_neg: a smooth
                     gate in place of the hard clip (gradient 1 at r = 1, fading off-policy);
                     averaged like "grpo";
            "luspo"  (Length-Unbiased Sequence Policy Optimization) the clipped term, each completion's
                     tokens summed (not averaged), then the mean over completions: with
                     importance_sampling_level="sequence" (as the paper; else a warning, as TRL) each
                     completion's GSPO term is scaled by its length;
            "vespo"  (Variational Sequence-Level Soft Policy Optimization) -sg[phi(w)] A logprobs with
                     `vespo_weights`' smooth gamma weight of the completion's ratio w (vespo_k_pos,
                     vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg) in place of a clip; averaged like "dapo".
        off_policy_mask_threshold: drop from the policy-gradient term the completions `off_policy_mask` drops,
            judged against `sampling_logprobs` (the log-probs the tokens were sampled with; default
            old_logprobs: then on-policy nothing is dropped).
        entropies, entropy_coef: with entropy_coef != 0, subtract entropy_coef x the mean entropy over this
            batch's real tokens (those entropy_mask keeps, when given) x `entropy_share`, as TRL's bonus: its
            mean is per micro-batch, scaled by 1 / gradient accumulation steps, so `entropy_share` is this
            micro-batch's share of the step (1 / (micro-batches x ranks)). `entropies` must carry the gradient.
        use_bias_correction_kl: multiply the KL term by the importance ratio (TRL's option of
            the same name, on by default there); it changes the gradient even at ratio 1.
        importance_sampling_level: "token" (GRPO: one ratio per token) or "sequence" (GSPO:
            one ratio per completion, the geometric mean of its tokens' ratios, clipped as a
            whole). Same name and definition as TRL's. At ratio 1 (on-policy, one iteration)
            both give the same loss and gradient; they differ once training is off-policy
            (num_iterations > 1, or old_logprobs from another engine).
        entropy_mask: [B, T] keep the policy-gradient term only where true (`high_entropy_mask`);
            the KL term and the token counts of the normalisation still cover every token.
        rollout_weights: [B, T] or [B, 1] `rollout_importance_weights`: the policy-gradient term
            is multiplied by them (the KL term is not), as TRL does with its vLLM correction; "vespo" takes
            [B, T] ones into its sequence ratio instead (as TRL, which allows only token-level ones there).
        num_sequences, num_tokens: totals of the whole batch when this call sees one
            micro-batch of it, so that summing the micro-batch losses gives exactly the
            full-batch loss. Default: this batch's own totals.

    Returns:
        (loss, metrics) where metrics holds detached tensors: kl, clip ratios, mean ratio.
    """
    settings = settings or LossSettings()
    if options:
        settings = replace(settings, **options)
    beta, epsilon, loss_type = settings.beta, settings.epsilon, settings.loss_type
    if beta > 0 and ref_logprobs is None:
        raise ValueError("grpo_loss: beta > 0 needs ref_logprobs")
    epsilon_high = epsilon if settings.epsilon_high is None else settings.epsilon_high
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"grpo_loss: advantages must be [B] = [{logprobs.shape[0]}] (one per completion), "
            f"got {tuple(advantages.shape)}"
        )
    mask = completion_mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(1)
    old = logprobs.detach() if old_logprobs is None else old_logprobs

    token_log_ratio = log_ratio = logprobs - old
    if settings.importance_sampling_level == "sequence":  # [B, 1]: the mean log-ratio over each completion's tokens
        log_ratio = ((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1.0)).unsqueeze(1)
    ratio = unclipped = torch.exp(log_ratio)  # `unclipped`: the clipped loss's other term (capped at delta below)
    if loss_type == "vespo":  # a smooth weight of the completion's whole ratio, whatever importance_sampling_level
        if rollout_weights is not None and rollout_weights.shape[1] == 1:
            raise ValueError("grpo_loss: loss_type='vespo' takes token-level rollout_weights only ([B, T]: "
                             "rollout_importance_sampling_mode 'token_truncate' or 'token_mask'), as TRL")
        phi = vespo_weights(adv, token_log_ratio, mask, rollout_weights, k_pos=settings.vespo_k_pos,
                            lambda_pos=settings.vespo_lambda_pos, k_neg=settings.vespo_k_neg,
                            lambda_neg=settings.vespo_lambda_neg)
        per_token = -phi * adv * logprobs
    elif loss_type == "cispo":  # the weight is capped and carries no gradient; the log-prob carries it
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * adv * logprobs
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg).to(logprobs.dtype)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    else:
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
        if settings.delta is not None:  # TRL caps the unclipped term after the clipped one is taken from r
            unclipped = torch.clamp(ratio, max=settings.delta)
        per_token = -torch.min(unclipped * adv, clipped * adv)
    kept = None
    if settings.off_policy_mask_threshold is not None:
        kept = off_policy_mask(adv, logprobs, old if sampling_logprobs is None else sampling_logprobs, mask,
                               settings.off_policy_mask_threshold)
        per_token = per_token * kept
    if entropy_mask is not None:
        per_token = per_token * entropy_mask.to(per_token.dtype)
    if rollout_weights is not None and loss_type != "vespo":
        per_token = per_token * rollout_weights.to(per_token.dtype)
    kl = None
    if beta > 0:
        # k3 estimator of KL(policy || ref): unbiased, always >= 0.
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1
        if settings.use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl

    b = num_sequences if num_sequences is not None else logprobs.shape[0]
    tokens = num_tokens if num_tokens is not None else mask.sum()
    tokens = torch.as_tensor(tokens, dtype=mask.dtype).clamp(min=1.0)
    masked = per_token * mask
    if loss_type in ("grpo", "sapo"):
        loss = (masked.sum(1) / mask.sum(1).clamp(min=1.0)).sum() / b
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (b * settings.max_completion_length)
    elif loss_type == "luspo":  # each completion's terms summed: its length weighs in
        loss = masked.sum() / b
    else:  # bnpo, dapo, cispo and vespo differ only in whose tokens count (one process vs all); same here
        loss = masked.sum() / tokens
    entropy = None
    if entropies is not None:
        counted = mask if entropy_mask is None else mask * entropy_mask.to(mask.dtype)
        entropy = (entropies * counted).sum() / counted.sum().clamp(min=1.0)
        if settings.entropy_coef:
            loss = loss - settings.entropy_coef * entropy * entropy_share

    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)

        def share(x):  # of tokens; of completions when there is one ratio per completion (as TRL logs it)
            return x.mean() if x.shape[1] == 1 else (x * mask).sum() / n

        # Tokens whose update the objective cuts off: for CISPO the capped weights (TRL's
        # cispo_clip_ratio, all "high"); SAPO and VESPO have no hard clip, so none. As in TRL they are read
        # from the delta-capped ratio: a delta at or below 1 + epsilon_high leaves no token "high".
        low = ((unclipped < 1 - epsilon) & (adv < 0)).to(mask.dtype)
        high = ((unclipped > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
        if loss_type == "cispo":
            low, high = torch.zeros_like(low), ((ratio > epsilon_high) & (adv > 0)).to(mask.dtype)
        elif loss_type in ("sapo", "vespo"):
            low, high = torch.zeros_like(low), torch.zeros_like(high)
        metrics = {
            "clip_ratio_low": share(low),
            "clip_ratio_high": share(high),
            "clip_ratio": share(low + high),
            "ratio_mean": share(ratio.detach()),
            "kl": (kl.detach() * mask).sum() / n if kl is not None else torch.zeros((), device=mask.device),
            "num_tokens": mask.sum(),
        }
        if kept is not None:  # completions the off-policy mask dropped, a share of this batch's
            metrics["off_policy_masked"] = 1 - kept.mean()
        if entropy is not None:  # the mean entropy over the tokens the bonus counts, and their number
            metrics["entropy"], metrics["entropy_tokens"] = entropy.detach(), counted.sum()
        if loss_type == "vespo":  # TRL's vespo/phi_seq_mean
            metrics["vespo_phi_mean"] = phi.mean()
    return loss, metrics
