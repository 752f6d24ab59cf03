"""Where the memory goes: measured during training, and estimated before it.

Both sides speak the same categories (`CATEGORIES`), so a run's records can be laid next to
the planner's estimate, and the VRAM widget draws either:

    base_weights     frozen weights (4-bit packed + quantisation constants under QLoRA), buffers
    trainable        the parameters being trained (LoRA adapters, fp32 under peft)
    optimizer        AdamW's two moments
    gradients        the trainable parameters' gradients at the end of backward
    activations      what the policy update holds for backward beyond the above: checkpointed
                     layer inputs, one layer's recompute, the final hidden states
    logprob_scratch  the log-prob/loss computation's working memory (chunk x vocab logits)
    kv_cache         the KV cache and sampling buffers while generating
    other            the rest of the peak: allocator cache and fragmentation, and on the CPU the
                     Python/torch runtime itself

Rollout and policy update never overlap, so a step's peak holds the static categories plus
the larger of the two phases: kv_cache, or gradients + activations + logprob_scratch.

Measurement: on CUDA the allocator's peaks per phase; on the CPU (Linux) the process's peak
resident set size per phase (VmHWM, reset through /proc/self/clear_refs). Weights, adapters,
optimizer states and gradients are counted from the tensors themselves; the KV cache and the
log-prob scratch from their shapes; activations are what the update phase's peak holds above
its starting level beyond gradients and scratch.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import math
import re
import resource
import sys
from dataclasses import dataclass, field

import torch

from .arguments import need_bool, need_choice, need_int, need_number, need_target_modules, plain, refuse
from .attachments import attachments, base_model
from .config import OPTIMIZERS
from .hardware import FP16_OVERFLOWS, training_dtype
from .loss import LOSS_TYPES

CATEGORIES = ("base_weights", "trainable", "optimizer", "gradients", "activations", "logprob_scratch",
              "kv_cache", "other")
GiB = 2**30

# --------------------------------------------------------------------------------------
# Peaks


def _vm_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_memory_bytes(torch.device("cpu"))


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # high-water mark := current RSS
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _vm_hwm_bytes()
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def current_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _rss_bytes()


# --------------------------------------------------------------------------------------
# Tensor bookkeeping


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: its shard of an FSDP-sharded (DTensor) one."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    """One key per storage (tied weights share it); unlike data_ptr, also distinct on the meta device."""
    return _local(t).untyped_storage()._cdata


def model_bytes(model) -> dict:
    """Frozen weights and buffers vs trainable parameters, counted once each (tied weights too).

    bitsandbytes' 4-bit weights count their packed bytes plus their quantisation constants.
    """
    seen, frozen, trainable = set(), 0, 0
    for p in model.parameters():
        key = _storage_key(p)
        if key in seen:
            continue
        seen.add(key)
        n = _nbytes(p)
        quant_state = getattr(p, "quant_state", None)
        if quant_state is not None:
            n += sum(_nbytes(t) for t in _quant_state_tensors(quant_state))
        if p.requires_grad:
            trainable += n
        else:
            frozen += n
    frozen += sum(_nbytes(b) for b in model.buffers() if _storage_key(b) not in seen)
    return {"base_weights": frozen, "trainable": trainable}


def _quant_state_tensors(state):
    for name in ("absmax", "code"):
        t = getattr(state, name, None)
        if isinstance(t, torch.Tensor):
            yield t
    nested = getattr(state, "state2", None)
    if nested is not None:
        yield from _quant_state_tensors(nested)


def optimizer_bytes(optimizer) -> int:
    return sum(_nbytes(v) for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.numel() > 1)


def gradient_bytes(params) -> int:
    return sum(_nbytes(p.grad) for p in params if p.grad is not None)


def text_config(model_or_config):
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def kv_cache_bytes(config, batch_size: int, seq_len: int, dtype_bytes: int) -> int:
    """Keys and values of every layer for `batch_size` sequences of `seq_len` tokens."""
    cfg = text_config(config)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return 2 * cfg.num_hidden_layers * batch_size * seq_len * kv_heads * head_dim * dtype_bytes


def sampling_bytes(vocab_size: int, batch_size: int) -> int:
    """generate()'s per-step buffers: the last position's logits in fp32, processed and softmaxed."""
    return 3 * batch_size * vocab_size * 4


def logprob_scratch_bytes(rows: int, vocab_size: int, hidden_size: int, *, chunk_size: int | None = None,
                          backend: str = "torch", dtype_bytes: int = 4) -> int:
    """Working memory of the log-prob computation for `rows` completion tokens.

    grpo-nb's chunked path ("torch") holds a chunk's fp32 logits, their softmax and their
    gradient; its Triton kernels ("triton") an fp32 gradient buffer for the hidden states. TRL
    1.16's fused LM head ("trl") a [min(rows, 4096), 32768] logits tile in the compute dtype, the
    completion positions' hidden states gathered, and an fp32 gradient for them.
    """
    if backend == "trl":
        return min(rows, 4096) * 32768 * dtype_bytes + rows * hidden_size * (dtype_bytes + 4)
    if backend == "triton":
        return rows * hidden_size * 4
    from .logprobs import default_chunk_size

    chunk = min(rows, chunk_size or default_chunk_size(vocab_size))
    return 3 * chunk * vocab_size * 4


# --------------------------------------------------------------------------------------
# Measurement during training


@dataclass
class MemoryTracker:
    """Per-step memory by category; `train()` calls the phase methods, records carry `breakdown()`."""

    model: object
    optimizer: object
    device: torch.device
    _phase: dict = field(default_factory=dict)

    def start_rollout(self) -> None:
        self._phase = {}
        reset_peak_memory(self.device)

    def end_rollout(self, batch_size: int, seq_len: int) -> None:
        cfg = text_config(self.model)
        # The cache is in the compute dtype, which the (never quantised) output head carries.
        base = base_model(self.model)
        dtype_bytes = base.get_output_embeddings().weight.element_size()
        self._phase["rollout_peak"] = peak_memory_bytes(self.device)
        self._phase["kv_cache"] = (kv_cache_bytes(cfg, batch_size, seq_len, dtype_bytes)
                                   + sampling_bytes(cfg.vocab_size, batch_size))

    def start_update(self) -> None:
        offloader = attachments(self.model).offloader
        if offloader is not None:
            offloader.reset_stats()  # its peak is then this update's
        self._phase["update_start"] = current_memory_bytes(self.device)
        reset_peak_memory(self.device)

    def end_update(self, *, gradients: int, logprob_scratch: int) -> None:
        self._phase["update_peak"] = peak_memory_bytes(self.device)
        self._phase["gradients"] = gradients
        self._phase["logprob_scratch"] = logprob_scratch

    def breakdown(self) -> dict:
        ph = self._phase
        out = dict.fromkeys(CATEGORIES, 0)
        out.update(model_bytes(self.model))
        out["optimizer"] = optimizer_bytes(self.optimizer)
        out["gradients"] = ph.get("gradients", 0)
        out["logprob_scratch"] = ph.get("logprob_scratch", 0)
        out["kv_cache"] = ph.get("kv_cache", 0)
        update_peak = ph.get("update_peak", 0)
        rise = max(0, update_peak - ph.get("update_start", update_peak))
        out["activations"] = max(0, rise - out["gradients"] - out["logprob_scratch"])
        peak = max(ph.get("rollout_peak", 0), update_peak)
        static = out["base_weights"] + out["trainable"] + out["optimizer"]
        dynamic = max(out["kv_cache"], out["gradients"] + out["activations"] + out["logprob_scratch"])
        out["other"] = max(0, peak - static - dynamic)
        out["peak"] = peak
        # What stays allocated between steps (CUDA allocated / CPU resident): flat over a healthy run.
        out["current"] = current_memory_bytes(self.device)
        out["rollout_peak"] = ph.get("rollout_peak", 0)
        out["update_peak"] = update_peak
        if self.device.type == "cuda":
            out["reserved_peak"] = int(torch.cuda.max_memory_reserved(self.device))
        offloader = attachments(self.model).offloader
        if offloader is not None:
            out["offloaded_peak"] = int(offloader.stats()["peak_offloaded_bytes"])  # in CPU RAM, not in `peak`
        return out


# --------------------------------------------------------------------------------------
# Estimation before training


@dataclass
class MemoryEstimate:
    """Bytes per category (see the module docstring) for one system and configuration."""

    system: str
    categories: dict
    settings: dict

    @property
    def total(self) -> int:
        c = self.categories
        static = c["base_weights"] + c["trainable"] + c["optimizer"] + c["other"]
        return static + max(c["kv_cache"], c["gradients"] + c["activations"] + c["logprob_scratch"])

    def __getitem__(self, key):
        return self.total if key == "total" else self.categories[key]

    def table(self, other: "MemoryEstimate | None" = None) -> str:
        """A markdown table in GiB; with `other`, side by side with a ratio."""
        names = {"base_weights": "Base weights", "trainable": "Trainable (LoRA)", "optimizer": "Optimizer states",
                 "gradients": "Gradients", "activations": "Activations", "logprob_scratch": "Log-prob / loss",
                 "kv_cache": "KV cache (rollout)", "other": "Other / runtime"}
        head = f"| | {self.system} |" + (f" {other.system} | ratio |" if other else "")
        rows = [head, "|---|---:|" + ("---:|---:|" if other else "")]
        for key in (*CATEGORIES, "total"):
            a = self[key]
            line = f"| {names.get(key, '**Peak**')} | {a / GiB:.2f} GiB |"
            if other:
                b = other[key]
                line += f" {b / GiB:.2f} GiB | {b / a:.1f}x |" if a else f" {b / GiB:.2f} GiB | |"
            rows.append(line)
        return "\n".join(rows)

    def __repr__(self):
        return f"MemoryEstimate({self.system}, peak {self.total / GiB:.2f} GiB)\n" + self.table()


_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def resolve_config(model_or_config, func: str = "estimate_vram"):
    """A transformers config from a model, a config, a hub-style config dict or a model name."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_or_config, PretrainedConfig):
        return model_or_config
    if isinstance(model_or_config, dict):
        entry = copy.deepcopy(model_or_config)  # transformers fills in nested dicts (rope_scaling) in place
        if "model_type" not in entry:
            raise ValueError(f"{func}: a config dict needs its 'model_type' (as in config.json), e.g. 'llama'")
        # config.json holds numbers as numbers; a string ('64') fails deep inside transformers
        strings = {k: v for k, v in entry.items() if isinstance(v, str) and is_number(v)}
        if strings:
            key, value = next(iter(strings.items()))
            raise ValueError(f"{func}: the config dict's {key}={value!r} is a string, and the sizes of a "
                             f"config are numbers: {key}={value.strip()}. Convert them (e.g. load config.json with "
                             f"json.load), or pass transformers.AutoConfig.from_pretrained(name).")
        check_config_dict(func, entry)
        return _read_config(func, "the config dict", lambda: AutoConfig.for_model(entry.pop("model_type"), **entry))
    if isinstance(model_or_config, str):
        from .architectures import known_config

        try:
            return known_config(model_or_config)
        except KeyError:
            return _config_from_pretrained(func, model_or_config)
    cfg = getattr(model_or_config, "config", None)
    if cfg is None:
        raise ValueError(f"{func}: expected a model, a config, a config dict or a model name, "
                         f"got {type(model_or_config).__name__}")
    return cfg


