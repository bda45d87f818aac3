"""What the framework adapters share: option checking and the sample-independence probe.

Used by ``ntk_flax`` and ``ntk_haiku``; not part of the public API.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._engine import KernelFunction
from ._options import make_options

NTK_OPTIONS = ("trace_axes", "diagonal_axes", "vmap_axes", "implementation", "precision")
NNGP_OPTIONS = ("trace_axes", "diagonal_axes", "vmap_axes", "precision")


def kernel_function(fn_name: str, kind: str, apply3, options: dict, check=None):
    """Validates ``options`` (names and values) and builds a :class:`KernelFunction`."""
    valid = NTK_OPTIONS if kind == "ntk" else NNGP_OPTIONS
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(
            f"{fn_name}: unknown option(s) {', '.join(map(repr, unknown))}; valid options are "
            f"{', '.join(valid)}. Fix: pass model keyword arguments through apply_kwargs={{...}}."
        )
    return KernelFunction(fn_name, kind, apply3, make_options(fn_name, **options), check)


def _take(x, index):
    return jax.tree.map(lambda leaf: jnp.asarray(leaf)[index : index + 1], x)


def samples_interact(apply3, params, x1, x2, aux, rtol: float = 1e-4) -> bool:
    """True when the output for one sample depends on the other samples of its batch.

    Runs the model on two samples together and on the first alone (two small forward
    passes) and compares the first sample's outputs. Detects BatchNorm in training mode
    and any other cross-sample coupling; returns False when fewer than two samples exist.
    """
    n1 = jax.tree.leaves(x1)[0].shape[0]
    if n1 >= 2:
        first, second = _take(x1, 0), _take(x1, 1)
    elif x2 is not None:
        first, second = _take(x1, 0), _take(x2, 0)
    else:
        return False
    pair = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), first, second)
    apply_jit = jax.jit(apply3)
    together = jax.tree.leaves(apply_jit(params, pair, aux))
    alone = jax.tree.leaves(apply_jit(params, first, aux))
    for t, a in zip(together, alone, strict=True):
        t0, a0 = np.asarray(t[:1], np.float64), np.asarray(a, np.float64)
        scale = max(np.abs(a0).max(initial=0.0), 1e-30)
        if np.abs(t0 - a0).max(initial=0.0) > rtol * scale:
            return True
    return False


def freeze(value):
    """A hashable stand-in for nested dicts and lists (for cache keys)."""
    if isinstance(value, dict):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
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
