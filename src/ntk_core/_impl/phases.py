"""The implementations: each a ``features`` phase (per sample, O(N)) and a ``contract``
phase (per pair, O(N1·N2)), compiled.

The third part of a kernel call (docs/architecture.md). :func:`build` turns a
:class:`~ntk_core._kernel.pipeline.Config` into an
:class:`~ntk_core._kernel.pipeline.Implementation` (its jitted ``features`` and
``tile``), which the executors call:

* ``"jacobian"``: per-sample Jacobians (:mod:`ntk_core._impl.jacobian`; with
  ``vmap_axes=None`` the whole batch's, cotangents in chunks), then their contraction;
* ``"structured"``: layer inputs and cotangents (:mod:`ntk_core._structured.analysis` and its
  rules), then Gram identities per group of leaves;
* ``"ntvp"``: no features; NTK-vector products on the two blocks' inputs
  (:mod:`ntk_core._impl.ntvp`);
* ``"nngp"``: the model's outputs, then their dot products.

The compiled phases are module-level functions of their static arguments (no kernel
function's state), so two kernel functions of the same model and configuration share
their compilations.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ntk_core._blocked import tiles as _blocked
from ntk_core._impl import jacobian as _jacobian
from ntk_core._impl import ntvp as _ntvp
from ntk_core._jax import caches as _caches
from ntk_core._jax.batches import even_batches
from ntk_core._kernel.model import replay
from ntk_core._kernel.pipeline import Config, Implementation
from ntk_core._kernel.validate import signature
from ntk_core._structured import analysis as _structured

_PRECISION = {
    "highest": lax.Precision.HIGHEST,
    "high": lax.Precision.HIGH,
    "default": lax.Precision.DEFAULT,
}


def build(apply3, config: Config, chunks: dict) -> Implementation:
    """The two compiled phases of ``config.implementation`` for ``apply3``.

    Args:
      apply3: ``apply3(params, x, aux)``, the model.
      config: the plan of the call (:func:`ntk_core._kernel.planner.configure`).
      chunks: the structured features' chunk sizes already found, per configuration
        and input signature (read and updated).
    """
    tile = functools.partial(_TILE, apply3=apply3, config=config)
    return Implementation(
        config.implementation,
        _features(apply3, config, chunks),
        lambda params, fa, fb, aux, xa, xb, same: tile(params, fa, fb, aux, xa, xb, same=same),
    )


def _features(apply3, config: Config, chunks: dict):
    """``features(params, x_block, aux)``, jitted, or None for ``"ntvp"``."""
    impl = config.implementation
    if impl == "jacobian":
        jac = _jacobian_features(apply3, config.vmap_axes, config.precision)
        chunk = None if config.whole_batch is None else config.whole_batch.chunk
        jac = functools.partial(
            jac,
            out_tree=config.out_tree,
            merge_limits=merge_limits(config),
            cotangent_chunk=chunk,
        )
        if chunk is None or chunk >= config.whole_batch.cotangents:
            return jac
        return functools.partial(_whole_batch_features, apply3, jac, config)
    if impl == "structured":
        feat = _structured_features(apply3, config.precision, config.fuse_bias)
        feat = functools.partial(
            feat,
            out_tree=config.out_tree,
            modes=config.structure.modes,
            merge_limits=merge_limits(config),
        )
        return functools.partial(_structured_in_chunks, apply3, feat, config, chunks)
    if impl == "nngp":
        return functools.partial(_OUTPUTS, apply3=apply3, config=config)
    return None


# -- features ------------------------------------------------------------------------


@_caches.lru_cache(maxsize=64)
def _jacobian_features(apply3, vmap_axes, precision):
    """The jitted first phase of ``"jacobian"``: per-sample Jacobians of one batch.

    Shared by every kernel function of the same ``apply3`` and the same
    ``merge_limits`` (:func:`merge_limits`), so changing ``trace_axes`` or
    ``diagonal_axes`` recompiles the contraction, and the features only where the
    kernel values per pair change.
    """

    def features(params, x, aux, *, out_tree, merge_limits, cotangent_chunk):
        with jax.default_matmul_precision(precision):
            return _jacobian.jacobians(
                apply3,
                params,
                x,
                aux,
                vmap_axes,
                out_tree,
                merge_limits,
                cotangent_chunk,
                single=replay(apply3, precision),
            )

    return jax.jit(features, static_argnames=("out_tree", "merge_limits", "cotangent_chunk"))


@_caches.lru_cache(maxsize=64)
def _whole_batch_phases(apply3, precision):
    """The jitted phases of ``"jacobian"`` with ``vmap_axes=None`` in cotangent chunks
    driven from Python (:func:`_whole_batch_features`): ``rows`` (one chunk of
    Jacobian rows from ``start``) and ``assemble`` (the chunks, their overlap dropped,
    as :func:`_jacobian.jacobians` returns the Jacobians)."""

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


def _whole_batch_features(apply3, in_program, config: Config, params, x, aux):
    """``"jacobian"`` features of a whole batch (``vmap_axes=None``), the output
    cotangents pulled back ``config.whole_batch.chunk`` at a time by a loop in
    Python over one compiled chunk, so that memory stays within the budget at the
    speed of one pass (XLA CPU runs convolutions' reverse passes about 8x slower
    inside an XLA loop). Under an outer ``jax.jit`` the chunks loop inside the
    program instead (``in_program``)."""
    if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves((params, x, aux))):
        return in_program(params, x, aux)
    rows, assemble = _whole_batch_phases(apply3, config.precision)
    n = jax.tree.leaves(x)[0].shape[0]
    total = n * sum(math.prod(s.shape[1:]) for s in config.shapes1)
    size, starts = even_batches(total, config.whole_batch.chunk)
    parts = [rows(params, x, aux, np.int32(start), size=size) for start in starts]
    skip = (starts[-2] + size - starts[-1]) if len(starts) > 1 else 0
    return assemble(
        params,
        x,
        aux,
        parts,
        skip=skip,
        out_tree=config.out_tree,
        merge_limits=merge_limits(config),
    )


@_caches.lru_cache(maxsize=64)
def _structured_features(apply3, precision, fuse_bias):
    """The jitted first phase of ``"structured"``: layer inputs, cotangents, fallbacks,
    ``chunk`` samples at a time."""

    def features(params, x, aux, *, out_tree, modes, merge_limits, chunk):
        with jax.default_matmul_precision(precision):
            return _structured.features_in_chunks(
                apply3,
                params,
                x,
                aux,
                out_tree,
                fuse_bias,
                modes,
                merge_limits,
                chunk,
                precision=precision,
            )

    return jax.jit(features, static_argnames=("out_tree", "modes", "merge_limits", "chunk"))


def _structured_in_chunks(apply3, features, config: Config, chunks: dict, params, x, aux):
    """``features(params, x, aux)`` computed :func:`_structured.chunk_size` samples
    at a time (:func:`_structured.features_in_chunks`); the chunk size is cached in
    ``chunks`` per configuration and input shapes."""
    key = (config, signature(x))
    chunk = chunks.get(key)
    if chunk is None:
        chunk = _structured.chunk_size(
            apply3,
            params,
            x,
            aux,
            config.out_tree,
            config.fuse_bias,
            config.structure.modes,
            precision=config.precision,
        )
        chunks[key] = chunk
    return features(params, x, aux, chunk=chunk)


def _nngp_outputs(params, x, aux, *, apply3, config: Config):
    """The first phase of the NNGP: the model's outputs on one block (with
    ``vmap_axes=0`` one sample at a time from the per-sample jaxpr, which the probe has
    shown equal to the batch's)."""
    with jax.default_matmul_precision(config.precision):
        if config.vmap_axes is None:
            return config.out_tree.flatten_up_to(apply3(params, x, aux))
        single = replay(apply3, config.precision)
        out = jax.vmap(single, in_axes=(None, 0, None))(params, x, aux)
        return config.out_tree.flatten_up_to(out)


