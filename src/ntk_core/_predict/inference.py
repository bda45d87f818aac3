"""Predictions from kernels: GP posterior, NTK ensemble and gradient-descent MSE dynamics.

Public through :mod:`ntk_core.predict`. Formulas and output layout follow
neural-tangents 0.6 (``nt.predict.gp_inference``, ``nt.predict.gradient_descent_mse``),
so ported code gives the same numbers where neural-tangents' were finite; the linear
algebra is that of :mod:`ntk_core._predict.linalg` (host numpy/LAPACK, refined solves,
no silent NaN).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import numpy as np

from ntk_core._jax.environment import _user_stacklevel
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._kernel.options import DEFAULTS
from ntk_core._predict.linalg import (
    ACCEPT,
    FlatLayout,
    Solver,
    as_host_array,
    bad,
    check_diag_reg,
    check_finite,
    check_int,
    check_real,
    check_rows_finite,
    compute_dtype,
    is_real,
    matmul64,
    numerical_rank,
    scan_train_kernel,
    unit_roundoff,
)


class DegenerateKernelWarning(UserWarning):
    """A train-train kernel given to :func:`~ntk_core.predict.gp_inference` has low rank.

    The posterior then lives in a low-dimensional space of functions: an empirical NNGP
    of one network with O outputs has rank at most O (one Monte Carlo sample of the
    prior), an empirical NTK rank at most the number of parameters.
    """


class Gaussian(NamedTuple):
    """A posterior: ``mean`` and ``covariance`` (``None`` when no test-test kernel was given).

    Unpacks like neural-tangents' ``Gaussian``: ``mean, cov = predictor.nngp(...)``.
    """

    mean: Any
    covariance: Any


class Kernels(NamedTuple):
    """An NNGP kernel and an NTK on the same inputs, in the same layout (either may be None).

    Returned by :func:`ntk_core.monte_carlo_kernels`; accepted by every function of
    :mod:`ntk_core.predict` wherever a kernel is.
    """

    nngp: Any = None
    ntk: Any = None


class Outputs(NamedTuple):
    """Network outputs on the training and test inputs (``None`` when not requested)."""

    train: Any
    test: Any


_SHARED_DOC = """
    Shared arguments:
      y_train: targets ``(N, O...)``, float; at least one output axis (``y[:, None]`` for
        one output).
      diag_reg: the regulariser strength, >= 0. The solves use ``K + λ I`` with
        λ = ``diag_reg`` · mean(diag K) (relative scale, the default), or
        λ = ``diag_reg`` when ``diag_reg_absolute_scale=True``. For ``(N, N, O, O)``
        kernels the diagonal is that of the ``(N·O, N·O)`` matrix. (The same λ as
        neural-tangents: trace / dimension is the mean of the diagonal.)
      diag_reg_absolute_scale: see ``diag_reg``.
      trace_axes: output axes of ``y_train`` that the kernels lack, as passed to the
        kernel function (default ``(-1,)``: ``(N, N)`` kernels applied to each output
        column, Θ ⊗ I). With ``trace_axes=()`` kernels are ``(N1, N2, O, O)``.
      dtype: dtype of the factorisation: ``None`` (the kernel's: float32, or float64 for
        float64 kernels), ``"float32"`` or ``"float64"``. All linear algebra runs on the
        host in numpy/LAPACK, so ``"float64"`` is a true float64 solve whether or not
        ``jax_enable_x64`` is on (never a silent float32). Results are numpy arrays of
        this dtype.
      test_batch_size: test points per chunk (``None``: all at once). Chunked and
        unchunked results agree to round-off; memory per chunk is O(B·N·O²).

    Solver: Cholesky of ``K + λI`` in ``dtype``, falling back to a symmetric
    eigendecomposition (eigenvalues floored at u·λ_max) when Cholesky fails; every solve
    is refined with float64 residuals and accepted only if the last correction is at
    most 1e-6 of the solution (max norm, per right-hand side). Otherwise a ValueError
    names the condition number and the fix (raise ``diag_reg``, or ``dtype="float64"``).
    Kernels may be numpy arrays, read-only memory-mapped ``.npy`` files
    (``np.load(path, mmap_mode="r")``) or jax arrays (copied to the host once); they are
    read in row chunks and only the factor (one ``(N·O, N·O)`` array of ``dtype``) is
    allocated whole.

    Variances: posterior variances (the diagonal of the covariance) are formed in
    float64. Negative values down to −M·u·s are round-off and are set to 0, where M is
    the number of training rows (N times the kept output size), u the unit round-off of
    the kernels' dtype (float32: 6e-8) and s the sum of the magnitudes of the terms
    whose cancellation forms the variance; below that a ValueError says the kernels are
    not jointly positive semi-definite. GP variances are also capped at the prior
    variance (the subtracted quadratic form is >= 0 in exact arithmetic).
