"""Rollout: sample a group of completions per prompt from the live policy.

The trainer talks to generation through one call, `rollout(model, tokenizer, prompt_ids,
prompt_mask, num_generations) -> RolloutBatch` (the `Rollout` protocol), and two optional
abilities: a random state of its own that checkpoints keep (`ResumableRollout`), and saying
before the first call whether it returns the sampling log-probs (`ReportsLogprobs`). Every
engine here implements them:

    batch.py          RolloutBatch, prompt encoding (left padding), EOS masks
    hf_generate.py    HFGenerateRollout: plain batched HF `generate`, the reference
    engine.py         RolloutEngine: the default (one prefill per prompt shared by its group,
                      finished rows dropped, sampling log-probs returned)
    static_cache.py   the engine's pre-sized KV cache and CUDA-graph decode step (CUDA)
    vllm_backend.py   VLLMRollout: optional, `setup_reasoning_model(fast_inference=True)`

`make_rollout` turns `train(rollout=...)` into one of them.
"""

from __future__ import annotations

import warnings
from typing import Protocol, runtime_checkable

import torch

from ..attachments import attachments, base_model
from .batch import (RolloutBatch, check_rollout_batch, check_tokenizer, completion_mask_from_eos, decode_completions, encode_prompts,
                    eos_token_ids, prompt_texts)
from .engine import SUPPORTED_GENERATION_KWARGS, RolloutEngine, keeps_kv_cache
from .hf_generate import HFGenerateRollout

__all__ = ["ROLLOUT_KINDS", "HFGenerateRollout", "ReportsLogprobs", "ResumableRollout", "Rollout", "RolloutBatch", "RolloutEngine",
           "check_rollout_batch", "check_tokenizer", "completion_mask_from_eos", "decode_completions", "encode_prompts", "eos_token_ids",
           "engine_for", "make_rollout", "prompt_texts", "returns_logprobs", "rollout_state"]

ROLLOUT_KINDS = ("auto", "native", "hf", "vllm")


@runtime_checkable
class Rollout(Protocol):
    """A generation engine: `num_generations` completions for each prompt of a left-padded batch, by the live
    policy. Any function of this signature is one (`train(rollout=my_function)`)."""

    def __call__(self, model, tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 num_generations: int) -> RolloutBatch: ...


