"""Watch a TRL GRPOTrainer run with grpo-nb's widgets: a `transformers.TrainerCallback`.

    from grpo_nb_widgets.trl_callback import GrpoNbDashboardCallback
    dash = GrpoNbDashboardCallback()                  # live dashboard in notebooks, throttled
    trainer = GRPOTrainer(..., callbacks=[dash]); trainer.train()
    reward_figure(dash.history); vram_figure(dash.history); traces_html(dash.history)

Each `on_log` (every `logging_steps`) becomes one grpo-nb-shaped record in `.history`.
What TRL 1.16's GRPOTrainer logs, and where it goes in the record:

    reward, reward_std, frac_reward_zero_std    -> same keys
    rewards/<name>/mean, rewards/<name>/std     -> record["rewards"][name] = {"mean", "std"}
    loss, grad_norm, learning_rate, kl, entropy -> same keys (kl only when beta > 0)
    clip_ratio/region_mean, /low_mean, /high_mean -> clip_ratio, clip_ratio_low, clip_ratio_high
    completions/mean_length, /max_length        -> completion_length_mean, completion_length_max
    completions/clipped_ratio                   -> truncated_fraction
    sampling/importance_sampling_ratio/mean, /min, /max  -> rollout_is_ratio_mean, _min, _max
    sampling/sampling_logp_difference/mean, /max         -> rollout_logprob_diff_mean, _max
                                                   (vLLM's correction; grpo-nb's rollout_importance_sampling_*)
    step_time                                   -> step_time
    (everything)                                -> record["trl_logs"], untouched

Evaluation (an eval_dataset with eval_strategy="steps"): TRL logs its eval metrics with an "eval_" prefix
(eval_reward, eval_rewards/<name>/mean, eval_completions/mean_length, eval_loss, ...; TRL measures no
accuracy, but an eval_accuracy a run logs is read). They go in the record of the step they were taken at, as
record["eval"] = {"reward", "reward_std", "rewards": {name: mean}, "mean_length", "truncation_rate", "loss",
"accuracy", "seconds", "trl_logs"}, which the dashboard's held-out panel draws (grpo_nb_widgets.evals); a step
that evaluated without logging (eval_on_start's step 0) gets a record of its own holding only that.

Memory: the callback gets the model and optimizer (not the trainer), so a record's
"memory" holds what can be measured from them: base (frozen) weights, trainable weights,
optimizer states, and gradients estimated as the trainable weights' size. On CUDA,
`torch.cuda.max_memory_allocated()` is the peak ("peak_memory_bytes") and the rest of it
(activations, KV cache, log-prob scratch: not separable from outside the trainer) is
"other". On CPU there is no peak.

Completions: TRL keeps them in the trainer's private `_logs`, which a callback cannot
reach. With `log_completions=True` TRL writes each logged step's table to
`<output_dir>/completions/completions_<step>.parquet` right AFTER calling `on_log`, so the
callback attaches those samples to the record one event later (the next step's end, or
the end of training). With `log_completions=False` records have no samples.
Not available at all: generation time (TRL does not log it) and the memory split of
activations / KV cache.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

from .arguments import need
from .live import LiveDashboard, in_notebook

try:  # transformers is only needed to be a TrainerCallback; the record conversion works without it
    from transformers import TrainerCallback as _Base
except ImportError:  # pragma: no cover
    _Base = object

# TRL log key -> record key (one to one).
DIRECT_KEYS = {
    "reward": "reward",
    "reward_std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "learning_rate": "learning_rate",
    "kl": "kl",
    "entropy": "entropy",
    "clip_ratio/region_mean": "clip_ratio",
    "clip_ratio/low_mean": "clip_ratio_low",
    "clip_ratio/high_mean": "clip_ratio_high",
    "completions/mean_length": "completion_length_mean",
    "completions/max_length": "completion_length_max",
    "completions/clipped_ratio": "truncated_fraction",
    "sampling/importance_sampling_ratio/mean": "rollout_is_ratio_mean",
    "sampling/importance_sampling_ratio/min": "rollout_is_ratio_min",
    "sampling/importance_sampling_ratio/max": "rollout_is_ratio_max",
    "sampling/sampling_logp_difference/mean": "rollout_logprob_diff_mean",
    "sampling/sampling_logp_difference/max": "rollout_logprob_diff_max",
    "step_time": "step_time",
    "epoch": "epoch",
}


def _number(value) -> float | None:
    """A logged value as a float (NaN and inf kept: a diverged step shows as one); None for what is not a number a
    float holds (None, text, a bool, an int beyond float's range, a tensor of several values), which the record
    leaves out: a display callback must never stop training, and TRL does not catch what a callback raises."""
    if value is None or isinstance(value, (str, bytes, bool)):
        return None
    try:
        return float(value)
    except Exception:  # OverflowError, TypeError, ValueError, RuntimeError (a tensor of several values), ...
        return None


def _is_step(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def record_from_trl_logs(logs: dict, step: int | None = None) -> dict | None:
    """A grpo-nb-shaped record from one TRL GRPOTrainer logs dict; None for logs that are not a
    training step's (evaluation logs, the end-of-training summary)."""
    if not isinstance(logs, dict) or any(str(k).startswith("eval_") for k in logs) or "train_runtime" in logs:
        return None
    if not any(k in logs for k in ("reward", "loss")) and not any(str(k).startswith("rewards/") for k in logs):
        return None
    step = step if _is_step(step) else logs.get("step")
    record = {"step": step if _is_step(step) else None, "rewards": {}, "samples": [], "source": "trl"}
    for key, target in DIRECT_KEYS.items():
        if key in logs and (number := _number(logs[key])) is not None:
            record[target] = number
    for key, value in logs.items():
        key = str(key)
        # Reward function names may contain "/" (a reward model's hub id), so cut from both ends.
        if key.startswith("rewards/") and key.endswith(("/mean", "/std")) and (number := _number(value)) is not None:
            name, stat = key[len("rewards/"):].rsplit("/", 1)
            record["rewards"].setdefault(name, {})[stat] = number
    record["trl_logs"] = dict(logs)
    return record


# TRL eval log key (after "eval_") -> the evaluation's key, as grpo-nb's record["eval"] names it
EVAL_KEYS = {
    "reward": "reward", "reward_std": "reward_std", "loss": "loss", "runtime": "seconds",
    "completions/mean_length": "mean_length", "completions/clipped_ratio": "truncation_rate",
    "accuracy": "accuracy", "lenient_accuracy": "lenient_accuracy",
}


def evaluation_from_trl_logs(logs: dict) -> dict | None:
    """A held-out evaluation (record["eval"]'s shape) from one TRL logs dict of eval_* metrics; None for other logs."""
    if not isinstance(logs, dict) or not any(str(k).startswith("eval_") for k in logs):
        return None
    evaluation = {"rewards": {}}
    for key, value in logs.items():
        key = str(key)
        if not key.startswith("eval_") or (number := _number(value)) is None:
            continue
        name = key[len("eval_"):]
        if name in EVAL_KEYS:
            evaluation[EVAL_KEYS[name]] = number
        elif name.startswith("rewards/") and name.endswith("/mean"):  # a name may hold "/": cut from both ends
            evaluation["rewards"][name[len("rewards/"):-len("/mean")]] = number
    evaluation["trl_logs"] = dict(logs)
    return evaluation


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "numel"))


