"""Argument checks for the public functions: a bad value is refused before any work, with a message
that names the function, the argument, the value and what is allowed."""

from __future__ import annotations

import math

import torch


def refuse(func: str, name: str, value, expected: str, error=ValueError):
    raise error(f"{func}({name}={value!r}) is invalid: expected {expected}.")


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


def need_int(func: str, name: str, value, low: int, *, optional: bool = False) -> None:
    """An integer (not a bool, not a float) >= low; None too when optional."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        refuse(func, name, value, f"an integer >= {low}" + (" or None" if optional else ""))


def need_number(func: str, name: str, value, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False, optional: bool = False) -> None:
    """A finite number within [low, high] (open ends where asked); None too when optional."""
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
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
