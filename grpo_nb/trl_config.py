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
import os
import warnings

from .arguments import plain
from .config import DECIDED_ELSEWHERE, GRPOConfig, TRL_RENAMES
from .tracking import tracker_names

# TRL's vLLM correction: it applies them only with use_vllm=True, which grpo-nb refuses (a model set up with
# fast_inference=True rolls out with vLLM here). With use_vllm=False they are read when the user changed one from
# TRL's defaults (a choice of correction, for the vLLM rollout the use_vllm refusal points to), else left off as TRL
# leaves them off then.
_WITH_VLLM = {name for name in TRL_RENAMES if name.startswith("vllm_")}
# TRL fields grpo-nb takes elsewhere than in its config: refused from a config, saying where.
_ELSEWHERE = {
    "use_vllm": "set it False and load the model with setup_reasoning_model(..., fast_inference=True): train() then "
                "rolls out with vLLM. TRL's vLLM correction (on by default there) is "
                "train(..., rollout_importance_sampling_correction=True) here, or set the config's "
                "vllm_importance_sampling_* fields, which then carry over",
    "resume_from_checkpoint": "pass it to train(..., resume_from_checkpoint=...), as a TRL script passes it to "
                              "trainer.train(); transformers' Trainer does not read it from the config either",
    "trackio_space_id": "set the environment variable TRACKIO_SPACE_ID (os.environ['TRACKIO_SPACE_ID'] = ...), "
                        "which report_to='trackio' reads",
}

# TRL fields that do nothing here: a warning that says why, not a refusal (a TRL script may set them for its own
# trainer; the run is the same without them)
_NO_EFFECT = {
    "model_init_kwargs": "grpo-nb loads the model itself (setup_reasoning_model(...) takes its settings) or trains "
                         "the model it is given, and TRL ignores it for a loaded model too",
    "use_liger_kernel": "deprecated in TRL (Liger's fused linear-cross-entropy loss); grpo-nb's log-probs never build "
                        "the full [batch, length, vocab] logits anyway (they are computed in chunks of rows)",
}


def _plain(value):
    return value.value if isinstance(value, enum.Enum) else value


def from_trl_config(trl_config, *, dataset_size: int | None = None, max_steps: int | None = None) -> GRPOConfig:
    """`trl_config` (a trl.GRPOConfig) as a GRPOConfig; `dataset_size` turns epochs into max_steps.

    `max_steps`: the run's length when it is not the config's (train(config=trl_config, max_steps=50) passes its
    override): TRL's step counts (warmup_steps) stay counts, and its fractions of the run (warmup_steps,
    save_steps, logging_steps below 1) are taken of this length."""
    if not dataclasses.is_dataclass(trl_config) or not hasattr(trl_config, "num_generations"):
        raise TypeError(f"config={type(trl_config).__name__} is neither a grpo_nb.GRPOConfig nor a trl.GRPOConfig; "
                        f"pass GRPOConfig(...) or settings as keywords: train(..., max_steps=50)")
    # What the same class makes of the settings that shape its derived fields: a field that differs from this
    # reference is one the user chose (a dataclass default would flag fields TRL fills in at construction).
    seeds = ("output_dir", "use_cpu", "bf16", "fp16", "per_device_train_batch_size", "gradient_accumulation_steps",
             "num_generations")
    reference = type(trl_config)(**{k: getattr(trl_config, k) for k in seeds if hasattr(trl_config, k)})
    ours = {f.name for f in dataclasses.fields(GRPOConfig)}
    values, refused, taken_elsewhere, elsewhere, no_effect = {}, [], [], _dtype_chosen(trl_config), []
    cannot = []  # settings whose meaning grpo-nb's design rules out, each with its reason
    vllm_chosen = any(_differs(_plain(getattr(trl_config, n, None)), _plain(getattr(reference, n, None)))
                      for n in _WITH_VLLM)
    for f in dataclasses.fields(trl_config):
        if not f.init:
            continue
        name, value = f.name, _plain(getattr(trl_config, f.name))
        changed = _differs(value, _plain(getattr(reference, name, value)))
        if name == "project" and not changed:
            continue  # TRL's default names Trackio's project only; W&B's stays $WANDB_PROJECT, as in TRL
        if name in ours:
            values[name] = value
        elif name in TRL_RENAMES:
            if name in _WITH_VLLM and not trl_config.use_vllm and not vllm_chosen:
                continue  # TRL's defaults: TRL applies them only with use_vllm=True
            values[TRL_RENAMES[name]] = value
        elif name == "sync_ref_model" and value:
            cannot.append(_sync_ref_model_refusal(trl_config.beta))  # a shared field: beta is TRL's own
        elif not changed or name in ("max_steps", "warmup_steps") or (
                name == "num_train_epochs" and trl_config.max_steps <= 0):  # these three: see _translated
            continue
        elif name == "vllm_importance_sampling_cap":  # TRL's older name: it has copied it into ..._clip_max
            continue
        elif name == "save_strategy" and value in ("no", "steps"):  # "no": save_steps=0 (see _translated)
            continue
        elif name == "do_eval" and value == (_plain(getattr(trl_config, "eval_strategy", "no")) != "no"):
            continue  # transformers sets it from eval_strategy, which carries over
        elif name in DECIDED_ELSEWHERE:
            elsewhere.append(name)
        elif name in _NO_EFFECT:
            no_effect.append(f"{name}={value!r:.120} ({_NO_EFFECT[name]})")
        elif name in _ELSEWHERE:
            taken_elsewhere.append(f"{name}={value!r} ({_ELSEWHERE[name]})")
        else:
            refused.append(f"{name}={value!r}")
    if refused or taken_elsewhere or cannot:
        parts = ([f"grpo-nb has no counterpart for {'; '.join(refused)}"] if refused else []) + (
            [f"grpo-nb takes these elsewhere than in its config: {'; '.join(taken_elsewhere)}"] if taken_elsewhere
            else []) + cannot
        raise ValueError(f"train(config=trl.GRPOConfig(...)): {'. And '.join(parts)}. Leave them at TRL's defaults in the config, "
                         f"or see the README's 'Coming from Unsloth / TRL' table for what grpo-nb offers instead.")
    if elsewhere:
        warnings.warn("trl.GRPOConfig settings that grpo-nb decides elsewhere and so ignores: "
                      + "; ".join(f"{n} ({DECIDED_ELSEWHERE[n]})" for n in elsewhere), stacklevel=3)
    if no_effect:
        warnings.warn("trl.GRPOConfig settings that do nothing in grpo-nb, ignored: " + "; ".join(no_effect) + ".",
                      stacklevel=3)
    _warn_wandb_project(values)
    values.update(_translated(trl_config, values, dataset_size, max_steps))
    return GRPOConfig(**values)


