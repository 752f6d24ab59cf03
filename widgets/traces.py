"""Sample reasoning traces: the completions a step produced, with their scores.

Reads `record["samples"]`: dicts with prompt, completion, rewards (per function), reward,
advantage and any dataset column such as `answer`. The `<reasoning>` and `<answer>` parts of
a completion are set apart, and when the sample has an `answer` the completion is marked
right or wrong against it. Completions are model output: everything is HTML-escaped.

The styles are inline (a notebook's saved output keeps no stylesheet), and the structure
(labels in bold, text in <pre>) stays readable where a renderer strips them.
"""

from __future__ import annotations

import html
import math
import re
from decimal import Decimal, InvalidOperation

from .figures import HTML, printable

# An unclosed tag runs to the next opening tag or to the end: a completion cut at
# max_completion_length is still shown.
_TAGGED = re.compile(r"<(reasoning|answer)>(.*?)(?:</\1>|(?=<(?:reasoning|answer)>)|$)", re.DOTALL)
_PART_STYLE = {
    "reasoning": "background:#eef4fb;border-left:3px solid #4c72b0",
    "answer": "background:#eef8ee;border-left:3px solid #55a868",
    "text": "background:#f6f6f6;border-left:3px solid #bbbbbb",
    "prefill": "background:#ffffff;border-left:3px dashed #999999;color:#555555",
    "call": "background:#fdf3e6;border-left:3px solid #dd8452",
    "result": "background:#ffffff;border-left:3px dashed #dd8452;color:#555555",
}
_PART_LABEL = {"reasoning": "reasoning", "answer": "answer", "text": "outside the tags",
               "prefill": "prefill (written in the prompt, not generated)", "call": "tool call",
               "result": "tool result (read by the model, not generated)"}


def completion_text(completion) -> str:
    """A completion as text: a string, or chat messages as TRL logs them."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, (list, tuple)):
        return "".join(completion_text(m) for m in completion)
    return "" if completion is None else str(completion)


def split_completion(text: str, skip: int = 0) -> list[tuple[str, str]]:
    """The completion as (kind, text) parts in order; kind is "reasoning", "answer" or "text".

    `skip`: the first characters are a prefill (the answer's start, written in the prompt): they place the
    tags (a prefill "<reasoning>\\n" opens the reasoning) but are not shown again in the parts."""
    def shown(start, end):
        return text[max(start, skip):end].strip()

    parts, pos = [], 0
    for match in _TAGGED.finditer(text):
        if shown(pos, match.start()):
            parts.append(("text", shown(pos, match.start())))
        if match.end() > skip:
            parts.append((match.group(1), shown(match.start(2), match.end(2))))
        pos = match.end()
    if shown(pos, len(text)):
        parts.append(("text", shown(pos, len(text))))
    return parts


# These two mirror grpo_nb.rewards.extract_answer / answers_match (same rule as the correctness
# reward), copied rather than imported so the widgets stay independent of grpo_nb.
def extract_answer(text: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>`, None if there is none."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end)
    if end == -1 or start == -1:
        return None
    return text[start + len("<answer>"): end].strip()


def _as_number(text) -> Decimal | None:
    """grpo_nb.rewards._as_number's rule (the widgets import nothing from grpo_nb; tests/test_widgets.py holds the
    two together): thousands commas, one leading currency sign and one trailing "%" dropped."""
    text = str(text).strip().replace(",", "")
    sign = text[0] if text[:1] in ("+", "-") else ""
    text = text[len(sign):].lstrip()
    text = text[1:] if text[:1] in ("$", "€", "£") else text
    text = text[:-1] if text.endswith("%") else text
    try:
        number = Decimal(sign + text.strip())
    except InvalidOperation:
        return None
    return number if number.is_finite() else None


def answers_match(predicted: str, reference) -> bool:
    """Equal as numbers when both are numbers ("5" == "5.0"), else equal as stripped strings."""
    a, b = _as_number(predicted), _as_number(reference)
    if a is not None and b is not None:
        return a == b
    return predicted.strip() == str(reference).strip()


def verdict(sample: dict) -> bool | None:
    """True/False against the sample's `answer` column; None when it has none, or holds no one answer (a list
    of aliases would never equal the completion's answer: "wrong" would be a guess)."""
    reference = sample.get("answer")
    if not isinstance(reference, (str, int, float)):
        return None
    # behind the prompt's assistant prefill, as grpo_nb's rewards read the answer (rewards.answer_texts)
    prefill = sample.get("prefill") if isinstance(sample.get("prefill"), str) else ""
    predicted = extract_answer(prefill + completion_text(sample.get("completion")))
    return predicted is not None and answers_match(predicted, reference)


