"""Argument checks for the public functions: a bad value is refused before any work, with a message
that names the function, the argument, the value and what is allowed."""

from __future__ import annotations

import math

import numpy as np
import torch


def refuse(func: str, name: str, value, expected: str, error=ValueError):
    """`func` names a function, or a config class with a dot ("GRPOConfig.") whose field `name` is."""
    where = f"{func}{name}={value!r}" if func.endswith(".") else f"{func}({name}={value!r})"
    raise error(f"{where} is invalid: expected {expected}.")


def shorten(text: str, limit: int = 300) -> str:
    """A long text as a message shows it: its start, and how much more there is."""
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters]"


def short_repr(value, limit: int = 200) -> str:
    """repr(value), shortened; a repr that fails (or ints beyond str()'s 4300 digits) as the type's name."""
    try:
        return shorten(repr(value), limit)
    except Exception:
        return f"<{type(value).__name__}>"


def check_device(func: str, device) -> torch.device | None:
    """None (the caller picks), or a CPU or CUDA device this machine has."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        refuse(func, "device", device, "None (the GPU if there is one), 'cpu', 'cuda' or 'cuda:<index>'")
    if device.type not in ("cpu", "cuda"):
        refuse(func, "device", str(device), "None, 'cpu' or 'cuda[:index]' (grpo-nb runs on CUDA GPUs and the CPU)")
    if device.type == "cuda" and not torch.cuda.is_available():
        refuse(func, "device", str(device), "'cpu' or None on this machine, which has no CUDA GPU")
    return device


def plain(value):
    """A numpy scalar as the Python value it holds (np.int64, what np.arange and pandas hand out, as int;
    np.float32 as float; np.bool_ as bool); anything else unchanged. JSON files, `random.Random` and peft's
    configs take only Python's own numbers."""
    return value.item() if isinstance(value, np.generic) else value


# torch's generators take seeds below 2**64, and a run adds to its seed (1009 x the rank in several processes, and an
# offset per call for vLLM's sampling): half that range leaves room for the offsets.
SEED_LIMIT = 2**63


def need_int(func: str, name: str, value, low: int, *, optional: bool = False, below: int | None = None):
    """An integer (not a bool, not a float; a numpy integer too) >= low (and < below, when given); None too when
    optional. Returns it as a Python int: bind it, `n = need_int(...)`."""
    value = plain(value)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (below is not None and value >= below):
        shown = f"an integer in [{low}, {'2**63' if below == SEED_LIMIT else below})" if below is not None else \
            f"an integer >= {low}"
        refuse(func, name, value, shown + (" or None" if optional else ""))
    return value


def need_number(func: str, name: str, value, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False, optional: bool = False):
    """A finite number within [low, high] (open ends where asked; a numpy number too); None too when optional.
    Returns it as a Python number: bind it, `x = need_number(...)`."""
    value = plain(value)
    if value is None and optional:
        return None
    # an int is finite however large (math.isfinite would raise OverflowError past a float's range)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (isinstance(value, int) or math.isfinite(value))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        bounds = []
        if low is not None:
            bounds.append(f"{'>' if low_open else '>='} {low:g}")
        if high is not None:
            bounds.append(f"{'<' if high_open else '<='} {high:g}")
        refuse(func, name, value, "a finite number" + (" " + " and ".join(bounds) if bounds else "")
               + (" or None" if optional else ""))
    return value


def need_bool(func: str, name: str, value) -> None:
    if not isinstance(value, bool):
        refuse(func, name, value, "True or False")


def need_choice(func: str, name: str, value, choices) -> None:
    """One of `choices`, of the same type too (True is not 1, 'fp16' is not b'fp16')."""
    if not any(type(value) is type(c) and value == c for c in choices):
        refuse(func, name, value, "one of " + ", ".join(repr(c) for c in choices))


def need_target_modules(func: str, name: str, value) -> None:
    """peft's target_modules: a string ('all-linear', or a regular expression over full names) or module names."""
    if not (isinstance(value, str) or (isinstance(value, (list, tuple)) and value
                                       and all(isinstance(m, str) for m in value))):
        refuse(func, name, value, "'all-linear' or a list of module names like ['q_proj', 'v_proj']")
