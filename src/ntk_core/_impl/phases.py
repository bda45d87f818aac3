"""The compiled phases of a call (:func:`build`): the implementation's ``features`` (O(N))
and the one tile that runs its ``contract`` (O(N1·N2)), triangular and exactly symmetric
for a Gram matrix, with its all-finite flag; module-level, so compilations are shared."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ntk_core._blocked import tiles as _blocked
from ntk_core._impl.base import jit_tuned
from ntk_core._impl.registry import PHASES
from ntk_core._kernel.kind import Kind
from ntk_core._kernel.layout import pair_bytes
from ntk_core._kernel.pipeline import Config, Implementation


def build(apply3, config: Config, chunks: dict) -> Implementation:
    """The two compiled phases of ``config.implementation`` for ``apply3`` (``chunks``:
    the features' chunk sizes found so far, read and updated)."""
    tile = functools.partial(_TILE, apply3=apply3, config=config)
    features = PHASES[config.implementation].features

    def run(params, fa, fb, aux, xa, xb, same):
        kernel, finite = tile(params, fa, fb, aux, xa, xb, same=same)
        if not same or (fa is not None and _triangle_blocks(fa, config) > 1):
            return kernel, finite  # _triangular's blocks are exactly symmetric already
        return _blocked.mirror(kernel, config, _MIRROR), finite

    features = None if features is None else features(apply3, config, chunks)
    return Implementation(config.implementation, features, run)


def _tile(params, fa, fb, aux, xa, xb, *, apply3, config: Config, same: bool):
    """One tile of row/column block features ``fa``/``fb`` (inputs ``xa``/``xb`` without
    features) and its all-finite flag; ``same``: the Gram matrix of ``fa``."""
    impl = PHASES[config.implementation]
    if impl.features is None:  # from the inputs
        kernel = impl.contract(params, xa, None if same else xb, aux, apply3=apply3, config=config)
    else:
        contract = impl.contract
        k = _triangle_blocks(fa, config) if same else 1
        rows = 1 if k > 1 else _row_blocks(fa, fa if same else fb, config)
        if k > 1:
            kernel = _triangular(contract, fa, k, config)
        elif rows > 1:
            kernel = _in_row_blocks(contract, fa, fa if same else fb, rows, config)
        else:
            kernel = contract(fa, None if same else fb, config=config)
    return _blocked.finish_tile(kernel)


_TILE = jit_tuned(_tile, static_argnames=("apply3", "config", "same"))
#: (K + Kᵀ)/2 of a Gram tile, in its own program: inside the tile's, XLA may fuse the
#: contraction into the sum and compute K[i, j] and K[j, i] with different rounding
#: (ntvp's traced kernel was off by 2e-7 relative); here both read one stored K. Small
#: kernels on CPU: numpy's, the same values (``tiles.mirror``).
_MIRROR = jit_tuned(_blocked.symmetrize, static_argnames=("config",), donate_argnums=0)


#: A Gram matrix of N samples is contracted in k = min(TRIANGLE_MAX_BLOCKS, N //
#: TRIANGLE_MIN_BLOCK) blocks, (k + 1)/2k of the pair work (smaller blocks lose more).
TRIANGLE_MIN_BLOCK = 128
TRIANGLE_MAX_BLOCKS = 8
#: Feature bytes above which the Gram matrix is contracted whole (XLA copies the slices).
TRIANGLE_MAX_FEATURE_BYTES = 2**28
#: N · feature bytes (~2 pair FLOPs per 4 bytes) below which it is contracted whole: the
#: block loop compiles 0.07-0.17 s slower (XLA CPU) and saves less than that per call.
#: MLP 784-1000-1, N = 1000 (1.1e10): first call 0.40 -> 0.28 s, warm 0.041 -> 0.047 s;
#: LeNet, N = 500: first 1.8 -> 1.55 s, warm unchanged (its features dominate).
TRIANGLE_MIN_PAIR_BYTES = 2e10


#: Bytes of a tile's kernel-sized temporaries (the contraction's terms, as many as the
#: kernel per term: ``Impl.pair_terms``) above which it is contracted over blocks of x1's
#: samples, at least TRIANGLE_MIN_BLOCK each. MLP 10-256-256-10, 1000 x 1000 samples,
#: ``trace_axes=()``: 1 165 MiB of temporaries for a 381 MiB kernel in one piece.
CONTRACT_TEMP_BYTES = 2**28
#: Backends whose compiler keeps each term's product (XLA CPU). XLA TPU fuses them into
#: the output (2000 x 1000 as above: no temporaries, 10.5 ms; in blocks 55 MiB, 16.8 ms).
ROW_BLOCK_PLATFORMS = ("cpu",)


def temp_bytes(config: Config, n1: int, n2: int) -> int:
    """Bytes of the kernel-sized temporaries of an N1 x N2 contraction in one piece."""
    terms = PHASES[config.implementation].pair_terms(config)
    leaves = config.params_tree.num_leaves if config.kind is Kind.NTK_PER_LEAF else 1
    return n1 * n2 * pair_bytes(config.shapes1, config.layouts, leaves) * (terms or 1)


def _row_blocks(fa, fb, config: Config) -> int:
    """Blocks of x1's samples that keep the temporaries near :data:`CONTRACT_TEMP_BYTES`
    (1: in one piece)."""
    if jax.default_backend() not in ROW_BLOCK_PLATFORMS or config.layouts[0].batch_diagonal:
        return 1
    n1, n2 = (jax.tree.leaves(f)[0].shape[0] for f in (fa, fb))
    temporaries = temp_bytes(config, n1, n2)
    if temporaries <= CONTRACT_TEMP_BYTES:
        return 1
    blocks = math.ceil(temporaries / max(CONTRACT_TEMP_BYTES, 1))
    return max(1, min(n1 // TRIANGLE_MIN_BLOCK, blocks))


def _blocks_of(features, k: int):
    """``(N, size, starts)`` of k blocks of ``size`` of the features' N samples; the last
    block overlaps the one before it (every block one compiled shape)."""
    n = jax.tree.leaves(features)[0].shape[0]
    size = -(-n // k)
    return n, size, np.minimum(np.arange(k) * size, n - size)


def _part(features, start, size: int):
    """The block of ``size`` samples from ``start`` (traced) of every feature leaf."""
    return jax.tree.map(lambda v: lax.dynamic_slice_in_dim(v, start, size, axis=0), features)


def _in_row_blocks(contract, fa, fb, k: int, config: Config):
    """Θ(xa, xb) in k blocks of xa's samples, one ``fori_loop`` writing each block's rows
    (its temporaries are a k-th of the whole contraction's); the last block overlaps."""
    n, size, starts = _blocks_of(fa, k)
    starts = jnp.asarray(starts, dtype=jnp.int32)

    def rows(start):
        return contract(_part(fa, start, size), fb, config=config)

    leaves_shape, treedef = jax.tree.flatten(jax.eval_shape(rows, starts[0]))
    out = [jnp.zeros((n,) + s.shape[1:], s.dtype) for s in leaves_shape]

    def body(i, out):
        block = jax.tree.leaves(rows(starts[i]))
        pairs = zip(out, block, strict=True)
        return [lax.dynamic_update_slice_in_dim(a, b, starts[i], 0) for a, b in pairs]

    return jax.tree.unflatten(treedef, lax.fori_loop(0, k, body, out))


def _triangle_blocks(features, config: Config) -> int:
    """k, the number of sample blocks of a symmetric contraction (1: in one piece)."""
    layout, leaves = config.layouts[0], jax.tree.leaves(features)
    if not leaves or layout.batch_diagonal:
        return 1
    nbytes = sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in leaves)
    return triangle_blocks(leaves[0].shape[0], nbytes)


def triangle_blocks(n: int, feature_bytes: float = 0.0) -> int:
    """k for a symmetric contraction of ``n`` samples with ``feature_bytes`` of features."""
    if not TRIANGLE_MIN_PAIR_BYTES <= n * feature_bytes <= n * TRIANGLE_MAX_FEATURE_BYTES:
        return 1
    return max(1, min(TRIANGLE_MAX_BLOCKS, n // TRIANGLE_MIN_BLOCK))


def _triangular(contract, features, k: int, config: Config):
    """Θ(x, x) in k x k sample blocks, those on and above the diagonal contracted in one
    ``fori_loop`` (unrolled compiles 12x slower) and mirrored; the last block overlaps.
    Exactly symmetric without a mirror of the whole kernel (on a TPU that program took 5
    of an MLP's 29 ms): every other block is written with its exact transpose, and a
    second loop then averages each diagonal block with its transpose, (B + Bᵀ)·½, read
    back from the kernel the first loop wrote. Read back, not as the first loop holds it:
    there XLA CPU fused the block's own arithmetic into that sum and computed B[i, j] one
    way for the term at (i, j) and another for the one at (j, i) (float64 per-leaf blocks
    came out 1e-15 asymmetric, even with the two terms ordered by value)."""
    n, size, starts = _blocks_of(features, k)
    pairs = np.array([(i, j) for i in range(k) for j in range(i, k)], dtype=np.int32)
    rows = jnp.asarray(starts[pairs[:, 0]], dtype=jnp.int32)
    cols = jnp.asarray(starts[pairs[:, 1]], dtype=jnp.int32)

    def part(start):
        return _part(features, start, size)

    shapes = jax.eval_shape(lambda f: contract(f, f, config=config), part(0))
    leaves_shape, treedef = jax.tree.flatten(shapes)
    perms = [_blocked.swap_perm(layout) for layout in _blocked.leaf_layouts(config)]
    out = [jnp.zeros((n, n) + s.shape[2:], s.dtype) for s in leaves_shape]

    def at(row, col, acc):  # int32 zeros: Python 0s are int64 under x64, beside int32 starts
        return (row, col) + (jnp.zeros((), jnp.int32),) * (acc.ndim - 2)  # ranks differ per leaf

    def body(p, out):
        r, c = rows[p], cols[p]
        block = jax.tree.leaves(contract(part(r), part(c), config=config))
        new = []
        for acc, b, perm in zip(out, block, perms, strict=True):
            acc = lax.dynamic_update_slice(acc, b, at(r, c, acc))
            mirror = jnp.transpose(b, perm)
            new.append(lax.dynamic_update_slice(acc, mirror, at(c, r, acc)))
        return new

    diagonal = jnp.asarray(starts, dtype=jnp.int32)

    def symmetric(i, out):  # in order: an overlap already symmetric stays, (v + v)·½ = v
        new = []
        for acc, perm in zip(out, perms, strict=True):
            start = at(diagonal[i], diagonal[i], acc)
            b = lax.dynamic_slice(acc, start, (size, size) + acc.shape[2:])
            # tiles._symmetric_leaf's (K + Kᵀ)·½ without its barriers: b is read from memory
            half = (b + jnp.transpose(b, perm)) * jnp.asarray(0.5, b.dtype)
            new.append(lax.dynamic_update_slice(acc, half, start))
        return new

    out = lax.fori_loop(0, len(pairs), body, out)
    out = lax.fori_loop(0, k, symmetric, out)
    return jax.tree.unflatten(treedef, out)
