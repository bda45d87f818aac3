"""An optimisation barrier that can be differentiated and batched on every supported JAX."""

from __future__ import annotations

import jax
from jax import lax


@jax.custom_batching.custom_vmap
def _batchable(x):
    return lax.optimization_barrier(x)


@_batchable.def_vmap
def _batchable_vmap(axis_size, in_batched, x):
    # The barrier of the batched value: same values, batched as its input.
    return lax.optimization_barrier(x), in_batched[0]


@jax.custom_jvp
def barrier(x):
    """``lax.optimization_barrier(x)``: the same values, which XLA may not fuse or fold
    across. Its JVP is the identity on tangents and under ``jax.vmap`` it is the barrier
    of the batched value, both given here because JAX before about 0.4.36 has neither
    rule for the barrier (kernels differentiated with respect to the parameters, or
    averaged over vmapped parameter draws, pass through it)."""
    return _batchable(x)


@barrier.defjvp
def _barrier_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return barrier(x), t
