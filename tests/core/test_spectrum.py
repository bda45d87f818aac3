"""ntk_core.ntk_vp_fn and ntk_core.spectrum against an independent float64 numpy NTK
(hand-derived Jacobian of a tanh MLP, no JAX), numpy.linalg.eigvalsh and np.trace."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse.linalg

import ntk_core
from ntk_core import spectrum
from ntk_core._analysis import host_kernel as _host_kernel

D, H, OUT = 5, 16, 3


def mlp(params, x):
    """tanh MLP with pytree params: tanh(x W1 + b1) W2."""
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]


def _params(seed=0, out=OUT, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((D, H)) / np.sqrt(D)).astype(dtype),
        "b1": (0.1 * rng.standard_normal(H)).astype(dtype),
        "w2": (rng.standard_normal((H, out)) / np.sqrt(H)).astype(dtype),
    }


def _inputs(n, seed=1, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((n, D)).astype(dtype)


def numpy_ntk(params, x):
    """float64 (N·O, N·O) NTK from the hand-derived Jacobian, rows ordered (i, a)."""
    w1, b1, w2 = (np.asarray(params[k], np.float64) for k in ("w1", "b1", "w2"))
    x = np.asarray(x, np.float64)
    n, o = x.shape[0], w2.shape[1]
    h = np.tanh(x @ w1 + b1)  # (N, H)
    s = 1 - h**2  # tanh'
    rows = []
    for i in range(n):
        for a in range(o):
            d_w2 = np.zeros_like(w2)
            d_w2[:, a] = h[i]  # ∂f_a/∂W2[h, a] = h_h
            d_b1 = s[i] * w2[:, a]  # ∂f_a/∂b1[h] = (1 − h²) W2[h, a]
            d_w1 = np.outer(x[i], d_b1)  # ∂f_a/∂W1[d, h] = x_d (1 − h²) W2[h, a]
            rows.append(np.concatenate([d_w1.ravel(), d_b1, d_w2.ravel()]))
    j = np.array(rows)
    return j @ j.T


def _close(a, b, tol):
    b = np.asarray(b, np.float64)
    assert np.abs(np.asarray(a, np.float64) - b).max() <= tol * np.abs(b).max()


# -- ntk_vp_fn ----------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [None, 7, 24, 100], ids=lambda b: f"batch={b}")
def test_ntk_vp_matches_numpy_reference_and_batched_equals_unbatched(batch_size):
    n = 24  # batch 7: three full batches and a ragged one of 3
    params, x = _params(), _inputs(n)
    v = np.random.default_rng(2).standard_normal((n, OUT)).astype(np.float32)
    ntk_vp = ntk_core.ntk_vp_fn(mlp, params, x, batch_size=batch_size)
    assert ntk_vp.outputs.shape == (n, OUT) and ntk_vp.outputs.dtype == jnp.float32
    out = ntk_vp(v)
    assert out.shape == (n, OUT) and out.dtype == jnp.float32
    expected = (numpy_ntk(params, x) @ v.reshape(-1)).reshape(n, OUT)
    _close(out, expected, 2e-5)
    unbatched = ntk_core.ntk_vp_fn(mlp, params, x)(v)
    _close(out, unbatched, 1e-5)
    # the library's own formed kernel, flattened, times v
    theta = ntk_core.empirical_ntk(mlp, params, x, trace_axes=())  # (N, N, O, O)
    _close(out, np.einsum("ijab,jb->ia", np.asarray(theta, np.float64), v), 2e-5)


def test_ntk_vp_pytree_outputs_include_cross_leaf_blocks():
    def two_heads(p, x):
        z = mlp(p, x)
        return {"a": z[:, :2], "b": jnp.sin(z[:, 2])}  # (N, 2) and (N,)

    n = 10
    params, x = _params(3), _inputs(n, 4)
    v = {"a": np.ones((n, 2), np.float32), "b": np.linspace(-1, 1, n).astype(np.float32)}

    def flat_outputs(p):
        out = two_heads(p, x)
        return jnp.concatenate([out["a"].reshape(-1), out["b"]])

    jac = jax.jit(jax.jacrev(flat_outputs))(params)
    j = np.concatenate(
        [np.asarray(leaf, np.float64).reshape(3 * n, -1) for leaf in jax.tree.leaves(jac)], axis=1
    )
    expected = j @ (j.T @ np.concatenate([v["a"].reshape(-1), v["b"]]))
    for batch_size in (None, 4):
        out = ntk_core.ntk_vp_fn(two_heads, params, x, batch_size=batch_size)(v)
        assert out["a"].shape == (n, 2) and out["b"].shape == (n,)
        _close(np.concatenate([np.asarray(out["a"]).reshape(-1), out["b"]]), expected, 2e-5)


def test_ntk_vp_does_not_retrace_on_a_second_call_or_new_values():
    traces = []

    def counted(p, x):
        traces.append(1)
        return mlp(p, x)

    params, x = _params(5), _inputs(9, 6)
    ntk_vp = ntk_core.ntk_vp_fn(counted, params, x, batch_size=4)
    v = np.ones((9, OUT), np.float32)
    first = ntk_vp(v)
    n_traces = len(traces)
    second = ntk_vp(2 * v)
    assert len(traces) == n_traces
    np.testing.assert_allclose(second, 2 * first, rtol=1e-6)
    other = ntk_core.ntk_vp_fn(counted, _params(6), _inputs(9, 7), batch_size=4)
    n_traces = len(traces)  # the new params and inputs were validated (abstract traces)
    assert other(v).shape == (9, OUT)
    assert len(traces) == n_traces  # the compiled product is shared


# -- eigenpairs ----------------------------------------------------------------------------


def test_ntk_eigsh_matches_eigvalsh_of_the_reference_kernel():
    n = 200
    params, x = _params(7, out=1), _inputs(n, 8)
    theta = numpy_ntk(params, x)  # (200, 200)
    w_ref, v_ref = np.linalg.eigh(theta)
    w_ref, v_ref = w_ref[::-1][:5], v_ref[:, ::-1][:, :5]
    top = spectrum.ntk_eigsh(mlp, params, x, k=5, batch_size=64)
    assert top.eigenvalues.dtype == np.float64 and top.eigenvectors.shape == (n, 1, 5)
    np.testing.assert_allclose(top.eigenvalues, w_ref, rtol=1e-5)
    overlap = np.abs(np.sum(top.eigenvectors[:, 0, :] * v_ref, axis=0))  # up to sign
    np.testing.assert_allclose(overlap, 1.0, atol=1e-4)
    assert 0 < top.matvecs < 200
    again = spectrum.ntk_eigsh(mlp, params, x, k=5, batch_size=64)  # fixed v0: the same
    np.testing.assert_array_equal(again.eigenvalues, top.eigenvalues)
    np.testing.assert_array_equal(again.eigenvectors, top.eigenvectors)


def test_ntk_eigsh_multi_output_and_dense_path():
    n = 6  # M = 18 <= 2k + 1: formed by 18 products and solved densely
    params, x = _params(9), _inputs(n, 10)
    theta = numpy_ntk(params, x)
    top = spectrum.ntk_eigsh(mlp, params, x, k=9)
    assert top.eigenvectors.shape == (n, OUT, 9) and top.matvecs == n * OUT
    np.testing.assert_allclose(top.eigenvalues, np.linalg.eigvalsh(theta)[::-1][:9], rtol=1e-4)
    op = spectrum.ntk_operator(mlp, params, x)
    v = np.random.default_rng(0).standard_normal(n * OUT)
    _close(op @ v, theta @ v, 2e-5)
    assert op.matvecs == 1


def _full_from_flat(flat, n, o):
    return flat.reshape(n, o, n, o).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("which", ["LA", "SA"])
def test_kernel_eigsh_array_memmap_and_jax_array_agree_with_eigh(tmp_path, monkeypatch, which):
    n, o = 40, 2
    phi = np.random.default_rng(11).standard_normal((n * o, 120))  # full rank
    flat = (phi @ phi.T).astype(np.float32)
    flat = (flat + flat.T) / 2
    k4 = _full_from_flat(flat, n, o)  # (N, N, O, O)
    np.save(tmp_path / "k.npy", k4)
    mm = np.load(tmp_path / "k.npy", mmap_mode="r")
    monkeypatch.setattr(_host_kernel, "CHUNK_ENTRIES", 4 * n * o * o)  # 4 samples per chunk
    from_array = spectrum.kernel_eigsh(k4, k=4, which=which, tol=0)
    from_mmap = spectrum.kernel_eigsh(mm, k=4, which=which, tol=0)
    from_jax = spectrum.kernel_eigsh(jnp.asarray(k4), k=4, which=which, tol=0)
    for other in (from_mmap, from_jax):
        np.testing.assert_array_equal(other.eigenvalues, from_array.eigenvalues)
        np.testing.assert_array_equal(other.eigenvectors, from_array.eigenvectors)
    w, v = np.linalg.eigh(flat.astype(np.float64))
    order = np.argsort(w)[::-1] if which == "LA" else np.argsort(w)
    np.testing.assert_allclose(from_array.eigenvalues, w[order[:4]], rtol=1e-10)
    got = from_array.eigenvectors.reshape(n * o, 4)  # (N, O, k) → flat rows (i, a)
    np.testing.assert_allclose(np.abs(np.sum(got * v[:, order[:4]], axis=0)), 1.0, atol=1e-8)
    for i in range(4):  # sign convention: the largest entry is positive
        assert got[np.argmax(np.abs(got[:, i])), i] > 0


def test_trace_equals_np_trace_of_the_reference_kernel():
    n = 15
    params, x = _params(12), _inputs(n, 13)
    expected = np.trace(numpy_ntk(params, x))
    for batch_size in (None, 4):
        got = spectrum.ntk_trace(mlp, params, x, batch_size=batch_size)
        assert isinstance(got, float)
        assert got == pytest.approx(expected, rel=1e-5)

    def heads(p, x):  # (N, 2, 1) and (N,): every output entry's diagonal counts
        z = mlp(p, x)
        return z[:, :2, None], z[:, 2]

    assert spectrum.ntk_trace(heads, params, x) == pytest.approx(expected, rel=1e-5)


def test_condition_number():
    assert spectrum.condition_number(np.diag([4.0, 2.0, 1.0])) == 4.0
    assert spectrum.condition_number(eigenvalues=np.array([3.0, 0.0])) == np.inf
    params, x = _params(14, out=1), _inputs(8, 15)
    theta = numpy_ntk(params, x)  # 8 < P: positive definite
    w = np.linalg.eigvalsh(theta)
    assert spectrum.condition_number(theta) == pytest.approx(w[-1] / w[0], rel=1e-8)


# -- errors ----------------------------------------------------------------------------------


def _vp(batch_size=None):
    return ntk_core.ntk_vp_fn(mlp, _params(), _inputs(5), batch_size=batch_size)


def _batch_mean(p, x):
    z = x - x.mean(axis=0)  # samples interact
    return mlp(p, z)


SYM = np.eye(4)
BAD = [
    (
        lambda: _vp()(np.ones((5, 2), np.float32)),
        ValueError,
        "ntk_vp_fn(...)(v): v has shape (5, 2); expected the outputs' (5, 3)",
    ),
    (lambda: _vp()(np.ones(15, np.float32)), ValueError, "(v.reshape(5, 3))"),
    (
        lambda: _vp()(np.ones((5, 3), np.int32)),
        TypeError,
        "ntk_vp_fn(...)(v): v has dtype int32; expected real floating point",
    ),
    (
        lambda: _vp()({"v": np.ones((5, 3))}),
        TypeError,
        "ntk_vp_fn(...)(v): v has the pytree structure",
    ),
    (
        lambda: _vp()(np.full((5, 3), np.nan)),
        ValueError,
        "ntk_vp_fn(...)(v): v contains NaN or Inf",
    ),
    (
        lambda: _vp(batch_size=0),
        ValueError,
        "ntk_vp_fn: batch_size must be None or a positive int, got 0",
    ),
    (
        lambda: _vp(batch_size=2.5),
        TypeError,
        "ntk_vp_fn: batch_size must be None or a positive int",
    ),
    (
        lambda: ntk_core.ntk_vp_fn(mlp, _params(), _inputs(5), precision="fast"),
        ValueError,
        "ntk_vp_fn: precision must be one of",
    ),
    (
        lambda: ntk_core.ntk_vp_fn(
            mlp, {**_params(), "b1": np.full(H, np.nan, np.float32)}, _inputs(5)
        ),
        ValueError,
        "ntk_vp_fn: params['b1'] contains NaN or Inf",
    ),
    (
        lambda: ntk_core.ntk_vp_fn(mlp, _params(), np.full((5, D), np.inf, np.float32)),
        ValueError,
        "ntk_vp_fn: x contains Inf values, first in sample 0",
    ),
    (
        lambda: ntk_core.ntk_vp_fn(mlp, _inputs(5), _params()),
        ValueError,
        "the argument order is (params, x), not neural-tangents' (f, x_train, params)",
    ),
    (
        lambda: ntk_core.ntk_vp_fn(lambda p, x: jnp.sum(mlp(p, x)), _params(), _inputs(5)),
        ValueError,
        "ntk_vp_fn: the output has shape () but x has 5 samples",
    ),
    (
        lambda: ntk_core.ntk_vp_fn(_batch_mean, _params(), _inputs(6), batch_size=2),
        ValueError,
        "ntk_vp_fn: the model's output for one sample depends on the other samples",
    ),
    (
        lambda: ntk_core.ntk_vp_fn(mlp, _params(), _inputs(5), batchsize=2),
        TypeError,
        "ntk_vp_fn: unknown keyword argument(s) 'batchsize'",
    ),
    (
        lambda: spectrum.ntk_eigsh(mlp, _params(), _inputs(5), k=16),
        ValueError,
        "ntk_eigsh: k must be an int in [1, 15], got 16",
    ),
    (
        lambda: spectrum.ntk_eigsh(mlp, _params(), _inputs(5), k=2, which="LM"),
        ValueError,
        "ntk_eigsh: which must be 'LA' or 'SA', got 'LM'",
    ),
    (
        lambda: spectrum.ntk_eigsh(mlp, _params(), np.ones((0, D))),
        ValueError,
        "ntk_eigsh: x is empty",
    ),
    (
        lambda: spectrum.kernel_eigsh(SYM, k=1, tol=-1),
        ValueError,
        "kernel_eigsh: tol must be a real number in [0, 1), got -1",
    ),
    (
        lambda: spectrum.kernel_eigsh(SYM, k=1, ncv=1),
        ValueError,
        "kernel_eigsh: ncv must be None or an int in [2, 4], got 1",
    ),
    (lambda: spectrum.kernel_eigsh(SYM, k=1.0), TypeError, "kernel_eigsh: k must be an int"),
    (
        lambda: spectrum.kernel_eigsh(np.triu(np.ones((4, 4))), k=1),
        ValueError,
        "kernel_eigsh: kernel is not symmetric",
    ),
    (
        lambda: spectrum.kernel_eigsh(np.ones((4, 3)), k=1),
        ValueError,
        "kernel_eigsh: kernel has shape (4, 3); expected a square kernel",
    ),
    (
        lambda: spectrum.kernel_eigsh(np.diag([1.0, np.nan, 1.0, 1.0]), k=1),
        ValueError,
        "kernel_eigsh: kernel contains NaN or Inf (first at sample 1)",
    ),
    (
        lambda: spectrum.kernel_operator(np.ones((2, 2, 2, 3))),
        ValueError,
        "kernel_operator: kernel has shape (2, 2, 2, 3)",
    ),
    (
        lambda: spectrum.ntk_trace(mlp, _params(), _inputs(5), batch_size=-1),
        ValueError,
        "ntk_trace: batch_size must be a positive number",
    ),
    (
        lambda: spectrum.condition_number(np.ones(3)),
        ValueError,
        "condition_number: kernel has shape (3,), one value per sample",
    ),
]


@pytest.mark.parametrize("call, error, message", BAD, ids=[m[:48] for _, _, m in BAD])
def test_documented_errors(call, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        call()
    assert "Fix:" in str(info.value)


def test_no_convergence_is_scipys_error_with_the_fix():
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((300, 300)))
    kern = (q * (1 + 1e-3 * rng.random(300))) @ q.T  # clustered spectrum
    kern = (kern + kern.T) / 2
    with pytest.raises(
        scipy.sparse.linalg.ArpackNoConvergence, match="kernel_eigsh: ARPACK did not converge"
    ) as info:
        spectrum.kernel_eigsh(kern, k=5, tol=0, maxiter=1)
    assert isinstance(info.value, spectrum.NoConvergence) and "Fix: raise maxiter" in str(
        info.value
    )
