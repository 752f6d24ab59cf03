"""What a model carries beside it through a grpo-nb run, in one place.

`setup_reasoning_model` decides a few things the model itself has no field for - the context the
run may use, the rollout backend that shares its weights, the offloader of its activations - and
several modules need them later. They live here, keyed (weakly) by the transformers model under
any peft wrapper, rather than as attributes stamped on the model:

    attachments(model).max_seq_length
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Attachments:
    max_seq_length: int | None = None  # prompt + completion tokens the run may use (setup's max_seq_length)
    rollout: object | None = None  # a rollout backend holding the weights (vLLM, fast_inference=True)
    offloader: object | None = None  # offload.ActivationOffloader when checkpointing is "offload"
    gradient_checkpointing: bool | str = False  # as resolved by setup: "offload", True or False
    checkpointing_auto: bool = False  # setup's "auto" off CUDA: each run decides (models.checkpointing_for)
    loaded_from: Path | None = None  # the absolute folder the base weights were loaded from (base_folder.py)
    tool_template: object = None  # the chat template a run with tools or environments trained under (train())


_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def base_model(model):
    """The transformers model under a peft wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def attachments(model) -> Attachments:
    """The model's attachments, created empty on first use (any model may be asked)."""
    base = base_model(model)
    try:
        found = _ATTACHED.get(base)
    except TypeError:  # an object nothing can be attached to (None, a stand-in): it has none
        return Attachments()
    if found is None:
        found = _ATTACHED[base] = Attachments()
    return found


def model_context(model) -> int | None:
    """The most tokens (prompt + completion) the run may use: setup's max_seq_length, else the model's."""
    return attachments(model).max_seq_length or position_window(getattr(model, "config", None))


def text_config(model_or_config):
    """The config of the language model a model (or config) holds: its text part for a multimodal one (Gemma 3,
    Qwen2.5-VL), else the config itself."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def windowed_attention(config) -> str | None:
    """Why some of the model's attention layers do not attend over the whole sequence (None: all of them do):
    layer types other than full attention (sliding, chunked, linear), or a sliding window on every layer (Mistral
    v0.1's, without layer_types). Paths that pass one mask to every layer (a 4D mask, a packed layout) must refuse
    such a model: the window would silently be ignored."""
    config = text_config(config)
    other = sorted(set(getattr(config, "layer_types", None) or []) - {"full_attention"})
    if other:
        return f"layer types {other}"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) is not False:  # Qwen2 keeps a window it does not use
        return f"a sliding window of {window} tokens"
    return None


def rope_scalings(config) -> list[dict]:
    """The config's rope scaling dicts (one per layer type where transformers 5 nests them, as on Gemma 3)."""
    config = text_config(config)
    scaling = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(scaling, dict):
        return []
    nested = [v for v in scaling.values() if isinstance(v, dict)]
    return nested or [scaling]


def rope_type(scaling: dict) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_depends_on_length(config) -> bool:
    """Whether the model's rotary factors depend on the length of the sequence in the forward pass
    (transformers' "longrope": long factors once it passes original_max_position_embeddings, all positions;
    "dynamic" NTK: frequencies recomputed from the length). Then a KV-cached rollout, whose prefill saw a
    short sequence, gives other log-probs than one forward pass over prompt + completion."""
    return any(rope_type(s) in ("longrope", "dynamic") for s in rope_scalings(config))


def position_window(config) -> int | None:
    """The positions a model was trained for. YaRN / LongRoPE / Llama 3 scaling extend the original window
    by the factor: original_max_position_embeddings x factor (Qwen3's YaRN: 32768 x 4), or the config's
    max_position_embeddings where it is larger (Llama 3.1: 131072 above 8192 x 8 = 65536). Linear and dynamic
    scaling are conventionally written with the extended window already in max_position_embeddings
    (LLaMA-2-7B-32K: 32768 with factor 8), so it is taken as is. None where the config has none."""
    config = text_config(config)
    window = getattr(config, "max_position_embeddings", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return None
    for scaling in rope_scalings(config):
        factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
        if rope_type(scaling) not in ("yarn", "longrope", "llama3") or not isinstance(factor, (int, float)) or factor <= 1:
            continue
        original = original if isinstance(original, int) and not isinstance(original, bool) else window
        window = max(window, int(original * factor))
    return window
