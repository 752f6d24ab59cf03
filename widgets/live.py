"""The dashboard, live: a callback that takes one history record per step.

In a notebook it shows `dashboard_html` through ONE IPython display handle and updates it in
place (`handle.update`), at most every `min_interval` seconds plus always the final state: the
output never grows, nothing flickers (no `clear_output`), and the last update is plain HTML with
the PNGs inlined, so the saved notebook, nbviewer and GitHub show it. No widget manager is needed
(Colab, Kaggle, JupyterLab, VS Code). Outside notebooks it prints one progress line per step and a
final text summary (the last step's sample traces and the summary line).

    dashboard = LiveDashboard(png_dir="plots")     # png_dir: reward.png and vram.png at the end
    for record in records: dashboard(record)       # or train(..., live=dashboard), or callbacks=[...]
    dashboard.close()                              # the final state, whatever happened before
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

from .arguments import need
from .curves import reward_figure
from .dashboard import dashboard_html, summary_line
from .evals import eval_figure, has_evaluations
from .figures import save_png
from .traces import traces_text
from .vram import memory_categories, vram_figure


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, Colab, Kaggle, VS Code), False in a terminal or IPython shell."""
    shell = sys.modules.get("IPython")
    ip = shell.get_ipython() if shell and hasattr(shell, "get_ipython") else None
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def progress_line(history: list[dict], max_steps: int | None = None) -> str:
    """`summary_line` with the step counted against `max_steps` ("step 3/10 | reward ...")."""
    line = summary_line(history)
    if not max_steps or not line.startswith("step "):
        return line
    head, sep, rest = line.partition(" | ")
    return f"{head}/{max_steps}{sep}{rest}"