@runtime_checkable
class ResumableRollout(Rollout, Protocol):
    """An engine that samples from a random state of its own: checkpoints keep it, so that a resumed run draws
    the same completions as an unbroken one."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class ReportsLogprobs(Rollout, Protocol):
    """An engine that says before its first call whether it returns each sampled token's log-prob
    (`RolloutBatch.sampling_logprobs`) with its settings."""

    def returns_logprobs(self) -> bool: ...


def rollout_state(rollout: Rollout) -> dict | None:
    """What a checkpoint keeps of the engine: its random state, or None for an engine without one."""
    if not isinstance(rollout, ResumableRollout):
        return None
    _check_method(rollout, "state_dict", "dict")
    _check_method(rollout, "load_state_dict", "None", "state")
    return rollout.state_dict()


def returns_logprobs(rollout: Rollout) -> bool | None:
    """Whether the engine returns each sampled token's log-prob (`RolloutBatch.sampling_logprobs`) with its
    settings; None when it does not say (a user's function: known after its first call)."""
    if not isinstance(rollout, ReportsLogprobs):
        return None
    _check_method(rollout, "returns_logprobs", "bool")
    return rollout.returns_logprobs()


def _check_method(rollout, name: str, returns: str, *args: str) -> None:
    """The protocols are checked by name alone: `returns_logprobs = True` on a class passes them, and would fail
    later as "'bool' object is not callable". Named, with the method to write."""
    value = getattr(rollout, name)
    if not callable(value):
        raise TypeError(f"The rollout {type(rollout).__name__!r} has {name} = {value!r:.60}, not a method: grpo-nb "
                        f"calls rollout.{name}({', '.join(args)}). Make it one: def {name}(self{''.join(', ' + a for a in args)}) "
                        f"-> {returns}: ..., or drop the attribute.")


def uses_vllm(kind, model) -> bool:
    """Whether make_rollout(kind, model, ...) picks the vLLM backend."""
    return kind == "vllm" or (kind == "auto" and attachments(model).rollout is not None)


def engine_for(model, *, seed=None, **settings):
    """The engine evaluate(), play() and sample_and_score() generate with: grpo-nb's own, or HF generate for a model
    whose forward keeps no KV cache (RecurrentGemma), as make_rollout's "auto" picks; `settings` are the engines'
    common ones (max_completion_length, greedy, temperature)."""
    if keeps_kv_cache(model):
        return RolloutEngine(seed=seed, **settings)
    if seed is not None:
        torch.manual_seed(seed)  # generate() samples from torch's generator: seeded here as the engine seeds its own
    return HFGenerateRollout(**settings)


def _cpu_dtype_unused(config, why: str) -> None:
    warnings.warn(f"cpu_rollout_dtype={config.cpu_rollout_dtype!r} has no effect in this run: {why}.", stacklevel=4)


def make_rollout(kind, model, tokenizer, config):
    """The generation engine `train()` uses: a name from ROLLOUT_KINDS, or any rollout callable.

    "native": grpo-nb's `RolloutEngine` (one prefill per prompt shared across its group, finished
    rows dropped, sampling log-probs returned; static KV cache + CUDA graph on CUDA).
    "hf": plain batched HF `generate`, the reference. "vllm": the vLLM backend built by
    `setup_reasoning_model(fast_inference=True)`. "auto": vLLM when the model was set up with it,
    else native, else (for `generation_kwargs` only `generate` understands, or a model whose forward keeps no KV
    cache, as RecurrentGemma's) HF.
    """
    if callable(kind) and not isinstance(kind, str):
        return kind
    if kind not in ROLLOUT_KINDS:
        raise ValueError(f"rollout={kind!r} is not a rollout engine: pass one of {ROLLOUT_KINDS} or a callable "
                         f"(model, tokenizer, prompt_ids, prompt_mask, num_generations) -> RolloutBatch.")
    sampling = dict(max_completion_length=config.max_completion_length, temperature=config.temperature,
                    top_p=config.top_p, top_k=config.top_k, min_p=config.min_p,
                    repetition_penalty=config.repetition_penalty)
    extra = dict(config.generation_kwargs or {})
    if config.cpu_rollout_dtype and uses_vllm(kind, model):
        _cpu_dtype_unused(config, f"rollout={kind!r} generates with its own arithmetic; it applies to the native engine")
    if uses_vllm(kind, model):
        vllm_rollout = attachments(model).rollout
        if extra:
            raise ValueError(f"generation_kwargs {sorted(extra)} are HF generate() arguments, which the vLLM rollout "
                             f"does not take: drop them, or use rollout='hf'.")
        if vllm_rollout is None:
            from .vllm_backend import VLLMRollout, require_vllm

            require_vllm()
            return VLLMRollout(model, tokenizer, seed=config.seed, **sampling)
        return vllm_rollout.configure(seed=config.seed, **sampling)

    cached = keeps_kv_cache(model)
    if kind == "native" and not cached:
        raise ValueError(f"rollout='native' decodes with a KV cache, which this model ({type(base_model(model)).__name__}"
                         f") does not take (a recurrent / state-space model keeps its state on its modules): use "
                         f"rollout='auto' or 'hf' (HF generate handles it).")
    if kind == "hf" or (kind == "auto" and (set(extra) - SUPPORTED_GENERATION_KWARGS or not cached)):
        if config.cpu_rollout_dtype:
            _cpu_dtype_unused(config, "this run generates with HF generate (rollout='auto' picked it), not the "
                                      "native engine it applies to" if kind == "auto" else
                                      "rollout='hf' generates with its own arithmetic; it applies to the native engine")
        return HFGenerateRollout(generation_kwargs=extra, **sampling)
    # With num_iterations > 1 (and no correction) the engine's log-probs become the old policy's in the ratio,
    # which must be 1 on the first pass: they are computed with the training forward's exact LoRA arithmetic.
    exact = config.num_iterations > 1 and not config.rollout_importance_sampling_correction
    if config.cpu_rollout_dtype:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if exact:
            _cpu_dtype_unused(config, f"with num_iterations={config.num_iterations} and no rollout correction the "
                                      f"engine's log-probs become the old policy's, so it keeps the training "
                                      f"forward's exact arithmetic; set rollout_importance_sampling_correction=True "
                                      f"to use it")
        elif device.type != "cpu":
            _cpu_dtype_unused(config, f"the model is on {device.type}, and it applies to CPU rollouts")
        elif not config.rollout_importance_sampling_correction:
            warnings.warn(f"cpu_rollout_dtype={config.cpu_rollout_dtype!r} samples from bf16-rounded weights while "
                          f"the update scores the model's own: set rollout_importance_sampling_correction=True so the "
                          f"loss weighs each token by how much likelier the trained policy finds it (as TRL does for "
                          f"vLLM).", stacklevel=3)
    return RolloutEngine(seed=config.seed, generation_kwargs=extra, max_rows=config.rollout_max_rows,
                         exact_adapters=exact, cpu_dtype=config.cpu_rollout_dtype, **sampling)
