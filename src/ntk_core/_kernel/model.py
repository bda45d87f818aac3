"""Helpers around the pure ``apply3(params, x, aux)``; ``aux`` is never differentiated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from ntk_core._jax import caches as _caches


def one_sample(x):
    """The abstract shapes of one sample of ``x`` (axis 0 dropped)."""
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v)[1:], v.dtype), x)


class NotPerSample(ValueError):
    """The model dropped the batch axis of a batch of one (squeeze, batch mean, fixed N);
    ``shape``: the output it returned."""

    def __init__(self, shape: tuple):
        super().__init__(f"on a batch of one the model returned {shape}, not (1, ...)")
        self.shape = shape


def per_sample(apply3):
    """``apply3`` on one sample (batch axis added, then removed); may raise NotPerSample."""

    def single(params, x_i, aux):
        x_b = jax.tree.map(lambda leaf: jnp.expand_dims(leaf, 0), x_i)
        out = apply3(params, x_b, aux)
        for leaf in jax.tree.leaves(out):
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] != 1:
                raise NotPerSample(tuple(np.shape(leaf)))
        return jax.tree.map(lambda leaf: leaf[0], out)

    return single


@_caches.lru_cache(maxsize=64)
def from_apply_fn(apply_fn):
    """``apply_fn(params, x)`` as ``apply3(params, x, aux)``, cached per ``apply_fn``."""

    def apply3(params, x, aux):
        del aux
        return apply_fn(params, x)

    return apply3


@_caches.lru_cache(maxsize=64)
def _flat_outputs(apply_fn, summed: bool):
    def apply(params, x, *aux):  # apply_fn(params, x) or an adapter's apply3(params, x, aux)
        leaves = [v.reshape(v.shape[0], -1) for v in jax.tree.leaves(apply_fn(params, x, *aux))]
        flat = leaves[0] if len(leaves) == 1 else jnp.concatenate(leaves, axis=1)
        return flat.sum(axis=1) / np.sqrt(flat.shape[1]) if summed else flat

    return apply


def flat_outputs(apply_fn, *, summed: bool = False):
    """``apply_fn`` with its output leaves flattened to ``(N, O_l)`` and concatenated,
    ``(N, O)``; ``summed``: Σ_a f_a / √O per sample, ``(N,)`` (the pseudo-NTK's function).
    Cached per ``apply_fn`` (the same wrapper, so the kernel caches hit)."""
    try:
        return _flat_outputs(apply_fn, summed)
    except TypeError:  # unhashable callable
        return _flat_outputs.__wrapped__(apply_fn, summed)


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


def per_sample_jaxpr(apply3, params, x_one, aux, *, precision: str):
    """The jaxpr of ``per_sample(apply3)`` under ``precision`` (written into each dot),
    traced once per model, per-sample signature and precision, read by every phase."""
    return per_sample_trace(apply3, params, x_one, aux, precision=precision)[0]


def per_sample_trace(apply3, params, x_one, aux, *, precision: str):
    """``(closed jaxpr, one sample's output shapes)`` of :func:`per_sample_jaxpr`, cached."""
    leaves, treedef = jax.tree.flatten((params, x_one, aux))
    key = (apply3, precision, treedef, tuple(_abstract(v) for v in leaves))
    found = _JAXPRS.pop(key, None)
    if found is None:
        with jax.default_matmul_precision(precision):
            found = jax.make_jaxpr(per_sample(apply3), return_shape=True)(params, x_one, aux)
        while len(_JAXPRS) >= _MAX_JAXPRS:  # bounded: the oldest goes first
            _JAXPRS.pop(next(iter(_JAXPRS)))
    _JAXPRS[key] = found  # most recently used last
    return found


def replay(apply3, precision: str):
    """``per_sample(apply3)`` evaluated from its cached jaxpr, without calling the model."""

    def single(params, x_i, aux):
        closed, out = per_sample_trace(apply3, params, x_i, aux, precision=precision)
        flat = jax.tree.leaves((params, x_i, aux))
        outs = jex.jaxpr_as_fun(closed)(*flat)
        return jax.tree.unflatten(jax.tree.structure(out), outs)

    return single


_JAXPRS: dict = {}
_caches.register(_JAXPRS.clear)
_MAX_JAXPRS = 32
