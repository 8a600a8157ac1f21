"""Argument parsing shared by the torch (``symheap.attention``) and JAX
(``symheap.jax``) attention front ends: the Python-level forms of their
arguments (ints, the window pair, dropout seeds, KV-cache options), with the
same messages in both. Imports neither framework. The core checks the values
again (ranges, shapes) when it plans the call.
"""
from __future__ import annotations

import operator

from . import _core
from ._runtime import INT32, INT64


def fail(message: str):
    raise ValueError(f"attention: {message}")


def _index(value, name: str) -> int:
    """``value`` as a Python int (anything with ``__index__``, not a bool)."""
    if isinstance(value, bool):
        fail(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        fail(f"{name} must be an int, got {type(value).__name__}")


def as_int(value, name: str) -> int:
    """``value`` as a Python int that fits the core's signed 64-bit integers
    (the core checks the narrower ranges)."""
    value = _index(value, name)
    if not INT64[0] <= value <= INT64[1]:
        fail(f"{name} must fit in 64 bits, got {value}")
    return value


def int32_value(value, name: str) -> int:
    """``value`` (an int) for an int32 tensor the call fills with it."""
    value = as_int(value, name)
    if not INT32[0] <= value <= INT32[1]:
        fail(f"{name} must fit in an int32, got {value}")
    return value


def window_pair(window_size) -> tuple:
    """(left, right) of ``window_size``; -1 = unbounded on that side."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        fail(f"window_size must be a pair (left, right) of ints, -1 = unbounded, got {window_size!r}")
    return as_int(left, "window_size's left side"), as_int(right, "window_size's right side")


def seed_pair(seed) -> tuple:
    """(seed, offset) of an explicit dropout seed: an int, or a (seed, offset) pair."""
    if isinstance(seed, (tuple, list)):
        if len(seed) != 2:
            fail("seed must be an int or a (seed, offset) pair")
        s, o = _index(seed[0], "seed"), _index(seed[1], "offset")
    else:
        s, o = _index(seed, "seed"), 0
    if not 0 <= s < 2 ** 64:
        fail(f"seed must be in [0, 2**64), got {s}")
    if not 0 <= o < 2 ** 32:
        fail(f"the dropout offset must be in [0, 2**32), got {o}")
    return s, o


def cache_options(head_dim: int, causal, window_size, softmax_scale, softcap) -> dict:
    """The scalar options of a KV-cache call, as the core's CacheCall names them
    (the core sets them: the default scale, a causal call's window)."""
    left, right = window_pair(window_size)
    return _core.attention_cache_options(head_dim, bool(causal), left, right,
                                         None if softmax_scale is None else float(softmax_scale),
                                         float(softcap))