def _config_from_pretrained(func: str, name: str):
    """The config of a folder or Hub id, read as data. The planner only needs its sizes, so it never runs
    the folder's own code (config.json's auto_map), nor asks whether to: transformers would prompt for it."""
    from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

    try:
        entry, _ = PretrainedConfig.get_config_dict(name)
    except OSError as err:
        raise ValueError(f"{func}: no config for {name!r}: not a built-in architecture and not loadable ({err}). "
                         f"Pass the model's config (or its config.json as a dict).") from None
    model_type = entry.get("model_type")
    if model_type not in CONFIG_MAPPING and "auto_map" in entry:
        raise ValueError(f"{func}: the config of {name!r} needs custom code (its config.json's auto_map, "
                         f"model_type={model_type!r}), and the planner does not run a folder's code. Pass a config "
                         f"dict of its sizes instead: {{'model_type': 'llama' (or the transformers architecture it "
                         f"follows), 'vocab_size': ..., 'hidden_size': ..., 'intermediate_size': ..., "
                         f"'num_hidden_layers': ..., 'num_attention_heads': ..., 'num_key_value_heads': ...}}.")
    # trust_remote_code=False: a known model_type is read by transformers' own class, auto_map or not.
    return _read_config(func, f"the config of {name!r}",
                        lambda: AutoConfig.from_pretrained(name, trust_remote_code=False))


def _read_config(func: str, what: str, read):
    """`read()`'s config; what transformers raises on a value it cannot use, as the config's fault, by name."""
    try:
        return read()
    except Exception as err:  # strict dataclass checks, unknown model types, dtypes torch lacks ...
        raise ValueError(f"{func}: {what} is invalid: transformers refused it ({type(err).__name__}: "
                         f"{err}). Check its values against the model's config.json.") from err


