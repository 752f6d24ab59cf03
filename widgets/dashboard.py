"""The three views in one HTML page: summary line, reward curves, memory bar, sample traces.

Plain HTML with the plots inlined as base64 PNGs, so the result needs no widget manager and
stays visible in a saved notebook, on nbviewer and on GitHub. In a notebook the returned
string renders itself; elsewhere write it to a .html file.
"""

from __future__ import annotations

import html

from .curves import reward_figure
from .evals import eval_figure, eval_line, has_evaluations
from .figures import HTML, as_number, format_bytes, img_html
from .traces import traces_html
from .vram import vram_figure


def summary_line(history: list[dict]) -> str:
    """One line about the latest step: reward, loss, KL, length, peak memory, time."""
    records = [r for r in history or [] if isinstance(r, dict)]
    if not records:
        return "no training steps recorded yet"
    r = records[-1]
    parts = [f"step {r.get('step', len(records))}"]
    for key, label, fmt in (("reward", "reward", "{:.3f}"), ("loss", "loss", "{:+.4f}"), ("kl", "kl", "{:.4f}"),
                            ("completion_length_mean", "length", "{:.0f}"), ("step_time", "step", "{:.1f}s")):
        value = as_number(r.get(key))
        if value == value:  # not NaN
            parts.append(f"{label} {fmt.format(value)}")
    peak = r.get("peak_memory_bytes")
    if isinstance(peak, (int, float)) and peak:
        parts.append(f"peak memory {format_bytes(peak)}")
    evaluated = eval_line([r])  # the step's own held-out evaluation, when it ran one
    if evaluated:
        parts.append(evaluated.rsplit(" at step ", 1)[0])
    return " | ".join(parts)


def dashboard_html(history: list[dict], *, trl_estimate=None, planned=None, device_total_bytes: int | None = None,
                   window: int = 5, step: int = -1, max_samples: int | None = None, title: str = "GRPO run") -> HTML:
    """Reward curves, the held-out evaluation panel (when the records hold evaluations), memory breakdown and one
    step's sample traces as one HTML string.

    Args:
        history: the records `train()` returns (or any list of dicts of the same shape).
        trl_estimate, planned, device_total_bytes: passed to `vram_figure`.
        window: rolling-mean window of the curves.
        step, max_samples: which step's samples to show (see `traces_html`).
    """
    history = list(history or [])
    curves = img_html(reward_figure(history, window=window), alt="reward curves")
    if has_evaluations(history):
        curves += img_html(eval_figure(history), alt="held-out evaluation")
    memory = img_html(vram_figure(history, trl_estimate=trl_estimate, planned=planned,
                                  device_total_bytes=device_total_bytes), alt="memory by category")
    traces = traces_html(history, step, max_samples=max_samples)
    return HTML(
        f'<div style="font-family:sans-serif">'
        f"<h3 style=\"margin:4px 0\">{html.escape(title)}</h3>"
        f"<div><code>{html.escape(summary_line(history))}</code></div>"
        f"<div>{curves}</div><div>{memory}</div><div>{traces}</div></div>")
