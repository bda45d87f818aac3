"""ntk_core.predict.gradient_descent_mse_ensemble against neural-tangents 0.6's formulas written
here in float64 (np.linalg.solve, scipy.linalg.expm), on a closed-form kernel function: the
NNGP and NTK of a one-hidden-layer ReLU network in NTK parameterisation (arc-cosine kernels)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg

from ntk_core import predict

N, T, D = 8, 5, 3
W_VAR, B_VAR = 2.0, 0.1  # σ_w², σ_b²


def relu_kernel_fn(x1, x2=None, get=None, w_var=W_VAR):
    """NNGP and NTK of x -> σ_w/√n · v·relu(σ_w/√d · W x + σ_b b) + σ_b b' as n -> ∞ (Cho & Saul's
    arc-cosine kernel of degree 1 and 0), neural-tangents' contract: x2 None means x1; an
    array for one name, a tuple in the order asked for several."""
    x2 = x1 if x2 is None else x2
    k0 = w_var * x1 @ x2.T / D + B_VAR  # first layer's pre-activations (= their NTK)
    d1 = w_var * np.sum(x1 * x1, 1) / D + B_VAR
    d2 = w_var * np.sum(x2 * x2, 1) / D + B_VAR
    norm = np.sqrt(np.outer(d1, d2))
    theta = np.arccos(np.clip(k0 / norm, -1.0, 1.0))
    nngp = w_var * norm * (np.sin(theta) + (np.pi - theta) * np.cos(theta)) / (2 * np.pi) + B_VAR
    ntk = nngp + w_var * k0 * (np.pi - theta) / (2 * np.pi)
    kernels = {"nngp": nngp, "ntk": ntk}
    return kernels[get] if isinstance(get, str) else tuple(kernels[g] for g in get)


def _data(o=2):
    rng = np.random.default_rng(0)
    x_train, x_test = rng.standard_normal((N, D)), rng.standard_normal((T, D))
    return x_train, x_test, rng.standard_normal((N, o))


def _expected(g, t, x_train, x_test, y, diag_reg, lr=1.0):
    """neural-tangents' mean and covariance, float64, traced layout; x_test None: its train set."""
    k, th = relu_kernel_fn(x_train, None, ("nngp", "ntk"))
    kg = k if g == "nngp" else th
    a = kg + diag_reg * np.mean(np.diag(kg)) * np.eye(N)
    tau = None if t is None else lr * t / y.size

    def expm(s):  # exp(−A s); 0 at s = ∞ (A is positive definite)
        return np.zeros((N, N)) if np.isinf(s) else scipy.linalg.expm(-a * s)

    def h(s):  # A⁻¹ (I − exp(−A s)); A⁻¹ at t = None
        return np.linalg.solve(a, np.eye(N) if s is None else np.eye(N) - expm(s))

    if x_test is None:
        if t is None:
            return y, np.zeros((N, N))
        e = expm(tau)
        cov = a @ e @ e if g == "nngp" else e @ k @ e
        return (np.eye(N) - e) @ y, cov
    k_tx, th_tx = relu_kernel_fn(x_test, x_train, ("nngp", "ntk"))
    k_tt = relu_kernel_fn(x_test, None, "nngp")
    if g == "nngp":
        return k_tx @ h(tau) @ y, k_tt - k_tx @ h(None if t is None else 2 * tau) @ k_tx.T
    hh = h(tau)
    cov = k_tt + th_tx @ hh @ k @ hh @ th_tx.T - th_tx @ hh @ k_tx.T - k_tx @ hh @ th_tx.T
    return th_tx @ hh @ y, cov


def _close(got, want, scale=None):
    scale = np.abs(want).max() if scale is None else scale
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * max(scale, 1.0))


@pytest.mark.parametrize("g", ["nngp", "ntk"])
@pytest.mark.parametrize("test_set", [True, False], ids=["x_test", "train"])
def test_matches_neural_tangents_formulas(g, test_set):
    x_train, x_test, y = _data()
    predict_fn = predict.gradient_descent_mse_ensemble(
        relu_kernel_fn, x_train, y, learning_rate=0.5, diag_reg=1e-2
    )
    xt = x_test if test_set else None
    for t in (None, 3.0, np.array([[0.0, 30.0, np.inf]])):
        mean, cov = predict_fn(t, xt, g, compute_cov=True)
        ts = np.asarray(0.0 if t is None else t)
        assert mean.shape == ts.shape + (T if test_set else N, 2)
        for idx in np.ndindex(ts.shape):
            tk = None if t is None else float(ts[idx])
            m, c = _expected(g, tk, x_train, xt, y, 1e-2, lr=0.5)
            _close(mean[idx], m)
            _close(cov[idx], c, np.abs(relu_kernel_fn(x_train, None, "nngp")).max())
        only_mean = predict_fn(t, xt, g)  # compute_cov=False: the mean alone
        np.testing.assert_array_equal(only_mean, mean)


