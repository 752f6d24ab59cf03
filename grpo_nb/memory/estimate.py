"""Memory estimated before training, by category (`memory.accounting`), from a model's config in milliseconds:
`estimate_vram()` for grpo-nb and TRL 1.16's GPU path, fitted to and tested against the simulation
(`grpo_nb.simulate`), and the argument and config checks it shares with `simulate_step` and `plan_for_gpu`.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass

import torch

from .. import lora as lora_layers
from ..architectures import known_config
from ..attachments import position_window, text_config
from ..hardware import DTYPE_NAMES
from ..arguments import need_bool, need_choice, need_int, need_number, need_target_modules, refuse
from ..config import OPTIMIZERS
from ..logprobs import LOGPROB_BACKENDS
from ..prefix_sharing import MIN_SAVING, prompts_per_micro_batch, shareable_config
from ..loss import LOSS_TYPES
from ..tiled_mlp import DEFAULT_TILE_TOKENS
from ..parking import PARKING_SETTINGS, parks
from ..rollout import lean_forward
from .accounting import (CATEGORIES, GiB, kv_cache_bytes, logprob_scratch_bytes, sampling_bytes, step_peak)

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
        return step_peak(self.categories, parked=self.settings.get("park_optimizer_state", False))

    @property
    def rollout_peak(self) -> int:
        """The rollout phase's peak: the static categories and the KV cache (as `SimulatedStep.phases["rollout"]`);
        a parked optimizer state (settings' park_optimizer_state, grpo_nb.parking) is in host memory then."""
        c = self.categories
        optimizer = 0 if self.settings.get("park_optimizer_state") else c["optimizer"]
        return c["base_weights"] + c["trainable"] + optimizer + c.get("other", 0) + c["kv_cache"]

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
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
            # Gemma 3n's intermediate_size, one a layer: its per-layer embeddings and AltUp are not estimated either
            shown = f"[{value[0]}, ... x{len(value)}]" if len(value) > 4 else repr(list(value))
            raise ValueError(f"{func}: the config gives every layer its own {name} ({shown}), as Gemma 3n's does: "
                             f"the planner does not support such models (it sizes every layer alike, and has no "
                             f"per-layer embeddings), so it would plan a run that does not fit. Measure one instead: "
                             f"train(..., max_steps=2) and read torch.cuda.max_memory_allocated().")
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
    """The model's context window in tokens, as train() reads it (attachments.position_window: rope scaling such as
    YaRN extends max_position_embeddings); None where it has none."""
    return position_window(text_config(cfg))


def check_planned_context(func: str, cfg, max_prompt_length: int, max_completion_length: int) -> None:
    """Prompt and completion within the model's context window: beyond it, the run would use positions the
    model never saw (and train() refuses it), so an estimate of it would plan a run that cannot happen."""
    context = context_window(cfg)
    if context and max_prompt_length + max_completion_length > context:
        fix = (f"lower max_completion_length to {context - max_prompt_length} or less" if context > max_prompt_length
               else f"lower max_prompt_length below {context}")
        raise ValueError(f"{func}(max_prompt_length={max_prompt_length}, max_completion_length="
                         f"{max_completion_length}) is invalid: {max_prompt_length} + {max_completion_length} = "
                         f"{max_prompt_length + max_completion_length} tokens is beyond the model's context window "
                         f"of {context} (its config's max_position_embeddings, times its rope scaling's factor): {fix}.")


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
            return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)  # the caller's is left as it is

    return _read_config(func, "the config", build)


def _parameter_counts(config, lora_rank, target_modules) -> dict:
    """Counts from the architecture built on the meta device: no weights are allocated."""
    model = build_on_meta("estimate_vram", config, torch.float32)
    out_emb = model.get_output_embeddings()
    linear = lora = other = adapted = 0
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
                adapted += module.weight.numel()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            other += p.numel()
    other += sum(b.numel() for b in model.buffers())  # rotary frequencies and the like
    return {"linear": linear, "other": other, "lora": lora, "adapted": adapted, "total": linear + other}


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
    "dtype": (need_choice, {"choices": tuple(DTYPE_NAMES)}),
    "gradient_checkpointing": (need_choice, {"choices": ("offload", True, False)}),
    "logprob_backend": (need_choice, {"choices": LOGPROB_BACKENDS}),
    "system": (need_choice, {"choices": ("grpo_nb", "trl")}),
    "device": (need_choice, {"choices": ("cuda", "cpu")}),
    "optim": (need_choice, {"choices": OPTIMIZERS}),
    "park_optimizer_state": (need_choice, {"choices": PARKING_SETTINGS}),
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
    if arguments.get("park_optimizer_state") is True and arguments.get("system") == "trl":
        refuse(func, "park_optimizer_state", True, "'auto' or False with system='trl': TRL keeps its optimizer's state "
               "on the device (parking is grpo-nb's, GRPOConfig.park_optimizer_state)")


