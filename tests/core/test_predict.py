"""ntk_core.predict against explicit float64 numpy formulas (np.linalg.solve, scipy expm),
written here independently of the library's flattening, solver and refinement."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
import scipy.linalg

from ntk_core import predict
from ntk_core._predict.linalg import Solver

N, T, OUT = 12, 5, 3

# Most kernels here are built from few features on purpose (rank p·OUT), which
# gp_inference reports; test_low_rank_prior_warns_* asserts that warning.
pytestmark = pytest.mark.filterwarnings("ignore::ntk_core.predict.DegenerateKernelWarning")


def _features(seed, n, p=8):
    """Joint train+test features (n + T, OUT, p): kernels from them are jointly PSD, rank p·OUT."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n + T, OUT, p))


def _full(phi_a, phi_b):
    """(Na, Nb, OUT, OUT) kernel Σ_p φ_a[i, o, p] φ_b[j, o', p]."""
    return np.einsum("iap,jbp->ijab", phi_a, phi_b)


def _traced(phi_a, phi_b):
    """(Na, Nb): the full kernel averaged over its output pair (trace_axes=(-1,))."""
    return np.einsum("iap,jap->ij", phi_a, phi_b) / phi_a.shape[1]


def _problem(layout, seed=0, n=N):
    phi = _features(seed, n)
    tr, te = phi[:n], phi[n:]
    make = _traced if layout == "traced" else _full
    y = np.random.default_rng(seed + 100).standard_normal((n, OUT))
    return make(tr, tr), make(te, tr), make(te, te), y


def _flat(k):
    """(A, B, OUT, OUT) → (A·OUT, B·OUT) by explicit loops (no shared code with the library)."""
    if k.ndim == 2:
        return k
    a, b = k.shape[:2]
    out = np.zeros((a * OUT, b * OUT))
    for i in range(a):
        for j in range(b):
            out[i * OUT : (i + 1) * OUT, j * OUT : (j + 1) * OUT] = k[i, j]
    return out


def _reference(k_xx, k_tx, k_tt, y, diag_reg, absolute):
    """float64: mean = K_tx (K_xx + λI)⁻¹ y, cov = K_tt − K_tx (K_xx + λI)⁻¹ K_xt."""
    kxx, ktx, ktt = _flat(k_xx), _flat(k_tx), _flat(k_tt)
    lam = diag_reg if absolute else diag_reg * np.mean(np.diag(kxx))
    a = kxx + lam * np.eye(len(kxx))
    yy = y.reshape(-1, 1) if k_xx.ndim == 4 else y
    mean = ktx @ np.linalg.solve(a, yy)
    cov = ktt - ktx @ np.linalg.solve(a, ktx.T)
    return mean.reshape(-1, OUT), cov, lam


def _unflat_cov(cov, t):
    out = np.zeros((t, t, OUT, OUT))
    for i in range(t):
        for j in range(t):
            out[i, j] = cov[i * OUT : (i + 1) * OUT, j * OUT : (j + 1) * OUT]
    return out


@pytest.mark.parametrize("absolute", [False, True], ids=["relative", "absolute"])
@pytest.mark.parametrize("layout", ["traced", "full"])
@pytest.mark.parametrize("diag_reg", [1e-3, 1e-1])
def test_gp_inference_matches_explicit_formula(layout, diag_reg, absolute):
    k_xx, k_tx, k_tt, y = _problem(layout)
    mean_ref, cov_ref, lam = _reference(k_xx, k_tx, k_tt, y, diag_reg, absolute)
    trace_axes = (-1,) if layout == "traced" else ()
    post = predict.gp_inference(
        k_xx,
        y,
        diag_reg=diag_reg,
        diag_reg_absolute_scale=absolute,
        trace_axes=trace_axes,
        dtype="float64",
    )
    np.testing.assert_allclose(post.regularizer, lam, rtol=1e-14)
    mean, cov = post.nngp(k_tx, k_tt)
    assert mean.shape == (T, OUT) and mean.dtype == np.float64
    np.testing.assert_allclose(mean, mean_ref, rtol=1e-9, atol=1e-9 * np.abs(mean_ref).max())
    expected_cov = cov_ref if layout == "traced" else _unflat_cov(cov_ref, T)
    assert cov.shape == expected_cov.shape
    np.testing.assert_allclose(cov, expected_cov, atol=1e-9 * np.abs(k_tt).max())
    # per-sample diagonal test-test kernel → the variances (diagonal blocks)
    diag = np.diagonal(k_tt) if layout == "traced" else np.stack([k_tt[i, i] for i in range(T)])
    _, var = post.nngp(k_tx, diag)
    exp_var = (
        np.diag(cov_ref) if layout == "traced" else np.stack([expected_cov[i, i] for i in range(T)])
    )
    np.testing.assert_allclose(var, exp_var, atol=1e-9 * np.abs(k_tt).max())


