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


@dataclass
class Attachments:
    max_seq_length: int | None = None  # prompt + completion tokens the run may use (setup's max_seq_length)
    rollout: object | None = None  # a rollout backend holding the weights (vLLM, fast_inference=True)
    offloader: object | None = None  # offload.ActivationOffloader when checkpointing is "offload"
    gradient_checkpointing: bool | str = False  # as resolved by setup: "offload", True or False


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


def position_window(config) -> int | None:
    """The positions a model was trained for: its config's max_position_embeddings, times the rope scaling
    factor when the scaling extends it (YaRN on Qwen2.5: 32768 x 4; Llama 3.1's config already holds the
    extended 131072, with original_max_position_embeddings 8192 below it). None where the config has none."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(config, "max_position_embeddings", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return None
    scaling = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
        if isinstance(factor, (int, float)) and factor > 1 and not (isinstance(original, int) and window > original):
            return int(window * factor)
    return window
