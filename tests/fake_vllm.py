"""An in-process stand-in for the slice of vLLM's API that `grpo_nb.rollout.vllm_backend` uses.

Not vLLM: a token-by-token sampler over a real (tiny) HF model, loaded from the path given to
`LLM(model=...)`, with the LoRA adapter loaded by peft from each `LoRARequest`'s path, cached
by its int id like vLLM does (so a reused id would serve a stale adapter). It records every
call, refuses to generate while asleep, and returns vLLM-shaped outputs (`RequestOutput.outputs[i]`
with `.index`, `.token_ids`, `.logprobs` [{token_id: Logprob}], `.finish_reason`, `.stop_reason`).
`install(monkeypatch)` puts it in sys.modules as vllm and the submodules in `EXPORTS`.

Signatures, field names/order, value sets and SamplingParams' checks follow the real vLLM
recorded in benchmarks/results/vllm_api.json (written by benchmarks/vllm_api.py from vLLM's
wheel); tests/test_vllm_api.py fails when this stand-in, or the backend's calls, drift from it.
"""

from __future__ import annotations

import copy
import importlib.machinery
import math
import sys
import types
from dataclasses import dataclass

import torch


# vLLM's value sets, as in the vLLM version recorded in benchmarks/results/vllm_api.json
# (tests/test_vllm_api.py holds them to that record).
VERSION = "0.33.0"
LOGPROBS_MODES = ("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs")
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# No "bitsandbytes": vLLM dropped it in 0.28.
QUANTIZATION_METHODS = (
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8",
    "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors",
    "experts_int8", "quark", "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8", "online",
    "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8")
SLEEP_LEVELS = (0, 1, 2)  # 0: pause scheduling; 1: weights to CPU, KV cache dropped; 2: weights and KV cache dropped
WAKE_UP_TAGS = ("weights", "kv_cache", "scheduling")
PAUSE_MODES = ("abort", "wait", "keep")
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
_SAMPLING_EPS = 1e-5  # temperature below it means greedy
_MAX_TEMP = 1e-2  # a positive temperature below it is raised to it


class VLLMValidationError(Exception):
    """Like vLLM's (a VLLMClientError, which is not a ValueError)."""


