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
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from . import atomic_files
from .checkpoint_schema import (ARRAY_DTYPES, CheckpointError, Refused, check_fits_run, check_lock,
                                check_trainer_state, check_weights, need)
from .distributed import like, load_optimizer_state
from .tracking import written_by_grpo_nb

TRAINER_STATE = "trainer_state.json"
TRAINER_TENSORS = "trainer_state.safetensors"
LEGACY_TRAINER_STATE = "trainer_state.pt"  # before grpo-nb 0.2: a pickle, which loading would run
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
        atomic_files.write_into(path, lambda tmp: _write_model_files(tmp, model, tokenizer, config, history,
                                                                     trainable))
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
    import safetensors.torch

    folder = Path(folder)
    with _refusing(folder, TRAINER_STATE):
        return decode_state(json.loads((folder / TRAINER_STATE).read_text()),
                            safetensors.torch.load_file(folder / TRAINER_TENSORS))


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
    return Path(resume_from_checkpoint)


def read_training_checkpoint(path, model) -> tuple[dict, dict]:
    """(the trainer state, the trainable weights) saved in `path`, each checked against what grpo-nb writes
    (checkpoint_schema) and the weights against `model`; nothing is loaded into anything yet."""
    import safetensors.torch

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
        raise ValueError(
            f"Cannot resume from {path}: it is not a grpo-nb training checkpoint (missing {', '.join(missing)}). "
            "Resume from a checkpoint-<step> folder written by train(), e.g. resume_from_checkpoint=True."
        )
    name = TRAINABLE
    try:
        tensors = safetensors.torch.load_file(path / TRAINABLE)
        name = f"{TRAINER_STATE} / {TRAINER_TENSORS}"
        state = read_state(path)
    except CheckpointError:
        raise
    except Exception as err:
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
    return state, tensors


def load_weights(model, weights: dict) -> None:
    """Copy checked trainable weights (read_training_checkpoint's) into `model`."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(like(params[name], tensor))  # a sharded parameter takes its shard


def load_training_checkpoint(path, model) -> dict:
    """Load the trainable weights into `model` once everything in `path` is checked; return the trainer state."""
    state, weights = read_training_checkpoint(path, model)
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


def warn_changed_settings(path: Path, config) -> None:
    """A resume with other training settings than the checkpoint's runs on under the new ones; say
    which changed, since the result then differs from an unbroken run's."""
    try:
        saved = json.loads((Path(path) / "grpo_config.json").read_text())
    except (OSError, ValueError):
        return
    if not isinstance(saved, dict):  # not a config grpo-nb wrote: nothing to compare with
        return
    now = json.loads(json.dumps(dataclasses.asdict(config)))  # as saved: lists for tuples
    changed = [f"{k} {saved[k]!r} -> {now[k]!r}" for k in sorted(now)
               if k in saved and saved[k] != now[k] and k not in RESUMABLE_CHANGES]
    if changed:
        warnings.warn(f"Resuming from {path} with settings that differ from the ones it was trained with: "
                      f"{'; '.join(changed)}. The run continues under the new ones (the learning rate follows "
                      f"the new schedule from this step), so it will not equal an unbroken run.", stacklevel=4)


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
# A folder holding one of these was written by transformers, peft or a grpo-nb run: saving there again is
# meant. Any other non-empty folder is someone else's, and its files could be overwritten.
SAVED_HERE = ("adapter_config.json", "config.json", TRAINER_STATE, LOCK, "grpo_config.json")


def foreign_files(folder) -> list[str]:
    """The names in `folder` when it holds files but none a model, an adapter or a training run
    wrote; [] for a new, empty or such a folder."""
    folder = Path(folder)
    # Hidden entries (.ipynb_checkpoints, .DS_Store) and TensorBoard's runs/ (a run that stopped before
    # its first checkpoint) are never overwritten by saving.
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and p.name != "runs") \
        if folder.is_dir() else []
    # A run's log_completions_path file too: a run killed before its first checkpoint leaves only that.
    if any(n in SAVED_HERE or _CHECKPOINT.match(n) or written_by_grpo_nb(folder / n) for n in names):
        return []
    return names


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
            owner = json.loads(path.read_text())
            if isinstance(owner, dict) and owner.get("pid") == os.getpid():
                path.unlink()


def _lock_owner(path: Path, output_dir) -> dict | None:
    """The run holding the lock file `path`, as it wrote itself there (checked: checkpoint_schema.check_lock);
    None when the file is gone, or empty: its writer was killed between creating and writing it."""
    deadline = time.monotonic() + 2  # a clock skewed on a shared disk could make an mtime look young forever
    while True:
        try:
            text = path.read_bytes()
            young = time.time() - path.stat().st_mtime < 2
        except FileNotFoundError:  # its run ended just now
            return None
        if text or not young or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # created a moment ago: its run is writing it now
    if not text:
        return None
    try:
        owner = json.loads(text)
        check_lock(owner)
    except (ValueError, Refused) as err:  # not JSON, not UTF-8, or not a lock grpo-nb writes
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
