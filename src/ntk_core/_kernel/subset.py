"""Parameter subsets (``wrt=``): the kernel with respect to some parameter leaves, the
others held fixed. Θ_S(x1, x2) = Σ_{p ∈ S} ∂f(x1)/∂θ_p · ∂f(x2)/∂θ_p, so Θ = Σ_S Θ_S over
any partition of the leaves.

The selected leaves stay where they are in the params pytree, with None in place of the
held ones (None is an empty subtree to JAX), and the held leaves travel with the model's
fixed parts: ``apply3(selected, x, (aux, held))``. Every implementation, the blocked
engine, ``out=`` and the devices then differentiate only the subset, so the cost scales
with its size (Malladi et al., "A Kernel-Based View of Language Model Fine-Tuning", ICML
2023, use such kernels of fine-tuned subsets).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from ntk_core._errors import bad
from ntk_core._kernel.arguments import misspelt


def _name(entry):
    """One key of a key path as a plain value: dict key, attribute name or index."""
    for field in ("key", "name", "idx"):
        if hasattr(entry, field):
            return getattr(entry, field)
    return str(entry)


def path_of(path) -> tuple:
    """A JAX key path as a tuple of names, e.g. ``("Dense_0", "kernel")``."""
    return tuple(_name(e) for e in path)


def joined(path: tuple) -> str:
    return "/".join(map(str, path))


def _selects(wrt, path: tuple) -> bool:
    if callable(wrt):
        chosen = wrt(path)
        if not isinstance(chosen, (bool, np.bool_)):
            raise TypeError(f"it returned {type(chosen).__name__} {chosen!r}, not a bool")
        return bool(chosen)
    text = joined(path)
    return any(text == n or text.startswith(n + "/") for n in wrt)


def split(fn_name: str, wrt, params, aux, masks: dict):
    """``(selected, (aux, held))``: ``params`` with None at the held leaves, and the held
    leaves with None at the selected ones; ValueError when nothing is selected or a name
    selects no leaf. ``masks``: the selection per params tree structure, decided once (a
    training loop's calls only flatten and unflatten)."""
    values, tree = jax.tree.flatten(params)
    chosen = masks.get(tree)
    if chosen is None:
        paths = [path_of(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        chosen = masks[tree] = _chosen(fn_name, wrt, paths)
    selected = [v if c else None for v, c in zip(values, chosen, strict=True)]
    held = [None if c else v for v, c in zip(values, chosen, strict=True)]
    return tree.unflatten(selected), (aux, tree.unflatten(held))


def _chosen(fn_name: str, wrt, paths: list) -> tuple[bool, ...]:
    """Whether ``wrt`` selects each leaf of ``paths``, or the error of a bad ``wrt``."""
    chosen = []
    for path in paths:
        try:
            chosen.append(_selects(wrt, path))
        except Exception as e:  # the user's predicate: say on which path it failed
            what = f"wrt(path) raised {type(e).__name__}: {e} on the path {path!r}"
            fix = "make wrt(path) take the path, a tuple of keys (str or int), and return a bool"
            raise bad(TypeError, fn_name, what, fix) from e
    if not callable(wrt):
        for name in wrt:
            if not any(_selects((name,), p) for p in paths):
                prefixes = sorted({joined(p[:i]) for p in paths for i in range(1, len(p) + 1)})
                near, whole = misspelt(name, prefixes), joined(wrt)
                fix = f"write {near!r}" if near else f"name one of {', '.join(prefixes[:6])}"
                if not prefixes:  # params is one array: no names
                    fix = "pass params as a dict of named arrays, or wrt=None for the one array"
                if len(wrt) > 1 and any(_selects((whole,), p) for p in paths):
                    fix = f"write {whole!r}: a list or tuple is several names, a path one string"
                raise bad(ValueError, fn_name, f"wrt names {name!r}, which no parameter has", fix)
    if not any(chosen):
        shown = ", ".join(map(repr, paths[:3])) + (", ..." if len(paths) > 3 else "")
        what = f"wrt selects none of the {len(paths)} parameter leaves, whose paths are {shown}"
        raise bad(ValueError, fn_name, what, "check the predicate against these paths")
    return tuple(chosen)


def _merge(selected, held):
    return jax.tree.map(lambda s, h: h if s is None else s, selected, held, is_leaf=_none)


def _none(v) -> bool:
    return v is None


@dataclasses.dataclass(frozen=True)
class OnSubset:
    """``apply3`` (or an adapter's ``check``) of the whole params, called on a subset;
    equal for equal functions, so that kernel functions share compiled programs."""

    fn: Callable

    def __call__(self, selected, *args):
        x_or_x1, *rest, (aux, held) = args
        return self.fn(_merge(selected, held), x_or_x1, *rest, aux)
