"""Predictions from kernels: GP posterior, NTK ensemble, gradient-flow MSE (neural-tangents 0.6)."""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import numpy as np

from ntk_core._errors import bad, check_bool, check_int, check_real
from ntk_core._jax.environment import _user_stacklevel
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._kernel.options import DEFAULTS
from ntk_core._predict.linalg import (
    ACCEPT,
    MISSING_TARGETS,
    SAME_AXES,
    SEE_ILL,
    FlatLayout,
    Solver,
    as_host_array,
    check_diag_reg,
    check_finite,
    check_prior_symmetric,
    check_rows_finite,
    compute_dtype,
    finite_host_array,
    is_real_dtype,
    matmul64,
    numerical_rank,
    scan_train_kernel,
    unit_roundoff,
)


class DegenerateKernelWarning(UserWarning):
    """A train-train kernel of low numerical rank (see docs/errors.md#low-rank-kernel)."""


class Gaussian(NamedTuple):
    """A posterior ``(mean, covariance)``; covariance None without a test-test kernel."""

    mean: Any
    covariance: Any


class Kernels(NamedTuple):
    """An NNGP and an NTK of the same inputs (either None), accepted wherever a kernel is."""

    nngp: Any = None
    ntk: Any = None


#: The fields of :class:`Kernels`, also the keys of the predictors' kernels.
_NNGP, _NTK = Kernels._fields


class Outputs(NamedTuple):
    """Network outputs on the training and test inputs (``None`` when not requested)."""

    train: Any
    test: Any


def _flat_train(fn_name, name, k, layout: FlatLayout):
    """(dtype, flat kernel, mean diagonal) of a checked train-train host array."""
    layout.check_pair(name, k, layout.n, layout.n)
    k2 = layout.flat(k)
    return k.dtype, k2, scan_train_kernel(fn_name, name, k2, k.dtype)[0]


class _Train:
    """One train-train kernel: validated, flattened, regularised, factored."""

    def __init__(self, fn_name, name, k, layout: FlatLayout, opts: _Options, eigh64=False):
        self.name = name
        self.k_dtype, self.k2, mean_diag = _flat_train(fn_name, name, k, layout)
        self.dtype = compute_dtype(fn_name, opts.dtype, self.k_dtype)  # the results' dtype
        self.reg_scale = reg = 1.0 if opts.diag_reg_absolute_scale else mean_diag
        self.lam = opts.diag_reg * reg
        factor = np.float64 if eigh64 else self.dtype
        self.solver = Solver(fn_name, self.k2, self.lam, factor, reg_scale=reg, eigh=eigh64)


#: A rank counts as structural (warned) when its last eigenvalue is this many times the next.
_RANK_DROP = 1e3


def _pick(fn_name, name, k, field):
    """``(name, host array)``: ``k``, or the ``field`` of a :class:`Kernels` (``name.field``)."""
    if isinstance(k, Kernels):
        name = f"{name}.{field}"
        if (k := getattr(k, field)) is None:
            raise bad(ValueError, fn_name, f"{name} is None", "pass both kernels, or an array")
    return name, as_host_array(fn_name, name, k)


