"""One GRPO step's stages, over one typed batch.

    rollout + rewards   sample_batch()          prompts -> scored groups (scoring.score_groups);
                                                dynamic sampling rolls out more until groups teach
    advantages          StepBatch.from_groups() each completion against its group
    log-probs           add_logprobs()          the sampler's / reference policy's, for the loss
    loss + backward     accumulate_gradients()  micro-batch by micro-batch
    optimizer step      apply_update()          clipped, or skipped when anything is non-finite

`train()` (trainer.py) runs them in this order; the memory simulation runs the same functions.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import warnings
from dataclasses import dataclass, field, fields

import torch
from transformers import TrainerState

from . import distributed
from .checkpoint_schema import pending_misfit
from .config import GRPOConfig
from .attachments import rope_depends_on_length
from .distributed import World
from .logprobs import completion_logprobs
from .loss import (group_advantages, grpo_loss, high_entropy_mask, informative_groups, rollout_correction_stats,
                   rollout_importance_weights)
from .memory import gradient_bytes
from .rewards import combine_rewards
from .scoring import ScoredGroups, score_groups


# --------------------------------------------------------------------------------------
# The step's data


@dataclass
class MicroBatch:
    """A slice of rows of a StepBatch, trimmed of columns that are padding in all of them."""
    rows: slice
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor

    def per_token(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """This micro-batch's part of a [N, Tc] tensor of the whole batch (None stays None)."""
        return None if values is None else values[self.rows, : self.completion_ids.shape[1]]


