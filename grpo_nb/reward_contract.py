"""The reward-function contract, as TRL GRPOTrainer defines it, checked: a function's name, the errors it raises,
the checks made of its signature before any generation, the `log_extra` / `log_metric` keywords it is given, and
reading what it returned (one finite float32 number, or None, per completion). The contract itself is described in
`rewards.py`, the reward library users read; `reward_calls.py` calls the functions."""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import warnings
from dataclasses import dataclass, field
from decimal import Decimal

import numpy as np
import torch

from .arguments import short_repr, shorten


# ----------------------------------------------------------------------------------------
# Completions, names and errors


# Here rather than in the reward library: a failing function's message shows its completion's text.
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


class RewardFunctionError(ValueError):
    """A reward function failed or returned something that is not one reward per completion."""


class LoggingError(RewardFunctionError):
    """A reward function called log_extra / log_metric the wrong way."""


def reward_func_name(func) -> str:
    """A name to show for a reward function: its `__name__` when that is text, else its class name; a
    functools.partial's is the wrapped function's, as TRL names it (trl.trainer.utils.get_callable_name), so a
    run's records and tracker tags read the same in both. Always a str: the name keys the records, the trackers'
    tags and the checkpoint's history."""
    while isinstance(func, functools.partial):
        func = func.func
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


def describe_completion(completion) -> str:
    try:
        return repr(shorten(completion_text(completion)))
    except TypeError:
        return shorten(repr(completion))


# ----------------------------------------------------------------------------------------
# Signatures, checked before any generation


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


def check_reward_funcs(reward_funcs, columns, reward_weights=None, *, more_columns: bool = False) -> None:
    """Fail before any generation when a reward function cannot be called the way train() will.

    train() calls each function by keyword with `REWARD_ARGUMENTS` and every dataset column
    but `prompt` (and a stored `completion`, as TRL does); a function that needs an argument no column
    provides (a renamed `answer` column, say) or that accepts neither a keyword it will get nor **kwargs would otherwise
    only fail after the first rollout.
    """
    if not reward_funcs:
        raise ValueError("train() needs at least one reward function, e.g. reward_funcs=[correctness_reward].")
    if len(reward_funcs) == 1 and isinstance(reward_funcs[0], (dict, set, frozenset)):
        raise TypeError(f"reward_funcs={shorten(repr(reward_funcs[0]), 120)} is a {type(reward_funcs[0]).__name__}: "
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
        if "environments" in missing and not more_columns:  # TRL's keyword, passed only with environments
            raise ValueError(
                f"Reward function {name!r} needs the argument 'environments', which train() passes only with "
                f"environment_factory=...: each episode's environment instance, as TRL does. Pass "
                f"environment_factory=MyEnv (its methods are the model's tools), or give the argument a default "
                f"(environments=None).")
        if missing and not more_columns:  # more_columns: a rollout_func's own keys, known only when it returns
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


# ----------------------------------------------------------------------------------------
# What a function returned


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


def error_text(err: BaseException) -> str:
    """The exception's type and message, with its notes (weighted_reward notes which of its functions raised)."""
    return f"{type(err).__name__}: {err}" + "".join(f" ({note})" for note in getattr(err, "__notes__", ()))


def checked_output(name: str, values, completions) -> RewardCall:
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
        message = (f"reward function {name!r} returned {type(values).__name__} {short_repr(values)}. "
                   f"{HOW_TO_RETURN}")
    if problem is None:
        try:  # the values actually there: a list whose len() disagrees with its items is counted by its items
            values = list(values)
        except Exception as err:
            problem = f"returned a {type(values).__name__} whose values cannot be read ({error_text(err)})"
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
                            f"Completion {i}: {describe_completion(completions[i])}")
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
                    f"{short_repr(value)} ({type(value).__name__}) at index {i}, which is not a number. "
                    f"{HOW_TO_RETURN}")
        number = float(value)
    except OverflowError:  # an int or a Fraction beyond any float
        pass
    except Exception as err:  # a signalling NaN, a __float__ that raises, a sympy expression with free symbols
        return (math.nan, value, f"cannot be read as a number ({type(err).__name__})",
                f"{short_repr(value)} ({type(value).__name__}) at index {i}, which cannot be read as a number "
                f"({error_text(err)}). {HOW_TO_RETURN}")
    if number is None or math.isinf(number) and not isinstance(value, float) and not _infinite(value):
        sign = _sign(value) if number is None else number
        # e.g. Decimal 1e400
        shown = _huge(value) if number is None else f"{short_repr(value)} ({type(value).__name__})"
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


def _number_text(value, number: float) -> str:
    """How a message shows a value that reads as `number`: the number, or both when the value prints otherwise
    (a float subclass holding 1.0 whose float() is nan, sympy's oo)."""
    text = f"{number:g}"
    try:
        same = str(value).lower() in (text, repr(number))  # Decimal('NaN') reads as it prints
    except Exception:
        same = False
    return text if same else f"{short_repr(value)} ({type(value).__name__}, whose float() is {text})"


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
    call = checked_output(reward_func_name(func), values, completions)
    if call.message is not None:
        raise RewardFunctionError(call.message)
    return call.rewards


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
                raise LoggingError(f"log_extra(column={shorten(repr(column), 80)}, ...) in reward function "
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
                    f"log_metric({shorten(repr(name), 80)}, {shorten(repr(value), 80)}) in reward function "
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
