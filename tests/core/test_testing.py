"""ntk_core.testing: the assertions users put in their own tests, against hand-made
kernels with known differences and networks with one known wrong leaf."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_core.testing import TOLERANCE, assert_kernels_close, assert_same_ntk, tolerance

K = np.arange(1.0, 17.0).reshape(2, 2, 2, 2).astype(np.float32)  # (N1, N2, O, O), max 16


def test_tolerance_is_that_of_the_less_precise_dtype():
    assert tolerance(np.float32, np.float64) == (TOLERANCE["float32"], "float32")
    assert tolerance(np.float64, np.float64) == (TOLERANCE["float64"], "float64")
    assert tolerance(jnp.bfloat16, np.float32) == (TOLERANCE["bfloat16"], "bfloat16")


def test_passes_within_rtol_of_the_kernels_scale():
    bumped = K.astype(np.float64)
    bumped[0, 0, 0, 0] += 0.9 * TOLERANCE["float32"] * 16.0  # relative to max |K|, not |K_ij|
    assert_kernels_close(K, bumped)


def test_fails_just_outside_and_says_where():
    bumped = K.astype(np.float64)
    bumped[1, 0, 1, 0] += 1.5 * TOLERANCE["float32"] * 16.0
    with pytest.raises(AssertionError) as info:
        assert_kernels_close(K, bumped)
    message = str(info.value)
    assert "at (1, 0, 1, 0)" in message and "x1[1], x2[0]" in message
    assert "outputs (1, 0)" in message and "float32 tolerance" in message
    assert "1 of 16 entries" in message


def test_float64_kernels_get_the_tight_tolerance():
    a = K.astype(np.float64)
    assert_kernels_close(a, a * (1 + 1e-13))
    with pytest.raises(AssertionError, match="float64 tolerance"):
        assert_kernels_close(a, a * (1 + 1e-9))
    assert_kernels_close(a, a * (1 + 1e-9), rtol=1e-8)  # a given rtol replaces the default
    assert_kernels_close(a, a + 1e-3, rtol=0.0, atol=2e-3)


def test_shape_pytree_and_non_finite_mismatches_fail():
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_kernels_close(K, K[:, :1])
    with pytest.raises(AssertionError, match="pytrees differ"):
        assert_kernels_close({"a": K}, {"b": K})
    nan = K.copy()
    nan[0, 1, 0, 0] = np.nan
    with pytest.raises(AssertionError, match=r"non-finite .* first at \(0, 1, 0, 0\)"):
        assert_kernels_close(K, nan)
    assert_kernels_close((K, K[0]), [K, K[0]])  # equal pytrees of any container type
    with pytest.raises(TypeError, match="holds no array"):
        assert_kernels_close({}, {})


def _mlp(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


def _params():
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    return {"w": jax.random.normal(keys[0], (3, 8)), "v": jax.random.normal(keys[1], (8, 2))}


def test_same_ntk_across_pytree_structures_every_implementation():
    p = _params()
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 3))
    twin = [p["v"], p["w"]]  # another structure and order

    def mlp_twin(q, x):
        return jnp.tanh(x @ q[1]) @ q[0]

    assert_same_ntk(_mlp, p, mlp_twin, twin, x, x[:3], trace_axes=())


def test_same_ntk_names_the_leaf_that_differs():
    """A model whose first layer is scaled by c, with that layer's weights divided by c:
    the same outputs, K_w scaled by c², K_b and K_v unchanged."""
    p = {"w": jnp.ones((3, 4)) * 0.1, "b": jnp.zeros((4,)), "v": jnp.ones((4, 1))}
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 3))

    def f(q, x):
        return jnp.tanh(x @ q["w"] + q["b"]) @ q["v"]

    def g(q, x):
        return jnp.tanh(x @ (2 * q["w"]) + q["b"]) @ q["v"]

    with pytest.raises(AssertionError) as info:
        assert_same_ntk(f, p, g, dict(p, w=p["w"] / 2), x, implementation="jacobian")
    message = str(info.value)
    assert message.startswith("implementation='jacobian': kernels differ")
    assert "leaves of A whose kernel differs: [\"['w']\"]" in message


def test_same_ntk_refuses_an_unknown_implementation():
    with pytest.raises(ValueError, match="assert_same_ntk: implementation='fast'"):
        assert_same_ntk(_mlp, _params(), _mlp, _params(), jnp.ones((2, 3)), implementation="fast")
