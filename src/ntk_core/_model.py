"""Helpers around the pure ``apply3(params, x, aux)`` that every implementation uses.

``aux`` is a pytree passed through untouched and never differentiated (the adapters
carry Flax's non-``params`` collections and Haiku's state and rng in it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _caches


def per_sample(apply3):
    """``apply3`` on one sample: adds batch axis 0 to the inputs, removes it from outputs."""

    def single(params, x_i, aux):
        x_b = jax.tree.map(lambda leaf: jnp.expand_dims(leaf, 0), x_i)
        out = apply3(params, x_b, aux)
        return jax.tree.map(lambda leaf: leaf[0], out)

    return single


@_caches.lru_cache(maxsize=64)
def from_apply_fn(apply_fn):
    """Wraps a public ``apply_fn(params, x)`` as ``apply3(params, x, aux)``.

    Cached, so kernel functions of the same ``apply_fn`` share compiled Jacobians.
    """

    def apply3(params, x, aux):
        del aux
        return apply_fn(params, x)

    return apply3
