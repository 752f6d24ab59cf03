"""Argument checks for the widgets' constructors: a bad value is refused when the widget is made, not
at the first render in the middle of a run. (The widgets stand alone, without grpo_nb; grpo_nb's own
checks live in grpo_nb/arguments.py.)"""

from __future__ import annotations

import math


def need(owner: str, name: str, value, kind: type, low: float, *, optional: bool = False) -> None:
    """`kind` int: an integer >= low; float: a finite number >= low; None too when optional."""
    if value is None and optional:
        return
    ok = not isinstance(value, bool) and isinstance(value, (int,) if kind is int else (int, float))
    try:
        finite = ok and math.isfinite(value)
    except OverflowError:  # an int past float's range
        finite = False
    if not (finite and value >= low):
        what = "an integer" if kind is int else "a finite number"
        raise (TypeError if not ok else ValueError)(
            f"{owner}({name}={value!r}) is invalid: expected {what} >= {low:g}" + (" or None" if optional else "") + ".")
