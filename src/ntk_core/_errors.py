"""The library's exception type, the one message shape (:func:`bad`), shared checks."""

from __future__ import annotations

import math
import numbers
import reprlib

import jax
import numpy as np


class NonFiniteError(ValueError):
    """NaN or inf in an input, a kernel, a tile, a Monte Carlo sum or a prediction; a
    ``ValueError`` whose own type tells it from other bad input."""


def bad(cls: type[Exception], fn: str, what: str, fix: str, see: str | None = None) -> Exception:
    """``cls("{fn}: {what}. Fix: {fix}.")``; ``see``: the section of ``docs/errors.md``."""
    return cls(f"{fn}: {what}. Fix: {fix}." + (f" See docs/errors.md#{see}." if see else ""))


def must(cls: type[Exception], fn: str, name: str, expect: str, got, fix=None, *, eg=None):
    """``bad(cls, fn, "{name} must be {expect}, got {got}", fix)``; ``eg``: the fix is
    ``"pass e.g. {name}={eg}"``."""
    return bad(cls, fn, f"{name} must be {expect}, got {got}", fix or f"pass e.g. {name}={eg}")


def one_line(error: BaseException) -> str:
    """``"{type}: {message}"`` of ``error`` on one line, without a final full stop."""
    return f"{type(error).__name__}: {' '.join(str(error).split()).rstrip('.')}"


def _out_of_range(fn, name, value, expect, fix, type_ok, type_error) -> Exception:
    got = f"{value!r}" if type_ok else f"{reprlib.repr(value)} ({type(value).__name__})"
    return must(ValueError if type_ok else type_error, fn, name, expect, got, fix)


def check_int(fn, name, value, fix, low=1, high=None, *, optional=False, type_error=TypeError):
    """``value`` as an int in ``[low, high]`` (``None`` if ``optional``); ``type_error`` for a
    non-int (bools included), ValueError out of range."""
    if optional and value is None:
        return None
    is_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if is_int and low <= value and (high is None or value <= high):
        return int(value)
    expect = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
    named = {"an int >= 1": "a positive int", "an int >= 0": "a non-negative int"}
    expect = ("None or " if optional else "") + named.get(expect, expect)
    raise _out_of_range(fn, name, value, expect, fix, is_int, type_error)


def check_bool(fn, name, value) -> bool:
    """``value`` as a bool (Python or numpy); TypeError otherwise (a string is truthy)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    got = f"{value!r} ({type(value).__name__})"
    raise must(TypeError, fn, name, "True or False", got, f"pass {name}=True or {name}=False")


def is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_real(
    fn,
    name,
    value,
    fix,
    low=0.0,
    high=math.inf,
    *,
    open_low=False,
    is_type=is_real,
    type_error=TypeError,
):
    """``value`` as a float in ``[low, high)`` (``(low, high)`` if ``open_low``; never NaN or
    inf); ``type_error`` unless ``is_type(value)``, ValueError out of range. A 0-d numpy or
    JAX array (``jnp.float32(0.5)``, bfloat16 too) is read as its Python number."""
    if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0:
        if not isinstance(value, jax.core.Tracer):
            value = value.item()
    type_ok = is_type(value)
    if type_ok and (low < value if open_low else low <= value) and value < high:
        return float(value)
    expect = f"a real number in {'(' if open_low else '['}{low:g}, {high:g})"
    raise _out_of_range(fn, name, value, expect, fix, type_ok, type_error)
