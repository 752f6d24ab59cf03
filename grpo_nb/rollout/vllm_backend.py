"""Optional vLLM rollout backend: the `Rollout` seam served by a `vllm.LLM` engine.

NOT YET RUN ON REAL vLLM: vLLM cannot be installed on the machines this project is developed
on, so this is tested against the in-process stand-in `tests/fake_vllm.py`. Both are checked
against vLLM's real API as recorded from its wheel (`benchmarks/vllm_api.py` parses the
source with `ast` into `benchmarks/results/vllm_api.json`, now vLLM 0.33.0;
`tests/test_vllm_api.py` fails when a call here or the stand-in drifts from that record).

The price of the backend: vLLM holds its OWN copy of the base weights (loaded from the
model's path, the one `from_pretrained` read), next to the training copy. The LoRA adapter
is synced, not merged: before every rollout the live adapter is written with peft's
`save_pretrained` and handed to vLLM as a `LoRARequest` under a NEW integer id, so vLLM
loads it afresh instead of serving a cached, stale adapter. Between rollouts the engine
sleeps at level 1 (weights offloaded to CPU RAM, KV cache dropped), so training gets the GPU
memory back. Full fine-tuning would need the full weights copied into vLLM each step and is
not implemented (use rollout="native").

vLLM API facts this relies on (vLLM 0.10.1 - 0.33):
  * `LLM(model=, enable_lora=True, max_lora_rank=, gpu_memory_utilization=, enable_sleep_mode=True,
    max_model_len=, dtype=, seed=, logprobs_mode=)` (all but model keyword-only; the engine ones
    go on to `EngineArgs`); `logprobs_mode` exists from 0.10.1 (PR #21398), default
    "raw_logprobs" = log_softmax of the logits before ANY processing (penalties, temperature,
    top-k/top-p/min-p); "processed_logprobs" = after all of them. `max_lora_rank` must be one of
    1, 8, 16, 32, 64, 128, 256, 320, 512. `quantization="bitsandbytes"` (a 4-bit base) exists
    only before vLLM 0.28, which removed bitsandbytes.
  * `LLM.generate([{"prompt_token_ids": ids}, ...], sampling_params=SamplingParams(n=G, ...),
    lora_request=LoRARequest(lora_name=, lora_int_id=, lora_path=), use_tqdm=False)` (use_tqdm and
    lora_request keyword-only) returns one `RequestOutput` per prompt, in prompt order, whose
    `.outputs` are G `CompletionOutput`s with `.index`, `.token_ids`, `.finish_reason` ("stop" /
    "length"), `.stop_reason` and, with `SamplingParams(logprobs=0)`, `.logprobs`: one
    {token_id: Logprob(logprob=...)} dict per generated token holding (at least) the sampled token.
  * `SamplingParams`: top_k=-1 disables top-k in every version (newer ones prefer 0), min_p=0.0
    disables min-p; temperature must be in [0, 2]; a request seed with n > 1 seeds the children
    seed + index. `LoRARequest` ids must be >= 1.
  * `LLM.sleep(level=1)` / `LLM.wake_up()` need `enable_sleep_mode=True` (CUDA only). Level 0
    only pauses scheduling; level 2 also drops the weights (they would need reloading).

`sampling_logprobs` must be log_softmax(logits / T) of the sampled token, unfiltered. vLLM can
give that only when (a) its mode is "raw_logprobs" and T == 1, or (b) its mode is
"processed_logprobs" and no filter or penalty is active (top_p 1, top_k off, min_p off,
repetition_penalty 1). In every other case no logprobs are requested and the batch carries
`sampling_logprobs=None`, so the trainer recomputes them with one forward pass.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import sys
import tempfile

import torch

from ..atomic_files import expand, write_into
from ..attachments import attachments, base_model
from .batch import RolloutBatch, completion_mask_from_eos, eos_token_ids

INSTALL_HINT = "pip install 'grpo-nb[vllm]'"
# vLLM's LoRAConfig accepts only these max_lora_rank values.
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_available() -> bool:
    """Whether `import vllm` can work (found, not imported: importing vLLM is slow)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ValueError, ImportError, AttributeError):  # a sys.modules entry without a spec
        return sys.modules.get("vllm") is not None


def require_vllm() -> None:
    """Raise a clear ImportError when vLLM is not importable."""
    if not vllm_available():
        raise ImportError(
            "The vLLM rollout backend (fast_inference=True / rollout='vllm') needs vLLM, which is not "
            f"installed. Install it with\n    {INSTALL_HINT}\n(CUDA only), or use rollout='native'."
        )


def require_lora(model) -> None:
    """vLLM gets the LoRA adapter each step; full fine-tuning would need a weight sync."""
    if not hasattr(model, "peft_config") or not hasattr(model, "save_pretrained"):
        raise NotImplementedError(
            "The vLLM rollout backend syncs only LoRA adapters into vLLM; full fine-tuning (lora_rank=None) "
            "would need every weight copied into the engine each step, which is not implemented yet. "
            "Use rollout='native' (HF generate on the training weights), or train LoRA (set lora_rank)."
        )


