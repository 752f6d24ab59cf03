"""One GRPO step's stages, over one typed batch.

    rollout + rewards   sample_batch()          prompts -> scored groups (scoring.score_groups; with tools,
                                                episodes of turns: episodes.run_episodes); dynamic
                                                sampling rolls out more until groups teach
    advantages          StepBatch.from_groups() each completion against its group
    log-probs           add_logprobs()          the sampler's / reference policy's, for the loss
    loss + backward     accumulate_gradients()  micro-batch by micro-batch
    optimizer step      apply_update()          clipped, or skipped when anything is non-finite

`train()` (trainer.py) runs them in this order; the memory simulation runs the same functions.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import torch
from transformers import TrainerState

from . import distributed, parking
from .config import GRPOConfig, correction_mode
from .attachments import rope_depends_on_length
from .distributed import World
from .logprobs import (completion_hidden_states, completion_logprobs, entropies_with_grad, output_head,
                       selective_logprobs)
from .batch import MicroBatch, StepBatch, StepMetrics, merged_metrics
from .loss import LossSettings, grpo_loss, high_entropy_mask, rollout_correction_stats, rollout_importance_weights
from .memory import gradient_bytes
from .rollout import returns_logprobs
from .scoring import score_groups


# --------------------------------------------------------------------------------------
# Rollout + rewards (+ advantages)


def sample_batch(model, tokenizer, prompts, rollout, reward_funcs, config: GRPOConfig, step: int = 0,
                 world: World = World(), agent=None) -> StepBatch:
    """Roll out and score the next `prompts_per_step` prompts (a PromptSampler): the step's batch.

    With `dynamic_sampling` (DAPO), groups whose rewards are all equal (zero advantage: no
    learning signal) are dropped and more prompts are rolled out, up to
    `dynamic_sampling_max_rounds` rollouts, to fill the batch with groups that teach something;
    if the rounds run out, zero-variance groups fill the rest.
    """
    trainer_state = reward_trainer_state(config, step, world, len(prompts.dataset))

    def one_rollout() -> StepBatch:
        groups = score_groups(model, tokenizer, next(prompts), rollout, config.num_generations, reward_funcs,
                              max_prompt_length=config.max_prompt_length, trainer_state=trainer_state,
                              timeout=config.reward_timeout, agent=agent,
                              max_completion_length=config.max_completion_length,
                              chat_template_kwargs=config.chat_template_kwargs)
        batch = StepBatch.from_groups(groups, config)
        if returns_logprobs(rollout) is None and not config.rollout_importance_sampling_correction:
            # a user's function's log-probs may be other than the sampler's (before temperature, other rows'):
            # the old policy of num_iterations > 1 is then computed, never taken from them
            batch.sampling_logprobs = None
        return batch

    parts = [one_rollout()]
    if not config.dynamic_sampling:
        return parts[0]

    def informative() -> int:  # over all ranks, so that every rank runs the same number of rounds
        found = sum(int(b.informative().sum()) for b in parts)
        return int(distributed.all_reduce(torch.tensor(found), world))

    while informative() < config.prompts_per_step * world.size and len(parts) < config.dynamic_sampling_max_rounds:
        parts.append(one_rollout())
    return keep_informative_groups(parts, config)


def reward_trainer_state(config: GRPOConfig, step: int, world: World, dataset_size: int) -> TrainerState:
    """The `trainer_state` reward functions get: transformers' TrainerState, as TRL hands them its own, with
    the fields a grpo-nb run knows. `epoch` counts passes over the dataset's prompts by the optimizer steps
    taken (a rollout serves num_iterations steps; dynamic sampling's extra rollouts are not counted), and
    `num_train_epochs` is where max_steps ends, rounded up as transformers does. `log_history` stays empty:
    the history is what train() returns and what its callbacks get."""
    prompts_per_optimizer_step = config.prompts_per_step * world.size / config.num_iterations
    return TrainerState(
        global_step=step, max_steps=config.max_steps, epoch=step * prompts_per_optimizer_step / dataset_size,
        num_train_epochs=math.ceil(config.max_steps * prompts_per_optimizer_step / dataset_size),
        logging_steps=config.logging_steps, save_steps=config.save_steps,
        train_batch_size=config.per_device_train_batch_size, is_world_process_zero=world.is_main,
        is_local_process_zero=int(os.environ.get("LOCAL_RANK", world.rank)) == 0)


def keep_informative_groups(parts: list[StepBatch], config: GRPOConfig) -> StepBatch:
    """One batch of prompts_per_step groups from several rollouts, informative groups first."""
    flags = [b.informative().tolist() for b in parts]
    order = [(p, k) for want in (True, False) for p, fl in enumerate(flags) for k, f in enumerate(fl) if f == want]
    chosen = sorted(order[: config.prompts_per_step])  # generation order: a batch that needed no refill is unchanged
    kept = [b.select_groups([k for q, k in chosen if q == p]) for p, b in enumerate(parts)]
    batch = StepBatch.cat([b for b in kept if b.size])
    # Every rollout counts, those whose groups were all dropped too.
    batch.logged_metrics = merged_metrics(parts)
    batch.generation_time = sum(b.generation_time for b in parts)
    batch.prompts_cut = sum(b.prompts_cut for b in parts)
    batch.sampling_rounds = len(parts)
    batch.rolled_out = {"rewards": torch.cat([b.rewards for b in parts]).tolist()}
    # Advantages again over the kept batch: per-group ones are unchanged, "batch" scaling needs the kept std.
    return batch.with_advantages(config)


# --------------------------------------------------------------------------------------
# Log-probs


@torch.no_grad()
def policy_logprobs(model, batch: StepBatch, config: GRPOConfig) -> torch.Tensor:
    """[N, Tc] log-probs of the sampled tokens, micro-batch by micro-batch, without grad."""
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32, device=batch.completion_ids.device)
    for micro in batch.micro_batches(config.per_device_train_batch_size):
        lp = completion_logprobs(model, micro.prompt_ids, micro.prompt_mask, micro.completion_ids,
                                 micro.completion_mask, temperature=config.temperature,
                                 chunk_size=config.logprob_chunk_size, backend=config.logprob_backend,
                                 share_prefix=config.prefix_sharing)
        out[micro.rows, : lp.shape[1]] = lp
    return out


def add_logprobs(model, batch: StepBatch, config: GRPOConfig) -> StepBatch:
    """The log-probs the loss compares the policy with: the sampling policy's (num_iterations > 1:
    later passes over this batch need them for the ratio) and the reference policy's (beta > 0:
    the model with its adapter switched off).

    With `rollout_importance_sampling_correction` (TRL's vLLM correction), the sampling policy's
    log-probs are the trainer's own, recomputed, and the engine's are kept for the correction's
    weights p_trainer / p_rollout (`accumulate_gradients`); with one iteration the trainer's are
    the loss's own forward pass, detached, so no extra pass is needed."""
    correct = config.rollout_importance_sampling_correction
    if correct and batch.sampling_logprobs is None:
        raise ValueError(NO_ROLLOUT_LOGPROBS.format(what="this step's rollout returned none"))
    if config.num_iterations > 1:
        # LongRoPE / dynamic-NTK rotary factors follow the forward pass's length: the engine's KV-cached
        # log-probs (prefill on the prompt alone) are under other factors than the loss's forward, so those
        # models get the old policy from the same forward pass the loss uses (as TRL always does)
        engine_ok = (batch.sampling_logprobs is not None and not correct
                     and not rope_depends_on_length(getattr(model, "config", None)))
        batch.old_logprobs = batch.sampling_logprobs if engine_ok else policy_logprobs(model, batch, config)
    if config.beta > 0:
        with model.disable_adapter():
            batch.ref_logprobs = policy_logprobs(model, batch, config)
    if not correct:
        batch.sampling_logprobs = None  # used up: not carried through the iterations and checkpoints
    return batch


NO_ROLLOUT_LOGPROBS = (
    "rollout_importance_sampling_correction=True weights each token by p_trainer / p_rollout, so it needs the "
    "rollout engine's per-token log-probs, and {what}. The native engine (rollout='native', the default) returns "
    "them; HF generate (rollout='hf', or 'auto' with generation_kwargs only generate() takes) does not; vLLM does "
    "when its log-probs are the plain tempered ones (logprobs_mode 'raw_logprobs': temperature 1; "
    "'processed_logprobs': no top_p/top_k/min_p/repetition_penalty filter). Use such a "
    "rollout, or set rollout_importance_sampling_correction=False.")


def check_rollout_logprobs(rollout, config: GRPOConfig) -> None:
    """Refuse before the first rollout an engine known to return no log-probs when the correction needs them."""
    if not config.rollout_importance_sampling_correction:
        return
    if returns_logprobs(rollout) is False:  # HF generate never; vLLM only for some sampling settings
        raise ValueError(NO_ROLLOUT_LOGPROBS.format(what=f"the {type(rollout).__name__} rollout returns none with "
                                                         f"these settings"))


# --------------------------------------------------------------------------------------
# Loss + backward, optimizer step


def accumulate_gradients(model, params, batch: StepBatch, config: GRPOConfig, scaler=None,
                         world: World = World(), history=()) -> StepMetrics:
    """The loss's gradients over the whole generation batch, in micro-batches with accumulation.

    Each micro-batch's loss is normalised by the whole batch's sequence/token counts, so the
    accumulated gradient equals that of one big batch; with several ranks the totals are the
    global batch's and the gradients are summed over ranks at the end, so every rank holds the
    whole batch's gradient. A non-finite loss stops early and marks the step to be skipped.
    With fp16 weights, `scaler` scales the loss so small gradients survive the half-precision backward.
    `history`: the run's records so far, where use_adaptive_entropy's coefficient is kept (`entropy_control`).
    """
    n = batch.size
    local_tokens = batch.loss_mask.sum()
    num_tokens = distributed.all_reduce(local_tokens, world)  # dapo: the tokens of the whole global batch
    # bnpo averages over each process's own tokens (as TRL's does), then over processes.
    loss_tokens = local_tokens * world.size if config.loss_type == "bnpo" else num_tokens
    totals = {"loss": 0.0, "kl": 0.0, "clip_ratio": 0.0, "clip_ratio_low": 0.0, "clip_ratio_high": 0.0}
    coef, applied = entropy_control(config, history)
    settings = replace(LossSettings.of(config), entropy_coef=applied)
    # TRL's bonus is each micro-batch's mean entropy / its accumulation steps, the gradients averaged over ranks
    entropy_share = 1.0 / (math.ceil(n / config.per_device_train_batch_size) * world.size)
    bonus = config.entropy_coef != 0 or config.use_adaptive_entropy
    want_entropy = config.top_entropy_quantile < 1.0 or bonus
    entropy_sums = [0.0, 0.0, 0.0, 0.0]  # over all real tokens (the record's entropy); over those the bonus counts
    masked_rows = 0.0
    correction = RolloutCorrection(config, world) if config.rollout_importance_sampling_correction else None
    finite = True
    # Sharded layers reduce their gradients in every backward, a collective: all ranks must run
    # every micro-batch's backward, even after a non-finite loss (the step is skipped anyway).
    lockstep = world.distributed and distributed.is_sharded(model)
    for micro in batch.micro_batches(config.per_device_train_batch_size):
        mask = micro.per_token(batch.loss_mask)
        if bonus:  # the entropy bonus needs the entropies' gradient
            logprobs = logprobs_and_entropies(model, micro, config)
        else:
            logprobs = completion_logprobs(model, micro.prompt_ids, micro.prompt_mask, micro.completion_ids,
                                           micro.completion_mask, temperature=config.temperature,
                                           chunk_size=config.logprob_chunk_size, backend=config.logprob_backend,
                                           return_entropy=want_entropy, share_prefix=config.prefix_sharing)
        entropy_mask = entropies = None
        if want_entropy:
            logprobs, entropies = logprobs
            if config.top_entropy_quantile < 1.0:
                entropy_mask = high_entropy_mask(entropies.detach(), mask, config.top_entropy_quantile)
            real = mask.to(entropies.dtype)
            entropy_sums[0] += float((entropies.detach() * real).sum())
            entropy_sums[1] += float(real.sum())
        weights = None if correction is None else correction.weights(micro, batch, logprobs, mask)
        loss, m = grpo_loss(logprobs, micro.per_token(batch.old_logprobs), micro.per_token(batch.ref_logprobs),
                            batch.advantages[micro.rows], mask, settings, num_sequences=n * world.size,
                            num_tokens=loss_tokens, entropy_mask=entropy_mask, rollout_weights=weights,
                            sampling_logprobs=micro.per_token(batch.sampling_logprobs),
                            entropies=entropies if bonus else None,
                            entropy_share=entropy_share)
        if "entropy" in m:
            entropy_sums[2] += float(m["entropy"]) * float(m["entropy_tokens"])
            entropy_sums[3] += float(m["entropy_tokens"])
        if "off_policy_masked" in m:
            masked_rows += float(m["off_policy_masked"]) * micro.completion_ids.shape[0]
        if not torch.isfinite(loss):
            finite = False
            if not lockstep:
                break
        (scaler.scale(loss) if scaler is not None else loss).backward()
        weight = float(m["num_tokens"]) / max(float(num_tokens), 1.0)
        # Clip shares are over completions when GSPO gives each completion one ratio.
        rows = micro.completion_ids.shape[0]
        clip_weight = rows / (n * world.size) if config.importance_sampling_level == "sequence" else weight
        totals["loss"] += float(loss.detach())
        totals["kl"] += float(m["kl"]) * weight
        for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            totals[k] += float(m[k]) * clip_weight
    if world.distributed:
        # One rank's non-finite loss skips the step on every rank; the metrics become global sums.
        finite = bool(distributed.all_reduce(torch.tensor(int(finite)), world, torch.distributed.ReduceOp.MIN))
        summed = distributed.all_reduce(torch.tensor(list(totals.values()), dtype=torch.float64), world)
        totals = dict(zip(totals, summed.tolist()))
        if finite:
            distributed.all_reduce_gradients(params, world)
    extras = {}
    if want_entropy or config.off_policy_mask_threshold is not None:
        if world.distributed:
            summed = distributed.all_reduce(torch.tensor([*entropy_sums, masked_rows], dtype=torch.float64), world)
            *entropy_sums, masked_rows = summed.tolist()
        if want_entropy:  # TRL's logged entropy: the mean over every real token
            extras["entropy"] = entropy_sums[0] / entropy_sums[1] if entropy_sums[1] else math.nan
        if bonus:
            extras.update(entropy_control_step(config, coef, entropy_sums[2], entropy_sums[3]))
        if config.off_policy_mask_threshold is not None:  # the share of the batch's completions it dropped
            extras["off_policy_masked"] = masked_rows / (n * world.size)
    return StepMetrics(**totals, finite=finite, gradient_bytes=gradient_bytes(params),
                       rollout_correction=correction.metrics() if correction is not None else {}, loss_extras=extras)


def logprobs_and_entropies(model, micro: MicroBatch, config: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """`completion_logprobs(..., return_entropy=True)` whose entropies carry their gradient, for the entropy bonus
    (logprobs.token_entropies is gradient-free). Chunk by chunk under activation checkpointing: a chunk's logits
    are recomputed in the backward, so the full logits never exist, as for the log-probs."""
    hidden = completion_hidden_states(model, micro.prompt_ids, micro.prompt_mask, micro.completion_ids,
                                      micro.completion_mask, share_prefix=config.prefix_sharing)
    head = output_head(model)
    logprobs = selective_logprobs(hidden, token_ids=micro.completion_ids, temperature=config.temperature,
                                  chunk_size=config.logprob_chunk_size, backend=config.logprob_backend, **head)
    return logprobs, entropies_with_grad(hidden, temperature=config.temperature, chunk_size=config.logprob_chunk_size,
                                         **head)


def entropy_control(config: GRPOConfig, history) -> tuple[float, float]:
    """(entropy_coef now, the coefficient this step applies). Constant without use_adaptive_entropy. With it (TRL's
    Skywork-OR1 control) the coefficient is the one the last step's record left, and it applies only while that
    step's entropy (`entropy_window`) was at or below entropy_target: none before a first measurement. The state
    lives in the records, so a resumed run (whose history is its checkpoint's) picks it up where it was."""
    if not config.use_adaptive_entropy:
        return config.entropy_coef, config.entropy_coef
    last = next((r for r in reversed(history) if "entropy_window" in r), None)
    if last is None:
        return config.entropy_coef, 0.0
    # within this run's bounds (a resume may narrow them); checkpoint_schema.check_history checked the values
    coef = min(max(float(last["entropy_coef"]), config.entropy_coef_min), config.entropy_coef_max)
    measured = last["entropy_window"]
    return coef, coef if measured <= config.entropy_target else 0.0


def entropy_control_step(config: GRPOConfig, coef: float, entropy_sum: float, tokens: float) -> dict:
    """The record's entropy_coef after this step (TRL logs it so) and, when adaptive, the step's entropy over the
    tokens the bonus counts (`entropy_window`, the whole batch's token-weighted mean, as TRL's window) and the
    coefficient moved by entropy_coef_delta towards keeping the entropy above entropy_target."""
    if not config.use_adaptive_entropy:
        return {"entropy_coef": coef}
    measured = entropy_sum / max(tokens, 1.0)
    if not math.isfinite(measured):  # a step whose entropies were not finite (it is skipped): the coefficient stays
        return {"entropy_coef": coef, "entropy_window": math.nan}
    if measured <= config.entropy_target:
        coef = min(coef + config.entropy_coef_delta, config.entropy_coef_max)
    else:
        coef = max(coef - config.entropy_coef_delta, config.entropy_coef_min)
    return {"entropy_coef": coef, "entropy_window": measured}


# The step record's keys from the loss's options: TRL's entropy (the mean over real tokens, when entropies are
# computed) and entropy_coef (entropy_coef / use_adaptive_entropy), the adaptive control's measured entropy, and the
# share of completions off_policy_mask_threshold dropped.
LOSS_EXTRA_METRICS = ("entropy", "entropy_coef", "entropy_window", "off_policy_masked")
# The step record's keys for the rollout correction, TRL's sampling/importance_sampling_ratio/{min,mean,max}
# and sampling/sampling_logp_difference/{mean,max}.
ROLLOUT_CORRECTION_METRICS = ("rollout_is_ratio_mean", "rollout_is_ratio_min", "rollout_is_ratio_max",
                              "rollout_logprob_diff_mean", "rollout_logprob_diff_max")


class RolloutCorrection:
    """rollout_importance_sampling_correction over one step's micro-batches: each one's weights, and the
    ratios' and log-prob differences' statistics over the whole (global) batch."""

    def __init__(self, config: GRPOConfig, world: World):
        self.config, self.world = config, world
        self.sums = {"is_ratio_sum": 0.0, "is_ratio_count": 0.0, "logprob_diff_sum": 0.0, "logprob_diff_count": 0.0}
        self.low, self.highs = math.inf, [-math.inf, -math.inf]  # is_ratio min; is_ratio max, logprob_diff max

    def weights(self, micro: MicroBatch, batch: StepBatch, logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # The trainer's log-probs at sampling time: recomputed for several iterations, else this very pass's.
        trainer = micro.per_token(batch.old_logprobs)
        trainer = logprobs.detach() if trainer is None else trainer
        rollout = micro.per_token(batch.sampling_logprobs)
        if rollout is None:  # add_logprobs refuses this first; a batch built by hand may still lack them
            raise ValueError(NO_ROLLOUT_LOGPROBS.format(what="the batch has no sampling_logprobs"))
        c = self.config
        w = rollout_importance_weights(trainer, rollout, mask, mode=correction_mode(c),
                                       clip_min=c.rollout_importance_sampling_clip_min,
                                       clip_max=c.rollout_importance_sampling_clip_max)
        stats = rollout_correction_stats(w, trainer, rollout, mask)
        for key in self.sums:
            self.sums[key] += stats[key]
        self.low = min(self.low, stats["is_ratio_min"])
        self.highs = [max(self.highs[0], stats["is_ratio_max"]), max(self.highs[1], stats["logprob_diff_max"])]
        return w

    def metrics(self) -> dict:
        sums, low, highs = self.sums, self.low, self.highs
        if self.world.distributed:
            summed = distributed.all_reduce(torch.tensor(list(sums.values()), dtype=torch.float64), self.world)
            sums = dict(zip(sums, summed.tolist()))
            lows = distributed.all_reduce(torch.tensor([low, -highs[0], -highs[1]], dtype=torch.float64), self.world,
                                          torch.distributed.ReduceOp.MIN).tolist()
            low, highs = lows[0], [-lows[1], -lows[2]]

        def finite(x):  # nothing counted (no real tokens): NaN, as a mean of nothing
            return x if math.isfinite(x) else math.nan

        return dict(zip(ROLLOUT_CORRECTION_METRICS, (
            sums["is_ratio_sum"] / sums["is_ratio_count"] if sums["is_ratio_count"] else math.nan, finite(low),
            finite(highs[0]),
            sums["logprob_diff_sum"] / sums["logprob_diff_count"] if sums["logprob_diff_count"] else math.nan,
            finite(highs[1]))))


def apply_update(optimizer, params, metrics: StepMetrics, config: GRPOConfig, scaler=None) -> StepMetrics:
    """Clip and apply the accumulated gradients, or skip the step if anything is non-finite.

    Returns `metrics` with the gradient norm and whether the step was skipped (its loss then NaN); the weights
    are untouched when skipped.
    """
    finite = metrics.finite
    if finite and scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = float(distributed.clip_grad_norm_(params, config.max_grad_norm)) if finite else math.nan
    skipped = not (finite and math.isfinite(grad_norm))
    if not skipped:
        # a parked state (grpo_nb.parking) comes back now that the backward has freed its activations
        parking.restore(optimizer)
        optimizer.step()
    if finite and scaler is not None:
        scaler.update()  # overflowing gradients (skipped above) halve the scale, as in torch.amp
    optimizer.zero_grad(set_to_none=True)
    parking.park(optimizer)  # in host memory until the next optimizer step: the rollout and update run without it
    return replace(metrics, grad_norm=grad_norm, skipped=skipped, loss=math.nan if skipped else metrics.loss)
