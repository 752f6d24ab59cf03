"""Each optimizer step's record: one plain dict, which is all the widgets and callbacks ever see."""

from __future__ import annotations

import math
import numbers

import torch

from . import distributed
from .distributed import World
from .loss import informative_groups
from .reward_contract import reward_func_names, table_cell
from .batch import StepBatch, StepMetrics


def _nan_stats(x: torch.Tensor) -> tuple[float, float]:
    x = x[~torch.isnan(x)]
    if x.numel() == 0:
        return math.nan, math.nan
    return float(x.mean()), float(x.std()) if x.numel() > 1 else 0.0


def _global_metrics(batch: StepBatch, world: World) -> dict[str, float]:
    """Each log_metric name's mean over the step's values, every rank's included (as TRL averages them)."""
    local = batch.logged_metrics
    names = sorted(local)
    if world.distributed:  # every rank must reduce the same names in the same order
        everyone = [None] * world.size
        torch.distributed.all_gather_object(everyone, names)
        names = sorted(set().union(*everyone))
    sums = torch.tensor([[sum(local.get(n, ())), len(local.get(n, ()))] for n in names], dtype=torch.float64,
                        device=batch.rewards.device)
    sums = distributed.all_reduce(sums, world)
    return {name: total / count for name, (total, count) in zip(names, sums.tolist())}


def _global_scores(batch: StepBatch, world: World) -> dict:
    """The step's scores over every rank's completions (rank 0's first). Samples stay local:
    rank 0's come first in the global order anyway."""
    scores = {"rewards": batch.rewards, "rewards_per_func": batch.rewards_per_func, "truncated": batch.truncated,
              "completion_lengths": batch.completion_lengths}
    if not world.distributed:
        return scores
    return {key: distributed.gather_rows(value, world) for key, value in scores.items()}


def _rolled_out(batch: StepBatch, config, world: World) -> dict:
    """Dynamic sampling keeps the groups whose rewards differ, so the record's reward and frac_reward_zero_std
    describe the kept groups (what the step trained on), which the filter raises. These say what the policy
    produced: the same numbers over every group rolled out for the step, the dropped ones too."""
    rewards = torch.tensor(batch.rolled_out["rewards"], dtype=torch.float32, device=batch.rewards.device)
    if world.distributed:  # every rank ran the same number of rounds: equal sizes
        rewards = distributed.gather_rows(rewards, world)
    mean, std = _nan_stats(rewards)
    flat = (~informative_groups(rewards, config.num_generations)).float()
    return {"rolled_out_reward": mean, "rolled_out_reward_std": std, "rolled_out_frac_reward_zero_std":
            float(flat.mean()), "rolled_out_groups": len(flat)}


def make_record(step: int, batch: StepBatch, metrics: StepMetrics, *, config, reward_funcs, lr: float,
                step_time: float, device, memory: dict, world: World = World()) -> dict:
    """One plain dict per optimizer step: everything the widgets and the summary show."""
    scores = _global_scores(batch, world)
    lengths, rewards = scores["completion_lengths"].float(), scores["rewards"]
    # A completion no reward function scored has reward NaN: left out of the means and stds, as in TRL, and counted.
    reward, reward_std = _nan_stats(rewards)
    record = {
        "step": step,
        "reward": reward,  # NaN when no completion of the step was scored
        "reward_std": reward_std,
        "rewards": {},
        "unscored_completions": int(rewards.isnan().sum()),
        "metrics": _global_metrics(batch, world),  # what reward functions gave log_metric, averaged
        "loss": metrics.loss,
        "kl": metrics.kl,
        "clip_ratio": metrics.clip_ratio,
        "clip_ratio_low": metrics.clip_ratio_low,
        "clip_ratio_high": metrics.clip_ratio_high,
        "grad_norm": metrics.grad_norm,
        "skipped_nonfinite": metrics.skipped,
        "learning_rate": lr,
        "completion_length_mean": float(lengths.mean()),
        "completion_length_max": int(lengths.max()),
        "truncated_fraction": float(scores["truncated"].float().mean()),
        "frac_reward_zero_std": float((~informative_groups(rewards, config.num_generations)).float().mean()),
        "sampling_rounds": batch.sampling_rounds,
        "prompts_truncated": batch.prompts_cut,
        "generation_time": batch.generation_time,
        "step_time": step_time,
        "peak_memory_bytes": memory["peak"],
        "memory": memory,
        "device": str(device),
        "samples": [],
    }
    # rollout_importance_sampling_correction's ratio and log-prob-difference stats, when it is on
    record.update(metrics.rollout_correction)
    record.update(metrics.loss_extras)  # entropy / entropy_coef / off_policy_masked ..., when their options are on
    if batch.rolled_out:
        record.update(_rolled_out(batch, config, world))
    names = reward_func_names(reward_funcs)  # two functions of one name: '<lambda>', '<lambda>#2'
    for j, name in enumerate(names):
        mean, std = _nan_stats(scores["rewards_per_func"][:, j])
        record["rewards"][name] = {"mean": mean, "std": std}
    if config.log_completions:
        for i in range(min(config.num_completions_to_print, len(batch.texts))):
            record["samples"].append({
                **sample_of_row(batch.rows[i]),
                "completion": batch.texts[i],
                "rewards": {n: float(batch.rewards_per_func[i, j]) for j, n in enumerate(names)},
                "reward": float(batch.rewards[i]),  # NaN: no reward function scored it
                "advantage": float(batch.advantages[i]),
                "extra": dict(batch.extras[i]) if i < len(batch.extras) else {},  # the columns log_extra added
            })
            if batch.episodes:  # an episode: its turns apart (the completion above is them as one text)
                record["samples"][-1]["turns"] = batch.episodes[i]
    return record


