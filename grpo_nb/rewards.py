"""Reward functions, and the machinery that calls them and checks what they return.

Reward functions follow TRL GRPOTrainer's convention, so functions written for TRL work
here unmodified and the other way round. A reward function is called by keyword with

- `prompts`: the N prompts (one per completion, so each repeats num_generations times)
- `completions`: the N completions, each a string (plain-text dataset) or a list of
  messages `[{"role": "assistant", "content": "..."}]` (conversational dataset)
- `completion_ids`: the N completions' token ids
- every other dataset column as a list of N values, e.g. `answer=[...]`

and returns a list of N floats, or None for a completion it has no opinion on. Accept the
keywords you need and `**kwargs` for the rest.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import re
import threading
from decimal import Decimal, InvalidOperation

import numpy as np
import torch


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


def _as_number(text: str) -> Decimal | None:
    """`text` as an exact number ("1,234" and " 5.0 " included), None if it is not one."""
    try:
        number = Decimal(text.strip().replace(",", ""))
    except InvalidOperation:
        return None
    return number if number.is_finite() else None


def answers_match(predicted: str, reference: str) -> bool:
    """Equal as numbers when both are numbers ("5" == "5.0"), else equal as stripped strings."""
    predicted_number, reference_number = _as_number(predicted), _as_number(reference)
    if predicted_number is not None and reference_number is not None:
        return predicted_number == reference_number
    return predicted.strip() == str(reference).strip()


# ----------------------------------------------------------------------------------------
# Reward functions


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """2.0 if the completion's last <answer>...</answer> equals the reference `answer`, else 0.0.

    Numbers compare as numbers ("5", "5.0" and " 5 " all match 5); anything else must
    match the reference exactly after stripping whitespace.
    """
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        predicted = extract_answer(completion_text(completion))
        rewards.append(2.0 if predicted is not None and answers_match(predicted, str(reference)) else 0.0)
    return rewards


def integer_answer_reward(completions, **kwargs) -> list[float]:
    """0.5 if the last <answer>...</answer> holds an integer ("42", "-3", "+7"), else 0.0."""
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
    return [0.5 if _STRICT_FORMAT.fullmatch(completion_text(c)) else 0.0 for c in completions]


def soft_format_reward(completions, **kwargs) -> list[float]:
    """0.5 if the completion contains <reasoning>...</reasoning> followed by <answer>...</answer>
    (any whitespace, any text around them), else 0.0."""
    return [0.5 if _SOFT_FORMAT.search(completion_text(c)) else 0.0 for c in completions]


_XML_TAGS = ("<reasoning>\n", "\n</reasoning>\n", "\n<answer>\n", "\n</answer>")


def xml_count_reward(completions, **kwargs) -> list[float]:
    """Partial credit for the format: 0.125 for each of "<reasoning>\\n", "\\n</reasoning>\\n",
    "\\n<answer>\\n" and "\\n</answer>" that appears exactly once (up to 0.5), minus 0.001
    per character of text after the last </answer> (surrounding whitespace not counted).

    Unlike the all-or-nothing format rewards this one differs between completions that are
    all "wrong", so even a weak model gets a learning signal from it.
    """
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
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
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
    reward_funcs, weights = list(reward_funcs), [float(w) for w in weights]
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
            values = _to_rewards(func, func(completions=completions, **kwargs), completions)
            for i, value in enumerate(values):
                if not math.isnan(value):
                    totals[i] = (totals[i] or 0.0) + weight * value
        return totals

    combined.__name__ = name or "+".join(
        f"{w:g}*{reward_func_name(f)}" for f, w in zip(reward_funcs, weights)
    )
    combined.__doc__ = "Weighted sum: " + ", ".join(
        f"{w:g} x {reward_func_name(f)}" for f, w in zip(reward_funcs, weights)
    )
    return combined


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


def reward_func_name(func) -> str:
    """A name to show for a reward function: its `__name__`, else its class name."""
    if isinstance(func, functools.partial):
        return f"partial({reward_func_name(func.func)})"
    return getattr(func, "__name__", None) or type(func).__name__


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


REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state")


def reward_columns(columns) -> list[str]:
    """The dataset columns handed to reward functions as keywords: all but the prompt and
    any stored completion (reward functions get the freshly generated ones instead)."""
    return [c for c in columns if c not in ("prompt", "completion", "completion_ids")]


def check_no_clashes(keywords) -> None:
    """Columns handed to reward functions as keywords must not shadow the functions' own arguments."""
    clashes = sorted(set(REWARD_ARGUMENTS) & set(keywords))
    if clashes:
        raise ValueError(f"Columns {clashes} clash with the reward functions' own arguments: rename them, "
                         f"e.g. dataset.rename_column('{clashes[0]}', 'my_{clashes[0]}').")


