"""The ways a run stops itself when it is going nowhere, checked after each step.

    check_nonfinite_streak   the last `max_nonfinite_steps` steps were all skipped (NaN/inf loss or gradient)
    check_unscored_streak    no completion got a reward for `max_unscored_steps` steps (every function said None)
    check_finite_weights     a trainable weight became NaN or inf (nothing is then saved from it)
    warn_nothing_to_learn    a step the settings leave nothing to learn from (said, not stopped)

train() calls them after each step; the first two errors then save the last completed step like any other.
"""

from __future__ import annotations

import math
import warnings

import torch

from . import distributed
from .reward_contract import RewardFunctionError


class NonFiniteTrainingError(RuntimeError):
    """Too many steps in a row had a NaN/inf loss or gradient; the weights were left untouched."""


def trailing(history, holds) -> int:
    """How many of the newest records in a row `holds` is true of."""
    streak = 0
    for record in reversed(history):
        if not holds(record):
            break
        streak += 1
    return streak


def check_nonfinite_streak(history, config) -> None:
    """Stop the run once the last `max_nonfinite_steps` steps were all skipped as non-finite."""
    streak = trailing(history, lambda record: record["skipped_nonfinite"])
    if streak >= config.max_nonfinite_steps:
        first = history[-streak]["step"]
        raise NonFiniteTrainingError(
            f"The last {streak} steps ({first} to {history[-1]['step']}) all had a non-finite (NaN or inf) loss or "
            f"gradient, so each was skipped: the weights are unchanged since step {first - 1}. Usual causes: a "
            f"learning rate too high (now {config.learning_rate:g}); fp16 overflow (load with dtype='bfloat16' on "
            f"a GPU of compute capability 8.0+, else dtype='float32'); rewards of a huge scale; a model already "
            f"broken before training (check its outputs). max_nonfinite_steps={config.max_nonfinite_steps} sets how "
            f"many in a row are allowed."
        )


def check_unscored_streak(history, config, warned: set) -> None:
    """Completions no reward function scored (all None) are left out of their group's advantages, as in TRL: say
    so the first time, and stop the run once no completion at all was scored for `max_unscored_steps` steps."""
    record = history[-1]
    names = ", ".join(record["rewards"])
    if record.get("unscored_completions") and "unscored" not in warned:
        warned.add("unscored")
        example = next((s for s in record["samples"] if math.isnan(s["reward"])), None)
        shown = "" if example is None else (
            f" One of them: {example['completion']!r:.200}, for the row " + ", ".join(
                f"{k}={v!r:.80}" for k, v in example.items()
                if k not in ("completion", "rewards", "reward", "advantage", "extra")) + ".")
        warnings.warn(
            f"{record['unscored_completions']} completion(s) of step {record['step']} got no score: every reward "
            f"function ({names}) returned None for them. As in TRL, they are left out of their group's mean and std "
            f"and get advantage 0, so they teach nothing; each record counts them as unscored_completions. Return "
            f"0.0 where None is meant as 'earned nothing'.{shown} The run stops only after "
            f"max_unscored_steps={config.max_unscored_steps} steps in a row with no score at all.", stacklevel=3)
    # a record's reward is the mean over its scored completions: NaN when there were none
    streak = trailing(history, lambda record: math.isnan(record["reward"]))
    if streak >= config.max_unscored_steps:
        first = history[-streak]["step"]
        raise RewardFunctionError(
            f"No completion got a reward in the last {streak} step(s) ({first} to {history[-1]['step']}): every "
            f"reward function ({names}) returned None for every completion, so there was nothing to learn from "
            f"(all advantages 0). None means 'no score for this completion'; return 0.0 for a completion that "
            f"earned nothing, and check that the functions can read the dataset's columns (e.g. an answer they "
            f"cannot parse). max_unscored_steps={config.max_unscored_steps} sets how many such steps in a row "
            f"are allowed."
        )


def check_finite_weights(run, model, when: str) -> None:
    """Stop the run (`run`: the trainer's Run) if a trainable weight is NaN or inf (`when`: before training, or after a step's update):
    nothing is ever saved from such weights, so the checkpoints and the adapter already saved stay good. The
    update skips non-finite gradients; this catches what gets past them (a learning rate or weight_decay far
    too high, a damaged optimizer state). One max-abs per tensor, one sync: cheap next to the step."""
    with torch.no_grad():
        local = [p.to_local() if isinstance(p, distributed.DTensor) else p for p in run.params]
        peaks = [torch.linalg.vector_norm(p, math.inf).float().to(run.device) for p in local if p.numel()]
        finite = torch.isfinite(torch.stack(peaks)).all() if peaks else torch.tensor(True, device=run.device)
        if run.sharded:  # each rank sees its shards: all stop together, or none
            finite = distributed.all_reduce(finite.int(), run.world, torch.distributed.ReduceOp.MIN).bool()
    if bool(finite):
        return
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    bad = [n for n, p in zip(names, local) if p.numel() and not bool(torch.isfinite(p).all())]
    c = run.config
    raise NonFiniteTrainingError(
        f"Trainable weights are NaN or inf {when} ({len(bad)} tensor(s), e.g. {', '.join(bad[:2])}). Nothing "
        f"is saved from them: the checkpoints in {run.output_dir} and any adapter saved there stay as they were. "
        f"Usual causes: a learning rate or weight_decay far too high (now learning_rate={c.learning_rate:g}, "
        f"weight_decay={c.weight_decay:g}); a damaged optimizer state; a model broken before training (reload "
        f"it). Resume from the newest checkpoint with gentler settings, or start again.")


def warn_nothing_to_learn(batch, config, step: int, warned: set) -> None:
    """A batch (StepBatch) the update cannot learn from, for a reason of the run's settings (GRPOConfig), and paid for: every completion cut
    and mask_truncated_completions=True (no token left in the loss: said each such step, as each changes nothing),
    or dynamic sampling's rounds all spent without one group whose rewards differ (said once)."""
    if (config.mask_truncated_completions and batch.truncated is not None and batch.size
            and bool(batch.truncated.all())):
        warnings.warn(
            f"Step {step}: every completion hit max_completion_length={config.max_completion_length}, and "
            f"mask_truncated_completions=True leaves cut completions out of the loss, so no token is left to train "
            f"on: this step changes nothing (loss 0)"
            + (f", nor do the {config.num_iterations - 1} more it iterates on this batch" if config.num_iterations > 1
               else "")
            + ". Raise max_completion_length, or set mask_truncated_completions=False.", stacklevel=3)
    if (config.dynamic_sampling and "no informative group" not in warned and batch.size
            and batch.sampling_rounds >= config.dynamic_sampling_max_rounds and not bool(batch.informative().any())):
        warned.add("no informative group")
        warnings.warn(
            f"Step {step}: dynamic_sampling rolled out {batch.sampling_rounds} times "
            f"(dynamic_sampling_max_rounds={config.dynamic_sampling_max_rounds}) and in no group did the rewards "
            f"differ, so every advantage is 0: the step trains nothing, at {batch.sampling_rounds} times a step's "
            f"generation. Check that the reward functions tell completions apart (preview_rewards(reward_funcs, "
            f"completions) shows what they give a few); the records' frac_reward_zero_std and sampling_rounds show "
            f"each step.",
            stacklevel=3)
