"""Python's binding errors of the public functions (an unknown or misspelt option, too
many positional arguments, a missing one) as TypeErrors naming the valid options."""

from __future__ import annotations

import difflib
import functools
import inspect

from ntk_core._errors import bad
from ntk_core._kernel.kind import NTK_ONLY


def required_positional(fn) -> int | None:
    """How many positional parameters without a default ``fn`` takes (None: no signature,
    as for some builtins)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds and p.default is p.empty for p in params)


def _first_missing(signature: inspect.Signature, args: tuple, kwargs: dict) -> str | None:
    """The first required parameter no argument gives (as ``Signature.bind`` checks), or None."""
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    taken = positional[: len(args)]
    if any(p.name in kwargs and p.kind is not p.POSITIONAL_ONLY for p in taken):
        return None  # multiple values for an argument
    if len(args) > len(positional) and not any(p.kind is p.VAR_POSITIONAL for p in params):
        return None  # too many positional arguments
    for p in params[len(taken) :]:
        if p.name in kwargs and p.kind is p.POSITIONAL_ONLY:
            return None  # a positional-only argument given by keyword
        required = p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        if required and p.name not in kwargs:
            return p.name
    return None


def _checked_arguments(fn, name: str | None = None):
    """``fn`` whose binding errors (checked after a TypeError) name the valid options."""
    signature = inspect.signature(fn)
    name = name or fn.__name__

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TypeError:
            try:
                signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(_message(name, signature, args, kwargs, e)) from None
            raise

    return checked


def misspelt(name: str, options) -> str | None:
    """The option ``name`` most likely misspells (similarity >= 0.65: ``diag_axes`` ->
    ``diagonal_axes``, not ``trace_axes`` -> ``vmap_axes``), or None."""
    match = difflib.get_close_matches(name, options, 1, cutoff=0.65)
    return match[0] if match else None


def _message(name: str, signature: inspect.Signature, args, kwargs, error) -> str:
    params = signature.parameters
    options = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [n for n, p in params.items() if p.kind in kinds]
    unknown = sorted(set(kwargs) - set(params))
    if not unknown:
        missing = _first_missing(signature, args, kwargs)
        fix = f"call {name}({', '.join(positional)}, *, option=...); options are keyword-only"
        if missing in options:
            fix = f"pass {missing}=... by keyword (it is keyword-only)"
        return str(binding_error(name, error, positional, fix))
    model_kwargs = next((p for p in _MODEL_KEYWORDS if p in params), None)
    return str(unknown_options(name, "keyword argument(s)", unknown, options, model_kwargs))


def binding_error(fn_name: str, error, positional: list, fix: str) -> TypeError:
    """The TypeError for a call Python could not bind (``error``, its message), naming the
    ``positional`` parameters."""
    what = f"{error} (expected positional arguments {', '.join(positional)})"
    return bad(TypeError, fn_name, what, fix)


def unknown_options(fn_name, noun, unknown, valid, model_kwargs=None, renamed=None) -> TypeError:
    """The TypeError for the ``unknown`` options (``noun``: what messages call them) among
    ``valid``: a fix for each renamed (``renamed``: its fix), misspelt or NTK-only one; the
    others may be model keywords (``model_kwargs``: where those go, if anywhere)."""
    renamed = renamed or {}
    fixes = [renamed.get(u) or _fix(u, valid) for u in unknown]
    fixes = [f for f in fixes if f]
    if len(fixes) < len(unknown):  # the others: perhaps the model's own keywords
        fixes.append(f"pass model keywords through {model_kwargs}" if model_kwargs else "drop them")
    what = f"unknown {noun} {', '.join(map(repr, unknown))}; valid options are {', '.join(valid)}"
    return bad(TypeError, fn_name, what, "; ".join(fixes))


def _fix(option: str, valid) -> str | None:
    close = misspelt(option, valid)
    if close:
        return f"write {close}= (not {option}=)"
    return ntk_only(option) if option in NTK_ONLY else None


def ntk_only(option: str) -> str:
    """The fix for an NTK-only option given to an NNGP function."""
    return f"drop {option}= (the NNGP takes no derivative; {option}= is an NTK option)"


#: Where the model's own keywords go: the adapters take apply_kwargs, the core apply_fn.
_MODEL_KEYWORDS = ("apply_kwargs", "apply_fn")
