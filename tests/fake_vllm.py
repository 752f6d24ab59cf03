"""An in-process stand-in for the slice of vLLM's API that `grpo_nb.rollout.vllm_backend` uses.

Not vLLM: a token-by-token sampler over a real (tiny) HF model, loaded from the path given to
`LLM(model=...)`, with the LoRA adapter loaded by peft from each `LoRARequest`'s path, cached
by its int id like vLLM does (so a reused id would serve a stale adapter). It records every
call, refuses to generate while asleep, and returns vLLM-shaped outputs (`RequestOutput.outputs[i]`
with `.index`, `.token_ids`, `.logprobs` [{token_id: Logprob}], `.finish_reason`, `.stop_reason`).
`install(monkeypatch)` puts it in sys.modules as vllm, vllm.lora.request and vllm.sampling_params.
"""

from __future__ import annotations

import copy
import importlib.machinery
import sys
import types
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: list | None = None
    logprobs: int | None = None
    detokenize: bool = True

    def __post_init__(self):  # the checks vLLM's _verify_args makes on these fields
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 < self.top_p <= 1.0 or not 0.0 <= self.min_p <= 1.0 or self.n < 1:
            raise ValueError("invalid sampling params")


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: list = field(default_factory=list)


class LLM:
    instances: list = []

    def __init__(self, model, *, logprobs_mode: str = "raw_logprobs", **kwargs):
        from transformers import AutoModelForCausalLM

        self.kwargs = dict(model=model, logprobs_mode=logprobs_mode, **kwargs)
        self.logprobs_mode = logprobs_mode
        self.base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.calls: list = []  # ("init"|"sleep"|"wake_up"|"generate"|"load_lora", details)
        self.generate_calls: list = []
        self.asleep = False
        self._loras: dict = {}
        self.calls.append(("init", self.kwargs))
        LLM.instances.append(self)

    def sleep(self, level: int = 1):
        assert self.kwargs.get("enable_sleep_mode"), "sleep mode needs enable_sleep_mode=True"
        self.calls.append(("sleep", level))
        self.asleep = True

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        self.asleep = False

    def _model_for(self, lora_request):
        if lora_request is None:
            return self.base
        assert self.kwargs.get("enable_lora"), "LoRA requests need enable_lora=True"
        if lora_request.lora_int_id not in self._loras:  # cached by id, like vLLM
            from peft import PeftModel

            self.calls.append(("load_lora", lora_request.lora_int_id))
            self._loras[lora_request.lora_int_id] = PeftModel.from_pretrained(
                copy.deepcopy(self.base), lora_request.lora_path).eval()
        return self._loras[lora_request.lora_int_id]

    @staticmethod
    def _process(logits, sp):
        z = logits / sp.temperature
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
    def generate(self, prompts, sampling_params=None, lora_request=None, use_tqdm=True):
        if self.asleep:
            raise RuntimeError("generate() on a sleeping engine: call wake_up() first")
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
            request = RequestOutput(str(p_idx), list(prompt["prompt_token_ids"]))
            for index in range(sp.n):
                gen = torch.Generator().manual_seed(sp.seed + index) if sp.seed is not None else None
                ids = list(prompt["prompt_token_ids"])
                out, lps, finish, stop_reason = [], [], "length", None
                for _ in range(sp.max_tokens):
                    logits = model(torch.tensor([ids])).logits[0, -1].float()
                    processed = self._process(logits, sp)
                    tok = int(torch.multinomial(processed.softmax(-1), 1, generator=gen))
                    source = logits if self.logprobs_mode.startswith("raw") else processed
                    lps.append({tok: Logprob(float(source.log_softmax(-1)[tok]), rank=1)})
                    ids.append(tok)
                    out.append(tok)
                    if tok in stops:
                        finish, stop_reason = "stop", (tok if tok != eos else None)
                        break
                request.outputs.append(CompletionOutput(
                    index, "", out, None, lps if sp.logprobs is not None else None, finish, stop_reason))
            results.append(request)
        return results


def install(monkeypatch):
    """Make `import vllm` (and the submodules grpo_nb uses) resolve to this stand-in."""
    LLM.instances = []
    modules = {}
    for name in ("vllm", "vllm.lora", "vllm.lora.request", "vllm.sampling_params"):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        modules[name] = mod
    modules["vllm"].LLM = LLM
    modules["vllm"].SamplingParams = SamplingParams
    modules["vllm"].lora = modules["vllm.lora"]
    modules["vllm"].sampling_params = modules["vllm.sampling_params"]
    modules["vllm.lora"].request = modules["vllm.lora.request"]
    modules["vllm.lora.request"].LoRARequest = LoRARequest
    modules["vllm.sampling_params"].SamplingParams = SamplingParams
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return modules["vllm"]