def test_train_set_prediction_is_y_at_infinite_time():
    """Issue 48: x_test=None predicts y (the regularised kernel as test kernel); x_test=x_train
    gives K (K + λI)⁻¹ y, which differs from y by an amount growing with diag_reg."""
    x_train, _, y = _data()
    k = relu_kernel_fn(x_train, None, "nngp")
    for diag_reg in (1e-3, 1e-1):
        predict_fn = predict.gradient_descent_mse_ensemble(
            relu_kernel_fn, x_train, y, diag_reg=diag_reg
        )
        out = predict_fn(x_test=None, get="nngp", compute_cov=True)
        np.testing.assert_array_equal(out.mean, y)
        np.testing.assert_array_equal(out.covariance, np.zeros((N, N)))
        a = k + diag_reg * np.mean(np.diag(k)) * np.eye(N)
        _close(predict_fn(x_test=x_train, get="nngp"), k @ np.linalg.solve(a, y))
        # gp_inference: the regularised kernel as test kernels gives the same, as documented
        post = predict.gp_inference(k, y, diag_reg=diag_reg)
        a_reg = k + post.regularizer * np.eye(N)
        mean, cov = post.nngp(a_reg, a_reg)
        _close(mean, y)
        assert np.abs(cov).max() <= 1e-9 * np.abs(k).max()


def test_get_layouts_kwargs_and_full_output_axes():
    """get=None / tuples give neural-tangents' Gaussians namedtuple in get's order; kernel_fn's
    keyword arguments reach every call; trace_axes=() kernels K ⊗ I give the traced results."""
    x_train, x_test, y = _data()
    calls = []

    def kernel_fn(x1, x2=None, get=None, **kwargs):
        calls.append((get, kwargs))
        return relu_kernel_fn(x1, x2, get, **kwargs)

    predict_fn = predict.gradient_descent_mse_ensemble(
        kernel_fn, x_train, y, diag_reg=1e-2, w_var=1.5
    )
    both = predict_fn(x_test=x_test)
    assert type(both).__name__ == "Gaussians" and both._fields == ("nngp", "ntk")
    swapped = predict_fn(x_test=x_test, get=("ntk", "nngp"))
    assert swapped._fields == ("ntk", "nngp")
    np.testing.assert_array_equal(swapped.ntk, both.ntk)
    assert all(kw == {"w_var": 1.5} for _, kw in calls)
    assert calls[0][0] == ("nngp", "ntk")  # the train kernels in one call
    k, th = relu_kernel_fn(x_train, None, ("nngp", "ntk"), w_var=1.5)
    k_tx = relu_kernel_fn(x_test, x_train, "nngp", w_var=1.5)
    a = k + 1e-2 * np.mean(np.diag(k)) * np.eye(N)
    _close(both.nngp, k_tx @ np.linalg.solve(a, y))

    def full_kernel_fn(x1, x2=None, get=None):  # (N1, N2, O, O) = K ⊗ I_O
        out = relu_kernel_fn(x1, x2, get)
        full = lambda m: np.einsum("ij,ab->ijab", m, np.eye(2))  # noqa: E731
        return full(out) if isinstance(get, str) else tuple(map(full, out))

    traced = predict.gradient_descent_mse_ensemble(relu_kernel_fn, x_train, y, diag_reg=1e-2)
    full = predict.gradient_descent_mse_ensemble(
        full_kernel_fn, x_train, y, diag_reg=1e-2, trace_axes=()
    )
    for t in (None, 5.0):
        m1, c1 = traced(t, x_test, "ntk", compute_cov=True)
        m2, c2 = full(t, x_test, "ntk", compute_cov=True)
        _close(m2, m1)
        _close(c2, np.einsum("ij,ab->ijab", c1, np.eye(2)))


def test_float32_kernels_give_float32_results_near_float64():
    x_train, x_test, y = _data()

    def kernel_fn32(x1, x2=None, get=None):
        out = relu_kernel_fn(x1, x2, get)
        return (
            out.astype(np.float32) if isinstance(get, str) else [o.astype(np.float32) for o in out]
        )

    mean, cov = predict.gradient_descent_mse_ensemble(kernel_fn32, x_train, y, diag_reg=1e-2)(
        x_test=x_test, get="ntk", compute_cov=True
    )
    assert mean.dtype == cov.dtype == np.float32
    m, c = _expected("ntk", None, x_train, x_test, y, 1e-2)
    np.testing.assert_allclose(mean, m, rtol=0, atol=1e-5 * np.abs(m).max())
    np.testing.assert_allclose(
        cov, c, rtol=0, atol=1e-5 * np.abs(relu_kernel_fn(x_test, None, "nngp")).max()
    )
