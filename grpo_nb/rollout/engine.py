"""Native rollout engine: one prefill per prompt, a shared KV cache, a lean decode loop.

`RolloutEngine` is a drop-in for `HFGenerateRollout` (same `__call__`, same RolloutBatch)
that avoids the work `generate` wastes in GRPO:

* Each prompt is prefilled ONCE and its KV cache is repeated to its `num_generations` rows
  (`share_prompt_prefix=True`); `generate` prefills G identical copies.
* Rows that finished (EOS) are dropped from the batch once enough of them accumulate, so
  long-tail generations do not pay for the short ones; a row map puts tokens back in place
  (dynamic decode only: the static cache keeps fixed shapes, see `decode` below).
* Sampling log-probs (log_softmax(logits / T) at the sampled token, no filters) come for free
  from the logits already computed, so the trainer needs no separate old-policy pass.
* Sampling draws ONE uniform per output row per step (inverse-CDF sampling), so a row's
  samples depend on the seed and its own logits only, not on which other rows are still in
  the batch: compaction and prefix sharing do not change the samples.

It runs on the live model (LoRA adapters active), in eval mode. On the CPU the adapted layers multiply by
rollout-only merged copies (`grpo_nb.lora`) and a Llama / Mistral / Qwen2 model forwards as straight tensor
calls instead of through its modules (`grpo_nb.rollout.lean_forward`); the training weights are never touched.

`decode` picks how the tokens after the prompt are computed; sampling and bookkeeping are the
same for all of them:

* "dynamic": HF's DynamicCache, grown one column per step, with row compaction (`_decode_step`).
* "static": a KV cache pre-sized for all prompts x generations (`grpo_nb.rollout.static_cache`), one
  fixed-shape step per token, no compaction (finished rows decode pad, ignored here).
* "cuda_graph": "static" with the step captured once per rollout in a CUDA graph (CUDA only;
  falls back to "static" with a RuntimeWarning if capture fails or disagrees with eager), and the step's
  sampling in a second graph (`_decode_static`, `static_cache.GraphedStep`: checked once against an eager call).
* "auto" (default): "cuda_graph" on CUDA, "dynamic" elsewhere.

A static cache that would not fit in free GPU memory, or a model the static path does not
support (attention other than eager/sdpa, sliding-window layers), falls back to "dynamic"
with a warning. The static cache is freed when the rollout ends. Episodes (`start_episodes` /
`continue_episodes`) decode by the same setting: on CUDA their static cache is made for the episodes' whole
token budget and one graph replays every turn's steps (`StaticDecoder.prefill` writes a tool's result between
turns); the episodes' state frees it (`EpisodeCache.release`).

`max_rows` bounds how many completions decode at once: the KV cache (the rollout's memory,
rows x tokens) then holds that many rows, and the rest wait their turn. Long completions are
KV-bound: 8 generations of 20K tokens of Llama-3.1-8B take 22 GB of cache together, 2.7 GB
one at a time. Rows are cut in order (whole prompts' groups when `max_rows` >= the group,
else a prompt's generations in pieces, each prefilling its prompt once).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import warnings

import torch

from ..attachments import base_model
from ..kernels import decode_glue
from ..lora import cpu_output_head, rollout_branch
from .batch import RolloutBatch, eos_token_ids
from . import lean_forward, static_cache
from .static_cache import static_unsupported_reason

SUPPORTED_GENERATION_KWARGS = {"min_new_tokens"}
DECODE_MODES = ("auto", "dynamic", "static", "cuda_graph")
# Decode steps between two checks whether every row has finished, with a static cache on CUDA (each check waits
# for the GPU; measured on an H200, a step that waits costs its graph's launch and its kernels one after the other).
CHECK_EVERY = 8
# Prompts sharing at least this many first tokens prefill them once (RolloutEngine._prefill): below it, the extra
# forward costs more than it saves.
MIN_SHARED_PREFIX = 16


# --------------------------------------------------------------------------------------
# Sampling filters: small pure functions on [n, V] logits (masked entries become -inf)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor on a [n, V] bool mask of tokens already present."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None,
                  min_p: float | None = None) -> torch.Tensor:
    """top_k, then top_p (nucleus), then min_p, with HF's semantics; the top token always survives."""
    neg_inf = float("-inf")
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, neg_inf)  # ties with the k-th are kept, as HF
    if top_p is not None and top_p < 1.0:
        # HF's TopPLogitsWarper exactly (ascending sort, so ties at the cut break the same way):
        # drop the low tail whose total mass is <= 1 - top_p; the top token always stays.
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        drop_sorted = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, neg_inf)
    if min_p:
        probs = logits.softmax(-1)
        threshold = min_p * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, neg_inf)  # the max itself always passes
    return logits


