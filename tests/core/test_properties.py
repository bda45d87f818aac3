"""Properties of the kernels: symmetry, PSD, x2=None equals x2=x1, no recompilation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import core_zoo
import ntk_core
import reference

IMPLEMENTATIONS = ["jacobian", "ntvp", "structured"]


def _square(k, n):
    """(N, N, O, O) zipped layout -> (N*O, N*O) matrix."""
    if k.ndim == 2:
        return k
    o = k.shape[2]
    return np.asarray(k).transpose(0, 2, 1, 3).reshape(n * o, n * o)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["trace", "full"])
def test_symmetric_and_psd(implementation, trace_axes):
    entry = core_zoo.ZOO["cnn10"]
    x = entry.make_x(jax.random.PRNGKey(3), 6)
    k = ntk_core.empirical_ntk(
        core_zoo.apply_fn(entry),
        entry.params,
        x,
        trace_axes=trace_axes,
        implementation=implementation,
    )
    m = _square(np.asarray(k, np.float64), 6)
    np.testing.assert_array_equal(m, m.T)  # mirrored exactly (tests/core/test_mirror.py)
    eig = np.linalg.eigvalsh((m + m.T) / 2)
    # PSD up to float32 round-off: eigenvalues >= -1e-5 * the largest.
    assert eig.min() >= -1e-5 * eig.max()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_x2_none_equals_x2_x1(implementation):
    entry = core_zoo.ZOO["tied"]
    x = entry.make_x(jax.random.PRNGKey(4), 5)
    f, p = core_zoo.apply_fn(entry), entry.params
    k_none = ntk_core.empirical_ntk(f, p, x, None, trace_axes=(), implementation=implementation)
    k_same = ntk_core.empirical_ntk(f, p, x, x, trace_axes=(), implementation=implementation)
    reference.assert_close(k_none, np.asarray(k_same, np.float64))


def test_traced_kernel_is_mean_of_full_kernel_diagonal():
    entry = core_zoo.ZOO["mlp"]
    x = entry.make_x(jax.random.PRNGKey(5), 4)
    f, p = core_zoo.apply_fn(entry), entry.params
    full = np.asarray(ntk_core.empirical_ntk(f, p, x, trace_axes=()), np.float64)
    traced = ntk_core.empirical_ntk(f, p, x)
    diag = ntk_core.empirical_ntk(f, p, x, trace_axes=(), diagonal_axes=(-1,))
    batch_diag = ntk_core.empirical_ntk(f, p, x, diagonal_axes=(0,))
    reference.assert_close(traced, np.einsum("ijaa->ij", full) / full.shape[-1])
    reference.assert_close(diag, np.einsum("ijaa->ija", full))
    reference.assert_close(batch_diag, np.einsum("iiaa->i", full) / full.shape[-1])


@pytest.mark.parametrize("implementation", ["jacobian", "ntvp", "structured", "auto"])
def test_no_recompilation_with_same_shapes(implementation):
    traces = []

    def apply_fn(params, x):
        traces.append(1)  # runs only while JAX traces
        return jnp.tanh(x @ params["w"]) @ params["v"]

    kernel = ntk_core.ntk_fn(apply_fn, implementation=implementation, trace_axes=())
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w": jax.random.normal(k1, (3, 4)), "v": jax.random.normal(k2, (4, 2))}
    x = jax.random.normal(k3, (5, 3))
    first = kernel(params, x)
    n_traces = len(traces)
    assert n_traces > 0
    new_params = jax.tree.map(lambda a: a * 0.5, params)
    second = kernel(new_params, x + 1.0)
    kernel(new_params, x + 2.0, x)  # a new signature (x2 given) may trace once more ...
    n_after = len(traces)
    kernel(params, x - 1.0, x + 3.0)  # ... but not again for the same shapes
    assert len(traces) == n_after
    assert not np.allclose(first, second)  # really recomputed with the new values
    kernel(params, x)
    assert len(traces) == n_after


def test_empirical_ntk_reuses_compiled_function():
    traces = []

    def apply_fn(params, x):
        traces.append(1)
        return x @ params

    p = jnp.ones((3, 2))
    ntk_core.empirical_ntk(apply_fn, p, jnp.ones((4, 3)))
    n = len(traces)
    ntk_core.empirical_ntk(apply_fn, p * 2, jnp.zeros((4, 3)))
    assert len(traces) == n


def test_linear_model_closed_form():
    """f(x) = x W: the NTK is (x1 . x2) I_O exactly, the NNGP x1 W W^T x2^T."""
    w = jax.random.normal(jax.random.PRNGKey(0), (4, 3))
    x1 = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (2, 4))
    f = lambda w, x: x @ w  # noqa: E731
    gram = np.asarray(x1, np.float64) @ np.asarray(x2, np.float64).T
    for impl in ["jacobian", "ntvp", "structured"]:
        full = ntk_core.empirical_ntk(f, w, x1, x2, trace_axes=(), implementation=impl)
        reference.assert_close(full, np.einsum("ij,ab->ijab", gram, np.eye(3)))
        reference.assert_close(ntk_core.empirical_ntk(f, w, x1, x2, implementation=impl), gram)
    w64 = np.asarray(w, np.float64)
    nngp = ntk_core.empirical_nngp(f, w, x1, x2)
    expected = (np.asarray(x1, np.float64) @ w64) @ (np.asarray(x2, np.float64) @ w64).T / 3
    reference.assert_close(nngp, expected)


def test_vmap_axes_none_matches_per_sample_for_independent_model():
    entry = core_zoo.ZOO["batchnorm_eval"]
    x1, x2 = core_zoo.inputs(entry)
    f, p = core_zoo.apply_fn(entry), entry.params
    a = ntk_core.empirical_ntk(f, p, x1, x2, trace_axes=(), vmap_axes=None)
    b = ntk_core.empirical_ntk(f, p, x1, x2, trace_axes=(), vmap_axes=0)
    reference.assert_close(a, np.asarray(b, np.float64))


def test_vmap_axes_none_for_interacting_samples():
    """Samples coupled through the batch mean: vmap_axes=None gives the true Jacobian."""

    def f(w, x):
        h = x @ w
        return h - h.mean(axis=0, keepdims=True)

    w = jax.random.normal(jax.random.PRNGKey(0), (3, 2))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
    expected = reference.ntk(f, w, x, None, trace_axes=())[0]
    for impl in ["jacobian", "ntvp"]:
        k = ntk_core.empirical_ntk(f, w, x, trace_axes=(), vmap_axes=None, implementation=impl)
        reference.assert_close(k, expected)


@pytest.mark.filterwarnings("ignore::ntk_core.PrecisionWarning")  # tested in test_environment
def test_precision_option_reaches_results():
    entry = core_zoo.ZOO["mlp"]
    x = entry.make_x(jax.random.PRNGKey(6), 3)
    f, p = core_zoo.apply_fn(entry), entry.params
    expected = reference.ntk(f, p, x, None)[0]
    for precision in ntk_core.PRECISIONS:
        reference.assert_close(ntk_core.empirical_ntk(f, p, x, precision=precision), expected)