def check_reward_funcs(reward_funcs, columns, reward_weights=None) -> None:
    """Fail before any generation when a reward function cannot be called the way train() will.

    train() calls each function by keyword with `REWARD_ARGUMENTS` and every dataset column
    but `prompt`; a function that needs an argument no column provides (a renamed `answer`
    column, say) or that accepts neither a keyword it will get nor **kwargs would otherwise
    only fail after the first rollout.
    """
    if not reward_funcs:
        raise ValueError("train() needs at least one reward function, e.g. reward_funcs=[correctness_reward].")
    check_no_clashes(reward_columns(columns))
    passed = [*REWARD_ARGUMENTS, *reward_columns(columns)]
    for func in reward_funcs:
        if not callable(func):
            raise ValueError(f"Reward function {func!r} is not callable. Pass functions "
                             f"f(prompts, completions, **kwargs) -> list[float].")
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


def _call(func, prompts, completions, completion_ids, columns, extra):
    """`func`'s raw output on the batch; on an exception, find and show the first failing sample."""
    try:
        return func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **extra)
    except Exception as batch_err:
        name = reward_func_name(func)
        keywords = ", ".join(["prompts", "completions", "completion_ids", *columns, *extra])
        hint = ""
        if not _accepts(func, ["prompts", "completions", "completion_ids", *columns, *extra]):
            hint = (
                f"\nIts signature does not fit the call: reward functions are called by keyword with "
                f"{keywords}. Name the ones you need and accept the rest with **kwargs."
            )
        # Re-running one sample at a time points at the completion that breaks it, which
        # is usually all it takes to see the bug (e.g. a missing tag, an unparsable number).
        for i in range(len(completions)):
            try:
                func(
                    prompts=prompts[i : i + 1],
                    completions=completions[i : i + 1],
                    completion_ids=completion_ids[i : i + 1],
                    **{key: values[i : i + 1] for key, values in columns.items()},
                    **extra,
                )
            except Exception as sample_err:
                raise RewardFunctionError(
                    f"reward function {name!r} raised {type(sample_err).__name__}: {sample_err}\n"
                    f"It first fails on sample {i} of {len(completions)}, whose completion is:\n"
                    f"{_describe_completion(completions[i])}{hint}"
                ) from sample_err
        raise RewardFunctionError(
            f"reward function {name!r} raised {type(batch_err).__name__}: {batch_err}\n"
            f"on the batch of {len(completions)} completions, but not on any one of them alone: "
            f"it fails only on the whole batch.{hint}"
        ) from batch_err


def _to_rewards(func, values, completions) -> list[float]:
    """Check `func`'s output and turn it into N floats, NaN where it returned None."""
    name = reward_func_name(func)
    n = len(completions)
    how = "Return a list of floats (or None for 'no score'), one reward per completion."
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        if values.dim() != 1:
            raise RewardFunctionError(
                f"reward function {name!r} returned a tensor of shape {tuple(values.shape)}, "
                f"expected shape ({n},). {how}"
            )
        values = values.tolist()
    elif isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise RewardFunctionError(
                f"reward function {name!r} returned an array of shape {values.shape}, "
                f"expected shape ({n},). {how}"
            )
        values = values.tolist()
    elif not isinstance(values, (list, tuple)):
        raise RewardFunctionError(
            f"reward function {name!r} returned {type(values).__name__} {_shorten(repr(values), 200)}. {how}"
        )
    if len(values) != n:
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(values)} values for {n} completions: "
            f"expected {n}, got {len(values)}. {how}"
        )

    rewards = []
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if value is None:
            rewards.append(math.nan)
            continue
        if not isinstance(value, (numbers.Real, np.bool_)):
            raise RewardFunctionError(
                f"reward function {name!r} returned {_shorten(repr(value), 200)} "
                f"({type(value).__name__}) at index {i}, which is not a number. {how}\n"
                f"Completion {i}: {_describe_completion(completions[i])}"
            )
        value = float(value)
        if not math.isfinite(value):
            raise RewardFunctionError(
                f"reward function {name!r} returned {value} at index {i}. Rewards must be finite; "
                f"return None to give a completion no score.\n"
                f"Completion {i}: {_describe_completion(completions[i])}"
            )
        rewards.append(value)
    return rewards


