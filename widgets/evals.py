"""The held-out evaluation panel: accuracy (strict and lenient, with their 95% intervals) and reward over steps.

Reads the evaluations the records carry: grpo-nb's `record["eval"]` (train(..., eval_dataset=...) with eval_steps:
the model after that step) and `record["eval_start"]` (eval_on_start: the model before the run's first step, drawn
one step earlier), and the same keys a TRL run's records get from GrpoNbDashboardCallback (TRL's eval_* logs: a
reward, no accuracy). Steps without an evaluation are left out, so the points are those evaluated.
"""

from __future__ import annotations

import math

from matplotlib.ticker import MaxNLocator, PercentFormatter

from .curves import function_style, legend_label
from .figures import as_number, as_plotted, message_figure, new_figure

# (key in an evaluation, label, colour): the two accuracies evaluate() measures
ACCURACIES = (("accuracy", "strict", "C0"), ("lenient_accuracy", "lenient", "C1"))


def evaluations(history: list[dict]) -> list[tuple[float, dict]]:
    """(step, evaluation) of every held-out evaluation in the history, in step order: a record's "eval_start" at
    the step before it (the weights before that step's update), its "eval" at its step."""
    out = []
    for i, record in enumerate(r for r in history or [] if isinstance(r, dict)):
        step = as_number(record.get("step"))
        step = step if math.isfinite(step) else i + 1
        for key, at in (("eval_start", step - 1), ("eval", step)):
            if isinstance(record.get(key), dict):
                out.append((at, record[key]))
    return sorted(out, key=lambda pair: pair[0])


def has_evaluations(history: list[dict]) -> bool:
    return bool(evaluations(history))


def _bounds(evaluation: dict, key: str) -> tuple[float, float]:
    """An accuracy's interval as shares (NaN, NaN when the record has none or a malformed one)."""
    intervals = evaluation.get("intervals")
    bounds = intervals.get(key) if isinstance(intervals, dict) else None
    if isinstance(bounds, (list, tuple)) and len(bounds) == 2:
        return as_plotted(bounds[0]), as_plotted(bounds[1])
    return math.nan, math.nan


def _rewards(evaluation: dict) -> dict:
    rewards = evaluation.get("rewards")
    return rewards if isinstance(rewards, dict) else {}


def eval_figure(history: list[dict], *, figsize=(11, 3.2)):
    """Held-out accuracy (strict and lenient, each with its 95% interval as a band) and the eval set's mean reward
    per reward function (and TRL's total "reward"), over the steps that evaluated. A figure with a message when the
    history holds no evaluation. Lines carry gids ("eval:accuracy", "eval:lenient_accuracy", "eval:reward:<name>")."""
    points = evaluations(history)
    if not points:
        return message_figure("no held-out evaluations recorded (train(..., eval_dataset=..., eval_steps=N))")
    steps = [step for step, _ in points]
    fig = new_figure(figsize)
    ax_acc, ax_reward = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)

    drawn = 0
    for key, label, color in ACCURACIES:
        values = [as_plotted(evaluation.get(key)) for _, evaluation in points]
        if all(math.isnan(v) for v in values):
            continue
        low, high = zip(*(_bounds(evaluation, key) for _, evaluation in points))
        ax_acc.fill_between(steps, low, high, color=color, alpha=0.15, lw=0, gid=f"eval:{key}:interval")
        ax_acc.plot(steps, values, "o-", ms=3, lw=1.5, color=color, label=label, gid=f"eval:{key}")
        drawn += 1
    n = next((e.get("n") for _, e in reversed(points) if isinstance(e.get("n"), int)), None)
    ax_acc.set_title("held-out accuracy (95% interval)" + (f", {n} rows" if n else ""), fontsize=10)
    if drawn:
        ax_acc.set_ylim(-0.03, 1.03)
        ax_acc.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax_acc.legend(fontsize=7)
    else:
        _no_data(ax_acc, "no accuracy in the evaluations (an eval set without an 'answer' column, or a TRL run)")

    names = [name for _, e in points for name in _rewards(e)]
    names = list(dict.fromkeys(names))
    lines = [("reward", "total", "C0")] if any(isinstance(e.get("reward"), (int, float)) for _, e in points) else []
    for key, label, color in lines:
        ax_reward.plot(steps, [as_plotted(e.get(key)) for _, e in points], "o-", ms=3, lw=1.8, color=color,
                       label=label, gid="eval:reward")
    for i, name in enumerate(names):
        color, style = function_style(i)
        values = [as_plotted(_rewards(e).get(name)) for _, e in points]
        ax_reward.plot(steps, values, "o" + style, ms=3, lw=1.2, color=color, label=legend_label(name),
                       gid=f"eval:reward:{name}")
    ax_reward.set_title("held-out mean reward", fontsize=10)
    if names or lines:
        ax_reward.legend(fontsize=7)
    else:
        _no_data(ax_reward, "no rewards in the evaluations")
    for ax in (ax_acc, ax_reward):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    return fig


def eval_line(history: list[dict]) -> str | None:
    """The latest evaluation in a few words ("eval acc 50% (lenient 75%) at step 10"), or None without one."""
    points = evaluations(history)
    if not points:
        return None
    step, evaluation = points[-1]
    acc, lenient = as_number(evaluation.get("accuracy")), as_number(evaluation.get("lenient_accuracy"))
    if math.isfinite(acc):
        text = f"eval acc {acc:.0%}" + (f" (lenient {lenient:.0%})" if math.isfinite(lenient) else "")
    elif math.isfinite(reward := as_number(evaluation.get("reward"))):
        text = f"eval reward {reward:.3f}"
    else:
        return None
    return f"{text} at step {step:g}"


def _no_data(ax, text):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=8, color="#777777", wrap=True)
