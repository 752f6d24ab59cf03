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
import shutil
import socket
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from .distributed import like, load_optimizer_state

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


def _atomic_folder(path: Path, write) -> Path:
    """Run `write(tmp)` on a fresh hidden folder beside `path`, then move it to `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(path.parent)
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


_LEFTOVER = re.compile(r"^\..+\.(tmp|old)-(\d+)$")


def _remove_leftovers(folder: Path) -> None:
    """Half-written folders of processes that were killed mid-write (their pid is gone)."""
    for entry in folder.iterdir():
        m = _LEFTOVER.match(entry.name)
        if m and int(m.group(2)) != os.getpid() and not _alive(int(m.group(2))):
            shutil.rmtree(entry, ignore_errors=True)


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
        _remove_leftovers(path)
        # Written beside, then each file renamed into place: a process killed meanwhile leaves every
        # file whole (the old one or the new one), never half written.
        tmp = path / f".result.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _write_model_files(tmp, model, tokenizer, config, history, trainable)
        for entry in sorted(tmp.iterdir(), key=lambda e: e.suffix == ".safetensors"):  # the weights last
            if entry.is_dir():
                shutil.rmtree(path / entry.name, ignore_errors=True)
            os.replace(entry, path / entry.name)
        tmp.rmdir()
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


def decode_state(obj, tensors: dict):
    """The inverse of `encode_state`: plain data in, nothing executed."""
    if isinstance(obj, list):
        return [decode_state(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy().astype(obj["dtype"])
    if "__bytes__" in obj:
        return base64.b64decode(obj["__bytes__"])
    if "__tuple__" in obj:
        return tuple(decode_state(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_hashable(decode_state(k, tensors)): decode_state(v, tensors) for k, v in obj["__items__"]}
    return {k: decode_state(v, tensors) for k, v in obj.items()}


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def write_state(folder: Path, state: dict) -> None:
    """`state` as trainer_state.json + trainer_state.safetensors in `folder`."""
    import safetensors.torch

    tensors: dict = {}
    encoded = encode_state(state, tensors)
    safetensors.torch.save_file(tensors, folder / TRAINER_TENSORS)
    (folder / TRAINER_STATE).write_text(json.dumps(encoded))


def read_state(folder: Path) -> dict:
    """What `write_state` wrote: JSON and safetensors only, so reading it cannot run code."""
    import safetensors.torch

    return decode_state(json.loads((folder / TRAINER_STATE).read_text()),
                        safetensors.torch.load_file(folder / TRAINER_TENSORS))


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
    order = state["sampler"]["order"]
    if order and max(order) >= len(prompts.dataset):
        raise ValueError(f"The checkpoint was trained on a dataset with at least {max(order) + 1} rows and is part "
                         f"way through an epoch of it; this dataset has {len(prompts.dataset)}. Resume with the "
                         f"same dataset (its order is part of the checkpoint), or start a new run in a new "
                         f"output_dir for another dataset.")
    load_optimizer_state(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    prompts.load_state_dict(state["sampler"])
    if state["rollout"] is not None and hasattr(rollout, "load_state_dict"):
        rollout.load_state_dict(state["rollout"])
    set_rng_state(state["rng"])


# Fields a resumed run may change without a word: where it stops, how it logs and saves.
RESUMABLE_CHANGES = {"max_steps", "logging_steps", "save_steps", "save_total_limit", "num_completions_to_print",
                     "sample_history_steps", "report_to", "run_name", "project", "logging_dir",
                     "log_completions", "log_completions_path", "output_dir", "reward_timeout", "max_nonfinite_steps"}


def warn_changed_settings(path: Path, config) -> None:
    """A resume with other training settings than the checkpoint's runs on under the new ones; say
    which changed, since the result then differs from an unbroken run's."""
    try:
        saved = json.loads((Path(path) / "grpo_config.json").read_text())
    except (OSError, ValueError):
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
    if any(n in SAVED_HERE or _CHECKPOINT.match(n) for n in names):
        return []
    return names


_HELD: set[str] = set()  # lock files this process holds


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, alive
        return True
    return True


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
            try:
                owner = json.loads(path.read_text())
            except (OSError, ValueError):  # half-written by a process killed right then, or just removed
                owner = None
            if owner is not None and not _stale(owner, key):
                raise RuntimeError(
                    f"output_dir={str(output_dir)!r} is in use by another training run: process {owner.get('pid')} on "
                    f"{owner.get('host')}, started {owner.get('started')}. Two runs writing one folder would mix "
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
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()


def _stale(owner: dict, key: str) -> bool:
    """The lock's process is gone: dead on this host, or this very process holding it no longer."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False  # another machine's process cannot be checked: assume it runs
    if owner["pid"] == os.getpid():
        return key not in _HELD  # left behind by an earlier run in this process that could not clean up
    return not _alive(owner["pid"])
