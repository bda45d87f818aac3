"""ntk_core.predict.low_rank_inference against the dense GP formulas with K = Φ Φᵀ (float64
numpy, and the library's own gp_inference given the dense kernels)."""

from __future__ import annotations

import doctest
import re
import warnings

import numpy as np
import pytest

from ntk_core import NonFiniteError, predict
from ntk_core._predict import low_rank

N, K, N_OUT, M = 300, 20, 3, 40


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    phi, phi_t = rng.standard_normal((N, K)), rng.standard_normal((M, K))
    y = phi @ rng.standard_normal((K, N_OUT)) + 0.3 * rng.standard_normal((N, N_OUT))
    return phi, phi_t, y


def dense(phi, phi_t, y, lam, prior):
    """GP posterior of K = ΦΦᵀ by the N x N formulas (Rasmussen & Williams eq. 2.25-2.26)."""
    a = phi @ phi.T + lam * np.eye(len(phi))
    kt = phi_t @ phi.T
    return kt @ np.linalg.solve(a, y), prior - kt @ np.linalg.solve(a, kt.T)


@pytest.mark.parametrize("diag_reg, absolute", [(1e-3, False), (0.5, False), (2.0, True)])
def test_matches_dense_formulas(data, diag_reg, absolute):
    phi, phi_t, y = data
    lam = diag_reg * (1.0 if absolute else np.sum(phi**2) / N)
    post = predict.low_rank_inference(phi, y, diag_reg=diag_reg, diag_reg_absolute_scale=absolute)
    assert post.regularizer == pytest.approx(lam, rel=1e-12)
    own = phi_t @ phi_t.T
    mean_ref, cov_ref = dense(phi, phi_t, y, lam, own)
    mean, var = post.posterior(phi_t, variance=True)
    mean2, cov = post.posterior(phi_t, full_covariance=True)
    scale = np.abs(own).max()
    np.testing.assert_allclose(mean, mean_ref, rtol=0, atol=1e-9 * np.abs(mean_ref).max())
    np.testing.assert_array_equal(mean, mean2)
    np.testing.assert_allclose(var, np.diagonal(cov_ref), rtol=0, atol=1e-9 * scale)
    np.testing.assert_allclose(cov, cov_ref, rtol=0, atol=1e-9 * scale)
    assert var.min() > 0 and var.dtype == np.float64 and mean.shape == (M, N_OUT)


def test_matches_gp_inference(data):
    """The library's gp_inference on ΦΦᵀ, Φ*Φᵀ, with the features' own and another prior."""
    phi, phi_t, y = data
    with warnings.catch_warnings():  # ΦΦᵀ has rank k = 20 of N = 300, which it names
        warnings.simplefilter("ignore", predict.DegenerateKernelWarning)
        gp = predict.gp_inference(phi @ phi.T, y, diag_reg=1e-2)
    post = predict.low_rank_inference(phi, y, diag_reg=1e-2)
    own, kt = phi_t @ phi_t.T, phi_t @ phi.T
    other = own + np.diag(np.linspace(0.5, 2.0, M)) + 0.1  # a prior beyond the features'
    for prior in (own, other):
        ref_mean, ref_var = gp.nngp(kt, np.diagonal(prior).copy())
        mean, var = post.posterior(phi_t, np.diagonal(prior).copy(), variance=True)
        np.testing.assert_allclose(mean, ref_mean, rtol=0, atol=1e-7 * np.abs(ref_mean).max())
        np.testing.assert_allclose(var, ref_var, rtol=0, atol=1e-7 * np.abs(prior).max())
        _, ref_cov = gp.nngp(kt, prior)
        _, cov = post.posterior(phi_t, prior, full_covariance=True)
        np.testing.assert_allclose(cov, ref_cov, rtol=0, atol=1e-7 * np.abs(prior).max())


def test_one_output_and_weights(data):
    phi, phi_t, y = data
    post = predict.low_rank_inference(phi, y[:, 0], diag_reg=1e-3)
    lam = 1e-3 * np.sum(phi**2) / N
    w_ref = np.linalg.solve(phi.T @ phi + lam * np.eye(K), phi.T @ y[:, 0])
    np.testing.assert_allclose(post.weights[:, 0], w_ref, rtol=1e-10)
    mean, cov = post.posterior(phi_t)
    assert mean.shape == (M,) and cov is None


def test_no_regulariser_is_least_squares(data):
    phi, phi_t, y = data
    post = predict.low_rank_inference(phi, y)
    mean, var = post.posterior(phi_t, variance=True)
    ref = phi_t @ np.linalg.lstsq(phi, y, rcond=None)[0]
    np.testing.assert_allclose(mean, ref, rtol=0, atol=1e-10 * np.abs(ref).max())
    np.testing.assert_array_equal(var, 0.0)  # the features' own prior is explained exactly


