"""A table of reward scores per sample: HTML in notebooks, aligned text in terminals.

Takes plain lists and dicts (it never calls reward functions itself), so it shows the output
of any scoring code. `grpo_nb.preview_rewards` and `grpo_nb.sample_and_score` build one.

    table = RewardTable(
        names=["format", "correct"],
        samples=[{"completion": "<answer>4</answer>", "prompt": "2+2?", "group": 0}, ...],
        cells={"format": [{"value": 0.5}, ...],
               "correct": [{"error": "KeyError: 'answer'"}, ...]},   # or {"value": ..., "note": ...}
        weights=[1.0, 2.0],            # adds a weighted total column
    )
    table.scores       # {"format": [0.5, ...], "correct": [None, ...]}: None where no usable number
    table              # renders itself (HTML) as a notebook cell's value; print(table) for text

A cell is a dict: {"value": float} for a score, {"value": None} for "no score" (a reward
function's None), {"error": text} when the function failed there, {"note": text} (with or
without a value) when the value is unusable (wrong count, not a number, NaN).
"""

from __future__ import annotations

import html
import math

from .figures import printable

MAX_COMPLETION_HTML = 3000
MAX_COMPLETION_TEXT = 60
MAX_CELL_TEXT = 42


def _fmt(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.4g}"
    return repr(value)


