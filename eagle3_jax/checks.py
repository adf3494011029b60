"""Argument checks shared by the public entry points (imports nothing of the package)."""

from __future__ import annotations

import numpy as np


class ArgumentError(ValueError, TypeError):
    """An argument of the wrong type (a ValueError and a TypeError, as numpy's AxisError is a
    ValueError and an IndexError): catch either."""


def is_int(v) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def int_arg(name: str, v, lo: int, optional: bool = False):
    """v as a Python int >= lo (None passes where optional). Bools, floats and strings raise
    ArgumentError, smaller integers ValueError, both naming `name`."""
    if v is None and optional:
        return None
    if not is_int(v):
        raise ArgumentError(f"{name}: expected an integer{' or None' if optional else ''}, got {v!r}")
    if v < lo:
        raise ValueError(f"{name}: must be an integer >= {lo}, got {v}")
    return int(v)


def number_arg(name: str, v, lo: float, hi: float, *, lo_open: bool = False, optional: bool = False):
    """v as a Python float in [lo, hi] ((lo, hi] where lo_open; None passes where optional). Anything
    else (bools, strings, NaN, a number outside the range) raises ArgumentError naming `name`, the
    range and the value."""
    if v is None and optional:
        return None
    number = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
    if not (number and (lo < v if lo_open else lo <= v) and v <= hi):
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ArgumentError(f"{name}: expected a number in {span}{' or None' if optional else ''}, got {v!r}")
    return float(v)
