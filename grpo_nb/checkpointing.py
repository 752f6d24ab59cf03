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
import stat
from pathlib import Path

import numpy as np
import torch

from . import atomic_files
from .base_folder import portable_base
from .batch import StepBatch
from .checkpoint_schema import ARRAY_DTYPES, CheckpointError, Refused, need
from .rollout import rollout_state
from .tracking import written_by_grpo_nb

TRAINER_STATE = "trainer_state.json"
TRAINER_TENSORS = "trainer_state.safetensors"
LEGACY_TRAINER_STATE = "trainer_state.pt"  # what the first grpo-nb checkpoints held: a pickle, which loading would run
TRAINABLE = "trainable.safetensors"
SETTINGS = "grpo_config.json"
# Only the names a run writes, f"checkpoint-{step}": a folder such as checkpoint-001 (a user's backup of step 1) is
# not a checkpoint, so rotation never deletes it and resume_from_checkpoint=True never takes it for one.
_CHECKPOINT = re.compile(r"^checkpoint-(0|[1-9][0-9]*)$")


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


# Files a save of a model, an adapter or a tokenizer writes by name. One an earlier save wrote and this one does not
# would stay beside the new files and be loaded with them: an earlier single model.safetensors before new shards
# (transformers prefers it), an earlier chat template for a tokenizer that has none.
STALE_FILES = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$"
                         r"|^chat_template\.(jinja|json)$|^(special_tokens_map|added_tokens|vocab)\.json$"
                         r"|^merges\.txt$|^tokenizer\.model$")


def remove_stale_files(path: Path, written) -> None:
    """After a save into `path`: the files of an earlier save of the same kind that this one did not write go (a
    link itself, never what it points to; folders stay). Weights only of the kind written (an adapter's, or a
    model's): a model saved by hand beside an adapter is not this save's to delete; tokenizer files only when a
    tokenizer was written."""
    kinds = {m.group(1) for name in written if (m := STALE_FILES.match(name)) and m.group(1)}
    tokenizer = "tokenizer_config.json" in written
    for entry in path.iterdir():
        m = STALE_FILES.match(entry.name)
        if not m or entry.name in written or not (entry.is_symlink() or entry.is_file()):
            continue
        weights = m.group(1)
        if (tokenizer if weights is None else weights in kinds or (weights == "pytorch_model" and "model" in kinds)):
            entry.unlink()


def _write_model_files(path: Path, model, tokenizer, config, history, trainable=None) -> None:
    # `trainable`: the trainable tensors gathered whole, for a model whose own are sharded over ranks. Of a peft
    # model only the active adapter, the one trained: another one saved at the top would be what loads.
    active = getattr(model, "active_adapter", None) if getattr(model, "peft_config", None) else None
    model.save_pretrained(path, **({"state_dict": trainable} if trainable is not None else {}),
                          **({"selected_adapters": [active]} if isinstance(active, str) else {}))
    portable_base(path, model)  # the base as a name that loads it from anywhere: a hub id, an absolute folder
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
        written = set()

        def write(tmp: Path) -> None:
            _write_model_files(tmp, model, tokenizer, config, history, trainable)
            written.update(os.listdir(tmp))

        atomic_files.write_into(path, write, keep=("README.md",))
        remove_stale_files(path, written)
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
        # (a subfolder with grpo_config.json of its own is another run's folder, nested here)
        if not _CHECKPOINT.match(sub.name) and "peft_type" in _json_object(sub / "adapter_config.json") \
                and not saved_here(sub / SETTINGS):
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
# Whose save a folder holds

# A folder holding one of these files, a JSON object with these keys, was written by transformers, peft or a
# grpo-nb run: saving there again is meant. A name alone proves nothing (anyone's project has a config.json).
SAVED_HERE = {"config.json": ("model_type",), "adapter_config.json": ("peft_type",),
              "grpo_config.json": ("output_dir", "num_generations", "max_completion_length", "beta")}


def foreign_files(folder) -> list[str]:
    """The names in `folder` when it holds files but none a model, an adapter or a training run
    wrote; [] for a new, empty or such a folder. A folder shows a save by a file at its top (a model's or an
    adapter's config, a run's settings) or a checkpoint folder; a completions log or an adapter in a subfolder
    alone shows one only when nothing else is there (a run killed before its first checkpoint leaves only its
    log): beside the user's own files they are not the folder's."""
    folder = Path(folder)
    # Hidden entries (.ipynb_checkpoints, .DS_Store) and TensorBoard's folders (runs/, or a logging_dir set to
    # output_dir or a folder in it: a run that stopped before its first checkpoint) are never overwritten by saving.
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")
                   and not (p.name == "runs" and p.is_dir() and not p.is_symlink())
                   and not _tensorboard_only(p)) if folder.is_dir() else []
    saved = [n for n in names if saved_here(folder / n)]
    if any(n in SAVED_HERE or _CHECKPOINT.match(n) for n in saved):
        return []
    # (a README.md beside them is the save's card, or notes every save keeps; a whole tokenizer - its
    # tokenizer_config.json names its class - beside a named adapter's subfolder is what
    # save_adapter(model, folder, tokenizer) writes at the top)
    tokenizer = any((folder / n / "adapter_config.json").is_file() for n in saved) \
        and "tokenizer_class" in _json_object(folder / "tokenizer_config.json")
    return [n for n in names if n not in saved and n != "README.md"
            and not (tokenizer and _TOKENIZER_FILE.match(n))] if saved else names


_TOKENIZER_FILE = re.compile(r"^(tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json"
                             r"|chat_template\.(jinja|json)|vocab\.json|merges\.txt)$")


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


def check_storable_rollout_state(rollout) -> None:
    """A ResumableRollout's state_dict() goes into every checkpoint (and the one an error or Ctrl-C saves): a value
    a checkpoint cannot store, e.g. a torch.Generator where its get_state() belongs, would stop the run at its
    first save with nothing written. Refused before training and after the first rollout, naming the value."""
    state = rollout_state(rollout)
    if state is None:
        return

    name = getattr(rollout, "__name__", None) or type(rollout).__name__
    inside: set[int] = set()  # the containers on the way to `value`: one met again holds itself

    def check(value, path: str) -> None:
        if isinstance(value, (dict, list, tuple)):
            if id(value) in inside:  # storing it would recurse without end (a raw RecursionError)
                raise TypeError(f"The rollout {name!r} keeps a state that a checkpoint cannot store: its {path} is "
                                f"the {type(value).__name__} it lies in (a reference to itself, which a checkpoint "
                                f"would store without end). Return plain nested data without cycles, e.g. a "
                                f"copy: {{'n': self.n}}.")
            inside.add(id(value))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(value, dict):
                    check(key, f"{path} key {key!r}")
                check(item, f"{path}[{key!r}]" if isinstance(value, dict) else f"{path}[{key}]")
            inside.discard(id(value))
        else:
            try:
                encode_state(value, {})
            except TypeError as err:
                kind = f"{type(value).__module__.split('.')[0]}.{type(value).__name__}"
                raise TypeError(f"The rollout {name!r} keeps a state that a checkpoint cannot store: its {path} is a "
                                f"{kind} ({err}). Checkpoints keep plain data (tensors, numpy arrays, numbers, "
                                f"strings, bytes, and lists, tuples and dicts of them): return a random generator's "
                                f"state, not the generator (torch: g.get_state(), loaded with g.set_state(...); "
                                f"numpy: rng.bit_generator.state).") from None

    check(state, "state_dict()")