@dataclass(kw_only=True)
class SamplingParams:
    """The fields grpo_nb passes, in vLLM's order; keyword-only (vLLM's msgspec struct also takes them
    positionally, in an order this subset cannot keep), with vLLM's defaults and checks."""

    n: int = 1
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # -1: the whole vocabulary; 0: just the sampled token
    detokenize: bool = True

    def __post_init__(self):  # vLLM's __post_init__, _verify_args and _verify_greedy_sampling, on these fields
        if 0 < self.temperature < _MAX_TEMP:
            self.temperature = _MAX_TEMP
        if self.seed == -1:
            self.seed = None
        self.stop_token_ids = [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        if self.logprobs is True:
            self.logprobs = 1
        checks = [
            (not isinstance(self.n, int) or self.n < 1, f"n must be at least 1, got {self.n}."),
            (not math.isfinite(self.repetition_penalty),
             f"repetition_penalty must be a finite number, got {self.repetition_penalty}."),
            (self.repetition_penalty <= 0.0,
             f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."),
            (not math.isfinite(self.temperature), f"temperature must be a finite number, got {self.temperature}."),
            (self.temperature < 0.0, f"temperature must be non-negative, got {self.temperature}."),
            (self.temperature > 2.0, f"temperature must be in [0, 2], got {self.temperature}."),
            (not 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}."),
            (self.top_k < -1, f"top_k must be 0 (disable), or at least 1, got {self.top_k}."),
            (not isinstance(self.top_k, int), f"top_k must be an integer, got {type(self.top_k).__name__}"),
            (not 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}."),
            (self.max_tokens is not None and self.max_tokens < 1,
             f"max_tokens must be at least 1, got {self.max_tokens}."),
            (self.min_tokens < 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."),
            (self.max_tokens is not None and self.min_tokens > self.max_tokens,
             f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."),
            (self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0,
             f"logprobs must be non-negative or -1, got {self.logprobs}."),
            (not all(isinstance(t, int) for t in self.stop_token_ids),
             f"stop_token_ids must contain only integers, got {self.stop_token_ids}."),
        ]
        for failed, message in checks:
            if failed:
                raise VLLMValidationError(message)
        if self.temperature < _SAMPLING_EPS:  # greedy
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {self.n}.")


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False  # True: reload even if this id is cached

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        assert self.lora_path, "lora_path cannot be empty"


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # vLLM's fields, in vLLM's order
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    routed_experts: object = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: LoRARequest | None = None
    sampling_mask: object = None
    spec_decode_metrics: object = None
    weight_versions: list | None = None


@dataclass
class RequestOutput:  # the first parameters of vLLM's RequestOutput.__init__, in its order
    request_id: str
    prompt: str | None
    prompt_token_ids: list | None
    prompt_logprobs: list | None
    outputs: list
    finished: bool
    metrics: object = None
    lora_request: LoRARequest | None = None


class LLM:
    instances: list = []

    def __init__(self, model, *, seed: int = 0, dtype: str = "auto", quantization: str | None = None, **kwargs):
        """vLLM's LLM(model, *, ...); the engine arguments it forwards to EngineArgs arrive in **kwargs."""
        from transformers import AutoModelForCausalLM

        logprobs_mode = kwargs.setdefault("logprobs_mode", "raw_logprobs")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {dtype!r}")
        if quantization is not None and quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"Unknown quantization method: {quantization}. "
                             f"Must be one of {list(QUANTIZATION_METHODS)}.")
        if kwargs.get("enable_lora") and kwargs.get("max_lora_rank", 16) not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {MAX_LORA_RANKS}, got {kwargs['max_lora_rank']}")
        self.kwargs = dict(model=model, seed=seed, dtype=dtype, quantization=quantization, **kwargs)
        self.logprobs_mode = logprobs_mode
        self.base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.calls: list = []  # ("init"|"sleep"|"wake_up"|"generate"|"load_lora", details)
        self.generate_calls: list = []
        self.sleeping: set = set()  # vLLM's sleeping tags: "scheduling" (level 0) or "weights", "kv_cache"
        self.weights_discarded = False
        self._loras: dict = {}
        self.calls.append(("init", self.kwargs))
        LLM.instances.append(self)

    @property
    def asleep(self) -> bool:
        return bool(self.sleeping)

    def sleep(self, level: int = 1, mode: str = "abort"):
        assert level in SLEEP_LEVELS and mode in PAUSE_MODES, (level, mode)
        if level >= 1:
            assert self.kwargs.get("enable_sleep_mode"), "sleep mode needs enable_sleep_mode=True"
        self.calls.append(("sleep", level))
        if level == 0:
            self.sleeping |= {"scheduling"}
        else:  # level 1 keeps a CPU copy of the weights; level 2 drops them (reload before generating)
            self.sleeping |= {"weights", "kv_cache"}
            self.weights_discarded |= level == 2

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake all (tags=None) or some memory; returns whether the engine is fully awake, like vLLM."""
        assert tags is None or set(tags) <= set(WAKE_UP_TAGS), tags
        self.calls.append(("wake_up", tags))
        if tags is None:
            self.sleeping.clear()
        elif set(tags) - {"scheduling"} <= self.sleeping:
            self.sleeping -= set(tags)
            if not self.sleeping & {"weights", "kv_cache"}:
                self.sleeping.discard("scheduling")  # vLLM resumes scheduling once all memory is back
        return not self.sleeping

    def _model_for(self, lora_request):
        if lora_request is None:
            return self.base
        assert self.kwargs.get("enable_lora"), "LoRA requests need enable_lora=True"
        if lora_request.lora_int_id not in self._loras or lora_request.load_inplace:  # cached by id, like vLLM
            from peft import PeftModel

            self.calls.append(("load_lora", lora_request.lora_int_id))
            self._loras[lora_request.lora_int_id] = PeftModel.from_pretrained(
                copy.deepcopy(self.base), lora_request.lora_path).eval()
        return self._loras[lora_request.lora_int_id]

    @staticmethod
    def _process(logits, sp):
        z = logits / max(sp.temperature, _SAMPLING_EPS)
        if sp.top_k > 0:
            kth = z.topk(min(sp.top_k, z.numel())).values[-1]
            z = z.masked_fill(z < kth, float("-inf"))
        if sp.min_p > 0:
            p = z.softmax(-1)
            z = z.masked_fill(p < sp.min_p * p.max(), float("-inf"))
        if sp.top_p < 1.0:
            p, order = z.softmax(-1).sort(descending=True)
            drop = (p.cumsum(-1) - p) >= sp.top_p
            z[order[drop]] = float("-inf")
        return z

    @torch.no_grad()
    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None,
                 tokenization_kwargs=None, mm_processor_kwargs=None):
        if self.asleep:  # vLLM would queue the requests and never run them (or fail on freed memory)
            raise RuntimeError("generate() on a sleeping engine: call wake_up() first")
        if self.weights_discarded:  # vLLM would run on garbage weights
            raise RuntimeError("generate() after sleep(level=2) without reloading the weights")
        sp = sampling_params or SamplingParams()
        self.calls.append(("generate", lora_request.lora_int_id if lora_request else None))
        self.generate_calls.append(dict(prompts=prompts, sampling_params=sp, lora_request=lora_request))
        return self._sample(prompts, sp, lora_request)

    def replay(self, k: int, lora_request=...):
        """Re-run recorded generate call k (seeded, so identically), optionally with another adapter; not recorded."""
        call = self.generate_calls[k]
        lora = call["lora_request"] if lora_request is ... else lora_request
        return self._sample(call["prompts"], call["sampling_params"], lora)

    @torch.no_grad()
    def _sample(self, prompts, sp, lora_request):
        model = self._model_for(lora_request)
        eos = getattr(self.base.generation_config, "eos_token_id", None)
        stops = set(sp.stop_token_ids or []) | ({eos} if isinstance(eos, int) else set(eos or []))
        results = []
        for p_idx, prompt in enumerate(prompts):
            request = RequestOutput(str(p_idx), None, list(prompt["prompt_token_ids"]), None, [], True,
                                    lora_request=lora_request)
            for index in range(sp.n):
                gen = torch.Generator().manual_seed(sp.seed + index) if sp.seed is not None else None
                ids = list(prompt["prompt_token_ids"])
                out, lps, finish, stop_reason = [], [], "length", None
                for _ in range(sp.max_tokens):
                    logits = model(torch.tensor([ids])).logits[0, -1].float()
                    processed = self._process(logits, sp)
                    if sp.temperature < _SAMPLING_EPS:  # greedy
                        tok = int(logits.argmax())
                    else:
                        tok = int(torch.multinomial(processed.softmax(-1), 1, generator=gen))
                    source = logits if self.logprobs_mode.startswith("raw") else processed
                    lps.append({tok: Logprob(float(source.log_softmax(-1)[tok]), rank=1)})
                    ids.append(tok)
                    out.append(tok)
                    if tok in stops:
                        finish, stop_reason = "stop", (tok if tok != eos else None)
                        break
                request.outputs.append(CompletionOutput(
                    index, "", out, None, lps if sp.logprobs is not None else None, finish_reason=finish,
                    stop_reason=stop_reason, lora_request=lora_request))
            results.append(request)
        return results


EXPORTS = {  # module -> the names the stand-in gives it (all exist there in vLLM too)
    "vllm": {"__version__": VERSION, "LLM": LLM, "SamplingParams": SamplingParams, "RequestOutput": RequestOutput,
             "CompletionOutput": CompletionOutput},
    "vllm.lora": {},
    "vllm.lora.request": {"LoRARequest": LoRARequest},
    "vllm.sampling_params": {"SamplingParams": SamplingParams},
    "vllm.outputs": {"RequestOutput": RequestOutput, "CompletionOutput": CompletionOutput},
    "vllm.logprobs": {"Logprob": Logprob},
}


def install(monkeypatch):
    """Make `import vllm` (and the submodules grpo_nb uses) resolve to this stand-in."""
    LLM.instances = []
    modules = {}
    for name, attrs in EXPORTS.items():
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        mod.__dict__.update(attrs)
        modules[name] = mod
    for name, mod in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, mod)
        monkeypatch.setitem(sys.modules, name, mod)
    return modules["vllm"]
