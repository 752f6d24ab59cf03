"""The step's data: `StepBatch`, one generation batch on its way through the step (typed, as torchtune's
GRPOTrajectory), its micro-batches, and a checkpoint's batch still being trained on brought back for a resume.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields, replace

import torch

from .checkpoint_schema import pending_misfit
from .config import GRPOConfig
from .loss import group_advantages, informative_groups
from .reward_calls import aggregated_advantages, combine_rewards
from .scoring import ScoredGroups


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
class StepMetrics:
    """What one optimizer step's update measured: `accumulate_gradients` fills the loss's part,
    `apply_update` returns it with the gradient norm and whether the weights moved."""
    loss: float  # the whole batch's loss; NaN when the update was skipped
    kl: float
    clip_ratio: float
    clip_ratio_low: float
    clip_ratio_high: float
    finite: bool  # every micro-batch's loss was finite (on every rank)
    gradient_bytes: int  # what the trainable parameters' gradients held (the memory tracker's)
    rollout_correction: dict = field(default_factory=dict)  # step.ROLLOUT_CORRECTION_METRICS, when the correction is on
    loss_extras: dict = field(default_factory=dict)  # step.LOSS_EXTRA_METRICS the options that measure them give
    grad_norm: float = math.nan  # before clipping; NaN when not finite
    skipped: bool = False  # the update was not applied (a non-finite loss or gradient)


@dataclass
class StepBatch:
    """One generation batch on its way through the step: whole groups of `num_generations`
    completions, their rewards and advantages, and the log-probs the loss compares with."""
    prompt_ids: torch.Tensor  # [N, Tp] left-padded
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # [N, Tc] right-padded
    completion_mask: torch.Tensor  # 1 up to and including the first EOS (over a whole episode's turns)
    loss_mask: torch.Tensor  # the completion mask, minus tokens tools wrote (env_mask), minus truncated completions
    # with mask_truncated_completions
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
    env_mask: torch.Tensor | None = None  # [N, Tc] episodes: 1 where the model sampled, 0 where a tool wrote
    episodes: list | None = None  # per completion of an episode batch: its messages (turns, calls, results)

    @classmethod
    def from_groups(cls, groups: ScoredGroups, config: GRPOConfig) -> "StepBatch":
        """The batch of a rollout's scored groups, with each completion's advantage over its group."""
        out = groups.rollout
        loss_mask = out.completion_mask if out.env_mask is None else out.completion_mask * out.env_mask
        if config.mask_truncated_completions:
            loss_mask = loss_mask * (~out.truncated).long()[:, None]
        rewards_per_func = groups.rewards_per_func
        extra = groups.log.extra
        batch = cls(out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, loss_mask, None,
                    groups.num_generations, combine_rewards(rewards_per_func, config.reward_weights),
                    rewards_per_func, out.truncated, groups.rows, groups.texts, out.sampling_logprobs,
                    generation_time=groups.generation_time, prompts_cut=groups.prompts_cut,
                    extras=[{column: values[i] for column, values in extra.items()} for i in range(len(groups.texts))],
                    logged_metrics=groups.log.metrics, env_mask=out.env_mask,
                    episodes=list(groups.completions) if out.env_mask is not None else None)
        return batch.with_advantages(config)

    def with_advantages(self, config: GRPOConfig) -> "StepBatch":
        """A copy whose advantages are each completion's against its group (config's estimator and scaling)."""
        if self.rewards_per_func is None or config.multi_objective_aggregation == "sum_then_normalize":
            advantages = group_advantages(self.rewards, self.num_generations, scale_rewards=config.scale_rewards,
                                          estimator=config.advantage_estimator)
        else:  # each reward function's rewards normalized first (reward_calls.aggregated_advantages)
            advantages = aggregated_advantages(self.rewards_per_func, self.num_generations,
                                               reward_weights=config.reward_weights,
                                               aggregation=config.multi_objective_aggregation)
        return replace(self, advantages=advantages.to(self.prompt_ids.device))

    @property
    def size(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def completion_lengths(self) -> torch.Tensor:
        """Tokens the model sampled (a tool's are not its: TRL counts only these too)."""
        return (self.completion_mask if self.env_mask is None else self.completion_mask * self.env_mask).sum(1)

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
                      episodes=None if any(b.episodes is None for b in batches) else
                      [e for b in batches for e in b.episodes],
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
        """A copy with every tensor on `device` (as torch's `.to`, the batch itself is left as it is)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

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


def merged_metrics(batches: list[StepBatch]) -> dict:
    """Every value the batches' reward functions gave log_metric, name by name."""
    merged = {}
    for batch in batches:
        for name, values in batch.logged_metrics.items():
            merged.setdefault(name, []).extend(values)
    return merged