_OUTPUTS = jax.jit(_nngp_outputs, static_argnames=("apply3", "config"))


def merge_limits(config: Config) -> tuple[int, ...] | None:
    """Per output leaf, the widest per-leaf Jacobian merged into one contraction
    (:func:`ntk_core._impl.jacobian.merge_limit` with O' the kept output axes squared and
    the diagonal ones once); None where each leaf's kernel is needed apart
    (``"ntk_per_leaf"``) or on the batch diagonal (N kernel values, too few to pay
    for a copy)."""
    if config.kind != "ntk" or config.layouts[0].batch_diagonal:
        return None
    # The larger N: a test-train call (N_test < N_train) then groups like the train
    # Gram matrix before it, and reuses its compiled features.
    n = max(config.shapes1[0].shape[0], config.n2)
    limits = []
    for s, layout in zip(config.shapes1, config.layouts, strict=True):
        pair = layout.values_per_pair(s.shape)
        limit = _jacobian.merge_limit(n, math.prod(s.shape[1:]), pair)
        # Snapped down to a width that occurs (every merged matrix is one parameter
        # leaf's Jacobian): the same grouping, and the same static argument for every N
        # that groups alike, so a new N reuses the compiled features.
        limits.append(max((w for w in config.param_sizes if w <= limit), default=0))
    return tuple(limits)


