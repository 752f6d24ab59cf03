"""Training curves from a history: rewards on top, loss / KL / length / clipping below.

Per-step values are noisy with small groups, so every curve is drawn twice: the raw values
faint, a rolling mean over `window` steps on top. Missing or non-numeric values leave gaps.
"""

from __future__ import annotations

import math

from matplotlib.ticker import MaxNLocator

from .figures import as_number, as_plotted, message_figure, new_figure, rolling_mean, save_png

# The small panels: (title, [(record key, line label, line style)]).
PANELS = (
    ("loss", [("loss", "loss", "-")]),
    ("KL to reference", [("kl", "kl", "-")]),
    ("completion length (tokens)", [("completion_length_mean", "mean", "-"), ("completion_length_max", "max", ":")]),
    ("clip ratio", [("clip_ratio", "total", "-"), ("clip_ratio_low", "low", ":"), ("clip_ratio_high", "high", "--")]),
)
# A share drawn on a panel's right-hand axis: completions that hit max_completion_length (their
# answers never arrive, so rewards for being right cannot either).
SHARES = {"completion length (tokens)": ("truncated_fraction", "hit the length cap (%)")}


def _per_function(record: dict) -> dict:
    """A record's {reward function: {"mean", "std"}}; anything else there (a hand-edited list) reads as none."""
    rewards = record.get("rewards")
    return rewards if isinstance(rewards, dict) else {}


def reward_function_names(history: list[dict]) -> list[str]:
    """Every reward function seen in the history, in first-seen order."""
    names = []
    for record in history:
        for name in _per_function(record):
            if name not in names:
                names.append(name)
    return names


def _function_means(history, name):
    out = []
    for record in history:
        entry = _per_function(record).get(name)
        out.append(as_plotted(entry.get("mean") if isinstance(entry, dict) else entry))
    return out


def reward_figure(history: list[dict], *, window: int = 5, figsize=(11, 6)):
    """Total reward, each reward function, and small panels for loss, KL, completion length and clip ratio.

    Returns a matplotlib Figure (Agg); a figure with a message when the history is empty.
    Lines carry gids ("reward:<name>" for a function's rolling mean) so they can be found again.
    """
    history = [r for r in history or [] if isinstance(r, dict)]
    if not history:
        return message_figure("no training steps recorded yet")
    # a step that is no number (a hand-edited record's list) is drawn at its place in the history
    steps = [r.get("step") if isinstance(r.get("step"), (int, float)) and not isinstance(r.get("step"), bool)
             and math.isfinite(as_number(r.get("step"))) else i + 1 for i, r in enumerate(history)]

    fig = new_figure(figsize)
    grid = fig.add_gridspec(2, 4, height_ratios=[1.7, 1])
    ax_total = fig.add_subplot(grid[0, :2])
    ax_funcs = fig.add_subplot(grid[0, 2:], sharex=ax_total)

    total = [as_plotted(r.get("reward")) for r in history]
    # Dynamic sampling trains on the groups whose rewards differ, a mean the filter raises: the mean over every
    # group rolled out (what the policy produced) is drawn beside it.
    rolled_out = [as_plotted(r.get("rolled_out_reward")) for r in history]
    filtered = not all(math.isnan(v) for v in rolled_out)
    ax_total.plot(steps, total, "o", ms=3, alpha=0.4, color="C0", label="per step", gid="reward:total:raw")
    ax_total.plot(steps, rolling_mean(total, window), lw=2, color="C0", gid="reward:total",
                  label=f"{'groups kept (trained on), ' if filtered else ''}rolling mean ({window})")
    if filtered:
        ax_total.plot(steps, rolling_mean(rolled_out, window), "--", lw=1.5, color="C7", gid="reward:rolled_out",
                      label=f"all groups rolled out, rolling mean ({window})")
    ax_total.set_title("total reward", fontsize=10)
    # Steps are whole numbers; shared by every panel (sharex), so no "1.25" ticks on short runs.
    ax_total.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_total.legend(fontsize=7)

    names = reward_function_names(history)
    for i, name in enumerate(names):
        values = _function_means(history, name)
        color, style = function_style(i)
        # A leading underscore keeps the raw line out of the legend: one entry per function.
        ax_funcs.plot(steps, values, "o-", ms=2, lw=0.8, alpha=0.3, color=color, label=f"_{name} raw",
                      gid=f"reward:{name}:raw")
        ax_funcs.plot(steps, rolling_mean(values, window), style, lw=1.8, color=color, label=legend_label(name),
                      gid=f"reward:{name}")
    ax_funcs.set_title(f"reward per function (rolling mean {window})", fontsize=10)
    if names:
        ax_funcs.legend(fontsize=7)
    else:
        _no_data(ax_funcs, "no per-function rewards in the records")

    for col, (title, series) in enumerate(PANELS):
        ax = fig.add_subplot(grid[1, col], sharex=ax_total)
        drawn = 0
        for key, label, style in series:
            values = [as_plotted(r.get(key)) for r in history]
            if all(math.isnan(v) for v in values):
                continue
            color = f"C{col + 4}"
            ax.plot(steps, values, "o", ms=2, alpha=0.35, color=color, gid=f"{key}:raw")
            ax.plot(steps, rolling_mean(values, window), style, lw=1.5, color=color, label=label, gid=key)
            drawn += 1
        if title in SHARES:
            key, label = SHARES[title]
            share = [100 * as_plotted(r.get(key)) for r in history]
            if not all(math.isnan(v) for v in share):
                right = ax.twinx()
                right.plot(steps, share, "--", lw=1, color="C3", gid=key)
                right.set_ylim(-3, 103)
                right.set_ylabel(label, fontsize=7, color="C3")
                right.tick_params(labelsize=6, colors="C3")
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("step", fontsize=8)
        if drawn > 1:
            ax.legend(fontsize=6)
        elif not drawn:
            _no_data(ax, "no data")
    fig.tight_layout()
    return fig


def function_style(i: int) -> tuple:
    """The colour and line style of the i-th reward function's curve: C1-C9 (C0 is the total's), then tab20b's and
    tab20c's 40 shades, so no two of the first 49 functions share a colour; past those the colours repeat with
    another line style."""
    from matplotlib import colormaps

    palette = [f"C{k}" for k in range(1, 10)] + [colormaps[name](k) for name in ("tab20b", "tab20c") for k in range(20)]
    return palette[i % len(palette)], ("-", "--", ":", "-.")[(i // len(palette)) % 4]


def legend_label(name: str) -> str:
    """A reward function's name as a legend shows it, as written: matplotlib leaves out a label starting with "_"
    (a private helper's name) and reads text between two "$" as TeX, which can fail and take the figure down."""
    text = str(name).replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def _no_data(ax, text):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=8, color="#777777")


def plot_reward_curves(history: list[dict], path=None, *, window: int = 5):
    """`reward_figure(history)`, also written as a PNG when `path` is given (the demo's reward curve)."""
    fig = reward_figure(history, window=window)
    if path is not None:
        save_png(fig, path)
    return fig