def memory_from_objects(model=None, optimizer=None) -> dict:
    """Memory categories measurable from outside the trainer (see the module doc), in bytes."""
    out = {}
    if model is not None and hasattr(model, "parameters"):
        params = list(model.parameters())
        out["base_weights"] = _tensor_bytes(p for p in params if not p.requires_grad)
        out["trainable"] = _tensor_bytes(p for p in params if p.requires_grad)
        out["gradients"] = out["trainable"]  # freed by zero_grad before logging: estimated
    if optimizer is not None and hasattr(optimizer, "state"):
        try:
            out["optimizer"] = _tensor_bytes(v for state in optimizer.state.values() for v in state.values())
        except Exception:  # an optimizer with an unusual state layout
            pass
    return out


def _cuda_memory():
    """(peak allocated, device total) in bytes on CUDA, (None, None) elsewhere."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()
            return (int(torch.cuda.max_memory_allocated(device)),
                    int(torch.cuda.get_device_properties(device).total_memory))
    except Exception:
        pass
    return None, None


def _text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and isinstance(value[-1], dict):
        return str(value[-1].get("content", ""))  # chat messages: the last one
    if hasattr(value, "tolist"):  # numpy arrays of message dicts from parquet
        return _text(value.tolist())
    return "" if value is None else str(value)


# What a sample keeps, as grpo-nb's records keep it (grpo_nb.records.sample_of_row; tests/test_trl_callback.py holds
# the two together): the prompt's end, a text column up to this many characters (a longer one is only named).
MAX_SAMPLE_PROMPT, MAX_SAMPLE_COLUMN = 2000, 1000


def _messages(value):
    value = value.tolist() if hasattr(value, "tolist") else value  # numpy arrays of message dicts from parquet
    return list(value) if isinstance(value, (list, tuple)) and value and isinstance(value[-1], dict) else None


def _tail(text: str) -> str:
    limit = MAX_SAMPLE_PROMPT
    return text if len(text) <= limit else f"[... {len(text) - limit:,} earlier characters cut]\n" + text[-limit:]


def prompt_of(value) -> dict:
    """{"prompt": the question (a chat prompt's last user message), "prefill": an assistant prefill the completion
    continues, when the prompt ends with one}, each cut to its end as grpo-nb's records cut them."""
    messages = _messages(value)
    if messages is None:
        return {"prompt": _tail(_text(value))}
    prefill = None
    if messages[-1].get("role") == "assistant":
        prefill, messages = str(messages[-1].get("content", "")), messages[:-1]
    asked = [m for m in messages if m.get("role") == "user"] or messages
    out = {"prompt": _tail(str(asked[-1].get("content", ""))) if asked else ""}
    return {**out, "prefill": _tail(prefill)} if prefill is not None else out


def samples_from_completions_table(path, reward_names, reward_weights=None, max_samples: int | None = None) -> list:
    """Sample dicts (as in grpo-nb records) from one of TRL's completions_<step>.parquet files."""
    import pandas as pd  # TRL itself needs pandas to write these files

    df = pd.read_parquet(path)
    names = [n for n in reward_names if n in df.columns]
    if not names:  # no reward columns seen in logs yet: any numeric column except step/advantage
        names = [c for c in df.columns if c not in ("step", "prompt", "completion", "advantage")
                 and pd.api.types.is_numeric_dtype(df[c])]
    weights = list(reward_weights) if reward_weights is not None and len(reward_weights) == len(names) else None
    samples = []
    for _, row in df.head(max_samples or len(df)).iterrows():
        rewards = {n: float(row[n]) for n in names}
        valid = [(w, v) for w, v in zip(weights or [1.0] * len(names), rewards.values()) if not math.isnan(v)]
        sample = {**prompt_of(row.get("prompt")), "completion": _text(row.get("completion")),
                  # no function scored it: no score (NaN, shown "—"), as in grpo-nb's own records, not a sum of 0
                  "rewards": rewards, "reward": sum(w * v for w, v in valid) if valid else math.nan}
        if "advantage" in row:
            sample["advantage"] = float(row["advantage"])
        left_out = []
        for column in df.columns:
            if column not in ("step", "prompt", "completion", "advantage", *names):
                value = row[column]
                if isinstance(value, str) and len(value) > MAX_SAMPLE_COLUMN:
                    left_out.append(f"{column} ({len(value):,} characters)")
                elif isinstance(value, (str, int, float)):
                    sample[column] = value
        if left_out:
            sample["left_out"] = left_out
        samples.append(sample)
    return samples


class GrpoNbDashboardCallback(_Base):
    """Turns GRPOTrainer logs into grpo-nb records (`.history`) and shows the dashboard live.

    Args:
        live: show `dashboard_html(history)` in one notebook output, updated in place;
            default: on in notebooks, off elsewhere.
        update_every_s: at most one live redraw per this many seconds (the last step is always drawn).
        max_samples: samples kept per record from TRL's completions files.
        dashboard_kwargs: passed to `dashboard_html` (e.g. trl_estimate=, device_total_bytes=).
    """

    def __init__(self, *, live: bool | None = None, update_every_s: float = 5.0, max_samples: int | None = 8,
                 **dashboard_kwargs):
        need("GrpoNbDashboardCallback", "update_every_s", update_every_s, float, 0)
        need("GrpoNbDashboardCallback", "max_samples", max_samples, int, 0, optional=True)
        notebook = in_notebook()
        self.live = notebook if live is None else live
        if dashboard_kwargs and not self.live:  # they shape the live view only: say so rather than drop them
            warnings.warn(f"GrpoNbDashboardCallback(live=False, {', '.join(map(str, dashboard_kwargs))}=...): "
                          f"these settings are for the live dashboard, which is off, so they are not used; pass "
                          f"them to dashboard_html(callback.history, ...) to draw it after the run.", UserWarning,
                          stacklevel=2)
        # The display is LiveDashboard's (one handle, throttled, never stops training); it keeps the records, so
        # `.history` is its list. Outside a notebook (live=True in a terminal) it prints its text summary, not the
        # HTML bundle with its inlined images.
        self.view = LiveDashboard(notebook=notebook, min_interval=update_every_s, print_steps=False,
                                  **{"title": "GRPO run (TRL)", **dashboard_kwargs}) if self.live else None
        self.history: list[dict] = self.view.history if self.view is not None else []
        self.max_samples = max_samples
        self._pending_samples: list[tuple[dict, Path]] = []
        self._reward_weights = None

    # ------------------------------------------------------------------ TrainerCallback hooks

    def on_log(self, args, state, control, logs=None, **kwargs):
        evaluation = evaluation_from_trl_logs(logs or {})
        if evaluation is not None:
            self._add_evaluation(evaluation, getattr(state, "global_step", None))
            return
        record = record_from_trl_logs(logs or {}, step=getattr(state, "global_step", None))
        if record is None:
            return
        self._attach_samples()
        record.update(self._memory(kwargs.get("model"), kwargs.get("optimizer")))
        self._reward_weights = getattr(args, "reward_weights", None)
        if getattr(args, "log_completions", False) and getattr(args, "output_dir", None) is not None:
            path = Path(args.output_dir) / "completions" / f"completions_{int(record['step'] or 0):05d}.parquet"
            self._pending_samples.append((record, path))
        if self.view is not None:
            self.view(record)  # appends to self.history, redraws at most every update_every_s
        else:
            self.history.append(record)

    def on_step_end(self, args, state, control, **kwargs):
        self._attach_samples()

    def on_train_end(self, args, state, control, **kwargs):
        self._attach_samples()
        if self.view is not None:
            self.view.close()

    # ------------------------------------------------------------------ internals

    def _add_evaluation(self, evaluation: dict, step) -> None:
        """Into the record of its step (Trainer logs a step's training metrics before it evaluates), else a record
        of its own (an evaluation at a step that logged nothing, as eval_on_start's step 0)."""
        step = step if _is_step(step) else None
        if self.history and self.history[-1].get("step") == step and "eval" not in self.history[-1]:
            self.history[-1]["eval"] = evaluation
            if self.view is not None:
                self.view.redraw()
            return
        record = {"step": step, "rewards": {}, "samples": [], "source": "trl", "eval": evaluation}
        if self.view is not None:
            self.view(record)
        else:
            self.history.append(record)

    @staticmethod
    def _memory(model, optimizer) -> dict:
        memory = memory_from_objects(model, optimizer)
        peak, total = _cuda_memory()
        out = {}
        if peak is not None:
            static = sum(memory.get(k, 0) for k in ("base_weights", "trainable", "optimizer", "gradients"))
            memory["other"] = max(0, peak - static)
            memory["peak"] = peak
            out.update(peak_memory_bytes=peak, device_total_bytes=total, device="cuda")
        if memory:
            out["memory"] = memory
        return out

    def _attach_samples(self) -> None:
        still = []
        for record, path in self._pending_samples:
            if not path.exists():
                still.append((record, path))
                continue
            try:
                record["samples"] = samples_from_completions_table(path, list(record["rewards"]),
                                                                   self._reward_weights, self.max_samples)
            except Exception as err:  # an unreadable file must not stop training
                record["samples_error"] = f"{type(err).__name__}: {err}"
        # Only the latest step can still be waiting for its file: TRL writes it right after on_log.
        self._pending_samples = still[-1:]