def test_singular_features_raise(data):
    phi, _, y = data
    dup = np.concatenate([phi, phi[:, :1]], axis=1)  # a repeated column: ΦᵀΦ singular
    with pytest.raises(ValueError, match=r"^low_rank_inference: ΦᵀΦ \+ λI .* singular") as info:
        predict.low_rank_inference(dup, y)
    suggested = float(re.search(r"pass diag_reg >= (\S+),", str(info.value)).group(1))
    assert 1e-14 <= suggested <= 1e-8  # the suggestion works, and is not a large bias
    mean = predict.low_rank_inference(dup, y, diag_reg=suggested).posterior(dup).mean
    np.testing.assert_allclose(mean, dup @ np.linalg.lstsq(dup, y, rcond=None)[0], atol=1e-6)
    with pytest.raises(ValueError, match=r"^low_rank_inference: ΦΦᵀ \+ λI .* singular"):
        predict.low_rank_inference(np.concatenate([phi[:10], phi[:1]]), y[:11])  # N < k


@pytest.mark.parametrize("diag_reg", [0.0, 1e-3, 0.5])
def test_n_below_k_solves_n_by_n(data, diag_reg):
    """N = 12 < k = 20: the N x N form; the dense formulas, λ = 0 interpolates."""
    phi, phi_t, y = data
    phi, y = phi[:12], y[:12]
    lam = diag_reg * np.sum(phi**2) / 12
    post = predict.low_rank_inference(phi, y, diag_reg=diag_reg)
    own = phi_t @ phi_t.T
    mean_ref, cov_ref = dense(phi, phi_t, y, lam, own)
    mean, cov = post.posterior(phi_t, full_covariance=True)
    _, var = post.posterior(phi_t, variance=True)
    np.testing.assert_allclose(mean, mean_ref, rtol=0, atol=1e-9 * np.abs(mean_ref).max())
    np.testing.assert_allclose(cov, cov_ref, rtol=0, atol=1e-9 * np.abs(own).max())
    np.testing.assert_allclose(var, np.diagonal(cov_ref), rtol=0, atol=1e-9 * np.abs(own).max())
    w_ref = phi.T @ np.linalg.solve(phi @ phi.T + lam * np.eye(12), y)  # = (ΦᵀΦ + λI)⁻¹Φᵀy
    np.testing.assert_allclose(post.weights, w_ref, rtol=0, atol=1e-10 * np.abs(w_ref).max())
    if diag_reg == 0.0:  # interpolation: the training targets back, no variance there
        train = post.posterior(phi, variance=True)
        np.testing.assert_allclose(train.mean, y, rtol=0, atol=1e-9 * np.abs(y).max())
        np.testing.assert_allclose(train.covariance, 0.0, atol=1e-9 * np.abs(own).max())
    other = np.diagonal(own) + np.linspace(0.5, 2.0, M)  # another prior: adds prior − |φ*|²
    _, var_other = post.posterior(phi_t, other, variance=True)
    np.testing.assert_allclose(var_other, var + other - np.diagonal(own), atol=1e-9 * other.max())


def test_memmap_in_blocks_equals_in_memory(data, tmp_path, monkeypatch):
    phi, phi_t, y = data
    monkeypatch.setattr(low_rank, "_BLOCK_BYTES", 8 * K * 64)  # blocks of 64 rows: 5 of them
    np.save(tmp_path / "phi.npy", phi.astype(np.float32))
    np.save(tmp_path / "phi_t.npy", phi_t.astype(np.float32))
    mapped = np.load(tmp_path / "phi.npy", mmap_mode="r")
    mapped_t = np.load(tmp_path / "phi_t.npy", mmap_mode="r")
    a = predict.low_rank_inference(mapped, y.astype(np.float32), diag_reg=1e-2)
    b = predict.low_rank_inference(np.array(mapped), y.astype(np.float32), diag_reg=1e-2)
    ga = a.posterior(mapped_t, variance=True)
    gb = b.posterior(np.array(mapped_t), variance=True)
    np.testing.assert_array_equal(ga.mean, gb.mean)
    np.testing.assert_array_equal(ga.covariance, gb.covariance)
    assert ga.mean.dtype == np.float32  # float32 features and targets: float32 results
    p32, t32 = np.asarray(mapped, np.float64), np.asarray(mapped_t, np.float64)
    lam = 1e-2 * np.sum(p32**2) / N
    mean_ref, cov_ref = dense(p32, t32, y.astype(np.float32), lam, t32 @ t32.T)
    np.testing.assert_allclose(ga.mean, mean_ref, rtol=0, atol=1e-6 * np.abs(mean_ref).max())
    np.testing.assert_allclose(ga.covariance, np.diagonal(cov_ref), rtol=1e-5)


def test_bad_prior_and_nan(data):
    phi, phi_t, y = data
    post = predict.low_rank_inference(phi, y, diag_reg=1e-2)
    with pytest.raises(ValueError, match=r"k_test_test is given, but variance=False"):
        post.posterior(phi_t, np.ones(M))
    with pytest.raises(ValueError, match=r"k_test_test has shape \(40,\), expected \(40, 40\)"):
        post.posterior(phi_t, np.ones(M), full_covariance=True)
    small = np.einsum("ik,ik->i", phi_t, phi_t) / 2  # below what the features explain
    with pytest.raises(ValueError, match=r"variance of test point 0 came out .* below \|φ\*\|²"):
        post.posterior(phi_t, small, variance=True)
    bad_t = phi_t.copy()
    bad_t[7, 3] = np.nan
    with pytest.raises(
        NonFiniteError, match=r"features_test contains NaN or Inf \(first at sample 7\)"
    ):
        post.posterior(bad_t)


def test_docstring_example():
    result = doctest.testmod(low_rank, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0