def turn_budget(max_completion_length: int, turns: int, result_tokens: int) -> int:
    """The tokens each model turn samples when `turns` turns and `turns - 1` results of `result_tokens` tokens share
    `max_completion_length` (multi-turn episodes: check_episode, simulate.episodes)."""
    return (max_completion_length - (turns - 1) * result_tokens) // turns


def check_episode(func: str, turns, result_tokens, max_completion_length: int, system: str = "grpo_nb",
                  rollout: bool = True) -> None:
    """`tool_turns` / `tool_result_tokens` of estimate_vram, simulate_step and plan_for_gpu: multi-turn episodes
    (`train(tools=...)`) whose turns and results share `max_completion_length`, on grpo-nb's own rollout."""
    import numbers

    for name, value, least in (("tool_turns", turns, 1), ("tool_result_tokens", result_tokens, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            refuse(func, name, value, f"an integer >= {least}")
    if turns == 1:
        if result_tokens:  # nothing would read it: the user most likely meant a call and its result, tool_turns=2
            refuse(func, "tool_result_tokens", result_tokens,
                   "0 with tool_turns=1: one model turn has no tool result after it, so the tokens would not be "
                   "counted; for a tool call and its result pass tool_turns=2 (turns = calls + 1)")
        return
    if turns > max_completion_length:  # before the results' share: with no room for the turns, no result size fits
        refuse(func, "tool_turns", turns,
               f"at most max_completion_length={max_completion_length}: every turn samples at least one token of "
               f"the episode's max_completion_length")
    if system != "grpo_nb" or not rollout:
        refuse(func, "tool_turns", turns, f"1 with {'system=' + repr(system) if system != 'grpo_nb' else 'rollout=False'}"
               f": multi-turn episodes are counted for grpo-nb's own rollout (the update alone has the single-turn "
               f"step's shapes: {func}(..., tool_turns=1) counts it)")
    if turn_budget(max_completion_length, turns, result_tokens) < 1:
        refuse(func, "tool_result_tokens", result_tokens, f"at most {(max_completion_length - turns) // max(1, turns - 1)}: "
               f"{turns} turns and {turns - 1} results of {result_tokens} tokens must share max_completion_length="
               f"{max_completion_length}, at least one sampled token a turn")


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
    tool_turns: int = 1,
    tool_result_tokens: int = 0,
    prefix_sharing: bool = True,
    park_optimizer_state: bool | str = "auto",
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
        tool_turns, tool_result_tokens: multi-turn episodes (`train(tools=...)`, grpo-nb only): `tool_turns` model
            turns with a tool result of `tool_result_tokens` tokens between turns, all within
            `max_completion_length` (so the update's shapes are the single-turn step's). The rollout keeps every
            row's dynamic KV cache from turn to turn and prefills each result on top of it (as
            `simulate_step(tool_turns=...)` simulates it); tool_turns=1 is the single-turn step.
        prefix_sharing: `GRPOConfig.prefix_sharing` (grpo-nb only): the update forwards each prompt once for the
            completions of its group in a micro-batch, packed without padding, where the model allows it and it
            saves tokens (grpo_nb.prefix_sharing; the estimate's completions are all full length).
        park_optimizer_state: `GRPOConfig.park_optimizer_state` (grpo-nb only): "auto" parks the optimizer's state in
            host memory between optimizer steps on CUDA for an optimizer that is not paged (grpo_nb.parking):
            `settings["park_optimizer_state"]` says whether, and the peak then holds it in the optimizer step only.

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
                            rollout_max_rows=rollout_max_rows, optim=optim, park_optimizer_state=park_optimizer_state)
    check_episode("estimate_vram", tool_turns, tool_result_tokens, max_completion_length, system)
    cfg = planner_config("estimate_vram", model_or_config)
    check_planned_context("estimate_vram", cfg, max_prompt_length, max_completion_length)
    s = DTYPE_NAMES[dtype].itemsize
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
    need_bool("estimate_vram", "prefix_sharing", prefix_sharing)
    # packed (grpo_nb.prefix_sharing), a micro-batch forwards each of its prompts once, then its completions
    tokens = micro * seq
    packed = prompts_per_micro_batch(micro, num_generations) * max_prompt_length + micro * max_completion_length
    shared = prefix_sharing and not trl and shareable_config(cfg) and packed <= (1 - MIN_SAVING) * tokens
    tokens = packed if shared else tokens
    if trl:
        # TRL: the whole MLP at once, LoRA branches in fp32 under autocast (bf16 for QLoRA).
        per_token = (13.1 * hidden + 5.45 * inter) if load_in_4bit else (24.0 * hidden + 5.69 * inter)
        layer_moment = tokens * per_token * s
    else:
        # grpo-nb: LoRA without fp32 copies (grpo_nb.lora), RMSNorm without fp32 copies
        # (grpo_nb.rms_norm), the MLP a tile of tokens at a time (grpo_nb.tiled_mlp).
        layer_moment = (11.4 * tokens * hidden + 8.2 * min(tokens, DEFAULT_TILE_TOKENS) * inter) * s
        if shared:  # each completion's attention takes its prompt's keys and values, repeated to every head
            kv_width = cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads)
            layer_moment += 2 * micro * seq * (hidden + kv_width) * s
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
    if tool_turns > 1 and kv_rows == n_gen:
        c["kv_cache"] += _episode_rollout_bytes(cfg, n_gen, max_prompt_length, max_completion_length, tool_turns,
                                                tool_result_tokens, dtype, kv_s)
    # (tool_turns > 1 with rollout_max_rows below the completions: train() runs each turn as a rollout of its own,
    # the conversation so far its prompt, at most rollout_max_rows rows at once: the single-turn terms above.)
    if device == "cpu" and lora_rank and not load_in_4bit and not trl and lora_layers.MERGE_ON_CPU:
        c["kv_cache"] += counts["adapted"] * s  # the rollout's merged copies of the adapted weights (grpo_nb.lora)
    if device == "cpu" and not trl and lora_layers.MERGE_ON_CPU and lean_forward.LEAN_ON_CPU and \
            lean_forward.config_supported(cfg):  # the lean CPU forward's keys/values buffers, with spare columns
        c["kv_cache"] += kv_cache_bytes(cfg, kv_rows, lean_forward.spare_columns(seq), kv_s)
    # CPU: the interpreter, torch and transformers themselves (on CUDA the context is outside the
    # allocator's count: plan_for_gpu's usable_gpu_bytes takes it off the card instead).
    c["other"] = _CPU_RUNTIME if device == "cpu" else 0
    settings = dict(max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
                    num_generations=num_generations, prompts_per_step=prompts_per_step,
                    per_device_train_batch_size=micro, load_in_4bit=load_in_4bit, lora_rank=lora_rank,
                    dtype=dtype, gradient_checkpointing=gradient_checkpointing, logprob_backend=logprob_backend,
                    device=device, rollout_max_rows=rollout_max_rows, optim=optim, parameters=counts["total"],
                    lora_parameters=counts["lora"], tool_turns=int(tool_turns),
                    tool_result_tokens=int(tool_result_tokens), prefix_sharing=bool(shared))
    settings["park_optimizer_state"] = not trl and parks(park_optimizer_state, device, optim)
    return MemoryEstimate(system, {k: int(v) for k, v in c.items()}, settings)


