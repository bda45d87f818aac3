"""ntk_core.clear_caches: the library's caches are bounded and can be emptied, so a
model that is no longer used can be freed."""

from __future__ import annotations

import gc
import weakref

import jax.numpy as jnp
import numpy as np

import ntk_core


def _model():
    w_scale = np.float32(0.5)

    def apply_fn(w, x):
        return jnp.tanh(x @ w) * w_scale

    return apply_fn


def test_clear_caches_frees_the_users_function_and_keeps_results():
    f = _model()
    w, x = jnp.ones((3, 2)), jnp.arange(12.0).reshape(4, 3) / 10
    before = np.asarray(ntk_core.empirical_ntk(f, w, x))
    ntk_core.ntk_fn(f, batch_size=2)(w, x)  # the blocked engine's caches too
    ntk_core.empirical_nngp(f, w, x)
    alive = weakref.ref(f)
    del f
    gc.collect()
    assert alive() is not None  # held by the (bounded) caches
    ntk_core.clear_caches()
    gc.collect()
    assert alive() is None
    np.testing.assert_array_equal(np.asarray(ntk_core.empirical_ntk(_model(), w, x)), before)
