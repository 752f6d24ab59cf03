"""The reward library: ready-made reward functions, and `weighted_reward` to combine them.

Reward functions follow TRL GRPOTrainer's convention, so functions written for TRL work
here unmodified and the other way round. A reward function is called by keyword with

- `prompts`: the N prompts (one per completion, so each repeats num_generations times)
- `completions`: the N completions, each a string (plain-text dataset) or a list of
  messages `[{"role": "assistant", "content": "..."}]` (conversational dataset)
- `completion_ids`: the N completions' token ids
- every other dataset column as a list of N values, e.g. `answer=[...]`
- `trainer_state`: transformers' TrainerState (global_step, max_steps, epoch, ...); outside train()
  one that has not trained (global_step=0, max_steps=0), as TRL's trainer has before training
- `log_extra(column, values)`: adds a column (one value per completion) to the completions table
- `log_metric(name, value)`: logs a number, averaged per step into the record's "metrics"

and returns a list of N floats, or None for a completion it has no opinion on. Accept the
keywords you need and `**kwargs` for the rest. `async def` functions are awaited. Each call gets
its own copies of the lists, so editing them in place changes nothing outside it.

`reward_contract.py` checks that contract (signatures, what comes back) and `reward_calls.py` calls the
functions the one way train(), evaluate() and the prototyping tools do.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal, InvalidOperation, localcontext

from .arguments import refuse, short_repr, shorten
from .reward_calls import add_note, own_copies, resolved
from .reward_contract import check_callable, checked_rewards, completion_text, reward_func_name


def extract_answer(text: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>` in `text`, None if there is none."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end)
    if end == -1 or start == -1:
        return None
    return text[start + len("<answer>") : end].strip()


def answer_texts(completions, prompts=None) -> list[str]:
    """Each completion's text as the answer it is: behind its prompt's assistant prefill (a chat prompt whose last
    message is the assistant's, e.g. "<reasoning>\n", which the model continues), since reward functions get only
    the generated text (as in TRL) and the format rewards below read the answer from its start."""
    texts = [completion_text(c) for c in completions]
    if not isinstance(prompts, (list, tuple)) or len(prompts) != len(texts):
        return texts
    return [prefill(p) + t for p, t in zip(prompts, texts)]


def prefill(prompt) -> str:
    """The assistant prefill a chat prompt ends with ("" when it ends with another role's message, or is text)."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[-1], dict) \
            and prompt[-1].get("role") == "assistant" and isinstance(prompt[-1].get("content"), str):
        return prompt[-1]["content"]
    return ""


CURRENCY_SIGNS = ("$", "€", "£")


def _as_number(text: str) -> Decimal | None:
    """`text` as an exact number ("1,234", " 5.0 ", "$18", "-$5", "18%" included), None if it is not one.

    A money or percent answer is its number: GSM8K writes "$18" where its final answer is 18 (format_gsm8k reads
    "#### $18" as 18), and a hand-made answer column may hold "$18" or "18%". Only one leading currency sign (after
    the number's sign or before it) and one trailing "%" are dropped; "18 dollars", "1/2" and "1 000" stay text."""
    text = text.strip().replace(",", "")
    sign = text[0] if text[:1] in ("+", "-") else ""
    text = text[len(sign):].lstrip()
    text = text[1:] if text[:1] in CURRENCY_SIGNS else text
    text = text[:-1] if text.endswith("%") else text
    try:
        number = Decimal(sign + text.strip())
    except InvalidOperation:
        return None
    return number if number.is_finite() else None


def answers_match(predicted: str, reference: str) -> bool:
    """Equal as numbers when both are numbers ("5" == "5.0" == "$5" == "5%"), else equal as stripped strings."""
    predicted_number, reference_number = _as_number(predicted), _as_number(reference)
    if predicted_number is not None and reference_number is not None:
        return predicted_number == reference_number
    return predicted.strip() == str(reference).strip()


# ----------------------------------------------------------------------------------------
# Reward functions


def check_per_completion(func: str, name: str, values) -> None:
    """`values` holds one entry per completion: a bare string would be read one character at a time."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{func}({name}={shorten(repr(values), 80)}) is invalid: expected a list with one entry per "
                        f"completion, and a bare string would be read one character at a time. Wrap it in a list: "
                        f"{name}=[{shorten(repr(values), 40)}].")


def _check_reference(func: str, reference) -> None:
    """A reference answer is one text or number: a list of aliases (or a dict) would be compared as its text and
    never match, scoring every completion 0 without a word. (train() and evaluate() refuse such a column first.)"""
    if not isinstance(reference, (str, numbers.Number)):
        raise TypeError(f"{func} got the answer {short_repr(reference, 100)}, a {type(reference).__name__}: it "
                        f"compares the completion's answer with one reference answer, a text or a number. Pass one "
                        f"answer per completion, or write a reward function that accepts any of several.")


def correctness_reward(completions, answer, prompts=None, **kwargs) -> list[float]:
    """2.0 if the completion's last <answer>...</answer> equals the reference `answer`, else 0.0.

    When both are numbers they compare as numbers, read as Python's Decimal reads them: "5", "5.0",
    " 5 ", "+5", "5." and "5e0" all match 5 (full-width and other Unicode digits too); thousands
    commas are dropped ("1,234" matches 1234); one leading currency sign ($, €, £) and one
    trailing "%" are dropped from either side ("$18" and "18%" match 18, and a reference "$18"
    matches "18"). Anything else must match the reference exactly after stripping whitespace:
    "1/2" does not match 0.5, "1 000" does not match 1000, "18 dollars" does not match 18.
    """
    check_per_completion("correctness_reward", "completions", completions)
    check_per_completion("correctness_reward", "answer", answer)
    rewards = []
    for text, reference in zip(answer_texts(completions, prompts), answer, strict=True):
        _check_reference("correctness_reward", reference)
        predicted = extract_answer(text)
        rewards.append(2.0 if predicted is not None and answers_match(predicted, str(reference)) else 0.0)
    return rewards


def integer_answer_reward(completions, prompts=None, **kwargs) -> list[float]:
    """0.5 if the last <answer>...</answer> holds an integer ("42", "-3", "+7"), else 0.0."""
    check_per_completion("integer_answer_reward", "completions", completions)
    rewards = []
    for text in answer_texts(completions, prompts):
        predicted = extract_answer(text)
        rewards.append(0.5 if predicted is not None and re.fullmatch(r"[+-]?\d+", predicted) else 0.0)
    return rewards


# The completion is exactly a reasoning block then an answer block, each tag on its own
# line, with at most one newline after </answer>.
_STRICT_FORMAT = re.compile(r"<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n?", re.DOTALL)
# A reasoning block followed by an answer block anywhere, however laid out.
_SOFT_FORMAT = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)


def strict_format_reward(completions, prompts=None, **kwargs) -> list[float]:
    """0.5 if the whole completion is "<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>"
    (one optional trailing newline, nothing before or after), else 0.0."""
    check_per_completion("strict_format_reward", "completions", completions)
    return [0.5 if _STRICT_FORMAT.fullmatch(t) else 0.0 for t in answer_texts(completions, prompts)]


def soft_format_reward(completions, prompts=None, **kwargs) -> list[float]:
    """0.5 if the completion contains <reasoning>...</reasoning> followed by <answer>...</answer>
    (any whitespace, any text around them), else 0.0."""
    check_per_completion("soft_format_reward", "completions", completions)
    return [0.5 if _SOFT_FORMAT.search(t) else 0.0 for t in answer_texts(completions, prompts)]


_XML_TAGS = ("<reasoning>\n", "\n</reasoning>\n", "\n<answer>\n", "\n</answer>")


def xml_count_reward(completions, prompts=None, **kwargs) -> list[float]:
    """Partial credit for the format: 0.125 for each of "<reasoning>\\n", "\\n</reasoning>\\n",
    "\\n<answer>\\n" and "\\n</answer>" that appears exactly once (up to 0.5), minus 0.001
    per character of text after the last </answer> (surrounding whitespace not counted).

    Unlike the all-or-nothing format rewards this one differs between completions that are
    all "wrong", so even a weak model gets a learning signal from it.
    """
    check_per_completion("xml_count_reward", "completions", completions)
    rewards = []
    for text in answer_texts(completions, prompts):
        reward = sum(0.125 for tag in _XML_TAGS if text.count(tag) == 1)
        if "</answer>" in text:
            trailing = text.rsplit("</answer>", 1)[1].strip()
            reward -= 0.001 * len(trailing)
        rewards.append(reward)
    return rewards


def proximity_reward(completions, answer, prompts=None, **kwargs) -> list[float]:
    """Partial credit for numeric answers: 1 / (1 + |predicted - answer| / max(1, |answer|)).

    1.0 for the exact number, 0.5 when off by the answer's size (or by 1 for answers
    below 1), approaching 0 as the number moves away; any number scores above 0.0,
    which is what an answer that is missing or not a number gets. Unlike
    correctness_reward it tells "off by one" from "off by a thousand", a signal a model
    that is never exactly right can still climb.
    """
    check_per_completion("proximity_reward", "completions", completions)
    check_per_completion("proximity_reward", "answer", answer)
    rewards = []
    for text, reference in zip(answer_texts(completions, prompts), answer, strict=True):
        _check_reference("proximity_reward", reference)
        predicted = extract_answer(text)
        predicted_number = None if predicted is None else _as_number(predicted)
        reference_number = _as_number(str(reference))
        if reference_number is None:
            raise ValueError(
                f"proximity_reward needs numeric answers, got answer={reference!r}; "
                "use correctness_reward for answers that are not numbers"
            )
        if predicted_number is None:
            rewards.append(0.0)
            continue
        # The model writes the number, "1e1000000" included: in a context of its own, with no traps and the widest
        # exponents, such a distance is exact or infinite (scoring 0.0), never a decimal.Overflow that stops the run.
        with localcontext(Context(prec=28, Emax=MAX_EMAX, Emin=MIN_EMIN, traps=[])):
            distance = abs(predicted_number - reference_number) / max(Decimal(1), abs(reference_number))
            rewards.append(float(1 / (1 + distance)))
    return rewards


def overlong_penalty(max_completion_length: int, buffer: int | None = None):
    """A reward function penalising completions that run into the length limit.

    0.0 up to `max_completion_length - buffer` tokens, then falling linearly to -1.0 at
    `max_completion_length` (a completion cut off there usually never reached its
    answer). `buffer` defaults to a quarter of the limit. Lengths are counted in tokens
    from `completion_ids`. This is DAPO's "soft overlong punishment"; give it the same
    max_completion_length as train().
    """
    if not isinstance(max_completion_length, int) or max_completion_length < 1:
        raise ValueError(f"max_completion_length must be a positive int, got {max_completion_length!r}")
    buffer = max(1, max_completion_length // 4) if buffer is None else buffer
    if not isinstance(buffer, int) or not 1 <= buffer <= max_completion_length:
        raise ValueError(f"buffer must be an int in [1, max_completion_length={max_completion_length}], got {buffer!r}")
    free = max_completion_length - buffer

    def overlong_penalty(completion_ids, **kwargs) -> list[float]:
        check_per_completion("overlong_penalty", "completion_ids", completion_ids)
        return [max(-1.0, min(0.0, (free - len(ids)) / buffer)) for ids in completion_ids]

    overlong_penalty.__doc__ = (
        f"0.0 up to {free} completion tokens, falling linearly to -1.0 at {max_completion_length} and beyond."
    )
    return overlong_penalty


def weighted_reward(reward_funcs, weights, *, name: str | None = None):
    """One reward function that returns the weighted sum of several.

    For completions where some functions return None, the others still count; a
    completion every function returns None for gets None. To keep each function's curve
    in the dashboard, pass the functions to train() with `reward_weights=` instead:
    this is for when a single combined function is what you need (e.g. inside another
    reward, or a library taking one function).
    """
    for arg, value in (("reward_funcs", reward_funcs), ("weights", weights)):
        if not isinstance(value, (list, tuple)):
            shown = f"<dict of {len(value)}>" if isinstance(value, dict) else shorten(repr(value), 80)
            raise TypeError(f"weighted_reward({arg}={shown}) is invalid: expected a list, one entry per function: "
                            f"pass the functions and their weights as two lists in the same order, e.g. "
                            f"weighted_reward([correctness_reward, xml_count_reward], [1.0, 0.5]) "
                            f"(one function: weighted_reward([f], [w])).")
    if name is not None and not isinstance(name, str):  # the name keys the records and the trackers' tags
        refuse("weighted_reward", "name", name, "a string, or None for one made of the functions' names", TypeError)
    reward_funcs = list(reward_funcs)
    for func in reward_funcs:
        if not callable(func):
            raise TypeError(f"weighted_reward(reward_funcs=[..., {shorten(repr(func), 80)}, ...]) is invalid: "
                            f"expected reward functions f(completions, **kwargs) -> list[float].")
        check_callable(func)  # a loaded reward model is callable, but not with these keywords
    try:
        weights = [float(w) for w in weights]
    except (TypeError, ValueError):
        raise TypeError(f"weighted_reward(weights={shorten(repr(weights), 80)}) is invalid: expected numbers, "
                        f"one per reward function.") from None
    if not reward_funcs or len(weights) != len(reward_funcs):
        raise ValueError(
            f"weighted_reward needs one weight per reward function: got {len(reward_funcs)} functions "
            f"and {len(weights)} weights"
        )
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"weights must be finite numbers, got {weights}")

    def combined(completions, **kwargs) -> list[float | None]:
        totals: list[float | None] = [None] * len(completions)
        for func, weight in zip(reward_funcs, weights):
            try:  # each function its own copies, as call_reward_funcs gives them
                values = resolved(func(**accepted_keywords(func, own_copies({"completions": completions, **kwargs}))))
            except Exception as err:
                add_note(err, f"raised by {reward_func_name(func)!r}, weight {weight:g}, inside weighted_reward")
                raise
            values = checked_rewards(func, values, completions)
            for i, value in enumerate(values):
                if not math.isnan(value):
                    totals[i] = (totals[i] or 0.0) + weight * value
        return totals

    # train() checks a reward function's signature against the dataset's columns before the first
    # rollout: show it the arguments the wrapped functions need, not just **kwargs.
    combined.__signature__ = inspect.Signature(
        [inspect.Parameter("completions", inspect.Parameter.KEYWORD_ONLY)]
        + [inspect.Parameter(arg, inspect.Parameter.KEYWORD_ONLY) for arg in needed_arguments(reward_funcs)
           if arg != "completions"]
        + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    combined.__name__ = name or "+".join(
        f"{w:g}*{reward_func_name(f)}" for f, w in zip(reward_funcs, weights)
    )
    combined.__doc__ = "Weighted sum: " + ", ".join(
        f"{w:g} x {reward_func_name(f)}" for f, w in zip(reward_funcs, weights)
    )
    return combined


def accepted_keywords(func, keywords: dict) -> dict:
    """The `keywords` that `func` accepts: all of them when it takes **kwargs (or its signature cannot be read),
    else only those it names. A function written without **kwargs still works inside weighted_reward."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return keywords
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return keywords
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {key: value for key, value in keywords.items() if key in names}


def needed_arguments(reward_funcs) -> list[str]:
    """The keyword arguments without a default that any of `reward_funcs` needs, in first-seen order."""
    needed = []
    for func in reward_funcs:
        try:
            params = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):  # builtins and some C callables: nothing to read
            continue
        needed += [p.name for p in params if p.default is p.empty and p.name not in needed
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return needed


# The GSM8K set: format first (a small model gets a signal from it at once), then integer
# answers, then being right (worth the most).
STARTER_REWARDS = [
    xml_count_reward,
    soft_format_reward,
    strict_format_reward,
    integer_answer_reward,
    correctness_reward,
]
