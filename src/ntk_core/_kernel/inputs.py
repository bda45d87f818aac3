"""``inputs=``: how x reaches the model, ``"x"`` (its one argument, any pytree), ``"args"`` (a
tuple: ``model(*x)``) or ``"kwargs"`` (a dict: ``model(**x)``); every leaf batched on axis 0.
Shared by the adapters through :mod:`ntk_core.adapters`."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from ntk_core._errors import bad, must, one_line
from ntk_core._kernel.caller import Caller
from ntk_core._kernel.checks import adapter_model_failure, model_failed

_KINDS = {"x": object, "args": (tuple, list), "kwargs": Mapping}
_AS = {"args": "a tuple", "kwargs": "a dict"}  # what x must be, in messages
#: Where the adapters' callers pass the model's own keywords, as messages name it.
MODEL_KWARGS = "apply_kwargs={...}"


def check_inputs_option(fn_name: str, inputs) -> str:
    """``inputs``, or a ValueError naming ``fn_name`` and the three choices."""
    if not (isinstance(inputs, str) and inputs in _KINDS):
        raise must(
            ValueError, fn_name, "inputs", "'x', 'args' or 'kwargs'", repr(inputs), eg="'args'"
        )
    return inputs


def spread_inputs(fn_name: str, inputs: str, x, name: str = "x1") -> tuple[tuple, dict]:
    """The model call's ``(args, kwargs)`` for ``x``; TypeError for a tuple / dict not given."""
    if not isinstance(x, _KINDS[inputs]):
        a, other = _AS[inputs], next(k for k in _AS if k != inputs)  # the other of args, kwargs
        what = f"inputs={inputs!r} needs {name} as {a} of per-sample arrays, got {type(x).__name__}"
        fix = f"pass {a}, inputs={other!r} for {_AS[other]}, or inputs='x' for one argument"
        raise bad(TypeError, fn_name, what, fix)
    return ((x,), {}) if inputs == "x" else (tuple(x), {}) if inputs == "args" else ((), dict(x))


def inputs_failure(
    caller: Caller, params_name: str, error: Exception, mode: str, flags=MODEL_KWARGS, call=None
):
    """``adapter_model_failure`` (``mode``: its evaluation mode); where ``call``, the model's
    own ``(fn, args, kwargs)``, does not fit ``fn``'s signature, where each argument goes
    (``flags``: where model keywords go, ``""`` for the model's own fields)."""
    if call is None or binds(*call):
        return adapter_model_failure(caller, params_name, error, mode)
    flags = f"in {flags}" if flags else "as the model's fields"
    fix = f"pass per-sample arrays in x1 with inputs='args' or 'kwargs', flags {flags}"
    return model_failed(caller.name, one_line(error), fix)


def binds(fn, args, kwargs) -> bool:
    """Whether ``fn(*args, **kwargs)`` fits ``fn``'s signature (True where it has none)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True
