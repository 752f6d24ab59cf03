"""Held-out evaluation: greedy answers to a prompt dataset, checked against its `answer` column
and scored by reward functions, so a run can be judged before and after training."""

from __future__ import annotations

import math

import torch

from .data import dataset_columns
from .config import GRPOConfig
from .rewards import answers_match, extract_answer, reward_func_name, soft_format_reward
from .rollout import RolloutEngine
from .scoring import score_groups


def default_answer_check(text: str, reference) -> bool:
    """The completion's last `<answer>...</answer>` equals `reference` (as numbers when both are)."""
    predicted = extract_answer(text)
    return predicted is not None and answers_match(predicted, str(reference))


@torch.no_grad()
def evaluate(model, tokenizer, dataset, reward_funcs=None, *, answer_check=default_answer_check,
             max_completion_length: int = GRPOConfig.max_completion_length, batch_size: int = 16, max_prompt_length: int | None = None,
             limit: int | None = None) -> dict:
    """Greedy completions for `dataset`'s prompts, their accuracy, format rate and mean rewards.

    Args:
        dataset: rows with a `prompt` (text or chat messages) and, for accuracy, an `answer`.
        reward_funcs: TRL-style reward functions to average over the completions (each gets
            the dataset's columns as keywords, as in training), e.g. STARTER_REWARDS.
        answer_check: `(completion_text, reference_answer) -> bool`; the default compares the
            last <answer>...</answer> with the reference. None skips accuracy.
        limit: evaluate only the first `limit` rows.

    Returns {"accuracy", "format_rate", "rewards": {function name: mean}, "n",
    "completions": texts, "correct": one bool per row}. accuracy and correct are None
    without an `answer` column or with answer_check=None.
    """
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    if len(dataset) == 0:
        raise ValueError("evaluate() got an empty dataset: pass at least one row with a 'prompt'")
    columns = dataset_columns(dataset)
    if "prompt" not in columns:
        raise ValueError(f"evaluate() needs a 'prompt' column; the dataset has {columns}")
    check_answers = answer_check is not None and "answer" in columns

    # The native engine's greedy tokens equal generate()'s (tests/test_engine.py), faster.
    rollout = RolloutEngine(max_completion_length=max_completion_length, greedy=True)
    texts, correct, scores = [], [], []
    for start in range(0, len(dataset), batch_size):
        rows = [dict(dataset[i]) for i in range(start, min(start + batch_size, len(dataset)))]
        groups = score_groups(model, tokenizer, rows, rollout, 1, reward_funcs or (),
                              max_prompt_length=max_prompt_length)
        if check_answers:
            correct += [bool(answer_check(text, row["answer"])) for text, row in zip(groups.texts, rows)]
        scores.append(groups.rewards_per_func)
        texts += groups.texts

    rewards = {}
    if reward_funcs:
        per_func = torch.cat(scores)
        for j, func in enumerate(reward_funcs):
            column = per_func[:, j]
            scored = column[~column.isnan()]  # None means "no score", as in training
            rewards[reward_func_name(func)] = scored.mean().item() if len(scored) else math.nan
    return {
        "accuracy": sum(correct) / len(texts) if check_answers else None,
        "format_rate": sum(score > 0 for score in soft_format_reward(texts)) / len(texts),
        "rewards": rewards,
        "n": len(texts),
        "completions": texts,
        "correct": correct if check_answers else None,
    }


def compare(before: dict, after: dict) -> str:
    """Two evaluate() results side by side, as text lines."""
    lines = [f"{'':<24}{'before':>10}{'after':>10}"]
    for key in ("accuracy", "format_rate"):
        if before.get(key) is not None and after.get(key) is not None:
            lines.append(f"{key:<24}{before[key]:>10.1%}{after[key]:>10.1%}")
    for name in before.get("rewards", {}):
        if name in after.get("rewards", {}):
            lines.append(f"{name:<24}{before['rewards'][name]:>10.3f}{after['rewards'][name]:>10.3f}")
    lines.append(f"{'n':<24}{before['n']:>10}{after['n']:>10}")
    return "\n".join(lines)
