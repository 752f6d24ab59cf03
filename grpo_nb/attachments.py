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
    found = _ATTACHED.get(base)
    if found is None:
        found = _ATTACHED[base] = Attachments()
    return found


def model_context(model) -> int | None:
    """The most tokens (prompt + completion) the run may use: setup's max_seq_length, else the model's."""
    return (attachments(model).max_seq_length
            or getattr(getattr(model, "config", None), "max_position_embeddings", None))
