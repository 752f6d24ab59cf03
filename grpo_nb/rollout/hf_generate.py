"""The reference rollout: batched HF `generate` on the live training weights (LoRA active, nothing copied)."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from ..attachments import base_model
from ..lora import rollout_branch
from .batch import RolloutBatch, completion_mask_from_eos, eos_token_ids


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

    def returns_logprobs(self) -> bool:
        return False  # generate() gives scores only after its logits processors: not the sampling distribution's

    @torch.no_grad()
    @rollout_branch()
    def __call__(self, model, tokenizer, prompt_ids, prompt_mask, num_generations: int) -> RolloutBatch:
        prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)
        eos = eos_token_ids(model, tokenizer)
        # Only grpo-nb's settings: generate() fills every field left unset from the model's own generation
        # config (someone's generation_config.json: num_beams, bad_words_ids, no_repeat_ngram_size, ...), and
        # the loss assumes plain temperature / top-k / top-p sampling, as the native engine does.
        config = GenerationConfig()
        rest = config.update(max_new_tokens=self.max_completion_length, eos_token_id=eos,
                             pad_token_id=tokenizer.pad_token_id, use_cache=True,
                             **{**self.sampling, **self.generation_kwargs})  # -> logits_processor, ...: not fields
        inner = base_model(model)
        was_training, model_config = model.training, inner.generation_config
        # eval(): generate() refuses the KV cache under gradient checkpointing in train mode.
        model.eval()
        inner.generation_config = config  # what generate() merges unset fields from, for this call only
        try:
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config, **rest)
        finally:
            inner.generation_config = model_config
            model.train(was_training)
        completion_ids = out[:, prompt_ids.shape[1] :]
        completion_mask, truncated = completion_mask_from_eos(completion_ids, eos)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
        return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated)
