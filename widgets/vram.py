"""Where the memory goes: one stacked horizontal bar per run (and per estimate).

The categories are those of `record["memory"]` (grpo_nb's memory tracker) and of the
planner's estimates. Rollout and policy update never run at the same time, so a bar is not
one plain stack: the static part (weights, LoRA + optimizer, other) runs full height, and
after it the bar splits into two lanes, the update's (gradients, activations, log-prob
scratch) above and the rollout's (KV cache) below. The longer lane ends at the step's peak,
which is exactly how the tracker and the planner add the categories up.

A TRL-style estimate is passed as a plain dict of the same categories, e.g.
`dict(estimate_vram(..., system="trl").categories)`; an object with a `.categories` dict
(grpo_nb's MemoryEstimate itself, or a simulated step) is read the same way. `planned` draws
what a configuration will take before any run - `grpo_nb.simulate.simulate_step(...)` (the
real step on the meta device), `estimate_vram(...)` or a `plan_for_gpu(...)` plan (labelled with
its card and, once priced, its seconds per step) - as a bar of its own.
"""

from __future__ import annotations

from matplotlib.patches import Patch

from .arguments import need
from .figures import GiB, MiB, as_bytes, format_bytes, message_figure, new_figure

# (key, label, color) in the order, which is also the legend's. The tracker's
# `trainable` and `optimizer` are shown as one segment: both exist only because of the adapter.
SEGMENTS = (
    ("base_weights", "base weights", "#4c72b0"),
    ("lora_optimizer", "LoRA + optimizer", "#dd8452"),
    ("gradients", "gradients", "#c44e52"),
    ("activations", "activations", "#8172b3"),
    ("logprob_scratch", "log-prob / loss", "#937860"),
    ("kv_cache", "KV cache", "#55a868"),
    ("other", "other / runtime", "#8c8c8c"),
    ("parked_optimizer", "optimizer (in host memory between steps)", "#f0b27a"),
)
LABELS = {key: label for key, label, _ in SEGMENTS}
COLORS = {key: color for key, _, color in SEGMENTS}
STATIC = ("base_weights", "lora_optimizer", "other")
UPDATE = ("gradients", "activations", "logprob_scratch")
ROLLOUT = ("kv_cache",)
# a state parked in host memory between steps (grpo_nb.parking) is on the device at the optimizer step only
OPTIMIZER_STEP = ("gradients", "parked_optimizer")
_SOURCE_KEYS = ("base_weights", "trainable", "optimizer", "gradients", "activations", "logprob_scratch",
                "kv_cache", "other")


def memory_categories(source) -> dict | None:
    """The display categories in bytes, or None when `source` holds no memory breakdown.

    `source`: a history record (reads its "memory"), a dict of categories (a record's
    "memory", a converted estimate), or an object with a `.categories` dict.
    """
    if source is None:
        return None
    parked = False  # the optimizer's state in host memory between steps: a record says so, an estimate's settings
    if isinstance(source, dict) and isinstance(source.get("memory"), dict):
        source = source["memory"]
    elif not isinstance(source, dict):
        settings = getattr(source, "settings", None)
        parked = isinstance(settings, dict) and settings.get("park_optimizer_state") is True
        source = getattr(source, "categories", None)
    if not isinstance(source, dict) or not any(k in source for k in _SOURCE_KEYS):
        return None

    def get(key):  # a byte count; anything else (negative, NaN, text, past what an axis can hold) as 0
        return as_bytes(source.get(key)) or 0

    cats = {key: get(key) for key in ("base_weights", "gradients", "activations", "logprob_scratch",
                                       "kv_cache", "other")}
    parked = parked or source.get("optimizer_parked") is True
    cats["lora_optimizer"] = get("trainable") + (0 if parked else get("optimizer"))
    cats["parked_optimizer"] = get("optimizer") if parked else 0
    return cats


def _lanes(cats: dict) -> list:
    """(name, keys) of the phases drawn after the static part: the update and the rollout, and the optimizer step
    when the optimizer's state is parked (memory.accounting.step_peak)."""
    return [("update", UPDATE), ("rollout", ROLLOUT)] + ([("optimizer step", OPTIMIZER_STEP)]
                                                         if cats.get("parked_optimizer") else [])


def breakdown_peak(cats: dict) -> float:
    """The peak the categories add up to: static + the largest phase."""
    return sum(cats[k] for k in STATIC) + max(sum(cats.get(k, 0) for k in keys) for _, keys in _lanes(cats))


