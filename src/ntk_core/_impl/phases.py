"""The compiled phases of a call: each implementation's ``features`` phase (per
sample, O(N)) and the tile that runs its ``contract`` phase (per pair, O(N1·N2)).

The third part of a kernel call (docs/architecture.md). :func:`build` turns a
:class:`~ntk_core._kernel.pipeline.Config` into an
:class:`~ntk_core._kernel.pipeline.Implementation` (its jitted ``features`` and
``tile``), which the executors call, from the config's entry of
:data:`ntk_core._impl.registry.PHASES` (the implementations, each in its own module, and
the NNGP's outputs). The tile is the same for all: the contraction (in triangular
blocks for a Gram matrix, :func:`triangle_blocks`), made exactly symmetric for a Gram
matrix, with its all-finite flag.

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
from ntk_core._impl.registry import PHASES
from ntk_core._kernel.pipeline import Config, Implementation


def build(apply3, config: Config, chunks: dict) -> Implementation:
    """The two compiled phases of ``config.implementation`` for ``apply3``.

    Args:
      apply3: ``apply3(params, x, aux)``, the model.
      config: the plan of the call (:func:`ntk_core._kernel.planner.configure`).
      chunks: the structured features' chunk sizes already found, per configuration
        and input signature (read and updated).
    """
    tile = functools.partial(_TILE, apply3=apply3, config=config)
    features = PHASES[config.implementation].features
    return Implementation(
        config.implementation,
        None if features is None else features(apply3, config, chunks),
        lambda params, fa, fb, aux, xa, xb, same: tile(params, fa, fb, aux, xa, xb, same=same),
    )


def _tile(params, fa, fb, aux, xa, xb, *, apply3, config: Config, same: bool):
    """One tile and its all-finite flag.

    ``fa``/``fb``: features of a row and a column block (``xa``/``xb``, their
    inputs, for an implementation without features); ``same``: the Gram matrix of one
    block (``fb``/``xb`` unused; the tile is made exactly symmetric here).
    """
    impl = PHASES[config.implementation]
    if impl.features is None:  # from the inputs
        kernel = impl.contract(params, xa, None if same else xb, aux, apply3=apply3, config=config)
    else:
        contract = impl.contract
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
