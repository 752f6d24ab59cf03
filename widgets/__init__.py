"""grpo_nb_widgets: the display layer. Reads history records (plain dicts) only.

It never imports grpo_nb, so the same views can show any run that produces the same
records (a TRL run through a callback, a saved history.json).

    vram_figure(record_or_history, trl_estimate=None, device_total_bytes=None)  memory bar
    reward_figure(history, window=5)          reward curves + loss / KL / length / clip panels
    eval_figure(history)                      held-out accuracy (with intervals) and reward over steps
    traces_html(history, step=-1)             one step's sample completions (HTML)
    traces_text(history, step=-1)             the same for terminals
    dashboard_html(history, ...)              all three in one self-contained HTML string
    LiveDashboard(...)                        a train() callback: the dashboard live in a notebook
                                              (one display handle, throttled), progress lines elsewhere
    save_png(fig, path), img_html(fig)        a figure as a PNG file / an inline <img>
    reward_table(...) -> RewardTable          reward functions' scores per sample (grpo_nb.preview_rewards)
    GrpoNbDashboardCallback(...)              the same dashboard for TRL's GRPOTrainer (a TrainerCallback)

Figures are matplotlib Figures on an Agg canvas (no pyplot, no display needed).
"""

from .curves import plot_reward_curves, reward_figure
from .dashboard import dashboard_html, summary_line
from .evals import eval_figure
from .figures import HTML, img_html, png_bytes, save_png
from .live import LiveDashboard
from .reward_table import RewardTable, reward_table
from .traces import split_completion, traces_html, traces_text
from .vram import memory_categories, vram_figure

__all__ = [
    "HTML", "GrpoNbDashboardCallback", "LiveDashboard", "RewardTable", "dashboard_html", "eval_figure", "img_html",
    "memory_categories", "plot_reward_curves", "png_bytes", "reward_figure", "reward_table", "save_png",
    "split_completion", "summary_line", "traces_html", "traces_text", "vram_figure",
]


def __getattr__(name):  # the TRL callback imports transformers: only when asked for
    if name == "GrpoNbDashboardCallback":
        from .trl_callback import GrpoNbDashboardCallback

        return GrpoNbDashboardCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
