"""Run the notebooks here and store their outputs, so GitHub shows what a user will see.

    python notebooks/save_outputs.py                 # all five (about 8 minutes on 2 CPU cores)
    python notebooks/save_outputs.py 01_quickstart   # one

The CPU notebooks (01, 04) run as written. The GPU ones (02, 03, 05) run in fast mode
(GRPO_NB_FAST=1: the embedded default, 2 short steps), and their training cell says so in its
output. Each notebook's metadata (grpo_nb.stored_outputs) records how its outputs were made and a hash of its code, so
tests/test_notebook_outputs.py fails when a notebook changes and its outputs are not refreshed.
The test command (nbmake) still executes every notebook from scratch.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def needs_gpu(nb) -> bool:
    """Set in a notebook's metadata (colab/generate.py reads it too): such a notebook runs in fast mode here."""
    return bool(nb.metadata.get("grpo_nb", {}).get("needs_gpu"))


def code_hash(nb) -> str:
    """What the stored outputs were computed from: every code cell's source, in order."""
    sources = "\x00".join(c.source for c in nb.cells if c.cell_type == "code")
    return hashlib.sha256(sources.encode()).hexdigest()


def run(name: str) -> None:
    path = HERE / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    fast = needs_gpu(nb)
    env = dict(os.environ, GRPO_NB_FAST="1" if fast else "0")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        # a fresh folder as the working directory: an earlier run's output_dir would make train() say (rightly) that
        # it replaces that adapter, and the stored outputs would show a user something a first run never prints
        with tempfile.TemporaryDirectory(prefix=f"{name}-") as cwd:
            NotebookClient(nb, timeout=1800, kernel_name="python3", record_timing=False,  # no timestamps in cells
                           resources={"metadata": {"path": cwd}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    import torch
    import transformers

    nb.metadata.setdefault("grpo_nb", {})["stored_outputs"] = {
        "outputs": ("a CPU run in fast mode (GRPO_NB_FAST=1): the embedded default, 2 short steps" if fast
                    else "a CPU run as written"),
        "code_sha256": code_hash(nb),
        "run": f"{datetime.date.today()} on {platform.machine()} CPU, Python {platform.python_version()}, "
               f"torch {torch.__version__}, transformers {transformers.__version__}",
    }
    nbformat.write(nb, path)
    print(f"{name}: outputs stored ({'fast mode' if fast else 'as written'})")


if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.stem for p in HERE.glob("[0-9]*.ipynb"))
    for name in names:
        run(name)