def _episode_rollout_bytes(cfg, rows, prompt, completion, turns, result_tokens, dtype, kv_s) -> int:
    """What a rollout of multi-turn episodes (`RolloutEngine.start_episodes` / `continue_episodes`) holds beyond the
    single-turn rollout's terms, all `rows` kept in a cache that ends at the same prompt + completion length.
    (Fitted to the dynamic cache's episodes; on CUDA they now run on a static cache made for the whole budget
    at the first turn, whose simulated rollout peaks within 0.3% of the dynamic one's at the tested shapes:
    no growing copies, but the results' prefills attend over the whole budget's columns.)

    Fitted to `simulate_step(tool_turns=3, ...)` (its rollout phase's allocations by location) at Qwen2.5-0.5B 8 x
    (64 + 256) bf16 and Qwen2.5-1.5B QLoRA 8 x (256 + 1024) fp16 on a simulated T4, 32- and 64-token results:
    * the dynamic cache grows by concatenation (transformers' DynamicCache.update): one layer's new keys beside the
      old ones, half a layer's cache, as TRL's growing cache above;
    * each result's prefill keeps its [rows, 1, vocab] logits in the compute dtype while the turn decodes;
    * in fp16 (cards before compute capability 8.0, as the planner plans them), the result prefill's attention over
      the cache holds ~8 [rows, heads, result + 1, keys] fp32 buffers (0.195 GiB of the 1.5B shape's rollout); the
      keys then: the prompt, all turns but the last and the results. Not seen in bf16 (FlashAttention's cards).
    """
    heads, layers = cfg.num_attention_heads, cfg.num_hidden_layers
    extra = kv_cache_bytes(cfg, rows, prompt + completion, kv_s) // layers // 2
    extra += rows * cfg.vocab_size * DTYPE_NAMES[dtype].itemsize
    if DTYPE_NAMES[dtype] is torch.float16:
        keys = prompt + completion - turn_budget(completion, turns, result_tokens)
        extra += 8 * rows * heads * (result_tokens + 1) * keys * 4
    return extra


def optimizer_state_bytes(optim: str, parameters: int, parameter_bytes: int) -> int:
    """AdamW's two moments: torch keeps them in the parameters' dtype, bitsandbytes' 32-bit ones in fp32,
    its 8-bit ones as one byte each plus an fp32 scale per block of 256 values."""
    if "8bit" in optim:
        return 2 * (parameters + 4 * -(-parameters // 256))
    return 2 * 4 * parameters if optim == "paged_adamw_32bit" else 2 * parameter_bytes


# Resident memory of a process that has imported torch, transformers and peft (measured on
# Linux x86-64, torch 2.13 CPU): part of `other` in CPU estimates.
_CPU_RUNTIME = 600 * 2**20

