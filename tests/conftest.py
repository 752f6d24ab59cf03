"""Without a GPU, Triton kernels run on Triton's CPU interpreter; this must be set before any
test module imports them, whichever module pytest collects first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
