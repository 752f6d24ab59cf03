"""Reward functions, and the machinery that calls them and checks what they return.

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
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import math
import numbers
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal, InvalidOperation, localcontext

import numpy as np
import torch
from transformers import TrainerState

from .arguments import refuse


def completion_text(completion) -> str:
    """The text of one completion, whether a plain string or a list of chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return completion.get("content") or ""
    if isinstance(completion, (list, tuple)):
        return "".join(completion_text(message) for message in completion)
    raise TypeError(
        f"a completion must be a string or a list of messages like "
        f"[{{'role': 'assistant', 'content': '...'}}], got {type(completion).__name__}: {completion!r:.200}"
    )


def extract_answer(text: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>` in `text`, None if there is none."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end)
    if end == -1 or start == -1:
        return None
    return text[start + len("<answer>") : end].strip()


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
        raise TypeError(f"{func}({name}={_shorten(repr(values), 80)}) is invalid: expected a list with one entry per "
                        f"completion, and a bare string would be read one character at a time. Wrap it in a list: "
                        f"{name}=[{_shorten(repr(values), 40)}].")


def _check_reference(func: str, reference) -> None:
    """A reference answer is one text or number: a list of aliases (or a dict) would be compared as its text and
    never match, scoring every completion 0 without a word. (train() and evaluate() refuse such a column first.)"""
    if not isinstance(reference, (str, numbers.Number)):
        raise TypeError(f"{func} got the answer {_repr(reference, 100)}, a {type(reference).__name__}: it compares "
                        f"the completion's answer with one reference answer, a text or a number. Pass one answer per "
                        f"completion, or write a reward function that accepts any of several.")


def correctness_reward(completions, answer, **kwargs) -> list[float]:
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
    for completion, reference in zip(completions, answer, strict=True):
        _check_reference("correctness_reward", reference)
        predicted = extract_answer(completion_text(completion))
        rewards.append(2.0 if predicted is not None and answers_match(predicted, str(reference)) else 0.0)
    return rewards


def integer_answer_reward(completions, **kwargs) -> list[float]:
    """0.5 if the last <answer>...</answer> holds an integer ("42", "-3", "+7"), else 0.0."""
    check_per_completion("integer_answer_reward", "completions", completions)
    rewards = []
    for completion in completions:
        predicted = extract_answer(completion_text(completion))
        rewards.append(0.5 if predicted is not None and re.fullmatch(r"[+-]?\d+", predicted) else 0.0)
    return rewards


# The completion is exactly a reasoning block then an answer block, each tag on its own
# line, with at most one newline after </answer>.
_STRICT_FORMAT = re.compile(r"<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n?", re.DOTALL)
# A reasoning block followed by an answer block anywhere, however laid out.
_SOFT_FORMAT = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)


def strict_format_reward(completions, **kwargs) -> list[float]:
    """0.5 if the whole completion is "<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>"
    (one optional trailing newline, nothing before or after), else 0.0."""
    check_per_completion("strict_format_reward", "completions", completions)
    return [0.5 if _STRICT_FORMAT.fullmatch(completion_text(c)) else 0.0 for c in completions]


def soft_format_reward(completions, **kwargs) -> list[float]:
    """0.5 if the completion contains <reasoning>...</reasoning> followed by <answer>...</answer>
    (any whitespace, any text around them), else 0.0."""
    check_per_completion("soft_format_reward", "completions", completions)
    return [0.5 if _SOFT_FORMAT.search(completion_text(c)) else 0.0 for c in completions]


_XML_TAGS = ("<reasoning>\n", "\n</reasoning>\n", "\n<answer>\n", "\n</answer>")


def xml_count_reward(completions, **kwargs) -> list[float]:
    """Partial credit for the format: 0.125 for each of "<reasoning>\\n", "\\n</reasoning>\\n",
    "\\n<answer>\\n" and "\\n</answer>" that appears exactly once (up to 0.5), minus 0.001
    per character of text after the last </answer> (surrounding whitespace not counted).

    Unlike the all-or-nothing format rewards this one differs between completions that are
    all "wrong", so even a weak model gets a learning signal from it.
    """
    check_per_completion("xml_count_reward", "completions", completions)
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        reward = sum(0.125 for tag in _XML_TAGS if text.count(tag) == 1)
        if "</answer>" in text:
            trailing = text.rsplit("</answer>", 1)[1].strip()
            reward -= 0.001 * len(trailing)
        rewards.append(reward)
    return rewards


def proximity_reward(completions, answer, **kwargs) -> list[float]:
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
    for completion, reference in zip(completions, answer, strict=True):
        _check_reference("proximity_reward", reference)
        predicted = extract_answer(completion_text(completion))
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
            shown = f"<dict of {len(value)}>" if isinstance(value, dict) else _shorten(repr(value), 80)
            raise TypeError(f"weighted_reward({arg}={shown}) is invalid: expected a list, one entry per function: "
                            f"pass the functions and their weights as two lists in the same order, e.g. "
                            f"weighted_reward([correctness_reward, xml_count_reward], [1.0, 0.5]) "
                            f"(one function: weighted_reward([f], [w])).")
    if name is not None and not isinstance(name, str):  # the name keys the records and the trackers' tags
        refuse("weighted_reward", "name", name, "a string, or None for one made of the functions' names", TypeError)
    reward_funcs = list(reward_funcs)
    for func in reward_funcs:
        if not callable(func):
            raise TypeError(f"weighted_reward(reward_funcs=[..., {_shorten(repr(func), 80)}, ...]) is invalid: "
                            f"expected reward functions f(completions, **kwargs) -> list[float].")
        check_callable(func)  # a loaded reward model is callable, but not with these keywords
    try:
        weights = [float(w) for w in weights]
    except (TypeError, ValueError):
        raise TypeError(f"weighted_reward(weights={_shorten(repr(weights), 80)}) is invalid: expected numbers, "
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
                _add_note(err, f"raised by {reward_func_name(func)!r}, weight {weight:g}, inside weighted_reward")
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


# ----------------------------------------------------------------------------------------
# Calling reward functions


class RewardFunctionError(ValueError):
    """A reward function failed or returned something that is not one reward per completion."""


class LoggingError(RewardFunctionError):
    """A reward function called log_extra / log_metric the wrong way."""


def reward_func_name(func) -> str:
    """A name to show for a reward function: its `__name__` when that is text, else its class name. Always a str:
    the name keys the records, the trackers' tags and the checkpoint's history."""
    if isinstance(func, functools.partial):
        return f"partial({reward_func_name(func.func)})"
    name = getattr(func, "__name__", None)
    return name if isinstance(name, str) and name else type(func).__name__


def reward_func_names(reward_funcs) -> list[str]:
    """`reward_func_name` of each function, made distinct: a second function with the same name (two
    lambdas, one function passed twice) becomes 'name#2', so records and tables keep each one's scores."""
    names = []
    for func in reward_funcs:
        base = name = reward_func_name(func)
        copy = 1
        while name in names:
            copy += 1
            name = f"{base}#{copy}"
        names.append(name)
    return names


def _shorten(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters]"


def _describe_completion(completion) -> str:
    try:
        return repr(_shorten(completion_text(completion)))
    except TypeError:
        return _shorten(repr(completion))


def _accepts(func, keywords) -> bool:
    """Whether `func` can be called with these keyword arguments (True when it cannot be told)."""
    try:
        inspect.signature(func).bind(**{key: None for key in keywords})
    except TypeError:
        return False
    except ValueError:  # some builtins have no signature to inspect
        return True
    return True


REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def reward_columns(columns) -> list[str]:
    """The dataset columns handed to reward functions as keywords: all but the prompt and a stored
    'completion' (TRL's prompt-completion datasets have one; as in TRL, reward functions get the generated
    completions instead, as `completions`). A 'completion_ids' column is handed on, to be refused as a clash
    (check_no_clashes): TRL replaces it with the generated ids without a word."""
    return [c for c in columns if c not in ("prompt", "completion")]


def check_no_clashes(keywords) -> None:
    """Columns handed to reward functions as keywords must not shadow the functions' own arguments."""
    clashes = sorted(set(REWARD_ARGUMENTS) & set(keywords))
    if clashes:
        raise ValueError(f"Columns {clashes} clash with the reward functions' own arguments: rename them, "
                         f"e.g. dataset.rename_column('{clashes[0]}', 'my_{clashes[0]}').")


def check_callable(func) -> None:
    """A reward function is something to call: not a name, not a loaded reward model (which TRL runs itself)."""
    if isinstance(func, torch.nn.Module):
        raise TypeError(
            f"Reward function <{type(func).__name__}> is a loaded model, not a reward function: grpo-nb calls "
            f"functions f(prompts, completions, **kwargs) -> list[float] and does not run reward models itself "
            f"(TRL's reward_funcs=[model] does). Wrap the model in a function, e.g.\n"
            f"def rm_reward(prompts, completions, **kwargs):\n"
            f"    inputs = rm_tokenizer([p + c for p, c in zip(prompts, completions)], return_tensors='pt', "
            f"padding=True)\n"
            f"    with torch.no_grad():\n"
            f"        return rm(**inputs.to(rm.device)).logits[:, 0].tolist()\n"
            f"(for chat prompts, join the messages with rm_tokenizer.apply_chat_template(p + c, tokenize=False)).")
    if not callable(func):
        raise ValueError(f"Reward function {func!r} is not callable. Pass functions "
                         f"f(prompts, completions, **kwargs) -> list[float].")
    if isinstance(func, type):  # calling the class would make an object, not rewards
        name = reward_func_name(func)
        raise TypeError(f"Reward function {name!r} is a class, not a reward function: pass an instance, "
                        f"reward_funcs=[{name}()] (with its constructor's arguments, if it takes any), whose "
                        f"__call__(completions, **kwargs) returns the rewards.")


def check_reward_funcs(reward_funcs, columns, reward_weights=None) -> None:
    """Fail before any generation when a reward function cannot be called the way train() will.

    train() calls each function by keyword with `REWARD_ARGUMENTS` and every dataset column
    but `prompt` (and a stored `completion`, as TRL does); a function that needs an argument no column
    provides (a renamed `answer` column, say) or that accepts neither a keyword it will get nor **kwargs would otherwise
    only fail after the first rollout.
    """
    if not reward_funcs:
        raise ValueError("train() needs at least one reward function, e.g. reward_funcs=[correctness_reward].")
    if len(reward_funcs) == 1 and isinstance(reward_funcs[0], (dict, set, frozenset)):
        raise TypeError(f"reward_funcs={_shorten(repr(reward_funcs[0]), 120)} is a {type(reward_funcs[0]).__name__}: "
                        f"pass a list of functions, e.g. [correctness_reward, xml_count_reward] (a list keeps their "
                        f"order, which reward_weights follows; for weights per function use reward_weights=[...]).")
    check_no_clashes(reward_columns(columns))
    passed = [*REWARD_ARGUMENTS, *reward_columns(columns)]
    for func in reward_funcs:
        check_callable(func)
        try:
            params = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):  # builtins and some C callables: nothing to check
            continue
        name = reward_func_name(func)
        missing = [p.name for p in params if p.default is p.empty and p.name not in passed
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
        if positional_only:
            raise ValueError(f"Reward function {name!r} takes {positional_only} positionally only, but reward "
                             f"functions are called by keyword: drop the '/' from its signature.")
        if "completion" in missing and "completion" in columns:
            raise ValueError(
                f"Reward function {name!r} needs the argument 'completion', and the dataset has a 'completion' "
                f"column, but that column is not passed to reward functions (as in TRL): they get the generated "
                f"completions as 'completions'. To give them the dataset's column (a reference completion), rename "
                f"it, e.g. dataset = dataset.rename_column('completion', 'reference'), and name that argument "
                f"'reference'.")
        if missing:
            raise ValueError(
                f"Reward function {name!r} needs argument(s) {missing} that train() does not pass. "
                f"It is called by keyword with {', '.join(passed)} (the dataset's columns besides 'prompt'). "
                f"Rename a dataset column to match (e.g. dataset.rename_column('solution', 'answer')), "
                f"or give the argument a default.")
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            accepted = {p.name for p in params}
            unwanted = [k for k in passed if k not in accepted]
            if unwanted:
                raise ValueError(
                    f"Reward function {name!r} does not accept the keyword(s) {unwanted} that train() passes to "
                    f"every reward function. Add **kwargs to its signature: def {name}(completions, ..., **kwargs).")
    if reward_weights is not None and len(reward_weights) != len(reward_funcs):
        raise ValueError(
            f"reward_weights has {len(reward_weights)} values but there are {len(reward_funcs)} reward "
            f"functions ({', '.join(reward_func_name(f) for f in reward_funcs)}): give one weight per function.")


HOW_TO_RETURN = "Return a list of floats (or None for 'no score'), one reward per completion."


@dataclass
class RewardCall:
    """One reward function's answer for a batch of completions, checked against the contract.

    `rewards` has one float per completion (NaN for None, 'no score', and for a value that breaks
    the contract). Per completion, `values` holds what the function returned for it, `notes` what
    is wrong with that value and `errors` the exception its own call raised; `problem` is a
    failure of the whole call (it raised, or returned the wrong count or type). `message` is the
    first failure written out in full, as strict mode raises it.
    """
    name: str
    rewards: list[float]
    values: list
    notes: list
    errors: list
    problem: str | None = None
    message: str | None = None

    def cells(self) -> list[dict]:
        """One display cell per completion (the widgets' RewardTable shows them)."""
        out = []
        for value, note, error in zip(self.values, self.notes, self.errors):
            if error is not None:
                out.append({"error": error})
            elif note is not None:
                out.append({"note": note} if self.problem else {"value": value, "note": note})
            else:
                out.append({"value": value})
        return out


def _error_text(err: BaseException) -> str:
    """The exception's type and message, with its notes (weighted_reward notes which of its functions raised)."""
    return f"{type(err).__name__}: {err}" + "".join(f" ({note})" for note in getattr(err, "__notes__", ()))


def _checked(name: str, values, completions) -> RewardCall:
    """`values` (a function's output for `completions`) checked: one number or None per completion."""
    n = len(completions)
    problem = message = None
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        if values.dim() != 1:
            problem = f"returned a tensor of shape {tuple(values.shape)}, not ({n},)"
            message = (f"reward function {name!r} returned a tensor of shape {tuple(values.shape)}, "
                       f"expected shape ({n},). {HOW_TO_RETURN}")
        values = values.tolist()
    elif isinstance(values, np.ndarray):
        if values.ndim != 1:
            problem = f"returned an array of shape {values.shape}, not ({n},)"
            message = (f"reward function {name!r} returned an array of shape {values.shape}, "
                       f"expected shape ({n},). {HOW_TO_RETURN}")
        values = values.tolist()
    elif not isinstance(values, (list, tuple)):
        problem = f"returned {type(values).__name__}, not a list of {n} floats"
        message = (f"reward function {name!r} returned {type(values).__name__} {_repr(values)}. "
                   f"{HOW_TO_RETURN}")
    if problem is None:
        try:  # the values actually there: a list whose len() disagrees with its items is counted by its items
            values = list(values)
        except Exception as err:
            problem = f"returned a {type(values).__name__} whose values cannot be read ({_error_text(err)})"
            message = f"reward function {name!r} {problem}. {HOW_TO_RETURN}"
    if problem is None and len(values) != n:
        problem = f"returned {len(values)} values for {n} completions"
        message = f"reward function {name!r} {problem}: expected {n}, got {len(values)}. {HOW_TO_RETURN}"
    if problem is not None:
        return RewardCall(name, [math.nan] * n, [None] * n, [problem] * n, [None] * n, problem, message)

    call = RewardCall(name, [], [], [], [None] * n)
    for i, value in enumerate(values):
        reward, shown, note, why = _read_reward(value, i)
        if note is not None and call.message is None:
            call.message = (f"reward function {name!r} returned {why}\n"
                            f"Completion {i}: {_describe_completion(completions[i])}")
        call.rewards.append(reward)
        call.values.append(shown)
        call.notes.append(note)
    return call


_FLOAT32 = "Rewards are stored as float32 (as in TRL), so they must lie within +-3.4e38; scale them down."


def _read_reward(value, i: int):
    """One value a reward function returned, read as a number once: the number checked is the number stored (a
    value whose float() changes from one read to the next cannot pass as finite and then be stored as inf).
    (reward, value to show, note, why): the reward is NaN for None ("no score") and for a value that breaks the
    contract, with a short note and `why`, the message's end after "reward function 'f' returned". Anything
    float() reads is a number, as for torch.tensor in TRL (a Decimal, a sympy expression), but text and
    complex numbers are not."""
    number = None
    try:
        value = _plain(value)
        if value is None:
            return math.nan, None, None, None
        if isinstance(value, (str, bytes, complex)) or not (isinstance(value, numbers.Real)
                                                          or hasattr(type(value), "__float__")):
            return (math.nan, value, f"not a number: {type(value).__name__}",
                    f"{_repr(value)} ({type(value).__name__}) at index {i}, which is not a number. {HOW_TO_RETURN}")
        number = float(value)
    except OverflowError:  # an int or a Fraction beyond any float
        pass
    except Exception as err:  # a signalling NaN, a __float__ that raises, a sympy expression with free symbols
        return (math.nan, value, f"cannot be read as a number ({type(err).__name__})",
                f"{_repr(value)} ({type(value).__name__}) at index {i}, which cannot be read as a number "
                f"({_error_text(err)}). {HOW_TO_RETURN}")
    if number is None or math.isinf(number) and not isinstance(value, float) and not _infinite(value):
        sign = _sign(value) if number is None else number
        shown = _huge(value) if number is None else f"{_repr(value)} ({type(value).__name__})"  # e.g. Decimal 1e400
        return (math.nan, math.copysign(math.inf, sign),  # shown as inf: the number itself has no short form
                "too big for a float", f"{shown} at index {i}, too big for a float. {_FLOAT32}")
    if not math.isfinite(number):
        return (math.nan, number, "not finite; return None for 'no score'",
                f"{_number_text(value, number)} at index {i}. Rewards must be finite; return None to give a "
                f"completion no score.")
    if not _fits_float32(number):
        return (math.nan, number, "overflows float32 (|r| > 3.4e38)",
                f"{number:g} at index {i}, beyond float32's range (+-3.4e38): the rewards are stored as float32 (as "
                f"in TRL), where it would be inf. Scale the rewards down.")
    return number, number, None, None


def _repr(value, limit: int = 200) -> str:
    """repr(value), shortened; a repr that fails (or ints beyond str()'s 4300 digits) as the type's name."""
    try:
        return _shorten(repr(value), limit)
    except Exception:
        return f"<{type(value).__name__}>"


def _number_text(value, number: float) -> str:
    """How a message shows a value that reads as `number`: the number, or both when the value prints otherwise
    (a float subclass holding 1.0 whose float() is nan, sympy's oo)."""
    text = f"{number:g}"
    try:
        same = str(value).lower() in (text, repr(number))  # Decimal('NaN') reads as it prints
    except Exception:
        same = False
    return text if same else f"{_repr(value)} ({type(value).__name__}, whose float() is {text})"


def _infinite(value) -> bool:
    """Whether `value` is itself infinite (not a finite number too big for a float)."""
    try:
        return bool(value == math.inf or value == -math.inf)
    except Exception:
        return True


def _sign(value) -> float:
    try:
        return -1.0 if value < 0 else 1.0
    except Exception:
        return 1.0


def _plain(value):
    """A one-element tensor or array (0-d included) or a numpy scalar as the Python value it holds; pandas' NA (a
    DataFrame's empty cell) and numpy's masked value (np.ma.masked: an entry a masked array leaves out) as None,
    "no value" (a masked entry's .item() would be 0.0)."""
    if isinstance(value, np.ma.MaskedArray) and value.size == 1 and np.ma.getmaskarray(value).all():
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 or isinstance(value, np.ndarray) and value.size == 1:
        return value.item()
    if is_pandas_na(value):
        return None
    return value.item() if isinstance(value, np.generic) else value


def is_pandas_na(value) -> bool:
    """pandas.NA, without importing pandas."""
    return type(value).__name__ == "NAType"


def _too_big_for_float(value) -> bool:
    """An int (or Fraction) beyond any float: float() would raise OverflowError."""
    try:
        float(value)
    except OverflowError:
        return True
    return False


def _huge(value) -> str:
    if isinstance(value, int):  # its digits are not printed: str() refuses ints of more than 4300 digits
        return f"an int of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return f"a {type(value).__name__} beyond any float"


def _fits_float32(value: float) -> bool:
    """Whether `value` stays finite when stored as float32 (rounded to the nearest, as torch and TRL store it)."""
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float32(value)))


def checked_rewards(func, values, completions) -> list[float]:
    """`func`'s output `values` as one float per completion (NaN for None), or RewardFunctionError."""
    call = _checked(reward_func_name(func), values, completions)
    if call.message is not None:
        raise RewardFunctionError(call.message)
    return call.rewards


# ----------------------------------------------------------------------------------------
# Async reward functions: awaited on one event loop in a background thread, as TRL does. Not the
# caller's loop: in Jupyter the main thread already runs one, and a blocking call cannot wait on it.


def is_async_reward(func) -> bool:
    """Whether calling `func` gives a coroutine: an `async def`, a partial of one, or an object whose
    `__call__` is `async def` (TRL's is_async_callable)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None
_loop_lock = threading.Lock()
_LOOP_THREAD = "grpo-nb async rewards"  # the name of the loop's thread (and of any loop given up as blocked)
_LOOP_PROBE_S = 1.0  # how long a loop gets to run a no-op before it counts as blocked


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's loop for async reward functions, started on first use in a daemon thread (and again
    after `blocked_loop` gave one up)."""
    global _loop, _loop_thread
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            _loop_thread = threading.Thread(target=_loop.run_forever, daemon=True, name=_LOOP_THREAD)
            _loop_thread.start()
    return _loop


def blocked_loop() -> str | None:
    """None while the async reward functions' loop runs a no-op within _LOOP_PROBE_S seconds. Else the code
    holding it (an `async def` that runs blocking code without await: time.sleep, requests, a busy loop), and
    the loop is given up: later calls start a fresh one, while this one runs on in its thread until that code
    returns. Without this, every later async reward function in the kernel would wait on it."""
    global _loop
    with _loop_lock:
        loop, thread = _loop, _loop_thread
    if loop is None:
        return None
    answered = threading.Event()
    loop.call_soon_threadsafe(answered.set)
    if answered.wait(_LOOP_PROBE_S):
        return None
    with _loop_lock:
        if _loop is loop:
            _loop = None
    return _code_running_on(thread) or "code that does not await"


def _code_running_on(thread: threading.Thread) -> str | None:
    """The outermost frame on `thread`'s stack that is not asyncio's or threading's own: on a loop's thread,
    the coroutine running on it. None for an idle loop."""
    frame, stack = sys._current_frames().get(thread.ident), []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    for frame in reversed(stack):
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] in ("asyncio", "threading", "selectors") or frame.f_code is _awaited.__code__:
            continue
        return f"{frame.f_code.co_name!r} (line {frame.f_lineno} of {frame.f_code.co_filename})"
    return None


def _note_blocked_loop(err: BaseException) -> None:
    """Waiting on the loop was given up (Ctrl-C, the Stop button): if the loop is blocked, say by what, and
    that later calls get a fresh one."""
    where = blocked_loop()
    if where is not None:
        _add_note(err, f"The async reward functions' event loop was blocked by {where}, which runs without "
                       f"awaiting; later calls use a fresh loop (restart the kernel to end the blocked one).")


def _add_note(err: BaseException, note: str) -> None:
    if hasattr(err, "add_note"):  # Python 3.11+
        err.add_note(note)


async def _awaited(awaitable):
    return await awaitable


def resolved(value):
    """`value`, or for an awaitable (what an async reward function's call returns) what awaiting it gives."""
    if not inspect.isawaitable(value):
        return value
    if threading.current_thread().name == _LOOP_THREAD:  # waiting here would block the loop that has to run it
        if inspect.iscoroutine(value):
            value.close()  # never awaited: no "was never awaited" warning on top of this error
        raise RuntimeError("an async reward function was called from inside another async reward function's "
                           "coroutine without `await`: await it there (weighted_reward's combined function is "
                           "synchronous, so call it outside async code).")
    future = asyncio.run_coroutine_threadsafe(_awaited(value), _event_loop())
    try:
        return future.result()
    except BaseException as err:
        if not future.done():  # interrupted while waiting
            _note_blocked_loop(err)
        raise


# ----------------------------------------------------------------------------------------
# log_extra and log_metric


@dataclass
class RewardLog:
    """What reward functions logged while one batch was scored, through the two keywords TRL passes them:
    `log_extra(column, values)`, a column of the completions table (one value per completion; a column
    logged twice keeps the later values), and `log_metric(name, value)`, a number (a step's values are
    averaged into its record's "metrics"). A misuse raises RewardFunctionError, about the whole call; once
    the batch is scored the log is closed, and a late call (from a thread or task the function left running)
    is dropped with a warning."""
    n: int  # completions in the batch
    extra: dict = field(default_factory=dict)  # column -> its n values, each None, a bool, a number or text
    metrics: dict = field(default_factory=dict)  # name -> every value logged, in order
    closed: bool = False

    def hooks(self, func: str) -> dict:
        """The `log_extra` and `log_metric` keywords for reward function `func` (named in their errors)."""
        def log_extra(column, values):
            if not isinstance(column, str) or not column:
                raise LoggingError(f"log_extra(column={_shorten(repr(column), 80)}, ...) in reward function "
                                   f"{func!r}: the column's name must be a non-empty string.")
            if isinstance(values, (torch.Tensor, np.ndarray)):
                values = values.tolist()
            if not isinstance(values, (list, tuple)) or len(values) != self.n:
                got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
                raise LoggingError(f"log_extra({column!r}, values) in reward function {func!r} got {got}: pass a "
                                   f"list with one value per completion ({self.n}), like the rewards themselves.")
            if not self._late(func, f"log_extra({column!r}, ...)"):
                self.extra[column] = [table_cell(value) for value in values]

        def log_metric(name, value):
            value = _plain(value)
            try:  # read once, as rewards are
                number = float(value) if isinstance(value, (numbers.Real, Decimal)) else None
            except Exception:  # an int beyond any float, a signalling NaN
                number = None
            if not isinstance(name, str) or not name or number is None:
                raise LoggingError(
                    f"log_metric({_shorten(repr(name), 80)}, {_shorten(repr(value), 80)}) in reward function "
                    f"{func!r}: expected a metric name (a non-empty string) and a number, e.g. "
                    f"log_metric('parsed_fraction', 0.75).")
            if not self._late(func, f"log_metric({name!r}, ...)"):
                self.metrics.setdefault(name, []).append(number)

        return {"log_extra": log_extra, "log_metric": log_metric}

    def _late(self, func: str, what: str) -> bool:
        """Whether the batch is already scored: then what was logged is dropped, with a warning (not an error:
        the call comes from a thread or task nobody waits on)."""
        if self.closed:
            warnings.warn(f"{what} in reward function {func!r} came after the function returned (from a thread or "
                          f"task it left running), when its batch was already scored: the value is dropped. Call "
                          f"log_extra / log_metric before the function returns.", stacklevel=3)
        return self.closed


def table_cell(value):
    """A value given log_extra as the completions table stores it (checkpoints, trackers, log_completions_path):
    None, a bool, a number or text. A numpy or torch scalar becomes its Python number, anything else its text."""
    value = _plain(value)
    if isinstance(value, int) and _too_big_for_float(value):
        return _huge(value)  # JSON and str() refuse ints of more than 4300 digits
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    # as text; a lone surrogate (badly decoded JSON) as its escape, since no file can hold it
    return (value if isinstance(value, str) else str(value)).encode("utf-8", "backslashreplace").decode("utf-8")


# ----------------------------------------------------------------------------------------
# One reward function's call


_COPIED = (list, tuple, dict, set)


def _fresh(value):
    """`value` with each list, tuple, dict and set in it copied; strings, numbers and other objects shared.

    Without recursion, and each container copied once: a value nested thousands deep (a parse tree) is copied
    like any other, and one that holds itself stays so in the copy (through a tuple, that tuple is shared)."""
    copies, building = {}, set()  # id of each container met -> its copy; ids of tuples still being built

    def start(v):
        """v's copy (a tuple's: a list to build it from) and its items still to copy, None when there are none."""
        kind = type(v)
        if kind not in _COPIED or id(v) in building:
            return v, None
        if id(v) in copies:
            return copies[id(v)], None
        if kind is set:  # its items are hashable: numbers, text, tuples
            copies[id(v)] = set(v)
            return copies[id(v)], None
        if kind is tuple:
            building.add(id(v))
            return [], iter(v)
        copies[id(v)] = {} if kind is dict else []
        return copies[id(v)], iter(v.items() if kind is dict else v)

    root, items = start(value)
    stack = [(value, root, items, None, None)] if items is not None else []  # + where the copy goes: parent, key
    while stack:
        original, new, items, parent, key = stack[-1]
        for item in items:
            k, v = item if type(original) is dict else (len(new), item)
            copied, more = start(v)
            if type(new) is dict:
                new[k] = copied
            else:
                new.append(copied)
            if more is not None:
                stack.append((v, copied, more, new, k))
                break
        else:
            stack.pop()
            if type(original) is tuple:
                building.discard(id(original))
                copies[id(original)] = built = tuple(new)
                if parent is None:
                    root = built
                else:
                    parent[key] = built
    return root


def own_copies(keywords: dict) -> dict:
    """The keywords of one reward function call, as its own copies: a function that edits a chat message, a
    column's list or the lists themselves in place (a strip(), an append, a pop, a sort) must change neither
    the dataset nor what the next function scores. Token ids are ints, so copying each list is enough (and
    50x faster than walking it): about 0.4 ms per function for 64 chat completions of 1,024 tokens."""
    return {key: [copy.copy(ids) for ids in value] if key == "completion_ids" and type(value) is list
            else _fresh(value) for key, value in keywords.items()}


# The per-sample re-run's log_extra / log_metric: what it logs is dropped (the batch's own call has failed,
# and its logs with it), and the batch's counts are not the sample's.
_DISCARD_LOGS = {"log_extra": lambda *args, **kwargs: None, "log_metric": lambda *args, **kwargs: None}


def _call_per_sample(func, prompts, completions, completion_ids, columns, extra):
    """Each completion's own call: [(index, output or the exception it raised)]."""
    for i in range(len(completions)):
        keywords = {"prompts": prompts[i : i + 1], "completions": completions[i : i + 1],
                    "completion_ids": completion_ids[i : i + 1],
                    **{key: values[i : i + 1] for key, values in columns.items()}, **extra, **_DISCARD_LOGS}
        try:
            yield i, resolved(func(**own_copies(keywords)))
        except Exception as err:
            yield i, err


def _chat_hint(err: Exception, completions) -> str:
    """A function written for text completions breaks on chat ones ('list' has no attribute 'count',
    ...): say what it was handed and how to read the text."""
    chat = bool(completions) and isinstance(completions[0], (list, tuple)) and all(
        isinstance(m, dict) for m in completions[0])
    if not chat or not isinstance(err, (AttributeError, TypeError)):
        return ""
    return ("\nThe prompts are chat messages, so each completion is a list of messages, "
            "[{'role': 'assistant', 'content': '...'}], not a string: read its text with "
            "grpo_nb.completion_text(c), e.g. texts = [completion_text(c) for c in completions].")


def _untrained_state_hint(func, extra: dict) -> str:
    """A function reading trainer_state fails outside train(), where the state has not trained: say so."""
    try:
        reads_state = "trainer_state" in inspect.signature(func).parameters
    except (TypeError, ValueError):
        reads_state = False
    if not reads_state or getattr(extra.get("trainer_state"), "max_steps", None) != 0:
        return ""
    return ("\nOutside train() (evaluate, sample_and_score, preview_rewards) trainer_state is a TrainerState that "
            "has not trained: global_step=0, max_steps=0, epoch=None, as TRL's trainer has before training. Guard "
            "for it, e.g. progress = state.global_step / state.max_steps if state.max_steps else 0.0.")


def _call(func, prompts, completions, completion_ids, columns, extra, strict: bool) -> RewardCall:
    """Call `func` on the batch (awaited when async). Strict: raise RewardFunctionError, naming the function
    and the first failing sample. Collecting: keep every completion's own result or exception."""
    name, n = reward_func_name(func), len(completions)
    try:
        values = resolved(func(**own_copies({"prompts": prompts, "completions": completions,
                                             "completion_ids": completion_ids, **columns, **extra})))
    except LoggingError as err:  # about the call, not a sample: nothing to find one at a time
        if strict:
            raise
        return RewardCall(name, [math.nan] * n, [None] * n, [None] * n, [_error_text(err)] * n,
                          problem=f"raised {_error_text(err)}")
    except Exception as batch_err:
        # Re-running one sample at a time points at the completion that breaks it, which
        # is usually all it takes to see the bug (e.g. a missing tag, an unparsable number).
        keywords = ["prompts", "completions", "completion_ids", *columns, *extra]
        chat_hint = _chat_hint(batch_err, completions)
        hint = chat_hint + _untrained_state_hint(func, extra) + ("" if _accepts(func, keywords) else (
            f"\nIts signature does not fit the call: reward functions are called by keyword with "
            f"{', '.join(keywords)}. Name the ones you need and accept the rest with **kwargs."))
        call = RewardCall(name, [math.nan] * n, [None] * n, [None] * n, [None] * n,
                          problem=f"raised {_error_text(batch_err)}{chat_hint}")
        for i, out in _call_per_sample(func, prompts, completions, completion_ids, columns, extra):
            if isinstance(out, Exception):
                if strict:
                    raise RewardFunctionError(
                        f"reward function {name!r} raised {_error_text(out)}\n"
                        f"It first fails on sample {i} of {n}, whose completion is:\n"
                        f"{_describe_completion(completions[i])}{hint}") from out
                call.errors[i] = _error_text(out)
                continue
            one = _checked(name, out, completions[i : i + 1])
            call.rewards[i], call.values[i], call.notes[i] = one.rewards[0], one.values[0], one.notes[0]
        if all(error is None for error in call.errors):  # fine one at a time, broken on the batch
            if strict:
                raise RewardFunctionError(
                    f"reward function {name!r} raised {_error_text(batch_err)}\n"
                    f"on the batch of {n} completions, but not on any one of them alone: "
                    f"it fails only on the whole batch.{hint}") from batch_err
            call.errors = [f"{_error_text(batch_err)} (on the whole batch only)"] * n
            call.rewards = [math.nan] * n
        return call
    call = _checked(name, values, completions)
    if strict and call.message is not None:
        raise RewardFunctionError(call.message)
    return call


class _InThread:
    """`_call` running in a helper thread, so that the caller can stop waiting for it after `timeout` seconds
    (counted from the start) and several async functions can be awaited at once."""

    def __init__(self, timeout, name, func, *args):
        self.name, self.func, self.n, self.timeout = name, func, len(args[1]), timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.outcome = {}
        self.thread = threading.Thread(target=self._run, args=args, daemon=True, name=f"grpo-nb reward {name}")
        self.thread.start()

    def _run(self, *args):
        try:
            self.outcome["value"] = _call(self.func, *args)
        except BaseException as err:  # handed to the waiting thread by result()
            self.outcome["error"] = err

    def result(self, others=()) -> RewardCall:
        """The call's result, or its exception; RewardFunctionError at the deadline. `others`: the batch's other
        helpers, named in that message when they are still running too."""
        try:
            self.thread.join(None if self.deadline is None else max(0.0, self.deadline - time.monotonic()))
        except BaseException as err:  # Ctrl-C or the Stop button while waiting
            _note_blocked_loop(err)
            raise
        if self.thread.is_alive():
            raise RewardFunctionError(self._timed_out(others))
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["value"]

    def _timed_out(self, others) -> str:
        running = [h.name for h in dict.fromkeys([self, *others]) if h.thread.is_alive()]
        where = blocked_loop()
        if where is not None:  # the async functions share one loop, and one that never awaits stalls them all
            return (f"reward function(s) {', '.join(map(repr, running))} did not return within reward_timeout="
                    f"{self.timeout:g} s: async reward functions share one event loop, and {where} is blocking "
                    f"it: an `async def` running blocking code (time.sleep, requests, a synchronous client, a long "
                    f"computation) without await holds the loop, so no other async function can run. Await "
                    f"instead (asyncio.sleep, an async client), or move the blocking call off the loop with "
                    f"`await asyncio.to_thread(f, ...)`. Later calls get a fresh event loop; the blocked one is "
                    f"left in its background thread until the function returns (restart the kernel to end one "
                    f"that never does).")
        also = [name for name in running if name != self.name]
        return (f"reward function {self.name!r} did not return within reward_timeout={self.timeout:g} s for "
                f"{self.n} completions; it may be stuck (an endless loop, a network call, a sandbox that never "
                f"answers). It is left running in a background thread. Make it faster or give it its own timeout, "
                f"or raise reward_timeout (None: no limit)."
                + (f" Still running too: {', '.join(map(repr, also))}." if also else ""))


# ----------------------------------------------------------------------------------------
# A batch's calls


def call_reward_funcs(reward_funcs, *, prompts, completions, completion_ids, columns, trainer_state=None,
                      timeout: float | None = None, strict: bool = True, log: RewardLog | None = None
                      ) -> list[RewardCall]:
    """Every reward function called the one way reward functions are called, its output checked.

    `columns` maps each dataset column except `prompt` to its N values (already repeated per
    generation); each function gets them as keywords, TRL-style, with `trainer_state` (outside
    train(), a TrainerState that has not trained, as TRL's trainer has before training) and
    `log_extra` / `log_metric`, which write into `log` (a RewardLog; dropped when None). Each call
    gets its own copies of the lists and what is in them (`own_copies`).
    Strict (training, evaluation): RewardFunctionError, naming the function and the sample, when a
    function fails or returns anything but one finite float32 number (or None) per completion.
    Collecting (prototyping): nothing raises; each RewardCall says what went wrong where.

    Async functions are awaited together (as TRL gathers them), while the others run one after
    another in this thread. With `timeout` (seconds), a function that has not returned by then
    raises RewardFunctionError; a synchronous one then runs in a helper thread (so functions that
    need the main thread, e.g. signal-based timeouts of their own, cannot be used).
    """
    n = len(completions)
    for key, values in {"prompts": prompts, "completion_ids": completion_ids, **columns}.items():
        if len(values) != n:
            raise ValueError(f"{key!r} has {len(values)} entries but there are {n} completions")
    check_no_clashes(columns)
    log = RewardLog(n) if log is None else log
    names = reward_func_names(reward_funcs)  # two functions of one name keep their own scores: 'f', 'f#2'
    state = TrainerState() if trainer_state is None else trainer_state

    def args(func, name):
        return func, prompts, completions, completion_ids, columns, {"trainer_state": state, **log.hooks(name)}, strict

    try:
        awaiting = {j: _InThread(timeout, name, *args(func, name))
                    for j, (func, name) in enumerate(zip(reward_funcs, names)) if is_async_reward(func)}
        calls = []
        for j, (func, name) in enumerate(zip(reward_funcs, names)):
            if j in awaiting:
                call = awaiting[j].result(awaiting.values())
            elif timeout is None:
                call = _call(*args(func, name))
            else:
                call = _InThread(timeout, name, *args(func, name)).result(awaiting.values())
            call.name = name
            calls.append(call)
    finally:
        log.closed = True  # what a function left running logs from now on comes too late for this batch
    return calls


def score_completions(reward_funcs, *, prompts, completions, completion_ids, columns, trainer_state=None,
                      timeout: float | None = None) -> torch.Tensor:
    """Every reward function's rewards for every completion, as a float32 [N, num_funcs] tensor.

    Strict `call_reward_funcs`; NaN marks a None, i.e. "no score" (`combine_rewards` skips those,
    and a completion no function scored is left out of its group's advantages).
    """
    calls = call_reward_funcs(reward_funcs, prompts=prompts, completions=completions, completion_ids=completion_ids,
                              columns=columns, trainer_state=trainer_state, timeout=timeout)
    return rewards_tensor(calls, len(completions))


def rewards_tensor(calls: list[RewardCall], n: int) -> torch.Tensor:
    """[n, len(calls)] float32: each call's rewards as a column (NaN: no score)."""
    # reshape first: with no calls the list makes a 1-D tensor, whose .T torch deprecates
    return torch.tensor([c.rewards for c in calls], dtype=torch.float32).reshape(len(calls), n).t().contiguous()


def combine_rewards(rewards_per_func: torch.Tensor, reward_weights=None) -> torch.Tensor:
    """The total reward of each completion: the weighted sum over functions, skipping NaN.

    `rewards_per_func` is [N, num_funcs] from `score_completions`; `reward_weights` has one
    weight per function (default 1.0 each). A completion no function scored is "unscorable" and
    gets NaN, as in TRL: `loss.group_advantages` leaves it out of its group's baseline and gives
    it advantage 0.
    """
    num_funcs = rewards_per_func.shape[1]
    if reward_weights is None:
        reward_weights = [1.0] * num_funcs
    weights = torch.as_tensor(reward_weights, dtype=torch.float64, device=rewards_per_func.device)
    if weights.dim() != 1 or len(weights) != num_funcs:
        raise ValueError(
            f"reward_weights has {weights.numel()} entries but there are {num_funcs} reward functions; "
            "give one weight per reward function"
        )
    # Summed in float64: each reward fits float32 (checked), but a weighted total may not, and in float32 it
    # would be inf - a NaN advantage for its whole group, and a step that learns nothing, without a word.
    totals = (rewards_per_func.double() * weights).nansum(dim=1)
    overflow = (totals.isfinite() & totals.float().isinf()).nonzero()
    if len(overflow):
        i = int(overflow[0])
        shown = lambda values: "[" + ", ".join(f"{v:g}" for v in values.tolist()) + "]"  # noqa: E731
        raise RewardFunctionError(
            f"The weighted total reward of completion {i} is {float(totals[i]):g}, beyond float32's range "
            f"(+-3.4e38), where it would be inf: its rewards {shown(rewards_per_func[i])} (one per reward "
            f"function, in order) weighted by reward_weights={shown(weights)}. Rewards are stored as float32 (as "
            f"in TRL): scale the rewards or the reward_weights down.")
    return totals.to(rewards_per_func.dtype).masked_fill(rewards_per_func.isnan().all(dim=1), math.nan)