def _call_with_timeout(timeout, func, *args):
    """`_call`, but give up waiting after `timeout` seconds (the call runs in a helper thread)."""
    if timeout is None:
        return _call(func, *args)
    outcome = {}

    def run():
        try:
            outcome["value"] = _call(func, *args)
        except BaseException as err:  # handed to the training thread below
            outcome["error"] = err

    worker = threading.Thread(target=run, daemon=True, name=f"grpo-nb reward {reward_func_name(func)}")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardFunctionError(
            f"reward function {reward_func_name(func)!r} did not return within reward_timeout={timeout:g} s for "
            f"{len(args[1])} completions; it may be stuck (an endless loop, a network call, a sandbox that never "
            f"answers). It is left running in a background thread. Make it faster or give it its own timeout, or "
            f"raise reward_timeout (None: no limit)."
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def score_completions(reward_funcs, *, prompts, completions, completion_ids, columns, trainer_state=None,
                      timeout: float | None = None) -> torch.Tensor:
    """Every reward function's rewards for every completion, as a float32 [N, num_funcs] tensor.

    `columns` maps each dataset column except `prompt` to its N values (already repeated
    per generation); each function gets them as keywords, TRL-style. NaN marks a None,
    i.e. "no score"; `combine_rewards` skips those. Raises RewardFunctionError, naming the
    function, when one fails or returns anything but one finite number (or None) per completion.
    `trainer_state` (an object with `global_step` and `max_steps`, as in TRL) is passed
    along when given, for rewards that change with training progress. With `timeout`
    (seconds), each function runs in a helper thread and one that has not returned by then
    raises RewardFunctionError (functions that need the main thread, e.g. signal-based
    timeouts of their own, then cannot be used).
    """
    n = len(completions)
    for key, values in {"prompts": prompts, "completion_ids": completion_ids, **columns}.items():
        if len(values) != n:
            raise ValueError(f"{key!r} has {len(values)} entries but there are {n} completions")
    check_no_clashes(columns)

    extra = {} if trainer_state is None else {"trainer_state": trainer_state}
    scores = torch.full((n, len(reward_funcs)), math.nan, dtype=torch.float32)
    for j, func in enumerate(reward_funcs):
        values = _call_with_timeout(timeout, func, prompts, completions, completion_ids, columns, extra)
        scores[:, j] = torch.tensor(_to_rewards(func, values, completions), dtype=torch.float32)
    if n and bool(scores.isnan().all()):
        names = ", ".join(reward_func_name(f) for f in reward_funcs)
        raise RewardFunctionError(
            f"every reward function ({names}) returned None for all {n} completions, so no completion has a "
            f"reward and GRPO has nothing to learn from. None means 'no score for this completion'; return 0.0 "
            f"for a completion that earned nothing. First completion: {_describe_completion(completions[0])}"
        )
    return scores


def combine_rewards(rewards_per_func: torch.Tensor, reward_weights=None) -> torch.Tensor:
    """The total reward of each completion: the weighted sum over functions, skipping NaN.

    `rewards_per_func` is [N, num_funcs] from `score_completions`; `reward_weights` has one
    weight per function (default 1.0 each). A completion no function scored gets 0.
    """
    num_funcs = rewards_per_func.shape[1]
    if reward_weights is None:
        reward_weights = [1.0] * num_funcs
    weights = torch.as_tensor(reward_weights, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    if weights.dim() != 1 or len(weights) != num_funcs:
        raise ValueError(
            f"reward_weights has {weights.numel()} entries but there are {num_funcs} reward functions; "
            "give one weight per reward function"
        )
    return (rewards_per_func * weights).nansum(dim=1)
