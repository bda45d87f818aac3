"""ntk_core.clear_caches: the library's caches are bounded and can be emptied, so a
model that is no longer used can be freed."""

from __future__ import annotations

import subprocess
import sys

_CHILD = """
import gc, weakref
import jax.numpy as jnp, numpy as np
import ntk_core


def _model():
    w_scale = np.float32(0.5)

    def apply_fn(w, x):
        return jnp.tanh(x @ w) * w_scale

    return apply_fn


f = _model()
w, x = jnp.ones((3, 2)), jnp.arange(12.0).reshape(4, 3) / 10
before = np.asarray(ntk_core.empirical_ntk(f, w, x))
ntk_core.ntk_fn(f, batch_size=2)(w, x)  # the blocked engine's caches too
ntk_core.empirical_nngp(f, w, x)
alive = weakref.ref(f)
del f
gc.collect()
assert alive() is not None, "not held by the (bounded) caches"
ntk_core.clear_caches()
gc.collect()
assert alive() is None, "still alive after clear_caches"
np.testing.assert_array_equal(np.asarray(ntk_core.empirical_ntk(_model(), w, x)), before)
print("ok")
"""


def test_clear_caches_frees_the_users_function_and_keeps_results():
    """The user's function is held by the caches until clear_caches, then freed, and the
    kernel computed again is the same. In a fresh process: clear_caches calls
    jax.clear_caches(), after which every later test in a pytest worker would compile
    again; in a worker this test took 9.9 s, alone 0.7 s (as a subprocess 2.2 s)."""
    run = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok"), run.stdout[-2000:]