class _TestSide:
    """Test-kernel parsing, chunking and output shaping of the predictors."""

    def _set_y(self, fn_name, y_train, opts) -> FlatLayout:
        self._fn, self._opts = fn_name, opts
        y = finite_host_array(fn_name, "y_train", y_train, MISSING_TARGETS)
        self._layout = lay = FlatLayout(fn_name, y.shape, opts.trace_axes)
        self._y_shape, self._y_size = y.shape, y.size
        self._y = np.asarray(lay.flat_y(y), np.float64)
        return lay

    def _test_train(self, fn, k, field, t=None):
        """(T, flat kernel) of a checked test-train kernel (``t``: the expected T)."""
        name, k = _pick(fn, "k_test_train", k, field)
        t = self._layout.check_pair(name, k, t, self._layout.n, fn)
        if t == 0:
            what = f"{name} of shape {k.shape} has no test samples"
            raise bad(ValueError, fn, what, "pass at least one test sample (row)")
        check_rows_finite(fn, name, k)
        return t, self._layout.flat(k)

    def _test_kernels(self, fn, k_test_train, k_test_test, fields):
        """(T, flat test-train kernels, diagonal k_test_test?, flat k_test_test or None, u)."""
        lay, out, t, diag, ktt = self._layout, {}, None, False, None
        for f in fields:
            t, out[f] = self._test_train(fn, k_test_train, f, t)
        if k_test_test is not None:
            name, k = _pick(fn, "k_test_test", k_test_test, _NNGP)
            diag = k.shape == lay.diag_shape(t)
            if not diag and k.shape != lay.pair_shape(t, t):
                what = f"{name} has shape {k.shape}, expected the full {lay.pair_shape(t, t)}"
                raise bad(ValueError, fn, f"{what} or diagonal {lay.diag_shape(t)}", SAME_AXES)
            ktt = lay.flat_diag(k) if diag else lay.flat(k)
            check_rows_finite(fn, name, k)
            check_prior_symmetric(fn, name, ktt)
        u = max(unit_roundoff(a.dtype) for a in [*out.values()] + ([] if ktt is None else [ktt]))
        return t, out, diag, ktt, u

    def _predict(self, fn, t, kts, diag, ktt, k_xx, alpha, apply_h, u):
        """Ensemble posterior with train operator H (``alpha`` = H y; ``k_xx`` None: the GP's)."""
        th, m, ko = kts[_NTK], alpha.shape[0], self._layout.ko
        mean = np.empty((t * ko, alpha.shape[1]))
        w1s, w2s, cov = [], [], np.empty((t, ko, ko)) if diag else None
        for ts, rs in self._chunks(t):
            tb = np.asarray(th[rs], np.float64)
            mean[rs] = tb @ alpha
            if ktt is None:
                continue
            kb = tb if kts[_NNGP] is th else np.asarray(kts[_NNGP][rs], np.float64)
            w1 = None if k_xx is None else apply_h(tb.T)  # H Θ_xt
            w2 = apply_h(kb.T) / (2 if k_xx is None else 1)  # H K_xt (GP: half of it)
            if not diag:
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
        if ktt is not None and not diag:
            th64, w2 = np.asarray(th, np.float64), np.concatenate(w2s, 1)
            quad = None if k_xx is None else (w1 := np.concatenate(w1s, 1)).T @ matmul64(k_xx, w1)
            abs_cross = np.einsum("jm,mj->j", np.abs(th64), np.abs(w2))
            cov = _covariance(fn, np.asarray(ktt, np.float64), quad, th64 @ w2, abs_cross, m, u)
        lay, dt = self._layout, self.dtype
        if ktt is not None:
            cov = cov * self.amplitude
            cov = (lay.unflat_diag(cov) if diag else lay.unflat_cov(cov, t)).astype(dt)
        return Gaussian(lay.unflat_y(mean, t).astype(dt), cov)

    def _chunks(self, t):
        b, ko = self._opts.test_batch_size or t, self._layout.ko
        for start in range(0, t, b):
            stop = min(t, start + b)
            yield slice(start, stop), slice(start * ko, stop * ko)