# The sizes the estimate reads off a config (by their standard names; a model type may spell them its own way,
# e.g. GPT-2's n_embd, through its config class's attribute_map).
CONFIG_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def check_config_dict(func: str, entry: dict) -> None:
    """A config.json-style dict gives every size the estimate needs, each a positive integer.

    transformers would fill a missing size with its defaults for the model type (Llama-7B's for
    'llama'), so a dict with only `hidden_size` would be estimated as another model.
    """
    from transformers import CONFIG_MAPPING

    sizes = entry["text_config"] if isinstance(entry.get("text_config"), dict) else entry
    model_type = sizes.get("model_type", entry["model_type"])
    aliases = getattr(CONFIG_MAPPING[model_type], "attribute_map", {}) if model_type in CONFIG_MAPPING else {}
    spelt = {name: aliases.get(name, name) for name in CONFIG_SIZES}
    missing = [key for name, key in spelt.items() if name not in sizes and key not in sizes]
    if missing:
        raise ValueError(f"{func}: the config dict has no {', '.join(missing)}, which the estimate needs; "
                         f"transformers would fill {'it' if len(missing) == 1 else 'them'} with its defaults for "
                         f"'{model_type}' (another model's sizes). Give every size as in the model's config.json "
                         f"(json.load it whole), or pass transformers.AutoConfig.from_pretrained(name).")
    values = {name: sizes.get(name, sizes.get(key)) for name, key in spelt.items()}
    values.update({k: sizes[k] for k in ("num_key_value_heads", "head_dim") if sizes.get(k) is not None})
    check_config_sizes(func, values)
    for key in ("rope_scaling", "rope_parameters"):  # the rest of them is checked on the config built from it
        if not isinstance(sizes.get(key), (dict, type(None))):
            raise ValueError(f"{func}: the config's {key}={sizes[key]!r} is invalid: expected a dict such as "
                             f"{{'rope_type': 'linear', 'factor': 2.0}}, or None, as in the model's config.json.")


# Sizes beyond any real model (the largest released ones have ~130 layers and weight matrices of ~2e9 values). The
# planner builds every layer on the meta device, ~1 ms each, and a simulation runs them all: a typo such as
# num_hidden_layers=100_000 would take minutes and gigabytes, and a weight beyond 2**40 values is likelier to
# overflow torch's size arithmetic than to be meant.
MAX_LAYERS = 1000
MAX_WEIGHT_VALUES = 2**40


