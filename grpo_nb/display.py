"""The library's one door to the display layer (`widgets/`, imported as `grpo_nb_widgets`).

The widgets read records and draw them; they import nothing from grpo_nb (nor torch). The
library reaches them only through the functions here, each importing them on first use, so
a run without a dashboard never loads matplotlib.
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from grpo_nb_widgets.reward_table import RewardTable


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (where the live dashboard is on by default). The widgets keep a copy
    of these three lines (grpo_nb_widgets.live.in_notebook): they import nothing from grpo_nb, and importing them
    here would load matplotlib in every run."""
    shell = sys.modules.get("IPython")
    ip = shell.get_ipython() if shell and hasattr(shell, "get_ipython") else None
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def live_dashboard(live, device, max_steps: int, verbose: bool, history=()):
    """The live display for `train(live=...)`, showing this run from `history`, the records it already has (a
    resumed run's); None when off; imported only when on."""
    if live is None or live is False:
        return None
    if live is True:
        from grpo_nb_widgets import LiveDashboard

        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        live = LiveDashboard(device_total_bytes=total, max_steps=max_steps, print_steps=not verbose)
    if hasattr(live, "start"):  # a LiveDashboard: one given again (a re-run cell) drops the records it showed
        live.start(history, max_steps=max_steps)
    return live  # a ready-made one may also be any callable with close()


def close_live(view, error) -> None:
    """Show the dashboard's final state; its own failure never masks the run's outcome."""
    try:
        view.close(error)
    except Exception as close_error:
        warnings.warn(f"The live dashboard failed to show the final state ({type(close_error).__name__}: "
                      f"{close_error}); training itself is unaffected.", stacklevel=3)


def reward_table(names, samples, cells, **kwargs) -> "RewardTable":
    """A `RewardTable` (HTML in a notebook, aligned text when printed)."""
    from grpo_nb_widgets.reward_table import RewardTable

    return RewardTable(names, samples, cells, **kwargs)


def plot_reward_curves(history, path, **kwargs):
    """The reward curves of a history, written to a PNG at `path`."""
    from grpo_nb_widgets import plot_reward_curves as plot

    return plot(history, path, **kwargs)


def traces(history, html: bool = True) -> str:
    """The sample traces of a history's last record: HTML (the dashboard's) or plain text."""
    from grpo_nb_widgets.traces import traces_html, traces_text

    return str(traces_html(history)) if html else traces_text(history)
