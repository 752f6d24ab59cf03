"""Where a run writes, checked before any work: output_dir (not the base model's folder, not someone's model or
another run's checkpoints, not inside a checkpoint, nothing planted at a name it writes, writable) and the logs
beside it (never where the run's saving or rotation would delete them)."""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from contextlib import suppress
from pathlib import Path

from . import atomic_files
from .base_folder import base_folder_problem
from .checkpointing import (_CHECKPOINT, LEGACY_TRAINER_STATE, SETTINGS, TRAINABLE, TRAINER_STATE, checkpoints,
                            finished_result, foreign_files, saved_here, saved_weights)
from .config import GRPOConfig
from .run_lock import LOCK


# The files a save writes by name, besides a run's checkpoint-<step> folders, its lock file and TensorBoard's
# default runs/ folder: peft's adapter and model card, transformers' model and tokenizer files, and the run's
# settings and history (train() at its end; save_adapter and save_merged, the same names).
SAVED_FILES = ("adapter_config.json", "adapter_model.safetensors", "README.md", "config.json",
               "generation_config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
               "vocab.json", "merges.txt", "grpo_config.json", "history.json")


def check_output_dir(output_dir: Path, resume_from_checkpoint, *, runs: bool = False, model=None) -> None:
    """output_dir is this run's: not the folder `model`'s base weights were loaded from, not a folder of other
    files that saving would overwrite, nor an earlier run's checkpoints that this run would mix with its own
    (rotation keeps the highest step numbers), and nothing stands at a name the run writes but what it writes
    there (`runs`: TensorBoard's default folder output_dir/runs is used)."""
    if model is not None and (problem := base_folder_problem(output_dir, model)) is not None:
        raise ValueError(f"output_dir={str(output_dir)!r}: {problem} (a full fine-tune's weights over it, or an "
                         f"adapter beside it, which transformers then loads with that folder as base + adapter). "
                         f"Pass another output_dir, e.g. "
                         f"output_dir={str(output_dir.expanduser().resolve()) + '-grpo'!r}.")
    if (problem := misplaced(output_dir, runs=runs)) is not None:
        raise ValueError(f"output_dir={str(output_dir)!r}: {problem}. Move it away (or rename it), or pass a new "
                         f"output_dir.")
    if (inside := checkpoint_around(output_dir)) is not None:
        said = "is" if inside == output_dir.expanduser().resolve() else "lies inside"
        raise ValueError(f"output_dir={str(output_dir)!r} {said} the checkpoint folder {str(inside)!r}: the run "
                         f"would write its checkpoints, adapter and settings into it, over the files that checkpoint "
                         f"resumes from, and the run that saved it deletes the folder, with everything in it, when it "
                         f"rotates its checkpoints (save_total_limit). Pass an output_dir outside it, e.g. "
                         f"output_dir={f'{inside.parent}-from-{inside.name}'!r} (resume_from_checkpoint= still "
                         f"takes the checkpoint's path).")
    found, fresh = checkpoints(output_dir), resume_from_checkpoint in (None, False)
    fork = not fresh and resume_from_checkpoint is not True and _fork(output_dir, resume_from_checkpoint)
    if links := [p for p in found if p.is_symlink()]:
        raise ValueError(f"output_dir={str(output_dir)!r}: {links[0].name} is a link (to {os.readlink(links[0])}), "
                         f"not a checkpoint folder a run wrote, and grpo-nb never writes or deletes through a link it "
                         f"did not make. Remove the link (what it points to stays), pass the folder it points to as "
                         f"resume_from_checkpoint=, or pass a new output_dir.")
    if names := foreign_files(output_dir):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ValueError(f"output_dir={str(output_dir)!r} holds other files ({shown}), and the run writes its "
                         f"checkpoints, adapter, tokenizer files and settings among them (over any of the same "
                         f"names, e.g. config.json; a README.md stays): pass a new folder, e.g. "
                         f"output_dir='grpo_nb_output'.")
    sub = adapter_subfolder(model)
    if sub is not None and (held := subfolder_held(output_dir, sub)) is not None:
        raise ValueError(f"output_dir={str(output_dir)!r}: its subfolder {sub!r} holds {held}, and this run saves "
                         f"its adapter {sub!r} there (peft saves an adapter named other than 'default' in a subfolder "
                         f"of that name), replacing that subfolder whole, with everything in it. Pass another "
                         f"output_dir, e.g. output_dir={str(output_dir.expanduser().resolve()) + '-grpo'!r}, or give "
                         f"the adapter another name (get_peft_model(..., adapter_name=...)).")
    if found and not any(os.path.lexists(p / TRAINABLE) or os.path.lexists(p / LEGACY_TRAINER_STATE) for p in found):
        raise ValueError(f"output_dir={str(output_dir)!r} holds checkpoint folders no grpo-nb run wrote (up to "
                         f"{found[-1].name}, without grpo-nb's {TRAINABLE}: e.g. an HF or TRL Trainer's), which "
                         f"this run cannot resume and would mix its own with. Pass a new output_dir, e.g. "
                         f"output_dir={str(output_dir.expanduser().resolve()) + '-grpo'!r}.")
    if found and fresh:
        raise ValueError(f"output_dir={str(output_dir)!r} holds an earlier run's checkpoints (up to "
                         f"{found[-1].name}); a new run there would number its steps from 1 and mix its checkpoints "
                         f"with them. Continue that run with resume_from_checkpoint=True (raise max_steps to train "
                         f"further), or pass a new output_dir (or delete the old one).")
    if found and fork:
        raise ValueError(f"output_dir={str(output_dir)!r} holds another run's checkpoints (up to {found[-1].name}), "
                         f"and resuming {str(resume_from_checkpoint)!r} there starts a run of its own (a fork) that "
                         f"would mix its checkpoints with them, and delete them to keep the newest "
                         f"(save_total_limit). Resume into a new output_dir, or continue that run with "
                         f"resume_from_checkpoint=True.")
    if (fresh or fork) and not found and not saved_here(output_dir / SETTINGS) \
            and (kind := saved_weights(output_dir) or (
                "sub" if sub is not None and saved_weights(output_dir / sub) == "adapter" else None)) is not None:
        # someone's model or adapter: at the top, or in the subfolder this run saves its named adapter into
        held = {"adapter": "an adapter", "model": "a model", "sub": f"an adapter in its subfolder {sub!r}"}[kind]
        raise ValueError(f"output_dir={str(output_dir)!r} holds {held} that no grpo-nb run saved there (it has no "
                         f"grpo_config.json): this run would replace it when it ends (a full fine-tune's weights and "
                         f"config over a model, or its adapter beside it, which transformers then loads as base + "
                         f"adapter). Pass a new output_dir, e.g. "
                         f"output_dir={str(output_dir.expanduser().resolve()) + '-grpo'!r}.")
    if (fresh or fork) and not found and (result := finished_result(output_dir)) is not None:
        if model is not None and (theirs := _other_result(output_dir, result, model)) is not None:
            raise ValueError(f"output_dir={str(output_dir)!r} holds {theirs}, and this run saves "
                             f"{_result_of(model)} there: its files would not replace the earlier ones but sit beside "
                             f"them, and the folder would load as the earlier result, or as a mix of the two "
                             f"(transformers applies an adapter it finds beside a model). Pass a new output_dir, or "
                             f"delete the earlier result first.")
        warnings.warn(f"output_dir={str(output_dir)!r} holds the {result[0]} an earlier run saved; this run will "
                      f"replace it when it ends. Pass a new output_dir to keep both.", stacklevel=4)