class LiveDashboard:
    """A training callback that shows the dashboard while the run goes on; see the module doc.

    Args:
        notebook: display through an IPython handle (True) or print to the terminal (False);
            default: detected.
        min_interval: seconds between two notebook updates; records in between are kept and
            shown by the next update (`close()` always shows the last one).
        device_total_bytes, trl_estimate, planned, window, max_samples, title: passed to `dashboard_html`
            (`planned`, e.g. `grpo_nb.simulate.simulate_step(...)` for the run's configuration, puts the
            step simulated before the run beside the measured one).
        max_steps: shown in the progress line and the title ("step 3/10").
        print_steps: outside notebooks, print a progress line per step (off when the caller
            already prints its own, as `train(verbose=True)` does).
        png_dir: if set, `close()` writes `reward.png` and `vram.png` there (and `eval.png` with evaluations).
        clock: a function returning seconds (injectable for tests).
    """

    def __init__(self, *, notebook: bool | None = None, min_interval: float = 2.0,
                 device_total_bytes: int | None = None, trl_estimate=None, planned=None, max_steps: int | None = None,
                 window: int = 5, max_samples: int | None = None, title: str = "GRPO run",
                 print_steps: bool = True, png_dir=None, clock=time.monotonic):
        need("LiveDashboard", "min_interval", min_interval, float, 0)
        need("LiveDashboard", "device_total_bytes", device_total_bytes, int, 1, optional=True)
        need("LiveDashboard", "max_steps", max_steps, int, 1, optional=True)
        need("LiveDashboard", "window", window, int, 1)
        need("LiveDashboard", "max_samples", max_samples, int, 0, optional=True)
        if not isinstance(title, str):
            raise TypeError(f"LiveDashboard(title={title!r:.80}) is invalid: expected a string, e.g. title='GRPO run'.")
        for name, value in (("planned", planned), ("trl_estimate", trl_estimate)):
            # read only at the first render, mid-run: find out now that it holds no memory breakdown
            if value is not None and memory_categories(value) is None:
                raise TypeError(f"LiveDashboard({name}={value!r:.80}) is invalid: expected a memory breakdown to draw: "
                                f"a grpo_nb.simulate.simulate_step(...) or estimate_vram(...) result, a dict of its "
                                f"categories (bytes), or None.")
        if png_dir is not None and (isinstance(png_dir, bool) or not isinstance(png_dir, (str, os.PathLike))):
            raise TypeError(f"LiveDashboard(png_dir={png_dir!r:.80}) is invalid: expected a folder for the PNGs, as a "
                            f"str or pathlib.Path, or None.")
        if png_dir is not None and Path(png_dir).expanduser().is_file():
            raise ValueError(f"LiveDashboard(png_dir={str(png_dir)!r}) is invalid: expected a folder for the PNGs, "
                             f"and this is a file.")
        self.notebook = in_notebook() if notebook is None else notebook
        self.min_interval, self.clock = min_interval, clock
        self.device_total_bytes, self.trl_estimate, self.max_steps = device_total_bytes, trl_estimate, max_steps
        self.planned = planned
        self.window, self.max_samples, self.title = window, max_samples, title
        self.print_steps, self.png_dir = print_steps, png_dir
        self.history: list[dict] = []
        self.handle = None          # the IPython DisplayHandle, after the first render
        self.last_render = None     # clock() at the last render
        self.shown = 0              # records shown by the last render
        self.closed = False
        self.failed = False         # a render raised: warn once, then stop displaying (never stop training)

    # ----------------------------------------------------------------------------------

    def __call__(self, record: dict) -> None:
        self.history.append(record)
        if not self.notebook:
            if self.print_steps:
                print(progress_line(self.history, self.max_steps), flush=True)
            return
        now = self.clock()
        if self.last_render is None or now - self.last_render >= self.min_interval:
            self._render()

    def redraw(self) -> None:
        """Show records already shown that changed (an evaluation added to a step's record), as often as a new
        record would be (at most every min_interval seconds; close() shows the final state anyway)."""
        if self.notebook and (self.last_render is None or self.clock() - self.last_render >= self.min_interval):
            self._render()

    def start(self, history=(), *, max_steps: int | None = None) -> None:
        """Show a new run from here: `history`, the records it already has (a resumed run's), replaces those shown
        before, and the next render is a new display (in the cell running this run, not an earlier one's), so one
        dashboard object can show one run after another. `max_steps`: the run's, when given."""
        self.history[:] = list(history)  # the same list: GrpoNbDashboardCallback.history is this one
        if max_steps is not None:
            self.max_steps = max_steps
        self.handle, self.last_render, self.shown, self.closed, self.failed = None, None, 0, False, False

    def close(self, error: BaseException | None = None) -> None:
        """Show the final state (the last record, and how the run ended: finished, interrupted (Ctrl-C, a
        KeyboardInterrupt `error`) or stopped by an error); write PNGs if asked.

        Safe to call more than once; a second call only re-renders if records came in since.
        """
        status = ("finished" if error is None else "interrupted" if isinstance(error, KeyboardInterrupt)
                  else f"stopped by an error: {type(error).__name__}")
        if self.notebook:
            if not self.closed or self.shown < len(self.history):
                self._render(status)
        elif not self.closed:
            print(traces_text(self.history, max_samples=self.max_samples), flush=True)
            print(f"{self.title} {status} | {progress_line(self.history, self.max_steps)}", flush=True)
        if self.png_dir is not None and self.history:
            self.save_pngs(self.png_dir)
        self.closed = True

    finish = close

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(exc)

    # ----------------------------------------------------------------------------------

    def html(self, status: str | None = None) -> str:
        """The dashboard for the records so far, as one self-contained HTML string."""
        step = self.history[-1].get("step", len(self.history)) if self.history else 0
        steps = f"step {step}" + (f"/{self.max_steps}" if self.max_steps else "")
        title = f"{self.title}: {steps}" + (f" ({status})" if status else "")
        return dashboard_html(self.history, trl_estimate=self.trl_estimate, planned=self.planned,
                              device_total_bytes=self.device_total_bytes, window=self.window,
                              max_samples=self.max_samples, title=title)

    def save_pngs(self, directory) -> dict[str, Path]:
        """Write the reward curves and the memory bar as `reward.png` and `vram.png` in `directory`, and the held-out
        evaluation panel as `eval.png` when the records hold evaluations; one that cannot be written does not keep
        the others from being written (the error names each)."""
        directory = Path(directory).expanduser()
        figures = {
            "reward": lambda: reward_figure(self.history, window=self.window),
            "vram": lambda: vram_figure(self.history, trl_estimate=self.trl_estimate, planned=self.planned,
                                        device_total_bytes=self.device_total_bytes),
        }
        if has_evaluations(self.history):
            figures["eval"] = lambda: eval_figure(self.history)
        written, errors = {}, []
        for name, figure in figures.items():
            try:
                written[name] = save_png(figure(), directory / f"{name}.png")
            except OSError as err:
                errors.append(err)
        if errors:
            raise OSError(" ".join(str(err) for err in errors)) from errors[0]
        return written

    def _render(self, status: str | None = None) -> None:
        if self.failed:
            return
        try:
            from IPython import display as ipd

            bundle = {"text/html": self.html(status), "text/plain": progress_line(self.history, self.max_steps)}
            if self.handle is None:
                self.handle = ipd.display(bundle, raw=True, display_id=True)
            else:
                self.handle.update(bundle, raw=True)
        except Exception as err:  # a display problem must never stop a training run
            self.failed = True
            warnings.warn(f"LiveDashboard: the live display failed and is switched off ({type(err).__name__}: "
                          f"{err}); training goes on.", stacklevel=2)
            return
        self.last_render, self.shown = self.clock(), len(self.history)