@dataclass
class StepBatch:
    """One generation batch on its way through the step: whole groups of `num_generations`
    completions, their rewards and advantages, and the log-probs the loss compares with."""
    prompt_ids: torch.Tensor  # [N, Tp] left-padded
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # [N, Tc] right-padded
    completion_mask: torch.Tensor  # 1 up to and including the first EOS
    loss_mask: torch.Tensor  # the completion mask, minus truncated completions with mask_truncated_completions
    advantages: torch.Tensor | None  # [N]
    num_generations: int
    rewards: torch.Tensor | None = None  # [N] the weighted total
    rewards_per_func: torch.Tensor | None = None  # [N, num_funcs], NaN: no score
    truncated: torch.Tensor | None = None  # [N] bool: hit max_completion_length
    rows: list = field(default_factory=list)  # per completion: its dataset row
    texts: list = field(default_factory=list)
    sampling_logprobs: torch.Tensor | None = None  # [N, Tc] from the rollout engine, when it returns them
    old_logprobs: torch.Tensor | None = None  # the sampling policy's, for num_iterations > 1 (trainer-computed
    # with rollout_importance_sampling_correction, which then keeps sampling_logprobs for its weights)
    ref_logprobs: torch.Tensor | None = None  # the reference policy's, for beta > 0
    generation_time: float = 0.0
    prompts_cut: int = 0
    sampling_rounds: int = 1
    extras: list = field(default_factory=list)  # per completion: {column: value} the reward functions' log_extra gave
    logged_metrics: dict = field(default_factory=dict)  # name -> the values reward functions gave log_metric
    # dynamic sampling: {"rewards": the weighted total of every completion rolled out for the batch, in groups, the
    # dropped ones too}, so that the record says what the policy produced beside what it trained on; {} otherwise
    rolled_out: dict = field(default_factory=dict)

    @classmethod
    def from_groups(cls, groups: ScoredGroups, config: GRPOConfig) -> "StepBatch":
        """The batch of a rollout's scored groups, with each completion's advantage over its group."""
        out = groups.rollout
        loss_mask = out.completion_mask
        if config.mask_truncated_completions:
            loss_mask = loss_mask * (~out.truncated).long()[:, None]
        rewards_per_func = groups.rewards_per_func
        extra = groups.log.extra
        batch = cls(out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, loss_mask, None,
                    groups.num_generations, combine_rewards(rewards_per_func, config.reward_weights),
                    rewards_per_func, out.truncated, groups.rows, groups.texts, out.sampling_logprobs,
                    generation_time=groups.generation_time, prompts_cut=groups.prompts_cut,
                    extras=[{column: values[i] for column, values in extra.items()} for i in range(len(groups.texts))],
                    logged_metrics=groups.log.metrics)
        return batch.with_advantages(config)

    def with_advantages(self, config: GRPOConfig) -> "StepBatch":
        self.advantages = group_advantages(self.rewards, self.num_generations, scale_rewards=config.scale_rewards,
                                           estimator=config.advantage_estimator).to(self.prompt_ids.device)
        return self

    @property
    def size(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(1)

    def informative(self) -> torch.Tensor:
        """[groups] bool: groups whose scored completions' rewards differ (`loss.informative_groups`)."""
        return informative_groups(self.rewards, self.num_generations)

    def select_groups(self, groups: list[int]) -> "StepBatch":
        """The batch of these whole groups only (advantages as they were)."""
        g = self.num_generations
        index = [k * g + j for k in groups for j in range(g)]
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value[index]
            elif isinstance(value, list) and value:  # per completion (a batch built by hand may leave one empty)
                value = [value[i] for i in index]
            picked[f.name] = value
        return StepBatch(**picked)

    @staticmethod
    def cat(batches: list["StepBatch"]) -> "StepBatch":
        """One batch of several (from different rollouts: prompts re-padded left, completions right)."""
        def joined(name, pad_left=False):
            pieces = [getattr(b, name) for b in batches]
            if any(p is None for p in pieces):
                return None
            if pieces[0].dim() > 1:
                width = max(p.shape[1] for p in pieces)
                pad = lambda p: p.new_zeros(p.shape[0], width - p.shape[1])  # noqa: E731
                pieces = [torch.cat([pad(p), p] if pad_left else [p, pad(p)], dim=1) for p in pieces]
            return torch.cat(pieces)

        merged = {f.name: joined(f.name, pad_left=f.name.startswith("prompt_"))
                  for f in fields(StepBatch) if f.type.startswith("torch.Tensor")}
        merged.update(num_generations=batches[0].num_generations,
                      rows=[r for b in batches for r in b.rows], texts=[t for b in batches for t in b.texts],
                      extras=[e for b in batches for e in b.extras or [{}] * b.size],
                      logged_metrics=merged_metrics(batches),
                      generation_time=sum(b.generation_time for b in batches),
                      prompts_cut=sum(b.prompts_cut for b in batches),
                      sampling_rounds=sum(b.sampling_rounds for b in batches))
        return StepBatch(**merged)

    def micro_batches(self, size: int):
        """MicroBatch after MicroBatch of `size` rows, each trimmed of all-padding columns."""
        for start in range(0, self.size, size):
            rows = slice(start, start + size)
            prompt_mask, completion_mask = self.prompt_mask[rows], self.completion_mask[rows]
            first = int(prompt_mask.any(0).int().argmax())  # first prompt column with a real token (left padding)
            width = int(completion_mask.any(0).nonzero().max()) + 1 if completion_mask.any() else 1
            yield MicroBatch(rows, self.prompt_ids[rows, first:], prompt_mask[:, first:],
                             self.completion_ids[rows, :width], completion_mask[:, :width])

    def to(self, device) -> "StepBatch":
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, value.to(device))
        return self

    def state_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict) -> "StepBatch":
        return cls(**state)


def resumed_batch(path, pending: tuple, config: GRPOConfig, reward_names: list[str], device,
                  scored_by: list | None = None) -> tuple[StepBatch | None, int]:
    """A checkpoint's batch still being trained on and the steps left on it; (None, 0) and a warning when it was
    made under settings this run does not share, or scored by other reward functions than `reward_names` (the
    checkpoint's last record names those that scored it: `scored_by`) - a fresh rollout instead, as a data-parallel
    resume does."""
    problem = pending_misfit(pending, config, len(reward_names))
    if problem is None and scored_by is not None and list(scored_by) != list(reward_names):
        problem = f"its completions were scored by {scored_by!r:.200}; this run's reward functions are {reward_names!r}"
    if problem is not None:
        warnings.warn(f"The checkpoint {path} holds a generation batch still being trained on (num_iterations), "
                      f"made under other settings: {problem}. It is dropped: this run starts with a fresh rollout "
                      f"(the prompts it would have trained on again are skipped).", stacklevel=4)
        return None, 0
    batch, left = pending
    return StepBatch.from_state_dict(batch).to(device), left


# --------------------------------------------------------------------------------------
# Rollout + rewards (+ advantages)


def sample_batch(model, tokenizer, prompts, rollout, reward_funcs, config: GRPOConfig, step: int = 0,
                 world: World = World()) -> StepBatch:
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
                              timeout=config.reward_timeout)
        return StepBatch.from_groups(groups, config)

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


