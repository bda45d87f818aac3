"""``"jacobian"``: the phases of :mod:`ntk_core._impl.jacobian` (:data:`JACOBIAN`)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._impl import cost as _cost
from ntk_core._impl import jacobian as _jacobian
from ntk_core._impl.base import PRECISION, Impl, finish, jit_tuned
from ntk_core._jax import caches as _caches
from ntk_core._jax.batches import even_batches
from ntk_core._kernel.model import replay


def features(apply3, config, chunks):
    """``features(params, x_block, aux)``, jitted (``chunks`` unused)."""
    jac = _jacobian_features(apply3, config.vmap_axes, config.precision)
    chunk = None if config.whole_batch is None else config.whole_batch.chunk
    jac = functools.partial(
        jac, out_tree=config.out_tree, merge_limits=merge_limits(config), cotangent_chunk=chunk
    )
    if chunk is None or chunk >= config.whole_batch.cotangents:
        return jac
    return functools.partial(_whole_batch_features, apply3, jac, config)


@_caches.lru_cache(maxsize=64)
def _jacobian_features(apply3, vmap_axes, precision):
    def features(params, x, aux, *, out_tree, merge_limits, cotangent_chunk):
        with jax.default_matmul_precision(precision):
            args = (apply3, params, x, aux, vmap_axes, out_tree, merge_limits, cotangent_chunk)
            return _jacobian.jacobians(*args, replay(apply3, precision))

    return jit_tuned(features, static_argnames=("out_tree", "merge_limits", "cotangent_chunk"))


@_caches.lru_cache(maxsize=64)
def _whole_batch_phases(apply3, precision):
    """Jitted ``rows`` (one chunk of Jacobian rows) and ``assemble`` (the chunks)."""

    def rows(params, x, aux, start, *, size):
        with jax.default_matmul_precision(precision):
            index = start + jnp.arange(size)
            return _jacobian.whole_batch_rows(lambda p: apply3(p, x, aux), params, index)

    def assemble(params, x, aux, parts, *, skip, out_tree, merge_limits):
        last = jax.tree.map(lambda v: v[skip:], parts[-1])
        flat = jax.tree.map(lambda *v: jnp.concatenate(v), *parts[:-1], last)
        out_shapes = jax.eval_shape(apply3, params, x, aux)
        jac = _jacobian.rows_as_jacobian(flat, out_shapes)
        return _jacobian.matrices(jac, params, out_tree, merge_limits)

    return (
        jax.jit(rows, static_argnames=("size",)),
        jax.jit(assemble, static_argnames=("skip", "out_tree", "merge_limits")),
    )


def _whole_batch_features(apply3, in_program, config, params, x, aux):
    """Whole-batch features, cotangent chunks looped from Python (XLA CPU runs conv
    reverse passes ~8x slower in an XLA loop); traced: ``in_program``."""
    if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves((params, x, aux))):
        return in_program(params, x, aux)
    rows, assemble = _whole_batch_phases(apply3, config.precision)
    n = jax.tree.leaves(x)[0].shape[0]
    total = n * sum(math.prod(s.shape[1:]) for s in config.shapes1)
    size, starts = even_batches(total, config.whole_batch.chunk)
    parts = [rows(params, x, aux, np.int32(start), size=size) for start in starts]
    skip = (starts[-2] + size - starts[-1]) if len(starts) > 1 else 0
    limits = merge_limits(config)
    return assemble(params, x, aux, parts, skip=skip, out_tree=config.out_tree, merge_limits=limits)


def merge_limits(config) -> tuple[int, ...] | None:
    """Per output leaf, :func:`_jacobian.merge_limit`; None for per-leaf kernels or the
    batch diagonal."""
    if config.kind != "ntk" or config.layouts[0].batch_diagonal:
        return None
    n = max(config.shapes1[0].shape[0], config.n2)
    limits = []
    for s, layout in zip(config.shapes1, config.layouts, strict=True):
        pair = layout.values_per_pair(s.shape)
        limit = _jacobian.merge_limit(n, math.prod(s.shape[1:]), pair)
        # Snapped to a width that occurs: a new N that groups alike reuses the compilation.
        limits.append(max((w for w in config.param_sizes if w <= limit), default=0))
    return tuple(limits)


def contract(j1, j2, *, config):
    j2 = j1 if j2 is None else j2
    with jax.default_matmul_precision(config.precision):
        per_leaf = _jacobian.contract(config.layouts, j1, j2, PRECISION[config.precision])
    return finish(per_leaf, config)


def pair_terms(config) -> int:
    return config.params_tree.num_leaves


def feature_bytes(config) -> int:
    """One sample's per-sample Jacobians: O·P values in the outputs' dtype."""
    outputs = sum(math.prod(s.shape[1:]) for s in config.shapes1)
    itemsize = max(np.dtype(s.dtype).itemsize for s in config.shapes1)
    return outputs * sum(config.param_sizes) * itemsize


JACOBIAN = Impl(
    estimate=_cost.jacobian_estimate,
    name="jacobian",
    title="Jacobian contraction",
    features=features,
    contract=contract,
    separates_leaves=True,
    whole_batch_as="jacobian",
    cotangent_chunks=True,
    pair_terms=pair_terms,
    feature_bytes=feature_bytes,
)