# -- contractions ----------------------------------------------------------------------


def _finish(per_leaf, config: Config):
    """Per output leaf lists of per-parameter-leaf kernels -> the result pytree."""
    if config.kind == "ntk_per_leaf":
        by_leaf = [
            jax.tree.unflatten(config.out_tree, [terms[i] for terms in per_leaf])
            for i in range(config.params_tree.num_leaves)
        ]
        return jax.tree.unflatten(config.params_tree, by_leaf)
    return jax.tree.unflatten(config.out_tree, [functools.reduce(jnp.add, t) for t in per_leaf])


def _contract_jacobians(j1, j2, *, config: Config):
    with jax.default_matmul_precision(config.precision):
        per_leaf = _jacobian.contract(
            config.layouts, j1, j1 if j2 is None else j2, _PRECISION[config.precision]
        )
    return _finish(per_leaf, config)


def _contract_structured(f1, f2, *, config: Config):
    with jax.default_matmul_precision(config.precision):
        per_leaf = _structured.contract(
            config.layouts,
            config.structure,
            config.analysis,
            f1,
            f1 if f2 is None else f2,
            _PRECISION[config.precision],
        )
    return _finish(per_leaf, config)


def _contract_nngp(out1, out2, *, config: Config):
    out2 = out1 if out2 is None else out2
    kernels = []
    for layout, a, b in zip(config.layouts, out1, out2, strict=True):
        lhs, rhs, out = layout.specs()
        k = _jacobian.pair_einsum(lhs, rhs, out, a, b, _PRECISION[config.precision])
        kernels.append(k / layout.trace_size(a.shape))
    return jax.tree.unflatten(config.out_tree, kernels)


_CONTRACT = {
    "jacobian": _contract_jacobians,
    "structured": _contract_structured,
    "nngp": _contract_nngp,
}


def _pairwise(config: Config) -> bool:
    """NTK-vector products on pairs (x1_i, x2_i) only: the O(N) batch diagonal."""
    return config.vmap_axes is not None and config.layouts[0].batch_diagonal


def _tile(params, fa, fb, aux, xa, xb, *, apply3, config: Config, same: bool):
    """One tile and its all-finite flag.

    ``fa``/``fb``: features of a row and a column block (``xa``/``xb``, their
    inputs, for ``"ntvp"``); ``same``: the Gram matrix of one block (``fb``/``xb``
    unused; the tile is made exactly symmetric here).
    """
    impl = config.implementation
    if impl == "ntvp":
        with jax.default_matmul_precision(config.precision):
            fulls = _ntvp.full_kernels(
                apply3,
                params,
                xa,
                xa if same else xb,
                aux,
                config.vmap_axes,
                config.out_tree,
                _pairwise(config),
                single=replay(apply3, config.precision),
            )
        kernels = _ntvp.reduce(config.layouts, fulls, _pairwise(config))
        kernel = jax.tree.unflatten(config.out_tree, kernels)
    else:
        contract = _CONTRACT[impl]
        k = _triangle_blocks(fa, config) if same else 1
        if k > 1:
            kernel = _triangular(contract, fa, k, config)
        else:
            kernel = contract(fa, None if same else fb, config=config)
    if same:  # exactly symmetric (barriers inside: no fusion across the mirror)
        kernel = _blocked.symmetrize(kernel, config)
    return _blocked.finish_tile(kernel)


_TILE = jax.jit(_tile, static_argnames=("apply3", "config", "same"))


