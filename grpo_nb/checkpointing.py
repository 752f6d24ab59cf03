"""Saving what a run has learned: the adapter (or full weights), tokenizer, config and history."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def save_checkpoint(model, tokenizer, path, *, config=None, history=None) -> Path:
    """Write the trainable weights (only the LoRA adapter for a peft model) and run metadata.

    A peft adapter folder saved here loads with `PeftModel.from_pretrained(base, path)`.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        if config is not None:
            (path / "grpo_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
        if history is not None:
            (path / "history.json").write_text(json.dumps(_jsonable(list(history))))
    except OSError as err:
        raise OSError(
            f"Could not save the checkpoint to {path}: {err}. Check that the folder is writable and the disk has "
            f"room, or pass another output_dir."
        ) from err
    return path
