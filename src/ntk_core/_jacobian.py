"""Jacobian contraction: per-sample Jacobians (features), then a dot over parameters.

Θ(x1_i, x2_j) = Σ_p J(x1_i)_p J(x2_j)_p^T with the output axes laid out by
:mod:`ntk_core._layout`. Cost: (N1 + N2)·O reverse passes for the Jacobians, memory
(N1 + N2)·O·P, and N1·N2·O'·P multiply-adds for the contraction (O' the product of the
kept output sizes). Reference: Novak et al., "Fast Finite Width Neural Tangent Kernel",
ICML 2022, section 3.1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._model import per_sample


def jacobians(apply3, params, x, aux, vmap_axes, out_tree):
    """Per-output-leaf lists of Jacobians flattened to ``(N, *out_shape[1:], P_leaf)``."""
    if vmap_axes is None:
        jac = jax.jacrev(lambda p: apply3(p, x, aux))(params)
    else:
        single = per_sample(apply3)
        jac = jax.vmap(jax.jacrev(single), in_axes=(None, 0, None))(params, x, aux)
    param_leaves = jax.tree.leaves(params)
    per_out = out_tree.flatten_up_to(jac)
    result = []
    for leaf_jac in per_out:
        flat = jax.tree.leaves(leaf_jac)
        mats = []
        for j, p in zip(flat, param_leaves, strict=True):
            out_ndim = j.ndim - jnp.ndim(p)
            mats.append(j.reshape(j.shape[:out_ndim] + (-1,)))
        result.append(mats)
    return result


def contract(layouts, jac1, jac2, precision):
    """Per output leaf, the list of each parameter leaf's kernel (they sum to the NTK)."""
    kernels = []
    for layout, m1, m2 in zip(layouts, jac1, jac2, strict=True):
        lhs, rhs, out = layout.specs(n_contracted=1)
        size = layout.trace_size(m1[0].shape)
        kernels.append(
            [
                jnp.einsum(f"{lhs},{rhs}->{out}", a, b, precision=precision) / size
                for a, b in zip(m1, m2, strict=True)
            ]
        )
    return kernels