def test_float32_kernel_solves_agree_with_float64_reference():
    k_xx, k_tx, k_tt, y = _problem("traced", seed=1)
    mean_ref, cov_ref, _ = _reference(k_xx, k_tx, k_tt, y, 1e-4, False)
    post = predict.gp_inference(k_xx.astype(np.float32), y.astype(np.float32), diag_reg=1e-4)
    mean, var = post.nngp(k_tx.astype(np.float32), np.diagonal(k_tt).astype(np.float32))
    assert mean.dtype == np.float32
    # the float32 kernel itself differs from the float64 one by round-off: compare with
    # the float64 solve of the float32 kernel's values
    mean32_ref, cov32_ref, _ = _reference(
        k_xx.astype(np.float32).astype(np.float64),
        k_tx.astype(np.float32).astype(np.float64),
        k_tt.astype(np.float32).astype(np.float64),
        y.astype(np.float32).astype(np.float64),
        1e-4,
        False,
    )
    np.testing.assert_allclose(mean, mean32_ref, rtol=2e-6, atol=2e-6 * np.abs(mean32_ref).max())
    assert np.all(var >= 0)
    np.testing.assert_allclose(
        var, np.maximum(np.diag(cov32_ref), 0), atol=1e-5 * np.abs(k_tt).max()
    )


def test_float64_requested_without_x64_is_float64():
    import jax

    assert not jax.config.jax_enable_x64
    k_xx, k_tx, _, y = _problem("traced", seed=2)
    k32 = jax.numpy.asarray(k_xx, jax.numpy.float32)  # a jax array, x64 off
    post = predict.gp_inference(k32, y, diag_reg=1e-6, dtype="float64")
    mean, _ = post.nngp(np.asarray(k_tx, np.float32))
    assert mean.dtype == np.float64
    ref, _, _ = _reference(
        np.asarray(k32, np.float64),
        k_tx.astype(np.float32).astype(np.float64),
        np.eye(T),
        y,
        1e-6,
        False,
    )
    np.testing.assert_allclose(mean, ref, rtol=1e-10, atol=1e-10 * np.abs(ref).max())


