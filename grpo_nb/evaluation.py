"""Held-out evaluation: greedy answers to a prompt dataset, checked against its `answer` column
and scored by reward functions, so a run can be judged before and after training.

Accuracy is measured two ways, as published GRPO runs report it: strict (the answer inside the
requested `<answer>` tags, exactly what `correctness_reward` pays for) and lenient (the last
number anywhere in the completion). Each rate comes with a 95% confidence interval (Wilson's), and
`paired_test` says whether two evaluations of the same problems differ beyond chance.
"""

from __future__ import annotations

import math
import re

import datasets
import torch

from .arguments import need_int
from .checks import check_model_and_tokenizer
from .config import GRPOConfig
from .data import as_dataset, dataset_columns
from .rewards import answers_match, correctness_reward, reward_func_name, soft_format_reward
from .rollout import RolloutEngine
from .scoring import score_groups

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
RATES = ("accuracy", "lenient_accuracy", "format_rate", "truncation_rate")


def default_answer_check(text: str, reference) -> bool:
    """Strict: the completion's last `<answer>...</answer>` equals `reference` (as numbers when both
    are) - `correctness_reward`'s own rule."""
    return correctness_reward([text], [reference])[0] > 0


def lenient_answer_check(text: str, reference) -> bool:
    """Lenient: the last number anywhere in the completion equals `reference` (tags or not)."""
    numbers = _NUMBER.findall(text)
    return bool(numbers) and answers_match(numbers[-1].rstrip(",").lstrip("+"), str(reference))


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% (z=1.96) Wilson score interval of a binomial rate: sound near 0% and 100% too."""
    if n == 0:
        return (math.nan, math.nan)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_test(before: list[bool], after: list[bool]) -> float:
    """Two-sided exact McNemar p-value for two evaluations of the same problems: the chance of a
    split at least this lopsided among the problems that changed, if training changed nothing."""
    if len(before) != len(after):
        raise ValueError(f"paired_test needs the same problems: {len(before)} vs {len(after)} results")
    gained = sum(1 for b, a in zip(before, after) if a and not b)
    lost = sum(1 for b, a in zip(before, after) if b and not a)
    changed = gained + lost
    if changed == 0:
        return 1.0
    tail = sum(math.comb(changed, k) for k in range(min(gained, lost) + 1)) / 2**changed
    return min(1.0, 2 * tail)


@torch.no_grad()
def evaluate(model, tokenizer, dataset, reward_funcs=None, *, answer_check=default_answer_check,
             lenient_check=lenient_answer_check, max_completion_length: int = GRPOConfig.max_completion_length,
             batch_size: int = 16, max_prompt_length: int | None = None, limit: int | None = None) -> dict:
    """Greedy completions for `dataset`'s prompts: accuracy (strict and lenient), format, length,
    truncation and mean rewards.

    Args:
        dataset: rows with a `prompt` (text or chat messages) and, for accuracy, an `answer`.
        reward_funcs: TRL-style reward functions to average over the completions (each gets
            the dataset's columns as keywords, as in training), e.g. STARTER_REWARDS.
        answer_check: `(completion_text, reference_answer) -> bool` for "accuracy"; the default
            is strict (`correctness_reward`'s rule). None skips accuracy.
        lenient_check: the same for "lenient_accuracy"; the default takes the last number in the
            completion. None skips it.
        limit: evaluate only the first `limit` rows.

    Returns {"accuracy", "lenient_accuracy", "format_rate", "truncation_rate", "mean_length",
    "intervals": {rate: (low, high)} (95%, Wilson), "rewards": {function name: mean}, "n",
    "completions": texts, "correct" / "correct_lenient": one bool per row, "truncated"}. The
    accuracies and their lists are None without an `answer` column or without their check.
    """
    need_int("evaluate", "max_completion_length", max_completion_length, 1)
    need_int("evaluate", "batch_size", batch_size, 1)
    need_int("evaluate", "max_prompt_length", max_prompt_length, 1, optional=True)
    need_int("evaluate", "limit", limit, 1, optional=True)
    check_model_and_tokenizer("evaluate", model, tokenizer)
    dataset = as_dataset(dataset)
    if isinstance(dataset, list):
        dataset = datasets.Dataset.from_list(dataset)
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    if len(dataset) == 0:
        raise ValueError("evaluate() got an empty dataset: pass at least one row with a 'prompt'")
    columns = dataset_columns(dataset)
    if "prompt" not in columns:
        raise ValueError(f"evaluate() needs a 'prompt' column; the dataset has {columns}")
    checks = {"correct": answer_check, "correct_lenient": lenient_check}
    checks = {k: f for k, f in checks.items() if f is not None and "answer" in columns}

    # The native engine's greedy tokens equal generate()'s (tests/test_engine.py), faster.
    rollout = RolloutEngine(max_completion_length=max_completion_length, greedy=True)
    texts, scores, truncated, lengths = [], [], [], []
    results = {k: [] for k in checks}
    for start in range(0, len(dataset), batch_size):
        rows = [dict(dataset[i]) for i in range(start, min(start + batch_size, len(dataset)))]
        groups = score_groups(model, tokenizer, rows, rollout, 1, reward_funcs or (),
                              max_prompt_length=max_prompt_length)
        for key, check in checks.items():
            results[key] += [bool(check(text, row["answer"])) for text, row in zip(groups.texts, rows)]
        scores.append(groups.rewards_per_func)
        texts += groups.texts
        truncated += groups.rollout.truncated.tolist()
        lengths += groups.rollout.completion_mask.sum(1).tolist()

    rewards = {}
    if reward_funcs:
        per_func = torch.cat(scores)
        for j, func in enumerate(reward_funcs):
            column = per_func[:, j]
            scored = column[~column.isnan()]  # None means "no score", as in training
            rewards[reward_func_name(func)] = scored.mean().item() if len(scored) else math.nan
    n = len(texts)
    hits = {"accuracy": results.get("correct"), "lenient_accuracy": results.get("correct_lenient"),
            "format_rate": [score > 0 for score in soft_format_reward(texts)], "truncation_rate": truncated}
    out = {name: (sum(found) / n if found is not None else None) for name, found in hits.items()}
    out.update(
        intervals={name: wilson_interval(sum(found), n) for name, found in hits.items() if found is not None},
        mean_length=sum(lengths) / n, rewards=rewards, n=n, completions=texts, truncated=truncated,
        correct=results.get("correct"), correct_lenient=results.get("correct_lenient"))
    return out


def compare(before: dict, after: dict) -> str:
    """Two evaluate() results side by side, as text lines (rates with their 95% intervals)."""
    def rate(result, key):
        low, high = result.get("intervals", {}).get(key, (math.nan, math.nan))
        return f"{result[key]:.1%}" + (f" [{low:.0%}, {high:.0%}]" if not math.isnan(low) else "")

    lines = [f"{'':<20}{'before':>22}{'after':>22}"]
    for key in RATES:
        if before.get(key) is not None and after.get(key) is not None:
            lines.append(f"{key:<20}{rate(before, key):>22}{rate(after, key):>22}")
    if before.get("mean_length") is not None and after.get("mean_length") is not None:
        lines.append(f"{'mean_length':<20}{before['mean_length']:>22.1f}{after['mean_length']:>22.1f}")
    for name in before.get("rewards", {}):
        if name in after.get("rewards", {}):
            lines.append(f"{name:<20}{before['rewards'][name]:>22.3f}{after['rewards'][name]:>22.3f}")
    lines.append(f"{'n':<20}{before['n']:>22}{after['n']:>22}")
    for key, label in (("correct", "strict"), ("correct_lenient", "lenient")):
        if before.get(key) and after.get(key) and len(before[key]) == len(after[key]):
            lines.append(f"paired test ({label}, same problems): p = {paired_test(before[key], after[key]):.3g}")
    return "\n".join(lines)