def _measured_peak(record: dict) -> float:
    """A record's measured peak in bytes, 0 when it has none: a hand-edited "1GB" (or a "memory" that is not a
    dict) counts as none, not as a TypeError that takes the dashboard down."""
    memory = record.get("memory")
    return as_bytes(record.get("peak_memory_bytes")) or as_bytes(
        memory.get("peak") if isinstance(memory, dict) else None) or 0


def _evaluation_peak(record: dict) -> float:
    """The peak of the held-out evaluations a record's step ran (record["memory"]["evaluation_peak"]: train(...,
    eval_dataset=...)), 0 when none: outside the step's bar (neither the rollout nor the update), but the run's."""
    memory = record.get("memory")
    return (as_bytes(memory.get("evaluation_peak")) if isinstance(memory, dict) else None) or 0


def _latest_with_memory(history):
    for record in reversed(history):
        if memory_categories(record) is not None:
            return record
    return None


def vram_figure(record=None, *, trl_estimate=None, planned=None, device_total_bytes: int | None = None,
                run_peak_bytes: int | None = None, trl_label: str = "TRL-style\n(estimate)",
                planned_label: str | None = None, figsize=None):
    """A stacked bar of one step's memory by category, against the device total when known.

    Args:
        record: one history record, or a whole history (the latest step with a breakdown is
            drawn and the run's peak is the highest over all steps); None to draw only `planned`.
        trl_estimate: optional bar: a dict of the same categories (see module doc).
        planned: optional bar for a configuration before (or beside) the run: a simulated step or
            an estimate (see module doc); labelled `planned_label`, by default from what it is.
        device_total_bytes: the accelerator's capacity (e.g.
            `torch.cuda.get_device_properties(0).total_memory`); also read from a record's
            "device_total_bytes" if present. Drawn as a dashed line.
        run_peak_bytes: the peak to mark; default the record's measured peak (or the history's), a held-out
            evaluation's included (record["memory"]["evaluation_peak"]), said so when it is the highest.

    Returns a matplotlib Figure (Agg); a figure with a message when there is nothing to draw.
    """
    need("vram_figure", "device_total_bytes", device_total_bytes, float, 1, optional=True)
    history = record if isinstance(record, list) else [record] if isinstance(record, dict) else []
    record = _latest_with_memory(history)
    run = memory_categories(record)
    estimate = memory_categories(trl_estimate)
    plan = memory_categories(planned)
    if run is None and estimate is None and plan is None:
        if planned is not None and getattr(planned, "fits", True) is False:  # a plan_for_gpu plan
            return message_figure(f"the plan for {getattr(planned, 'gpu', 'the card')} fits nothing it tried: no bar "
                                  f"to draw (see the plan's notes)")
        return message_figure("no memory breakdown in this record (record['memory'] is missing)")

    if run is not None and run_peak_bytes is None:
        peaks = [_measured_peak(r) for r in history if isinstance(r, dict)]
        evaluations = [_evaluation_peak(r) for r in history if isinstance(r, dict)]
        run_peak_bytes = max(peaks + evaluations, default=0) or breakdown_peak(run)
        in_evaluation = max(evaluations, default=0) > max(peaks, default=0)
    else:
        in_evaluation = False
    if device_total_bytes is None and record is not None:
        device_total_bytes = as_bytes(record.get("device_total_bytes"))

    rows = []  # (tag, y label, categories)
    if run is not None:
        where = f"this run\n(step {record.get('step', '?')}, {record.get('device', '?')})"
        rows.append(("run", where, run))
    if plan is not None:
        rows.append(("planned", planned_label or _plan_label(planned), plan))
    if estimate is not None:
        rows.append(("estimate", trl_label, estimate))

    ends = [breakdown_peak(cats) for _, _, cats in rows] + [run_peak_bytes or 0, device_total_bytes or 0]
    scale, unit = (GiB, "GiB") if max(ends) >= GiB else (MiB, "MiB")
    fig = new_figure(figsize or (10, 1.6 + 1.1 * len(rows)))
    ax = fig.add_subplot()
    xmax = max(ends) / scale * 1.18  # room for the labels right of the bars
    height = 0.7

    for y, (tag, _, cats) in enumerate(rows):
        static_end = _draw_stack(ax, tag, cats, STATIC, 0.0, y, height, scale, xmax)
        lanes = _lanes(cats)
        lane = height / len(lanes)
        ends = []
        for i, (name, keys) in enumerate(lanes):
            ly = y - height / 2 + lane * (i + 0.5)
            ends.append(_draw_stack(ax, tag, cats, keys, static_end, ly, lane, scale, xmax))
            if ends[-1] > static_end:
                ax.text(ends[-1] + xmax * 0.005, ly, name, va="center", fontsize=7, color="#555555")
        total = max(ends)
        ax.text(total + xmax * 0.06, y, format_bytes(total * scale), va="center", fontsize=8, fontweight="bold")

    if run is not None and run_peak_bytes:
        # The run's peak on its own bar; it can exceed this step's bar when an earlier step peaked higher.
        p = run_peak_bytes / scale
        said = f"run peak {format_bytes(run_peak_bytes)}" + (" (held-out evaluation)" if in_evaluation else "")
        if (record or {}).get("memory", {}).get("peaks_upper_bound") is True:  # MemoryTracker.peaks_reset
            said += " (at most: this OS keeps the process's peak)"
        ax.plot([p, p], [-height / 2 - 0.12, height / 2 + 0.12], color="black", lw=2, gid="peak", label=said)
        ax.plot([p], [-height / 2 - 0.12], marker="v", color="black", ms=7)
        ax.text(p, -height / 2 - 0.2, said, ha="center", va="bottom", fontsize=8)
    if device_total_bytes:
        ax.axvline(device_total_bytes / scale, color="#d62728", ls="--", lw=1.5, gid="device_total")
        ax.text(device_total_bytes / scale, len(rows) - 0.5, f" device total {format_bytes(device_total_bytes)}",
                color="#d62728", fontsize=8, va="bottom", ha="right")

    ax.set_yticks(range(len(rows)), [label for _, label, _ in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.4, -0.85)  # first row on top, room above it for the peak label
    ax.set_xlim(0, xmax)
    ax.set_xlabel(unit)
    ax.set_title("memory by category", fontsize=10)
    ax.legend(handles=_legend_handles(rows), loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.1 / len(rows)),
              ncol=4, fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


def _plan_label(planned) -> str:
    """"grpo_nb (simulated)" for a simulated step, "grpo_nb (estimate)" for the planner's; for a plan
    (`plan_for_gpu`) its card, and its priced seconds per step once priced (`plan.time`)."""
    if hasattr(planned, "priced_time"):  # a grpo_nb.planning.Plan
        kind = "simulated" if planned.simulated is not None else "estimate"
        t = planned.priced_time
        timed = f"\n~{t.total:.3g} s/step" if t is not None else ""
        return f"plan, {planned.gpu}\n({kind}){timed}"
    system = getattr(planned, "system", "planned")
    kind = "simulated" if hasattr(planned, "phases") else "estimate"
    return f"{system}\n({kind})"


def _draw_stack(ax, tag, cats, keys, start, y, height, scale, xmax):
    """Draw the non-zero categories in `keys` left to right from `start`; return where they end."""
    x = start
    for key in keys:
        width = cats[key] / scale
        if width <= 0:
            continue
        bar = ax.barh(y, width, left=x, height=height, color=COLORS[key], edgecolor="white", linewidth=0.5)
        bar.patches[0].set_gid(f"{tag}:{key}")  # so tests and callers can find each segment
        if width > xmax * 0.07:  # a value label only where it fits inside the segment
            ax.text(x + width / 2, y, format_bytes(cats[key]), ha="center", va="center", fontsize=7, color="white")
        x += width
    return x


def _legend_handles(rows):
    handles = []
    for key, label, color in SEGMENTS:
        values = [(tag, cats[key]) for tag, _, cats in rows]
        if not any(v for _, v in values):
            continue
        if key == "lora_optimizer":
            full = not any(cats["base_weights"] for _, _, cats in rows)  # a full fine-tune: no frozen base, no LoRA
            parked = all(cats.get("parked_optimizer") for _, _, cats in rows)  # its own segment then
            label = ("weights" if full else "LoRA") + ("" if parked else " + optimizer")
        if len(values) > 1:  # one legend for both bars: the value on each
            label += "  " + " | ".join(format_bytes(v) for _, v in values)
        else:
            label += f"  {format_bytes(values[0][1])}"
        handles.append(Patch(color=color, label=label))
    return handles