def base_model_path(model) -> str:
    """Where vLLM loads its copy of the base weights from: the path `from_pretrained` read."""
    base = base_model(model)
    path = getattr(base, "name_or_path", None) or getattr(base.config, "_name_or_path", None)
    if not path:
        peft_config = getattr(model, "peft_config", {}).get("default")
        path = getattr(peft_config, "base_model_name_or_path", None)
    if not path:
        raise ValueError("The model has no name_or_path, so vLLM cannot load its base weights: load it from a "
                         "Hub id or a saved folder (save_pretrained) first.")
    return str(path)


def _lora_rank(model) -> int:
    cfg = model.peft_config["default"]
    ranks = [cfg.r, *getattr(cfg, "rank_pattern", {}).values()]
    rank = max(ranks)
    return next((r for r in _VLLM_LORA_RANKS if r >= rank), rank)


def _has_bitsandbytes(vllm) -> bool:
    """vLLM 0.28 removed quantization="bitsandbytes"; an unparsable version is left to vLLM to judge."""
    m = re.match(r"(\d+)\.(\d+)", str(getattr(vllm, "__version__", "")))
    return m is None or (int(m[1]), int(m[2])) < (0, 28)


def check_4bit_base(vllm) -> None:
    """A 4-bit (bitsandbytes) base needs a vLLM that still has bitsandbytes; setup checks before loading."""
    if not _has_bitsandbytes(vllm):
        raise NotImplementedError(
            f"vLLM {vllm.__version__} has no bitsandbytes quantization (removed in vLLM 0.28), so it cannot "
            "hold the 4-bit base this model trains on (load_in_4bit=True). Use load_in_4bit=False, or "
            "rollout='native' (fast_inference=False), or vllm<0.28.")


def build_llm(model, *, gpu_memory_utilization: float = 0.5, max_model_len: int | None = None,
              logprobs_mode: str = "raw_logprobs", seed: int | None = None, **llm_kwargs):
    """A `vllm.LLM` on the base weights of peft `model`, with LoRA and sleep mode on.

    Returns (llm, logprobs_mode actually in force).
    """
    require_vllm()
    require_lora(model)
    import vllm

    base = base_model(model)
    kwargs = dict(
        model=base_model_path(model),
        enable_lora=True,
        max_lora_rank=_lora_rank(model),
        gpu_memory_utilization=gpu_memory_utilization,
        enable_sleep_mode=True,
        max_model_len=max_model_len or attachments(base).max_seq_length,
        dtype={torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}.get(
            getattr(base, "dtype", None), "auto"),
    )
    if getattr(base, "is_loaded_in_4bit", False):
        # The training base is NF4; vLLM quantizes its own copy in flight the same way (before 0.28).
        check_4bit_base(vllm)
        kwargs["quantization"] = "bitsandbytes"
    if seed is not None:
        kwargs["seed"] = seed
    kwargs.update(llm_kwargs)
    try:
        llm = vllm.LLM(**kwargs, logprobs_mode=logprobs_mode)
    except TypeError as err:  # vLLM < 0.10.1 has no logprobs_mode; V1 then returns raw logprobs
        if "logprobs_mode" not in str(err):
            raise
        llm, logprobs_mode = vllm.LLM(**kwargs), "raw_logprobs"
    return llm, logprobs_mode


