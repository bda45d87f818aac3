"""An optimisation barrier that can be differentiated on every supported JAX."""

from __future__ import annotations

import jax
from jax import lax


@jax.custom_jvp
def barrier(x):
    """``lax.optimization_barrier(x)``: the same values, which XLA may not fuse or fold
    across. Its JVP is the identity on tangents, given here because JAX before about
    0.4.36 has no differentiation rule for the barrier (kernels differentiated with
    respect to the parameters pass through it). Batching (``jax.vmap`` over its input)
    still needs JAX's own rule."""
    return lax.optimization_barrier(x)


@barrier.defjvp
def _barrier_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return barrier(x), t
