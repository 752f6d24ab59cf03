"""What every view shares: Agg figures, PNG/HTML output, byte formatting, rolling means, text safe to print.

Figures are built as `matplotlib.figure.Figure` with an Agg canvas attached by hand instead of
through pyplot: pyplot keeps every figure alive in a global registry (they leak unless closed)
and `matplotlib.use("Agg")` would switch a notebook's own backend away from under the user.
A Figure made this way is freed like any other object once nothing refers to it.
"""

from __future__ import annotations

import base64
import contextlib
import io
import math
import os
import tempfile
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

KiB, MiB, GiB = 2**10, 2**20, 2**30


class HTML(str):
    """An HTML string that also renders itself when it is a notebook cell's value.

    Being a plain `str`, it can be written to a file or embedded in other HTML as is.
    """

    def _repr_html_(self) -> str:
        return str(self)


class PNGFigure(Figure):
    """A Figure that shows itself as a PNG when it is a notebook cell's value, whatever the backend."""

    def _repr_png_(self) -> bytes:
        return png_bytes(self)


def new_figure(figsize, dpi: int = 100) -> Figure:
    fig = PNGFigure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)  # attaches itself as fig.canvas: drawing never touches pyplot
    return fig


def message_figure(text: str, figsize=(6, 1.2)) -> Figure:
    """A figure that only says why there is nothing to draw (instead of raising)."""
    fig = new_figure(figsize)
    fig.text(0.5, 0.5, text, ha="center", va="center", fontsize=10, color="#555555", gid="message")
    return fig


def png_bytes(fig: Figure, dpi: int | None = None) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def save_png(fig: Figure, path, dpi: int | None = None) -> Path:
    """Write `fig` as a PNG file (parent folders created, '~' expanded) and return the path.

    Written to a fresh private file beside it, then renamed into place: a link planted at `path` is
    replaced, never written through, and a reader never sees half a PNG. A failure names `path`."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Cannot write a PNG to {path!r}: expected a file path (a str or pathlib.Path).")
    path = Path(path).expanduser()
    if path.is_dir() and not path.is_symlink():
        raise IsADirectoryError(f"Cannot write the PNG {path}: it is a folder. Name a file in it, e.g. "
                                f"{path / 'figure.png'}, or move the folder away.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # The private name is cut short: `path`'s own name may already be as long as the disk allows.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:32]}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise type(err)(f"Cannot write the PNG {path}: {err.strerror or err} ({err.filename or path.parent}).") from err
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(png_bytes(fig, dpi))
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise type(err)(f"Cannot write the PNG {path}: {err.strerror or err}.") from err
        raise
    return path


def img_html(fig: Figure, alt: str = "", dpi: int | None = None) -> str:
    """`fig` as an <img> with the PNG inlined as base64.

    Inlined images survive a saved notebook, nbviewer and GitHub's renderer, which keep
    neither widget state nor files next to the notebook.
    """
    data = base64.b64encode(png_bytes(fig, dpi)).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{alt}" style="max-width:100%">'


def format_bytes(n: float) -> str:
    if n is None or not math.isfinite(n):
        return "n/a"
    if n == 0:
        return "0"
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.0f} MiB" if abs(n) >= 100 * MiB else f"{n / MiB:.1f} MiB"
    return f"{n / KiB:.0f} KiB"


def as_number(value) -> float:
    """A float for plotting; anything missing or not a number becomes NaN (a gap in the curve)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    try:
        return float(value)
    except OverflowError:  # an int past float's range (a hand-edited record's 10**400): an infinity of its sign
        return math.inf if value > 0 else -math.inf


# Past this size matplotlib's axis arithmetic (limits with their margins, the ticks' range) overflows to inf and
# raises ("arange: cannot compute length"): a diverged run's 1.7e308 loss would take the whole figure down.
PLOT_LIMIT = 1e300


def as_plotted(value) -> float:
    """as_number for a point on an axis: a finite value past PLOT_LIMIT becomes an infinity of its sign, which a
    curve leaves out as it does inf (the value itself stays in the record, and in the summary line)."""
    number = as_number(value)
    return math.copysign(math.inf, number) if math.isfinite(number) and abs(number) > PLOT_LIMIT else number


def as_bytes(value) -> float | None:
    """A byte count from a record to draw (a peak, a device's total), or None when it is missing, not a number
    (a hand-edited "1GB"), not above 0, or past PLOT_LIMIT."""
    number = as_number(value)
    return number if math.isfinite(number) and 0 < number <= PLOT_LIMIT else None


def rolling_mean(values, window: int) -> list[float]:
    """Mean of the last `window` values at each position, skipping NaNs (NaN if all are)."""
    window = max(1, int(window))
    out = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1): i + 1] if not math.isnan(v)]
        out.append(sum(recent) / len(recent) if recent else math.nan)
    return out


# What a terminal (or a bidi-aware page showing text output) acts on instead of showing: C0 and C1 controls (an
# ANSI sequence clears the screen or hides the text after it, OSC 52 writes the clipboard) and the bidi marks,
# overrides and isolates (U+202E shows the rest of its line reversed). Model output, prompts and answers reach
# the text views with them: each is shown as its escape, as repr() shows it; newlines and tabs stay.
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)] if chr(c) not in "\n\t"}
_CONTROLS.update({ord("\r"): "\\r"})
_CONTROLS.update({c: f"\\u{c:04x}" for c in [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]})


def printable(text) -> str:
    """`text` with control characters and bidi controls as escapes (`\\x1b`, `\\u202e`): safe to print."""
    return str(text).translate(_CONTROLS)