# What peft writes into <folder>/<adapter name>/ for an adapter named other than "default" (the model card goes to the
# folder's top).
_ADAPTER_FILE = re.compile(r"^adapter_(config\.json|model(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?)$")


def adapter_subfolder(model) -> str | None:
    """The subfolder a save of `model` writes its adapter into, replacing that subfolder whole: peft keeps an adapter
    named other than "default" in <folder>/<name>/. None for one saved at the folder's top (or no adapter)."""
    if not getattr(model, "peft_config", None):
        return None
    name = getattr(model, "active_adapter", None)
    return name if isinstance(name, str) and name != "default" else None


def adapter_name_problem(name) -> str | None:
    """Why a save of the adapter `name` would not land in <folder>/<name>/ as one subfolder of its own, described;
    None for a plain name (or "default", saved at the top). peft joins the folder and the name as they are: an
    absolute name writes wherever it points, outside the folder (and past the atomic write), a name with a
    separator nests, and a name the run itself writes in output_dir (a checkpoint-<step> folder, TensorBoard's
    runs/, a file of the save, the run's lock) is replaced by the final save, or replaces it."""
    if not isinstance(name, str) or name == "default":
        return None
    if name in ("", ".", "..") or os.path.isabs(name) or "/" in name or "\\" in name or os.sep in name:
        where = "an absolute path: peft writes the adapter there, outside the folder saved to" \
            if os.path.isabs(name) else "not one plain folder name: peft saves the adapter in <folder>/<name>/"
        return f"is {where}"
    if "\0" in name:  # os.makedirs refuses it ("embedded null byte"), only when the run saves, after training
        return "holds a NUL character ('\\0'), which no file system takes in a folder name"
    try:  # the bytes os.makedirs writes: UTF-8, a lone surrogate ('\ud800') not encodable (surrogateescape aside)
        size = len(os.fsencode(name))
    except UnicodeEncodeError:
        return ("holds a character no file name can hold (a lone surrogate, such as '\\ud800', from text cut in the "
                "middle of a character or a broken escape): the save would fail with a UnicodeEncodeError, after "
                "training")
    if size > 255:  # NAME_MAX of ext4, APFS, NTFS (and most others): 255 bytes
        return (f"is {size} bytes long (UTF-8), past the 255 bytes a file "
                f"system takes for one folder name (the save would fail with 'File name too long', after training)")
    if re.match(r"^checkpoint-[0-9]+$", name):
        return ("is the name of the run's own checkpoint folder of that step: the final save would replace that "
                "checkpoint with the adapter (and rotation delete the adapter as an old checkpoint)")
    if name == "runs":
        return "is the folder TensorBoard writes the run's event files to (output_dir/runs): the final save would " \
               "replace the logs with the adapter"
    if name in SAVED_FILES or name == LOCK:
        return f"is the name of a file the run writes in output_dir ({name}), where the adapter's folder would go"
    return None