class VLLMRollout:
    """The rollout seam on a vLLM engine; LoRA adapter re-synced before every call.

    Knobs mirror `HFGenerateRollout`. `configure(**knobs)` changes them later (the engine is
    built by `setup_reasoning_model(fast_inference=True)` before the run's sampling settings
    are known). `llm` injects a ready engine (then `logprobs_mode` must say what it returns).
    """

    def __init__(self, model, tokenizer=None, *, max_completion_length: int | None = None, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int | None = 0, min_p: float | None = None,
                 repetition_penalty: float = 1.0, seed: int | None = None, gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, llm=None, adapter_dir: str | os.PathLike | None = None,
                 logprobs_mode: str = "raw_logprobs"):
        require_lora(model)  # before anything expensive
        if llm is None:
            llm, logprobs_mode = build_llm(model, gpu_memory_utilization=gpu_memory_utilization,
                                           max_model_len=max_model_len, logprobs_mode=logprobs_mode, seed=seed)
        self.llm = llm
        self.logprobs_mode = logprobs_mode
        self.max_completion_length = max_completion_length
        self.temperature, self.top_p, self.top_k, self.min_p = temperature, top_p, top_k, min_p
        self.repetition_penalty, self.seed = repetition_penalty, seed
        if adapter_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="grpo_nb-vllm-lora-")
            adapter_dir = self._tmp.name
        self.adapter_dir = str(expand(adapter_dir))
        self._lora_ids = itertools.count(1)
        self._calls = 0
        self.lora_int_id = None
        self.asleep = False
        self.sleep()  # the engine allocated its weights and KV cache: hand the memory to training

    def configure(self, **knobs) -> VLLMRollout:
        """Set sampling knobs (max_completion_length, temperature, top_p, top_k, min_p, ...)."""
        allowed = {"max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"}
        unknown = set(knobs) - allowed
        if unknown:
            raise TypeError(f"VLLMRollout.configure() got unknown knobs {sorted(unknown)}; allowed: {sorted(allowed)}")
        for name, value in knobs.items():
            setattr(self, name, value)
        return self

    # -- engine memory -------------------------------------------------------------------
    def sleep(self) -> None:
        if not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # -- sync + sampling -----------------------------------------------------------------
    def sync_adapter(self, model):
        """Write the live adapter and return a LoRARequest under a new id (vLLM caches by id)."""
        from vllm.lora.request import LoRARequest

        # Into a private folder, then renamed in: a link planted in adapter_dir is replaced, never written through.
        write_into(self.adapter_dir, model.save_pretrained)
        self.lora_int_id = next(self._lora_ids)
        return LoRARequest(lora_name=f"grpo_nb-{self.lora_int_id}", lora_int_id=self.lora_int_id,
                           lora_path=self.adapter_dir)

    def returns_logprobs(self) -> bool:
        """Whether vLLM's returned logprobs equal log_softmax(logits / T), unfiltered (see module doc): only then
        are they returned as the sampling log-probs."""
        if self.logprobs_mode == "raw_logprobs":
            return self.temperature == 1.0
        if self.logprobs_mode == "processed_logprobs":
            return (self.temperature > 0 and self.top_p in (None, 1.0) and (self.top_k or 0) <= 0
                    and not self.min_p and self.repetition_penalty in (None, 1.0))
        return False

    def sampling_params(self, num_generations: int, eos: list[int]):
        from vllm import SamplingParams

        seed = None if self.seed is None else self.seed + 1_000_003 * self._calls  # fresh samples per step
        return SamplingParams(
            n=num_generations,
            temperature=self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k if self.top_k and self.top_k > 0 else -1,  # -1: disabled in every vLLM version
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=self.max_completion_length,
            seed=seed,
            stop_token_ids=list(eos),
            logprobs=0 if self.returns_logprobs() else None,  # 0: just the sampled token's
            detokenize=False,
        )

    @torch.no_grad()
    def __call__(self, model, tokenizer, prompt_ids, prompt_mask, num_generations: int) -> RolloutBatch:
        if self.max_completion_length is None:
            raise ValueError("VLLMRollout needs max_completion_length: pass it or call .configure(max_completion_length=...)")
        eos = eos_token_ids(model, tokenizer)
        prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        params = self.sampling_params(num_generations, eos)
        lora = self.sync_adapter(model)
        self.wake_up()
        try:
            outputs = self.llm.generate(prompts, sampling_params=params, lora_request=lora, use_tqdm=False)
        finally:
            self.sleep()
        self._calls += 1
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")

        rows, row_logprobs = [], []
        want_logprobs = params.logprobs is not None
        for request in outputs:
            completions = sorted(request.outputs, key=lambda c: getattr(c, "index", 0))
            if len(completions) != num_generations:
                raise RuntimeError(f"vLLM returned {len(completions)} completions for n={num_generations}")
            for c in completions:
                ids = list(c.token_ids)
                if c.finish_reason == "stop" and not any(t in eos for t in ids):
                    # Stopped on a stop token vLLM left out of token_ids: put the EOS back so the
                    # mask/reward see a finished turn. It has no logprob, so none are returned.
                    stop = c.stop_reason if isinstance(c.stop_reason, int) else eos[0]
                    ids.append(stop)
                    want_logprobs = False
                rows.append(ids)
                if want_logprobs:
                    if c.logprobs is None or len(c.logprobs) < len(c.token_ids):
                        want_logprobs = False
                    else:
                        row_logprobs.append([step[t].logprob for t, step in zip(c.token_ids, c.logprobs)])

        device = prompt_ids.device
        pad = tokenizer.pad_token_id
        width = max(1, max(len(r) for r in rows))
        completion_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        for i, r in enumerate(rows):
            completion_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        completion_mask, truncated = completion_mask_from_eos(completion_ids, eos)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
        sampling_logprobs = None
        if want_logprobs:
            sampling_logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
            for i, lp in enumerate(row_logprobs):
                sampling_logprobs[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
            sampling_logprobs = (sampling_logprobs * completion_mask).to(device)
        return RolloutBatch(
            prompt_ids.repeat_interleave(num_generations, dim=0),
            prompt_mask.repeat_interleave(num_generations, dim=0),
            completion_ids.to(device),
            completion_mask.to(device),
            truncated.to(device),
            sampling_logprobs,
        )
