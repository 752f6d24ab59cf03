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
import hashlib
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
from .batch import StepBatch
from .checkpoint_schema import (ARRAY_DTYPES, FLOAT_DTYPES, CheckpointError, Refused, check_fits_run, check_lock,
                                check_trainer_state, check_weights, is_plain, need)
from .distributed import like, load_optimizer_state
from .tracking import written_by_grpo_nb

TRAINER_STATE = "trainer_state.json"
TRAINER_TENSORS = "trainer_state.safetensors"
LEGACY_TRAINER_STATE = "trainer_state.pt"  # before grpo-nb 0.2: a pickle, which loading would run
TRAINABLE = "trainable.safetensors"
SETTINGS = "grpo_config.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _jsonable(value, *, null_nonfinite: bool = True, depth: int = 32):
    """`value` as plain JSON data, whatever a reward function, a dataset column or a setting put in it, so
    that a save never fails on a value and a resume accepts what it wrote (checkpoint_schema.is_plain):
    numpy scalars become numbers, tuples lists, keys text, and anything else - a tensor, bytes, a datetime,
    an int too long for JSON, data nested over `depth` levels - its text. NaN and inf become null
    (`null_nonfinite`, for files other tools read; trainer_state.json keeps them: NaN means "no score")."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, float):
        return None if null_nonfinite and not math.isfinite(value) else value
    if isinstance(value, int):
        return value if _printable(value) else _text(value)
    if isinstance(value, dict) and depth > 0:
        return {k if isinstance(k, str) else _text(k): _jsonable(v, null_nonfinite=null_nonfinite, depth=depth - 1)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)) and depth > 0:
        return [_jsonable(v, null_nonfinite=null_nonfinite, depth=depth - 1) for v in value]
    return _text(value)


def _printable(number: int) -> bool:
    """Whether Python writes `number` in digits: it refuses past sys.get_int_max_str_digits() (4300 by default)."""
    if number.bit_length() <= 64:
        return True
    try:
        str(number)
    except ValueError:
        return False
    return True


def _text(value) -> str:
    try:
        return str(value)
    except Exception:  # an int too long to print, data nested deeper than Python's stack, a __str__ that raises
        if isinstance(value, int):
            return f"<an int of about {int(value.bit_length() * math.log10(2)) + 1:,} digits>"
        return f"<a {type(value).__name__}>"


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
        return encode_state(obj.item(), tensors)
    if isinstance(obj, int) and not isinstance(obj, bool) and not _printable(obj):
        raise TypeError(f"{_text(obj)} cannot be stored in a checkpoint (JSON)")
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

    if "history" in state:  # whatever a record holds (a dataset's value, a callback's), a resume accepts it
        state = {**state, "history": _jsonable(state["history"], null_nonfinite=False)}

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
            raise FileNotFoundError(f"resume_from_checkpoint=True, but {output_dir} has no checkpoint-<step> folder "
                                    f"to resume from. {without_checkpoints(Path(output_dir))}")
        return found[-1]
    text = os.fspath(resume_from_checkpoint)
    if isinstance(text, str) and text.strip().lower() in ("", "true", "false"):  # e.g. from YAML or a command line
        said = "is empty" if not text.strip() else f"is the text {text!r}, not a folder"
        raise ValueError(f"train(resume_from_checkpoint={text!r}) {said}: pass the bool True to resume from the "
                         f"newest checkpoint in output_dir, None (or False) to start fresh, or a checkpoint "
                         f"folder's path.")
    return atomic_files.expand(text)  # '~/runs/checkpoint-50', as output_dir and the save functions read it


def finished_result(output_dir: Path) -> tuple[str, Path] | None:
    """What a finished run saved in `output_dir`, and the folder to load it from: ("adapter", folder) - peft keeps an
    adapter named other than "default" in a subfolder of that name - or ("model", output_dir) for full fine-tuning;
    None when neither is there."""
    if "peft_type" in _json_object(output_dir / "adapter_config.json"):
        return "adapter", output_dir
    # a named adapter's subfolder counts in a run's folder only (its grpo_config.json): anywhere else it is the
    # user's adapter, kept in a folder of its own
    subfolders = sorted(p for p in output_dir.iterdir() if p.is_dir() and not p.is_symlink()) \
        if saved_here(output_dir / SETTINGS) else []
    for sub in subfolders:
        if not _CHECKPOINT.match(sub.name) and "peft_type" in _json_object(sub / "adapter_config.json"):
            return "adapter", sub
    if "model_type" in _json_object(output_dir / "config.json") and any(output_dir.glob("model*.safetensors")):
        return "model", output_dir
    return None


def saved_weights(folder: Path) -> str | None:
    """"model" or "adapter" when `folder` holds what transformers or peft loads as one (its config.json or
    adapter_config.json), whatever its weight files are called (model.safetensors, pytorch_model.bin, shards,
    none yet); None otherwise."""
    if "peft_type" in _json_object(folder / "adapter_config.json"):
        return "adapter"
    return "model" if "model_type" in _json_object(folder / "config.json") else None


def without_checkpoints(output_dir: Path) -> str:
    """What to do in an output_dir without checkpoints. A finished run with save_steps=0 (the quickstart's) left
    only its adapter (or, fully fine-tuned, its model) there: not resumable (no optimizer, schedule or history), but
    its weights can be trained on, as a new run, while starting afresh in that folder would replace them."""
    if all((output_dir / name).is_file() for name in (TRAINER_STATE, TRAINABLE)):
        return (f"It is a checkpoint folder itself: resume it with output_dir={str(output_dir.parent)!r} (its run's "
                f"folder), or with resume_from_checkpoint={str(output_dir)!r} and a new output_dir.")
    found = finished_result(output_dir)
    if found is None:
        return "Start without resume_from_checkpoint, or pass the checkpoint folder's path."
    kind, folder = found
    if kind == "model":
        load = (f"model = grpo_nb.prepare_for_training(AutoModelForCausalLM.from_pretrained({str(folder)!r}), "
                f"lora_rank=None)")
        fresh = "the model you pass and replaces this one"
    else:
        base = _json_object(folder / "adapter_config.json").get("base_model_name_or_path")
        base = repr(base) if isinstance(base, str) and base else "<its base model>"
        load = (f"model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base}), "
                f"{str(folder)!r}, is_trainable=True)")
        fresh = "a fresh adapter from the base model and replaces this one"
    return (f"It holds the {kind} a finished run saved, and no checkpoint of its optimizer and history (saved "
            f"every save_steps; 0 saves none), which resuming continues. To train that {kind} further, as a new run "
            f"from its weights: {load}, then train(model, ..., output_dir=<a new folder>). Starting "
            f"without resume_from_checkpoint in {str(output_dir)!r} trains {fresh} when it ends.")


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
    `model`, its LoRA setup and its base model included; nothing is loaded into anything yet."""
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
        instead = (f"pass one of the checkpoints in it ({', '.join(str(p) for p in inside[-3:])}), or True with "
                   f"output_dir={str(path)!r} to continue from its newest" if inside else
                   f"resume from one of the checkpoints beside it ({', '.join(beside)})" if beside else
                   "pass a checkpoint-<step> folder a train() run wrote into its output_dir")
        finished = f" {without_checkpoints(path)}" if finished_result(path) and not (inside or beside) else ""
        raise ValueError(f"Cannot resume from {path}: it is not a grpo-nb training checkpoint (missing "
                         f"{', '.join(missing)}): {instead}.{finished}")
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
    folder = adapter_folder(path, model)
    adapter = _json_object(folder / "adapter_config.json")  # peft's, beside the adapter's weights
    adapter = adapter if is_plain(adapter) else {}
    params = dict(model.named_parameters())
    expected = {name for name, p in params.items() if p.requires_grad}
    # before the tensors' names: it names the setting that differs; target_modules by the layers LoRA sits on
    check_same_adapter(path, adapter, model, same_layers=set(tensors) == expected)
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
    check_same_base(path, state.get("identity", {}).get("base"), adapter, model, folder)
    return state, tensors, settings


def adapter_folder(path: Path, model) -> Path:
    """Where peft saved the model's adapter in `path`: `path` itself, or its subfolder named after the adapter when
    that is not "default" (get_peft_model(..., adapter_name="grpo") saves into <path>/grpo)."""
    name = getattr(model, "active_adapter", None) if getattr(model, "active_peft_config", None) is not None else None
    if isinstance(name, str) and name != "default" and (path / name / "adapter_config.json").exists() \
            and not (path / "adapter_config.json").exists():
        return path / name
    return path


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
    then put the weights, optimizer, schedule, random states and data position in place. `rollout`: the run's
    engine when it keeps a random state of its own (a grpo_nb.rollout.ResumableRollout), else None."""
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
    if state["rollout"] is not None and rollout is not None:
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


# Settings a resume cannot apply: the checkpoint's state fixes them.
NOT_APPLIED = {"seed": "a resumed run continues the checkpoint's random streams (sampling, data order), so it draws "
                       "what the unbroken run would. Start a new run, without resume_from_checkpoint, for another seed"}


def warn_changed_settings(path: Path, saved: dict | None, config, *, state: dict | None = None,
                          identity: dict | None = None, reward_names: list[str] | None = None) -> None:
    """A resume with other training settings (`saved`: the checkpoint's grpo_config.json), reward functions or data
    (`state`: its trainer state, against this run's `identity` and `reward_names`) runs on under the new ones, so
    the result differs from an unbroken run's: say which changed, and which a resume does not apply (the seed)."""
    if saved is not None:  # a checkpoint without its settings: nothing to compare with
        now = json.loads(json.dumps(_jsonable(dataclasses.asdict(config))))  # as saved: lists for tuples
        differ = [k for k in sorted(now) if k in saved and saved[k] != now[k] and k not in RESUMABLE_CHANGES]
        changed = [f"{k} {_short(saved[k])} -> {now[k]!r}" for k in differ if k not in NOT_APPLIED]
        if changed:
            warnings.warn(f"Resuming from {path} with settings that differ from the ones it was trained with: "
                          f"{'; '.join(changed)}. The run continues under the new ones (the optimizer's settings "
                          f"too, and the learning rate follows the new schedule from this step), so it will not "
                          f"equal an unbroken run.", stacklevel=4)
        for k in (k for k in differ if k in NOT_APPLIED):
            warnings.warn(f"Resuming from {path} with {k} {_short(saved[k])} -> {now[k]!r}, which a resume does not "
                          f"apply: {NOT_APPLIED[k]}.", stacklevel=4)
    inputs = changed_inputs(state, identity, reward_names) if state is not None else []
    if inputs:
        warnings.warn(f"Resuming from {path} with other inputs than it was trained with: {'; '.join(inputs)}. The "
                      f"run trains on the new ones from step {state['step'] + 1}: its history's rewards before and "
                      f"after measure different things, and it will not equal an unbroken run. Resume with the "
                      f"checkpoint's to continue that run, or start a new run in a new output_dir.", stacklevel=4)


def changed_inputs(state: dict, identity: dict | None, reward_names: list[str] | None) -> list[str]:
    """What this run trains on that differs from the checkpoint's (`state`, checked): the reward functions, by the
    names its records hold; the dataset, by its size and a digest of a few rows; the tokens its prompts become."""
    changes = []
    before = state["history"][-1].get("rewards") if state["history"] else None
    if isinstance(before, dict) and reward_names is not None and list(before) != list(reward_names):
        changes.append(f"reward functions {_short(list(before))} -> {list(reward_names)!r}")
    saved, now = state.get("identity", {}).get("dataset"), (identity or {}).get("dataset")
    if saved and now:
        if saved["rows"] != now["rows"]:
            changes.append(f"a dataset of {now['rows']} rows (it was trained on {saved['rows']}; the data order "
                           f"continues the checkpoint's epoch)")
        elif None not in (saved["rows_digest"], now["rows_digest"]) and saved["rows_digest"] != now["rows_digest"]:
            changes.append(f"another dataset of the same size ({now['rows']} rows, other contents, or the same rows "
                           f"in another order: the rest of the checkpoint's epoch then takes other rows, some again, "
                           f"some never; rows are compared by a sample of 9)")
        elif (None not in (saved["prompts_digest"], now["prompts_digest"])
              and saved["prompts_digest"] != now["prompts_digest"]):
            changes.append("prompts that become other tokens (another chat template or tokenizer)")
    return changes


# ----------------------------------------------------------------------------------------
# What a run trains on: its base model, its adapter and its data, compared when it is resumed

# Positions sampled in each dimension of a weight for its fingerprint: small and fixed, so that an embedding
# resized for added tokens (new rows at the end) keeps them.
_SAMPLED = (0, 1, 7, 31, 127, 511, 2047, 8191)
# LoRA settings that change what the adapter's weights mean: its scale (lora_alpha / r, / sqrt(r) with rsLoRA),
# DoRA's magnitudes, the layers that carry it. lora_dropout only shapes the training from here on: warned.
ADAPTER_MEANING = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "rank_pattern", "alpha_pattern",
                   "target_modules")


def run_identity(model, tokenizer, dataset) -> dict:
    """What a checkpoint's weights mean something only together with: the base model under them and the data they
    were trained on. Taken when a run starts (before a checkpoint's weights are loaded), kept in its checkpoints,
    and compared when one is resumed (read_training_checkpoint, warn_changed_settings)."""
    return {"base": base_identity(model), "dataset": data_identity(dataset, tokenizer)}


def base_identity(model) -> dict:
    """The base model: its architecture, the hub id or folder it was loaded from, and a fingerprint of its weights."""
    config = getattr(model, "config", None)
    return {"model_type": getattr(config, "model_type", None) or None,
            "name_or_path": str(getattr(config, "name_or_path", None) or "") or None,
            "fingerprint": weight_fingerprint(model), "layers": layer_fingerprint(model)}


def weight_fingerprint(model) -> list | None:
    """Values at fixed positions of frozen weights a checkpoint relies on but does not hold: the input embedding and
    the last frozen 1-D weight (the final norm). Both lie outside the decoder layers, so neither quantization (4-bit)
    nor sharding (fsdp) changes them, and a QLoRA and a bf16 run of one base agree. None when there is none to read
    (full fine-tuning, offloaded weights)."""
    try:
        embedding = model.get_input_embeddings().weight
    except (AttributeError, NotImplementedError):
        embedding = None
    picked = [embedding] if embedding is not None and not embedding.requires_grad and _readable(embedding) else []
    picked += [p for p in model.parameters() if not p.requires_grad and p.dim() == 1 and _readable(p)][-1:]
    if not picked:
        return None
    with torch.no_grad():
        return [[v if math.isfinite(v) else None for v in _sample(p).float().flatten().tolist()] for p in picked]


_LAYER = re.compile(r"\.(\d+)\.")
# Positions (row, column) sampled from each matrix of every decoder layer: a few values each, so that a model of
# 100 layers keeps a small fingerprint and a fine-tune that changed any layer (LoRA's layers_to_transform) shows.
_PAIRS = ((0, 0), (1, 7), (7, 31), (31, 1), (127, 511), (511, 127), (2047, 8191), (8191, 2047))


def layer_fingerprint(model) -> dict:
    """Values at a few fixed positions of the frozen weight matrices of every decoder layer (up to 8 a layer), and of
    an output head not tied to the embedding, by name: a fine-tune merged from LoRA differs from its base only there.
    Plain float weights only: a quantized one (4-bit, 8-bit, float8) holds other values for the same model, so a
    QLoRA and a bf16 run compare the layers both hold."""
    layers: dict[int, list] = {}
    for name, p in model.named_parameters():
        if (found := _LAYER.search(name)) and not p.requires_grad and p.dim() == 2 and _readable(p) \
                and p.dtype in FLOAT_DTYPES:
            layers.setdefault(int(found.group(1)), []).append((name, p))
    picked = [pair for i in sorted(layers) for pair in layers[i][:8]][:1024]
    try:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        head = embedding = None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.nn.Parameter) and not weight.requires_grad and weight.dim() == 2 and _readable(weight) \
            and weight is not getattr(embedding, "weight", None):
        picked.append(("lm_head.weight", weight))
    with torch.no_grad():  # the same names with or without peft's wrapping
        return {re.sub(r"^base_model\.model\.|\.base_layer", "", name): [
            v if math.isfinite(v) else None for v in _few(p).float().tolist()] for name, p in picked}


def _readable(param) -> bool:
    # a DTensor (fsdp) holds only this rank's shard, a meta tensor (offloaded) no values
    return param.is_floating_point() and param.device.type != "meta" and not hasattr(param, "device_mesh")


def _sample(weight: torch.Tensor) -> torch.Tensor:
    index = [torch.tensor([i for i in _SAMPLED if i < size], device=weight.device) for size in weight.shape[:2]]
    return weight[index[0]] if weight.dim() == 1 else weight[index[0]][:, index[1]]


def _few(weight: torch.Tensor) -> torch.Tensor:
    rows, columns = zip(*[(i, j) for i, j in _PAIRS if i < weight.shape[0] and j < weight.shape[1]])
    return weight[torch.tensor(rows, device=weight.device), torch.tensor(columns, device=weight.device)]


def _same_weights(saved: list, now: list) -> bool:
    """Two fingerprints of one model, loaded in any float dtype (bf16, fp16, fp32): equal to bf16's precision."""
    if len(saved) != len(now) or any(len(a) != len(b) for a, b in zip(saved, now)):
        return False
    return all(a == b if a is None or b is None else abs(a - b) <= 2**-7 * max(abs(a), abs(b)) + 1e-6
               for values, others in zip(saved, now) for a, b in zip(values, others))


def _model_name(name_or_path: str | None) -> str | None:
    """The model a hub id or folder names: 'Qwen/Qwen2.5-1.5B', '/content/Qwen2.5-1.5B/' and a hub cache's
    '.../models--Qwen--Qwen2.5-1.5B/snapshots/<hash>' all name qwen2.5-1.5b."""
    text = str(name_or_path or "").replace("\\", "/").rstrip("/")
    cached = re.search(r"models--([^/]+)/snapshots/", text)
    name = cached.group(1).split("--")[-1] if cached else text.rsplit("/", 1)[-1]
    return name.lower() or None


def data_identity(dataset, tokenizer) -> dict:
    """The dataset's size, a digest of a few of its rows (every column) and of the tokens their prompts become
    through this tokenizer and chat template: a few rows read, whatever the dataset's size."""
    rows = len(dataset)
    picked = [dict(dataset[i]) for i in sorted({i * rows // 8 for i in range(8)} | {rows - 1})] if rows else []
    prompts = None
    if tokenizer is not None and picked:
        from .rollout.batch import prompt_texts

        try:
            prompts = tokenizer(prompt_texts(tokenizer, [row.get("prompt") for row in picked]),
                                add_special_tokens=False)["input_ids"]
        except Exception:  # a prompt the template fails on: the first rollout names it; nothing to compare here
            prompts = None
    return {"rows": rows, "rows_digest": _digest(picked), "prompts_digest": None if prompts is None else
            _digest(prompts)}


def _digest(value) -> str | None:
    try:  # numpy numbers by value; other values JSON cannot hold (an image, an array) count by their kind
        text = json.dumps(value, sort_keys=True, default=lambda v: v.item() if getattr(v, "shape", None) == ()
                          and hasattr(v, "item") else type(v).__name__)
    except (TypeError, ValueError, RecursionError):  # keys of mixed kinds, an int too long to print, deep nesting
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_same_base(path: Path, saved: dict | None, adapter: dict, model, folder: Path | None = None) -> None:
    """Refuse a checkpoint trained on another base model of the same shape (Qwen2.5-1.5B, -Instruct, -Math; another
    family with the same layer names; a fine-tune merged from LoRA): its adapter means something only on the weights
    it was trained on. A moved or renamed folder of the same model passes: its weights match. `saved`: the
    checkpoint's identity["base"] (None in checkpoints written before grpo-nb recorded it); `adapter`: its
    adapter_config.json, in `folder`. A fully fine-tuned checkpoint holds every weight, but runs under this model's
    config: its architecture and the settings that change the computation (check_same_config)."""
    saved, folder = saved or {}, folder or path
    if not getattr(model, "peft_config", None):  # full fine-tuning, some weights frozen (an embedding) or none
        check_same_config(path, saved, model)
    if all(p.requires_grad for p in model.parameters()):
        return
    now = base_identity(model)
    then_name = adapter.get("base_model_name_or_path") or saved.get("name_or_path")
    then_name = then_name if isinstance(then_name, str) else None
    now_name = now["name_or_path"] or getattr(getattr(model, "active_peft_config", None), "base_model_name_or_path",
                                                 None)
    trained_on = f"trained on {_short(then_name)}" if then_name else "trained on another base model"
    this = f"this model ({_short(now_name)})" if now_name else "this model"
    # an older checkpoint's sample (more values, of the first and last layer only) has other lengths: not compared
    differ = [name for name in set(saved.get("layers") or {}) & set(now["layers"])
              if len(saved["layers"][name]) == len(now["layers"][name])
              and not _same_weights([saved["layers"][name]], [now["layers"][name]])]
    if saved.get("model_type") and now["model_type"] and saved["model_type"] != now["model_type"]:
        problem = (f"it was {trained_on}, a {_short(saved['model_type'])} model, and {this} is a "
                   f"{_short(now['model_type'])} model")
    elif saved.get("fingerprint") and now["fingerprint"] and not _same_weights(saved["fingerprint"],
                                                                                 now["fingerprint"]):
        problem = (f"it was {trained_on}, and {this} has other base weights (the values sampled from its embedding "
                   f"and final norm differ; a moved or renamed folder of the same model would match): another model "
                   f"of the same shape, e.g. an -Instruct and a base model, or another fine-tune")
    elif differ:
        problem = (f"it was {trained_on}, and {this} has other weights in its decoder layers or output head (the "
                   f"values sampled from {sorted(differ)[0]} differ, while its embedding matches): e.g. a fine-tune "
                   f"merged from a LoRA adapter and the model it was merged into")
    elif saved.get("fingerprint") and now["fingerprint"]:
        return  # the same weights, whatever the name: a moved or renamed folder, a local copy of a hub model
    elif _model_name(then_name) and _model_name(now_name) and _model_name(then_name) != _model_name(now_name):
        problem = (f"it was {trained_on}, and {this} is another model. If it is the same model moved or renamed, "
                   f"write {str(now_name)!r} into {folder / 'adapter_config.json'} as base_model_name_or_path")
    else:
        return
    raise ValueError(
        f"Cannot resume from {path}: {problem}. An adapter means something only on the base model it was trained on: "
        f"load that model and resume again, or start a new run in a new output_dir for this one (to train this "
        f"adapter on it on purpose, start from the adapter's weights: PeftModel.from_pretrained(<this base model "
        f"without an adapter>, {str(folder)!r}, is_trainable=True), without resume_from_checkpoint).")


# The config fields that change what a fully fine-tuned model computes with the same weights: positions (rope),
# norms, attention window, activation, tied embeddings. Sizes are checked by the weights' shapes.
_COMPUTES = re.compile(r"^(model_type|rope_\w+|\w*_eps|sliding_window|use_sliding_window|hidden_act|"
                       r"tie_word_embeddings|partial_rotary_factor)$")


def check_same_config(path: Path, saved: dict, model) -> None:
    """Refuse a fully fine-tuned checkpoint resumed onto another architecture (identity's model_type) or a config
    that computes otherwise (its config.json against the model's: rope settings, norm eps, sliding window, ...)."""
    then = _json_object(path / "config.json")
    then = {"model_type": saved.get("model_type"), **then} if saved.get("model_type") else then
    config = getattr(model, "config", None)
    now = json.loads(json.dumps(config.to_dict(), default=str)) if hasattr(config, "to_dict") else {}
    changed = [k for k in sorted(then) if _COMPUTES.match(k) and k in now and then[k] != now[k]]
    if changed:
        raise ValueError(
            f"Cannot resume from {path}: its weights were trained fully under another model config: "
            f"{'; '.join(f'{k} {_short(then[k])} -> {_short(now[k])}' for k in changed)} (its config.json against "
            f"this model's). The trained weights would run under other positions, norms or architecture. Load the "
            f"model the checkpoint was trained from (the same architecture and config) and resume again, or start "
            f"a new run in a new output_dir.")


def check_same_adapter(path: Path, saved: dict, model, same_layers: bool = False) -> None:
    """Refuse a checkpoint whose adapter was trained with another LoRA setup (adapter_config.json against the model's
    peft config): another lora_alpha or use_rslora rescales every trained weight, another r or target_modules does not
    fit. target_modules counts only when LoRA sits on other layers (not `same_layers`, the trained tensors' names):
    "all-linear", a list and a regex can name the same ones. Warn for another lora_dropout."""
    config = getattr(model, "active_peft_config", None)
    if config is None:
        return  # not an adapter: full fine-tuning
    if not saved and same_layers:  # (other tensors: refused by their names next, a clearer message)
        raise ValueError(
            f"Cannot resume from {path}: it holds no adapter_config.json for this model's adapter "
            f"({getattr(model, 'active_adapter', None)!r}; peft saves an adapter named other than 'default' in a "
            f"subfolder of that name), so its LoRA setup (lora_alpha, r, ...) cannot be checked against this one's. "
            f"Resume a checkpoint a train() run of this adapter wrote, set up with the same adapter_name.")
    if not saved:
        return
    now = config.to_dict()
    meaning = [key for key in ADAPTER_MEANING if not (same_layers and key == "target_modules")]
    changed = [key for key in meaning if key in saved and _setting(saved[key]) != _setting(now.get(key))]
    if changed:
        scale = ""
        if "r" not in changed and {"lora_alpha", "use_rslora"} & set(changed):
            then, after = _lora_scale(saved), _lora_scale(now)
            if then and after:
                scale = f": its weights would act {after / then:.3g}x as strongly (LoRA scales them by lora_alpha / r)"
        raise ValueError(
            f"Cannot resume from {path}: it was written for another model or LoRA setup: its adapter was trained "
            f"with {'; '.join(f'{k} {_show(k, saved[k])}' for k in changed)}, and this model's adapter has "
            f"{'; '.join(f'{k} {_show(k, now.get(k))}' for k in changed)}{scale}. Set the model up with the "
            f"checkpoint's LoRA settings (its adapter_config.json; setup_reasoning_model(..., lora_rank=r, "
            f"lora_alpha=...)) and resume again, or start a new run in a new output_dir.")
    if "lora_dropout" in saved and _setting(saved["lora_dropout"]) != _setting(now.get("lora_dropout")):
        warnings.warn(f"Resuming from {path} with another lora_dropout than it was trained with: "
                      f"{_short(saved['lora_dropout'])} -> {now.get('lora_dropout')!r}. The run continues with the "
                      f"new one, so it will not equal an unbroken run.", stacklevel=5)


def _setting(value):
    """A peft setting as adapter_config.json holds it: sets and tuples as sorted lists, enums by value."""
    if isinstance(value, (set, tuple, list)):
        return sorted(_setting(v) for v in value) if all(isinstance(v, str) for v in value) else [
            _setting(v) for v in value]
    return getattr(value, "value", value)


def _show(key: str, value) -> str:
    if key == "target_modules" and isinstance(value, (set, tuple, list)):  # full names: model.layers.0.mlp.up_proj
        return f"{sorted({str(m).rsplit('.', 1)[-1] for m in value})} ({len(value)} modules)"
    return _short(_setting(value))


def _lora_scale(config: dict) -> float | None:
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (r, alpha)):
        return None
    return alpha / (math.sqrt(r) if config.get("use_rslora") is True else r)


def convert_legacy_checkpoint(path) -> Path:
    """Rewrite an older grpo-nb checkpoint's pickled trainer_state.pt in today's format (JSON +
    safetensors). Unpickling runs code: call this only on a checkpoint you trust (e.g. your own)."""
    path = Path(path)
    state = torch.load(path / LEGACY_TRAINER_STATE, map_location="cpu", weights_only=False)
    pending = state.get("pending")
    if isinstance(pending, list) and len(pending) == 3:  # [batch dict, info dict, iterations left]
        batch, info, left = pending
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
    # Hidden entries (.ipynb_checkpoints, .DS_Store) and TensorBoard's folders (runs/, or a logging_dir set to
    # output_dir or a folder in it: a run that stopped before its first checkpoint) are never overwritten by saving.
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")
                   and not (p.name == "runs" and p.is_dir() and not p.is_symlink())
                   and not _tensorboard_only(p)) if folder.is_dir() else []
    if any(saved_here(folder / n) for n in names):
        return []
    return names


def _tensorboard_only(path: Path, depth: int = 3) -> bool:
    """`path` is a folder holding TensorBoard event files and nothing else (<logging_dir>/<run id>/events...)."""
    if path.is_symlink() or not path.is_dir() or depth == 0:
        return False
    entries = list(path.iterdir())
    return bool(entries) and all(_tensorboard_only(p, depth - 1) if p.is_dir() else
                                 (p.name.startswith("events.out.tfevents.") and not p.is_symlink()) for p in entries)


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
