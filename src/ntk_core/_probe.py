"""The per-sample independence probe behind ``vmap_axes=0``.

``vmap_axes=0`` differentiates the model one sample at a time; that is the Jacobian of
the batched model only if each sample's output ignores the other samples. The probe
runs the model on two batches of two samples that share the first sample and differ
in the second (same shapes, so random keys give the same masks), and compares the
first sample's outputs. It catches BatchNorm in training mode, batch means or softmax
over the batch, at the cost of two small forward passes once per input signature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _sample(x, i):
    return jax.tree.map(lambda leaf: jnp.asarray(leaf)[i : i + 1], x)


def _candidates(x1, x2):
    """Up to three distinct samples: from x1, then x2, then a transformed copy."""
    samples = [_sample(x1, i) for i in range(min(3, jax.tree.leaves(x1)[0].shape[0]))]
    if x2 is not None and len(samples) < 3:
        samples.append(_sample(x2, 0))
    if len(samples) == 2 and all(
        jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in jax.tree.leaves(samples[1])
    ):
        samples.append(jax.tree.map(lambda v: -1.5 * v + 0.5, samples[1]))
    return samples


def samples_interact(apply3, params, x1, x2, aux, rtol: float = 1e-4) -> bool:
    """True when sample 0's output changes with the other sample of its batch.

    Returns False when the inputs are abstract (under an outer ``jax.jit``) or fewer
    than three distinct samples can be formed.
    """
    try:
        samples = _candidates(x1, x2)
        if len(samples) < 3:
            return False
        first, second, third = samples

        def pair(a, b):
            return jax.tree.map(lambda u, v: jnp.concatenate([u, v]), a, b)

        run = jax.jit(apply3)
        out_b = jax.tree.leaves(run(params, pair(first, second), aux))
        out_c = jax.tree.leaves(run(params, pair(first, third), aux))
        for b, c in zip(out_b, out_c, strict=True):
            b0, c0 = np.asarray(b[:1], np.float64), np.asarray(c[:1], np.float64)
            scale = max(np.abs(b0).max(initial=0.0), np.abs(c0).max(initial=0.0), 1e-30)
            if not np.all(np.isfinite(b0)) or not np.all(np.isfinite(c0)):
                return False  # non-finite inputs are reported elsewhere
            if np.abs(b0 - c0).max(initial=0.0) > rtol * scale:
                return True
        return False
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return False
