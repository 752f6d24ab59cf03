"""Shared by every test module: Triton's CPU interpreter when there is no GPU (set before any test module
imports the kernels, whichever pytest collects first), and the `tok` fixture (the tiny offline tokenizer,
prepared as setup_reasoning_model prepares one). The tiny models and reward functions are in tiny_models.py."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def saved_base(tmp_path):
    """A tiny model and its tokenizer saved to a folder, as a hub model's."""
    from tiny_models import tiny_model, tiny_tokenizer

    path = tmp_path / "base"
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def tok():
    from grpo_nb.models import prepare_tokenizer
    from tiny_models import tiny_tokenizer

    return prepare_tokenizer(tiny_tokenizer())


def pytest_collection_modifyitems(config, items):
    """The quickstart notebook runs once per session: test_live executes it and also checks the outputs it
    saves, so nbmake's plain run of the same notebook is dropped when that test is collected and not skipped."""
    live = [i for i in items if i.name == "test_quickstart_notebook_keeps_the_final_dashboard_in_its_saved_outputs"]
    if not live or any(mark.args and mark.args[0] for mark in live[0].iter_markers("skipif")):
        return
    dropped = [i for i in items if i.nodeid.endswith("01_quickstart.ipynb::01_quickstart.ipynb")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if i not in dropped]
