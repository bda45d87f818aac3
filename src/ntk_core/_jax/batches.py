"""Loops over equal, overlapping batches: the last batch starts at N - size, so every step
has the same shapes and XLA compiles the body once (``lax.map(batch_size=)`` compiles a
second body for the remainder)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex


def even_batches(n: int, most: int) -> tuple[int, list[int]]:
    """``(size, starts)``: batches of ``size`` ≤ ``most`` items covering ``n``, the
    last starting at ``n - size``."""
    pieces = -(-n // max(most, 1))
    size = -(-n // pieces)
    return size, [min(i * size, n - size) for i in range(pieces)]


def map_in_batches(fn, args, most: int):
    """``fn(args)`` (leading axis N), ``most`` items at a time in one XLA loop."""
    n = jax.tree.leaves(args)[0].shape[0]
    if most >= n:
        return fn(args)
    size, starts = even_batches(n, most)

    def part(start):
        return fn(jax.tree.map(lambda v: lax.dynamic_slice_in_dim(v, start, size, 0), args))

    # Traced once: the loop's body replays the jaxpr (a model's trace took 2.1 s of a ViT's
    # 10.5 s first call with a filled compilation cache on a TPU; eval_shape and the loop
    # had traced it twice).
    closed, shapes = jax.make_jaxpr(part, return_shape=True)(jnp.int32(0))
    replay = jex.jaxpr_as_fun(closed)
    treedef = jax.tree.structure(shapes)
    out = jax.tree.map(lambda s: jnp.zeros((n,) + s.shape[1:], s.dtype), shapes)

    def step(i, out):
        start = jnp.minimum(i * size, n - size).astype(jnp.int32)
        piece = jax.tree.unflatten(treedef, replay(start))
        return jax.tree.map(
            lambda o, p: lax.dynamic_update_slice_in_dim(o, p, start, 0), out, piece
        )

    return lax.fori_loop(0, len(starts), step, out)