def check_adapter_name(func: str, model) -> None:
    """Refuse an adapter name that a save would not keep as its own subfolder (adapter_name_problem)."""
    if not getattr(model, "peft_config", None):
        return
    name = getattr(model, "active_adapter", None)  # the one a save writes
    if (problem := adapter_name_problem(name)) is not None:
        raise ValueError(f"{func}(model=...) has its LoRA adapter named {name!r}, which {problem}. peft saves an "
                         f"adapter named other than 'default' in a subfolder of that name: give it a plain folder "
                         f"name of its own, e.g. get_peft_model(model, lora_config, adapter_name='grpo') (or "
                         f"leave adapter_name out: 'default' is saved at the folder's top).")


def subfolder_held(folder: Path, name: str) -> str | None:
    """What `folder`/`name` holds besides an adapter's files, which a save of the adapter `name` would delete with the
    subfolder it replaces whole: another run's folder, checkpoints, other files, or a file at that name (described);
    None when nothing is there, only an adapter's files, or a link (replaced, never followed)."""
    sub = Path(folder) / name
    if sub.is_symlink() or not os.path.lexists(sub):
        return None
    if not sub.is_dir():
        return "a file of that name, where that folder goes"
    try:
        names = sorted(os.listdir(sub))
    except OSError:
        return None
    if saved_here(sub / SETTINGS):
        return f"another training run's folder (its {SETTINGS}, {len(checkpoints(sub))} checkpoint(s))"
    if found := checkpoints(sub):
        return f"checkpoint folders (up to {found[-1].name})"
    if other := [n for n in names if not _ADAPTER_FILE.match(n)]:
        return f"other files ({', '.join(other[:3])}{', ...' if len(other) > 3 else ''})"
    return None


def _result_of(model) -> str:
    """What a run of `model` saves in its output_dir: its adapter (peft keeps one named other than "default" in a
    subfolder of that name), or the whole model."""
    if not getattr(model, "peft_config", None):
        return "a fully fine-tuned model"
    name = getattr(model, "active_adapter", "default")
    return "a LoRA adapter" + ("" if name == "default" else f" in the subfolder {name!r}")


def _other_result(output_dir: Path, result: tuple, model) -> str | None:
    """The earlier run's result in output_dir (finished_result's), named, when this run's is of another kind or
    place (a model vs an adapter, another adapter subfolder); None when this run's final save replaces it."""
    kind, folder = result
    ours = _result_of(model)
    if kind == "model":
        return None if ours == "a fully fine-tuned model" else "a fully fine-tuned model an earlier run saved"
    theirs = "a LoRA adapter" + ("" if folder == output_dir else f" in the subfolder {folder.name!r}")
    return None if ours == theirs else theirs + " an earlier run saved"


def _fork(output_dir: Path, checkpoint) -> bool:
    """A checkpoint outside output_dir resumed into it: a run of its own there, which writes and rotates
    checkpoints as a new run does. output_dir itself is no checkpoint (read_training_checkpoint says which of
    its checkpoints to pass)."""
    try:
        path, here = atomic_files.expand(checkpoint).resolve(), output_dir.expanduser().resolve()
    except (OSError, ValueError, RuntimeError):  # a path no file can have: find_checkpoint names the problem
        return False
    return path.parent != here and path != here