def check_config_sizes(func: str, sizes: dict) -> None:
    """Every size a positive integer within any real model's, and the attention heads that split the width evenly."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{func}: the config's {name}={value!r} is invalid: expected an integer >= 1, as in "
                             f"the model's config.json.")
    heads, kv_heads = sizes["num_attention_heads"], sizes.get("num_key_value_heads")
    if sizes.get("head_dim") is None and sizes["hidden_size"] % heads:
        raise ValueError(f"{func}: the config's num_attention_heads={heads} does not divide its "
                         f"hidden_size={sizes['hidden_size']}: each head gets hidden_size / num_attention_heads "
                         f"dimensions (or give head_dim, as in the model's config.json).")
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(f"{func}: the config's num_key_value_heads={kv_heads} does not divide its "
                         f"num_attention_heads={heads}: each key/value head serves a whole group of query heads.")
    if sizes["num_hidden_layers"] > MAX_LAYERS:
        raise ValueError(f"{func}: the config's num_hidden_layers={sizes['num_hidden_layers']} is invalid: expected at "
                         f"most {MAX_LAYERS:,}, beyond any real model (the largest have ~130 layers); planning it "
                         f"would build every layer, for minutes. Check the config for a typo.")
    head_dim = sizes.get("head_dim") or sizes["hidden_size"] // heads
    weights = {("vocab_size", "hidden_size"): sizes["vocab_size"] * sizes["hidden_size"],
               ("hidden_size", "intermediate_size"): sizes["hidden_size"] * sizes["intermediate_size"],
               ("num_attention_heads", "head_dim", "hidden_size"): heads * head_dim * sizes["hidden_size"]}
    for names, values in weights.items():
        if values > MAX_WEIGHT_VALUES:
            product = " x ".join(f"{n}={head_dim if n == 'head_dim' else sizes[n]}" for n in names)
            raise ValueError(f"{func}: the config's {product} make a weight of {values:.3g} values, beyond any real "
                             f"model (the largest hold ~2e9; at most 2**40 = {MAX_WEIGHT_VALUES:.3g} here). Check "
                             f"the config for a typo.")


def context_window(cfg) -> int | None:
    """The model's context window in tokens (its config's max_position_embeddings); None where it has none."""
    return getattr(text_config(cfg), "max_position_embeddings", None)


def check_context(func: str, cfg, max_prompt_length: int, max_completion_length: int) -> None:
    """Prompt and completion within the model's context window: beyond it, the run would use positions the
    model never saw (and train() refuses it), so an estimate of it would plan a run that cannot happen."""
    context = context_window(cfg)
    if context and max_prompt_length + max_completion_length > context:
        fix = (f"lower max_completion_length to {context - max_prompt_length} or less" if context > max_prompt_length
               else f"lower max_prompt_length below {context}")
        raise ValueError(f"{func}(max_prompt_length={max_prompt_length}, max_completion_length="
                         f"{max_completion_length}) is invalid: {max_prompt_length} + {max_completion_length} = "
                         f"{max_prompt_length + max_completion_length} tokens is beyond the model's context window "
                         f"of {context} (its config's max_position_embeddings): {fix}.")


def planner_config(func: str, model_or_config):
    """The text config the planner sizes, from anything `estimate_vram` takes, its sizes, rotary scaling and
    attention window checked (a folder's config.json and a loaded model's config as much as a dict)."""
    cfg = text_config(resolve_config(model_or_config, func))
    sizes = {name: getattr(cfg, name, None) for name in CONFIG_SIZES}
    sizes.update({k: getattr(cfg, k) for k in ("num_key_value_heads", "head_dim") if getattr(cfg, k, None) is not None})
    check_config_sizes(func, sizes)
    check_rope(func, cfg)
    window = getattr(cfg, "sliding_window", None)
    used = getattr(cfg, "use_sliding_window", True) is not False  # Qwen2-MoE stores 0 for a window it does not use
    if used and window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        # 0 would mask every key, the query's own too: attention over nothing
        raise ValueError(f"{func}: the config's sliding_window={window!r} is invalid: expected an integer >= 1 (the "
                         f"tokens each position attends to), or None for full attention, as in the model's "
                         f"config.json.")
    return cfg


def check_rope(func: str, cfg) -> None:
    """The rotary scaling a model type can build: a rope_type transformers knows, a numeric factor >= 1.

    Scaling stretches the trained positions over a longer context, so a factor below 1 (or negative) has
    no meaning; transformers only logs it, and a type it lacks fails inside the model's code.
    """
    rope = getattr(cfg, "rope_parameters", None) or {}
    nested = cfg.nested_rope_parameter_keys(rope) if hasattr(cfg, "nested_rope_parameter_keys") else []
    known = sorted(re.findall(r"^_validate_(\w+)_rope_parameters$", "\n".join(dir(cfg)), re.M))
    for layer_type, params in ({k: rope[k] for k in nested} if nested else {None: rope}).items():
        if not params:
            continue
        key = "rope_parameters" + (f"[{layer_type!r}]" if layer_type else "")
        where = f"{func}: the config's {key} (rope_scaling in config.json files before transformers 5)"
        if not isinstance(params, dict):
            raise ValueError(f"{where} is {params!r}: expected a dict such as {{'rope_type': 'linear', "
                             f"'factor': 2.0}}, or None, as in the model's config.json.")
        kind = params.get("rope_type", params.get("type", "default"))
        if known and kind not in known:
            raise ValueError(f"{where} has rope_type={kind!r}, which this transformers does not know: expected one of "
                             f"{', '.join(map(repr, known))} (a config.json from a newer transformers? upgrade it, or "
                             f"plan with the rope_type the model's documentation gives).")
        factor = params.get("factor")
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                   or not math.isfinite(factor) or factor < 1):
            raise ValueError(f"{where} has factor={factor!r}: expected a number >= 1 (how many times the trained "
                             f"context the scaling stretches it to), as in the model's config.json.")


def _matches(name: str, target_modules) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    if target_modules == "all-linear":
        return leaf != "lm_head"
    if isinstance(target_modules, str):
        import re

        return re.fullmatch(target_modules, name) is not None
    return leaf in target_modules


def build_on_meta(func: str, config, dtype: torch.dtype):
    """The architecture of `config` on the meta device: no weights are allocated.

    In `dtype`, the one the planner plans: the config's own (the checkpoint's storage dtype, float8 in some
    files) is not what setup_reasoning_model loads in. Building reads every value the model type uses, so
    one it cannot use is named as the config's, not left as an error from inside transformers.
    """
    from transformers import AutoModelForCausalLM

    def build():
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)

    return _read_config(func, "the config", build)


def _parameter_counts(config, lora_rank, target_modules) -> dict:
    """Counts from the architecture built on the meta device: no weights are allocated."""
    model = build_on_meta("estimate_vram", config, torch.float32)
    out_emb = model.get_output_embeddings()
    linear = lora = other = 0
    seen = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not out_emb:
            linear += module.weight.numel()
            seen.add(id(module.weight))
            if module.bias is not None:
                other += module.bias.numel()
                seen.add(id(module.bias))
            if lora_rank and _matches(name, target_modules):
                lora += lora_rank * (module.in_features + module.out_features)
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            other += p.numel()
    other += sum(b.numel() for b in model.buffers())  # rotary frequencies and the like
    return {"linear": linear, "other": other, "lora": lora, "total": linear + other}


# What each setting of estimate_vram, simulate_step and plan_for_gpu may be: one table, so the three refuse a bad
# value alike and before any work (a simulation can run for minutes). Sizes are counts of tokens or completions:
# integers >= 1, None where None means a default (per_device_train_batch_size=None: all completions at once).
PLANNER_ARGUMENTS = {
    "max_prompt_length": (need_int, {"low": 1}),
    "max_completion_length": (need_int, {"low": 1}),
    "num_generations": (need_int, {"low": 1}),
    "prompts_per_step": (need_int, {"low": 1}),
    "per_device_train_batch_size": (need_int, {"low": 1, "optional": True}),
    "lora_rank": (need_int, {"low": 1, "optional": True}),
    "logprob_chunk_size": (need_int, {"low": 1, "optional": True}),
    "rollout_max_rows": (need_int, {"low": 1, "optional": True}),
    "num_iterations": (need_int, {"low": 1}),
    "beta": (need_number, {"low": 0}),
    "load_in_4bit": (need_bool, {}),
    "rollout": (need_bool, {}),
    "target_modules": (need_target_modules, {}),
    "dtype": (need_choice, {"choices": tuple(_DTYPE_BYTES)}),
    "gradient_checkpointing": (need_choice, {"choices": ("offload", True, False)}),
    "logprob_backend": (need_choice, {"choices": ("auto", "torch", "triton")}),
    "system": (need_choice, {"choices": ("grpo_nb", "trl")}),
    "device": (need_choice, {"choices": ("cuda", "cpu")}),
    "optim": (need_choice, {"choices": OPTIMIZERS}),
    "loss_type": (need_choice, {"choices": LOSS_TYPES}),
}


def check_planner_arguments(func: str, **arguments) -> None:
    """`func`'s settings checked by `PLANNER_ARGUMENTS`, the same messages from all three planner functions."""
    for name, value in arguments.items():
        check, limits = PLANNER_ARGUMENTS[name]
        check(func, name, value, **limits)
    if arguments.get("load_in_4bit") and arguments.get("lora_rank", 16) is None:
        refuse(func, "lora_rank", None, "an integer >= 1 with load_in_4bit=True: load_in_4bit needs lora_rank "
               "(QLoRA trains adapters on a 4-bit base), e.g. lora_rank=16; or load_in_4bit=False to plan full "
               "fine-tuning")
    if arguments.get("dtype") in ("fp16", "float16") and "lora_rank" in arguments and arguments["lora_rank"] is None:
        refuse(func, "dtype", arguments["dtype"], "'fp32' or 'bf16' with lora_rank=None: full fine-tuning trains the "
               "weights themselves, and float16 weights cannot hold the small updates (train() refuses them). Plan "
               "LoRA (lora_rank=16), or full fine-tuning in fp32 (what a GPU without native bf16 trains it in)")