# A record's samples keep what the views show, bounded: the history holds a record per step and every checkpoint
# writes it whole, so a long document in a prompt or a column must not be copied into each one.
MAX_SAMPLE_PROMPT = 2000  # characters of the prompt kept, from its end (the question; the model sees the end too)
MAX_SAMPLE_COLUMN = 1000  # characters of a dataset text column; a longer one is left out, and named
SAMPLE_KEYS = ("prompt", "prefill", "left_out", "completion", "rewards", "reward", "advantage", "extra", "turns")


def sample_of_row(row: dict) -> dict:
    """What a sample keeps of its dataset row: the prompt (a chat prompt's last user message) cut to its end, an
    assistant prefill (the start of the answer the prompt wrote, which the completion continues) apart as
    "prefill", and the short columns the views read (the answer, an id) as plain values; longer text columns
    are named in "left_out", and lists and dicts, which no view shows, are not kept. A column named like a
    sample's own key gives way to it."""
    sample, left_out = {}, []
    for key, value in row.items():
        if key in SAMPLE_KEYS or not isinstance(value, (str, numbers.Number)):
            continue
        if isinstance(value, str) and len(value) > MAX_SAMPLE_COLUMN:
            left_out.append(f"{key} ({len(value):,} characters)")
            continue
        sample[key] = table_cell(value)  # an int beyond JSON's 4300 digits as text, a numpy number as Python's
    prompt, prefill = row["prompt"], None
    if not isinstance(prompt, str):
        messages = prompt
        if messages and messages[-1].get("role") == "assistant":  # a prefill: the model continues it
            prefill, messages = messages[-1]["content"], messages[:-1]
        asked = [m for m in messages if m.get("role") == "user"] or messages
        prompt = asked[-1]["content"] if asked else ""
    sample["prompt"] = _tail(prompt)
    if prefill is not None:
        sample["prefill"] = _tail(prefill)
    if left_out:
        sample["left_out"] = left_out
    return sample


def _tail(text: str, limit: int = MAX_SAMPLE_PROMPT) -> str:
    """`text`'s last `limit` characters, marked as cut when it is longer."""
    text = table_cell(text)  # a lone surrogate as its escape: no file can hold it
    return text if len(text) <= limit else f"[... {len(text) - limit:,} earlier characters cut]\n" + text[-limit:]


def print_progress(record: dict, max_steps: int) -> None:
    """A plain one-line progress report for terminals (train(verbose=True)); the dashboard's own line, with the
    peak memory, is grpo_nb_widgets.live.progress_line, which this library does not import for a run without one."""
    skipped = "  SKIPPED (non-finite loss)" if record["skipped_nonfinite"] else ""
    evaluated = "".join(f" | {eval_summary(record[key], label)}" for key, label in (("eval_start", "eval before"),
                                                                                     ("eval", "eval"))
                        if isinstance(record.get(key), dict))
    print(
        f"step {record['step']:>4}/{max_steps} | reward {record['reward']:.3f} ± {record['reward_std']:.3f} | "
        f"loss {record['loss']:+.4f} | kl {record['kl']:.4f} | len {record['completion_length_mean']:.0f} | "
        f"{record['step_time']:.1f}s{evaluated}{skipped}",
        flush=True,
    )


def eval_summary(evaluation: dict, label: str = "eval") -> str:
    """A held-out evaluation in a few words: "eval acc 50% (lenient 75%) of 4", or its format rate when the eval set
    has no answers."""
    def share(key):
        value = evaluation.get(key)
        return f"{value:.0%}" if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    n = evaluation.get("n")
    of = f" of {n}" if isinstance(n, int) else ""
    if share("accuracy") is not None:
        lenient = f" (lenient {share('lenient_accuracy')})" if share("lenient_accuracy") is not None else ""
        return f"{label} acc {share('accuracy')}{lenient}{of}"
    return f"{label} format {share('format_rate')}{of}" if share("format_rate") is not None else f"{label}{of}"