def select_record(history, step: int = -1) -> dict | None:
    """The record to show: `step` is a record's "step" number; negative counts back from the latest.

    `history` may also be one record. None when there is no such step.
    """
    if isinstance(history, dict):
        return history
    records = [r for r in history or [] if isinstance(r, dict)]
    if not records:
        return None
    if step < 0:
        return records[step] if -step <= len(records) else None
    return next((r for r in records if r.get("step") == step), None)


def _fmt(value, signed=False) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "—"
    try:
        value = float(value)
    except OverflowError:  # an int past float's range (a hand-edited record)
        value = math.inf if value > 0 else -math.inf
    if math.isnan(value):
        return "—"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def _samples(record: dict) -> list[dict]:
    """A record's samples that are dicts (a hand-edited record's "samples" of another kind: none)."""
    samples = record.get("samples")
    return [s for s in samples if isinstance(s, dict)] if isinstance(samples, (list, tuple)) else []


def _scores(sample: dict) -> dict:
    """A sample's per-function rewards (a dict; anything else in a hand-edited record: none)."""
    rewards = sample.get("rewards")
    return rewards if isinstance(rewards, dict) else {}


def _parts(sample: dict) -> tuple[str, list[tuple[str, str]]]:
    """(the sample's prefill or "", its completion's parts): with a prefill (the start of the answer, written in the
    prompt's last assistant message), the tags are read from the prefill and the completion together, so the
    completion's text lands in the part the prefill opened."""
    prefill = completion_text(sample.get("prefill"))
    return prefill.strip(), split_completion(prefill + completion_text(sample.get("completion")), skip=len(prefill))


def _turn_parts(turns) -> list[tuple[str, str]]:
    """An episode's messages (sample["turns"]: the model's turns, the tool calls it made, the results it read) as
    (kind, text) parts in order; anything that is not a message is shown as its text."""
    import json

    parts = []
    for message in turns if isinstance(turns, (list, tuple)) else [turns]:
        if not isinstance(message, dict):
            parts.append(("text", str(message)))
        elif message.get("role") == "assistant":
            parts += split_completion(completion_text(message))
            for call in message.get("tool_calls") or []:
                f = call.get("function", call) if isinstance(call, dict) else {}
                try:
                    arguments = json.dumps(f.get("arguments"), ensure_ascii=False)
                except (TypeError, ValueError):
                    arguments = str(f.get("arguments"))
                parts.append(("call", f"{f.get('name')}({arguments})"))
        else:
            parts.append(("result", f"{message.get('name') or message.get('role')}: {completion_text(message)}"))
    return parts