def checkpoint_around(output_dir: Path) -> Path | None:
    """The checkpoint folder that `output_dir` is or lies in, None when none: one holding a checkpoint's files,
    or a folder named checkpoint-<step> in a finished run's folder (the next checkpoint of that name)."""
    try:
        folder = output_dir.expanduser().resolve()
    except (OSError, ValueError, RuntimeError):  # a path no file can have: saving names the problem
        return None
    for path in (folder, *folder.parents):
        with suppress(OSError):
            if (path / TRAINER_STATE).is_file() and (path / TRAINABLE).is_file():
                return path
            if _CHECKPOINT.match(path.name) and saved_here(path.parent / SETTINGS):
                return path
    return None


def in_checkpoint(path: Path) -> str | None:
    """Why a save cannot go to `path` (a folder, or a file): it is or lies in a run's checkpoint folder, whose files a
    resume reads and which that run deletes, with everything in it, when it rotates its checkpoints; with a name
    outside it to pick. None when it lies in none."""
    if (inside := checkpoint_around(path)) is None:
        return None
    parts = path.expanduser().resolve().relative_to(inside.parent).parts  # checkpoint-1, export, ...
    return (f"{'is' if len(parts) == 1 else 'lies in'} the checkpoint folder {str(inside)!r}, whose files a resume "
            f"reads, and which the run that saved it deletes, with everything in it, when it rotates its checkpoints "
            f"(save_total_limit): pick a name outside it, e.g. {str(inside.parent) + '-' + '-'.join(parts)!r}")


def misplaced(folder: Path, *, runs: bool = False) -> str | None:
    """An entry of `folder` at a name a save writes that is not what it writes there, described (a file
    where a checkpoint folder goes, a folder where a file or the lock goes; with `runs`, a link or a file
    at runs/); None when there is none. Writing would fail on it midway, or follow the link."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:  # not there yet
        return None
    for entry in entries:
        link, is_folder = entry.is_symlink(), entry.is_dir(follow_symlinks=False)
        if _CHECKPOINT.match(entry.name) and not link and not is_folder:
            return f"{entry.name} is a file, where the run writes its checkpoint folder of that name"
        if (entry.name == LOCK or entry.name in SAVED_FILES) and is_folder:
            return f"{entry.name} is a folder, where a file of that name is written"
        if runs and entry.name == "runs" and (link or not is_folder):
            return (f"runs is {f'a link (to {os.readlink(entry.path)})' if link else 'a file'}, where TensorBoard "
                    f"writes its event files by default (grpo-nb never writes through a link it did not make), or "
                    f"set GRPOConfig.logging_dir to another folder")
    return None


def check_log_paths(config: GRPOConfig, model=None) -> None:
    """log_completions_path and logging_dir are not at or under a name the run replaces or deletes in
    output_dir: the final save would rename its files over the log (or replace `model`'s named adapter's
    subfolder whole), rotation delete it with its checkpoint."""
    output_dir = Path(config.output_dir).expanduser().resolve()
    sub = adapter_subfolder(model)
    for option, instead in (("log_completions_path", str(output_dir / "completions.jsonl")),
                            ("logging_dir", str(output_dir / "runs"))):
        value = getattr(config, option)
        folder = None if value is None else Path(value) if option == "logging_dir" else Path(value).parent
        if folder is not None and (inside := checkpoint_around(folder)) is not None:  # another run's checkpoint
            raise ValueError(f"GRPOConfig.{option}={value!r} is invalid: it lies in the checkpoint folder "
                             f"{str(inside)!r}, which the run that saved it deletes, with everything in it, when it "
                             f"rotates its checkpoints (save_total_limit). Pick a folder outside it, e.g. "
                             f"{option}={instead!r}.")
        try:
            first = Path(value).expanduser().resolve().relative_to(output_dir).parts[0]
        except (TypeError, ValueError, IndexError):  # None, outside output_dir, or output_dir itself
            continue
        if _CHECKPOINT.match(first):
            why = "a checkpoint folder the run replaces (and deletes, to keep only the newest)"
        elif first in SAVED_FILES:
            why = "a file the run's final save replaces"
        elif first == sub:
            why = (f"the subfolder where the run saves its adapter {sub!r} (peft keeps an adapter named other than "
                   f"'default' in a subfolder of that name), which the final save replaces whole")
        else:
            continue
        raise ValueError(f"GRPOConfig.{option}={value!r} is invalid: it is at {first} in output_dir, {why}, and "
                         f"the log would be lost with it. Pick another name, e.g. {option}={instead!r}.")


def check_writable(output_dir: Path) -> None:
    """The run ends by saving to output_dir: find out now, not after hours of training, if it can't."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as err:
        raise OSError(f"output_dir={str(output_dir)!r} is not a writable folder ({err}); checkpoints and the "
                      f"trained adapter are saved there. Pass another output_dir.") from err