def merged_metrics(batches: list[StepBatch]) -> dict:
    """Every value the batches' reward functions gave log_metric, name by name."""
    merged = {}
    for batch in batches:
        for name, values in batch.logged_metrics.items():
            merged.setdefault(name, []).extend(values)
    return merged


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
                                 chunk_size=config.logprob_chunk_size, backend=config.logprob_backend)
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
    from .rollout import HFGenerateRollout

    exact = getattr(rollout, "logprobs_exact", None)  # the vLLM backend: only for some sampling settings
    if isinstance(rollout, HFGenerateRollout) or (callable(exact) and not exact()):
        raise ValueError(NO_ROLLOUT_LOGPROBS.format(what=f"the {type(rollout).__name__} rollout returns none with "
                                                         f"these settings"))


# --------------------------------------------------------------------------------------
# Loss + backward, optimizer step


def accumulate_gradients(model, params, batch: StepBatch, config: GRPOConfig, scaler=None,
                         world: World = World()) -> dict:
    """The loss's gradients over the whole generation batch, in micro-batches with accumulation.

    Each micro-batch's loss is normalised by the whole batch's sequence/token counts, so the
    accumulated gradient equals that of one big batch; with several ranks the totals are the
    global batch's and the gradients are summed over ranks at the end, so every rank holds the
    whole batch's gradient. A non-finite loss stops early and marks the step to be skipped.
    With fp16 weights, `scaler` scales the loss so small gradients survive the half-precision backward.
    """
    n = batch.size
    local_tokens = batch.loss_mask.sum()
    num_tokens = distributed.all_reduce(local_tokens, world)  # dapo: the tokens of the whole global batch
    # bnpo averages over each process's own tokens (as TRL's does), then over processes.
    loss_tokens = local_tokens * world.size if config.loss_type == "bnpo" else num_tokens
    totals = {"loss": 0.0, "kl": 0.0, "clip_ratio": 0.0, "clip_ratio_low": 0.0, "clip_ratio_high": 0.0}
    correction = RolloutCorrection(config, world) if config.rollout_importance_sampling_correction else None
    finite = True
    # Sharded layers reduce their gradients in every backward, a collective: all ranks must run
    # every micro-batch's backward, even after a non-finite loss (the step is skipped anyway).
    lockstep = world.distributed and distributed.is_sharded(model)
    for micro in batch.micro_batches(config.per_device_train_batch_size):
        mask = micro.per_token(batch.loss_mask)
        logprobs = completion_logprobs(model, micro.prompt_ids, micro.prompt_mask, micro.completion_ids,
                                       micro.completion_mask, temperature=config.temperature,
                                       chunk_size=config.logprob_chunk_size, backend=config.logprob_backend,
                                       return_entropy=config.top_entropy_quantile < 1.0)
        entropy_mask = None
        if config.top_entropy_quantile < 1.0:
            logprobs, entropies = logprobs
            entropy_mask = high_entropy_mask(entropies, mask, config.top_entropy_quantile)
        weights = None if correction is None else correction.weights(micro, batch, logprobs, mask)
        loss, m = grpo_loss(
            logprobs, micro.per_token(batch.old_logprobs), micro.per_token(batch.ref_logprobs),
            batch.advantages[micro.rows], mask, beta=config.beta, epsilon=config.epsilon,
            epsilon_high=config.epsilon_high, loss_type=config.loss_type,
            max_completion_length=config.max_completion_length, num_sequences=n * world.size, num_tokens=loss_tokens,
            use_bias_correction_kl=config.use_bias_correction_kl,
            importance_sampling_level=config.importance_sampling_level, entropy_mask=entropy_mask,
            sapo_temperature_pos=config.sapo_temperature_pos, sapo_temperature_neg=config.sapo_temperature_neg,
            rollout_weights=weights,
        )
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
    if correction is not None:
        totals.update(correction.metrics())
    return {**totals, "finite": finite, "gradient_bytes": gradient_bytes(params)}


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
        w = rollout_importance_weights(trainer, rollout, mask, mode=c.rollout_importance_sampling_mode,
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


def apply_update(optimizer, params, metrics: dict, config: GRPOConfig, scaler=None) -> None:
    """Clip and apply the accumulated gradients, or skip the step if anything is non-finite.

    Fills in metrics["grad_norm"] and metrics["skipped"]; the weights are untouched when skipped.
    """
    finite = metrics.pop("finite")
    if finite and scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = float(distributed.clip_grad_norm_(params, config.max_grad_norm)) if finite else math.nan
    skipped = not (finite and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
    if finite and scaler is not None:
        scaler.update()  # overflowing gradients (skipped above) halve the scale, as in torch.amp
    optimizer.zero_grad(set_to_none=True)
    if skipped:
        metrics["loss"] = math.nan
    metrics.update(grad_norm=grad_norm, skipped=skipped)


def optimize(model, optimizer, params, batch: StepBatch, config: GRPOConfig, scaler=None) -> dict:
    """One optimizer step over the whole generation batch: accumulate_gradients + apply_update."""
    metrics = accumulate_gradients(model, params, batch, config, scaler)
    apply_update(optimizer, params, metrics, config, scaler)
    return metrics


@contextlib.contextmanager
def deferred_interrupts():
    """Hold Ctrl-C (a notebook's Stop button) until the block is done, then raise it.

    The weight update, the schedule and the step count change together inside this block, so
    an interrupt never leaves the model one step ahead of its optimizer or its history.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield  # handlers can only be set from the main thread; an ignored Ctrl-C (a background job) stays ignored
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            raise KeyboardInterrupt


# --------------------------------------------------------------------------------------
# Builders


def build_optimizer(model, config: GRPOConfig):
    """AdamW over the trainable parameters, and the learning-rate schedule: (optimizer, scheduler, params)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        # e.g. load_for_inference's model: an adapter loaded for use, which a finished run's output_dir holds
        inference = (" Its adapter was loaded for inference (load_for_inference, or peft's from_pretrained without "
                     "is_trainable=True): to train it further, as a new run from its weights, load it with "
                     "peft.PeftModel.from_pretrained(<its base model>, <the adapter's folder>, is_trainable=True)."
                     if getattr(model, "peft_config", None) else "")
        raise ValueError(f"The model has no trainable parameters.{inference} For a fresh adapter, load the model with "
                         f"setup_reasoning_model(lora_rank=...).")
    optimizer = adamw(params, config)
    warmup = int(config.warmup_ratio * config.max_steps)

    def lr_factor(step):
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, config.max_steps - warmup)
        if config.lr_scheduler_type == "linear":
            return 1.0 - progress
        if config.lr_scheduler_type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor), params


