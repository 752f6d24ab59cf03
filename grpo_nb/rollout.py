"""Rollout: sample a group of completions per prompt from the live policy.

The trainer talks to generation through one small interface, `Rollout.__call__`, so a
faster engine (shared-prefix KV cache, CUDA graphs, vLLM) can replace `HFGenerateRollout`
without touching the loop. This module holds the reference path: batched HF `generate`
with a KV cache, on the training weights themselves (LoRA active, nothing copied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RolloutBatch:
    """One generation batch, `num_generations` rows per prompt next to each other."""

    prompt_ids: torch.Tensor  # [N, Tp] left-padded
    prompt_mask: torch.Tensor  # [N, Tp]
    completion_ids: torch.Tensor  # [N, Tc] right-padded
    completion_mask: torch.Tensor  # [N, Tc] 1 up to and including the first EOS
    truncated: torch.Tensor  # [N] bool: hit max_completion_length without EOS
    sampling_logprobs: torch.Tensor | None = None  # [N, Tc] if the engine returns them


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_token_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of real tokens (through the first EOS) and whether each row ended without one.

    Derived from the first EOS rather than from pad ids, because many tokenizers pad with EOS.
    """
    is_eos = torch.isin(completion_ids, torch.as_tensor(list(eos_token_ids), device=completion_ids.device))
    n, t = completion_ids.shape
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((n,), t, device=completion_ids.device))
    mask = (torch.arange(t, device=completion_ids.device)[None] <= first_eos[:, None]).long()
    return mask, ~is_eos.any(1)


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a turn: the tokenizer's EOS and the generation config's (may be a list)."""
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, gen_eos):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    if not ids:
        raise ValueError("The tokenizer has no EOS token, so completions could never end; set tokenizer.eos_token.")
    return sorted(ids)


class HFGenerateRollout:
    """Reference rollout: `model.generate` over every prompt x generation in one batch."""

    def __init__(self, *, max_completion_length, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                 repetition_penalty=1.0, greedy=False, generation_kwargs=None):
        self.max_completion_length = max_completion_length
        self.generation_kwargs = dict(generation_kwargs or {})
        if greedy:  # evaluation: the most likely completion, no sampling filters
            self.sampling = dict(do_sample=False, temperature=None, top_p=None, top_k=None,
                                 repetition_penalty=repetition_penalty)
        else:
            self.sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None,
                                 min_p=min_p, repetition_penalty=repetition_penalty)

    @torch.no_grad()
    def __call__(self, model, tokenizer, prompt_ids, prompt_mask, num_generations: int) -> RolloutBatch:
        prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)
        eos = eos_token_ids(model, tokenizer)
        was_training = model.training
        # eval(): generate() refuses the KV cache under gradient checkpointing in train mode.
        model.eval()
        try:
            out = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                max_new_tokens=self.max_completion_length,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
                use_cache=True,
                **{**self.sampling, **self.generation_kwargs},
            )
        finally:
            model.train(was_training)
        completion_ids = out[:, prompt_ids.shape[1] :]
        completion_mask, truncated = completion_mask_from_eos(completion_ids, eos)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
        return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated)


def encode_prompts(tokenizer, prompts: list, max_prompt_length: int | None, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Tokenize prompts (chat messages through the chat template) and left-pad them.

    Prompts longer than `max_prompt_length` keep their last `max_prompt_length` tokens (the
    end of the conversation, where the question usually is); the count of cut prompts is
    returned so the caller can say so.
    """
    texts = [
        p if isinstance(p, str) else tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    rows = tokenizer(texts, add_special_tokens=False)["input_ids"]
    n_cut = 0
    if max_prompt_length is not None:
        n_cut = sum(len(r) > max_prompt_length for r in rows)
        rows = [r[-max_prompt_length:] for r in rows]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device), n_cut