class GPInference(_TestSide):
    """Predictor returned by :func:`gp_inference`."""

    def __init__(self, fn_name, k_train_train, y_train, opts, fit_amplitude):
        self._set_y(fn_name, y_train, opts)
        self._k, self._train = k_train_train, {}
        # validate, factor and solve for y now: bad input fails here, not at prediction time
        kernels = isinstance(k_train_train, Kernels)
        for f in Kernels._fields if kernels else (_NNGP,):
            if not kernels or getattr(k_train_train, f) is not None:
                self._get_train(f)
        if not self._train:
            raise bad(ValueError, fn_name, f"k_train_train is {k_train_train}", "pass a kernel")
        for tr in self._train.values():
            tr.alpha = tr.solver.solve(self._y)  # (M, R)
        for tr in self._train.values():  # warned: rank <= half the probes, then a 1000x drop
            r, c, drop = numerical_rank(tr.k2, tr.k_dtype)
            if 2 * r <= c and drop >= _RANK_DROP:
                what = f"{tr.name} has numerical rank {r} of {tr.k2.shape[0]} ({tr.k_dtype.name})"
                fix = "average initialisations with ntk_core.monte_carlo_kernels for a GP prior"
                w = bad(DegenerateKernelWarning, fn_name, what, fix, see="low-rank-kernel")
                warnings.warn(w, stacklevel=_user_stacklevel())
        alpha = next(iter(self._train.values())).alpha  # the GP's, else the NTK's
        self.amplitude = float(np.sum(self._y * alpha) / self._y_size) if fit_amplitude else 1.0

    def _get_train(self, field) -> _Train:
        if not isinstance(self._k, Kernels):
            field = _NNGP  # one array serves as both
        if field not in self._train:
            name, k = _pick(self._fn, "k_train_train", self._k, field)
            self._train[field] = _Train(self._fn, name, k, self._layout, self._opts)
        return self._train[field]

    @property
    def dtype(self) -> np.dtype:
        """The compute dtype (that of the results)."""
        return next(iter(self._train.values())).dtype

    @property
    def method(self) -> str:
        """``"cholesky"``, or ``"eigh"`` where Cholesky failed."""
        return next(iter(self._train.values())).solver.method

    @property
    def regularizer(self) -> float:
        """λ added to the diagonal of the (GP, else NTK) train-train kernel."""
        return next(iter(self._train.values())).lam

    def nngp(self, k_test_train, k_test_test=None) -> Gaussian:
        """GP posterior, the train kernel as prior: mean K_tx A⁻¹ y, cov σ² (K_tt − K_tx A⁻¹ K_xt).

        Args:
          k_test_train: ``(T, N)`` / ``(T, N, O, O)``, or :class:`Kernels` (``nngp`` used).
          k_test_test: None (mean only), full ``(T, T)`` / ``(T, T, O, O)``, or per-sample
            diagonal ``(T,)`` / ``(T, O, O)`` (variances at O(T) memory).

        Returns ``Gaussian``: mean ``(T, O...)``, covariance in the layout of ``k_test_test``.
        Raises ValueError, TypeError: shapes not matching, non-finite kernels, negative variances.
        """
        fn = f"{self._fn}(...).nngp"
        t, kt, diag, ktt, u = self._test_kernels(fn, k_test_train, k_test_test, [_NNGP])
        kts, tr = {_NTK: kt[_NNGP], _NNGP: kt[_NNGP]}, self._get_train(_NNGP)
        return self._predict(fn, t, kts, diag, ktt, None, tr.alpha, tr.solver.solve, u)

    def ntk(self, k_test_train, k_test_test=None) -> Gaussian:
        """Infinite ensemble of wide networks trained to convergence (neural-tangents' ``"ntk"``).

        With Θ the NTK, K the NNGP, A = Θ_xx + λI: mean Θ_tx A⁻¹ y, covariance
        σ² (K_tt + Θ_tx A⁻¹ K_xx A⁻¹ Θ_xt − Θ_tx A⁻¹ K_xt − K_tx A⁻¹ Θ_xt) (Lee et al. 2019).
        ``k_test_train``: :class:`Kernels` (an array is the NTK); ``k_test_test``: the NNGP's, as
        :meth:`nngp`, needing ``Kernels`` with both here and in :func:`gp_inference`.
        """
        fn = f"{self._fn}(...).ntk"
        needs_cov = k_test_test is not None
        both = isinstance(self._k, Kernels) and self._k.nngp is not None and self._k.ntk is not None
        if needs_cov and not (both and isinstance(k_test_train, Kernels)):
            raise _needs_both(fn, gp_inference)
        fields = [_NTK, _NNGP] if needs_cov else [_NTK]
        t, kts, diag, ktt, u = self._test_kernels(fn, k_test_train, k_test_test, fields)
        tr, k_xx = self._get_train(_NTK), self._get_train(_NNGP).k2 if needs_cov else None
        return self._predict(fn, t, kts, diag, ktt, k_xx, tr.alpha, tr.solver.solve, u)


def _covariance(fn, prior, quad, cross, abs_cross, m, u):
    """prior + quad − cross − crossᵀ (``quad`` None: GP, variances capped at prior); variances
    above −m·u·s of round-off set to 0 at least, below raising."""
    idx = np.arange(prior.shape[-1])
    cov = (prior if quad is None else prior + quad) - cross - np.swapaxes(cross, -1, -2)
    if cov.ndim == 2:
        cov = (cov + cov.T) / 2
    p = prior[..., idx, idx]
    if quad is None:
        var, s = p - np.maximum(2 * cross[..., idx, idx], 0.0), np.abs(p)
    else:
        var, s = cov[..., idx, idx], np.abs(p) + np.abs(quad[..., idx, idx])
    tol = m * u * (s + 2 * abs_cross)
    if (below := var < -tol).any():
        i = int(np.flatnonzero(below.reshape(-1))[0])
        v, lim = var.reshape(-1)[i], tol.reshape(-1)[i]
        what = f"a posterior variance {v:.2e} < −{lim:.2e}: not jointly positive semi-definite"
        fix = "use the kernels of one network, computed in one call (in float64 for a deep one)"
        raise bad(ValueError, fn, what, fix, see="negative-variance")
    cov[..., idx, idx] = np.maximum(var, 0.0)
    return cov


def _needs_both(fn, public) -> ValueError:
    what = "the ensemble covariance needs both the NTK and the NNGP, of train and test-train"
    return bad(ValueError, fn, what, f"pass Kernels to {public.__name__} and as k_test_train")


class _Options(NamedTuple):
    diag_reg: float
    diag_reg_absolute_scale: bool
    trace_axes: Any
    dtype: Any
    test_batch_size: int | None


def _options(fn_name, diag_reg, diag_reg_absolute_scale, trace_axes, dtype, test_batch_size):
    diag_reg, absolute = check_diag_reg(fn_name, diag_reg, diag_reg_absolute_scale)
    fix, tbs = "pass e.g. test_batch_size=1000", test_batch_size
    tbs = check_int(fn_name, "test_batch_size", tbs, fix, optional=True, type_error=ValueError)
    compute_dtype(fn_name, dtype, np.float32)  # validates the value early
    return _Options(diag_reg, absolute, trace_axes, dtype, tbs)


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
    """GP and NTK-ensemble posteriors from kernels (neural-tangents' ``gp_inference``).

    With A = K_xx + λI: GP mean K_tx A⁻¹ y, covariance K_tt − K_tx A⁻¹ K_xt (Rasmussen &
    Williams eq. 2.25-2.26); the ensemble of :meth:`GPInference.ntk` (Lee et al. 2019).

    Args:
      k_train_train: ``(N, N)`` (``trace_axes=(-1,)``) or ``(N, N, O, O)`` (``trace_axes=()``),
        symmetric, finite, or ``Kernels(nngp=..., ntk=...)``; numpy, memmap or jax array.
      y_train: targets ``(N, O...)``, float, at least one output axis.
      diag_reg: >= 0; λ = ``diag_reg``·mean(diag K) of the ``(N·O, N·O)`` matrix, or
        λ = ``diag_reg`` with ``diag_reg_absolute_scale=True``.
      trace_axes: output axes the kernels lack, as given to the kernel function.
      fit_amplitude: scale covariances by σ² = yᵀ A⁻¹ y / ``y_train.size`` (``.amplitude``).
      dtype: of the factorisation and results: None (the kernel's), "float32" or "float64"
        (host float64, without ``jax_enable_x64``).
      test_batch_size: test points per chunk (None: all); memory O(B·N·O²) per chunk.

    Solver: Cholesky of A in ``dtype``, else eigendecomposition (floored at u·λ_max); solves
    refined in float64 until the last correction is <= 1e-6 of the solution. Variances in
    float64; negatives down to −M·u·s are set to 0; GP variances capped at the prior.

    Returns :class:`GPInference`: ``.nngp`` / ``.ntk(k_test_train, k_test_test=None) ->
    Gaussian``. Warns DegenerateKernelWarning: numerical rank <= half of min(M, 64), then a
    >= 1000x drop. Raises ValueError: bad ``y_train`` or ``diag_reg``; a kernel of the wrong
    shape, non-symmetric, non-finite, not PSD or too ill-conditioned for ``dtype``;
    TypeError: non-floating arrays, ``diag_reg`` not a number, ``diag_reg_absolute_scale``
    not a bool.

    Cost: per train kernel M³/3 flops (9·M³ eigh), M² memory, M = N·O_kept; 2·M²·R per
    refinement step; means 2·T·M·R, variances 2·T·M².

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

    References: Rasmussen, Williams, "Gaussian Processes for Machine Learning", 2006, ch. 2;
    Lee et al., "Wide Neural Networks of Any Depth Evolve as Linear Models", NeurIPS 2019.
    """
    fn = "gp_inference"
    opts = _options(fn, diag_reg, diag_reg_absolute_scale, trace_axes, dtype, test_batch_size)
    fit = check_bool(fn, "fit_amplitude", fit_amplitude)
    return GPInference(fn, k_train_train, y_train, opts, fit)


class _DefaultZero(float):
    """The default 0.0 of ``fx_train_0`` / ``fx_test_0``, told apart by ``is``."""

    def __repr__(self) -> str:
        return "0.0"


_DEFAULT_ZERO = _DefaultZero(0.0)
_OUTPUTS_0 = ("fx_train_0", "fx_test_0")
_SEE_OUT = "initial-outputs"


def _check_one_sided(fn, given, values) -> None:
    """Refuses a non-zero output at t = 0 on one side (``given``) beside the other's default."""
    if sum(given) != 1 or not np.any(values[given.index(True)] != 0):
        return
    i = given.index(True)
    name, other, top = _OUTPUTS_0[i], _OUTPUTS_0[1 - i], np.abs(values[i]).max()
    what = f"{name} is given (max |value| {top:.3g}) but {other} is left at its default 0.0"
    raise bad(ValueError, fn, what, f"pass {other} too, or {other}=0.0", see=_SEE_OUT)


def _initial_outputs(fn, name, value, shape) -> np.ndarray:
    fix = "pass the network's outputs at t = 0, or 0.0"
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - any conversion failure is reported
        arr = np.asarray(None)
    if not is_real_dtype(arr.dtype):
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
    try:  # ragged lists and jax tracers fail here (a tracer's conversion error: TypeError)
        ts = np.asarray(np.inf if t is None else t)
    except (ValueError, TypeError):
        ts = np.asarray(None)
    if isinstance(t, bool) or ts.dtype.kind not in "iuf" or ts.size == 0:  # "10", True, []
        what = f"t must be a number or a non-empty array of numbers, got {type(t).__name__}"
        raise bad(TypeError, fn, f"{what} {t!r:.40}", "pass times in steps as numbers (None: inf)")
    ts = ts.astype(np.float64)
    if np.isnan(ts).any() or (ts < 0).any():
        raise bad(ValueError, fn, f"t must be >= 0, got {t!r}", "pass times in steps (None: inf)")
    return ts


class GradientDescentMSE(_TestSide):
    """Predictor returned by :func:`gradient_descent_mse`."""

    def __init__(self, fn_name, k_train_train, y_train, learning_rate, opts):
        lay = self._set_y(fn_name, y_train, opts)
        fix, lr, name = "pass the step size, e.g. learning_rate=1.0", learning_rate, "k_train_train"
        self._lr = check_real(fn_name, "learning_rate", lr, fix, open_low=True)
        ntk_name, k = _pick(fn_name, name, k_train_train, _NTK)
        # a float32 eigendecomposition lost 1e-3 at t = 1e5: always float64
        self._train = _Train(fn_name, ntk_name, k, lay, opts, eigh64=True)
        w, v = self._train.solver._eigs
        self._w, self._v = np.maximum(w, 0.0), np.asarray(v, np.float64)
        # directions at the kernel's own round-off (w <= √M·u·w_max) do not move
        u = max(unit_roundoff(self._train.k_dtype), unit_roundoff(self._train.dtype))
        w_max = max(float(self._w.max(initial=0.0)), 0.0)
        self._null = self._w <= math.sqrt(self._w.size) * u * w_max
        self._nngp2, self.amplitude = None, 1.0
        if isinstance(k_train_train, Kernels) and k_train_train.nngp is not None:
            self._nngp2 = _flat_train(fn_name, *_pick(fn_name, name, k_train_train, _NNGP), lay)[1]

    @property
    def dtype(self) -> np.dtype:
        """The compute dtype (that of the results)."""
        return self._train.dtype

    @property
    def eigenvalues(self) -> np.ndarray:
        """Eigenvalues of the regularised train kernel, ascending, clipped at 0."""
        return self._w

    def __call__(
        self, t=None, fx_train_0=_DEFAULT_ZERO, fx_test_0=_DEFAULT_ZERO, k_test_train=None
    ) -> Outputs:
        """``Outputs(train t.shape + (N, O...), test t.shape + (T, O...))`` at time(s) ``t``.

        Args:
          t: None/inf (convergence), or times in steps of any shape.
          fx_train_0: outputs at t = 0 broadcastable to ``y_train.shape``; None skips train.
          fx_test_0: broadcastable to ``(T, O...)``; needs ``k_test_train``.
          k_test_train: ``(T, N)`` / ``(T, N, O, O)`` or :class:`Kernels` (``ntk`` used).

        Test outputs need the outputs at t = 0 on both sides or neither (0.0: the ensemble
        mean). Raises ValueError, TypeError: bad times, shapes or values, one-sided outputs,
        ill-conditioned test predictions (see :func:`gradient_descent_mse`).
        """
        fn, lay = f"{self._fn}(...)", self._layout
        ts = _check_times(fn, t)
        train_0, test_0 = _OUTPUTS_0
        if k_test_train is not None and (fx_train_0 is None or fx_test_0 is None):
            name = test_0 if fx_test_0 is None else train_0
            what = f"{name}=None with k_test_train: test predictions need the outputs at t = 0"
            raise bad(ValueError, fn, what, f"pass {name}, or leave both at 0.0", see=_SEE_OUT)
        if k_test_train is None and fx_train_0 is None:
            what = "fx_train_0=None and k_test_train=None: nothing to predict"
            raise bad(ValueError, fn, what, "pass fx_train_0 (e.g. 0.0) and/or k_test_train")
        if k_test_train is None and fx_test_0 is not _DEFAULT_ZERO and fx_test_0 is not None:
            what = "fx_test_0 is given but k_test_train=None"
            raise bad(ValueError, fn, what, "pass k_test_train (the test-train NTK), or drop it")
        f0 = _initial_outputs(fn, train_0, 0.0 if fx_train_0 is None else fx_train_0, self._y_shape)
        rhs = lay.flat_y(f0) - self._y  # (M, R): fx_train_0 − y
        kt, t_test = None, None
        if k_test_train is not None:
            t_test, kt = self._test_train(fn, k_test_train, _NTK)
            ft0 = _initial_outputs(fn, test_0, fx_test_0, (t_test,) + self._y_shape[1:])
            given = [v is not _DEFAULT_ZERO for v in (fx_train_0, fx_test_0)]
            _check_one_sided(fn, given, (f0, ft0))
            ft0 = lay.flat_y(ft0)
        dt, shape = self._train.dtype, ts.shape  # t=None: inf, shape ()
        tv = ts.reshape(-1) * self._lr / self._y_size
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
            d = np.empty((kt.shape[0], b.shape[1]))  # (T·Ko, K·R)
            for _, rs in self._chunks(t_test):
                d[rs] = np.asarray(kt[rs], np.float64) @ b
            d = d.reshape(d.shape[0], len(tv), -1)
            test = np.stack([lay.unflat_y(ft0 + d[:, k], t_test) for k in range(len(tv))])
            test = test.reshape(shape + (t_test,) + self._y_shape[1:]).astype(dt)
        return Outputs(train, test)

    def _decay(self, tau):
        """expm1(−w τ) per eigenvalue (−1 at τ = ∞: 0·∞ is NaN); 0 on null directions."""
        return np.where(self._null, 0.0, -1.0 if np.isinf(tau) else np.expm1(-self._w * tau))

    def _weights(self, fn, tau, t):
        """(1 − exp(−w τ)) / w per eigenvalue; raises past :data:`ACCEPT`."""
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
            what = (
                f"the test predictions at t = {t!r} are too ill-conditioned: round-off {bound:.1e}"
            )
            fix = f"raise diag_reg to about {suggest:.0e} or more, or predict at smaller t"
            raise bad(ValueError, fn, what, fix, see=SEE_ILL)
        return h

    def ntk_ensemble(self, t=None, k_test_train=None, k_test_test=None) -> Gaussian:
        """Mean and covariance of an infinite ensemble of wide networks after time(s) ``t``.

        The formulas of :meth:`GPInference.ntk` with H(t) = A⁻¹ (I − exp(−A τ / n)) for A⁻¹,
        τ = ``learning_rate``·t (``gradient_descent_mse_ensemble``); arguments and errors as
        there. Returns ``Gaussian``, ``t.shape +`` the layouts of :meth:`GPInference.ntk`.
        """
        fn = f"{self._fn}(...).ntk_ensemble"
        if k_test_train is None:
            raise bad(ValueError, fn, "k_test_train is required", "pass the test-train kernels")
        needs_cov = k_test_test is not None
        if needs_cov and not (self._nngp2 is not None and isinstance(k_test_train, Kernels)):
            raise _needs_both(fn, gradient_descent_mse)
        times = _check_times(fn, t)
        fields = [_NTK, _NNGP] if needs_cov else [_NTK]
        n_test, kts, diag, ktt, u = self._test_kernels(fn, k_test_train, k_test_test, fields)
        means, covs = [], []
        for tk in times.reshape(-1):
            h = self._weights(fn, tk * self._lr / self._y_size, float(tk))
            apply_h = lambda b, h=h: self._v @ (h[:, None] * (self._v.T @ b))  # noqa: E731
            g = self._predict(fn, n_test, kts, diag, ktt, self._nngp2, apply_h(self._y), apply_h, u)
            means.append(g.mean)
            covs.append(g.covariance)
        mean = np.stack(means).reshape(times.shape + means[0].shape)
        cov = None if ktt is None else np.stack(covs).reshape(times.shape + covs[0].shape)
        return Gaussian(mean, cov)


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

    Linearised regime, loss ½·|f − y|² / n, n = ``y_train.size``, τ = ``learning_rate``·t,
    A = Θ_xx + λI = V diag(w) Vᵀ (neural-tangents' ``gradient_descent_mse``):

        f_train(t) = y + V diag(exp(−w τ / n)) Vᵀ (f_train(0) − y)
        f_test(t)  = f_test(0) + Θ_tx V diag((1 − exp(−w τ / n)) / w) Vᵀ (y − f_train(0))

    The float64 eigendecomposition is computed once, here. Directions with
    w <= √M·u·w_max do not move. Test predictions with round-off bound u·w_max·max h above
    1e-6 raise ValueError.

    Args:
      k_train_train: the NTK ``(N, N)`` / ``(N, N, O, O)`` or :class:`Kernels` (``ntk``).
      learning_rate: step size η > 0.
      y_train, diag_reg, diag_reg_absolute_scale, trace_axes, dtype, test_batch_size:
        as :func:`gp_inference`.

    Returns :class:`GradientDescentMSE` (``predictor(t, ...) -> Outputs``, ``.ntk_ensemble``).
    Raises ValueError, TypeError: as :func:`gp_inference`; ``learning_rate`` <= 0.

    Cost: 9·M³ flops and 2·M² float64 memory once; per call 2·M²·R·K + 2·T·M·R·K for K times.

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

    References: Jacot et al., "Neural Tangent Kernel", NeurIPS 2018; Lee et al. 2019.
    """
    fn = "gradient_descent_mse"
    opts = _options(fn, diag_reg, diag_reg_absolute_scale, trace_axes, dtype, test_batch_size)
    return GradientDescentMSE(fn, k_train_train, y_train, learning_rate, opts)


gp_inference = _checked_arguments(gp_inference)
gradient_descent_mse = _checked_arguments(gradient_descent_mse)
