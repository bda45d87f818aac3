"""Helpers around the pure ``apply3(params, x, aux)`` that every implementation uses.

``aux`` is a pytree passed through untouched and never differentiated (the adapters
carry Flax's non-``params`` collections and Haiku's state and rng in it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _caches


def per_sample(apply3):
    """``apply3`` on one sample: adds batch axis 0 to the inputs, removes it from outputs."""

    def single(params, x_i, aux):
        x_b = jax.tree.map(lambda leaf: jnp.expand_dims(leaf, 0), x_i)
        out = apply3(params, x_b, aux)
        return jax.tree.map(lambda leaf: leaf[0], out)

    return single


@_caches.lru_cache(maxsize=64)
def from_apply_fn(apply_fn):
    """Wraps a public ``apply_fn(params, x)`` as ``apply3(params, x, aux)``.

    Cached, so kernel functions of the same ``apply_fn`` share compiled Jacobians.
    """

    def apply3(params, x, aux):
        del aux
        return apply_fn(params, x)

    return apply3


def _abstract(leaf):
    """A leaf's hashable signature for :func:`per_sample_jaxpr`'s cache."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        weak = getattr(getattr(leaf, "aval", None), "weak_type", False)
        # The dtype as JAX traces it (a float64 numpy array is float32 without x64).
        try:
            dtype = jax.dtypes.canonicalize_dtype(leaf.dtype)
        except (TypeError, ValueError):  # extended dtypes (random keys) stay as they are
            dtype = leaf.dtype
        return (tuple(leaf.shape), str(dtype), weak)
    return (type(leaf).__name__, np.shape(leaf), str(np.result_type(leaf)))


def per_sample_jaxpr(apply3, params, x_one, aux):
    """``jax.make_jaxpr(per_sample(apply3))(params, x_one, aux)``, traced once per
    model and per-sample signature (tree structures, shapes, dtypes as traced): the
    structured analysis, the cost model and the features' chunk size all read this
    one jaxpr (before, each traced the model again). The default matmul precision is
    not part of the jaxpr (it applies when the equations are lowered)."""
    leaves, treedef = jax.tree.flatten((params, x_one, aux))
    key = (apply3, treedef, tuple(_abstract(v) for v in leaves))
    return _traced(key, params, x_one, aux)


_JAXPRS: dict = {}
_caches.register(_JAXPRS.clear)
_MAX_JAXPRS = 32


def _traced(key, params, x_one, aux):
    closed = _JAXPRS.pop(key, None)
    if closed is None:
        closed = jax.make_jaxpr(per_sample(key[0]))(params, x_one, aux)
        while len(_JAXPRS) >= _MAX_JAXPRS:  # bounded: the oldest goes first
            _JAXPRS.pop(next(iter(_JAXPRS)))
    _JAXPRS[key] = closed  # most recently used last
    return closed
