"""Checkpoints a run can resume from exactly, written so that a crash never leaves half a folder.

A checkpoint folder `output_dir/checkpoint-<step>` holds:

    adapter_model.safetensors, adapter_config.json   the LoRA adapter (loads with peft), or the full
                                                     weights for a model without LoRA
    tokenizer files
    trainable.safetensors     every trainable tensor by name, what resume loads
    trainer_state.json        optimizer, scheduler, grad scaler, RNG states (python, numpy, torch,
    trainer_state.safetensors CUDA), the prompt sampler's position, the rollout's random state, and
                              a generation batch still being iterated on (num_iterations > 1): the
                              tensors in safetensors, the rest as JSON, so that loading a
                              checkpoint from someone else cannot run code (a pickle could)
    grpo_config.json, history.json

It is written to a hidden temporary folder and renamed into place, so a folder named
checkpoint-<step> is always complete. `rotate_checkpoints` keeps the newest few.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import socket
import stat
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from . import atomic_files
from .checkpoint_schema import (ARRAY_DTYPES, CheckpointError, Refused, check_fits_run, check_lock,
                                check_trainer_state, check_weights, is_plain, need)
from .distributed import like, load_optimizer_state
from .tracking import written_by_grpo_nb

TRAINER_STATE = "trainer_state.json"
TRAINER_TENSORS = "trainer_state.safetensors"
LEGACY_TRAINER_STATE = "trainer_state.pt"  # before grpo-nb 0.2: a pickle, which loading would run
TRAINABLE = "trainable.safetensors"
SETTINGS = "grpo_config.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _jsonable(value):
    """`value` as JSON holds it, whatever a reward function or a setting put in it: a save never fails on
    a value (numpy scalars become numbers, NaN null, anything else its text)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int, float, bool)) or k is None else str(k): _jsonable(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)


