"""grpo_loss and group_advantages against direct computations of TRL's definitions."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_nb.loss import LOSS_TYPES, group_advantages, grpo_loss, high_entropy_mask

ATOL = 1e-6
RTOL = 1e-5


def close(actual, expected, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------
# Reference: TRL GRPOTrainer._compute_loss, token-level importance sampling, one process.


def reference_loss(lp, old, ref, adv, mask, *, beta, eps, eps_high, loss_type, max_len, token_weight=None,
                   tau_pos=1.0, tau_neg=1.05):
    mask = mask.to(lp.dtype)
    old = lp.detach() if old is None else old
    ratio = torch.exp(lp - old)
    a = adv.unsqueeze(1)
    if loss_type == "cispo":  # TRL: -clamp(coef_1, max=epsilon_high).detach() * advantages * per_token_logps
        per_token = -torch.clamp(ratio, max=eps_high).detach() * a * lp
    elif loss_type == "sapo":  # TRL: -sigmoid(t * (coef_1 - 1)) * 4 / t * advantages, t by the advantage's sign
        t = torch.where(a > 0, tau_pos, tau_neg)
        per_token = -torch.sigmoid(t * (ratio - 1)) * 4 / t * a
    elif loss_type == "vespo":  # phi(w) = e^l w^k e^(-l w) of w = the completion's ratio, detached; k, l by sign
        w = torch.exp(((lp - old).detach() * mask).sum(-1, keepdim=True))
        k, lam = torch.where(a >= 0, 2.0, 3.0), torch.where(a >= 0, 3.0, 2.0)
        per_token = -(math.e ** lam * w ** k * torch.exp(-lam * w)) * a * lp
    else:
        clipped = torch.clamp(ratio, 1 - eps, 1 + eps_high)
        per_token = -torch.min(ratio * a, clipped * a)
    if token_weight is not None:
        per_token = per_token * token_weight.to(lp.dtype)
    if beta != 0.0:
        per_token = per_token + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
    masked = per_token * mask
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo", "cispo", "vespo"):
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "luspo":  # each completion's terms summed, then the mean over completions
        return masked.sum(-1).mean()
    if loss_type == "dr_grpo":
        return masked.sum() / (lp.shape[0] * max_len)
    raise AssertionError(loss_type)


def make_batch(b=6, t=9, seed=0, with_empty_row=True):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 3 - 0.05
    old = lp + 0.4 * torch.randn(b, t, generator=g)  # ratios well outside [0.8, 1.3] for some tokens
    ref = lp + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    if with_empty_row:
        lengths[2] = 0  # a completion with no scored tokens
    lengths[0] = t
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    return lp, old, ref, adv, mask


BETAS = [0.0, 0.04]
EPSILONS = [(0.2, None), (0.2, 0.28)]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("eps,eps_high", EPSILONS, ids=["sym", "asym"])
@pytest.mark.parametrize("with_old", [True, False], ids=["old", "no-old"])
def test_matches_reference(loss_type, beta, eps, eps_high, with_old):
    lp, old, ref, adv, mask = make_batch()
    max_len = 12  # > T: Dr. GRPO divides by the configured length, not the padded one
    old = old if with_old else None
    lp1, lp2 = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    ours, metrics = grpo_loss(lp1, old, ref, adv, mask, beta=beta, epsilon=eps, epsilon_high=eps_high,
                              loss_type=loss_type, max_completion_length=max_len)
    expected = reference_loss(lp2, old, ref, adv, mask, beta=beta, eps=eps,
                              eps_high=eps if eps_high is None else eps_high, loss_type=loss_type, max_len=max_len)
    assert ours.dim() == 0
    close(ours, expected)
    ours.backward()
    expected.backward()
    close(lp1.grad, lp2.grad)
    assert (lp1.grad[mask == 0] == 0).all(), "padding tokens must get no gradient"
    assert all(not v.requires_grad for v in metrics.values())


def test_old_none_means_ratio_one():
    lp, _, _, adv, mask = make_batch()
    a = grpo_loss(lp, None, None, adv, mask, loss_type="bnpo")[0]
    b = grpo_loss(lp, lp.clone(), None, adv, mask, loss_type="bnpo")[0]
    close(a, b)
    m = mask.float()
    close(a, -(adv[:, None] * m).sum() / m.sum())
    # The gradient is the plain policy gradient: d ratio / d lp = 1 at ratio = 1.
    lp = lp.clone().requires_grad_()
    grpo_loss(lp, None, None, adv, mask, loss_type="dapo")[0].backward()
    close(lp.grad, -adv[:, None] * m / m.sum())


def test_float_mask_and_bool_mask_agree():
    lp, old, ref, adv, mask = make_batch()
    for loss_type in LOSS_TYPES:
        kw = dict(beta=0.04, loss_type=loss_type, max_completion_length=9)
        a = grpo_loss(lp, old, ref, adv, mask, **kw)[0]
        b = grpo_loss(lp, old, ref, adv, mask.bool(), **kw)[0]
        c = grpo_loss(lp, old, ref, adv, mask.float(), **kw)[0]
        close(a, b)
        close(a, c)


# --------------------------------------------------------------------------------------
# Micro-batches with the full batch's totals sum to the full-batch loss.


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("splits", [(2, 2, 2), (1, 5), (3, 3), (4, 1, 1)])
def test_micro_batches_sum_to_full_batch(loss_type, beta, splits):
    lp, old, ref, adv, mask = make_batch(b=6)
    kw = dict(beta=beta, epsilon=0.2, epsilon_high=0.28, loss_type=loss_type, max_completion_length=10)

    lp_full = lp.clone().requires_grad_()
    full, _ = grpo_loss(lp_full, old, ref, adv, mask, **kw)
    full.backward()

    lp_micro = lp.clone().requires_grad_()
    total = torch.zeros(())
    n_seq, n_tok = mask.shape[0], mask.sum()
    start = 0
    for size in splits:
        sl = slice(start, start + size)
        start += size
        part, _ = grpo_loss(lp_micro[sl], old[sl], ref[sl], adv[sl], mask[sl],
                            num_sequences=n_seq, num_tokens=n_tok, **kw)
        part.backward()
        total = total + part.detach()
    assert start == mask.shape[0]
    close(total, full.detach())
    close(lp_micro.grad, lp_full.grad)


@pytest.mark.parametrize("num_tokens", [37, 37.0, torch.tensor(37), torch.tensor(37.0)])
def test_num_tokens_accepts_int_float_tensor(num_tokens):
    lp, old, ref, adv, mask = make_batch()
    loss, _ = grpo_loss(lp, old, None, adv, mask, loss_type="dapo", num_tokens=num_tokens)
    expected = reference_loss(lp, old, None, adv, mask, beta=0.0, eps=0.2, eps_high=0.2,
                              loss_type="bnpo", max_len=None) * mask.sum() / 37
    close(loss, expected)


# --------------------------------------------------------------------------------------
# Metrics on a hand-built case


def test_clip_metrics_hand_built():
    # ratio = exp(lp - old) with old = 0.
    ratios = torch.tensor([[0.5, 1.0, 1.5, 1.3],
                           [0.5, 0.7, 1.5, 0.79]])
    mask = torch.tensor([[1, 1, 1, 1],
                         [1, 1, 1, 0]])
    adv = torch.tensor([1.0, -1.0])
    lp = ratios.log().requires_grad_()
    old = torch.zeros(2, 4)
    ref = torch.full((2, 4), -0.1)
    loss, m = grpo_loss(lp, old, ref, adv, mask, beta=0.1, epsilon=0.2, epsilon_high=0.28, loss_type="bnpo")

    # Row 0 (A > 0): ratios 1.5 and 1.3 exceed 1.28 -> high-clipped. Row 1 (A < 0): 0.5 and 0.7 are
    # below 0.8 -> low-clipped; 0.79 is below too but padded; 1.5 is not clipped for A < 0.
    close(m["clip_ratio_high"], torch.tensor(2 / 7))
    close(m["clip_ratio_low"], torch.tensor(2 / 7))
    close(m["clip_ratio"], torch.tensor(4 / 7))
    close(m["ratio_mean"], torch.tensor(7.0 / 7))
    assert m["num_tokens"].item() == 7
    delta = ref - lp.detach()
    kl = torch.exp(delta) - delta - 1
    close(m["kl"], (kl * mask).sum() / 7)
    assert (kl >= 0).all()

    loss.backward()
    # Clipped tokens carry only the KL gradient; unclipped ones carry the policy gradient too.
    kl_grad = 0.1 * (1 - torch.exp(delta)) / 7
    clipped = torch.tensor([[0, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    close(lp.grad[clipped], kl_grad[clipped])
    pg_grad = -adv[:, None] * ratios / 7 + kl_grad
    unclipped = ~clipped & mask.bool()
    close(lp.grad[unclipped], pg_grad[unclipped])
    assert (lp.grad[mask == 0] == 0).all()


def test_metrics_without_beta():
    lp, old, ref, adv, mask = make_batch()
    _, m = grpo_loss(lp, old, None, adv, mask, loss_type="grpo")
    assert m["kl"].item() == 0.0
    for key in ("clip_ratio_low", "clip_ratio_high", "clip_ratio"):
        assert 0.0 <= m[key].item() <= 1.0
    close(m["clip_ratio"], m["clip_ratio_low"] + m["clip_ratio_high"])
    close(m["ratio_mean"], (torch.exp(lp - old) * mask).sum() / mask.sum())


def test_bad_arguments_raise():
    lp, old, ref, adv, mask = make_batch()
    with pytest.raises(ValueError):
        grpo_loss(lp, old, ref, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError):
        grpo_loss(lp, old, ref, adv, mask, loss_type="GRPO")
    with pytest.raises(ValueError):
        grpo_loss(lp, old, None, adv, mask, beta=0.04)  # beta > 0 without ref log-probs
    with pytest.raises(ValueError):
        grpo_loss(lp, old, ref, adv, mask, loss_type="dr_grpo")  # no max_completion_length


# --------------------------------------------------------------------------------------
# group_advantages


def reference_advantages(rewards, g, scale):
    out = torch.empty_like(rewards)
    batch_std = rewards.std()  # unbiased
    for start in range(0, len(rewards), g):
        grp = rewards[start : start + g]
        diff = grp - grp.mean()
        if scale == "group":
            diff = diff / (grp.std() + 1e-4)
        elif scale == "batch":
            diff = diff / (batch_std + 1e-4)
        out[start : start + g] = diff
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("g", [2, 4, 8])
def test_group_advantages_reference(scale, g):
    rewards = torch.randn(3 * g, generator=torch.Generator().manual_seed(g)) * 2 + 0.5
    close(group_advantages(rewards, g, scale_rewards=scale), reference_advantages(rewards, g, scale))


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # mean 0.5, unbiased std sqrt(1/3)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (math.sqrt(1 / 3) + 1e-4)
    close(group_advantages(rewards, 4), expected)
    close(group_advantages(rewards, 4, scale_rewards="none"), torch.tensor([0.5, -0.5, -0.5, 0.5]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_group_gives_zeros(scale):
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.0])
    adv = group_advantages(rewards, 4, scale_rewards=scale)
    assert torch.isfinite(adv).all()
    assert (adv[:4] == 0).all()
    assert (adv[4:] != 0).any()
    # A batch where every reward is equal: all zeros, no NaN, even with batch scaling.
    assert (group_advantages(torch.full((8,), 0.3), 4, scale_rewards=scale) == 0).all()


def test_advantages_sum_to_zero_per_group():
    rewards = torch.rand(12, generator=torch.Generator().manual_seed(7))
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, 3, scale_rewards=scale).view(4, 3)
        close(adv.sum(1), torch.zeros(4), atol=1e-5, rtol=0)


def test_group_advantages_bad_inputs():
    with pytest.raises(ValueError):
        group_advantages(torch.randn(10), 4)  # not divisible
    with pytest.raises(ValueError):
        group_advantages(torch.randn(2, 4), 4)  # not 1-D
    with pytest.raises(ValueError):
        group_advantages(torch.randn(8), 4, scale_rewards="std")
    with pytest.raises(ValueError):
        group_advantages(torch.randn(8), 4, scale_rewards=True)


def test_degenerate_groups_and_bad_shapes_are_clear():
    from grpo_nb import group_advantages, grpo_loss

    # One completion per group, or a one-element batch: no spread, zero advantage (never NaN).
    assert torch.equal(group_advantages(torch.tensor([1.0, 3.0]), 1), torch.zeros(2))
    assert torch.equal(group_advantages(torch.tensor([2.0]), 1, scale_rewards="batch"), torch.zeros(1))
    for bad in (0, -2, 2.0):
        with pytest.raises(ValueError, match="num_generations"):
            group_advantages(torch.ones(4), bad)
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages must be \[B\]"):
        grpo_loss(lp, None, None, torch.zeros(2, 3), torch.ones(2, 3))


# --------------------------------------------------------------------------------------
# RLOO advantages and GSPO's sequence-level ratio, against direct computations


def reference_rloo(rewards, g, scale):
    """r_i minus the mean of the other rewards of its group, one completion at a time."""
    out = torch.empty_like(rewards)
    batch_std = rewards.std()
    for start in range(0, len(rewards), g):
        grp = rewards[start : start + g]
        for i in range(g):
            others = torch.cat([grp[:i], grp[i + 1 :]])
            diff = grp[i] - others.mean()
            if scale == "group":
                diff = diff / (grp.std() + 1e-4)
            elif scale == "batch":
                diff = diff / (batch_std + 1e-4)
            out[start + i] = diff
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("g", [2, 3, 8])
def test_rloo_advantages_reference(scale, g):
    rewards = torch.randn(4 * g, generator=torch.Generator().manual_seed(g)) + 0.3
    close(group_advantages(rewards, g, scale_rewards=scale, estimator="rloo"), reference_rloo(rewards, g, scale))


def test_rloo_hand_computed_and_bad_inputs():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])  # the first: 1 - mean(0, 0, 1) = 2/3
    close(group_advantages(rewards, 4, scale_rewards="none", estimator="rloo"),
          torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    with pytest.raises(ValueError, match="estimator='ppo'"):
        group_advantages(rewards, 4, estimator="ppo")
    with pytest.raises(ValueError, match="num_generations >= 2"):
        group_advantages(rewards, 1, estimator="rloo")


def reference_gspo_loss(lp, old, ref, adv, mask, *, beta, eps, eps_high, loss_type, max_len):
    """GSPO written out row by row: one ratio per completion, exp(mean token log-ratio)."""
    b, t = lp.shape
    m = mask.to(lp.dtype)
    rows, tokens = [], m.sum().clamp(min=1.0)
    for i in range(b):
        length = m[i].sum()
        s = torch.exp(((lp[i] - old[i]) * m[i]).sum() / length.clamp(min=1.0))
        if loss_type == "cispo":  # the sequence's capped weight on each token's log-prob
            per_token = -torch.clamp(s, max=eps_high).detach() * adv[i] * lp[i]
        elif loss_type == "sapo":
            tau = 1.0 if adv[i] > 0 else 1.05
            per_token = (-torch.sigmoid(tau * (s - 1)) * 4 / tau * adv[i]).expand(t)
        else:
            per_token = (-torch.min(s * adv[i], torch.clamp(s, 1 - eps, 1 + eps_high) * adv[i])).expand(t)
        if beta:
            per_token = per_token + beta * (torch.exp(ref[i] - lp[i]) - (ref[i] - lp[i]) - 1)
        rows.append((per_token * m[i]).sum() / (length.clamp(min=1.0) if loss_type in ("grpo", "sapo") else 1.0))
    total = torch.stack(rows).sum()
    return {"grpo": total / b, "sapo": total / b, "dapo": total / tokens, "bnpo": total / tokens,
            "cispo": total / tokens, "dr_grpo": total / (b * max_len), "luspo": total / b}[loss_type]


# VESPO weighs each completion by its whole ratio at either level (the level only changes its KL's bias correction)
@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "vespo"])
@pytest.mark.parametrize("beta", BETAS)
def test_gspo_sequence_ratio_matches_reference(loss_type, beta):
    lp, old, ref, adv, mask = make_batch(seed=5)
    lp = lp.clone().requires_grad_(True)
    kwargs = dict(beta=beta, loss_type=loss_type, max_completion_length=lp.shape[1])
    eps_high = 1.2 if loss_type == "cispo" else 0.28  # CISPO's cap is the bound itself: some ratios exceed 1.2
    ours, metrics = grpo_loss(lp, old, ref, adv, mask, epsilon=0.2, epsilon_high=eps_high,
                              importance_sampling_level="sequence", **kwargs)
    expected = reference_gspo_loss(lp, old, ref, adv, mask, eps=0.2, eps_high=eps_high, max_len=lp.shape[1],
                                   beta=beta, loss_type=loss_type)
    close(ours, expected)
    close(torch.autograd.grad(ours, lp)[0], torch.autograd.grad(expected, lp)[0])
    # Clip shares count completions: each completion is clipped whole or not at all.
    assert float(metrics["clip_ratio"]) * lp.shape[0] == pytest.approx(round(float(metrics["clip_ratio"]) * lp.shape[0]))
    token_level, _ = grpo_loss(lp, old, ref, adv, mask, epsilon=0.2, epsilon_high=eps_high, **kwargs)
    assert not torch.allclose(ours, token_level), "off-policy, the two levels must differ"


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gspo_equals_grpo_on_policy(loss_type):
    lp, _, ref, adv, mask = make_batch(seed=6)
    lp = lp.clone().requires_grad_(True)
    kwargs = dict(beta=0.04, loss_type=loss_type, max_completion_length=lp.shape[1])
    seq, _ = grpo_loss(lp, None, ref, adv, mask, importance_sampling_level="sequence", **kwargs)
    tok, _ = grpo_loss(lp, None, ref, adv, mask, **kwargs)
    close(seq, tok)
    close(torch.autograd.grad(seq, lp)[0], torch.autograd.grad(tok, lp)[0])


# --------------------------------------------------------------------------------------
# top_entropy_quantile


def test_high_entropy_mask_hand_computed():
    entropies = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # the 7.0 is padding: it must not count
    # Real entropies sorted: 0.0 0.1 0.2 0.3 0.5 0.7 0.9; the top half's threshold is the median, 0.3.
    keep = high_entropy_mask(entropies, mask, 0.5)
    assert keep.tolist() == [[False, True, True, False], [True, True, False, False]]
    assert high_entropy_mask(entropies, mask, 1.0).tolist() == mask.bool().tolist()
    assert not high_entropy_mask(entropies, torch.zeros_like(mask), 0.5).any()
    # 0.0, TRL's lower end (probe P29-8, refused before): only the highest-entropy real token, 0.9
    assert high_entropy_mask(entropies, mask, 0.0).tolist() == [[False, True, False, False], [False] * 4]
    from grpo_nb import GRPOConfig

    assert GRPOConfig(top_entropy_quantile=0.0).top_entropy_quantile == 0.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_entropy_mask_drops_only_the_policy_term(loss_type):
    lp, old, ref, adv, mask = make_batch(seed=8)
    keep = (torch.rand(lp.shape, generator=torch.Generator().manual_seed(9)) > 0.5) & mask.bool()
    kwargs = dict(beta=0.04, eps=0.2, eps_high=0.28, loss_type=loss_type, max_len=lp.shape[1])
    ours, _ = grpo_loss(lp, old, ref, adv, mask, beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_type=loss_type,
                        max_completion_length=lp.shape[1], entropy_mask=keep)
    # Reference: the policy part with the entropy mask on top of the completion mask, the KL part
    # over every real token, both normalised as for the full mask.
    policy = reference_loss(lp, old, ref, adv, mask, **{**kwargs, "beta": 0.0}, token_weight=keep)
    kl_only = reference_loss(lp, old, ref, adv, mask, **kwargs) - reference_loss(lp, old, ref, adv, mask,
                                                                               **{**kwargs, "beta": 0.0})
    close(ours, policy + kl_only)


# --------------------------------------------------------------------------------------
# Unscorable completions (NaN: no reward function scored them), as TRL's GRPOTrainer and RLOOTrainer
# treat them (tests/test_trl_parity.py compares with both)


def reference_scored_only(rewards, g, scale, estimator):
    """Each group's advantages over its scored completions alone (the batch std over all scored ones); 0 for
    the unscored, and where a std or a leave-one-out baseline would need two scored completions."""
    out = torch.zeros_like(rewards)
    scored = rewards[~rewards.isnan()]
    batch_std = scored.std() if len(scored) > 1 else math.nan
    for start in range(0, len(rewards), g):
        keep = ~rewards[start : start + g].isnan()
        values = rewards[start : start + g][keep]
        k = len(values)
        if k < 2:
            continue  # none scored, or one: compared with itself it gets 0 in every mode
        diff = values - values.mean()
        if estimator == "rloo":
            diff = diff * k / (k - 1)
        if scale == "group":
            diff = diff / (values.std() + 1e-4)
        elif scale == "batch":
            diff = diff / (batch_std + 1e-4)
        out[start : start + g][keep] = diff
    return out


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_unscorable_completions_are_left_out_of_their_group(scale, estimator):
    from grpo_nb.loss import informative_groups

    rewards = torch.randn(20, generator=torch.Generator().manual_seed(3))
    # groups of 4 with 4, 3, 2, 1 and 0 scored completions
    rewards[[7, 10, 11, 13, 14, 15, 16, 17, 18, 19]] = math.nan
    adv = group_advantages(rewards, 4, scale_rewards=scale, estimator=estimator)
    close(adv, reference_scored_only(rewards, 4, scale, estimator))
    assert (adv[[7, 10, 11]] == 0).all() and (adv[12:] == 0).all() and (adv[4:7] != 0).all()
    assert informative_groups(rewards, 4).tolist() == [True, True, True, False, False]
    # Equal scored rewards teach nothing however many are unscored.
    flat = torch.tensor([1.0, math.nan, 1.0, 1.0])
    assert (group_advantages(flat, 4, scale_rewards=scale, estimator=estimator) == 0).all()
    assert informative_groups(flat, 4).tolist() == [False]
    # Fewer than two scored completions in the whole batch: no std to scale by, zero everywhere.
    single = torch.tensor([2.0, math.nan, math.nan, math.nan])
    assert (group_advantages(single, 4, scale_rewards=scale, estimator=estimator) == 0).all()
