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
from .engine import SUPPORTED_GENERATION_KWARGS, RolloutEngine, cpu_has_bf16, keeps_kv_cache
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


# The fp32 weights (of the layers whose rollout copies would be bf16) below which cpu_rollout_dtype="auto" stays in
# fp32: a decode step of a model this small costs its ops' dispatch, not its weights' bytes, and bf16 copies would
# only add casts (the embedded default has ~540 MB).
AUTO_BF16_MIN_BYTES = 64 * 2**20


# what `rollout_precision` decides where the user left it to grpo-nb ("auto", None)
PRECISION_SETTINGS = ("cpu_rollout_dtype", "rollout_importance_sampling_correction", "rollout_importance_sampling_mode")


def rollout_precision(config, model, kind, rollout_func=None):
    """`config` with cpu_rollout_dtype="auto" and rollout_importance_sampling_correction=None (the defaults) made
    concrete for this run, as train() runs it.

    "auto" takes bf16 rollout copies where they pay: grpo-nb's native engine merging on the CPU (no user
    rollout_func: its log-probs are its own) for an fp32 model whose adapted layers and output head hold at least
    AUTO_BF16_MIN_BYTES, on a CPU that multiplies bf16 natively (AVX512-BF16 / AMX), with a correction this config's
    loss takes; else the model's own dtype. The correction left at None comes on exactly where bf16 copies are
    used, and its mode left at None is then token-level truncation (`grpo_nb.config.correction_mode`), else TRL's
    sequence-level mask. A value the user set stays as set; rollout_importance_sampling_correction=False keeps "auto"
    in the model's dtype (nothing would then weigh the bf16 sampler's tokens)."""
    dtype, correct = config.cpu_rollout_dtype, config.rollout_importance_sampling_correction
    mode = config.rollout_importance_sampling_mode
    if dtype != "auto" and correct is not None and mode is not None:
        return config  # nothing left to decide (train() decided it; make_rollout asks again)
    copies = _merges_on_cpu(config, model, kind or "auto", rollout_func)
    if dtype == "auto":
        dtype = "bfloat16" if correct is not False and copies and _bf16_pays(config, model) else None
    if correct is None:
        correct = dtype == "bfloat16" and copies
    if mode is None:
        mode = "token_truncate" if dtype == "bfloat16" and copies else "sequence_mask"
    return config.replace(cpu_rollout_dtype=dtype, rollout_importance_sampling_correction=correct,
                          rollout_importance_sampling_mode=mode)


def _merges_on_cpu(config, model, kind, rollout_func) -> bool:
    """Whether this run's rollouts are grpo-nb's engine multiplying by merged copies on the CPU (where
    cpu_rollout_dtype applies)."""
    if rollout_func is not None or not isinstance(kind, str) or kind not in ("auto", "native"):
        return False
    if uses_vllm(kind, model) or _picks_hf_generate(kind, model, config) or not keeps_kv_cache(model):
        return False
    from .. import lora

    return lora.MERGE_ON_CPU and not _exact_adapters(config) and all(p.device.type == "cpu" for p in model.parameters())


def _picks_hf_generate(kind, model, config) -> bool:
    """Whether make_rollout generates with HF generate: asked for, or "auto" with arguments only generate() takes or a
    model whose forward keeps no KV cache."""
    return kind == "hf" or (kind == "auto" and bool(set(config.generation_kwargs or {}) - SUPPORTED_GENERATION_KWARGS
                                                    or not keeps_kv_cache(model)))


def _exact_adapters(config) -> bool:
    """With num_iterations > 1 and no correction the engine's log-probs become the old policy's in the ratio, which
    must be 1 on the first pass: they are computed with the training forward's exact LoRA arithmetic. (A correction
    left at None may still come on: not exact.)"""
    return config.num_iterations > 1 and config.rollout_importance_sampling_correction is False


def _bf16_pays(config, model) -> bool:
    from peft.tuners.lora import LoraLayer

    # what a decode step would read in bf16: the adapted layers' merged copies and the output head (a plain
    # nn.Linear's own weight stays as it is)
    weights = [m.base_layer.weight for m in model.modules() if isinstance(m, LoraLayer)
               and isinstance(getattr(m, "base_layer", None), torch.nn.Linear)]
    head = base_model(model).get_output_embeddings() if hasattr(base_model(model), "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear):
        weights.append(head.weight)
    if not (weights and all(w.dtype == torch.float32 for w in weights)
            and sum(w.numel() * 4 for w in weights) >= AUTO_BF16_MIN_BYTES and cpu_has_bf16()):
        return False
    try:  # a loss that refuses the correction keeps the model's dtype
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config.replace(cpu_rollout_dtype="bfloat16", rollout_importance_sampling_correction=True)
    except ValueError:
        return False
    return True


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
    config = rollout_precision(config, model, kind)  # train() passes it decided; other callers may not
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

    if kind == "native" and not keeps_kv_cache(model):
        raise ValueError(f"rollout='native' decodes with a KV cache, which this model ({type(base_model(model)).__name__}"
                         f") does not take (a recurrent / state-space model keeps its state on its modules): use "
                         f"rollout='auto' or 'hf' (HF generate handles it).")
    if _picks_hf_generate(kind, model, config):
        if config.cpu_rollout_dtype:
            _cpu_dtype_unused(config, "this run generates with HF generate (rollout='auto' picked it), not the "
                                      "native engine it applies to" if kind == "auto" else
                                      "rollout='hf' generates with its own arithmetic; it applies to the native engine")
        return HFGenerateRollout(generation_kwargs=extra, **sampling)
    exact = _exact_adapters(config)
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
