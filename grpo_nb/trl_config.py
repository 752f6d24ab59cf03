"""A TRL user's `trl.GRPOConfig`, read as a grpo-nb GRPOConfig: `train(..., config=trl_config)`.

Every field the two share by name (or by TRL_RENAMES) carries over with TRL's meaning. A field
grpo-nb has no counterpart for is refused by name when the user changed it; a handful that only
decide what grpo-nb decides elsewhere (the model's dtype, the progress bar) are named in one
warning. Nothing is dropped without a word. TRL is not imported: the config is read as a dataclass.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings

from .config import DECIDED_ELSEWHERE, GRPOConfig, TRL_RENAMES

# Read only while TRL itself would use them (its vLLM correction only applies with use_vllm=True).
_WITH_VLLM = {name for name in TRL_RENAMES if name.startswith("vllm_")}


def _plain(value):
    return value.value if isinstance(value, enum.Enum) else value


def from_trl_config(trl_config, *, dataset_size: int | None = None) -> GRPOConfig:
    """`trl_config` (a trl.GRPOConfig) as a GRPOConfig; `dataset_size` turns epochs into max_steps."""
    if not dataclasses.is_dataclass(trl_config) or not hasattr(trl_config, "num_generations"):
        raise TypeError(f"config={type(trl_config).__name__} is neither a grpo_nb.GRPOConfig nor a trl.GRPOConfig; "
                        f"pass GRPOConfig(...) or settings as keywords: train(..., max_steps=50)")
    # What the same class makes of the settings that shape its derived fields: a field that differs from this
    # reference is one the user chose (a dataclass default would flag fields TRL fills in at construction).
    seeds = ("output_dir", "use_cpu", "bf16", "fp16", "per_device_train_batch_size", "gradient_accumulation_steps",
             "num_generations")
    reference = type(trl_config)(**{k: getattr(trl_config, k) for k in seeds if hasattr(trl_config, k)})
    ours = {f.name for f in dataclasses.fields(GRPOConfig)}
    values, refused, elsewhere = {}, [], _dtype_chosen(trl_config)
    for f in dataclasses.fields(trl_config):
        if not f.init:
            continue
        name, value = f.name, _plain(getattr(trl_config, f.name))
        changed = _differs(value, _plain(getattr(reference, name, value)))
        if name in ours:
            values[name] = value
        elif name in TRL_RENAMES:
            if name in _WITH_VLLM and not trl_config.use_vllm:
                continue  # TRL reads them only with use_vllm=True
            values[TRL_RENAMES[name]] = value
        elif not changed or name in ("max_steps", "warmup_steps") or (
                name == "num_train_epochs" and trl_config.max_steps <= 0):  # these three: see _translated
            continue
        elif name == "vllm_importance_sampling_cap":  # TRL's older name: it has copied it into ..._clip_max
            continue
        elif name == "save_strategy" and value in ("no", "steps"):  # "no": save_steps=0 (see _translated)
            continue
        elif name in DECIDED_ELSEWHERE:
            elsewhere.append(name)
        elif name == "use_vllm":
            refused.append("use_vllm=True (load the model with setup_reasoning_model(..., fast_inference=True); "
                           "train() then rolls out with vLLM)")
        else:
            refused.append(f"{name}={value!r}")
    if refused:
        raise ValueError(f"train(config=trl.GRPOConfig(...)): grpo-nb has no counterpart for "
                         f"{'; '.join(refused)}. Leave them at TRL's defaults, or see the README's "
                         f"'Coming from TRL / Unsloth' table for what grpo-nb offers instead.")
    if elsewhere:
        warnings.warn("trl.GRPOConfig settings that grpo-nb decides elsewhere and so ignores: "
                      + "; ".join(f"{n} ({DECIDED_ELSEWHERE[n]})" for n in elsewhere), stacklevel=3)
    values.update(_translated(trl_config, values, dataset_size))
    return GRPOConfig(**values)


def _translated(trl_config, values: dict, dataset_size: int | None) -> dict:
    """The fields whose form differs between the two configs."""
    out = {}
    report_to = values.get("report_to")
    out["report_to"] = "none" if report_to in (None, [], "none", ["none"]) else report_to
    out["fsdp"] = bool(values.get("fsdp"))  # TRL: a string of FSDP options; "" or None is off
    if values.get("num_completions_to_print") is None:  # TRL: None prints all; records keep a few here
        out["num_completions_to_print"] = GRPOConfig.num_completions_to_print
    if values.get("project") is None:
        values.pop("project", None)
    if values.get("top_k") is None and "top_k" in values:  # older TRL: None for no top-k
        out["top_k"] = 0
    # TRL's warmup_steps is a count, or a fraction of the run below 1
    warmup = getattr(trl_config, "warmup_steps", 0) or 0
    out["warmup_ratio"] = warmup if warmup < 1 else None  # a count becomes a ratio once max_steps is known
    steps = trl_config.max_steps
    if steps <= 0:  # TRL trains num_train_epochs passes over the dataset then
        if dataset_size is None:
            raise ValueError(f"trl.GRPOConfig(max_steps={steps}) means {trl_config.num_train_epochs} epochs, which "
                             f"needs the dataset's size: pass the config to train(), or set max_steps")
        prompts_per_step = values["per_device_train_batch_size"] * values["gradient_accumulation_steps"] \
            // values["num_generations"]
        steps = max(1, math.ceil(trl_config.num_train_epochs * dataset_size / max(1, prompts_per_step)))
        iterations = values.get("num_iterations", 1)  # a bad one is refused by GRPOConfig under its own name
        steps *= iterations if isinstance(iterations, int) and iterations >= 1 else 1
    out["max_steps"] = steps
    if out["warmup_ratio"] is None:
        out["warmup_ratio"] = min(1.0, warmup / steps)
    for name in ("save_steps", "logging_steps"):  # TRL: below 1 is a fraction of the run
        if isinstance(values.get(name), float) and 0 < values[name] < 1:
            out[name] = max(1, math.ceil(values[name] * steps))
        elif isinstance(values.get(name), float) and values[name].is_integer():
            out[name] = int(values[name])
    if _plain(getattr(trl_config, "save_strategy", "steps")) == "no":
        out["save_steps"] = 0  # grpo-nb still saves the final adapter, as TRL's trainer.save_model() would
    return out


def _dtype_chosen(trl_config) -> list[str]:
    """["fp16"] or ["bf16"] when the user changed TRL's mixed-precision default (bf16=True unless fp16), else [].
    Those two seed the reference above (TRL's default bf16=True raises on a machine without a GPU unless
    use_cpu), so they are read against a config built with only use_cpu=True, which holds TRL's defaults.
    An explicit bf16=True equals the default and says nothing."""
    if not hasattr(trl_config, "bf16"):
        return []
    defaults = type(trl_config)(output_dir=trl_config.output_dir, use_cpu=True)
    return [name for name in ("fp16", "bf16") if _differs(getattr(trl_config, name), getattr(defaults, name))][:1]


def _differs(a, b) -> bool:
    try:
        return bool(a != b)
    except Exception:  # objects without a plain comparison (e.g. accelerate's config): compare their text
        return repr(a) != repr(b)