def _sync_ref_model_refusal(beta) -> str:
    """Why sync_ref_model=True has nothing to act on here, in TRL 1.16's own terms: with beta == 0 no reference
    model is used (TRL raises ValueError); with beta > 0 grpo-nb's reference is the base model with the LoRA adapter
    switched off (beta > 0 needs a LoRA model), where TRL raises NotImplementedError for a PEFT model."""
    if not beta:
        return (f"sync_ref_model=True with beta={beta!r} has nothing to sync: without the KL term no reference model "
                f"is used (TRL refuses this too, with a ValueError). Set sync_ref_model=False (with beta > 0 the "
                f"reference here is the base model with the LoRA adapter switched off, which is not synced either)")
    return (f"sync_ref_model=True (beta={beta!r}) cannot apply: grpo-nb's reference policy is the base model with "
            f"the LoRA adapter switched off, never a separate copy of the model, so there is no reference model to "
            f"sync; TRL 1.16 refuses sync_ref_model=True with a PEFT model for the same reason "
            f"(NotImplementedError). Set sync_ref_model=False: the reference stays the base model")


def _warn_wandb_project(values: dict) -> None:
    """TRL's `project` names Trackio's project only (its W&B run goes to $WANDB_PROJECT); here it names both. A
    chosen project with W&B and another $WANDB_PROJECT: said, since the run lands elsewhere than the TRL run would."""
    project, env = values.get("project"), os.environ.get("WANDB_PROJECT")
    if isinstance(project, str) and env and env != project and "wandb" in _trackers(values.get("report_to")):
        warnings.warn(f"trl.GRPOConfig(project={project!r}) names the W&B project here too, so this run goes to W&B "
                      f"project {project!r}, not $WANDB_PROJECT={env!r} (TRL uses `project` for Trackio only). To "
                      f"keep {env!r}, leave project at TRL's default or set project={env!r}.", stacklevel=4)


def _trackers(report_to) -> list[str]:
    try:
        return tracker_names(report_to)  # "all": the installed ones
    except Exception:  # a bad report_to: GRPOConfig refuses it under its own name
        return []


def _translated(trl_config, values: dict, dataset_size: int | None, max_steps: int | None = None) -> dict:
    """The fields whose form differs between the two configs; `max_steps`: the run's length, when train() overrides
    the config's (see from_trl_config)."""
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
    scheduler = values.get("lr_scheduler_type")
    if scheduler == "constant_with_warmup":  # grpo-nb's "constant" is that: it applies the warmup
        out["lr_scheduler_type"] = "constant"
    elif scheduler == "constant" and warmup > 0:  # transformers' constant schedule never reads the warmup
        warnings.warn(f"trl.GRPOConfig(lr_scheduler_type='constant', warmup_steps={warmup!r}): transformers' constant "
                      f"schedule has no warmup, so the TRL run would not warm up, and neither does this one. For a "
                      f"warmup, set lr_scheduler_type='constant_with_warmup'.", stacklevel=4)
        warmup = 0
    out["warmup_ratio"] = warmup if warmup < 1 else None  # a count becomes a ratio once max_steps is known
    override = plain(max_steps)
    given = isinstance(override, int) and not isinstance(override, bool) and override >= 1  # else refused later
    steps = override if given else trl_config.max_steps
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
    if out["warmup_ratio"] is None:  # transformers: int(warmup_steps) steps; optim.build_optimizer gives them back
        out["warmup_ratio"] = min(1.0, int(warmup) / steps)
    for name in ("save_steps", "logging_steps", "eval_steps"):  # TRL: below 1 is a fraction of the run
        if isinstance(values.get(name), float) and 0 < values[name] < 1:
            out[name] = max(1, math.ceil(values[name] * steps))
        elif isinstance(values.get(name), float) and values[name].is_integer():
            out[name] = int(values[name])
    if values.get("eval_strategy") == "no":  # TRL evaluates at no interval then, whatever eval_steps says
        out["eval_steps"] = None
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