def estimate_vram(
    model_or_config,
    *,
    max_prompt_length: int = 256,
    max_completion_length: int = 256,
    num_generations: int = 8,
    prompts_per_step: int = 1,
    per_device_train_batch_size: int | None = None,
    load_in_4bit: bool = False,
    lora_rank: int | None = 16,
    target_modules="all-linear",
    dtype: str = "bf16",
    gradient_checkpointing: bool | str = "offload",
    logprob_backend: str = "auto",
    logprob_chunk_size: int | None = None,
    system: str = "grpo_nb",
    device: str = "cuda",
    rollout_max_rows: int | None = None,
    optim: str = "adamw_torch",
) -> MemoryEstimate:
    """Peak memory by category for a GRPO run, without loading any weights, in a fraction of a second.

    Args:
        model_or_config: a loaded model, a transformers config, a config.json-style dict, or a
            model name (built-in shapes in `grpo_nb.architectures`, else `AutoConfig.from_pretrained`).
        max_prompt_length, max_completion_length: the token lengths the run will use (worst case).
        num_generations, prompts_per_step: one step generates `prompts_per_step * num_generations`
            completions.
        per_device_train_batch_size: completions per micro-batch in the policy update (default:
            all of them, as in GRPOConfig's default of 8 with 8 generations).
        load_in_4bit, lora_rank, target_modules: as in `setup_reasoning_model`.
        dtype: "bf16", "fp16" or "fp32" compute dtype.
        gradient_checkpointing: "offload" (layer inputs in CPU RAM), True (kept on the device) or False.
        logprob_backend: "auto" (the Triton kernels on CUDA), "torch" (chunked) or "triton".
        system: "grpo_nb", or "trl" for TRL 1.16's GRPOTrainer on a GPU: its fused, chunked LM head
            (no full logits), plain gradient checkpointing, bf16 autocast, QLoRA adapters cast to
            bf16, HF generate's growing KV cache.
        device: "cuda" or "cpu"; on the CPU, `other` holds the Python/torch runtime.
        rollout_max_rows: completions decoded at once (`GRPOConfig.rollout_max_rows`; grpo-nb only).
        optim: `GRPOConfig.optim`; the 8-bit optimizers keep ~2 bytes of state per trainable parameter.

    On CUDA the result is the allocation peak (what `torch.cuda.max_memory_allocated` reports);
    `plan_for_gpu` adds the CUDA context and the allocator's fragmentation (`usable_gpu_bytes`).
    The activation terms are fitted to the real step run on the meta device (`grpo_nb.simulate`)
    at Qwen2.5-0.5B/1.5B, Llama-3.2-1B and Llama-3.1-8B shapes; `tests/test_memory_accounting.py`
    holds them within 10% of the simulation.
    """
    check_planner_arguments("estimate_vram", max_prompt_length=max_prompt_length,
                            max_completion_length=max_completion_length, num_generations=num_generations,
                            prompts_per_step=prompts_per_step, per_device_train_batch_size=per_device_train_batch_size,
                            load_in_4bit=load_in_4bit, lora_rank=lora_rank, target_modules=target_modules, dtype=dtype,
                            gradient_checkpointing=gradient_checkpointing, logprob_backend=logprob_backend,
                            logprob_chunk_size=logprob_chunk_size, system=system, device=device,
                            rollout_max_rows=rollout_max_rows, optim=optim)
    cfg = planner_config("estimate_vram", model_or_config)
    check_context("estimate_vram", cfg, max_prompt_length, max_completion_length)
    s = _DTYPE_BYTES[dtype]
    counts = _parameter_counts(cfg, lora_rank, target_modules)
    n_gen = prompts_per_step * num_generations
    micro = min(per_device_train_batch_size or n_gen, n_gen)
    seq = max_prompt_length + max_completion_length
    hidden, layers, inter, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    trl = system == "trl"
    if logprob_backend == "auto":
        logprob_backend = "triton" if device == "cuda" else "torch"

    c = dict.fromkeys(CATEGORIES, 0)
    if load_in_4bit:
        # NF4: half a byte per weight, one 8-bit absmax per 64 weights (double quantised) plus
        # an fp32 constant per 256 blocks; everything that isn't a decoder Linear stays in `dtype`.
        q = counts["linear"]
        c["base_weights"] = q // 2 + q // 64 + (q // (64 * 256)) * 4 + counts["other"] * s
    else:
        c["base_weights"] = counts["total"] * s
    if lora_rank:
        # peft keeps adapters in fp32 over a 16-bit base; TRL casts QLoRA adapters to bf16.
        trainable_bytes = counts["lora"] * (2 if trl and load_in_4bit else 4)
    else:
        trainable_bytes = counts["total"] * s
        c["base_weights"] = 0
    c["trainable"] = trainable_bytes
    c["optimizer"] = optimizer_state_bytes(optim, counts["lora"] if lora_rank else counts["total"], trainable_bytes)
    c["gradients"] = trainable_bytes

    # The policy update's activations for one micro-batch of `tokens` tokens, at their worst moment
    # (inside one decoder layer's recompute and backward), in units of a [tokens, hidden] tensor.
    tokens = micro * seq
    if trl:
        # TRL: the whole MLP at once, LoRA branches in fp32 under autocast (bf16 for QLoRA).
        per_token = (13.1 * hidden + 5.45 * inter) if load_in_4bit else (24.0 * hidden + 5.69 * inter)
        layer_moment = tokens * per_token * s
    else:
        # grpo-nb: LoRA without fp32 copies (grpo_nb.lora), RMSNorm without fp32 copies
        # (grpo_nb.rms_norm), the MLP a tile of tokens at a time (grpo_nb.tiled_mlp).
        from .tiled_mlp import DEFAULT_TILE_TOKENS

        layer_moment = (11.4 * tokens * hidden + 8.2 * min(tokens, DEFAULT_TILE_TOKENS) * inter) * s
    offloaded = gradient_checkpointing == "offload" and not trl and device == "cuda"
    if gradient_checkpointing is False:
        c["activations"] = layers * layer_moment
    else:
        # Checkpointed layer inputs: all of them on the device, or (offloaded) the one being
        # recomputed and the one prefetched, whose two copies the layer moment above includes.
        c["activations"] = layer_moment + (0 if offloaded else max(0, layers - 2) * tokens * hidden * s)
    rows = micro * max_completion_length
    scratch = logprob_scratch_bytes(rows, vocab, hidden, chunk_size=logprob_chunk_size,
                                    backend="trl" if trl else logprob_backend, dtype_bytes=s)
    # The log-prob pass comes after the layers' forward and before their backward: its scratch adds
    # to the final hidden states and the checkpointed inputs, and counts only beyond the layers' moment.
    logprob_moment = 3 * tokens * hidden * s + scratch
    c["logprob_scratch"] = max(0, logprob_moment - layer_moment)
    kv_rows = n_gen if trl else min(n_gen, rollout_max_rows or n_gen)
    kv_s = max(s, 2) if device == "cuda" else s
    c["kv_cache"] = kv_cache_bytes(cfg, kv_rows, seq, kv_s) + sampling_bytes(vocab, kv_rows)
    if trl:  # generate() grows its cache a column at a time: a new tensor beside the old one, per layer
        c["kv_cache"] += kv_cache_bytes(cfg, kv_rows, seq, kv_s) // layers // 2
    # CPU: the interpreter, torch and transformers themselves (on CUDA the context is outside the
    # allocator's count: plan_for_gpu's usable_gpu_bytes takes it off the card instead).
    c["other"] = _CPU_RUNTIME if device == "cpu" else 0
    settings = dict(max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
                    num_generations=num_generations, prompts_per_step=prompts_per_step,
                    per_device_train_batch_size=micro, load_in_4bit=load_in_4bit, lora_rank=lora_rank,
                    dtype=dtype, gradient_checkpointing=gradient_checkpointing, logprob_backend=logprob_backend,
                    device=device, rollout_max_rows=rollout_max_rows, optim=optim, parameters=counts["total"],
                    lora_parameters=counts["lora"])
    return MemoryEstimate(system, {k: int(v) for k, v in c.items()}, settings)


