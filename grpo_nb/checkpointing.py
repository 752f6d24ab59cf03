"""Checkpoints a run can resume from exactly, written so that a crash never leaves half a folder.

A checkpoint folder `output_dir/checkpoint-<step>` holds:

    adapter_model.safetensors, adapter_config.json   the LoRA adapter (loads with peft), or the full
                                                     weights for a model without LoRA
    tokenizer files
    trainable.safetensors     every trainable tensor by name, what resume loads
    trainer_state.pt          optimizer, scheduler, grad scaler, RNG states (python, numpy, torch,
                              CUDA), the prompt sampler's position, the rollout's random state, and
                              a generation batch still being iterated on (num_iterations > 1)
    grpo_config.json, history.json

It is written to a hidden temporary folder and renamed into place, so a folder named
checkpoint-<step> is always complete. `rotate_checkpoints` keeps the newest few.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from .distributed import like, load_optimizer_state

TRAINER_STATE = "trainer_state.pt"
TRAINABLE = "trainable.safetensors"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _write_model_files(path: Path, model, tokenizer, config, history, trainable=None) -> None:
    # `trainable`: the trainable tensors gathered whole, for a model whose own are sharded over ranks.
    model.save_pretrained(path, **({"state_dict": trainable} if trainable is not None else {}))
    tokenizer.save_pretrained(path)
    if config is not None:
        (path / "grpo_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    if history is not None:
        (path / "history.json").write_text(json.dumps(_jsonable(list(history))))


def _atomic_folder(path: Path, write) -> Path:
    """Run `write(tmp)` on a fresh hidden folder beside `path`, then move it to `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write(tmp)
        if path.exists():
            os.replace(path, old)  # a directory cannot be renamed over a non-empty one
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return path


def _saving_error(path, err) -> OSError:
    return OSError(
        f"Could not save the checkpoint to {path}: {err}. Check that the folder is writable and the disk has "
        f"room, or pass another output_dir."
    )


def save_checkpoint(model, tokenizer, path, *, config=None, history=None, trainable=None) -> Path:
    """Write the trainable weights (only the LoRA adapter for a peft model) and run metadata.

    A peft adapter folder saved here loads with `PeftModel.from_pretrained(base, path)`.
    This is what train() leaves in output_dir at the end; resumable checkpoints are
    written by `save_training_checkpoint`.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        _write_model_files(path, model, tokenizer, config, history, trainable)
    except OSError as err:
        raise _saving_error(path, err) from err
    return path


# ----------------------------------------------------------------------------------------
# Resumable state


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def save_training_checkpoint(path, *, model, tokenizer, config, history, state: dict, trainable=None) -> Path:
    """Write a resumable checkpoint atomically. `state` is the trainer's (see train()): optimizer,
    scheduler, scaler, rng, sampler, rollout, step, history and the pending batch. `trainable`:
    the trainable tensors gathered whole when the model's are sharded (distributed.full_trainable_state)."""
    import safetensors.torch

    def write(tmp: Path) -> None:
        _write_model_files(tmp, model, tokenizer, config, history, trainable)
        tensors = {name: t.contiguous().cpu() for name, t in (trainable or trainable_state(model)).items()}
        safetensors.torch.save_file(tensors, tmp / TRAINABLE)
        torch.save(state, tmp / TRAINER_STATE)

    try:
        return _atomic_folder(Path(path), write)
    except OSError as err:
        raise _saving_error(path, err) from err


def checkpoints(output_dir) -> list[Path]:
    """The complete checkpoint-<step> folders in `output_dir`, oldest step first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found)]


def rotate_checkpoints(output_dir, keep: int | None) -> None:
    """Delete all but the newest `keep` checkpoints (None keeps all)."""
    if keep is None:
        return
    for path in checkpoints(output_dir)[: -keep or None]:
        shutil.rmtree(path, ignore_errors=True)


def find_checkpoint(resume_from_checkpoint, output_dir) -> Path | None:
    """The folder `train(resume_from_checkpoint=...)` means: True = the newest in output_dir."""
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        found = checkpoints(output_dir)
        if not found:
            raise FileNotFoundError(
                f"resume_from_checkpoint=True, but {output_dir} has no checkpoint-<step> folder to resume from. "
                "Start without resume_from_checkpoint, or pass the checkpoint folder's path."
            )
        return found[-1]
    return Path(resume_from_checkpoint)


def load_training_checkpoint(path, model) -> dict:
    """Load the trainable weights into `model`; return the trainer state saved in `path`."""
    import safetensors.torch

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"Cannot resume: {path} is not a folder. Pass a checkpoint-<step> folder or True.")
    missing = [name for name in (TRAINER_STATE, TRAINABLE) if not (path / name).exists()]
    if missing:
        raise ValueError(
            f"Cannot resume from {path}: it is not a grpo-nb training checkpoint (missing {', '.join(missing)}). "
            "Resume from a checkpoint-<step> folder written by train(), e.g. resume_from_checkpoint=True."
        )
    name = TRAINABLE
    try:
        tensors = safetensors.torch.load_file(path / TRAINABLE)
        name = TRAINER_STATE
        state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
    except Exception as err:
        others = [p.name for p in checkpoints(path.parent) if p != path]
        raise ValueError(
            f"Cannot resume from {path}: {name} could not be read ({type(err).__name__}: {err}). The folder is "
            f"damaged; resume from an earlier checkpoint-<step> folder"
            + (f" ({', '.join(others)} in the same folder)." if others else ", or start again without resuming.")
        ) from err
    params = dict(model.named_parameters())
    expected = {name for name, p in params.items() if p.requires_grad}
    if set(tensors) != expected:
        unknown, absent = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        raise ValueError(
            f"Cannot resume from {path}: it was written for another model or LoRA setup "
            f"({len(unknown)} tensors this model does not train, e.g. {unknown[:2]}; {len(absent)} trained tensors "
            f"missing, e.g. {absent[:2]}). Load the same model with the same lora_rank and target_modules."
        )
    with torch.no_grad():
        for name, tensor in tensors.items():
            if params[name].shape != tensor.shape:
                raise ValueError(f"Cannot resume from {path}: {name} has shape {tuple(tensor.shape)} in the "
                                 f"checkpoint but {tuple(params[name].shape)} in the model.")
            params[name].copy_(like(params[name], tensor))  # a sharded parameter takes its shard
    return state


def restore_state(state, *, optimizer, scheduler, scaler, prompts, rollout) -> None:
    """Put a checkpoint's optimizer, schedule, random states and data position back in place."""
    load_optimizer_state(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    prompts.load_state_dict(state["sampler"])
    if state["rollout"] is not None and hasattr(rollout, "load_state_dict"):
        rollout.load_state_dict(state["rollout"])
    set_rng_state(state["rng"])
