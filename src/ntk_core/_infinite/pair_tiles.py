"""One ``kernel_fn`` call's pairs of samples in tiles of B1 x B2, inside its program (CPU).

Every layer maps each pair of samples (i, j) on its own: Σ(x1_i, x2_j) and Θ(x1_i, x2_j)
depend on that pair's entries and the two samples' own covariances only. So the whole
network may run on one tile of pairs at a time, in a loop of the compiled program, each
tile's temporaries small enough to stay in the CPU's cache. Run on all N1 x N2 pairs at
once, XLA CPU writes each closed form's shared parts (√(q11 q22), ρ, θ) to memory as
N1 x N2 arrays and reads them back: a 3-layer ReLU network at N = 4 000 made about 20
passes over 64 MB arrays, memory-bound. The tiles are stacked by a ``lax.scan``, then a
loop places them (the stack and the result: about twice the kernels' memory). A Gram
matrix (x2 None) computes the tiles on and above the diagonal only, and the loop places
each stored tile and its transpose: K[j, i] is K[i, j] bit for bit (exact symmetry, which
a copy inside one fusion does not promise: XLA may compute the two sides apart).

The tile is sized so that one kernel's tile is about :data:`TILE_BYTES`; the TPU and GPUs
run the whole call as one (small tiles would leave them idle between loop steps).
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

#: One kernel's tile of pairs, in bytes: 1/2 of a core's L2 cache on the machine this was
#: measured on (benchmarks/README.md, bench_stax section), so that a layer's few
#: temporaries of the tile stay in cache
TILE_BYTES = 1 << 20

_forced: list[int] = []
_ZERO = np.int32(0)  # start indices all int32 (x64 would make a bare 0 int64)


@contextlib.contextmanager
def using(b: int):
    """Tiles of exactly ``b`` x ``b`` samples (any backend; the last ones padded) for
    calls traced inside the block (tests: the tiled program on small inputs)."""
    _forced.append(int(b))
    try:
        yield
    finally:
        _forced.pop()


def _divisor_near(n: int, b: int) -> int:
    """A divisor of n in [b/2, b] if there is one (no padded samples), else b."""
    for d in range(b, max(b // 2, 1) - 1, -1):
        if n % d == 0:
            return d
    return b


def tile_sizes(n1: int, n2: int | None, per_pair_bytes: int) -> tuple[int, int] | None:
    """(B1, B2) for N1 x N2 pairs (n2 None: a Gram matrix, B1 = B2) of ``per_pair_bytes``
    each (one kernel), or None where one tile would hold them all or the backend is not
    the CPU; read when the call is traced."""
    if _forced:  # exactly b (tests: padded samples too)
        b = _forced[-1]
        if n2 is None:
            return None if b >= n1 else (b, b)
        return None if b >= n1 and b >= n2 else (min(b, n1), min(b, n2))
    if jax.default_backend() != "cpu":
        return None
    else:
        b = max(1, math.isqrt(TILE_BYTES // max(per_pair_bytes, 1)))
    if n2 is None:
        if b >= n1:
            return None
        b = _divisor_near(n1, b)
        return b, b
    if b >= n1 and b >= n2:
        return None
    return _divisor_near(n1, min(b, n1)), _divisor_near(n2, min(b, n2))


def _pad_rows(a, n: int):
    if a.shape[0] == n:
        return a
    return jnp.pad(a, [(0, n - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def _swap_pairs(ndim: int) -> tuple[int, ...]:
    """The permutation that swaps x1's and x2's axis in each pair (samples, positions)."""
    return tuple(i + 1 if i % 2 == 0 else i - 1 for i in range(ndim))


def tiled(tile_fn, inputs1, inputs2, n1: int, n2: int | None, b1: int, b2: int):
    """(kernels, sums): ``tile_fn(blocks1, blocks2, offset)`` -> a tuple of arrays (b1,
    b2, ...) run on every tile of pairs, the results placed in (N1, N2, ...) arrays, with
    each kernel's sum over the computed tiles (the caller's finiteness flag).

    ``inputs1``: a tuple of per-sample arrays (N1, ...) (the inputs, their covariances),
    sliced to each tile's rows (``blocks1``); ``inputs2`` the same for x2, or None for a
    Gram matrix (then ``blocks2`` are ``inputs1`` sliced to the tile's columns, and
    ``offset`` = the tile's first row − its first column: pair (i, j) is one sample where
    j − i == offset; otherwise ``offset`` is None)."""
    gram = inputs2 is None
    k1 = -(-n1 // b1)
    k2 = k1 if gram else -(-n2 // b2)
    rows_all = tuple(_pad_rows(a, k1 * b1) for a in inputs1)
    cols_all = rows_all if gram else tuple(_pad_rows(a, k2 * b2) for a in inputs2)
    if gram:
        pairs = [(i, j) for i in range(k1) for j in range(i, k1)]
    else:
        pairs = [(i, j) for i in range(k1) for j in range(k2)]
    tile_rows = jnp.asarray(np.array([p[0] for p in pairs], np.int32))
    tile_cols = jnp.asarray(np.array([p[1] for p in pairs], np.int32))

    def one(i, j):
        r0, c0 = i * b1, j * b2
        blocks1 = tuple(lax.dynamic_slice_in_dim(a, r0, b1) for a in rows_all)
        blocks2 = tuple(lax.dynamic_slice_in_dim(a, c0, b2) for a in cols_all)
        return tile_fn(blocks1, blocks2, r0 - c0 if gram else None)

    # the tiles stacked (T, B1, B2, ...) by a scan (which finds their shapes as it traces
    # the network: no second trace to size a buffer), then placed by a loop reading them
    _, stacked = lax.scan(lambda c, ij: (c, one(ij[0], ij[1])), None, (tile_rows, tile_cols))
    kernels = tuple(jnp.zeros((k1 * b1, k2 * b2, *s.shape[3:]), s.dtype) for s in stacked)
    sums = tuple(jnp.zeros((), s.dtype) for s in stacked)

    def place(t, carry):
        kernels, sums = carry
        i, j = tile_rows[t], tile_cols[t]
        out = []
        for k, s in zip(kernels, stacked, strict=True):
            tile = s[t]
            rest = (_ZERO,) * (tile.ndim - 2)
            k = lax.dynamic_update_slice(k, tile, (i * b1, j * b2) + rest)
            if gram:  # its transpose below the diagonal
                k = lax.dynamic_update_slice(
                    k, _mirror_value(tile, i == j), (j * b1, i * b1) + rest
                )
            out.append(k)
        sums = tuple(a + jnp.sum(s[t]) for a, s in zip(sums, stacked, strict=True))
        return tuple(out), sums

    kernels, sums = lax.fori_loop(0, len(pairs), place, (kernels, sums))
    if k1 * b1 != n1 or k2 * b2 != (n1 if gram else n2):
        kernels = tuple(k[:n1, : (n1 if gram else n2)] for k in kernels)
    return kernels, sums


def _mirror_value(tile, diagonal_tile):
    """What a Gram matrix's tile (I, J) puts at (J, I): its transpose; a diagonal tile
    (I == J) its mean with its transpose, ½·K + ½·Kᵀ with each pair of axes swapped (each
    term exact, their sum commutes: K[i, j, h, h'] == K[j, i, h', h], neural-tangents'
    layout). ``tile`` is read from the scan's stored result: both sides of the diagonal
    are the same stored numbers (exact symmetry)."""
    flipped = jnp.transpose(tile, _swap_pairs(tile.ndim))
    half = jnp.asarray(0.5, tile.dtype)
    return jnp.where(diagonal_tile, tile * half + flipped * half, flipped)
