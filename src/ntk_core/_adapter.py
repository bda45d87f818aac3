"""What the framework adapters share: option checking and the sample-independence probe.

Used by ``ntk_flax`` and ``ntk_haiku``; not part of the public API.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from ._engine import KernelFunction
from ._options import NNGP_OPTION_NAMES, NTK_OPTION_NAMES, make_options

#: Options of the other framework's spelling, per adapter: the fix to give instead.
_RENAMED = {
    "ntk_haiku": {
        "rngs": "pass rng=key (Haiku takes one PRNG key, not rngs=)",
        "mutable": "pass state= for an hk.TransformedWithState (Haiku has no mutable=)",
    },
    "ntk_flax": {"rng": "pass rngs={'dropout': key} (Flax takes a dict of PRNG keys, not rng=)"},
}


def check_apply_kwargs(fn_name: str, apply_kwargs, example: str) -> dict:
    """``apply_kwargs`` as a dict (``None`` -> ``{}``); a TypeError naming ``example``
    (e.g. ``"{'train': False}"``) for anything that is not a mapping."""
    if apply_kwargs is not None and not isinstance(apply_kwargs, Mapping):
        raise TypeError(
            f"{fn_name}: apply_kwargs must be a dict of the model's keyword arguments, got "
            f"{type(apply_kwargs).__name__} {apply_kwargs!r}. Fix: pass e.g. "
            f"apply_kwargs={example}."
        )
    return dict(apply_kwargs or {})


def kernel_function(fn_name: str, kind: str, apply3, options: dict, check=None, hint: str = ""):
    """Validates ``options`` (names and values) and builds a :class:`KernelFunction`."""
    valid = NNGP_OPTION_NAMES if kind == "nngp" else NTK_OPTION_NAMES
    unknown = sorted(set(options) - set(valid))
    if unknown:
        renamed = _RENAMED.get(fn_name.split(".")[0], {})
        fixes, model_kwargs = [], False
        for u in unknown:
            close = difflib.get_close_matches(u, valid, 1)
            if u in renamed:
                fixes.append(renamed[u])
            elif close:  # a misspelt option, e.g. trace_axis
                fixes.append(f"write {close[0]}= (not {u}=)")
            else:
                model_kwargs = True
        if model_kwargs:
            fixes.append("pass model keyword arguments through apply_kwargs={...}")
        raise TypeError(
            f"{fn_name}: unknown option(s) {', '.join(map(repr, unknown))}; valid options are "
            f"{', '.join(valid)}. Fix: {'; '.join(fixes)}."
        )
    return KernelFunction(fn_name, kind, apply3, make_options(fn_name, **options), check, hint)


def bound_kernel(fn_name: str, kernel: KernelFunction, to_core, keywords: tuple[str, ...]):
    """The function an adapter returns: ``call(first, x1, x2=None, **keywords)``, with
    ``.implementation_for`` and ``.plan`` taking the same arguments.

    ``to_core(first, **keywords) -> (params, aux)`` turns the adapter's arguments (Flax
    ``variables`` and ``rngs``, Haiku ``params``, ``state`` and ``rng``) into the core's;
    a keyword outside ``keywords`` gets a TypeError naming the valid ones.
    """

    def core_arguments(first, given):
        unknown = sorted(set(given) - set(keywords))
        if unknown:
            raise TypeError(
                f"{fn_name}(...)(...): unknown keyword argument(s) "
                f"{', '.join(map(repr, unknown))}; the kernel function takes "
                f"{', '.join(f'{k}=' for k in keywords)}. Fix: give kernel options when "
                f"building it, and model arguments through apply_kwargs={{...}}."
            )
        return to_core(first, **given)

    def call(first, x1, x2=None, **given):
        params, aux = core_arguments(first, given)
        return kernel(params, x1, x2, aux)

    def implementation_for(first, x1, x2=None, **given) -> str:
        params, aux = core_arguments(first, given)
        return kernel.implementation_for(params, x1, x2, aux)

    def plan(first, x1, x2=None, **given):
        params, aux = core_arguments(first, given)
        return kernel.plan(params, x1, x2, aux)

    call.implementation_for = implementation_for
    call.plan = plan
    return call


def freeze(value):
    """A hashable stand-in for nested dicts and lists (for cache keys)."""
    if isinstance(value, dict):
        return (dict, tuple(sorted((k, freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(freeze(v) for v in value))
    return value


class BuildCache:
    """A small FIFO cache of built kernel functions, so one-call entry points such as
    ``ntk_flax.kernel`` reuse the compiled function of an equal earlier call."""

    def __init__(self, size: int = 32):
        self._size = size
        self._items: dict = {}

    def get(self, key, build):
        try:
            hash(key)
        except TypeError:
            return build()
        fn = self._items.get(key)
        if fn is None:
            if len(self._items) >= self._size:
                self._items.pop(next(iter(self._items)))
            fn = self._items[key] = build()
        return fn
