"""What the framework adapters share: option checking and the sample-independence probe.

Used by ``ntk_flax`` and ``ntk_haiku``; not part of the public API.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping

import jax
import numpy as np

from . import _caches
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


def _param_shapes(tree) -> dict[str, tuple[int, ...]]:
    return {
        jax.tree_util.keystr(path): tuple(np.shape(leaf))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def input_shape_mismatch(
    fn_name: str, params_name: str, params, init_params: Callable, x1, init_call: str
) -> ValueError | None:
    """The ValueError for params made by the model's init for inputs of another shape
    than x1's (e.g. a Dense layer initialised for 3 features, given 5), else ``None``.

    Compares shapes, not the framework's error text: ``init_params(x)`` returns the
    parameters the model's init makes for inputs ``x`` (run under ``jax.eval_shape``, so
    nothing is computed). When params and the parameters made for x1 have the same
    leaves but some shapes differ, the inputs do not fit; changing one axis of x1 to the
    size the first differing parameter was made for, and finding that init then makes
    exactly params' shapes, gives the per-sample shape the model was initialised with.
    Error path only: a few abstract traces of init.
    """

    def made_for(x):
        try:
            return _param_shapes(jax.eval_shape(init_params, x))
        except Exception:  # the model cannot be initialised on x: not this mistake
            return None

    given = _param_shapes(params)
    for_x1 = made_for(x1)
    if for_x1 is None or set(for_x1) != set(given):
        return None  # init fails on x1 too, or params of another model: not this mistake
    differ = [(k, given[k], for_x1[k]) for k in given if given[k] != for_x1[k]]
    if not differ:
        return None
    path, has, needs = differ[0]
    sizes = sorted({(n, h) for h, n in zip(has, needs, strict=False) if h != n})

    def original_shape():
        """(x1's leaf name, its per-sample shape, the one params were made for)."""
        leaves, treedef = jax.tree_util.tree_flatten(x1)
        names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(x1)]
        for i, leaf in enumerate(leaves):
            shape = tuple(np.shape(leaf))
            dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
            for axis in range(1, len(shape)):
                for need, had in sizes:
                    if shape[axis] != need:
                        continue
                    new = shape[:axis] + (had,) + shape[axis + 1 :]
                    trial = list(leaves)
                    trial[i] = jax.ShapeDtypeStruct(new, dtype)
                    if made_for(jax.tree_util.tree_unflatten(treedef, trial)) == given:
                        return f"x1{names[i]}", shape[1:], new[1:]
        return None

    more = f" ({len(differ) - 1} more parameter(s) differ)" if len(differ) > 1 else ""
    init_name = init_call.split("=")[-1].split("(")[0].strip()
    found = original_shape()
    if found is not None:
        name, sample, original = found
        return ValueError(
            f"{fn_name}: applying the model to x1 failed: {name} has per-sample shape "
            f"{sample}, but {params_name} were made by {init_name} for inputs of per-sample "
            f"shape {original}: parameter {path} has shape {has}, but inputs like x1 need "
            f"{needs}{more}. Fix: pass {'inputs' if name == 'x1' else name} of "
            f"shape (N, {', '.join(map(str, original))}), the shape the model was initialised "
            f"with, or re-initialise it for these inputs ({init_call})."
        )
    samples = [tuple(np.shape(v))[1:] for v in jax.tree.leaves(x1)]
    return ValueError(
        f"{fn_name}: applying the model to x1 failed: {params_name} do not fit inputs of "
        f"x1's per-sample shape{'s' if len(samples) > 1 else ''} "
        f"{', '.join(map(str, samples))}: parameter {path} has shape {has}, but the "
        f"model's init on x1 makes {needs}{more}. Fix: pass inputs of the per-sample "
        f"shape the model was initialised with, and {params_name} made by this model's "
        f"init (the same model built with other sizes makes other shapes), or "
        f"re-initialise it for these inputs ({init_call})."
    )


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


def bound_kernel(
    fn_name: str,
    kernel: KernelFunction,
    to_core,
    keywords: tuple[str, ...],
    *,
    with_x1: bool = False,
):
    """The function an adapter returns: ``call(first, x1, x2=None, **keywords)``, with
    ``.implementation_for`` and ``.plan`` taking the same arguments.

    ``to_core(first, **keywords) -> (params, aux)`` turns the adapter's arguments (Flax
    ``variables`` and ``rngs``, Haiku ``params``, ``state`` and ``rng``) into the core's;
    with ``with_x1``, ``to_core(first, x1, **keywords)`` also sees x1 (Flax reads what
    ``variables`` is from the model's init on x1). A keyword outside ``keywords`` gets a
    TypeError naming the valid ones.
    """

    def core_arguments(first, x1, given):
        unknown = sorted(set(given) - set(keywords))
        if unknown:
            raise TypeError(
                f"{fn_name}(...)(...): unknown keyword argument(s) "
                f"{', '.join(map(repr, unknown))}; the kernel function takes "
                f"{', '.join(f'{k}=' for k in keywords)}. Fix: give kernel options when "
                f"building it, and model arguments through apply_kwargs={{...}}."
            )
        return to_core(first, x1, **given) if with_x1 else to_core(first, **given)

    def call(first, x1, x2=None, **given):
        params, aux = core_arguments(first, x1, given)
        return kernel(params, x1, x2, aux)

    def implementation_for(first, x1, x2=None, **given) -> str:
        params, aux = core_arguments(first, x1, given)
        return kernel.implementation_for(params, x1, x2, aux)

    def plan(first, x1, x2=None, **given):
        params, aux = core_arguments(first, x1, given)
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
        _caches.register(self._items.clear)  # ntk_core.clear_caches() empties it

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