def _one_value(value, limit: int = 80) -> str:
    """A logged value on one short line."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _available(history) -> str:
    steps = [r.get("step") for r in history or [] if isinstance(r, dict) and r.get("samples")] \
        if isinstance(history, list) else []
    return f" (steps with samples: {steps[0]}–{steps[-1]})" if steps else ""


# --------------------------------------------------------------------------------------
# HTML


def traces_html(history, step: int = -1, *, max_samples: int | None = None) -> HTML:
    """The samples of one step as HTML (latest by default; see `select_record` for `step`)."""
    record = select_record(history, step)
    if record is None:
        return HTML(f"<div><i>No step {step} in this history{html.escape(_available(history))}.</i></div>")
    samples = _samples(record)
    title = f"Sample completions, step {html.escape(str(record.get('step', '?')))}"
    if not samples:
        return HTML(f"<div><b>{title}</b><br><i>No samples in this record (they are logged with "
                    f"log_completions=True and num_completions_to_print &gt; 0).</i></div>")
    if max_samples is not None:
        samples = samples[:max_samples]
    verdicts = [verdict(s) for s in samples]
    judged = [v for v in verdicts if v is not None]
    score = f" · {sum(judged)}/{len(judged)} right" if judged else ""
    cards = "\n".join(_sample_html(i, s, v) for i, (s, v) in enumerate(zip(samples, verdicts), 1))
    return HTML(f'<div style="font-family:sans-serif;font-size:13px">'
                f"<b>{title}</b>{score}{html.escape(_available(history))}\n{cards}</div>")


def _sample_html(index: int, sample: dict, right: bool | None) -> str:
    esc = html.escape
    if right is None:
        mark = ""
    elif right:
        mark = '<span style="color:#2ca02c;font-weight:bold">✓ right</span>'
    else:
        mark = '<span style="color:#d62728;font-weight:bold">✗ wrong</span>'
    if right is not None:
        mark += f" (answer: <code>{esc(str(sample['answer']))}</code>)"
    head = (f"<b>#{index}</b> &nbsp; reward <b>{_fmt(sample.get('reward'))}</b> &nbsp; "
            f"advantage {_fmt(sample.get('advantage'), signed=True)} &nbsp; {mark}")
    scores = " ".join(
        f'<span style="background:#eeeeee;border-radius:3px;padding:0 4px;margin-right:4px">'
        f"{esc(str(name))}: <b>{_fmt(value)}</b></span>"
        for name, value in _scores(sample).items())
    scores += "".join(  # the columns reward functions added with log_extra
        f'<span style="border:1px solid #dddddd;border-radius:3px;padding:0 4px;margin-right:4px">'
        f"{esc(str(name))}: {esc(_one_value(value))}</span>" for name, value in (sample.get("extra") or {}).items())
    prompt = completion_text(sample.get("prompt"))
    prefill, parts = _parts(sample)
    if sample.get("turns"):  # an episode with tools: each turn, call and result apart
        parts = _turn_parts(sample["turns"])
    parts = [("prefill", prefill)] * bool(prefill) + (parts or [("text", "(empty completion)")])
    blocks = "".join(
        f'<div style="{_PART_STYLE[kind]};padding:3px 6px;margin:3px 0" data-part="{kind}">'
        f'<b style="font-size:11px;color:#555">{_PART_LABEL[kind]}</b>'
        f'<pre style="white-space:pre-wrap;margin:0;font-size:12px">{esc(text)}</pre></div>'
        for kind, text in parts)
    return (f'<div style="border:1px solid #dddddd;border-radius:4px;padding:6px;margin:6px 0">'
            f"<div>{head}</div><div>{scores}</div>"
            f'<details><summary style="font-size:11px;color:#555">prompt</summary>'
            f'<pre style="white-space:pre-wrap;font-size:11px">{esc(prompt)}</pre></details>'
            f"{blocks}</div>")


# --------------------------------------------------------------------------------------
# Plain text, for terminals


def traces_text(history, step: int = -1, *, max_samples: int | None = None, max_chars: int = 800) -> str:
    """The same view as `traces_html` as plain text; long parts are cut to `max_chars`."""
    record = select_record(history, step)
    if record is None:
        return f"No step {step} in this history{_available(history)}."
    samples = _samples(record)
    lines = [f"Sample completions, step {record.get('step', '?')}"]
    if not samples:
        return lines[0] + ": no samples in this record (log_completions=True, num_completions_to_print > 0)."
    for i, sample in enumerate(samples[:max_samples] if max_samples else samples, 1):
        right = verdict(sample)
        mark = "" if right is None else f" | {'RIGHT' if right else 'WRONG'} (answer {sample['answer']})"
        lines.append(f"--- #{i} | reward {_fmt(sample.get('reward'))} | "
                     f"advantage {_fmt(sample.get('advantage'), signed=True)}{mark}")
        scores = ", ".join(f"{n} {_fmt(v)}" for n, v in _scores(sample).items())
        if scores:
            lines.append(f"    scores: {scores}")
        extra = ", ".join(f"{n} {_one_value(v)}" for n, v in (sample.get("extra") or {}).items())
        if extra:
            lines.append(f"    logged: {extra}")
        prefill, parts = _parts(sample)
        if sample.get("turns"):
            parts = _turn_parts(sample["turns"])
        for kind, text in [("prefill", prefill)] * bool(prefill) + (parts or [("text", "(empty)")]):
            text = text if len(text) <= max_chars else text[:max_chars] + " [...]"
            lines.append(f"    [{_PART_LABEL[kind]}] " + text.replace("\n", "\n      "))
    return printable("\n".join(lines))  # model output's terminal escapes and bidi overrides as escapes
