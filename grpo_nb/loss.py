"""Group-relative advantages and the clipped GRPO surrogate loss.

Definitions follow TRL's GRPOTrainer so that settings and results carry over; the tests
check both against a direct computation and against TRL itself.
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


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
    gets zero advantages: it carries no learning signal (and dynamic sampling drops it)."""
    grouped = rewards.view(-1, num_generations)
    return grouped.amax(1) > grouped.amin(1)


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
    grouped = rewards.view(-1, num_generations)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if estimator == "rloo":
        advantages = advantages * (num_generations / (num_generations - 1))
    if scale_rewards == "none":
        return advantages
    # A single value has no spread: std 0 (not NaN), so its advantage is simply 0.
    if scale_rewards == "group":
        std = grouped.std(dim=1) if num_generations > 1 else torch.zeros(grouped.shape[0], device=rewards.device)
        std = std.repeat_interleave(num_generations)
    else:
        std = (rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())).expand_as(rewards)
    return advantages / (std + 1e-4)


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


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    use_bias_correction_kl: bool = False,
    importance_sampling_level: str = "token",
    entropy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate objective with an optional k3 KL penalty, as a loss to minimise.

    Args:
        logprobs: [B, T] current policy log-probs of the completion tokens (with grad).
        old_logprobs: [B, T] log-probs of the policy that sampled the tokens; None means
            "the current policy" (one optimisation pass per generation batch), ratio 1.
        ref_logprobs: [B, T] reference policy log-probs; needed when beta > 0.
        advantages: [B] one advantage per completion.
        completion_mask: [B, T] 1 on real completion tokens.
        loss_type: how per-token losses are averaged:
            "grpo"   mean over each sequence's tokens, then over sequences;
            "bnpo"   mean over all tokens of the batch;
            "dr_grpo" sum over tokens / (sequences x max_completion_length);
            "dapo"   sum over tokens / tokens of the whole generation batch.
        use_bias_correction_kl: multiply the KL term by the importance ratio (TRL's option of
            the same name, on by default there); it changes the gradient even at ratio 1.
        importance_sampling_level: "token" (GRPO: one ratio per token) or "sequence" (GSPO:
            one ratio per completion, the geometric mean of its tokens' ratios, clipped as a
            whole). Same name and definition as TRL's. At ratio 1 (on-policy, one iteration)
            both give the same loss and gradient; they differ once training is off-policy
            (num_iterations > 1, or old_logprobs from another engine).
        entropy_mask: [B, T] keep the policy-gradient term only where true (`high_entropy_mask`);
            the KL term and the token counts of the normalisation still cover every token.
        num_sequences, num_tokens: totals of the whole batch when this call sees one
            micro-batch of it, so that summing the micro-batch losses gives exactly the
            full-batch loss. Default: this batch's own totals.

    Returns:
        (loss, metrics) where metrics holds detached tensors: kl, clip ratios, mean ratio.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not one of {LOSS_TYPES}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r} is not one of "
                         f"{IMPORTANCE_SAMPLING_LEVELS}")
    if beta > 0 and ref_logprobs is None:
        raise ValueError("grpo_loss: beta > 0 needs ref_logprobs")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"grpo_loss: advantages must be [B] = [{logprobs.shape[0]}] (one per completion), "
            f"got {tuple(advantages.shape)}"
        )
    mask = completion_mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(1)
    old = logprobs.detach() if old_logprobs is None else old_logprobs

    log_ratio = logprobs - old
    if importance_sampling_level == "sequence":  # [B, 1]: the mean log-ratio over each completion's tokens
        log_ratio = ((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1.0)).unsqueeze(1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask.to(per_token.dtype)
    kl = None
    if beta > 0:
        # k3 estimator of KL(policy || ref): unbiased, always >= 0.
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1
        if use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl

    b = num_sequences if num_sequences is not None else logprobs.shape[0]
    tokens = num_tokens if num_tokens is not None else mask.sum()
    tokens = torch.as_tensor(tokens, dtype=mask.dtype).clamp(min=1.0)
    masked = per_token * mask
    if loss_type == "grpo":
        loss = (masked.sum(1) / mask.sum(1).clamp(min=1.0)).sum() / b
    elif loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("grpo_loss: loss_type='dr_grpo' needs max_completion_length")
        loss = masked.sum() / (b * max_completion_length)
    else:  # bnpo and dapo differ only in whose tokens count (one process vs all); same here
        loss = masked.sum() / tokens

    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)

        def share(x):  # of tokens; of completions when there is one ratio per completion (as TRL logs it)
            return x.mean() if x.shape[1] == 1 else (x * mask).sum() / n

        low = ((ratio < 1 - epsilon) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
        metrics = {
            "clip_ratio_low": share(low),
            "clip_ratio_high": share(high),
            "clip_ratio": share(low + high),
            "ratio_mean": share(ratio.detach()),
            "kl": (kl.detach() * mask).sum() / n if kl is not None else torch.zeros((), device=mask.device),
            "num_tokens": mask.sum(),
        }
    return loss, metrics