"""


def _doc(fn):
    if fn.__doc__:
        fn.__doc__ = fn.__doc__.replace("{shared}", _SHARED_DOC.strip("\n"))
    return fn


class _Train:
    """One train-train kernel: validated, flattened, regularised and factored."""

    def __init__(self, fn_name, name, k, layout: FlatLayout, opts: _Options, factor=None):
        k = as_host_array(fn_name, name, k)
        layout.check_pair(name, k, layout.n, layout.n)
        self.k_dtype = k.dtype
        self.k2 = layout.flat(k)
        self.mean_diag, self.kmax = scan_train_kernel(fn_name, name, self.k2, k.dtype)
        self.dtype = compute_dtype(fn_name, opts.dtype, k.dtype)  # the results' dtype
        self.reg_scale = 1.0 if opts.diag_reg_absolute_scale else self.mean_diag
        self.lam = opts.diag_reg * self.reg_scale
        factor = self.dtype if factor is None else factor
        self.solver = Solver(
            fn_name, self.k2, self.lam, factor, reg_scale=self.reg_scale, method=opts.method
        )


#: A rank counts as structural (warned) when its last eigenvalue is this many times the next.
_RANK_DROP = 1e3
_DOCS = "docs/errors.md"
_Y_NAN_FIX = "drop or impute the samples with missing targets"
#: Why a kernel has low rank, per field of :class:`Kernels` (both for a plain array).
_LOW_RANK_WHY = {
    "nngp": "an empirical NNGP of one network with O outputs has rank <= O: for a GP prior, "
    "average initialisations (ntk_core.monte_carlo_kernels(..., n_samples=...))",
    "ntk": "an empirical NTK has rank <= the number of parameters",
}


def _warn_if_low_rank(fn_name, field, tr: _Train) -> None:
    """Warns when the kernel's numerical rank is at most half of what the probes see
    (all of M for M <= 64, else 64 probes) and ends in a drop of 1000x or more: a kernel
    built from few feature vectors, not a smooth one whose spectrum fades gradually."""
    r, c, drop = numerical_rank(tr.k2, tr.k_dtype)
    if 2 * r > c or drop < _RANK_DROP:
        return
    name = "k_train_train" + (f".{field}" if field else "")
    what = f"{name} has numerical rank {r} of {tr.k2.shape[0]} ({np.dtype(tr.k_dtype).name})"
    why = _LOW_RANK_WHY.get(field, "; ".join(_LOW_RANK_WHY.values()))
    msg = f"{fn_name}: {what}: as a prior it holds only {r} functions; {why}."
    msg += f" See {_DOCS}#low-rank-kernel."
    warnings.warn(msg, DegenerateKernelWarning, stacklevel=_user_stacklevel())


def _pick(fn_name, name, k, field):
    """An array, or the ``field`` of a :class:`Kernels`."""
    if isinstance(k, Kernels):
        v = getattr(k, field)
        if v is None:
            what = f"{name}.{field} is None but this prediction needs the {field.upper()}"
            raise bad(ValueError, fn_name, what, "pass Kernels(nngp=..., ntk=...), or an array")
        return v
    return k


def _clip_variances(fn_name, var, s, m, u):
    """Sets round-off negatives (>= −m·u·s) to 0; raises below."""
    tol = m * u * s
    below = var < -tol
    if below.any():
        i = int(np.flatnonzero(below.reshape(-1))[0])
        what = f"a posterior variance came out {var.reshape(-1)[i]:.3e}, below round-off "
        what += f"−{tol.reshape(-1)[i]:.3e}: the kernels are not jointly positive semi-definite"
        fix = "compute all three kernels with the same network, parameters and trace_axes"
        raise bad(ValueError, fn_name, what, fix, see="negative-variance")
    return np.maximum(var, 0.0)


class _TestSide:
    """Test-kernel parsing, chunking and output shaping shared by the predictors
    (needs ``_layout``, ``_opts``, ``dtype`` and ``amplitude``)."""

    # -- test inputs -----------------------------------------------------------------
    def _test_kernels(self, fn, k_test_train, k_test_test, fields):
        lay = self._layout
        out, t = {}, None
        for f in fields:
            k = as_host_array(fn, "k_test_train", _pick(fn, "k_test_train", k_test_train, f))
            t = lay.check_pair("k_test_train", k, t, lay.n, fn)
            check_rows_finite(fn, "k_test_train", k)
            out[f] = lay.flat(k)
        kind, ktt = None, None
        if k_test_test is not None:
            k = as_host_array(fn, "k_test_test", _pick(fn, "k_test_test", k_test_test, "nngp"))
            if k.shape == lay.pair_shape(t, t):
                kind, ktt = "full", lay.flat(k)
            elif k.shape == lay.diag_shape(t):
                kind, ktt = "diag", lay.flat_diag(k)
            else:
                what = f"k_test_test has shape {k.shape}, expected the full {lay.pair_shape(t, t)}"
                what += f" or its per-sample diagonal {lay.diag_shape(t)} (diagonal_axes=(0,))"
                fix = "compute it on the same test inputs with the same trace_axes"
                raise bad(ValueError, fn, what, fix)
            check_rows_finite(fn, "k_test_test", k)
        u = max(unit_roundoff(a.dtype) for a in [*out.values()] + ([ktt] if kind else []))
        return t, out, kind, ktt, u

    def _chunks(self, t):
        b = self._opts.test_batch_size or t
        ko = self._layout.ko
        for start in range(0, t, b):
            stop = min(t, start + b)
            yield slice(start, stop), slice(start * ko, stop * ko)

    def _finish(self, t, mean, kind, cov):
        lay, dt = self._layout, self.dtype
        mean = lay.unflat_y(mean, t).astype(dt)
        if kind is None:
            return Gaussian(mean, None)
        cov = cov * self.amplitude
        if kind == "full":
            return Gaussian(mean, lay.unflat_cov(cov, t).astype(dt))
        return Gaussian(mean, lay.unflat_diag(cov).astype(dt))


class GPInference(_TestSide):
    """Predictor returned by :func:`gp_inference`; see there."""

    def __init__(self, fn_name, k_train_train, y_train, opts):
        self._fn = fn_name
        y = as_host_array(fn_name, "y_train", y_train)
        self._layout = FlatLayout(fn_name, y.shape, opts.trace_axes)
        check_rows_finite(fn_name, "y_train", y, _Y_NAN_FIX)
        self._y = np.asarray(self._layout.flat_y(y), np.float64)
        self._y_size = y.size
        self._opts = opts
        self._k = k_train_train
        self._train: dict[str, _Train] = {}
        self._alpha: dict[str, np.ndarray] = {}
        # validate and factor now, so that bad input fails here, not at prediction time
        fields = ("nngp", "ntk") if isinstance(k_train_train, Kernels) else ("nngp",)
        for f in fields:
            if not isinstance(k_train_train, Kernels) or getattr(k_train_train, f) is not None:
                self._get_train(f)
        if not self._train:
            what = "k_train_train is Kernels(nngp=None, ntk=None)"
            raise bad(ValueError, fn_name, what, "pass an array or Kernels with a kernel")
        for field in list(self._train):  # solve for y now: an unsolvable kernel fails here
            self._alpha_of(field)
        for field, tr in self._train.items():
            _warn_if_low_rank(fn_name, field if isinstance(k_train_train, Kernels) else None, tr)
        self.amplitude = self._amplitude() if opts.fit_amplitude else 1.0

    def _get_train(self, field) -> _Train:
        if not isinstance(self._k, Kernels):
            field = "nngp"  # one array serves as both
        if field not in self._train:
            name = f"k_train_train.{field}" if isinstance(self._k, Kernels) else "k_train_train"
            k = _pick(self._fn, "k_train_train", self._k, field)
            self._train[field] = _Train(self._fn, name, k, self._layout, self._opts)
        return self._train[field]

    def _alpha_of(self, field) -> np.ndarray:
        tr = self._get_train(field)
        if id(tr) not in self._alpha:
            self._alpha[id(tr)] = tr.solver.solve(self._y)
        return self._alpha[id(tr)]

    def _amplitude(self) -> float:
        field = "nngp" if not isinstance(self._k, Kernels) or self._k.nngp is not None else "ntk"
        return float(np.sum(self._y * self._alpha_of(field)) / self._y_size)

    @property
    def dtype(self) -> np.dtype:
        """The compute dtype (that of the results)."""
        return next(iter(self._train.values())).dtype

    @property
    def method(self) -> str:
        """``"cholesky"``, or ``"eigh"`` where Cholesky failed and the fallback ran."""
        return next(iter(self._train.values())).solver.method

    @property
    def regularizer(self) -> float:
        """λ added to the diagonal of the (GP, else NTK) train-train kernel."""
        return next(iter(self._train.values())).lam

    @_doc
    def nngp(self, k_test_train, k_test_test=None) -> Gaussian:
        """GP posterior on the test inputs with the train kernel as the prior covariance.

        mean = K_tx (K_xx + λI)⁻¹ y;  covariance = σ² (K_tt − K_tx (K_xx + λI)⁻¹ K_xt),
        σ² = 1 unless ``fit_amplitude``. The kernel is the array given to
        :func:`gp_inference` or the ``nngp`` of its :class:`Kernels` (neural-tangents'
        ``get="nngp"``; with an NTK array it is the "NTKGP" posterior).

        Args:
          k_test_train: ``(T, N)`` (or ``(T, N, O, O)`` with ``trace_axes=()``), or
            :class:`Kernels` (its ``nngp`` is used).
          k_test_test: ``None`` (mean only), the full test-test kernel ``(T, T)`` /
            ``(T, T, O, O)`` (gives the covariance) or its per-sample diagonal ``(T,)`` /
            ``(T, O, O)`` (``diagonal_axes=(0,)``; gives the variances at O(T) memory).

        Returns:
          ``Gaussian(mean, covariance)``: mean ``(T, O...)`` like ``y_train``; covariance
          in the layout of ``k_test_test`` (``None`` without it); numpy, compute dtype.

        Raises:
          ValueError, TypeError: shapes not matching ``y_train`` and the train kernel,
            non-finite kernels, a negative variance beyond round-off.
        """
        fn = f"{self._fn}(...).nngp"
        t, kt, kind, ktt, u = self._test_kernels(fn, k_test_train, k_test_test, ["nngp"])
        tr, kt = self._get_train("nngp"), kt["nngp"]
        chunks, ko = list(self._chunks(t)), self._layout.ko
        kts, alpha = {"ntk": kt, "nngp": kt}, self._alpha_of("nngp")
        mean, cov = _posterior(fn, chunks, ko, kts, kind, ktt, None, alpha, tr.solver.solve, u)
        return self._finish(t, mean, kind, cov)

    @_doc
    def ntk(self, k_test_train, k_test_test=None) -> Gaussian:
        """Outputs of an infinite ensemble of wide networks trained to convergence (t → ∞)
        by gradient flow on the MSE (Lee et al. 2019), neural-tangents' ``get="ntk"``.

        With Θ the NTK, K the NNGP and A = Θ_xx + λI:
        mean = Θ_tx A⁻¹ y;
        covariance = σ² (K_tt + Θ_tx A⁻¹ K_xx A⁻¹ Θ_xt − Θ_tx A⁻¹ K_xt − K_tx A⁻¹ Θ_xt).

        Args:
          k_test_train: :class:`Kernels` with ``ntk`` (and ``nngp`` for the covariance),
            each ``(T, N)`` / ``(T, N, O, O)``; an array is taken as the NTK (mean only).
          k_test_test: ``None`` (mean only), or the NNGP test-test kernel (an array or
            :class:`Kernels`), full ``(T, T)`` / ``(T, T, O, O)`` or per-sample diagonal
            ``(T,)`` / ``(T, O, O)``. Needs :class:`Kernels` train and test-train kernels
            with both ``nngp`` and ``ntk``.

        Returns:
          ``Gaussian(mean, covariance)`` as :meth:`nngp`.

        Raises:
          ValueError, TypeError: as :meth:`nngp`, and a covariance request without both
            the NTK and the NNGP.
        """
        fn = f"{self._fn}(...).ntk"
        needs_cov = k_test_test is not None
        if needs_cov and not (_has_both(self._k) and isinstance(k_test_train, Kernels)):
            raise _needs_both(fn, "gp_inference")
        fields = ["ntk", "nngp"] if needs_cov else ["ntk"]
        t, kts, kind, ktt, u = self._test_kernels(fn, k_test_train, k_test_test, fields)
        tr = self._get_train("ntk")
        k_xx = self._get_train("nngp").k2 if needs_cov else None
        mean, cov = _posterior(
            fn,
            list(self._chunks(t)),
            self._layout.ko,
            kts,
            kind,
            ktt,
            k_xx,
            self._alpha_of("ntk"),
            tr.solver.solve,
            u,
        )
        return self._finish(t, mean, kind, cov)


def _posterior(fn, chunks, ko, kts, kind, ktt, k_xx, alpha, apply_h, u):
    """Mean and covariance of the NTK ensemble with the train operator H (A⁻¹ at t = ∞):
    mean = Θ_tx H y (``alpha`` = H y), cov = K_tt + Θ_tx H K_xx H Θ_xt − Θ_tx H K_xt − K_tx H Θ_xt.
    With ``k_xx`` None and ``kts["nngp"]`` = Θ_tx it is the GP posterior K_tt − Θ_tx H Θ_xt:
    no quadratic term and half of Θ_tx H Θ_xt as the cross term on each side.
    Returns the flat mean ``(T·Ko, R)`` and the covariance (None, ``(T, Ko, Ko)`` or flat
    ``(T·Ko, T·Ko)``) of :func:`_covariance`."""
    th = kts["ntk"]
    m = alpha.shape[0]
    t = chunks[-1][0].stop if chunks else 0
    mean = np.empty((t * ko, alpha.shape[1]))
    w1s, w2s, cov = [], [], None
    if kind == "diag":
        cov = np.empty((t, ko, ko))
    for ts, rs in chunks:
        tb = np.asarray(th[rs], np.float64)
        mean[rs] = tb @ alpha
        if kind is None:
            continue
        kb = tb if kts["nngp"] is th else np.asarray(kts["nngp"][rs], np.float64)
        w1 = None if k_xx is None else apply_h(tb.T)  # H Θ_xt
        w2 = apply_h(kb.T) / (2 if k_xx is None else 1)  # H K_xt (GP: half of it)
        if kind == "full":
            w1s.append(w1)
            w2s.append(w2)
            continue
        c = ts.stop - ts.start
        tb3, w2_3, quad = tb.reshape(c, ko, m), w2.reshape(m, c, ko), None
        if k_xx is not None:
            kw1 = matmul64(k_xx, w1)
            quad = np.einsum("mia,mib->iab", w1.reshape(m, c, ko), kw1.reshape(m, c, ko))
        cross = np.einsum("iam,mib->iab", tb3, w2_3)
        abs_cross = np.einsum("iam,mia->ia", np.abs(tb3), np.abs(w2_3))
        prior = np.asarray(ktt[ts], np.float64)
        cov[ts] = _covariance(fn, prior, quad, cross, abs_cross, m, u)
    if kind == "full":
        th64, w2 = np.asarray(th, np.float64), np.concatenate(w2s, 1)
        quad = None if k_xx is None else (w1 := np.concatenate(w1s, 1)).T @ matmul64(k_xx, w1)
        abs_cross = np.einsum("jm,mj->j", np.abs(th64), np.abs(w2))
        cov = _covariance(fn, np.asarray(ktt, np.float64), quad, th64 @ w2, abs_cross, m, u)
    return mean, cov


def _covariance(fn, prior, quad, cross, abs_cross, m, u):
    """prior + quad − cross − crossᵀ over the last two axes: ``(c, Ko, Ko)`` blocks of a
    per-sample diagonal, or the full flat ``(T·Ko, T·Ko)`` matrix (then symmetrised).
    Variances clipped by :func:`_clip_variances` with s = |prior| + |quad| + 2·``abs_cross``
    (Σ |a|·|b| over the products forming cross's diagonal). ``quad`` None: the GP
    posterior (cross = ½ K_tx A⁻¹ K_xt), variances prior − max(2·cross, 0): at most the
    prior's, as xᵀA⁻¹x >= 0."""
    idx = np.arange(prior.shape[-1])
    cov = (prior if quad is None else prior + quad) - cross - np.swapaxes(cross, -1, -2)
    if cov.ndim == 2:
        cov = (cov + cov.T) / 2
    p = prior[..., idx, idx]
    if quad is None:
        var, s = p - np.maximum(2 * cross[..., idx, idx], 0.0), np.abs(p)
    else:
        var, s = cov[..., idx, idx], np.abs(p) + np.abs(quad[..., idx, idx])
    cov[..., idx, idx] = _clip_variances(fn, var, s + 2 * abs_cross, m, u)
    return cov


def _has_both(k) -> bool:
    return isinstance(k, Kernels) and k.nngp is not None and k.ntk is not None


def _needs_both(fn, public) -> ValueError:
    what = "the ensemble covariance needs both the NTK and the NNGP of train and test-train"
    fix = f"pass Kernels(nngp=..., ntk=...) to {public} and as k_test_train, or no k_test_test"
    return bad(ValueError, fn, what, fix)


class _Options(NamedTuple):
    """The validated options shared by the predictors."""

    diag_reg: float
    diag_reg_absolute_scale: bool
    trace_axes: Any
    dtype: Any
    test_batch_size: int | None
    fit_amplitude: bool = False
    method: str = "cholesky"


def _options(fn_name, diag_reg, diag_reg_absolute_scale, trace_axes, dtype, test_batch_size):
    diag_reg = check_diag_reg(fn_name, diag_reg)
    fix = "pass e.g. test_batch_size=1000"
    test_batch_size = check_int(
        fn_name, "test_batch_size", test_batch_size, fix, optional=True, type_error=ValueError
    )
    compute_dtype(fn_name, dtype, np.float32)  # validates the value early
    return _Options(diag_reg, bool(diag_reg_absolute_scale), trace_axes, dtype, test_batch_size)


@_doc
def gp_inference(
    k_train_train,
    y_train,
    *,
    diag_reg: float = 0.0,
    diag_reg_absolute_scale: bool = False,
    trace_axes=DEFAULTS.trace_axes,
    fit_amplitude: bool = False,
    dtype=None,
    test_batch_size: int | None = None,
) -> GPInference:
    """Kernel regression / GP posterior and the NTK ensemble posterior from kernels.

    With A = K_xx + λI (train-train, regularised): the GP posterior with prior kernel K
    (NNGP, or any kernel such as the NTK) has mean K_tx A⁻¹ y and covariance
    K_tt − K_tx A⁻¹ K_xt (Rasmussen & Williams 2006, eq. 2.25-2.26); an infinite
    ensemble of wide networks trained to convergence by gradient flow on the MSE has
    mean Θ_tx (Θ_xx + λI)⁻¹ y and the covariance of :meth:`GPInference.ntk` (Lee et al.
    2019). Same formulas, λ and layout as neural-tangents' ``predict.gp_inference``.

    Args:
      k_train_train: the train-train kernel ``(N, N)`` (``trace_axes=(-1,)``) or
        ``(N, N, O, O)`` (``trace_axes=()``), symmetric, finite; or
        ``Kernels(nngp=..., ntk=...)`` (needed for the NTK ensemble covariance).
      fit_amplitude: if True, covariances are multiplied by the maximum-likelihood output
        scale σ² = yᵀ A⁻¹ y / (N·O) (A from the NNGP, or the array given; N·O =
        ``y_train.size``), so that predicted spreads are on the targets' scale. The value
        is ``predictor.amplitude`` (1.0 otherwise).
    {shared}

    Returns:
      A :class:`GPInference` with ``.nngp(k_test_train, k_test_test=None)`` and
      ``.ntk(k_test_train, k_test_test=None)``, each giving ``Gaussian(mean,
      covariance)``: mean ``(T, O...)``, covariance ``(T, T)`` / ``(T, T, O, O)`` for a
      full ``k_test_test``, ``(T,)`` / ``(T, O, O)`` for a per-sample diagonal one, None
      without it. The kernels are checked and factored here, once.

    Warns:
      DegenerateKernelWarning: a train-train kernel of low numerical rank r (eigenvalues
        above M·u·λ_max, u of its dtype), r at most half of min(M, 64) and followed by
        a drop of 1000x or more (found from all eigenvalues for M <= 64, else from a
        64-probe random sketch at 2·M²·64 flops): as a prior it holds only r functions,
        and the posterior mean and samples are combinations of them. An empirical NNGP
        of one network with O outputs has rank <= O; average initialisations
        (:func:`ntk_core.monte_carlo_kernels`) for a GP prior. Smooth kernels whose
        spectrum fades gradually (e.g. on 1-D inputs) do not warn.

    Raises:
      ValueError: ``y_train`` without an output axis or non-finite; a kernel whose shape
        does not match ``y_train`` and ``trace_axes``, non-square, non-symmetric or
        non-finite; negative or non-finite ``diag_reg``; a kernel too ill-conditioned
        to solve in ``dtype`` (message gives the condition number and the fix) or not
        positive semi-definite.
      TypeError: non-floating arrays, ``diag_reg`` not a number.

    Cost: one factorisation per train-train kernel given (two for ``Kernels`` with both)
    of the ``M x M`` matrix, M = N·O_kept: M³/3 flops (Cholesky) or about 9·M³
    (eigendecomposition fallback), M² memory of ``dtype`` each;
    then each refinement step (typically 2-3) costs 2·M²·R flops for R right-hand
    sides; a mean over T test points costs 2·T·M·R, variances 2·T·M² (one solve per
    test row), a full covariance also T² memory.

    Example:
      >>> import numpy as np
      >>> from ntk_core import predict
      >>> x = np.linspace(-1, 1, 5)[:, None]
      >>> k = np.exp(-(x - x.T) ** 2)                       # (N, N) = (5, 5)
      >>> y = np.sin(3 * x)                                 # (N, O) = (5, 1)
      >>> post = predict.gp_inference(k, y, diag_reg=1e-6)
      >>> mean, var = post.nngp(k[:2], k_test_test=np.diagonal(k)[:2])
      >>> mean.shape, var.shape, bool(np.all(var >= 0))
      ((2, 1), (2,), True)
      >>> bool(np.allclose(mean, y[:2], atol=1e-4))
      True

    References:
      Rasmussen, Williams, "Gaussian Processes for Machine Learning", MIT Press 2006,
      ch. 2 and 5.4 (σ² by maximum likelihood); Lee, Xiao, Schoenholz, Bahri, Novak,
      Sohl-Dickstein, Pennington, "Wide Neural Networks of Any Depth Evolve as Linear
      Models Under Gradient Descent", NeurIPS 2019.
    """
    fn = "gp_inference"
    opts = _options(fn, diag_reg, diag_reg_absolute_scale, trace_axes, dtype, test_batch_size)
    opts = opts._replace(fit_amplitude=bool(fit_amplitude))
    return GPInference(fn, k_train_train, y_train, opts)


class _DefaultZero(float):
    """The default 0.0 of ``fx_train_0`` / ``fx_test_0``: equal to 0.0, but told apart
    from a 0.0 the caller passed (``is``), so that one-sided outputs can be refused."""

    def __repr__(self) -> str:
        return "0.0"


_DEFAULT_ZERO = _DefaultZero(0.0)


def _check_initial_outputs(fn, fx_train_0, fx_test_0, k_test_train) -> None:
    """Refuses ``None`` outputs at t = 0 where a formula needs them, and test outputs at
    t = 0 without a test kernel (one-sided outputs: :func:`_check_one_sided`)."""
    if k_test_train is not None and (fx_train_0 is None or fx_test_0 is None):
        name = "fx_test_0" if fx_test_0 is None else "fx_train_0"
        what = (
            f"{name}=None with k_test_train: the test predictions start from the outputs at t = 0"
        )
        fix = f"pass {name}, or leave fx_train_0 and fx_test_0 at their default 0.0"
        raise bad(ValueError, fn, what, fix, see="initial-outputs")
    if k_test_train is None and fx_train_0 is None:
        what = "fx_train_0=None and k_test_train=None: nothing to predict"
        raise bad(ValueError, fn, what, "pass fx_train_0 (e.g. 0.0) and/or k_test_train")
    if k_test_train is None and fx_test_0 is not _DEFAULT_ZERO and fx_test_0 is not None:
        what = "fx_test_0 is given but k_test_train=None (no test predictions)"
        raise bad(ValueError, fn, what, "pass k_test_train (the test-train NTK), or drop fx_test_0")


def _check_one_sided(fn, given, values) -> None:
    """Refuses a non-zero output at t = 0 on one side beside the other's default.

    ``given``: the names of the outputs the caller passed; ``values``: name -> the
    validated (finite, broadcast) array."""
    if len(given) != 1 or not np.any(values[given[0]] != 0):
        return
    name, other = given[0], ({"fx_train_0", "fx_test_0"} - set(given)).pop()
    what = f"{name} is given (max |value| {np.abs(values[name]).max():.3g}) but {other} is left"
    what += " at its default 0.0 (outputs 0 at t = 0)"
    fix = f"pass {other} too, or {other}=0.0 explicitly if the outputs are 0"
    raise bad(ValueError, fn, what, fix, see="initial-outputs")


def _initial_outputs(fn, name, value, shape, which) -> np.ndarray:
    """``value`` as float64 broadcast to ``shape``, finite."""
    fix = f"pass the network's outputs on the {which} inputs at t = 0, or 0.0"
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - any conversion failure is reported
        arr = np.asarray(None)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        what = f"{name} must be a number or an array of outputs, got {type(value).__name__}"
        raise bad(TypeError, fn, what, fix)
    try:
        arr = np.broadcast_to(np.asarray(arr, np.float64), shape)
    except ValueError:
        what = f"{name} of shape {np.shape(value)} does not broadcast to {shape}"
        raise bad(ValueError, fn, what, fix) from None
    check_finite(fn, name, arr, fix)
    return arr


def _check_times(fn, t) -> np.ndarray:
    """``t`` (``None``: convergence) as float64 times, all >= 0 (``inf`` allowed)."""
    ts = np.asarray(np.inf if t is None else t, np.float64)
    if np.isnan(ts).any() or (ts < 0).any():
        what = f"t must be >= 0 (or None / inf for convergence), got {t!r}"
        raise bad(ValueError, fn, what, "pass training times in steps")
    return ts


def _finite(value) -> bool:
    """A finite Python int or float (``learning_rate``'s type; else TypeError)."""
    return isinstance(value, (int, float)) and is_real(value) and math.isfinite(value)


class GradientDescentMSE(_TestSide):
    """Predictor returned by :func:`gradient_descent_mse`; see there."""

    def __init__(self, fn_name, k_train_train, y_train, learning_rate, opts):
        self._fn = fn_name
        y = as_host_array(fn_name, "y_train", y_train)
        self._layout = lay = FlatLayout(fn_name, y.shape, opts.trace_axes)
        check_rows_finite(fn_name, "y_train", y, _Y_NAN_FIX)
        self._y_shape, self._y_size = y.shape, y.size
        self._y = np.asarray(lay.flat_y(y), np.float64)
        fix = "pass the step size, e.g. learning_rate=1.0"
        lr = check_real(
            fn_name, "learning_rate", learning_rate, fix, open_low=True, is_type=_finite
        )
        self._lr = lr
        k = _pick(fn_name, "k_train_train", k_train_train, "ntk")
        # a float32 eigendecomposition lost 1e-3 at t = 1e5: always float64
        eigh = opts._replace(method="eigh")
        self._train = _Train(fn_name, "k_train_train", k, lay, eigh, factor=np.float64)
        w, v = self._train.solver._eigs
        self._w = np.maximum(w, 0.0)
        self._v = np.asarray(v, np.float64)
        # Directions the kernel does not move (an empirical NTK has rank <= P): eigenvalues
        # at the kernel's own round-off, w <= √M·u·w_max with u of the kernel's dtype (the
        # float64 eigendecomposition resolves float32 round-off as eigenvalues of about
        # u·w_max; M·eps, 8√M times more, froze a real direction at 2.8e-6·w_max of a
        # full-rank float32 NTK with M = 40), keep their t = 0 value at every t and add
        # nothing to test outputs.
        u = max(unit_roundoff(self._train.k_dtype), unit_roundoff(self._train.dtype))
        w_max = max(float(self._w.max(initial=0.0)), 0.0)
        self._null = self._w <= math.sqrt(self._w.size) * u * w_max
        self._opts = opts
        self._k = k_train_train
        self._nngp2 = None
        if isinstance(k_train_train, Kernels) and k_train_train.nngp is not None:
            k = as_host_array(fn_name, "k_train_train.nngp", k_train_train.nngp)
            lay.check_pair("k_train_train.nngp", k, lay.n, lay.n)
            self._nngp2 = lay.flat(k)
            scan_train_kernel(fn_name, "k_train_train.nngp", self._nngp2, k.dtype)
        self.amplitude = 1.0

    @property
    def dtype(self) -> np.dtype:
        """The compute dtype (that of the results)."""
        return self._train.dtype

    @property
    def eigenvalues(self) -> np.ndarray:
        """Eigenvalues of the regularised train-train kernel, ascending, clipped at 0."""
        return self._w

    @_doc
    def __call__(
        self, t=None, fx_train_0=_DEFAULT_ZERO, fx_test_0=_DEFAULT_ZERO, k_test_train=None
    ) -> Outputs:
        """Outputs at training time(s) ``t`` (``None`` or ``np.inf``: convergence).

        The test formula needs the network's outputs at t = 0 on both the training and
        the test inputs (f_test(t) = f_test(0) + Θ_tx H(t) (y − f_train(0))). Either
        pass both (the outputs of the network you train), or leave both at their
        default 0.0: the outputs of a network whose initial outputs are 0, which is also
        the mean over an ensemble of initialisations (neural-tangents' defaults). Giving
        one of them non-zero while the other is left at its default, or
        ``fx_train_0=None`` with ``k_test_train``, is refused: the prediction would
        silently assume outputs you did not give.

        Args:
          t: ``None``/``inf`` or a float or array of times of any shape, in steps
            (continuous time ``learning_rate·t``).
          fx_train_0: outputs on the training inputs at t = 0, broadcastable to
            ``y_train.shape`` (default 0.0, see above); ``None`` skips the train
            predictions (allowed only without ``k_test_train``).
          fx_test_0: outputs on the test inputs at t = 0, broadcastable to ``(T, O...)``
            (default 0.0, see above); needs ``k_test_train``.
          k_test_train: the test-train kernel ``(T, N)`` / ``(T, N, O, O)`` (or
            :class:`Kernels`, whose ``ntk`` is used); ``None`` skips test predictions.

        Returns:
          ``Outputs(train, test)``: train ``t.shape + (N, O...)``, test
          ``t.shape + (T, O...)`` (``None`` when skipped); numpy, compute dtype.

        Raises:
          ValueError, TypeError: negative or non-finite times, shapes not matching,
            non-finite kernels or outputs, outputs at t = 0 given for one side only (see
            above); test predictions more ill-conditioned than float64 can compute to
            1e-6 (see :func:`gradient_descent_mse`).
        """
        fn = f"{self._fn}(...)"
        lay = self._layout
        ts = _check_times(fn, t)
        _check_initial_outputs(fn, fx_train_0, fx_test_0, k_test_train)
        f0 = 0.0 if fx_train_0 is None else fx_train_0
        f0 = _initial_outputs(fn, "fx_train_0", f0, self._y_shape, "training")
        rhs = lay.flat_y(f0) - self._y  # (M, R): fx_train_0 − y
        kt, t_test = None, None
        if k_test_train is not None:
            k = as_host_array(fn, "k_test_train", _pick(fn, "k_test_train", k_test_train, "ntk"))
            t_test = lay.check_pair("k_test_train", k, None, lay.n, fn)
            check_rows_finite(fn, "k_test_train", k)
            kt = lay.flat(k)
            out_shape = (t_test,) + self._y_shape[1:]
            ft0 = _initial_outputs(fn, "fx_test_0", fx_test_0, out_shape, "test")
            given = [
                n
                for n, v in (("fx_train_0", fx_train_0), ("fx_test_0", fx_test_0))
                if v is not _DEFAULT_ZERO
            ]
            _check_one_sided(fn, given, {"fx_train_0": f0, "fx_test_0": ft0})
            ft0 = lay.flat_y(ft0)
        dt = self._train.dtype
        shape = () if t is None else ts.shape
        tv = (np.array([np.inf]) if t is None else ts.reshape(-1)) * self._lr / self._y_size
        c = self._v.T @ rhs  # (M, R) in the eigenbasis
        train = test = None
        if fx_train_0 is not None:
            g = np.stack([self._decay(tk) for tk in tv])  # expm1(−w τ), (K, M)
            tr = np.einsum("mi,ki,ir->kmr", self._v, g, c)
            train = np.stack([lay.unflat_y(lay.flat_y(f0) + tr[k], lay.n) for k in range(len(tv))])
            train = train.reshape(shape + self._y_shape).astype(dt)
        if kt is not None:
            h = -np.stack([self._weights(fn, tk, t) for tk in tv])  # (K, M)
            b = np.einsum("mi,ki,ir->mkr", self._v, h, c).reshape(self._v.shape[0], -1)
            d = self._matmul_chunked(kt, b, t_test)  # (T·Ko, K·R)
            d = d.reshape(d.shape[0], len(tv), -1)
            test = np.stack([lay.unflat_y(ft0 + d[:, k], t_test) for k in range(len(tv))])
            test = test.reshape(shape + (t_test,) + self._y_shape[1:]).astype(dt)
        return Outputs(train, test)

    def _decay(self, tau):
        """expm1(−w τ) per eigenvalue (τ = η t / n; −1 at τ = ∞); 0 on null directions."""
        if np.isinf(tau):
            return np.where(self._null, 0.0, -1.0)
        return np.where(self._null, 0.0, np.expm1(-self._w * tau))

    def _weights(self, fn, tau, t):
        """h = (1 − exp(−w τ)) / w per eigenvalue (τ = η t / n; 1/w at τ = ∞; the limit
        τ at w = 0); 0 on null directions. Refuses weights whose float64 round-off
        bound u·w_max·max h exceeds :data:`ACCEPT` (see :func:`gradient_descent_mse`)."""
        keep = ~self._null
        if np.isinf(tau):
            h = np.zeros_like(self._w)
            h[keep] = 1.0 / self._w[keep]
        else:
            x = self._w * tau
            with np.errstate(invalid="ignore", over="ignore"):
                phi = np.where(x > 1e-12, -np.expm1(-x) / np.where(x > 0, x, 1.0), 1.0 - x / 2)
            h = np.where(keep, tau * phi, 0.0)
        w_max = float(self._w.max(initial=0.0))
        bound = unit_roundoff(np.float64) * w_max * float(h.max(initial=0.0))
        if bound > ACCEPT:
            tr = self._train
            need = unit_roundoff(np.float64) * w_max / ACCEPT
            suggest = 10 ** math.ceil(math.log10(max(need / tr.reg_scale, 1e-300)))
            w_min = float(self._w[keep].min(initial=w_max))
            when = "at convergence (t = inf)" if np.isinf(tau) else f"at t = {t!r}"
            what = f"the test predictions {when} are too ill-conditioned: K + λI (λ = "
            what += f"{tr.lam:.3e}) has eigenvalues {w_min:.3e} .. {w_max:.3e}, round-off bound "
            what += f"{bound:.1e} > {ACCEPT:.0e}"
            fix = f"raise diag_reg to about {suggest:.0e} or more, or predict at smaller t"
            raise bad(ValueError, fn, what, fix, see="ill-conditioned-kernel")
        return h

    @_doc
    def ntk_ensemble(self, t=None, k_test_train=None, k_test_test=None) -> Gaussian:
        """Mean and covariance over an infinite ensemble of wide networks (initialised from
        the prior, mean 0) after training time(s) ``t`` (``None``/``inf``: convergence).

        With Θ the NTK, K the NNGP, A = Θ_xx + λI and H(t) = A⁻¹ (I − exp(−A τ / n)),
        τ = ``learning_rate``·t (Lee et al. 2019; neural-tangents'
        ``gradient_descent_mse_ensemble(..., get="ntk")``):
        mean = Θ_tx H y;  covariance = K_tt + Θ_tx H K_xx H Θ_xt − Θ_tx H K_xt − K_tx H Θ_xt.
        At t = ∞, H = A⁻¹ and the result is :meth:`GPInference.ntk`.

        Args:
          t: ``None``/``inf`` or a float or array of times (steps), any shape.
          k_test_train: :class:`Kernels` with ``ntk`` (and ``nngp`` for the covariance),
            each ``(T, N)`` / ``(T, N, O, O)``; an array is taken as the NTK (mean only).
          k_test_test: ``None`` (mean only) or the NNGP test-test kernel, full ``(T, T)``
            / ``(T, T, O, O)`` or per-sample diagonal ``(T,)`` / ``(T, O, O)``. Needs
            ``Kernels(nngp=..., ntk=...)`` given to :func:`gradient_descent_mse`.

        Returns:
          ``Gaussian(mean, covariance)``: mean ``t.shape + (T, O...)``, covariance
          ``t.shape +`` the layout of ``k_test_test`` (``None`` without it).

        Raises:
          ValueError, TypeError: as :meth:`GPInference.ntk`; negative times; at t = ∞ a
            kernel too ill-conditioned to solve.
        """
        fn = f"{self._fn}(...).ntk_ensemble"
        if k_test_train is None:
            raise bad(ValueError, fn, "k_test_train is required", "pass the test-train kernels")
        needs_cov = k_test_test is not None
        if needs_cov and not (self._nngp2 is not None and isinstance(k_test_train, Kernels)):
            raise _needs_both(fn, "gradient_descent_mse")
        times = _check_times(fn, t)
        fields = ["ntk", "nngp"] if needs_cov else ["ntk"]
        n_test, kts, kind, ktt, u = self._test_kernels(fn, k_test_train, k_test_test, fields)
        chunks = list(self._chunks(n_test))
        means, covs = [], []
        for tk in times.reshape(-1):
            h = self._weights(fn, tk * self._lr / self._y_size, float(tk))

            def apply_h(b, h=h):
                return self._v @ (h[:, None] * (self._v.T @ b))

            mean, cov = _posterior(
                fn,
                chunks,
                self._layout.ko,
                kts,
                kind,
                ktt,
                self._nngp2,
                apply_h(self._y),
                apply_h,
                u,
            )
            g = self._finish(n_test, mean, kind, cov)
            means.append(g.mean)
            covs.append(g.covariance)
        mean = np.stack(means).reshape(times.shape + means[0].shape)
        cov = None if kind is None else np.stack(covs).reshape(times.shape + covs[0].shape)
        return Gaussian(mean, cov)

    def _matmul_chunked(self, kt, b, t):
        out = np.empty((kt.shape[0], b.shape[1]))
        bs = self._opts.test_batch_size or t
        ko = self._layout.ko
        for start in range(0, t, bs):
            rs = slice(start * ko, min(t, start + bs) * ko)
            out[rs] = np.asarray(kt[rs], np.float64) @ b
        return out


@_doc
def gradient_descent_mse(
    k_train_train,
    y_train,
    *,
    learning_rate: float = 1.0,
    diag_reg: float = 0.0,
    diag_reg_absolute_scale: bool = False,
    trace_axes=DEFAULTS.trace_axes,
    dtype=None,
    test_batch_size: int | None = None,
) -> GradientDescentMSE:
    """Outputs of a network trained by gradient flow on the MSE, at any training time.

    In the linearised (NTK) regime with loss ½·|f(x) − y|² / (N·O) and continuous time
    τ = ``learning_rate``·t, with A = Θ_xx + λI = V diag(w) Vᵀ and n = ``y_train.size``:

        f_train(t) = y + V diag(exp(−w τ / n)) Vᵀ (f_train(0) − y)
        f_test(t)  = f_test(0) + Θ_tx V diag((1 − exp(−w τ / n)) / w) Vᵀ (y − f_train(0))

    (Jacot et al. 2018; Lee et al. 2019), neural-tangents' ``gradient_descent_mse``. The
    eigendecomposition is computed once, here, and always in float64 on the host
    (whatever ``dtype``, which sets the results' dtype): a float32 one lost up to 1.3e-3
    relative against float64 at t = 1e5, where small eigenvalues dominate; each call
    costs matrix products only. At t = ∞ the weight is 1/w (f_test(∞) = f_test(0) +
    Θ_tx A⁻¹ (y − f_train(0))); finite times never divide by w (the weight
    (1 − exp(−w τ/n))/w tends to τ/n as w → 0). Eigenvalues that are negative at
    round-off level are set to 0. Directions the kernel does not move (eigenvalues of
    A at most √M·u·w_max, u of the kernel's dtype: an empirical NTK has rank <= P, so
    with ``diag_reg=0`` these exist whenever N·O > P) keep their t = 0 value in the
    train outputs at every t, t = ∞ included, and add nothing to the test outputs
    (gradient flow never moves them). Test predictions whose float64 round-off bound
    u·λ_max·max_w h exceeds 1e-6 (h the weight above; at t = ∞ this is u times the
    condition number of the moving directions) raise a ValueError with the fix (raise
    ``diag_reg``), at finite and infinite t alike.

    Args:
      k_train_train: the train-train NTK ``(N, N)`` / ``(N, N, O, O)``, or
        :class:`Kernels` (its ``ntk`` is used).
      learning_rate: step size η > 0 of the training run.
    {shared}

    Returns:
      A :class:`GradientDescentMSE`: ``predictor(t=None, fx_train_0=0.0, fx_test_0=0.0,
      k_test_train=None) -> Outputs(train, test)``, train ``t.shape + (N, O...)``, test
      ``t.shape + (T, O...)`` (``Outputs`` unpacks like neural-tangents' ``(fx_train_t,
      fx_test_t)``; test predictions take the outputs at t = 0 on both sides or on
      neither, see :meth:`GradientDescentMSE.__call__`); and
      ``predictor.ntk_ensemble(t, k_test_train, k_test_test=None) ->
      Gaussian``, the mean and covariance over an infinite ensemble at time t (needs
      ``Kernels(nngp=..., ntk=...)`` for the covariance).

    Raises:
      ValueError, TypeError: as :func:`gp_inference`, and a non-positive
        ``learning_rate``.

    Cost: one float64 eigendecomposition of the ``M x M`` matrix (M = N·O_kept, about
    9·M³ flops, 2·M² float64 memory: the matrix it overwrites and the eigenvectors);
    each call 2·M²·R·K for K times and 2·T·M·R·K for T test points.

    Example:
      >>> import numpy as np
      >>> from ntk_core import predict
      >>> x = np.linspace(-1, 1, 4)[:, None]
      >>> k = 1.0 + x @ x.T + np.eye(4)                     # (N, N) = (4, 4)
      >>> y = np.array([[0.0], [1.0], [1.0], [0.0]])       # (N, O) = (4, 1)
      >>> mse = predict.gradient_descent_mse(k, y, learning_rate=1.0)
      >>> out = mse(np.array([0.0, 1e9]), fx_train_0=0.0)
      >>> out.train.shape, bool(np.allclose(out.train[0], 0)), bool(np.allclose(out.train[1], y))
      ((2, 4, 1), True, True)

    References:
      Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Lee et al.,
      "Wide Neural Networks of Any Depth Evolve as Linear Models Under Gradient
      Descent", NeurIPS 2019.
    """
    fn = "gradient_descent_mse"
    opts = _options(fn, diag_reg, diag_reg_absolute_scale, trace_axes, dtype, test_batch_size)
    return GradientDescentMSE(fn, k_train_train, y_train, learning_rate, opts)


gp_inference = _checked_arguments(gp_inference)
gradient_descent_mse = _checked_arguments(gradient_descent_mse)