def test_ntk_ensemble_matches_explicit_formula():
    phi = _features(3, N)
    psi = np.random.default_rng(4).standard_normal((N + T, OUT, 6))
    nngp = _traced(phi, phi)
    ntk = _traced(phi, phi) + _traced(psi, psi)
    y = np.random.default_rng(5).standard_normal((N, OUT))
    x, t = slice(0, N), slice(N, N + T)
    lam = 1e-2 * np.mean(np.diag(ntk[x, x]))
    a = ntk[x, x] + lam * np.eye(N)
    m = ntk[t, x] @ np.linalg.solve(a, np.eye(N))
    mean_ref = m @ y
    cov_ref = nngp[t, t] + m @ nngp[x, x] @ m.T - m @ nngp[x, t] - nngp[t, x] @ m.T
    post = predict.gp_inference(
        predict.Kernels(nngp=nngp[x, x], ntk=ntk[x, x]), y, diag_reg=1e-2, dtype="float64"
    )
    test = predict.Kernels(nngp=nngp[t, x], ntk=ntk[t, x])
    mean, cov = post.ntk(test, nngp[t, t])
    np.testing.assert_allclose(mean, mean_ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(cov, cov_ref, atol=1e-9 * np.abs(cov_ref).max())
    _, var = post.ntk(test, np.diagonal(nngp[t, t]))
    np.testing.assert_allclose(var, np.diag(cov_ref), atol=1e-9 * np.abs(cov_ref).max())
    # the GP posterior of the same object uses the NNGP
    mean_gp, _ = post.nngp(test)
    lam_k = 1e-2 * np.mean(np.diag(nngp[x, x]))
    ref_gp = nngp[t, x] @ np.linalg.solve(nngp[x, x] + lam_k * np.eye(N), y)
    np.testing.assert_allclose(mean_gp, ref_gp, rtol=1e-9, atol=1e-12)


def test_fit_amplitude_scales_covariance_by_ml_sigma2():
    k_xx, k_tx, k_tt, y = _problem("traced", seed=6)
    y = 300.0 * y
    post = predict.gp_inference(k_xx, y, diag_reg=1e-2, fit_amplitude=True, dtype="float64")
    lam = 1e-2 * np.mean(np.diag(k_xx))
    sigma2 = np.sum(y * np.linalg.solve(k_xx + lam * np.eye(N), y)) / y.size
    np.testing.assert_allclose(post.amplitude, sigma2, rtol=1e-10)
    _, cov_ref, _ = _reference(k_xx, k_tx, k_tt, y, 1e-2, False)
    _, cov = post.nngp(k_tx, k_tt)
    np.testing.assert_allclose(cov, sigma2 * cov_ref, atol=1e-9 * sigma2 * np.abs(k_tt).max())


@pytest.mark.parametrize("layout", ["traced", "full"])
def test_test_batches_equal_one_batch(layout):
    k_xx, k_tx, k_tt, y = _problem(layout, seed=7)
    axes = (-1,) if layout == "traced" else ()
    diag = np.diagonal(k_tt) if layout == "traced" else np.stack([k_tt[i, i] for i in range(T)])
    whole = predict.gp_inference(k_xx, y, diag_reg=1e-3, trace_axes=axes)
    for batch in (1, 2, 4):
        chunked = predict.gp_inference(
            k_xx, y, diag_reg=1e-3, trace_axes=axes, test_batch_size=batch
        )
        for k_test_test in (k_tt, diag):
            a, b = whole.nngp(k_tx, k_test_test), chunked.nngp(k_tx, k_test_test)
            np.testing.assert_allclose(a.mean, b.mean, rtol=1e-6, atol=1e-6 * np.abs(a.mean).max())
            np.testing.assert_allclose(a.covariance, b.covariance, atol=1e-6 * np.abs(k_tt).max())


def test_memory_mapped_read_only_kernels(tmp_path):
    k_xx, k_tx, k_tt, y = _problem("traced", seed=8)
    np.save(tmp_path / "kxx.npy", k_xx.astype(np.float32))
    np.save(tmp_path / "ktx.npy", k_tx.astype(np.float32))
    kxx_map = np.load(tmp_path / "kxx.npy", mmap_mode="r")
    ktx_map = np.load(tmp_path / "ktx.npy", mmap_mode="r")
    assert not kxx_map.flags.writeable
    a = predict.gp_inference(kxx_map, y, diag_reg=1e-3).nngp(ktx_map, np.diagonal(k_tt))
    b = predict.gp_inference(np.array(kxx_map), y, diag_reg=1e-3).nngp(
        np.array(ktx_map), np.diagonal(k_tt)
    )
    np.testing.assert_array_equal(a.mean, b.mean)
    np.testing.assert_array_equal(a.covariance, b.covariance)
    np.testing.assert_array_equal(np.load(tmp_path / "kxx.npy"), k_xx.astype(np.float32))
    # diag_reg as a 0-d array (e.g. a value read back with np.load or from a jnp sweep)
    c = predict.gp_inference(kxx_map, y, diag_reg=np.asarray(1e-3)).nngp(ktx_map, np.diagonal(k_tt))
    np.testing.assert_array_equal(a.mean, c.mean)


def test_variances_at_training_points_clip_round_off_to_zero():
    """Test points = training points, tiny λ: exact posterior variance ≈ 0, computed as
    a difference of nearly equal numbers; never negative, never above the prior."""
    phi = np.random.default_rng(9).standard_normal((N, 1, 40))
    k = _traced(phi, phi).astype(np.float32)
    y = np.random.default_rng(10).standard_normal((N, 1)).astype(np.float32)
    post = predict.gp_inference(k, y, diag_reg=1e-7)
    mean, var = post.nngp(k, np.diagonal(k))
    assert np.all(var >= 0) and np.all(var <= np.diagonal(k))
    assert var.max() <= 1e-4 * np.diagonal(k).max()
    np.testing.assert_allclose(mean, y, atol=1e-3)


def test_eigh_path_agrees_with_cholesky():
    k_xx, _, _, y = _problem("traced", seed=11)
    lam = 1e-3 * np.mean(np.diag(k_xx))
    xc = Solver("t", k_xx, lam, np.float32).solve(y)
    xe = Solver("t", k_xx, lam, np.float32, eigh=True).solve(y)
    ref = np.linalg.solve(k_xx + lam * np.eye(N), y)
    for x in (xc, xe):
        np.testing.assert_allclose(x, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_singular_float32_kernel_raises_with_condition_number_and_fix():
    phi = np.random.default_rng(12).standard_normal((40, 1, 5))  # rank 5 < N = 40
    k = _traced(phi, phi).astype(np.float32)
    y = np.ones((40, 1), np.float32)
    with pytest.raises(
        ValueError,
        match=r"^gp_inference: .*ill-conditioned.*condition number ≈ .*Fix: raise diag_reg.*float64",
    ):
        predict.gp_inference(k, y, diag_reg=0.0)
    # the fix works: float64 with a small regulariser, or a larger regulariser in float32
    predict.gp_inference(k, y, diag_reg=1e-5, dtype="float64")
    predict.gp_inference(k, y, diag_reg=1e-2)


@pytest.mark.parametrize(
    "dtype, condition",
    [
        (np.float32, 1e8),
        (np.float32, 1e12),
        (np.float32, 1e15),
        (np.float64, 1e12),
        (np.float64, 1e15),
    ],
)
def test_the_suggested_diag_reg_makes_the_solve_succeed(dtype, condition):
    # A float64 solve's error stays near κ·u (its residuals round as it does), so the
    # suggestion there must bring κ far lower than a float32 solve's (float64 residuals).
    rng = np.random.default_rng(3)
    q = np.linalg.qr(rng.standard_normal((40, 40)))[0]
    k = ((q * np.geomspace(1.0, 1 / condition, 40)) @ q.T).astype(dtype)
    k, y = (k + k.T) / 2, rng.standard_normal((40, 2))
    with pytest.raises(ValueError, match="too ill-conditioned") as info:
        predict.gp_inference(k, y, dtype=dtype)
    message = str(info.value)
    wide = re.search(r"or pass dtype='float64' with diag_reg about ([0-9.e+-]+\d)", message)
    assert (wide is not None) == (dtype == np.float32)  # a float64 solve, and its diag_reg
    if wide is not None:
        predict.gp_inference(k, y, diag_reg=float(wide[1]), dtype="float64")
    suggested = float(re.search(r"raise diag_reg to about ([0-9.e+-]+\d)", message)[1])
    mean = predict.gp_inference(k, y, diag_reg=suggested, dtype=dtype).nngp(k[:3]).mean
    lam = suggested * np.mean(np.diag(k).astype(np.float64))
    ref = k[:3].astype(np.float64) @ np.linalg.solve(k.astype(np.float64) + lam * np.eye(40), y)
    np.testing.assert_allclose(mean, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_not_psd_kernel_raises():
    k = -np.eye(6) - 0.1
    with pytest.raises(ValueError, match=r"^gp_inference: .*not positive semi-definite.*Fix"):
        predict.gp_inference(k, np.ones((6, 1)), diag_reg=1e-3, diag_reg_absolute_scale=True)


def test_negative_variance_beyond_round_off_raises():
    k_xx, k_tx, _, y = _problem("traced", seed=13)
    post = predict.gp_inference(k_xx, y, diag_reg=1e-3)
    with pytest.raises(
        ValueError,
        match=r"^gp_inference\(\.\.\.\)\.nngp: a posterior variance .* not jointly positive semi-definite",
    ):
        post.nngp(k_tx, np.full(T, -1.0))


M = np.eye(4)
Y = np.ones((4, 2))
ERRORS = [
    (
        lambda: predict.gp_inference(np.ones((4, 3)), Y),
        r"^gp_inference: k_train_train has shape \(4, 3\), expected \(4, 4\).*Fix",
    ),
    (
        lambda: predict.gp_inference(M, np.ones((5, 2))),
        r"^gp_inference: k_train_train has shape \(4, 4\), expected \(5, 5\).*Fix",
    ),
    (
        lambda: predict.gp_inference(M, Y, trace_axes=()),
        r"^gp_inference: k_train_train has shape \(4, 4\), expected \(4, 4, 2, 2\).*Fix",
    ),
    (
        lambda: predict.gp_inference(M + np.triu(np.ones((4, 4)), 1), Y),
        r"^gp_inference: k_train_train is not symmetric.*Fix",
    ),
    (
        lambda: predict.gp_inference(M, Y, diag_reg=-1e-3),
        r"^gp_inference: diag_reg must be a real number in \[0, inf\), got -0.001.*Fix",
    ),
    (
        lambda: predict.gp_inference(M, Y, diag_reg="1e-3"),
        r"^gp_inference: diag_reg must be a real number",
    ),
    (
        lambda: predict.gp_inference(np.where(M > 0, np.nan, M), Y),
        r"^gp_inference: k_train_train contains NaN or Inf.*Fix",
    ),
    (
        lambda: predict.gp_inference(M, np.full((4, 2), np.inf)),
        r"^gp_inference: y_train contains NaN or Inf",
    ),
    (
        lambda: predict.gp_inference(M, np.ones(4)),
        r"^gp_inference: y_train must have shape \(N, O...\).*Fix: pass y_train\[:, None\]",
    ),
    (
        lambda: predict.gp_inference(M.astype(int), Y),
        r"^gp_inference: k_train_train must be a floating array",
    ),
    (lambda: predict.gp_inference(M, Y, dtype="float16"), r"^gp_inference: dtype must be None"),
    (
        lambda: predict.gp_inference(M, Y, test_batch_size=0),
        r"^gp_inference: test_batch_size must be None or a positive int",
    ),
    (
        lambda: predict.gp_inference(M, Y, trace_axes=(0,)),
        r"^gp_inference: trace_axes=\(0,\) must name distinct output axes",
    ),
    (
        lambda: predict.gp_inference(M, Y).nngp(np.ones((2, 3))),
        r"^gp_inference\(\.\.\.\)\.nngp: k_test_train has shape \(2, 3\), expected \(M, 4\)",
    ),
    (
        lambda: predict.gp_inference(M, Y).nngp(np.ones((2, 4)), np.ones((3, 3))),
        r"^gp_inference\(\.\.\.\)\.nngp: k_test_test has shape \(3, 3\), expected the full",
    ),
    (
        lambda: predict.gp_inference(M, Y).ntk(np.ones((2, 4)), np.ones((2, 2))),
        r"^gp_inference\(\.\.\.\)\.ntk: the ensemble covariance needs both",
    ),
    (
        lambda: predict.gp_inference(predict.Kernels(ntk=M), Y).nngp(
            predict.Kernels(ntk=np.ones((2, 4)))
        ),
        r"^gp_inference\(\.\.\.\)\.nngp: k_test_train.nngp is None",
    ),
    (
        lambda: predict.gradient_descent_mse(M, Y, learning_rate=0.0),
        r"^gradient_descent_mse: learning_rate must be a real number in \(0, inf\)",
    ),
    (
        lambda: predict.gradient_descent_mse(M, Y)(-1.0),
        r"^gradient_descent_mse\(\.\.\.\): t must be >= 0",
    ),
    (
        lambda: predict.gradient_descent_mse(M, Y)(1.0, fx_train_0=np.ones((3, 2))),
        r"^gradient_descent_mse\(\.\.\.\): fx_train_0 of shape \(3, 2\) does not broadcast",
    ),
]


@pytest.mark.parametrize("call, pattern", ERRORS)
def test_errors(call, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        call()


# -- gradient_descent_mse --------------------------------------------------------------


def _gd_reference(k_xx, k_tx, y, f0, ft0, t, lr, lam):
    """float64 closed form with scipy's matrix exponential (no eigendecomposition):
    f_train(t) = y + expm(−A τ/n)(f0 − y), f_test(t) = ft0 + K_tx A⁻¹ (I − expm(−A τ/n))(y − f0)."""
    kxx, ktx = _flat(k_xx), _flat(k_tx)
    a = kxx + lam * np.eye(len(kxx))
    yy, ff = (y.reshape(-1, 1), f0.reshape(-1, 1)) if k_xx.ndim == 4 else (y, f0)
    e = scipy.linalg.expm(-a * lr * t / y.size)
    train = yy + e @ (ff - yy)
    test = ft0.reshape(ktx.shape[0], -1) + ktx @ np.linalg.solve(
        a, (np.eye(len(a)) - e) @ (yy - ff)
    )
    return train.reshape(y.shape), test.reshape(-1, OUT)


@pytest.mark.parametrize("layout", ["traced", "full"])
def test_gradient_descent_mse_matches_matrix_exponential(layout):
    k_xx, k_tx, _, y = _problem(layout, seed=14)
    rng = np.random.default_rng(15)
    f0, ft0 = rng.standard_normal(y.shape), rng.standard_normal((T, OUT))
    axes = (-1,) if layout == "traced" else ()
    lam = 1e-3 * np.mean(np.diag(_flat(k_xx)))
    mse = predict.gradient_descent_mse(
        k_xx, y, learning_rate=0.5, diag_reg=1e-3, trace_axes=axes, dtype="float64"
    )
    times = np.array([[0.0, 3.0], [50.0, 2000.0]])
    out = mse(times, fx_train_0=f0, fx_test_0=ft0, k_test_train=k_tx)
    assert out.train.shape == (2, 2, N, OUT) and out.test.shape == (2, 2, T, OUT)
    for idx in np.ndindex(times.shape):
        train_ref, test_ref = _gd_reference(k_xx, k_tx, y, f0, ft0, times[idx], 0.5, lam)
        np.testing.assert_allclose(out.train[idx], train_ref, atol=1e-9 * np.abs(train_ref).max())
        np.testing.assert_allclose(out.test[idx], test_ref, atol=1e-8 * np.abs(test_ref).max())
    # t = None (convergence) equals the regularised kernel regression from f0
    inf = mse(None, fx_train_0=f0, fx_test_0=ft0, k_test_train=k_tx)
    kxx, ktx = _flat(k_xx), _flat(k_tx)
    yy, ff = (y.reshape(-1, 1), f0.reshape(-1, 1)) if layout == "full" else (y, f0)
    ref = ft0 + (ktx @ np.linalg.solve(kxx + lam * np.eye(len(kxx)), yy - ff)).reshape(T, OUT)
    np.testing.assert_allclose(inf.test, ref, atol=1e-9 * np.abs(ref).max())
    np.testing.assert_allclose(inf.train, y)
    # a scalar time gives no time axis; test batches give the same numbers
    one = mse(3.0, fx_train_0=f0, fx_test_0=ft0, k_test_train=k_tx)
    assert one.test.shape == (T, OUT)
    chunked = predict.gradient_descent_mse(
        k_xx,
        y,
        learning_rate=0.5,
        diag_reg=1e-3,
        trace_axes=axes,
        dtype="float64",
        test_batch_size=2,
    )(3.0, fx_train_0=f0, fx_test_0=ft0, k_test_train=k_tx)
    np.testing.assert_allclose(chunked.test, one.test, rtol=1e-12, atol=1e-12)


def test_gradient_descent_mse_singular_kernel_finite_times_and_convergence():
    """Rank-deficient NTK (rank 4 < N = 20) with no regulariser: finite times are well
    defined (no inversion: (1 − e^{−wτ})/w → τ at w = 0); directions the kernel does not
    move stay put, so at t = ∞ the test outputs are those of the least-squares fit in
    the features (reference: numpy's lstsq, independent of the eigendecomposition), and
    a large finite t approaches them."""
    phi = np.random.default_rng(16).standard_normal((20, 1, 4))
    k = _traced(phi, phi).astype(np.float32)
    y = np.random.default_rng(17).standard_normal((20, 1)).astype(np.float32)
    mse = predict.gradient_descent_mse(k, y)
    out = mse(np.array([1.0, 100.0]), fx_train_0=0.0, fx_test_0=0.0, k_test_train=k[:3])
    assert np.isfinite(out.train).all() and np.isfinite(out.test).all()
    e = scipy.linalg.expm(-k.astype(np.float64) * 100.0 / y.size)
    np.testing.assert_allclose(out.train[1], y + e @ (0 - y), atol=1e-4)
    a = phi[:, 0, :].astype(np.float32).astype(np.float64)
    beta = np.linalg.lstsq(a, y.astype(np.float64), rcond=None)[0]
    expected = a[:3] @ beta
    np.testing.assert_allclose(mse(None, k_test_train=k[:3]).test, expected, rtol=1e-5)
    np.testing.assert_allclose(mse(1e9, k_test_train=k[:3]).test, expected, rtol=1e-5)


def test_gradient_descent_mse_refuses_test_predictions_float64_cannot_resolve():
    """Eigenvalues 1 and 1e-12 (float64, far above round-off, so not a null direction):
    at t = ∞ the weight 1/w = 1e12 makes float64 round-off alone 1e-4 relative; finite t
    and t = ∞ refuse alike once u·λ_max·max h > 1e-6, and small t is computed."""
    q = np.linalg.qr(np.random.default_rng(3).standard_normal((6, 6)))[0]
    k = (q * np.array([1e-12, 0.5, 0.6, 0.7, 0.8, 1.0])) @ q.T
    k = (k + k.T) / 2
    y = np.random.default_rng(4).standard_normal((6, 1))
    mse = predict.gradient_descent_mse(k, y, dtype="float64")
    pattern = r"^gradient_descent_mse\(\.\.\.\): the test predictions .*too ill-conditioned.*Fix: raise diag_reg"
    for t in (None, 1e14):
        with pytest.raises(ValueError, match=pattern):
            mse(t, k_test_train=k[:2])
    w, v = np.linalg.eigh(k)
    tau = 10.0 / y.size
    ref = k[:2] @ (v @ ((-np.expm1(-w * tau) / w)[:, None] * (v.T @ y)))
    np.testing.assert_allclose(mse(10.0, k_test_train=k[:2]).test, ref, rtol=1e-10)


def test_ntk_ensemble_at_time_t_matches_matrix_exponential_and_converges_to_gp_inference():
    phi = _features(18, N)
    psi = np.random.default_rng(19).standard_normal((N + T, OUT, 6))
    nngp = _traced(phi, phi)
    ntk = nngp + _traced(psi, psi)
    y = np.random.default_rng(20).standard_normal((N, OUT))
    x, t = slice(0, N), slice(N, N + T)
    train = predict.Kernels(nngp=nngp[x, x], ntk=ntk[x, x])
    test = predict.Kernels(nngp=nngp[t, x], ntk=ntk[t, x])
    lam = 1e-3 * np.mean(np.diag(ntk[x, x]))
    a = ntk[x, x] + lam * np.eye(N)
    mse = predict.gradient_descent_mse(train, y, learning_rate=2.0, diag_reg=1e-3, dtype="float64")
    times = np.array([0.0, 5.0, 500.0])
    g = mse.ntk_ensemble(times, test, nngp[t, t])
    assert g.mean.shape == (3, T, OUT) and g.covariance.shape == (3, T, T)
    for i, tk in enumerate(times):
        h = np.linalg.solve(a, np.eye(N) - scipy.linalg.expm(-a * 2.0 * tk / y.size))
        m = ntk[t, x] @ h
        cov = nngp[t, t] + m @ nngp[x, x] @ m.T - m @ nngp[x, t] - nngp[t, x] @ m.T
        np.testing.assert_allclose(g.mean[i], m @ y, atol=1e-9 * max(np.abs(m @ y).max(), 1))
        np.testing.assert_allclose(g.covariance[i], cov, atol=1e-9 * np.abs(cov).max())
    # t = 0: the prior; t = ∞: the converged posterior of gp_inference
    np.testing.assert_allclose(g.covariance[0], nngp[t, t], atol=1e-12 * np.abs(nngp).max())
    inf = mse.ntk_ensemble(None, test, np.diagonal(nngp[t, t]))
    ref = predict.gp_inference(train, y, diag_reg=1e-3, dtype="float64").ntk(
        test, np.diagonal(nngp[t, t])
    )
    np.testing.assert_allclose(inf.mean, ref.mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(inf.covariance, ref.covariance, rtol=1e-9, atol=1e-12)


C3_KERNELS = pathlib.Path(__file__).parents[1] / "data" / "gp_erf_1d_nt_stax_kernels.npz"


@pytest.mark.parametrize("diag_reg", [1e-2, 1e-3, 1e-4])
@pytest.mark.parametrize("name", ["nngp", "ntk"])
def test_c3_with_neural_tangents_infinite_width_kernels(name, diag_reg):
    """Case C3 on the kernels neural-tangents 0.6.5's stax computed for the case's 13 x 511
    Erf network (float32; benchmarks/compare_neural_tangents_predict.py c3-analytic).
    There neural-tangents' own float32 GP inference gave 15 of 70 NaN standard deviations
    for the NTK at diag_reg=1e-4. Here: no NaN, 0 <= variance <= prior, and the mean of a
    float64 solve of the same float32 kernel; or the documented refusal."""
    d = np.load(C3_KERNELS)
    y = np.load(C3_KERNELS.with_name("gp_erf_1d.npz"))["y_train"]
    n, k = int(d["n_train"]), d[name]
    assert k.dtype == np.float32
    k_xx, k_tx, prior = k[:n, :n], k[n:, :n], np.diagonal(k)[n:]
    lam = diag_reg * np.mean(np.diag(k_xx).astype(np.float64))
    a = k_xx.astype(np.float64) + lam * np.eye(n)
    ref = k_tx.astype(np.float64) @ np.linalg.solve(a, y.astype(np.float64))
    try:
        post = predict.gp_inference(k_xx, y, diag_reg=diag_reg)
    except ValueError as e:
        assert "too ill-conditioned" in str(e) and "Fix: raise diag_reg" in str(e)
        return
    mean, var = post.nngp(k_tx, prior)
    assert np.isfinite(mean).all() and np.isfinite(var).all()
    assert np.all(var >= 0) and np.all(var <= prior)
    np.testing.assert_allclose(mean, ref, rtol=0, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gradient_descent_mse_singular_kernel_train_outputs_at_convergence(dtype):
    """Rank-deficient NTK (rank 4 < N = 20), diag_reg = 0: at t = ∞ gradient flow only
    fits the projection of y onto range(K); the rest of f0 − y stays. Reference: the
    orthogonal projector of the features (independent of the eigendecomposition)."""
    rng = np.random.default_rng(18)
    phi = rng.standard_normal((20, 1, 4))
    k = _traced(phi, phi).astype(dtype)
    y = rng.standard_normal((20, 1)).astype(dtype)
    f0 = rng.standard_normal((20, 1)).astype(dtype)
    a = phi[:, 0, :]
    proj = a @ np.linalg.solve(a.T @ a, a.T)  # onto range(K)
    expected = proj @ y + (np.eye(20) - proj) @ f0
    mse = predict.gradient_descent_mse(k, y)
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(mse(None, fx_train_0=f0).train, expected, atol=tol)
    np.testing.assert_allclose(mse(np.array([np.inf]), fx_train_0=f0).train[0], expected, atol=tol)
    # the loss at convergence is that of the projection, not 0
    assert ((mse(None, fx_train_0=0.0).train - y) ** 2).mean() > 0.1


def _tanh_features_kernel(n_train, n_test, seed=0):
    """A float32 NTK-like kernel (random tanh features plus a linear term), its train and
    test-train blocks, and float32 targets."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_train + n_test, 8))
    f = np.tanh(x @ (rng.standard_normal((8, 200)) / np.sqrt(8)))
    k = (f @ f.T / 200 + 0.05 * (x @ x.T) / 8).astype(np.float32)
    y = rng.standard_normal((n_train, 1)).astype(np.float32)
    return k[:n_train, :n_train], k[n_train:, :n_train], y


def _gradient_flow_reference(k_xx, k_tx, y, t, f0=0.0, ft0=0.0):
    """f_test(t) from a float64 eigendecomposition of the same (float32) kernel."""
    w, v = np.linalg.eigh(k_xx.astype(np.float64))
    tau = t / y.size
    h = -np.expm1(-w * tau) / w
    return ft0 + k_tx.astype(np.float64) @ (v @ (h[:, None] * (v.T @ (y - f0))))


@pytest.mark.parametrize("t", [10.0, 1e3, 1e5, 1e7])
def test_gradient_descent_mse_float32_kernel_keeps_accuracy_at_large_times(t):
    """A float32 eigendecomposition lost up to 1.3e-3 relative against a float64 one at
    t = 1e5 (7e-5 on this kernel, condition number 9e3); the spectral factor is float64
    now, so only the float32 rounding of the results remains."""
    k_xx, k_tx, y = _tanh_features_kernel(60, 10)
    got = predict.gradient_descent_mse(k_xx, y)(t, k_test_train=k_tx).test
    assert got.dtype == np.float32
    ref = _gradient_flow_reference(k_xx, k_tx, y, t)
    assert np.abs(got - ref).max() <= 3e-7 * np.abs(ref).max()


def test_gradient_descent_mse_uses_both_initial_outputs():
    """Given outputs at t = 0 enter the train and the test formula."""
    k_xx, k_tx, y = _tanh_features_kernel(30, 5, seed=1)
    rng = np.random.default_rng(2)
    f0 = rng.standard_normal((30, 1)).astype(np.float32)
    ft0 = rng.standard_normal((5, 1)).astype(np.float32)
    out = predict.gradient_descent_mse(k_xx, y)(50.0, f0, ft0, k_tx)
    ref = _gradient_flow_reference(k_xx, k_tx, y, 50.0, f0, ft0)
    np.testing.assert_allclose(out.test, ref, rtol=0, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (
            dict(fx_train_0=None, fx_test_0=1.0),
            r"fx_train_0=None with k_test_train.*Fix: pass fx_train_0",
        ),
        (dict(fx_train_0=None), r"fx_train_0=None with k_test_train"),
        (
            dict(fx_train_0=0.5),
            r"fx_train_0 is given .* but fx_test_0 is left at its default 0.0.*Fix: pass fx_test_0 too",
        ),
        (
            dict(fx_test_0=-2.0),
            r"fx_test_0 is given .* but fx_train_0 is left at its default 0.0.*Fix: pass fx_train_0 too",
        ),
        (
            dict(fx_train_0=0.0, fx_test_0=None),
            r"fx_test_0=None with k_test_train.*Fix: pass fx_test_0",
        ),
        (dict(fx_train_0=0.0, fx_test_0=np.nan), r"fx_test_0 contains NaN or Inf"),
        (dict(fx_train_0=0.0, fx_test_0="zero"), r"fx_test_0 must be a number or an array"),
        (dict(fx_test_0="zero"), r"fx_test_0 must be a number or an array"),
        (dict(fx_train_0="zero"), r"fx_train_0 must be a number or an array"),
        (dict(fx_test_0=np.array([[np.nan]])), r"fx_test_0 contains NaN or Inf"),
        (dict(fx_train_0=np.ones((5, 1))), r"fx_train_0 of shape \(5, 1\) does not broadcast"),
    ],
)
def test_gradient_descent_mse_refuses_test_predictions_from_outputs_not_given(kwargs, pattern):
    """fx_train_0=None used to make the test formula take f_train(0) = 0 silently (the test
    outputs moved by up to 1.24 on outputs of size 1.8), fx_test_0=None gave NaN."""
    k_xx, k_tx, y = _tanh_features_kernel(12, 3, seed=3)
    mse = predict.gradient_descent_mse(k_xx, y)
    with pytest.raises(
        (ValueError, TypeError), match=r"^gradient_descent_mse\(\.\.\.\): " + pattern
    ):
        mse(5.0, k_test_train=k_tx, **kwargs)


def test_gradient_descent_mse_accepts_zero_outputs_on_one_side_and_train_only_calls():
    """A given 0.0 beside a default one is consistent; without k_test_train, fx_test_0 is
    not needed and fx_train_0=None with fx_test_0 left alone is 'nothing to predict'."""
    k_xx, k_tx, y = _tanh_features_kernel(12, 3, seed=3)
    mse = predict.gradient_descent_mse(k_xx, y)
    a = mse(5.0, fx_train_0=np.zeros((12, 1)), k_test_train=k_tx).test
    np.testing.assert_array_equal(a, mse(5.0, k_test_train=k_tx).test)
    assert mse(5.0, fx_train_0=np.ones((12, 1))).test is None
    with pytest.raises(ValueError, match=r"fx_test_0 is given but k_test_train=None"):
        mse(5.0, fx_test_0=np.ones((3, 1)))


@pytest.mark.parametrize("m", [60, 200])
def test_low_rank_prior_warns_with_its_rank(m):
    """An empirical NNGP of one network with one output, K = f fᵀ, is rank 1: accepted
    as before (same mean as a float64 solve), with a DegenerateKernelWarning naming the
    rank (m = 60: all eigenvalues; m = 200: the 64-probe sketch)."""
    rng = np.random.default_rng(5)
    f = rng.standard_normal((m, 1)).astype(np.float32)
    y = rng.standard_normal((m, 1)).astype(np.float32)
    k = f @ f.T
    with pytest.warns(
        predict.DegenerateKernelWarning,
        match=rf"^gp_inference: k_train_train has numerical rank 1 of {m} .*monte_carlo_kernels",
    ):
        post = predict.gp_inference(k, y, diag_reg=1e-3)
    lam = 1e-3 * np.mean(np.diag(k).astype(np.float64))
    ref = k[:3].astype(np.float64) @ np.linalg.solve(k.astype(np.float64) + lam * np.eye(m), y)
    np.testing.assert_allclose(post.nngp(k[:3]).mean, ref, rtol=1e-5)


def test_low_rank_prior_warning_counts_features_and_names_the_kernel():
    """Kernels(nngp=rank 5, ntk=full rank): the NNGP is named with its rank, the NTK
    (random features, 300 > M) is not."""
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((100, 5)), rng.standard_normal((100, 300))
    kernels = predict.Kernels(nngp=a @ a.T, ntk=b @ b.T / 300)
    with pytest.warns(predict.DegenerateKernelWarning) as record:
        predict.gp_inference(kernels, rng.standard_normal((100, 1)), diag_reg=1e-4)
    messages = [str(w.message) for w in record]
    assert len(messages) == 1 and "k_train_train.nngp has numerical rank 5 of 100" in messages[0]


@pytest.mark.filterwarnings("error::ntk_core.predict.DegenerateKernelWarning")
def test_full_rank_and_smooth_priors_do_not_warn():
    """neural-tangents' infinite-width kernels of case C3 on 1-D inputs (float32; their
    spectrum fades gradually below round-off) and a random-feature kernel with more
    features than points are no degenerate priors."""
    d = np.load(C3_KERNELS)
    y = np.load(C3_KERNELS.with_name("gp_erf_1d.npz"))["y_train"]
    n = int(d["n_train"])
    for name in ("nngp", "ntk"):
        predict.gp_inference(d[name][:n, :n], y, diag_reg=1e-2)
    b = np.random.default_rng(7).standard_normal((150, 400))
    predict.gp_inference(b @ b.T / 400, np.ones((150, 1)), diag_reg=1e-6)


MLP_NTK = pathlib.Path(__file__).parents[1] / "data" / "gd_mse_float32_mlp_ntk.npz"


@pytest.mark.parametrize("t", [1.0, 1e2, 1e4, 1e5, 1e7, None])
def test_gradient_descent_mse_trains_every_real_direction_of_a_float32_ntk(t):
    """A new user's float32 NTK of a Flax MLP 3-32-32-1 (P = 1217 > N = 40, so full
    rank; smallest eigenvalue 7.45e-4 = 2.8e-6·λ_max, also in a float64 recomputation)
    with the network's own outputs at t = 0. A null-direction cut-off of M·eps·λ_max
    froze that direction: 1.1e-2 to 6.6e-2 relative error in the test outputs from
    t = 1e4. Reference: a float64 eigendecomposition of the same kernel."""
    d = np.load(MLP_NTK)
    k_xx, k_tx, f0, ft0, y = (d[k] for k in ("ktt", "kxt", "f0", "g0", "ytr"))
    out = predict.gradient_descent_mse(k_xx, y)(t, f0, ft0, k_tx)
    w, v = np.linalg.eigh(k_xx.astype(np.float64))
    tau = (np.inf if t is None else t) / y.size
    train = y + v @ (np.exp(-w * tau)[:, None] * (v.T @ (f0 - y)))
    h = 1 / w if t is None else -np.expm1(-w * tau) / w
    test = ft0 + k_tx.astype(np.float64) @ (v @ (h[:, None] * (v.T @ (y - f0))))
    assert np.abs(out.train - train).max() <= 1e-6 * np.abs(train).max()
    assert np.abs(out.test - test).max() <= 1e-6 * np.abs(test).max()


@pytest.mark.parametrize("lr", [0.5, np.float32(0.5), np.float64(0.5), "jax"])
def test_learning_rate_as_numpy_or_jax_scalar(lr):
    # f_train(t) = y + exp(-w η t / n) (f_train(0) - y) for K = w I, f_train(0) = 0, n = y.size
    if lr == "jax":
        import jax.numpy as jnp

        lr = jnp.float32(0.5)
    k, y, t = 2.0 * np.eye(3), np.arange(1.0, 4.0)[:, None], 3.0
    got = predict.gradient_descent_mse(k, y, learning_rate=lr, dtype="float64")(t).train
    np.testing.assert_allclose(got, y * (1 - np.exp(-2.0 * 0.5 * t / 3)), rtol=1e-12)
