"""GRPO learns: the sampled distribution moves toward what the reward pays for.

On a tiny random model (seconds): a reward that pays for tokens from a fixed ~12% of the vocabulary doubles their
share in fresh samples after 20 steps, far beyond sampling noise. That the main job teaches the embedded default
the format and the task (held-out accuracy before/after, 3 seeds, ~10 CPU minutes each) is benchmarks/learning.py's
proof (benchmarks/results/learning_cpu.json); a 6-step real-model version of this test took ~4.5 of CI's minutes.
"""

import math

import torch

from grpo_nb import train
from tiny_models import FAST, dataset, lora_model

LOW = range(4, 64)  # 60 of the 512 ids


def low_ids(completion_ids, **kwargs):
    return [sum(i in LOW for i in ids) / max(len(ids), 1) for ids in completion_ids]


def low_share(model, tok, samples=32):
    """The share of LOW tokens in `samples` fresh 8-token samples per prompt, and its standard error (per completion)."""
    prompts = tok(list(dataset(16)["prompt"]), return_tensors="pt", padding=True)
    torch.manual_seed(1)
    with torch.no_grad():
        out = model.generate(**prompts, do_sample=True, max_new_tokens=8, min_new_tokens=8, num_return_sequences=samples,
                             pad_token_id=tok.pad_token_id)
    completions = out[:, prompts["input_ids"].shape[1]:]
    per_completion = ((completions >= LOW.start) & (completions < LOW.stop)).float().mean(1)
    return per_completion.mean().item(), per_completion.std().item() / math.sqrt(len(per_completion))


def test_the_reward_paid_for_rises_in_fresh_samples(tok, tmp_path):
    model = lora_model()
    before, se_before = low_share(model, tok)
    history = train(model, tok, dataset(16), [low_ids], output_dir=str(tmp_path), max_steps=20, seed=0, logging_steps=100,
                    **{**FAST, "num_generations": 8, "per_device_train_batch_size": 16, "gradient_accumulation_steps": 1,
                       "max_completion_length": 8, "learning_rate": 5e-2})
    after, se_after = low_share(model, tok)
    lift, noise = after - before, math.hypot(se_before, se_after)
    print(f"LOW share {before:.3f} -> {after:.3f} (noise {noise:.3f})")
    assert abs(before - len(LOW) / 512) < 4 * se_before  # a random model: about the vocabulary's share
    assert lift > 0.08 and lift > 6 * noise, (before, after, noise)
    assert all(not r["skipped_nonfinite"] for r in history)
