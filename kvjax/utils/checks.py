"""Argument checks: integers and floats within the limits kvjax's devices and memory set, for the
library (`check_int`) and the command line (`int_arg`, `float_arg` as argparse types), and how a
value is shown in the message that refuses it.

Numbers are checked before any work: finite, and within limits that follow from int32 indexing
(token ids, positions, slots and block ids are int32 on the device) and from memory (`MAX_GIB`).
A refusal is a KvjaxError (kvjax.errors) naming the value and the rule it broke.
"""
from __future__ import annotations

import argparse
import json
import math
import numbers
from typing import Any

from kvjax.errors import KvjaxError

INT32_MAX = 2**31 - 1  # device indices (tokens, positions, slots, blocks) are int32
MAX_SEED = 2**32 - 1  # seeds are uint32: jax.random.key(seed) keeps 32 bits
MAX_GIB = 2**20  # 1 PiB: far above any device or host, far below float overflow


def is_int(value: Any) -> bool:
    """A Python or NumPy integer, not a bool: what check_int accepts."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(value: Any, name: str, lo: int = 0, hi: int | None = INT32_MAX, error: type = None) -> int:
    """An integer (a Python or NumPy int; not a bool, not a float) in [lo, hi] (hi None: no upper
    bound) as a Python int, else a KvjaxError (or `error`, a subclass) naming `name`. The one
    integer guard: "n must be an integer in [1, 16384], got 0", "block_size must be a positive
    integer, got 0"."""
    error = error or KvjaxError
    ok = is_int(value)
    if hi is None:
        if not ok or value < lo:
            rule = {0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"an integer >= {lo}")
            raise error(f"{name} must be {rule}, got {show_value(value)}")
    elif not ok or not lo <= value <= hi:
        raise error(f"{name} must be an integer in [{lo}, {hi}], got {show_value(value)}")
    return int(value)


def int_arg(lo: int = 1, hi: int = INT32_MAX):
    """An argparse `type` for an integer flag in [lo, hi] (argparse names the flag)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {show_text(text)}")
        return value
    return parse


def float_arg(lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False):
    """An argparse `type` for a finite float flag in [lo, hi] (or (lo, hi] with lo_open)."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {show_text(text)}") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"must be finite, got {show_text(text)}")
        if not (lo < x if lo_open else lo <= x) or not x <= hi:
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], "
                                             f"got {show_text(text)}")
        return x
    return parse


def show_text(text: str, n: int = 40) -> str:
    """Text as a message quotes it: its repr, cut to n characters."""
    return repr(text if len(text) <= n else text[:n] + "...")


def show_value(value: Any) -> str:
    """A value as a message shows it: its JSON (else its repr), cut to 60 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
