"""Case C3 (../shared/cases/README.md): GP inference with a deep Erf network's Monte
Carlo NNGP and NTK on the shared 1-D data (tests/data/gp_erf_1d.npz, a copy), in float32.

The network is small here (2 hidden layers of width 32, 3 samples) to keep CI fast; the
case's 13 x 511 network is examples/c3_gp_erf.py. Parameterisation: standard, Dense
weights W ~ N(0, 1.5² / fan_in) (variance_scaling(1.5², "fan_in", "normal")) and biases
b ~ N(0, 0.05²), so the initialiser scales are the case's weight std 1.5 and bias std 0.05.
"""

from __future__ import annotations

import functools
import pathlib
import warnings

import flax.linen as nn
import jax
import numpy as np
import pytest

import ntk_flax
from ntk_core import predict

DATA = np.load(pathlib.Path(__file__).parents[1] / "data" / "gp_erf_1d.npz")
X_TRAIN, Y_TRAIN, X_TEST = DATA["x_train"], DATA["y_train"], DATA["x_test"]
N = len(X_TRAIN)


class ErfMLP(nn.Module):
    depth: int
    width: int

    @nn.compact
    def __call__(self, x):
        dense = functools.partial(
            nn.Dense,
            kernel_init=nn.initializers.variance_scaling(1.5**2, "fan_in", "normal"),
            bias_init=nn.initializers.normal(0.05),
        )
        for _ in range(self.depth):
            x = jax.scipy.special.erf(dense(self.width)(x))
        return dense(1)(x)


@functools.cache
def kernels():
    """Monte Carlo kernels on train and test inputs together (jointly PSD), float32."""
    x = np.concatenate([X_TRAIN, X_TEST])
    k = ntk_flax.monte_carlo_kernels(
        ErfMLP(depth=2, width=32), x, key=jax.random.PRNGKey(0), n_samples=3, progress=False
    )
    return {name: np.asarray(getattr(k, name)) for name in ("nngp", "ntk")}


def _split(k):
    return k[:N, :N], k[N:, :N], np.diagonal(k)[N:]


def test_kernels_are_float32_and_finite():
    for k in kernels().values():
        assert k.dtype == np.float32 and k.shape == (N + len(X_TEST),) * 2
        assert np.isfinite(k).all()


@pytest.mark.parametrize("diag_reg", [1e-2, 1e-3, 1e-4])
@pytest.mark.parametrize("name", ["nngp", "ntk"])
def test_gp_inference_float32_never_nan(name, diag_reg):
    k_xx, k_tx, prior = _split(kernels()[name])
    lam = diag_reg * np.mean(np.diag(k_xx).astype(np.float64))
    a = k_xx.astype(np.float64) + lam * np.eye(N)
    mean_ref = k_tx.astype(np.float64) @ np.linalg.solve(a, Y_TRAIN.astype(np.float64))
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            post = predict.gp_inference(k_xx, Y_TRAIN, diag_reg=diag_reg)
        # 3 samples of a one-output network: an NNGP of rank 3, and gp_inference says so
        degenerate = [w for w in record if w.category is predict.DegenerateKernelWarning]
        assert len(degenerate) == (name == "nngp")
        if degenerate:
            assert f"numerical rank 3 of {N}" in str(degenerate[0].message)
    except ValueError as e:  # the documented refusal, with the fix
        assert "too ill-conditioned" in str(e) and "Fix: raise diag_reg" in str(e)
        assert diag_reg < 1e-2, "diag_reg=1e-2 must be solvable in float32"
        return
    mean, var = post.nngp(k_tx, prior)
    assert mean.dtype == np.float32 and var.dtype == np.float32
    assert np.isfinite(mean).all() and np.isfinite(var).all()
    assert np.all(var >= 0) and np.all(var <= prior)
    np.testing.assert_allclose(mean, mean_ref, rtol=0, atol=1e-5 * np.abs(mean_ref).max())
    # the same in float64 (on the host, x64 off)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", predict.DegenerateKernelWarning)
        post64 = predict.gp_inference(k_xx, Y_TRAIN, diag_reg=diag_reg, dtype="float64")
    mean64, var64 = post64.nngp(k_tx, prior)
    np.testing.assert_allclose(mean64, mean_ref, rtol=0, atol=1e-9 * np.abs(mean_ref).max())
    assert np.all(var64 >= 0) and np.all(var64 <= prior)


@pytest.mark.filterwarnings("ignore::ntk_core.predict.DegenerateKernelWarning")
def test_ntk_ensemble_posterior_has_no_nan_and_no_negative_variance():
    k = kernels()
    nngp, ntk = _split(k["nngp"]), _split(k["ntk"])
    post = predict.gp_inference(predict.Kernels(nngp=nngp[0], ntk=ntk[0]), Y_TRAIN, diag_reg=1e-3)
    mean, var = post.ntk(predict.Kernels(nngp=nngp[1], ntk=ntk[1]), nngp[2])
    assert np.isfinite(mean).all() and np.isfinite(var).all() and np.all(var >= 0)


@pytest.mark.filterwarnings("ignore::ntk_core.predict.DegenerateKernelWarning")
def test_fit_amplitude_puts_std_on_the_targets_scale():
    k_xx, k_tx, prior = _split(kernels()["nngp"])
    plain = predict.gp_inference(k_xx, Y_TRAIN, diag_reg=1e-2)
    fitted = predict.gp_inference(k_xx, Y_TRAIN, diag_reg=1e-2, fit_amplitude=True)
    lam = 1e-2 * np.mean(np.diag(k_xx).astype(np.float64))
    y = Y_TRAIN.astype(np.float64)
    sigma2 = (y.T @ np.linalg.solve(k_xx + lam * np.eye(N), y)).item() / N
    np.testing.assert_allclose(fitted.amplitude, sigma2, rtol=1e-5)
    std_plain = np.sqrt(plain.nngp(k_tx, prior).covariance)
    std_fitted = np.sqrt(fitted.nngp(k_tx, prior).covariance)
    np.testing.assert_allclose(std_fitted, np.sqrt(sigma2) * std_plain, rtol=1e-4)
    scale = Y_TRAIN.std()  # targets in the hundreds
    assert np.median(std_plain) < 0.01 * scale  # the C3 user's "tiny standard deviations"
    assert 0.02 * scale < np.median(std_fitted) < 5 * scale