def follow_schedule(optimizer, scheduler, learning_rate: float) -> None:
    """After a resume, the learning rate this run's schedule gives at the restored step: a run resumed
    with a higher max_steps or another learning_rate follows them, rather than the old run's ending
    schedule (whose last lr is 0 for "linear"). Unchanged settings give the restored values exactly."""
    scheduler.base_lrs = [learning_rate] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = learning_rate * factor(scheduler.last_epoch)
    scheduler.load_state_dict({**scheduler.state_dict(), "_last_lr": [g["lr"] for g in optimizer.param_groups]})


def adamw(params, config: GRPOConfig):
    """The AdamW that config.optim names: torch's, or bitsandbytes' 8-bit / paged one."""
    settings = dict(lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                    weight_decay=config.weight_decay)
    if config.optim in ("adamw_torch", "adamw_torch_fused"):  # fused: one kernel for all parameters (TRL's default)
        return torch.optim.AdamW(params, fused=config.optim == "adamw_torch_fused" or None, **settings)
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise ImportError(f"optim={config.optim!r} needs bitsandbytes: pip install bitsandbytes (or use "
                          f"optim='adamw_torch').") from err
    # Paging lets the states move to CPU RAM when the GPU runs short; with the parameters on the CPU there
    # is nothing to page, and bitsandbytes would warn and fall back to the same unpaged optimizer.
    paged = config.optim.startswith("paged_") and params[0].device.type == "cuda"
    if "8bit" in config.optim:
        return (bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit)(params, **settings)
    return bnb.optim.PagedAdamW32bit(params, **settings) if paged else bnb.optim.AdamW32bit(params, **settings)


def build_grad_scaler(model, device):
    """Loss scaling for fp16 weights (T4-class GPUs); bf16 and fp32 need none."""
    if any(p.dtype == torch.float16 for p in model.parameters()):
        return torch.amp.GradScaler(device.type, init_scale=2.0**12)
    return None