def sample_from_logits(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i takes the first token whose cumulative prob exceeds uniforms[i].

    `right=True` makes a zero-probability token unreachable even for u == 0.
    """
    cdf = logits.softmax(-1).cumsum(-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)


# --------------------------------------------------------------------------------------
# KV-cache batch surgery, across transformers versions


def repeat_cache_rows(cache, repeats: int) -> None:
    """Repeat every layer's keys/values `repeats` times along the batch dim (row i -> rows i*r..i*r+r-1)."""
    if hasattr(cache, "batch_repeat_interleave"):
        cache.batch_repeat_interleave(repeats)
    else:  # legacy list-of-tensors cache
        for lst in (cache.key_cache, cache.value_cache):
            for i, t in enumerate(lst):
                lst[i] = t.repeat_interleave(repeats, dim=0)


def select_cache_rows(cache, indices: torch.Tensor) -> None:
    """Keep only `indices` along the batch dim of every layer's keys/values."""
    if hasattr(cache, "batch_select_indices"):
        cache.batch_select_indices(indices)
    else:
        for lst in (cache.key_cache, cache.value_cache):
            for i, t in enumerate(lst):
                lst[i] = t[indices]


def common_prefix_length(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """How many first real tokens every row of left-padded prompts shares, leaving each row one token of its own
    (its last token's logits start the decode). 0 for one row, meta tensors (no values) or other padding."""
    lengths = mask.sum(-1)
    if ids.shape[0] < 2 or ids.device.type == "meta" or not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        return 0
    shortest = int(lengths.min()) - 1
    if shortest <= 0:
        return 0
    starts = (ids.shape[1] - lengths)[:, None]
    tokens = ids.gather(1, starts + torch.arange(shortest, device=ids.device)[None])
    differs = (tokens != tokens[:1]).any(0)
    return int(differs.float().argmax()) if bool(differs.any()) else shortest


def cpu_dtype_from(value) -> torch.dtype | None:
    """RolloutEngine's `cpu_dtype`: None (the model's own) or bfloat16, by name or as the torch dtype."""
    if value is None:
        return None
    if value in ("bfloat16", torch.bfloat16):
        if not cpu_has_bf16():
            warnings.warn("cpu_dtype='bfloat16': this CPU has no bf16 instructions (AVX512-BF16 / AMX), so its bf16 "
                          "products are emulated and likely slower than fp32; leave cpu_dtype=None here.",
                          RuntimeWarning, stacklevel=3)
        return torch.bfloat16
    raise ValueError(f"cpu_dtype={value!r} is invalid: expected None (the model's own dtype) or 'bfloat16' (a CPU "
                     f"rollout's merged weights in bf16)")


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN's AVX512-BF16 / AMX kernels)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------


def keeps_kv_cache(model) -> bool:
    """Whether the model's forward takes and returns a KV cache, which the engine decodes with (RecurrentGemma and
    other state-space models keep their state on their modules instead: HF generate() handles them)."""
    base = base_model(model)
    if getattr(getattr(base, "config", None), "model_type", None) in NO_KV_CACHE:
        return False
    forward = getattr(base, "forward", None)
    if forward is None:  # no model to ask (a stand-in): the engine, whose own checks name what is missing
        return True
    params = inspect.signature(forward).parameters
    return "cache" in params or "past_key_values" in params


# model types whose forward takes a `cache` argument yet returns none (their state lives on their modules)
NO_KV_CACHE = {"recurrent_gemma"}


def cache_argument(model) -> str:
    """forward()'s keyword (and output field) for the KV cache: `cache` in newer transformers, where
    `past_key_values` still works but warns (it goes in 5.40); `past_key_values` before the rename."""
    return "cache" if "cache" in inspect.signature(base_model(model).forward).parameters else "past_key_values"


def _rollout_forward(method):
    """An engine method's forwards: no gradients, the LoRA branch in the model's dtype unless `exact_adapters`."""
    @functools.wraps(method)
    def run(self, model, *args, **kwargs):
        with torch.no_grad(), rollout_branch(enabled=not self.exact_adapters, cpu_dtype=self.cpu_dtype), \
                cpu_output_head(model) if not self.exact_adapters else contextlib.nullcontext():
            outer = self._lean
            self._lean = lean_forward.LeanForward(model) if lean_forward.usable(model, self.exact_adapters) else None
            try:
                return method(self, model, *args, **kwargs)
            finally:
                self._lean = outer
    return run


class RolloutEngine:
    """Rollout with a shared prompt prefix, row compaction and returned sampling log-probs."""

    def __init__(self, *, max_completion_length, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                 repetition_penalty=1.0, greedy=False, seed: int | None = None, share_prompt_prefix: bool = True,
                 min_new_tokens: int | None = None, generation_kwargs=None, decode: str = "auto",
                 max_rows: int | None = None, exact_adapters: bool = False, cpu_dtype=None,
                 _compact_fraction: float | None = 0.25):
        extra = dict(generation_kwargs or {})
        unsupported = set(extra) - SUPPORTED_GENERATION_KWARGS
        if unsupported:
            raise ValueError(f"RolloutEngine supports only {sorted(SUPPORTED_GENERATION_KWARGS)} in generation_kwargs, "
                             f"got {sorted(unsupported)}; use rollout='hf' for other generate() arguments")
        if decode not in DECODE_MODES:
            raise ValueError(f"decode={decode!r} is invalid: expected one of {DECODE_MODES}")
        if temperature is None or temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
            raise ValueError(f"max_rows={max_rows!r} is invalid: expected a positive integer, or None for all rows")
        self.max_rows = max_rows
        # True: the LoRA branch with peft's exact fp32 arithmetic, for log-probs that must equal the training
        # forward's (they become the old policy's); False: in a 16-bit model's dtype (grpo_nb.lora.rollout_branch).
        self.exact_adapters = bool(exact_adapters)
        # On the CPU: the rollout's merged weights in this dtype (None: the model's; see grpo_nb.lora)
        self.cpu_dtype = cpu_dtype_from(cpu_dtype)
        self.max_completion_length = int(max_completion_length)
        self.temperature = float(temperature)
        self.top_p, self.top_k, self.min_p = top_p, top_k or None, min_p
        self.repetition_penalty = float(repetition_penalty or 1.0)
        self.greedy = greedy
        self.seed = None if seed is None else int(seed)  # torch's Generator takes no numpy integer
        self.share_prompt_prefix = share_prompt_prefix
        self.min_new_tokens = int(min_new_tokens or extra.get("min_new_tokens") or 0)
        # Drop finished rows once they are >= this fraction of the batch (None: never).
        self._compact_fraction = _compact_fraction
        self._check_every: int | None = None  # None: CHECK_EVERY on CUDA, every step elsewhere
        self.decode = decode
        self._static = None  # the rollout's StaticDecoder while one runs (released in __call__)
        self._graph_failure: str | None = None  # once capture failed, later rollouts stay eager
        self._sampling_graph_failure: str | None = None  # the same for the sampling's graph (`_decode_static`)
        self._generator = None  # created on the model's device at the first call, then advanced
        self._lean = None  # inside a call: its LeanForward (a CPU rollout of a model it reproduces), or None
        # Timings and sizes of the last call (benchmarks read these): prefill_s, decode_s, decode_steps, ...
        self.last_stats: dict = {}

    def state_dict(self) -> dict:
        """The sampler's random state, so a resumed run draws the same samples as an unbroken one."""
        generator = self._generator
        return {"seed": self.seed, "generator": None if generator is None else generator.get_state(),
                "device": None if generator is None else str(generator.device)}

    def returns_logprobs(self) -> bool:
        return True  # the log-softmax it samples from, at each sampled token

    def load_state_dict(self, state: dict) -> None:
        self.seed = state["seed"]
        self._generator = None
        if state["generator"] is not None:
            self._generator = torch.Generator(device=state["device"])
            self._generator.set_state(state["generator"])

    def _uniforms(self, n: int, device, out: torch.Tensor | None = None) -> torch.Tensor:
        """n uniform draws (into `out` where given: the same draws, one kernel)."""
        kwargs = {} if out is None else {"out": out}
        if self.seed is None:
            return torch.rand(n, device=device, **kwargs)
        return torch.rand(n, device=device, generator=self._seeded(device), **kwargs)

    def _seeded(self, device) -> torch.Generator:
        """The seeded generator on `device`, made at its first use there and advanced from then on."""
        if self._generator is None or self._generator.device != torch.device(device):
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator

    def _prefill(self, model, ids, mask, extra):
        """The prompts' forward: (fp32 logits at each row's last token, the KV cache, which cache columns hold real
        tokens, how many first tokens all rows shared).

        Prompts that begin alike (a system prompt, few-shot examples: the same tokens at the same positions, so the
        same keys and values) forward that common prefix once, its cache repeated to every row, then each row's
        rest; a row's padding then lies between the two, masked. An evaluation of 100 one-shot arithmetic prompts
        prefills ~4x fewer tokens. Not for sliding-window layers (the padding would sit inside the window) nor
        attention kernels other than eager / sdpa (a mask with a hole), as the static cache."""
        shareable = self.share_prompt_prefix and static_unsupported_reason(model) is None
        prefix = common_prefix_length(ids, mask) if shareable else 0
        if prefix < MIN_SHARED_PREFIX:
            pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate() for left padding
            logits, cache = self._forward(model, ids, mask, pos, None, extra)
            return logits, cache, mask, 0
        rows, width = ids.shape
        start = int(width - mask[0].sum())  # where the first row's real tokens begin (left padding)
        _, cache = self._forward(model, ids[:1, start:start + prefix], None,
                                 torch.arange(prefix, device=ids.device)[None], None, extra)
        repeat_cache_rows(cache, rows)
        # Each row's tokens after the prefix are the last (length - prefix) of its left-padded row: the columns
        # from `prefix` on, masked where they are padding or the row's own copy of the prefix.
        rest = mask.sum(-1, keepdim=True) - prefix
        columns = torch.arange(width - prefix, device=ids.device)[None]
        rest_mask = (columns >= width - prefix - rest).to(mask.dtype)
        layout = torch.cat([torch.ones_like(mask[:, :prefix]), rest_mask], dim=1)
        pos = (prefix + rest_mask.long().cumsum(-1) - 1).masked_fill(rest_mask == 0, 1)
        logits, cache = self._forward(model, ids[:, prefix:], layout, pos, cache, extra)
        return logits, cache, layout, prefix

    @staticmethod
    def _forward_kwargs(model) -> dict:
        base = base_model(model)
        params = inspect.signature(base.forward).parameters
        return {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def _forward(self, model, ids, attention_mask, position_ids, cache, extra):
        """The model over `ids` after what `cache` holds (None: a new cache): (fp32 logits at the last position,
        the cache). Through `lean_forward` where this call found it usable, else the model's own forward."""
        if self._lean is not None:
            return self._lean(ids, attention_mask, position_ids, cache)
        kwargs = {} if cache is None else {self._cache_arg: cache}
        out = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                    **kwargs, **extra)
        return out.logits[:, -1].float(), getattr(out, self._cache_arg)

    def _decode_step(self, model, tokens, attention_mask, position_ids, cache, extra):
        """One token per row through the model with the KV cache; returns fp32 [n, V] logits."""
        return self._forward(model, tokens[:, None], attention_mask, position_ids[:, None], cache, extra)[0]

    def _resolve_decode(self, device) -> str:
        if self.decode == "auto":
            return "cuda_graph" if torch.device(device).type == "cuda" else "dynamic"
        if self.decode == "cuda_graph" and torch.device(device).type != "cuda":
            raise ValueError(f"decode='cuda_graph' needs a CUDA device, the prompts are on {device}: "
                             "use decode='static' (same cache, no graph) or 'auto'")
        return self.decode

    def _static_decoder(self, mode, model, cache, prompt_mask, extra, columns: int | None = None):
        """The rollout's StaticDecoder with `columns` after the prompt (None: max_completion_length), or None to
        decode with the dynamic cache."""
        if mode == "dynamic" or self.max_completion_length < 2:  # < 2: no decode step at all
            return None
        columns = self.max_completion_length if columns is None else max(columns, self.max_completion_length)
        reason = static_cache.static_unsupported_reason(model)
        if reason is None:
            need = static_cache.StaticDecoder.nbytes(cache, prompt_mask.shape[0], columns)
            free = static_cache.free_device_memory(prompt_mask.device)
            if free is not None and need > free:
                reason = f"its static KV cache needs {need / 2**30:.2f} GiB, only {free / 2**30:.2f} GiB free"
        if reason is not None:
            warnings.warn(f"decode={mode!r} falls back to the dynamic KV cache: {reason}", RuntimeWarning, stacklevel=4)
            return None
        graph = mode == "cuda_graph" and self._graph_failure is None
        return static_cache.StaticDecoder(model, cache, prompt_mask, columns, extra, graph=graph,
                                          cache_argument=self._cache_arg,
                                          lean=lean_forward.static_lean(model, prompt_mask.device))

    @_rollout_forward
    def __call__(self, model, tokenizer, prompt_ids, prompt_mask, num_generations: int) -> RolloutBatch:
        G = num_generations
        was_training = model.training
        model.eval()  # gradient checkpointing refuses the KV cache in train mode
        try:
            if self.max_rows is None or prompt_ids.shape[0] * G <= self.max_rows:
                return self._generate(model, tokenizer, prompt_ids, prompt_mask, G)
            pieces = []
            for rows, count in self._pieces(prompt_ids.shape[0], G):
                pieces.append(self._generate(model, tokenizer, prompt_ids[rows], prompt_mask[rows], count))
                self._release_static()  # one piece's KV cache at a time
            return RolloutBatch.concat(pieces, tokenizer.pad_token_id)
        finally:
            model.train(was_training)
            self._release_static()  # free the static cache (and graph) for the training step

    def _release_static(self) -> None:
        if self._static is not None:
            if self._static.fallback_reason:
                self._graph_failure = self._static.fallback_reason
            self._static.release()
            self._static = None

    def _pieces(self, prompts: int, G: int):
        """(prompt rows, generations each) per piece of at most `max_rows` completions, in row order."""
        if self.max_rows >= G:
            per = self.max_rows // G
            return [(slice(p, min(p + per, prompts)), G) for p in range(0, prompts, per)]
        return [(slice(p, p + 1), min(self.max_rows, G - g)) for p in range(prompts) for g in range(0, G, self.max_rows)]

    def _generate(self, model, tokenizer, prompt_ids, prompt_mask, G, keep: bool = False, room: int | None = None):
        """One rollout. `keep`: an episode's first turn - every row kept in the cache (no compaction), a static
        one made for `room` columns after the prompt, and the state to continue from returned beside the batch
        (`EpisodeCache`)."""
        device = prompt_ids.device
        eos = torch.tensor(eos_token_ids(model, tokenizer), device=device)
        all_prompt_ids = prompt_ids.repeat_interleave(G, dim=0)
        all_prompt_mask = prompt_mask.repeat_interleave(G, dim=0)
        N, T = all_prompt_ids.shape[0], self.max_completion_length
        extra, self._cache_arg = self._forward_kwargs(model), cache_argument(model)
        mode = self._resolve_decode(device)

        # Prefill: P rows (then the cache is repeated per generation) or N rows (the A/B baseline).
        ids, mask = (prompt_ids, prompt_mask) if self.share_prompt_prefix else (all_prompt_ids, all_prompt_mask)
        t_start = time.perf_counter()
        logits, cache, layout, shared = self._prefill(model, ids, mask, extra)
        if self._lean is not None:  # cache columns with the same keys and values in every row (repeated below):
            # one prompt's whole width when it is the only one, else the prefix all prompts share
            one = self.share_prompt_prefix and ids.shape[0] == 1
            self._lean.shared_columns = layout.shape[1] if one else shared
        if self.share_prompt_prefix and G > 1:
            layout = layout.repeat_interleave(G, dim=0)
        static = self._static = self._static_decoder(mode, model, cache, layout, extra, room if keep else None)
        if static is not None:
            cache = None  # the static cache now holds the prompt keys/values, for every row
        elif self.share_prompt_prefix and G > 1:
            repeat_cache_rows(cache, G)
        if self.share_prompt_prefix and G > 1:
            logits = logits.repeat_interleave(G, dim=0)
        seen = None
        if self.repetition_penalty != 1.0:  # over real prompt tokens + generated ones (HF also counts pads)
            seen = self._seen(all_prompt_ids, all_prompt_mask, logits.shape[-1])
        attn = layout.long()  # which cache columns hold real tokens (a shared prefix puts its rows' padding after it)
        _sync(device)
        t_prefill = time.perf_counter()
        completion, logprobs, lengths, steps = self._decode(model, logits, cache, static, attn, attn.sum(-1), seen,
                                                            T, eos, tokenizer.pad_token_id, extra, compact=not keep)
        _sync(device)
        self.last_stats = {"prefill_s": t_prefill - t_start, "decode_s": time.perf_counter() - t_prefill,
                           "decode_steps": steps, "rows": N, "prefill_rows": ids.shape[0],
                           "prompt_width": prompt_ids.shape[1], "shared_prefix": shared,
                           "generated_tokens": int(lengths.sum()),
                           "decode": "dynamic" if static is None else "cuda_graph" if static.graph is not None
                           else "static", "forward": "model" if self._lean is None else "lean"}
        batch = self._batch(all_prompt_ids, all_prompt_mask, completion, logprobs, lengths, eos)
        if not keep:
            return batch
        self._static = None  # the episodes' state holds it now (EpisodeCache.release)
        return batch, EpisodeCache(cache, attn, attn.sum(-1), seen, extra, static).after_turn(batch, steps)

    @staticmethod
    def _seen(ids, mask, V) -> torch.Tensor:
        # Pads go to a spare last column (dropped): writing False for a pad id that is also a
        # real prompt token (SmolLM2: pad = EOS) would race with its True on CUDA.
        seen = torch.zeros(ids.shape[0], V + 1, dtype=torch.bool, device=ids.device)
        seen.scatter_(1, ids.masked_fill(mask == 0, V), True)
        return seen[:, :V].contiguous()

    @staticmethod
    def _batch(prompt_ids, prompt_mask, completion, logprobs, lengths, eos) -> RolloutBatch:
        tc = int(lengths.max()) if len(lengths) else 0
        completion, logprobs = completion[:, :tc], logprobs[:, :tc]
        completion_mask = (torch.arange(tc, device=completion.device)[None] < lengths[:, None]).long()
        truncated = ~torch.isin(completion, eos).any(1)
        return RolloutBatch(prompt_ids, prompt_mask, completion, completion_mask, truncated,
                            sampling_logprobs=logprobs * completion_mask)

    def _decode(self, model, logits, cache, static, attn, next_pos, seen, T, eos, pad, extra, compact=True,
                done=None, drawn=None):
        """Up to T tokens per row from the next-token `logits` on: (completion [N, T], log-probs, lengths, steps).
        Each row's tokens through its first EOS; the last token sampled is not fed to the model (its keys and
        values are not in the cache). `done`: rows finished from the start (pad only; an ended episode's row in a
        static cache). `drawn`: the rows that draw a uniform each step, in order (None: all) - the others are done,
        and each drawing row samples what it would as the same row of a batch of those rows alone."""
        if static is not None:
            return self._decode_static(logits, static, next_pos, seen, T, eos, pad, done, drawn)
        N, device = logits.shape[0], logits.device
        compact = compact and self._compact_fraction is not None
        rows = torch.arange(N, device=device)  # per active row: its output row
        done = torch.zeros(N, dtype=torch.bool, device=device) if done is None else done.clone()
        completion = torch.full((N, T), pad, dtype=torch.long, device=device)
        logprobs = torch.zeros(N, T, dtype=torch.float32, device=device)
        lengths = torch.full((N,), T, dtype=torch.long, device=device)
        steps, fused = 0, decode_glue.sampler(device)
        for t in range(T):
            uniforms = None
            if not self.greedy:
                if drawn is None:
                    uniforms = self._uniforms(N, device)[rows]  # one draw per OUTPUT row: compaction-invariant
                else:
                    uniforms = logits.new_zeros(N).index_copy_(0, drawn, self._uniforms(len(drawn), device))
            sampled, logp = self._sample(logits, eos, seen, uniforms, t < self.min_new_tokens, fused)

            # Written for every row with where() rather than for the alive rows by a boolean index: an index by
            # mask waits for the GPU, these do not (finished rows write what their rows already hold).
            alive = ~done
            token = torch.where(alive, sampled, torch.full_like(sampled, pad))  # finished rows emit pad
            completion[rows, t] = token
            logprobs[rows, t] = torch.where(alive, logp, 0.0)
            hit_eos = alive & torch.isin(token, eos)
            lengths[rows] = torch.where(hit_eos, t + 1, lengths[rows])
            done = done | hit_eos
            if seen is not None:
                seen.scatter_(1, token[:, None], alive[:, None])
            if t + 1 == T:  # no forward after the last token
                break
            n_done = int(done.sum())  # the step's one wait for the GPU
            if n_done == len(rows):
                break

            # Compaction: drop finished rows once enough have accumulated (the cache is re-indexed,
            # a copy, so not every step). Not with the static cache: its shapes are fixed, finished
            # rows keep decoding pad, and the `alive` masks above ignore what they produce.
            if compact and n_done > 0 and n_done >= self._compact_fraction * len(rows):
                keep = (~done).nonzero().squeeze(1)
                select_cache_rows(cache, keep)
                rows, done, token, attn, next_pos = rows[keep], done[keep], token[keep], attn[keep], next_pos[keep]
                seen = seen[keep] if seen is not None else None

            attn = torch.cat([attn, attn.new_ones(len(rows), 1)], dim=1)
            logits = self._decode_step(model, token, attn, next_pos, cache, extra)
            next_pos = next_pos + 1
            steps += 1
        return completion, logprobs, lengths, steps

    def _sample(self, logits, eos, seen, uniforms, before_min_tokens, fused=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step's tokens from fp32 logits [n, V]: (sampled [n], their tempered log-probs [n] - before any
        processor or filter). EOS barred while `before_min_tokens` (min_new_tokens: a bool, or a device bool a graph
        reads), the repetition penalty over `seen`, then greedy, or top-k / top-p / min-p and a draw by `uniforms`
        [n]. `fused`: the sampling kernels (`kernels.decode_glue.sampler`), taken where nothing changes the scores."""
        if fused is not None and not self._changes_scores(logits.shape[-1], seen, before_min_tokens):
            return fused(logits, self.temperature, uniforms)
        tempered = logits / self.temperature
        logp_all = torch.log_softmax(tempered, dim=-1)
        if self.greedy or seen is not None or before_min_tokens is not False:
            tempered = None  # (not what is sampled from: freed now, as before the rest)
        scores = logits
        if isinstance(before_min_tokens, torch.Tensor):
            scores = torch.where(before_min_tokens, scores.index_fill(1, eos, float("-inf")), scores)
        elif before_min_tokens:
            scores = scores.index_fill(1, eos, float("-inf"))
        if seen is not None:
            scores = apply_repetition_penalty(scores, seen, self.repetition_penalty)
        if self.greedy:
            sampled = scores.argmax(-1)
        else:
            scores = scores / self.temperature if tempered is None else tempered  # (the same division, once)
            sampled = sample_from_logits(filter_logits(scores, self.top_k, self.top_p, self.min_p), uniforms)
        return sampled, logp_all.gather(1, sampled[:, None]).squeeze(1)

    def _changes_scores(self, vocab: int, seen, before_min_tokens) -> bool:
        """Whether `_sample` draws from anything but softmax(logits / temperature): greedy, a repetition penalty, EOS
        barred (min_new_tokens), or a top-k / top-p / min-p filter that removes tokens."""
        return bool(self.greedy or seen is not None or before_min_tokens is not False
                    or (self.top_k and self.top_k < vocab) or (self.top_p is not None and self.top_p < 1.0)
                    or self.min_p)

    def _decode_static(self, logits, static, next_pos, seen, T, eos, pad, done=None, drawn=None):
        """`_decode` on a static cache: every row decodes every step (finished rows feed pad, their tokens not
        kept), and each step's sampling - the same arithmetic as `_decode`'s - works on fixed tensors, the step
        index a device tensor, so that on CUDA it replays from a CUDA graph of its own beside the forward's
        (`static_cache.GraphedStep`: ~30 small kernels a step the host would otherwise launch one by one). Whether
        every row has finished is asked every `check_every` steps on CUDA, so that the host launches the next
        steps while the GPU runs these (at most check_every - 1 steps of finished rows are decoded for nothing)."""
        N, device = logits.shape[0], logits.device
        check_every = self._check_every or (CHECK_EVERY if device.type == "cuda" else 1)
        done_at_start = torch.zeros(N, dtype=torch.bool, device=device) if done is None else done
        done = done_at_start.clone()
        completion = torch.full((N, T), pad, dtype=torch.long, device=device)
        logprobs = torch.zeros(N, T, dtype=torch.float32, device=device)
        lengths = torch.full((N,), T, dtype=torch.long, device=device)
        t = torch.zeros(1, dtype=torch.long, device=device)  # the step being sampled
        token = torch.zeros(N, dtype=torch.long, device=device)
        uniforms = None if self.greedy else torch.zeros(N, device=device)
        scores_in = static.logits_buffer(logits)  # every decode step's logits land in this buffer
        fused = decode_glue.sampler(device)
        # the next step's inputs, written by the sampling on the device: the token it feeds, at next_pos, into the
        # column after those written so far
        next_pos = next_pos.clone()
        static.write_pos.fill_(static.length - 1)

        def sample():  # reads and writes only the tensors above (a graph replays it)
            sampled, logp = self._sample(scores_in, eos, seen, uniforms,
                                         (t < self.min_new_tokens) if self.min_new_tokens else False, fused)
            alive = ~done
            token.copy_(torch.where(alive, sampled, pad))  # finished rows emit pad
            completion.index_copy_(1, t, token[:, None])
            logp = torch.where(alive, logp, 0.0)
            logprobs.index_copy_(1, t, logp[:, None])
            hit_eos = alive & torch.isin(token, eos)
            lengths.copy_(torch.where(hit_eos, t + 1, lengths))
            done.logical_or_(hit_eos)
            if seen is not None:
                seen.scatter_(1, token[:, None], alive[:, None])
            t.add_(1)
            static.tokens.copy_(token[:, None])
            static.positions.copy_(next_pos[:, None])
            next_pos.add_(1)
            static.write_pos.add_(1)

        writes = [completion, logprobs, lengths, done, token, t, static.tokens, static.positions, next_pos,
                  static.write_pos] + ([seen] if seen is not None else [])
        graph = (static.use_graph or static.graph is not None) and self._sampling_graph_failure is None
        step = static_cache.GraphedStep(sample, writes, graph=graph)
        # The seeded generator's state before each step's draw: steps decoded after the last row ended (between two
        # checks) drew too, which `_decode` does not - the generator is put back after the rollout, so that the next
        # rollout (or piece) draws what it would after `_decode`'s
        states = [] if uniforms is not None and self.seed is not None else None
        steps = 0
        for i in range(T):
            if states is not None:
                states.append(self._seeded(device).get_state())
            if uniforms is not None:  # one draw per row, as `_decode` draws them
                if drawn is None:
                    self._uniforms(N, device, out=uniforms)
                else:  # (the other rows are done: their zeros are never used)
                    uniforms.index_copy_(0, drawn, self._uniforms(len(drawn), device))
            step()
            if i + 1 == T:  # no forward after the last token
                break
            if (i + 1) % check_every == 0 and int(done.sum()) == N:  # the one wait for the GPU
                break
            static.step_written()  # its logits into `scores_in`
            steps += 1
        if step.failure:
            self._sampling_graph_failure = step.failure
        if states is not None and not bool(done_at_start.all()):
            drawn_by_decode = int(lengths[~done_at_start].max())  # `_decode` stops drawing once every row has ended
            if drawn_by_decode < len(states):
                self._generator.set_state(states[drawn_by_decode])
        return completion, logprobs, lengths, steps

    # ----------------------------------------------------------------------------------
    # Episodes (grpo_nb.episodes): a turn that called a tool goes on from the KV cache of the turns before it

    @_rollout_forward
    def start_episodes(self, model, tokenizer, prompt_ids, prompt_mask, num_generations: int,
                       room: int | None = None):
        """The first turn of each episode, as __call__ samples it, and the KV cache of every row kept so that
        `continue_episodes` prefills only what a tool appended; all rows at once. With a static cache (`decode`,
        as for one turn: a CUDA graph on CUDA) it is made for `room` columns after the prompt (None:
        max_completion_length, which run_episodes lowers to the episodes' whole budget for the first turn), and
        every later turn decodes with a graph of the same shapes. Call the state's `release()` when the episodes
        end."""
        was_training = model.training
        model.eval()
        try:
            batch, state = self._generate(model, tokenizer, prompt_ids, prompt_mask, num_generations, keep=True,
                                          room=room)
        except BaseException:
            self._release_static()
            raise
        finally:
            model.train(was_training)
        if state.static is not None:
            state.static.drop_graph()  # it read this call's adapter copies (lora.rollout_branch), gone now
        return batch, state

    @_rollout_forward
    def continue_episodes(self, model, tokenizer, state: "EpisodeCache", rows: list[int],
                          appended: list[list[int]], budget: int) -> RolloutBatch:
        """The next turn of the episodes `rows` (indices into the state's rows, which are the last turn's batch's;
        the others end: they leave a dynamic cache, a static one keeps their rows decoding pad), each after its
        `appended` tokens (a tool's result and the opening of the next turn): only the last sampled token and
        those are prefilled. `budget`: at most this many new tokens per row."""
        state.check_continuable(rows, appended)
        was_training = model.training
        model.eval()
        state.midturn = True  # until this turn is done: a state an error left mid-turn cannot go on
        try:
            T = max(1, min(budget, self.max_completion_length))
            if state.static is not None:
                width = 1 + max((len(more) for more in appended), default=0)
                if state.static.make_room(width + T):
                    return self._continue_static(model, tokenizer, state, rows, appended, T)
                warnings.warn("The episodes' static KV cache has no room left for their next turn and the GPU no room "
                              "for a larger one: they go on with a dynamic KV cache (slower: no CUDA graph).",
                              RuntimeWarning, stacklevel=3)
                state.to_dynamic()
            device = state.attn.device
            eos = torch.tensor(eos_token_ids(model, tokenizer), device=device)
            state.keep(torch.tensor(rows, device=device))
            ids, block, pos, _ = self._turn_block(state, range(len(rows)), appended, tokenizer.pad_token_id)
            counts = block.sum(-1)
            attn = torch.cat([state.attn, block], dim=1)
            t_start = time.perf_counter()
            logits, _ = self._forward(model, ids, attn, pos, state.cache, state.extra)
            next_pos = state.next_pos + counts
            completion, logprobs, lengths, steps = self._decode(
                model, logits, state.cache, None, attn, next_pos, state.seen, T, eos, tokenizer.pad_token_id,
                state.extra, compact=False)
            self.last_stats = {"prefill_s": 0.0, "decode_s": time.perf_counter() - t_start, "decode_steps": steps,
                               "rows": len(rows), "prefill_tokens": int(counts.sum()), "decode": "dynamic",
                               "forward": "model" if self._lean is None else "lean"}
            batch = self._batch(ids, block, completion, logprobs, lengths, eos)
            state.attn, state.next_pos = attn, next_pos
            state.after_turn(batch, steps)
            state.midturn = False
            return batch
        finally:
            model.train(was_training)
            if state.static is not None:
                state.static.drop_graph()  # it read this call's adapter copies (lora.rollout_branch), gone now

    @staticmethod
    def _turn_block(state: "EpisodeCache", rows, appended: list[list[int]], pad: int) -> tuple:
        """What a turn prefills for each of the state's cache rows: for `rows` (in the order of `appended`) the
        row's last sampled token (placed on the device, never read back to the host), then what was appended, the
        other rows padding - (ids, real tokens, positions [n, width], `rows` as a device index). What was appended
        counts as seen (repetition penalty), as a prompt's tokens do; the last token already is."""
        device = state.next_pos.device
        sizes = [1 + len(more) for more in appended]
        width = max(sizes)
        ids = torch.full((len(state.next_pos), width), pad, dtype=torch.long, device=device)
        block = torch.zeros_like(ids)
        for row, more, size in zip(rows, appended, sizes):
            if more:
                more = torch.tensor(list(more), dtype=torch.long, device=device)
                ids[row, width - len(more):] = more
                if state.seen is not None:
                    state.seen[row, more] = True
            block[row, width - size:] = 1
        index = torch.tensor(list(rows), dtype=torch.long, device=device)
        ids[index, torch.tensor([width - n for n in sizes], device=device)] = state.last[index]
        pos = (state.next_pos[:, None] + block.cumsum(-1) - 1).masked_fill(block == 0, 1)
        return ids, block, pos, index

    def _continue_static(self, model, tokenizer, state: "EpisodeCache", rows: list[int], appended: list[list[int]],
                         T: int) -> RolloutBatch:
        """`continue_episodes` on the episodes' static cache: every row of the cache takes part, the rows of
        episodes that ended as finished ones (their block all padding, pad decoded); the batch holds `rows`."""
        static = state.static
        device, N = static.mask.device, static.rows
        eos = torch.tensor(eos_token_ids(model, tokenizer), device=device)
        going = [state.active[r] for r in rows]  # their rows in the cache
        ids, block, pos, index = self._turn_block(state, going, appended, tokenizer.pad_token_id)
        counts = block.sum(-1)
        t_start = time.perf_counter()
        logits = static.prefill(ids, pos, block)
        next_pos = state.next_pos + counts
        done = torch.ones(N, dtype=torch.bool, device=device)
        done[index] = False
        completion, logprobs, lengths, steps = self._decode(model, logits, None, static, None, next_pos, state.seen,
                                                            T, eos, tokenizer.pad_token_id, state.extra,
                                                            compact=False, done=done, drawn=index)
        self.last_stats = {"prefill_s": 0.0, "decode_s": time.perf_counter() - t_start, "decode_steps": steps,
                           "rows": len(rows), "prefill_tokens": int(counts.sum()),
                           "decode": "cuda_graph" if static.graph is not None else "static", "forward": "model"}
        if static.fallback_reason:
            self._graph_failure = static.fallback_reason
        state.next_pos, state.active = next_pos, going
        lengths = lengths.where(done.logical_not(), 0)  # (ended rows: nothing of this turn is theirs)
        state.after_turn_static(completion, lengths, steps)
        state.midturn = False
        return self._batch(ids[index], block[index], completion[index], logprobs[index], lengths[index], eos)


class EpisodeCache:
    """What `RolloutEngine.continue_episodes` goes on from: the KV cache of every row's turns so far and, per row,
    which of its columns are real, the next position, the last sampled token (not yet in the cache) and the tokens
    seen (repetition penalty).

    Two kinds: a dynamic cache (`cache`; `attn` marks the real columns; rows of ended episodes leave it), or the
    first turn's `static` decoder (its mask marks them; every row stays, `active` lists the cache rows of the
    episodes still going, in order, and next_pos / last / seen are per cache row)."""

    def __init__(self, cache, attn, next_pos, seen, extra, static=None):
        self.cache, self.attn, self.next_pos, self.seen, self.extra = cache, attn, next_pos, seen, extra
        self.static = static
        self.active = list(range(len(next_pos))) if static is not None else None
        self.last = None
        self.midturn = False

    def check_continuable(self, rows, appended) -> None:
        """Refuse what `continue_episodes` cannot go on with, before anything is changed."""
        if self.cache is None and self.static is None:
            raise RuntimeError("continue_episodes: these episodes' KV cache was released (EpisodeCache.release()): "
                               "start the episodes again with start_episodes")
        if self.midturn:
            raise RuntimeError("continue_episodes: an error stopped an earlier turn of these episodes midway, and "
                               "their KV cache holds part of it: start the episodes again with start_episodes")
        count = len(self.next_pos) if self.active is None else len(self.active)
        rows = list(rows)
        if not rows or len(rows) != len(appended) or len(set(rows)) != len(rows) or \
                not all(isinstance(r, int) and 0 <= r < count for r in rows):
            raise ValueError(f"continue_episodes: rows={rows!r} with {len(appended)} appended lists: expected "
                             f"distinct indices from 0 to {count - 1} (the episodes still going, in the order of "
                             f"the last turn's batch), one appended list of token ids each, at least one row")

    def after_turn(self, batch: RolloutBatch, steps: int) -> "EpisodeCache":
        """A turn of `steps` decode steps ended: its fed tokens (all sampled but the last) join the real columns."""
        if self.static is not None:
            self.after_turn_static(batch.completion_ids, batch.completion_mask.sum(-1), steps)
            return self
        lengths = batch.completion_mask.sum(-1)
        fed = (torch.arange(steps, device=lengths.device)[None] < (lengths - 1)[:, None]).long()
        self.attn = torch.cat([self.attn, fed], dim=1)
        self.next_pos = self.next_pos + (lengths - 1).clamp(min=0)
        self.last = batch.completion_ids.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        return self

    def after_turn_static(self, completion: torch.Tensor, lengths: torch.Tensor, steps: int) -> None:
        """`after_turn` on the static cache, `completion` and `lengths` per cache row (0 for an ended episode's):
        the turn's columns (the last `steps` written) stay real only where a row fed a token of its own."""
        fed = torch.arange(steps, device=lengths.device)[None] < (lengths - 1)[:, None]
        self.static.settle(self.static.length - steps, fed)
        self.next_pos = self.next_pos + (lengths - 1).clamp(min=0)
        last = completion.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        self.last = last if self.last is None else torch.where(lengths > 0, last, self.last)

    def keep(self, rows: torch.Tensor) -> None:
        select_cache_rows(self.cache, rows)
        self.attn, self.next_pos, self.last = self.attn[rows], self.next_pos[rows], self.last[rows]
        self.seen = None if self.seen is None else self.seen[rows]

    def to_dynamic(self) -> None:
        """Go on with a dynamic cache of the static one's columns, keeping the rows of the episodes still going."""
        cache, real = self.static.to_dynamic()
        self.static, index = None, torch.tensor(self.active, dtype=torch.long, device=real.device)
        self.cache, self.attn = cache, real[index]
        self.next_pos, self.last = self.next_pos[index], self.last[index]
        self.seen = None if self.seen is None else self.seen[index]
        select_cache_rows(self.cache, index)
        self.active = None

    def release(self) -> None:
        """Drop the cache (a static one's graph and buffers with it): the episodes ended."""
        if self.static is not None:
            self.static.release()
        self.cache = self.static = None
