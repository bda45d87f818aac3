"""Signatures of pytrees of arrays: what the caches of a kernel function are keyed on
(tree structure, shapes, dtypes), with or without the batch axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def signature(tree) -> tuple:
    """The tree structure and each leaf's shape and dtype (else type and repr)."""
    leaves, treedef = jax.tree.flatten(tree)
    sig = []
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            sig.append((tuple(leaf.shape), str(leaf.dtype)))
        else:
            sig.append((type(leaf).__name__, repr(leaf)))
    return treedef, tuple(sig)


def sample_signature(tree) -> tuple:
    """:func:`signature` without the batch axis: what one sample looks like."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(v)[1:]), str(jnp.result_type(v))) for v in leaves)