def _write_model_files(path: Path, model, tokenizer, config, history, trainable=None) -> None:
    # `trainable`: the trainable tensors gathered whole, for a model whose own are sharded over ranks.
    model.save_pretrained(path, **({"state_dict": trainable} if trainable is not None else {}))
    tokenizer.save_pretrained(path)
    if config is not None:
        (path / "grpo_config.json").write_text(json.dumps(_jsonable(dataclasses.asdict(config)), indent=2))
    if history is not None:
        (path / "history.json").write_text(json.dumps(_jsonable(list(history))))


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
    path = atomic_files.expand(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        atomic_files.remove_leftovers(path)  # of any run killed mid-write here
        # Written beside, then each file renamed into place, the weights last: a process killed meanwhile
        # leaves every file whole (the old one or the new one), never half written.
        # A README.md there stays: the user's notes, or the card of an earlier save (peft writes a fresh one).
        atomic_files.write_into(path, lambda tmp: _write_model_files(tmp, model, tokenizer, config, history,
                                                                     trainable), keep=("README.md",))
    except OSError as err:
        raise _saving_error(path, err) from err
    return path


# ----------------------------------------------------------------------------------------
# Resumable state


def encode_state(obj, tensors: dict):
    """`obj` (nested dicts, lists, tuples, tensors, numpy arrays, numbers, strings, bytes) as plain
    JSON, its tensors moved into `tensors` (for safetensors) and referred to by key."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        # A copy of its own: safetensors stores each tensor alone (not views, not shared storage).
        tensor = obj.detach().to("cpu", copy=True).contiguous()
        tensors[key] = tensor
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(obj.astype(np.int64) if obj.dtype == np.uint32 else obj.copy())
        return {"__ndarray__": key, "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, bytes):
        return {"__bytes__": base64.b64encode(obj).decode()}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_state(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [encode_state(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode_state(v, tensors) for k, v in obj.items()}
        return {"__items__": [[encode_state(k, tensors), encode_state(v, tensors)] for k, v in obj.items()]}
    raise TypeError(f"a {type(obj).__name__} cannot be stored in a checkpoint")


# The markers encode_state writes, each with exactly these keys (its plain dicts have no key starting "__").
_MARKERS = {"__tensor__": {"__tensor__"}, "__ndarray__": {"__ndarray__", "dtype"}, "__bytes__": {"__bytes__"},
            "__tuple__": {"__tuple__"}, "__items__": {"__items__"}}


def decode_state(obj, tensors: dict, field: str = ""):
    """The inverse of `encode_state`: plain data in, nothing executed. What encode_state does not write (a
    tensor the safetensors file lacks, an array dtype outside ARRAY_DTYPES) is refused, naming its field."""
    if isinstance(obj, list):
        return [decode_state(v, tensors, f"{field}[{i}]") for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        return obj
    marker = next((k for k in obj if k.startswith("__")), None)
    if marker is None:
        return {k: decode_state(v, tensors, f"{field}.{k}" if field else k) for k, v in obj.items()}
    value, field = obj[marker], field or "the state"
    need(set(obj) == _MARKERS.get(marker), field, "a value as grpo-nb stores it", obj)
    if marker in ("__tensor__", "__ndarray__"):
        need(isinstance(value, str) and value in tensors, field, f"the key of a tensor in {TRAINER_TENSORS}", value)
        if marker == "__tensor__":
            return tensors[value]
        # numpy makes any dtype a string names, e.g. "<U999999999": gigabytes per element
        need(obj["dtype"] in ARRAY_DTYPES, f"{field}.dtype", f"a numeric dtype ({', '.join(ARRAY_DTYPES)})",
             obj["dtype"])
        try:
            return tensors[value].numpy().astype(obj["dtype"])
        except TypeError as err:  # a dtype numpy lacks (bfloat16)
            raise Refused(field, f"an array numpy can hold ({err})", tensors[value]) from None
    if marker == "__bytes__":
        try:
            return base64.b64decode(value, validate=True)
        except (TypeError, ValueError):
            raise Refused(field, "base64 text (stored bytes)", value) from None
    need(isinstance(value, list), field, "a list", value)
    if marker == "__tuple__":
        return tuple(decode_state(v, tensors, f"{field}[{i}]") for i, v in enumerate(value))
    need(all(isinstance(pair, list) and len(pair) == 2 for pair in value), field, "a list of [key, value] pairs",
         value)
    items = {}
    for k, v in value:
        key = _hashable(decode_state(k, tensors, field))
        try:
            hash(key)
        except TypeError:
            raise Refused(f"{field} (a key)", "a number, a string or a tuple", key) from None
        items[key] = decode_state(v, tensors, f"{field}[{key!r}]")
    return items


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def write_state(folder: Path, state: dict) -> None:
    """`state` as trainer_state.json + trainer_state.safetensors in `folder`."""
    import safetensors.torch

    tensors: dict = {}
    encoded = encode_state(state, tensors)

    def write(tmp: Path) -> None:
        safetensors.torch.save_file(tensors, tmp / TRAINER_TENSORS)
        (tmp / TRAINER_STATE).write_text(json.dumps(encoded))

    atomic_files.write_into(folder, write)  # also when rewriting a checkpoint in place (convert_legacy_checkpoint)


def read_state(folder: Path) -> dict:
    """What `write_state` wrote: JSON and safetensors only, so reading it cannot run code."""
    folder = Path(folder)
    with _refusing(folder, TRAINER_STATE):
        return decode_state(json.loads(read_file(folder / TRAINER_STATE)[0]), load_tensors(folder / TRAINER_TENSORS))


def read_file(path: Path, cap: int | None = None) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file at `path` and its status (see _open_regular)."""
    f, info = _open_regular(path, cap)
    with f:
        return f.read(info.st_size), info  # never more than its size: a file growing meanwhile ends there


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at `path`, a regular file (see _open_regular)."""
    import safetensors.torch

    _open_regular(path)[0].close()
    return safetensors.torch.load_file(path)


def _open_regular(path: Path, cap: int | None = None):
    """`path` opened to read, and its status, if it is a regular file (a link to one is followed: a downloaded
    checkpoint's files may be links into a cache) of at most `cap` bytes. Anything else is refused by name
    (OSError), not read: a FIFO blocks its reader forever, /dev/zero never ends, a folder is no file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO opens without waiting for a writer
    info = os.fstat(fd)  # of what was opened, not of whatever is at `path` by now
    problem = None
    if not stat.S_ISREG(info.st_mode):
        kind = ("a folder" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode)
                else "a socket" if stat.S_ISSOCK(info.st_mode) else "a device")
        problem = f"{Path(path).name} is {kind}, not a regular file"
    elif cap is not None and info.st_size > cap:
        problem = f"{Path(path).name} is {info.st_size:,} bytes, more than grpo-nb writes there ({cap:,} at most)"
    if problem:
        os.close(fd)
        raise OSError(problem)
    return os.fdopen(fd, "rb"), info


@contextlib.contextmanager
def _refusing(path: Path, file: str):
    """A field that failed its check (checkpoint_schema.Refused) as the error the user sees."""
    try:
        yield
    except Refused as err:
        raise _foreign(path, file, err) from None


def _foreign(path: Path, file: str, problem) -> CheckpointError:
    others = [p.name for p in checkpoints(path.parent) if p != path]
    return CheckpointError(
        f"Cannot resume from {path}: damaged or foreign checkpoint ({file}: {problem}). Nothing of it was "
        f"loaded: the model's weights and output_dir are as they were. Resume from a checkpoint-<step> folder "
        f"a grpo-nb run wrote"
        + (f" ({', '.join(others)} in the same folder)" if others else "") + ", or start again without resuming.")


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
        write_state(tmp, state)

    path = atomic_files.expand(path)
    try:
        atomic_files.remove_leftovers(path.parent)  # of any run killed mid-write here
        return atomic_files.write_folder(path, write)
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
    # Only folders a run wrote: a link named checkpoint-<step> is someone's, and deleting "it" must never
    # delete what it points to.
    for path in [p for p in checkpoints(output_dir) if not p.is_symlink()][: -keep or None]:
        with contextlib.suppress(OSError):  # one left over costs disk space, not the run
            atomic_files.remove_folder(path)  # whole or gone: never a half-deleted checkpoint that loads


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
    text = os.fspath(resume_from_checkpoint)
    if isinstance(text, str) and text.strip().lower() in ("", "true", "false"):  # e.g. from YAML or a command line
        said = "is empty" if not text.strip() else f"is the text {text!r}, not a folder"
        raise ValueError(f"train(resume_from_checkpoint={text!r}) {said}: pass the bool True to resume from the "
                         f"newest checkpoint in output_dir, None (or False) to start fresh, or a checkpoint "
                         f"folder's path.")
    return atomic_files.expand(text)  # '~/runs/checkpoint-50', as output_dir and the save functions read it


def check_no_later_checkpoints(output_dir, step: int, path: Path) -> None:
    """A run resumed at `step` writes checkpoint-<step + 1>, ... into output_dir, and rotation keeps the highest
    numbers: checkpoints there numbered above `step` (the rest of the run it goes back on, a copy) would be
    replaced by the new ones, or kept over them while the new ones are deleted. Refused while they are there."""
    later = [p.name for p in checkpoints(output_dir) if int(_CHECKPOINT.match(p.name).group(1)) > step]
    if later:
        raise ValueError(
            f"Cannot resume from {path} (step {step}) in output_dir={str(output_dir)!r}: it holds "
            f"{', '.join(later)}, numbered after step {step}. The resumed run writes its checkpoints there by step "
            f"number and keeps the highest numbers (save_total_limit), so its new checkpoints would replace those, "
            f"or be deleted to keep them. Move them out of output_dir (or delete them), or resume into a new "
            f"output_dir.")


def read_training_checkpoint(path, model) -> tuple[dict, dict, dict | None]:
    """(the trainer state, the trainable weights, the run's settings: its grpo_config.json, None when it has
    none) saved in `path`, each checked against what grpo-nb writes (checkpoint_schema) and the weights against
    `model`; nothing is loaded into anything yet."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"Cannot resume: {path} is not a folder. Pass a checkpoint-<step> folder or True.")
    if (path / LEGACY_TRAINER_STATE).exists() and not (path / TRAINER_STATE).exists():
        raise ValueError(
            f"Cannot resume from {path}: it was written by an older grpo-nb, which stored the trainer state as a "
            f"pickle ({LEGACY_TRAINER_STATE}); loading a pickle can run any code it holds, so grpo-nb does not. "
            f"If you wrote it yourself and trust it, convert it once with "
            f"grpo_nb.checkpointing.convert_legacy_checkpoint({str(path)!r}), then resume.")
    missing = [name for name in (TRAINER_STATE, TRAINER_TENSORS, TRAINABLE) if not (path / name).exists()]
    if missing:
        inside, beside = checkpoints(path), [p.name for p in checkpoints(path.parent) if p != path]
        instead = (f"pass one of the checkpoints in it ({', '.join(str(p) for p in inside[-3:])})" if inside else
                   f"resume from one of the checkpoints beside it ({', '.join(beside)})" if beside else
                   "pass a checkpoint-<step> folder a train() run wrote into its output_dir")
        raise ValueError(f"Cannot resume from {path}: it is not a grpo-nb training checkpoint (missing "
                         f"{', '.join(missing)}): {instead}.")
    name = TRAINABLE
    try:
        tensors = load_tensors(path / TRAINABLE)
        name = f"{TRAINER_STATE} / {TRAINER_TENSORS}"
        state = read_state(path)
        name = SETTINGS
        settings = json.loads(read_file(path / SETTINGS)[0]) if (path / SETTINGS).exists() else None
    except CheckpointError:
        raise
    except Exception as err:  # also RecursionError: JSON nested deeper than Python's stack
        raise _foreign(path, name, f"could not be read, {type(err).__name__}: {err}") from err
    params = dict(model.named_parameters())
    expected = {name for name, p in params.items() if p.requires_grad}
    if set(tensors) != expected:
        unknown, absent = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        raise ValueError(
            f"Cannot resume from {path}: it was written for another model or LoRA setup "
            f"({len(unknown)} tensors this model does not train, e.g. {unknown[:2]}; {len(absent)} trained tensors "
            f"missing, e.g. {absent[:2]}). Load the same model with the same lora_rank and target_modules."
        )
    for name, tensor in tensors.items():
        if params[name].shape != tensor.shape:
            raise ValueError(f"Cannot resume from {path}: {name} has shape {tuple(tensor.shape)} in the "
                             f"checkpoint but {tuple(params[name].shape)} in the model.")
    with _refusing(path, TRAINABLE):
        check_weights(tensors, params)
    with _refusing(path, TRAINER_STATE):
        check_trainer_state(state)
        # checkpoint-<n> holds step n: a copy or a renamed folder would be taken for another step (resume=True
        # picks the highest number, rotation keeps the highest numbers)
        number = _CHECKPOINT.match(path.name)
        need(number is None or int(number.group(1)) == state["step"], "step",
             f"{number and int(number.group(1))}, the step its folder's name says (a checkpoint copied or renamed "
             f"to another step's name)", state["step"])
    with _refusing(path, SETTINGS):
        need(settings is None or (isinstance(settings, dict) and is_plain(settings)), "the settings",
             "a JSON object of GRPOConfig's fields", settings)
    return state, tensors, settings


def load_weights(model, weights: dict) -> None:
    """Copy checked trainable weights (read_training_checkpoint's) into `model`."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(like(params[name], tensor))  # a sharded parameter takes its shard


def load_training_checkpoint(path, model) -> dict:
    """Load the trainable weights into `model` once everything in `path` is checked; return the trainer state."""
    state, weights, _ = read_training_checkpoint(path, model)
    load_weights(model, weights)
    return state


def restore_state(path, state, weights, *, model, optimizer, scheduler, scaler, prompts, rollout, batch_type) -> None:
    """Check a checkpoint's state (read_training_checkpoint's) against this run - its dataset, optimizer,
    schedule, rollout, vocabulary and the pending batch's fields (`batch_type`, step.StepBatch) - and only
    then put the weights, optimizer, schedule, random states and data position in place."""
    order = state["sampler"]["order"]
    if order and max(order) >= len(prompts.dataset):
        raise ValueError(f"The checkpoint was trained on a dataset with at least {max(order) + 1} rows and is part "
                         f"way through an epoch of it; this dataset has {len(prompts.dataset)}. Resume with the "
                         f"same dataset (its order is part of the checkpoint), or start a new run in a new "
                         f"output_dir for another dataset.")
    with _refusing(Path(path), TRAINER_STATE):
        check_fits_run(state, optimizer=optimizer, scheduler=scheduler, rollout=rollout, batch_type=batch_type,
                       vocab_size=_vocab_size(model))
    load_weights(model, weights)
    load_optimizer_state(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    prompts.load_state_dict(state["sampler"])
    if state["rollout"] is not None and hasattr(rollout, "load_state_dict"):
        rollout.load_state_dict(state["rollout"])
    set_rng_state(state["rng"])


def _vocab_size(model) -> int | None:
    """The rows of the model's input embedding: token ids must be below it."""
    try:
        return model.get_input_embeddings().weight.shape[0]
    except (AttributeError, NotImplementedError):
        return None


# Fields a resumed run may change without a word: where it stops, how it logs and saves.
RESUMABLE_CHANGES = {"max_steps", "logging_steps", "save_steps", "save_total_limit", "num_completions_to_print",
                     "sample_history_steps", "report_to", "run_name", "project", "logging_dir",
                     "log_completions", "log_completions_path", "output_dir", "reward_timeout", "max_nonfinite_steps",
                     "max_unscored_steps"}


def warn_changed_settings(path: Path, saved: dict | None, config) -> None:
    """A resume with other training settings than the checkpoint's (`saved`, read_training_checkpoint's) runs
    on under the new ones; say which changed, since the result then differs from an unbroken run's."""
    if saved is None:  # a checkpoint without its settings: nothing to compare with
        return
    now = json.loads(json.dumps(_jsonable(dataclasses.asdict(config))))  # as saved: lists for tuples
    changed = [f"{k} {saved[k]!r} -> {now[k]!r}" for k in sorted(now)
               if k in saved and saved[k] != now[k] and k not in RESUMABLE_CHANGES]
    if changed:
        warnings.warn(f"Resuming from {path} with settings that differ from the ones it was trained with: "
                      f"{'; '.join(changed)}. The run continues under the new ones (the optimizer's settings too, "
                      f"and the learning rate follows the new schedule from this step), so it will not equal an "
                      f"unbroken run.", stacklevel=4)


def convert_legacy_checkpoint(path) -> Path:
    """Rewrite an older grpo-nb checkpoint's pickled trainer_state.pt in today's format (JSON +
    safetensors). Unpickling runs code: call this only on a checkpoint you trust (e.g. your own)."""
    path = Path(path)
    state = torch.load(path / LEGACY_TRAINER_STATE, map_location="cpu", weights_only=False)
    pending = state.get("pending")
    if isinstance(pending, list) and len(pending) == 3:  # [batch dict, info dict, iterations left]
        batch, info, left = pending
        from .step import StepBatch

        merged = {k: v for k, v in {**batch, **info}.items() if k in StepBatch.__dataclass_fields__}
        generations = json.loads((path / "grpo_config.json").read_text())["num_generations"]
        state["pending"] = (StepBatch(**merged, num_generations=generations).state_dict(), left)
    write_state(path, state)
    (path / LEGACY_TRAINER_STATE).unlink()
    return path


# ----------------------------------------------------------------------------------------
# One run per output_dir

LOCK = ".grpo_nb.lock"
# A folder holding one of these files, a JSON object with these keys, was written by transformers, peft or a
# grpo-nb run: saving there again is meant. A name alone proves nothing (anyone's project has a config.json).
SAVED_HERE = {"config.json": ("model_type",), "adapter_config.json": ("peft_type",),
              "grpo_config.json": ("output_dir", "num_generations", "max_completion_length", "beta")}


def foreign_files(folder) -> list[str]:
    """The names in `folder` when it holds files but none a model, an adapter or a training run
    wrote; [] for a new, empty or such a folder."""
    folder = Path(folder)
    # Hidden entries (.ipynb_checkpoints, .DS_Store) and TensorBoard's runs/ folder (a run that stopped before
    # its first checkpoint) are never overwritten by saving.
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")
                   and not (p.name == "runs" and p.is_dir() and not p.is_symlink())) if folder.is_dir() else []
    if any(saved_here(folder / n) for n in names):
        return []
    return names


def saved_here(path: Path) -> bool:
    """`path` shows a save: a model's or an adapter's config, a run's grpo_config.json, a checkpoint
    folder, an adapter peft saved in a subfolder (an adapter name other than "default"), or a run's
    log_completions_path file (a run killed before its first checkpoint leaves only that)."""
    if path.is_symlink():
        return False  # someone's link, whatever it points to
    if path.is_dir():
        return bool(_CHECKPOINT.match(path.name)) or "peft_type" in _json_object(path / "adapter_config.json")
    if path.name in SAVED_HERE:
        return all(key in _json_object(path) for key in SAVED_HERE[path.name])
    return written_by_grpo_nb(path)


def _json_object(path: Path, limit: int = 2**20) -> dict:
    """The JSON object in the regular file `path`, or {} (not one, not JSON, over `limit` bytes, unreadable)."""
    if not atomic_files.regular_file(path):
        return {}
    try:
        with atomic_files.open_to_read(path) as f:
            data = f.read(limit + 1)
        value = json.loads(data) if len(data) <= limit else None
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


_HELD: set[str] = set()  # lock files this process holds


@contextlib.contextmanager
def output_dir_lock(output_dir, enabled: bool = True):
    """Hold `output_dir/.grpo_nb.lock` while a run writes there: a second run (another process, another
    notebook, another thread) is refused with a message naming the first. The lock of a process that
    died (killed, a crashed kernel) is taken over."""
    if not enabled:
        yield
        return
    path = Path(output_dir) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    key = str(path.resolve())
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            owner = _lock_owner(path, output_dir)
            if owner is not None and not _stale(owner, key):
                raise RuntimeError(
                    f"output_dir={str(output_dir)!r} is in use by another training run: process {owner['pid']} on "
                    f"{owner['host']}, started {owner['started']}. Two runs writing one folder would mix "
                    f"their checkpoints. Wait for it to finish, stop it, or pass another output_dir. If that run is "
                    f"gone (e.g. on another machine sharing this disk), delete {path}.")
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        break
    _HELD.add(key)
    try:
        yield
    finally:
        _HELD.discard(key)
        with contextlib.suppress(OSError, ValueError):
            owner = json.loads(read_file(path, cap=2**16)[0])
            if isinstance(owner, dict) and owner.get("pid") == os.getpid():
                path.unlink()


def _lock_owner(path: Path, output_dir) -> dict | None:
    """The run holding the lock file `path`, as it wrote itself there (checked: checkpoint_schema.check_lock);
    None when the file is gone, or empty: its writer was killed between creating and writing it."""
    deadline = time.monotonic() + 2  # a clock skewed on a shared disk could make an mtime look young forever
    try:
        while True:
            try:
                text, info = read_file(path, cap=2**16)  # a lock is one line: a FIFO or /dev/zero is refused
            except FileNotFoundError:  # its run ended just now
                return None
            if text or time.time() - info.st_mtime >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # created a moment ago: its run is writing it now
        if not text:
            return None
        owner = json.loads(text)
        check_lock(owner)
    except (OSError, ValueError, RecursionError, Refused) as err:  # not a file, not JSON, or not a lock grpo-nb writes
        raise CheckpointError(
            f"output_dir={str(output_dir)!r}: damaged or foreign lock file {path} ({err}). A running grpo-nb "
            f"run keeps its process id there, so this one cannot tell whether another run uses the folder. If "
            f"none does, delete {path}, then run again.") from None
    return owner


def _stale(owner: dict, key: str) -> bool:
    """The lock's process (checked by _lock_owner) is gone: dead on this host, or this very process holding
    it no longer."""
    if owner["host"] != socket.gethostname():
        return False  # another machine's process cannot be checked: assume it runs
    if owner["pid"] == os.getpid():
        return key not in _HELD  # left behind by an earlier run in this process that could not clean up
    return not atomic_files.running(owner["pid"])
