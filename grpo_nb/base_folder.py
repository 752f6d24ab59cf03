"""The folders no run or save may write into: the one a model's base weights were loaded from, and grpo-nb's
copy of the embedded default. Writing there replaces the base model: a full fine-tune's weights over it, or an
adapter beside it (transformers then loads that folder as base + adapter), and every adapter trained on it, and
resuming, would then load on the wrong weights.

The folder is recorded absolute when the model is loaded (setup_reasoning_model, load_for_inference), as
`attachments(model).loaded_from`: a relative name_or_path ('./models/x') means another folder after a %cd.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .atomic_files import expand
from .attachments import attachments, base_model

EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded default is, as adapters record their base


def cache_dir() -> Path:
    """Where converted models live: $GRPO_NB_CACHE, else ~/.cache/grpo_nb."""
    return expand(os.environ.get("GRPO_NB_CACHE") or Path.home() / ".cache" / "grpo_nb")


def record_loaded_from(model, name_or_path) -> None:
    """Remember, absolute, the local folder `model`'s base weights were just loaded from (a hub name: nothing)."""
    folder = expand(name_or_path)
    if folder.is_dir():
        attachments(model).loaded_from = folder.resolve()


def loaded_from(model) -> Path | None:
    """The folder the model's base weights were loaded from: recorded at load, else its name_or_path as it reads
    from here (a model from from_pretrained), then recorded so that a later %cd does not change it."""
    if (recorded := attachments(model).loaded_from) is not None:
        return recorded
    base = base_model(model)
    name = getattr(base, "name_or_path", "") or getattr(getattr(base, "config", None), "_name_or_path", "") or ""
    if isinstance(name, (str, os.PathLike)) and str(name):
        record_loaded_from(model, name)
    return attachments(model).loaded_from


def base_folder_problem(path, model) -> str | None:
    """Why `path` is no folder to write `model`'s run or save into (it is its base model's folder, or grpo-nb's
    copy of the embedded default), or None."""
    try:
        target = expand(path).resolve()
    except (OSError, ValueError, RuntimeError):  # a path no file can have: the write names the problem
        return None
    for folder, what in ((loaded_from(model), "the folder this model's base weights were loaded from"),
                         (cache_dir() / EMBEDDED_HUB_ID.split("/")[1], "grpo-nb's copy of the embedded default model")):
        # a base folder holds a model (config.json): a new folder of that name elsewhere is none
        if folder is not None and folder.resolve() == target and (target / "config.json").is_file():
            return f"this is {what}, and writing there would replace that base model"
    return None


def portable_base(folder: Path, model=None) -> None:
    """An adapter saved in `folder` names its base by where it was loaded from, which may not load the same weights
    elsewhere: for the embedded default this machine's cache folder, which another machine (or another
    GRPO_NB_CACHE) lacks - rewritten to the hub id of the same model, which peft and vLLM can load anywhere
    (load_for_inference maps it back to the embedded copy, the weights trained on); for a base loaded by a relative
    path (from_pretrained("base")), that name, which from another working folder names another folder or none -
    rewritten to the absolute folder `model`'s base was loaded from (loaded_from). Done on the saved file only: in
    memory the model keeps its name, so that peft's save never looks the base up on the Hub."""
    embedded = cache_dir() / EMBEDDED_HUB_ID.split("/")[1]
    base = base_model(model) if model is not None else None
    name = getattr(base, "name_or_path", None) or getattr(getattr(base, "config", None), "_name_or_path", None)
    absolute = loaded_from(model) if model is not None else None
    # peft writes an adapter not named "default" into a subfolder of its name
    for file in [Path(folder) / "adapter_config.json", *Path(folder).glob("*/adapter_config.json")]:
        if not file.is_file():
            continue
        config = json.loads(file.read_text())
        recorded = config.get("base_model_name_or_path")
        if not isinstance(recorded, str) or not recorded:
            continue
        if Path(recorded) == embedded:
            portable = EMBEDDED_HUB_ID
        elif absolute is not None and recorded == str(name) and not expand(recorded).is_absolute():
            portable = str(absolute)
        else:
            continue
        file.write_text(json.dumps({**config, "base_model_name_or_path": portable}, indent=2, sort_keys=True))
