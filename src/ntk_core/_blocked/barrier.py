"""An optimisation barrier that can be differentiated and batched on every supported JAX."""

from __future__ import annotations

import jax
from jax import lax


@jax.custom_batching.custom_vmap
def _batchable(x):
    return lax.optimization_barrier(x)


@_batchable.def_vmap
def _batchable_vmap(axis_size, in_batched, x):
    return lax.optimization_barrier(x), in_batched[0]


@jax.custom_jvp
def barrier(x):
    """``lax.optimization_barrier(x)`` (XLA may not fuse or fold across it), with the JVP
    (identity) and vmap rules that JAX before about 0.4.36 lacks."""
    return _batchable(x)


@barrier.defjvp
def _barrier_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return barrier(x), t