def optimizer_state_bytes(optim: str, parameters: int, parameter_bytes: int) -> int:
    """AdamW's two moments: torch keeps them in the parameters' dtype, bitsandbytes' 32-bit ones in fp32,
    its 8-bit ones as one byte each plus an fp32 scale per block of 256 values."""
    if "8bit" in optim:
        return 2 * (parameters + 4 * -(-parameters // 256))
    return 2 * 4 * parameters if optim == "paged_adamw_32bit" else 2 * parameter_bytes


# Resident memory of a process that has imported torch, transformers and peft (measured on
# Linux x86-64, torch 2.13 CPU): part of `other` in CPU estimates.
_CPU_RUNTIME = 600 * 2**20


# --------------------------------------------------------------------------------------
# Planning for a GPU

GPU_MEMORY_GIB = {
    "T4": 15.0, "P100": 16.0, "V100": 16.0, "V100-32GB": 32.0, "L4": 22.5, "A10G": 22.5, "A10": 22.5,
    "RTX3090": 24.0, "RTX4090": 24.0, "A100": 40.0, "A100-40GB": 40.0, "A100-80GB": 80.0, "L40S": 45.0,
    "H100": 80.0, "H200": 141.0,
}
# Compute capability of each card above: from 8.0 (Ampere) a card computes bf16 natively and the planner
# plans in bf16; older cards (P100, V100, T4) train in fp16, as setup_reasoning_model's dtype="auto" picks.
GPU_CAPABILITY = {
    "T4": (7, 5), "P100": (6, 0), "V100": (7, 0), "V100-32GB": (7, 0), "L4": (8, 9), "A10G": (8, 6), "A10": (8, 6),
    "RTX3090": (8, 6), "RTX4090": (8, 9), "A100": (8, 0), "A100-40GB": (8, 0), "A100-80GB": (8, 0), "L40S": (8, 9),
    "H100": (9, 0), "H200": (9, 0),
}
MAX_GPU_GIB = 1024  # a number above this is not a GiB count of any card


def gpu_memory_gib(gpu: str) -> float:
    """A card's memory from its name (see `catalogued_gpu`)."""
    return GPU_MEMORY_GIB[catalogued_gpu(gpu)]


def gpu_dtype(gpu: str, *, full_fine_tuning: bool = False, model_type: str | None = None) -> str:
    """The compute dtype a catalogued card trains in (`hardware.training_dtype`): "bf16" where it is native,
    else "fp16", or "fp32" for full fine-tuning and for model types that overflow fp16 (Gemma 2 / 3)."""
    dtype = training_dtype(GPU_CAPABILITY[catalogued_gpu(gpu)], full_fine_tuning=full_fine_tuning,
                           model_type=model_type)
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def catalogued_gpu(gpu: str) -> str:
    """The key of `GPU_MEMORY_GIB` a card's name means: a key itself ("T4", "A100-80GB"), or the name
    torch.cuda.get_device_name() reports ("Tesla T4", "NVIDIA A100-SXM4-80GB") when it matches one
    card of the table only (or several of the same memory and capability)."""
    known = {k.upper(): k for k in GPU_MEMORY_GIB}
    key = str(gpu).upper().replace(" ", "").replace("NVIDIA", "")
    if key in known:
        return known[key]
    # "NVIDIA GeForce RTX 4090" -> NVIDIA, GEFORCE, RTX, 4090, and RTX4090 from neighbours
    words = re.split(r"[\s_-]+", str(gpu).upper())
    words += [a + b for a, b in zip(words, words[1:])]
    found = {k: v for k, v in known.items() if k.split("-")[0] in words}
    # a size in the name ("A100-SXM4-80GB") picks the entry of that size
    sized = {k: v for k, v in found.items() if "-" in k and k.split("-", 1)[1] in words}
    found = sized or {k: v for k, v in found.items() if "-" not in k}
    if len({(GPU_MEMORY_GIB[v], GPU_CAPABILITY[v]) for v in found.values()}) == 1:
        return next(iter(found.values()))
    refuse("plan_for_gpu", "gpu", gpu, f"a GPU name, one of {sorted(GPU_MEMORY_GIB)}"
           + (f" (this name matches {sorted(found)}, which differ in memory)" if found else "")
           + ", or the card's memory in GiB as a number, e.g. plan_for_gpu(24)")


# The CUDA context and cuBLAS/cuDNN workspaces live outside torch's allocator.
_CUDA_CONTEXT_GIB = 0.6


def usable_gpu_bytes(gpu_gib: float, headroom: float = 0.1) -> int:
    """What of a card's memory a run's allocation peak may take.

    The card's memory less the CUDA context and library workspaces (0.6 GiB: a CUDA 12 context
    with PyTorch's kernels loaded takes 0.3-0.5 GiB, cuBLAS keeps up to 32 MiB of workspace per
    stream on Hopper, cuDNN and NCCL some more), then less `headroom` of the rest for the caching
    allocator's rounding and fragmentation (its reserved memory runs 5-10% above what is
    allocated in steady training). `plan_for_gpu` and the simulation's fit search both use it.
    """
    return int((gpu_gib - _CUDA_CONTEXT_GIB) * (1 - headroom) * GiB)


@dataclass
class Plan:
    gpu: str
    budget_bytes: int
    fits: bool
    settings: dict
    estimate: MemoryEstimate | None
    tried: list
    simulated: object = None  # the plan's step run on the meta device (grpo_nb.simulate), with simulate=True
    notes: list = field(default_factory=list)  # what the plan assumed or left out, in words

    def __repr__(self):
        if not self.fits:
            line = f"Plan({self.gpu}: nothing tried fits in {self.budget_bytes / GiB:.1f} GiB)"
        else:
            s = self.settings
            checked = f", simulated {self.simulated.peak / GiB:.2f} GiB" if self.simulated is not None else ""
            line = (f"Plan({self.gpu}, {self.budget_bytes / GiB:.1f} GiB usable): load_in_4bit={s['load_in_4bit']}, "
                    f"num_generations={s['num_generations']}, max_completion_length={s['max_completion_length']} "
                    f"-> estimated peak {self.estimate.total / GiB:.2f} GiB{checked}")
        return "\n".join([line, *(f"Note: {note}" for note in self.notes)])


# The completion lengths the planner tries, longest first (plan_for_gpu, and the advice after out of memory).
COMPLETION_LENGTHS = (32768, 16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64)
GENERATION_COUNTS = (16, 12, 8, 6, 4, 2)


def plan_for_gpu(
    gpu: str | float = "T4",
    model_or_config="Qwen/Qwen2.5-1.5B-Instruct",
    *,
    max_prompt_length: int = 256,
    num_generations=GENERATION_COUNTS[:-1],
    max_completion_length=tuple(n for n in COMPLETION_LENGTHS if n >= 256),
    load_in_4bit=(False, True),
    headroom: float = 0.1,
    simulate: bool = False,
    **estimate_kwargs,
) -> Plan:
    """The longest completions (then the most generations, then 16-bit over 4-bit) that fit on `gpu`.

    Args:
        gpu: a name in `GPU_MEMORY_GIB` ("T4", "A100-80GB", ...) or the card's memory in GiB. A named
            card is planned in the dtype it trains in (`GPU_CAPABILITY`: bf16 from compute capability
            8.0; before, fp16 under LoRA and fp32 for full fine-tuning, as `setup_reasoning_model`
            picks) unless `dtype` is given. A size names no card, so no compute capability: it is
            planned in `dtype` (default bf16), and the plan's notes say so.
        model_or_config: anything `estimate_vram` takes.
        headroom: fraction of the card kept free for fragmentation and spikes.
        simulate: check the planner's choice by running the real step at that size on the meta
            device (`grpo_nb.simulate.simulate_step`, no GPU needed; seconds per try at a few
            thousand tokens, minutes at tens of thousands); a choice whose
            simulated peak does not fit falls through to the next candidate. The plan then carries
            the simulated step (`plan.simulated`: its categories, phases and largest allocations),
            which the widgets' `vram_figure(planned=plan.simulated)` draws.
        Candidates for `num_generations`, `max_completion_length` and `load_in_4bit` are tried
        longest completion first (those beyond the model's context window beside `max_prompt_length`
        are left out, and the plan's notes say so); the other keyword arguments go to `estimate_vram`.
    """
    as_tuple = lambda v: tuple(v) if isinstance(v, (list, tuple, range)) else (v,)  # noqa: E731
    # Every candidate and setting is checked before the first (possibly minutes-long, simulated) try.
    unknown = [k for k in estimate_kwargs if k not in inspect.signature(estimate_vram).parameters]
    if unknown:
        close = difflib.get_close_matches(unknown[0], inspect.signature(estimate_vram).parameters, n=1)
        raise TypeError(f"plan_for_gpu({unknown[0]}={estimate_kwargs[unknown[0]]!r}) is invalid: plan_for_gpu passes "
                        f"its other keyword arguments to estimate_vram, which has no argument {unknown[0]!r}."
                        + (f" Did you mean {close[0]}?" if close else ""))
    for arg, values in (("max_completion_length", max_completion_length), ("num_generations", num_generations),
                        ("load_in_4bit", load_in_4bit)):
        if not as_tuple(values):
            refuse("plan_for_gpu", arg, values, "a value or a non-empty list of candidates")
        for value in as_tuple(values):
            check_planner_arguments("plan_for_gpu", **{arg: value})
    check_planner_arguments("plan_for_gpu", max_prompt_length=max_prompt_length, **estimate_kwargs)
    if True in as_tuple(load_in_4bit):
        check_planner_arguments("plan_for_gpu", load_in_4bit=True, lora_rank=estimate_kwargs.get("lora_rank", 16))
    need_number("plan_for_gpu", "headroom", headroom, 0, 1, high_open=True)
    need_bool("plan_for_gpu", "simulate", simulate)
    if simulate and estimate_kwargs.get("optim", "adamw_torch") != "adamw_torch":
        refuse("plan_for_gpu", "optim", estimate_kwargs["optim"], "'adamw_torch' with simulate=True: the meta device "
               "runs torch's AdamW, not bitsandbytes' kernels (plan with simulate=False for the 8-bit states)")
    cfg = planner_config("plan_for_gpu", model_or_config)
    lengths, notes = completions_in_context(cfg, max_prompt_length, as_tuple(max_completion_length))
    gpu = plain(gpu)  # np.float32(15) is a size too
    if isinstance(gpu, (int, float)) and not isinstance(gpu, bool):
        need_number("plan_for_gpu", "gpu", gpu, 0, low_open=True)
        if gpu > MAX_GPU_GIB:  # no card comes near; torch's total_memory and nvidia-smi give bytes and MiB
            unit, size = ("bytes", gpu / GiB) if gpu >= GiB else ("MiB (as nvidia-smi shows it)", gpu / 1024)
            refuse("plan_for_gpu", "gpu", gpu, f"the card's memory in GiB, e.g. 16, or a name such as 'T4'; "
                   f"{gpu:g} looks like {unit}, which is {size:.1f} GiB: plan_for_gpu({size:.1f})")
        if gpu <= _CUDA_CONTEXT_GIB:
            refuse("plan_for_gpu", "gpu", gpu, f"more than the {_CUDA_CONTEXT_GIB} GiB that the CUDA context and its "
                   f"libraries take on any card before the first tensor: {gpu:g} GiB leaves nothing for the run")
        name, gib = f"{gpu:g} GiB GPU", float(gpu)
        if "dtype" not in estimate_kwargs:
            notes.append(f"{gpu:g} GiB is a size, not a card, so it has no compute capability: planned in bf16 "
                         f"(compute capability 8.0+). On a T4 or V100 LoRA trains in fp16 (the same memory) and full "
                         f"fine-tuning in fp32: pass the card's name, e.g. plan_for_gpu('T4'), or dtype=")
    else:
        name, gib = str(gpu), gpu_memory_gib(gpu)
        # A card without native bf16 (T4, V100) trains LoRA in fp16 and full fine-tuning in fp32, as
        # setup_reasoning_model's dtype="auto" picks; fp32 too for Gemma 2 / 3, which overflow fp16.
        model_type, picked = getattr(cfg, "model_type", None), "dtype" not in estimate_kwargs
        estimate_kwargs.setdefault("dtype", gpu_dtype(gpu, full_fine_tuning=estimate_kwargs.get("lora_rank", 16) is None,
                                                      model_type=model_type))
        if picked and estimate_kwargs["dtype"] == "fp32" and model_type in FP16_OVERFLOWS:
            notes.append(f"planned in fp32: {model_type} models overflow fp16 and {name} has no native bf16")
    budget = usable_gpu_bytes(gib, headroom)
    tried = []
    for length in sorted(lengths, reverse=True):
        for gens in sorted(as_tuple(num_generations), reverse=True):
            for q in sorted(as_tuple(load_in_4bit)):  # 16-bit first: better quality when it fits
                est = estimate_vram(model_or_config, max_prompt_length=max_prompt_length,
                                    max_completion_length=length, num_generations=gens, load_in_4bit=q,
                                    **estimate_kwargs)
                tried.append((length, gens, q, est.total))
                if est.total > budget:
                    continue
                if not simulate:
                    return Plan(name, budget, True, dict(est.settings), est, tried, notes=notes)
                from .simulate import simulate_step

                simulated = simulate_step(model_or_config, max_prompt_length=max_prompt_length,
                                          max_completion_length=length, num_generations=gens, load_in_4bit=q,
                                          **estimate_kwargs)
                if simulated.peak <= budget:
                    return Plan(name, budget, True, dict(est.settings), est, tried, simulated, notes=notes)
    return Plan(name, budget, False, {}, None, tried, notes=notes)


def completions_in_context(cfg, max_prompt_length: int, lengths) -> tuple[list, list]:
    """The candidate completion lengths that fit beside the prompt in the model's context window, and a
    note naming those left out; refused when none does."""
    context = context_window(cfg)
    room = context - max_prompt_length if context else math.inf
    if room < 1:
        refuse("plan_for_gpu", "max_prompt_length", max_prompt_length, f"less than the model's context window of "
               f"{context} tokens (its config's max_position_embeddings), leaving room for the completion")
    fitting, beyond = [n for n in lengths if n <= room], sorted((n for n in lengths if n > room), reverse=True)
    if not fitting:
        refuse("plan_for_gpu", "max_completion_length", lengths if len(lengths) > 1 else lengths[0],
               f"at most {room} tokens: the model's context window of {context} (its config's "
               f"max_position_embeddings) less max_prompt_length={max_prompt_length}")
    notes = [f"max_completion_length {', '.join(map(str, beyond))} not tried: beyond the model's context window of "
             f"{context} tokens (its config's max_position_embeddings) beside max_prompt_length={max_prompt_length}"
             ] if beyond else []
    return fitting, notes


def completion_steps_in_context(model_or_config, max_prompt_length: int, step: int) -> int:
    """How many `step`s of completion fit beside the prompt in the model's context window."""
    context = context_window(resolve_config(model_or_config)) or 2**20
    return (context - max_prompt_length) // step


def longest_completion(gpu_gib: float, model_or_config, *, system: str = "grpo_nb", lengths=None, step: int = 256,
                       headroom: float = 0.1, **estimate_kwargs) -> int:
    """The longest max_completion_length whose estimate fits a `gpu_gib` card (0 if none).

    The card's usable memory is `usable_gpu_bytes(gpu_gib, headroom)`. Candidates are `lengths`, or
    by default every multiple of `step` that leaves the prompt room in the model's context window
    (searched by doubling, then bisection: the estimate grows with the length).
    """
    budget = usable_gpu_bytes(gpu_gib, headroom)
    fits = lambda n: estimate_vram(model_or_config, max_completion_length=n, system=system,  # noqa: E731
                                   **estimate_kwargs).total <= budget
    if lengths is not None:  # those beyond the model's context window cannot run at all
        room = completion_steps_in_context(model_or_config, estimate_kwargs.get("max_prompt_length", 256), 1)
        return max((n for n in lengths if n <= room and fits(n)), default=0)
    most = completion_steps_in_context(model_or_config, estimate_kwargs.get("max_prompt_length", 256), step)
    lo = 0
    while lo < most and fits(min(most, max(1, 2 * lo)) * step):
        lo = min(most, max(1, 2 * lo))
    hi = min(most, max(1, 2 * lo))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid - 1)
    return lo * step


def format_bytes(n: float) -> str:
    if not n or not math.isfinite(n):
        return "0 B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


# --------------------------------------------------------------------------------------
# Out-of-memory guidance

_PHASE_ADVICE = {
    "rollout": ("generation holds the KV cache of every completion: lower num_generations or "
                "max_completion_length, or train fewer prompts per step (gradient_accumulation_steps)"),
    "update": ("the update holds activations of one micro-batch: lower per_device_train_batch_size, keep "
               "gradient_checkpointing='offload' (the default on CUDA), or shorten max_completion_length"),
}


def oom_message(phase: str, step: int, config, model, breakdown: dict | None, device) -> str:
    """What ran out, what memory held at that moment, and settings that would fit (from the planner)."""
    lines = [f"Out of memory during the {phase} of step {step + 1}."]
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        lines.append(f"At that moment: {torch.cuda.memory_allocated(device) / GiB:.2f} GiB allocated, "
                     f"{torch.cuda.memory_reserved(device) / GiB:.2f} GiB reserved, of {total / GiB:.1f} GiB on "
                     f"{torch.cuda.get_device_name(device)}.")
    else:
        total = None
    if breakdown:
        parts = ", ".join(f"{k.replace('_', ' ')} {breakdown[k] / GiB:.2f}" for k in CATEGORIES if breakdown.get(k))
        lines.append(f"The last completed step used (GiB): {parts}; peak {breakdown.get('peak', 0) / GiB:.2f}.")
    lines.append(f"This run: num_generations={config.num_generations}, max_completion_length="
                 f"{config.max_completion_length}, per_device_train_batch_size={config.per_device_train_batch_size}, "
                 f"load_in_4bit={_is_4bit(model)}.")
    lines.append("What to change: " + _PHASE_ADVICE.get(phase, _PHASE_ADVICE["update"]) + ".")
    if total:
        gens = tuple(g for g in GENERATION_COUNTS if g <= config.num_generations) or (2,)
        lengths = tuple(n for n in COMPLETION_LENGTHS if n <= config.max_completion_length) or (
            config.max_completion_length,)

        def plan_for(lengths):
            return plan_for_gpu(total / GiB, model, max_prompt_length=config.max_prompt_length or 256,
                                num_generations=gens, max_completion_length=lengths,
                                load_in_4bit=(True,) if _is_4bit(model) else (False, True), optim=config.optim)

        try:
            plan = plan_for(lengths)
            if plan.fits and (plan.settings["num_generations"], plan.settings["max_completion_length"]) == (
                    config.num_generations, config.max_completion_length):
                # The planner thinks this very run fits, yet it ran out: something else holds memory on this
                # GPU (another process, a second model) or the estimate is low here. Offering the same settings
                # would send the user round in a circle, so offer the next smaller completion length instead.
                lines.append(f"The planner estimated this run at {plan.estimate.total / GiB:.1f} GiB, below this "
                             "GPU's size: check what else holds memory on it (nvidia-smi).")
                shorter = tuple(n for n in lengths if n < config.max_completion_length)
                plan = plan_for(shorter) if shorter else None
        except Exception as err:  # the advice must never hide the error itself
            plan = None
            lines.append(f"(The planner could not size this model: {err!r}.)")
        if plan is not None and plan.fits:
            s = plan.settings
            lines.append(f"The planner's estimate of what fits this GPU: num_generations={s['num_generations']}, "
                         f"max_completion_length={s['max_completion_length']}, per_device_train_batch_size="
                         f"{s['per_device_train_batch_size']}, load_in_4bit={s['load_in_4bit']} (estimated peak "
                         f"{plan.estimate.total / GiB:.1f} GiB).")
        elif plan is not None:
            lines.append("The planner finds no setting of this model that fits this GPU: use a smaller model.")
    return "\n".join(lines)


def _is_4bit(model) -> bool:
    base = base_model(model)
    return bool(getattr(base, "is_loaded_in_4bit", False))