def _usable(cell) -> float | None:
    """The cell's score when it is a finite number with nothing wrong, else None."""
    if not isinstance(cell, dict) or cell.get("error") or cell.get("note"):
        return None
    value = cell.get("value")
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def _one_line(text, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class RewardTable:
    """Scores of several reward functions on the same samples (see the module doc for the input)."""

    def __init__(self, names, samples, cells, *, weights=None, errors=None, title: str = "Reward preview",
                 footer=()):
        self.names = list(names)
        self.samples = [dict(s) if isinstance(s, dict) else {"completion": s} for s in samples]
        n = len(self.samples)
        self.cells = {name: list(cells.get(name) or [{"value": None} for _ in range(n)]) for name in self.names}
        for name, column in self.cells.items():
            if len(column) != n:
                raise ValueError(f"{name!r} has {len(column)} cells for {n} samples")
        if weights is not None and len(weights) != len(self.names):
            raise ValueError(f"{len(weights)} weights for {len(self.names)} reward functions")
        self.weights = None if weights is None else [float(w) for w in weights]
        self.errors = {name: (errors or {}).get(name) for name in self.names}
        self.title, self.footer = title, list(footer)

    # ------------------------------------------------------------------ values

    @property
    def scores(self) -> dict:
        """{name: [score or None per sample]}: None wherever there is no usable number."""
        return {name: [_usable(c) for c in column] for name, column in self.cells.items()}

    @property
    def show_total(self) -> bool:
        return self.weights is not None or len(self.names) > 1

    @property
    def totals(self) -> list:
        """Per sample: the weighted sum over functions (None scores skipped, as in training);
        None when a function failed or returned something unusable for that sample, and when no
        function scored it (see `unscored`)."""
        weights = self.weights or [1.0] * len(self.names)
        out = []
        for i, unscored in enumerate(self.unscored):
            total, broken = 0.0, False
            for name, w in zip(self.names, weights):
                cell = self.cells[name][i]
                value = _usable(cell)
                if value is not None:
                    total += w * value
                elif cell.get("error") or cell.get("note"):
                    broken = True
            out.append(None if broken or unscored else total)
        return out

    @property
    def unscored(self) -> list:
        """Per sample: every function returned None for it (no error): training leaves such a
        completion out of its group's mean and std and gives it advantage 0, as TRL does."""
        return [bool(self.names) and all(not (c.get("error") or c.get("note")) and c.get("value") is None
                                         for c in (self.cells[name][i] for name in self.names))
                for i in range(len(self.samples))]

    def _cell_text(self, cell) -> tuple[str, str]:
        """(short text, kind) of one cell; kind is "ok", "none", "note" or "error"."""
        if cell.get("error"):
            return str(cell["error"]), "error"
        if cell.get("note"):
            prefix = _fmt(cell["value"]) + " " if "value" in cell else ""
            return f"{prefix}({cell['note']})", "note"
        if cell.get("value") is None:
            return "None (no score)", "none"
        return _fmt(cell["value"]), "ok"

    def _header(self, name: str, j: int) -> str:
        if self.weights is not None:
            return f"{name} ×{self.weights[j]:g}"
        return name

    def _summary_lines(self) -> list[str]:
        lines = []
        for name in self.names:
            values = [v for v in self.scores[name] if v is not None]
            mean = f"mean {sum(values) / len(values):.4g} over {len(values)}" if values else "no usable scores"
            lines.append(f"{name}: {mean}" + (f" — {self.errors[name]}" if self.errors.get(name) else ""))
        return lines + [str(line) for line in self.footer]

    # ------------------------------------------------------------------ text

    def text(self) -> str:
        has_prompt = any(s.get("prompt") is not None for s in self.samples)
        has_group = any(s.get("group") is not None for s in self.samples)
        header = ["#"] + (["group"] if has_group else []) + (["prompt"] if has_prompt else []) + ["completion"]
        header += [self._header(n, j) for j, n in enumerate(self.names)] + (["total"] if self.show_total else [])
        rows = []
        totals = self.totals
        for i, sample in enumerate(self.samples):
            row = [str(i)] + ([str(sample.get("group", ""))] if has_group else [])
            if has_prompt:
                row.append(_one_line(sample.get("prompt") or "", 30))
            completion = _one_line(sample.get("completion", ""), MAX_COMPLETION_TEXT)
            if sample.get("truncated"):
                completion += " [cut]"
            row.append(completion)
            for name in self.names:
                text, kind = self._cell_text(self.cells[name][i])
                row.append(("!! " if kind in ("error", "note") else "") + _one_line(text, MAX_CELL_TEXT))
            if self.show_total:
                row.append(_fmt(totals[i]) if totals[i] is not None else "n/a")
            rows.append(row)
        # model output's terminal escapes and bidi overrides (which would reverse the rest of a row) as escapes
        header, rows = [printable(c) for c in header], [[printable(c) for c in r] for r in rows]
        widths = [max(len(r[k]) for r in [header] + rows) for k in range(len(header))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        out = [printable(self.title), line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]
        errors = [(name, i, self.cells[name][i]) for name in self.names for i in range(len(self.samples))
                  if self.cells[name][i].get("error") or self.cells[name][i].get("note")]
        if errors:
            out.append("problems:")
            seen = set()
            for name, i, cell in errors:
                message = cell.get("error") or cell.get("note")
                if (name, message) in seen:
                    continue
                seen.add((name, message))
                where = [k for k in range(len(self.samples))
                         if (self.cells[name][k].get("error") or self.cells[name][k].get("note")) == message]
                out.append(printable(f"  {name}, sample(s) {_ranges(where)}: {message}"))
        out += map(printable, self._summary_lines())
        return "\n".join(out)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return self.text()

    # ------------------------------------------------------------------ HTML

    def html(self) -> str:
        e = html.escape
        has_prompt = any(s.get("prompt") is not None for s in self.samples)
        has_group = any(s.get("group") is not None for s in self.samples)
        th = 'style="border-bottom:1px solid #999;padding:3px 6px;text-align:left"'
        td = 'style="border-bottom:1px solid #ddd;padding:3px 6px;vertical-align:top"'
        colors = {"ok": "", "none": "color:#777;", "note": "color:#b35900;background:#fff4e5;",
                  "error": "color:#b00020;background:#fdecea;"}
        head = "<th {0}>#</th>".format(th)
        head += f"<th {th}>group</th>" if has_group else ""
        head += f"<th {th}>prompt</th>" if has_prompt else ""
        head += f"<th {th}>completion</th>"
        head += "".join(f"<th {th}>{e(self._header(n, j))}</th>" for j, n in enumerate(self.names))
        head += f"<th {th}>total</th>" if self.show_total else ""
        body = []
        totals = self.totals
        previous_group = object()
        for i, sample in enumerate(self.samples):
            cells = [f"<td {td}>{i}</td>"]
            if has_group:
                cells.append(f"<td {td}>{e(str(sample.get('group', '')))}</td>")
            if has_prompt:
                # The prompt is shown once per group (on its first row) to keep the table short.
                group = sample.get("group", i)
                shown = sample.get("prompt") if group != previous_group or not has_group else ""
                previous_group = group
                cells.append(f'<td {td}><div style="max-width:22em;white-space:pre-wrap;font-size:90%">'
                             f"{e(_cut(str(shown or '')))}</div></td>")
            flag = ' <span style="color:#b35900">[cut at max length]</span>' if sample.get("truncated") else ""
            cells.append(f'<td {td}><pre style="white-space:pre-wrap;margin:0;max-width:40em">'
                         f"{e(_cut(str(sample.get('completion', ''))))}</pre>{flag}</td>")
            for name in self.names:
                text, kind = self._cell_text(self.cells[name][i])
                cells.append(f'<td {td[:-1]};{colors[kind]}" class="reward-{kind}">{e(text)}</td>')
            if self.show_total:
                total = totals[i]
                cells.append(f"<td {td}><b>{e(_fmt(total)) if total is not None else 'n/a'}</b></td>")
            body.append("<tr>" + "".join(cells) + "</tr>")
        summary = "".join(f"<li>{e(line)}</li>" for line in self._summary_lines())
        return (f'<div style="font-family:sans-serif;font-size:13px"><b>{e(self.title)}</b>'
                f'<table style="border-collapse:collapse;margin:4px 0"><thead><tr>{head}</tr></thead>'
                f"<tbody>{''.join(body)}</tbody></table><ul style=\"margin:2px 0\">{summary}</ul></div>")

    def _repr_html_(self) -> str:
        return self.html()


def _cut(text: str, limit: int = MAX_COMPLETION_HTML) -> str:
    """`text`'s first `limit` characters, and how many more there were: cut before it is escaped, so that a cut
    never lands inside an escape ("&l")."""
    return text if len(text) <= limit else text[:limit] + f" … [{len(text) - limit} more characters]"


def _ranges(indices) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    parts, start = [], None
    for k, i in enumerate(indices):
        if start is None:
            start = i
        if k + 1 == len(indices) or indices[k + 1] != i + 1:
            parts.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ", ".join(parts)


def reward_table(names, samples, cells, **kwargs) -> RewardTable:
    """Shorthand for `RewardTable(...)`."""
    return RewardTable(names, samples, cells, **kwargs)
