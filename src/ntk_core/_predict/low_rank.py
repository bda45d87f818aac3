"""Kernel regression and GP posteriors of a low-rank kernel Φ Φᵀ, from its features (N, k)."""

from __future__ import annotations

import math

import numpy as np

from ntk_core._errors import bad
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._predict.inference import Gaussian
from ntk_core._predict.linalg import (
    MISSING_TARGETS,
    Solver,
    as_host_array,
    check_diag_reg,
    check_finite,
    check_prior_symmetric,
    finite_host_array,
    unit_roundoff,
)

#: Bytes of float64 per row block when streaming features (tests lower it).
_BLOCK_BYTES = 64 << 20
#: ΦᵀΦ + λI counts as singular when its smallest eigenvalue is <= _SINGULAR·k·u·λ_max.
_SINGULAR = 1e3
_U64 = unit_roundoff(np.float64)


def _blocks(n_rows: int, k: int):
    rows = max(1, _BLOCK_BYTES // (8 * max(k, 1)))
    for start in range(0, n_rows, rows):
        yield slice(start, min(n_rows, start + rows))


def _features(fn, name, phi, k=None) -> np.ndarray:
    phi = as_host_array(fn, name, phi)
    want = "(N, k)" if k is None else f"(M, {k})"
    if phi.ndim != 2 or 0 in phi.shape or (k is not None and phi.shape[1] != k):
        what = f"{name} has shape {phi.shape}, expected {want}"
        raise bad(ValueError, fn, what, "pass k features per sample, the same k as features_train")
    return phi


def _block64(fn, name, phi, rows) -> np.ndarray:
    block = np.asarray(phi[rows], np.float64)
    check_finite(fn, name, block, first=rows.start)
    return block


class LowRankInference:
    """Predictor returned by :func:`low_rank_inference`."""

    def __init__(self, fn, features, y_train, diag_reg, diag_reg_absolute_scale):
        import scipy.linalg  # not at import: 0.3 s off `import ntk_core`

        self._fn = fn
        lam_scale, absolute = check_diag_reg(fn, diag_reg, diag_reg_absolute_scale)
        phi = _features(fn, "features_train", features)
        (n, k), y = phi.shape, finite_host_array(fn, "y_train", y_train, MISSING_TARGETS)
        if y.ndim not in (1, 2) or y.shape[0] != n or y.size == 0:
            what = f"y_train has shape {y.shape}, expected (N,) or (N, O >= 1) with N = {n}"
            raise bad(ValueError, fn, what, "pass one target row per row of features_train")
        self._y_shape, self.k = y.shape, k
        self.dtype = np.dtype(np.float64 if np.float64 in (phi.dtype, y.dtype) else np.float32)
        y2 = y.reshape(n, -1)
        # N < k: the N x N system (ΦΦᵀ + λI) α = y, w = Φᵀα, with Φ kept (N·k <= k²);
        # else the k x k system (ΦᵀΦ + λI) w = Φᵀy, summed over row blocks of Φ
        self._phi = np.empty((n, k)) if n < k else None
        size = min(n, k)
        gram, rhs = np.zeros((size, size)), np.zeros((size, y2.shape[1]))
        with np.errstate(over="ignore", invalid="ignore"):  # checked below
            for rows in _blocks(n, k):
                block = _block64(fn, "features_train", phi, rows)
                yb = np.asarray(y2[rows], np.float64)
                if self._phi is not None:
                    self._phi[rows], rhs[rows] = block, yb
                    continue
                gram += block.T @ block
                rhs += block.T @ yb
            if self._phi is not None:
                gram = self._phi @ self._phi.T
        name = "ΦᵀΦ" if self._phi is None else "ΦΦᵀ"
        check_finite(
            fn, f"{name} (summed in float64)", gram, "rescale the features", unit="feature"
        )
        mean_diag = float(np.trace(gram)) / n  # mean diag Φ Φᵀ
        reg = 1.0 if absolute else mean_diag
        self.regularizer = lam = lam_scale * reg
        if mean_diag == 0.0 and lam == 0.0:
            scale = "absolute" if absolute else "relative"
            what = f"features_train is all zeros and λ = 0 ({scale} diag_reg)"
            fix = "pass non-zero features, or diag_reg > 0 with diag_reg_absolute_scale=True"
            raise bad(ValueError, fn, what, fix)
        w = scipy.linalg.eigvalsh(gram + lam * np.eye(size), check_finite=False)
        w_max = max(float(w[-1]), np.finfo(np.float64).tiny)
        if not w[0] > _SINGULAR * size * _U64 * w_max:
            what = f"{name} + λI (k = {k}, λ = {lam:.3e}, N = {n}) is singular to float64"
            need = 10 * _SINGULAR * size * _U64 * w_max / max(reg, np.finfo(np.float64).tiny)
            need = 10 ** math.ceil(math.log10(need))
            fix = f"pass diag_reg >= {need:.0e}, or drop dependent features or repeated samples"
            raise bad(ValueError, fn, what, fix)
        self._solver = Solver(fn, gram, lam, np.float64, reg_scale=reg)
        solved = self._solver.solve(rhs)
        # (k, O): (ΦᵀΦ + λI)⁻¹ Φᵀ y = Φᵀ (ΦΦᵀ + λI)⁻¹ y
        self.weights = solved if self._phi is None else self._phi.T @ solved

    def _explained(self, block: np.ndarray) -> np.ndarray:
        """λ (ΦᵀΦ + λI)⁻¹ φ*ᵀ ``(k, B)`` for a block φ* ``(B, k)``: by the k x k solve, or
        (N < k) as φ*ᵀ − Φᵀ (ΦΦᵀ + λI)⁻¹ Φ φ*ᵀ, which also holds at λ = 0."""
        if self._phi is None:
            return self.regularizer * self._solver.solve(block.T)
        return block.T - self._phi.T @ self._solver.solve(self._phi @ block.T)

    def posterior(
        self, features_test, k_test_test=None, *, variance=False, full_covariance=False
    ) -> Gaussian:
        """Posterior mean Φ* w and, when asked, the covariance of the test points.

        Args:
          features_test: ``(M, k)`` features of M test points; numpy, memmap or jax array.
          k_test_test: None (prior Φ* Φ*ᵀ, the features' own), or the prior to use instead:
            ``(M,)`` with ``variance=True``, ``(M, M)`` with ``full_covariance=True``.
          variance: return the per-sample variances ``(M,)``.
          full_covariance: return the ``(M, M)`` covariance (O(M²) memory), not variances.

        Returns ``Gaussian``: mean ``(M,)`` / ``(M, O)`` as ``y_train``; covariance None,
        ``(M,)`` or ``(M, M)``, shared by the outputs. Raises ValueError: a shape not
        matching, NaN or Inf (NonFiniteError), ``k_test_test`` without ``variance`` or
        ``full_covariance``, a variance below −10·k·u·(|prior| + |φ*|²) (a prior smaller
        than the features' own, e.g. a sketch's noise).
        """
        fn = f"{self._fn}(...).posterior"
        phi = _features(fn, "features_test", features_test, self.k)
        m, full = phi.shape[0], bool(full_covariance)
        want = None if not (variance or full) else (m, m) if full else (m,)
        prior = None if k_test_test is None else finite_host_array(fn, "k_test_test", k_test_test)
        if prior is not None and prior.shape != want:
            what = f"k_test_test has shape {prior.shape}, expected {want} for M = {m}"
            if want is None:
                what = "k_test_test is given, but variance=False and full_covariance=False"
            fix = "pass an (M,) prior with variance=True, or (M, M) with full_covariance=True"
            raise bad(ValueError, fn, what, fix)
        mean = np.empty((m, self.weights.shape[1]))
        own, left = np.empty(m), (np.empty((self.k, m)) if full else None)
        quad = np.empty(m) if want else None
        for rows in _blocks(m, self.k):
            block = _block64(fn, "features_test", phi, rows)
            mean[rows] = block @ self.weights
            if want is None:
                continue
            explained = self._explained(block)  # (k, B): λ (ΦᵀΦ + λI)⁻¹ φ*
            own[rows] = np.einsum("ik,ik->i", block, block)
            quad[rows] = np.einsum("ik,ki->i", block, explained)
            if full:
                left[:, rows] = explained
        mean = mean.reshape((m,) + self._y_shape[1:]).astype(self.dtype)
        if want is None:
            return Gaussian(mean, None)
        cov = self._covariance(fn, phi, prior, own, quad, left)
        return Gaussian(mean, cov.astype(self.dtype))

    def _covariance(self, fn, phi, prior, own, quad, left) -> np.ndarray:
        """prior − Φ*Φ*ᵀ + λ Φ*(ΦᵀΦ + λI)⁻¹Φ*ᵀ; the features' own prior: the last term."""
        if prior is not None and left is not None:
            check_prior_symmetric(fn, "k_test_test", prior)
        p = None if prior is None else np.asarray(prior, np.float64)
        p_diag = own if p is None else (p if left is None else np.diagonal(p))
        var = quad + (0.0 if p is None else p_diag - own)
        tol = 10 * self.k * unit_roundoff(self.dtype) * (np.abs(p_diag) + own)
        if (below := var < -tol).any():
            i = int(np.flatnonzero(below)[0])
            what = f"the variance of test point {i} came out {var[i]:.3e} < −{tol[i]:.1e}: "
            what += f"k_test_test there ({p_diag[i]:.3e}) is below |φ*|² = {own[i]:.3e}"
            fix = "omit k_test_test (the features' own prior), or pass a prior of these features"
            raise bad(ValueError, fn, what, fix)
        var = np.maximum(var, 0.0)
        if left is None:
            return var
        m, cov = phi.shape[0], np.empty((phi.shape[0], phi.shape[0]))
        phi_t = None if p is None else np.asarray(phi, np.float64).T  # (k, M), as ``left``
        for rows in _blocks(m, self.k):
            block = np.asarray(phi[rows], np.float64)
            cov[rows] = block @ left
            if p is not None:
                cov[rows] += p[rows] - block @ phi_t
        cov = (cov + cov.T) / 2
        cov[np.diag_indices(m)] = var
        return cov


def low_rank_inference(
    features_train,
    y_train,
    *,
    diag_reg: float = 0.0,
    diag_reg_absolute_scale: bool = False,
) -> LowRankInference:
    """Kernel regression and GP posterior of the kernel K = Φ Φᵀ, from its features Φ.

    For Θ(x_i, x_j) ≈ φ_i·φ_j (a sketch, random features, or any feature map), with
    A = ΦᵀΦ + λI_k (k x k), by the push-through identity Φᵀ(ΦΦᵀ + λI_N)⁻¹ = A⁻¹Φᵀ:

        mean(x*) = φ*ᵀ A⁻¹ Φᵀ y            = k*ᵀ (K + λI_N)⁻¹ y
        var(x*)  = k(x*, x*) − |φ*|² + λ φ*ᵀ A⁻¹ φ*
                                           = k(x*, x*) − k*ᵀ (K + λI_N)⁻¹ k*

    (k* = Φφ*; since Φᵀ(ΦΦᵀ + λI)⁻¹Φ = I − λA⁻¹). With the features' own prior
    k(x*, x*) = |φ*|² the variance is λ φ*ᵀA⁻¹φ*, and the covariance λ Φ*A⁻¹Φ*ᵀ. The same
    numbers as :func:`gp_inference` given ``k_train_train`` = ΦΦᵀ and ``k_test_train`` =
    Φ*Φᵀ, without an N x N matrix. λ = 0 (N >= k): the least-squares projection
    Φ*(ΦᵀΦ)⁻¹Φᵀy, variance 0 under the features' own prior. With N < k the N x N system
    is solved instead (w = Φᵀ(ΦΦᵀ + λI)⁻¹y, the same numbers, O(N²·k)); there λ = 0 is
    interpolation (the minimum-norm w), as :func:`gp_inference` on ΦΦᵀ.

    Args:
      features_train: Φ ``(N, k)`` float; numpy, jax, or a read-only memmap
        (``np.load(path, mmap_mode="r")``) larger than memory: read in row blocks of 64 MiB
        of float64.
      y_train: targets ``(N,)`` or ``(N, O)``, float.
      diag_reg: >= 0; λ = ``diag_reg``·mean(diag ΦΦᵀ) = ``diag_reg``·‖Φ‖²_F / N, or
        λ = ``diag_reg`` with ``diag_reg_absolute_scale=True`` (as :func:`gp_inference`).

    ΦᵀΦ and Φᵀy are summed in float64 block by block; A is checked by its eigenvalues and
    solved by Cholesky in float64, refined until the last correction is <= 1e-6.

    Returns :class:`LowRankInference`: ``.posterior(features_test, k_test_test=None, *,
    variance=False, full_covariance=False) -> Gaussian``; ``.weights`` A⁻¹Φᵀy ``(k, O)``;
    ``.regularizer`` λ. Results are float32 unless Φ or y is float64.
    Raises ValueError: shapes (Φ not 2-D, y of another N, k differing between train and
    test), negative ``diag_reg``; A (or ΦΦᵀ + λI when N < k) singular to float64 (smallest
    eigenvalue <= 1000·min(N, k)·u times the largest, e.g. λ = 0 with dependent columns or
    repeated samples), with the ``diag_reg`` that fixes it; NonFiniteError (a ValueError):
    NaN or Inf, naming the first row.
    TypeError: non-floating arrays, ``diag_reg_absolute_scale`` not a bool.

    Cost (N >= k): 2·N·k·(k + O) flops and one pass over Φ; O(k² + N·O) memory besides a
    block; 4·k³/3 for the eigenvalue check, k³/3 for Cholesky; per test point 2·k·O
    (mean), 4·k² (variance, one refined solve). N < k: the same with N and k exchanged in
    the k³ and k² terms, Φ held in float64 (8·N·k bytes), 4·N·k per test point's variance.

    Example:
      >>> import numpy as np
      >>> from ntk_core import predict
      >>> rng = np.random.default_rng(0)
      >>> phi, phi_test = rng.standard_normal((100, 8)), rng.standard_normal((3, 8))
      >>> y = phi @ np.ones(8)                              # (N,) = (100,)
      >>> post = predict.low_rank_inference(phi, y, diag_reg=1e-6)
      >>> mean, var = post.posterior(phi_test, variance=True)
      >>> bool(np.allclose(mean, phi_test @ np.ones(8), atol=1e-4)), var.shape
      (True, (3,))

    References: Rasmussen, Williams, "Gaussian Processes for Machine Learning", 2006,
    eq. 2.11-2.12 (weight-space view); Woodbury, 1950.
    """
    fn = "low_rank_inference"
    return LowRankInference(fn, features_train, y_train, diag_reg, diag_reg_absolute_scale)


low_rank_inference = _checked_arguments(low_rank_inference)
