"""Python's binding errors of the public functions (an unknown or misspelt option, too
many positional arguments, a missing one) as TypeErrors naming the valid options."""

from __future__ import annotations

import difflib
import functools
import inspect


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


def _message(name: str, signature: inspect.Signature, args, kwargs, error) -> str:
    params = signature.parameters
    options = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = ", ".join(n for n, p in params.items() if p.kind in kinds)
    unknown = sorted(set(kwargs) - set(params))
    if not unknown:
        reason = f"{error} (expected positional arguments {positional})."
        fix = f"call {name}({positional}, *, option=...); options are keyword-only."
        missing = _first_missing(signature, args, kwargs)
        if missing in options:
            fix = f"pass {missing}=... by keyword (it is keyword-only)."
        return f"{name}: {reason} Fix: {fix}"
    close = {u: difflib.get_close_matches(u, options, 1) for u in unknown}
    guess = "".join(f" Did you mean {c[0]!r} for {u!r}?" for u, c in close.items() if c)
    valid = "the kernel options and " if "apply_kwargs" in params else ""  # the adapters
    reason = f"unknown keyword argument(s) {', '.join(map(repr, unknown))}; valid options are "
    reason += f"{valid}{', '.join(options)}.{guess}"
    fix = "use those option names"
    if "apply_kwargs" in params:
        fix += "; keyword arguments of the model go in apply_kwargs={...}"
    elif "apply_fn" in params:
        fix += "; keyword arguments of the model go into apply_fn, e.g. "
        fix += "functools.partial(model.apply, train=False)"
    return f"{name}: {reason} Fix: {fix}."