#: A Gram matrix of one set of samples (x2=None, or a diagonal tile of the blocked
#: engine) of N samples is contracted in k = min(TRIANGLE_MAX_BLOCKS, N //
#: TRIANGLE_MIN_BLOCK) blocks of samples, and only the k(k + 1)/2 block pairs on and
#: above the diagonal are computed (the rest are their mirrors): (k + 1)/2k of the pair
#: work, 9/16 at k = 8. Measured on the MLP 784-1000-1 at N = 1000 (XLA CPU, 2 cores):
#: blocks of 333 / 200 / 143 samples (k = 3, 5, 7) took 45 / 41 / 40 ms for the whole
#: kernel; smaller blocks lose more to smaller matrix products than they save.
TRIANGLE_MIN_BLOCK = 128
TRIANGLE_MAX_BLOCKS = 8
#: The blocks are slices of the features, which XLA copies: above this many feature
#: bytes the Gram matrix is contracted whole (ResNet case, 0.8 GB of features: 0.4 GB
#: more peak memory in blocks, for a quarter of a contraction that is not its main cost).
TRIANGLE_MAX_FEATURE_BYTES = 2**28


def _triangle_blocks(features, config: Config) -> int:
    """k, the number of sample blocks of a symmetric contraction (1: in one piece)."""
    layout = config.layouts[0]
    if features is None or 0 in layout.trace or 0 in layout.diag:
        return 1
    leaves = jax.tree.leaves(features)
    if not leaves:
        return 1
    nbytes = sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in leaves)
    return triangle_blocks(leaves[0].shape[0], nbytes)


def triangle_blocks(n: int, feature_bytes: float = 0.0) -> int:
    """k for a symmetric contraction of ``n`` samples whose features take
    ``feature_bytes`` (see :data:`TRIANGLE_MIN_BLOCK`)."""
    if feature_bytes > TRIANGLE_MAX_FEATURE_BYTES:
        return 1
    return max(1, min(TRIANGLE_MAX_BLOCKS, n // TRIANGLE_MIN_BLOCK))


def _triangular(contract, features, k: int, config: Config):
    """Θ(x, x) from the features of x, in k x k blocks of samples, of which only those
    on and above the diagonal are contracted; block (j, i) is block (i, j) with the x1
    and x2 axis of each pair swapped, so it equals it exactly mirrored.

    One loop over the k(k + 1)/2 block pairs (``lax.fori_loop``), so the program holds
    one block contraction whatever k: unrolled, the 28 pairs of k = 7 took 1.2 s of XLA
    compilation on the MLP 784-1000-1 at N = 1000, the loop 0.1 s. The blocks all have
    ceil(N/k) samples; the last starts at N - ceil(N/k) and overlaps its neighbour
    (those entries are written twice, from the same features).
    """
    n = jax.tree.leaves(features)[0].shape[0]
    size = -(-n // k)
    starts = np.minimum(np.arange(k) * size, n - size)
    pairs = np.array([(i, j) for i in range(k) for j in range(i, k)], dtype=np.int32)
    rows = jnp.asarray(starts[pairs[:, 0]], dtype=jnp.int32)
    cols = jnp.asarray(starts[pairs[:, 1]], dtype=jnp.int32)

    def part(start):
        return jax.tree.map(lambda v: lax.dynamic_slice_in_dim(v, start, size, axis=0), features)

    shapes = jax.eval_shape(lambda f: contract(f, f, config=config), part(0))
    leaves_shape, treedef = jax.tree.flatten(shapes)
    perms = [_blocked.swap_perm(layout) for layout in _blocked.leaf_layouts(config)]
    out = [jnp.zeros((n, n) + s.shape[2:], s.dtype) for s in leaves_shape]

    def body(p, out):
        r, c = rows[p], cols[p]
        block = jax.tree.leaves(contract(part(r), part(c), config=config))
        zeros = (0,) * (block[0].ndim - 2)
        new = []
        for acc, b, perm in zip(out, block, perms, strict=True):
            acc = lax.dynamic_update_slice(acc, b, (r, c) + zeros[: b.ndim - 2])
            mirror = jnp.transpose(b, perm)
            new.append(lax.dynamic_update_slice(acc, mirror, (c, r) + zeros[: b.ndim - 2]))
        return new

    out = lax.fori_loop(0, len(pairs), body, out)
    return jax.tree.unflatten(treedef, out)
