"""Static plots of a run's history, drawn with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import math


def _rolling_mean(values, window):
    out, acc, buf = [], 0.0, []
    for v in values:
        buf.append(v)
        acc += v
        if len(buf) > window:
            acc -= buf.pop(0)
        out.append(acc / len(buf))
    return out


def plot_reward_curves(history: list[dict], path=None, *, window: int = 5):
    """Total reward and each reward function's mean over steps, with a rolling mean.

    Returns the matplotlib Figure; writes a PNG when `path` is given.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    steps = [r["step"] for r in history]
    fig = Figure(figsize=(9, 3.6), dpi=100)
    ax_total, ax_funcs = fig.subplots(1, 2)
    total = [r["reward"] for r in history]
    ax_total.plot(steps, total, "o", ms=3, alpha=0.4, label="per step")
    ax_total.plot(steps, _rolling_mean(total, window), lw=2, label=f"rolling mean ({window})")
    ax_total.set(title="total reward", xlabel="step")
    ax_total.legend(fontsize=8)
    names = list(history[0]["rewards"]) if history else []
    for name in names:
        vals = [r["rewards"][name]["mean"] for r in history]
        vals = [0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in vals]
        ax_funcs.plot(steps, _rolling_mean(vals, window), lw=1.5, label=name)
    ax_funcs.set(title="reward per function (rolling mean)", xlabel="step")
    if names:
        ax_funcs.legend(fontsize=7)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig
