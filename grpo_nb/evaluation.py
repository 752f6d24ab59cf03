"""Held-out evaluation: greedy answers to a prompt dataset, checked against its `answer` column."""

from __future__ import annotations

import torch

from .rewards import answers_match, extract_answer, soft_format_reward
from .rollout import RolloutEngine, encode_prompts


@torch.no_grad()
def evaluate(model, tokenizer, dataset, *, max_completion_length: int = 128, batch_size: int = 16,
             max_prompt_length: int | None = None) -> dict:
    """Accuracy (the `<answer>` equals the reference) and format rate of greedy completions.

    Returns {"accuracy", "format_rate", "n", "completions"}.
    """
    # The native engine's greedy tokens equal generate()'s (tests/test_engine.py), faster.
    rollout = RolloutEngine(max_completion_length=max_completion_length, greedy=True)
    device = next(model.parameters()).device
    correct, formatted, texts = 0, 0, []
    for start in range(0, len(dataset), batch_size):
        rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        ids, mask, _ = encode_prompts(tokenizer, [r["prompt"] for r in rows], max_prompt_length, device)
        out = rollout(model, tokenizer, ids, mask, num_generations=1)
        batch_texts = tokenizer.batch_decode(out.completion_ids * out.completion_mask, skip_special_tokens=True)
        for row, text in zip(rows, batch_texts):
            predicted = extract_answer(text)
            correct += predicted is not None and answers_match(predicted, row["answer"])
        formatted += sum(score > 0 for score in soft_format_reward(batch_texts))
        texts += batch_texts
    n = len(texts)
    return {"accuracy": correct / n, "format_rate": formatted / n, "n": n, "completions": texts}
