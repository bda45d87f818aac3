"""neural-tangents 0.6's ``gradient_descent_mse_ensemble``: predictions from a kernel function
``kernel_fn(x1, x2, get, **kwargs)`` (stax's contract), on the solvers of :mod:`.inference`."""

from __future__ import annotations

import collections
import inspect
from typing import Any

import jax
import numpy as np

from ntk_core._errors import bad, check_bool, check_real
from ntk_core._kernel.arguments import _checked_arguments, misspelt
from ntk_core._kernel.options import DEFAULTS
from ntk_core._predict.inference import (
    _NNGP,
    _NTK,
    Gaussian,
    GPInference,
    GradientDescentMSE,
    Kernels,
    _check_times,
    _options,
)
from ntk_core._predict.linalg import (
    MISSING_TARGETS,
    FlatLayout,
    as_host_array,
    check_rows_finite,
    compute_dtype,
    finite_host_array,
)

_GETS = (_NNGP, _NTK)
_GAUSSIANS: dict[tuple[str, ...], type] = {}


def _gaussians(get: tuple[str, ...]) -> type:
    """neural-tangents' ``Gaussians`` namedtuple with the fields of ``get``, in its order."""
    if get not in _GAUSSIANS:
        _GAUSSIANS[get] = collections.namedtuple("Gaussians", get)
    return _GAUSSIANS[get]


def _n_samples(fn, name, x) -> int:
    """The common leading axis of every array of ``x`` (an array or a pytree of them)."""
    leaves = jax.tree_util.tree_leaves(x)
    if not leaves or any(np.ndim(leaf) == 0 for leaf in leaves):
        what = f"{name} must hold arrays with a leading sample axis, got {x!r:.40}"
        raise bad(ValueError, fn, what, f"pass {name} as an array (N, ...)")
    shapes = [np.shape(leaf) for leaf in leaves]
    if len({s[0] for s in shapes}) > 1:
        what = f"the arrays of {name} disagree on the number of samples: {[s[0] for s in shapes]}"
        raise bad(ValueError, fn, what, "pass arrays with the same leading axis N")
    return shapes[0][0]


def _canonical_get(fn, get) -> tuple[bool, tuple[str, ...]]:
    """``(one name?, names)`` of neural-tangents' ``get``: None, a name, or a tuple of names."""
    if get is None:
        return False, _GETS
    one = isinstance(get, str)
    names = (get,) if one else get
    fix = "pass get='nngp', get='ntk', or get=('nngp', 'ntk')"
    if not isinstance(names, (tuple, list)) or not names:
        raise bad(TypeError, fn, f"get must be a name or a tuple of names, got {get!r}", fix)
    if not all(isinstance(g, str) and g.lower() in _GETS for g in names):
        raise bad(ValueError, fn, f"get must name 'nngp' and/or 'ntk', got {get!r}", fix)
    names = tuple(g.lower() for g in names)
    if len(set(names)) < len(names):
        raise bad(ValueError, fn, f"get names a kernel twice: {get!r}", fix)
    return one, names


_OPTIONS = ("learning_rate", "diag_reg", "diag_reg_absolute_scale", "trace_axes")


def _check_call(fn, kernel_fn, kwargs) -> None:
    """Refuses a ``kernel_fn`` that cannot be called as ``kernel_fn(x1, x2, get, **kwargs)``
    now, not at the first prediction (a misspelt option lands in ``kwargs``)."""
    if not callable(kernel_fn):
        what = f"kernel_fn must be callable, got {type(kernel_fn).__name__}"
        fix = "pass a kernel function kernel_fn(x1, x2, get), e.g. ntk_core.stax's"
        raise bad(TypeError, fn, what, fix)
    try:
        signature = inspect.signature(kernel_fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): its call will tell
        return
    try:
        signature.bind(None, None, None, **kwargs)
    except TypeError as e:
        own = signature.parameters
        typo = next((k for k in kwargs if k not in own and misspelt(k, _OPTIONS)), None)
        fix = f"pass a kernel_fn(x1, x2=None, get=None, **kwargs); options: {', '.join(_OPTIONS)}"
        if typo is not None:
            fix = f"write {misspelt(typo, _OPTIONS)}= (not {typo}=)"
        what = f"kernel_fn{signature} cannot be called as kernel_fn(x1, x2, get"
        what += "".join(f", {k}=..." for k in kwargs) + f") ({e})"
        raise bad(TypeError, fn, what, fix) from None


class GradientDescentMSEEnsemble:
    """Predictor returned by :func:`gradient_descent_mse_ensemble` (neural-tangents'
    ``predict_fn``)."""

    def __init__(self, fn, kernel_fn, x_train, y_train, learning_rate, opts, kwargs):
        _check_call(fn, kernel_fn, kwargs)
        fix = "pass the step size, e.g. learning_rate=1.0"
        self._lr = check_real(fn, "learning_rate", learning_rate, fix, open_low=True)
        y = finite_host_array(fn, "y_train", y_train, MISSING_TARGETS)
        self._layout = FlatLayout(fn, y.shape, opts.trace_axes)
        n = _n_samples(fn, "x_train", x_train)
        if n != y.shape[0]:
            what = f"x_train has {n} samples but y_train has {y.shape[0]} (shape {y.shape})"
            raise bad(ValueError, fn, what, "pass one target row per training input")
        self._fn, self._kernel_fn, self._x, self._y, self._opts = fn, kernel_fn, x_train, y, opts
        self._kwargs, self._n = kwargs, n
        self._k_dd: dict[str, np.ndarray] = {}  # train-train kernels, computed when first needed
        self._gp: dict[tuple[str, ...], GPInference] = {}
        self._gd: dict[str, GradientDescentMSE] = {}

    def _call(self, x1, x2, names, n1):
        """``{name: checked host array}`` of one ``kernel_fn(x1, x2, get)`` call; ``n1``: the
        rows expected (None: any, a test-train kernel)."""
        get = names[0] if len(names) == 1 else names
        out = self._kernel_fn(x1, x2, get, **self._kwargs)
        x1_name = "x_train" if x1 is self._x else "x_test"
        x2_name = "None" if x2 is None else "x_train"
        call = f"kernel_fn({x1_name}, {x2_name}, get={get!r})"
        if len(names) == 1:
            arrays = (out,)
        elif all(hasattr(out, g) for g in names):
            arrays = tuple(getattr(out, g) for g in names)
        elif isinstance(out, (tuple, list)) and len(out) == len(names):
            arrays = tuple(out)  # a plain tuple, in the order asked for
        else:
            what = f"{call} returned {type(out).__name__}, expected .nngp and .ntk or a 2-tuple"
            raise bad(TypeError, self._fn, what, "return kernels in neural-tangents' contract")
        result = {}
        for g, k in zip(names, arrays, strict=True):
            name = f"{call}.{g}" if len(names) > 1 else call
            k = as_host_array(self._fn, name, k)
            self._layout.check_pair(name, k, n1, self._n if x2 is not None else n1, self._fn)
            check_rows_finite(self._fn, name, k)
            result[g] = k
        return result

    def _train(self, names) -> dict[str, np.ndarray]:
        missing = tuple(g for g in names if g not in self._k_dd)
        if missing:  # one call for both: stax computes the NNGP with the NTK anyway
            self._k_dd.update(self._call(self._x, None, missing, self._n))
        return {g: self._k_dd[g] for g in names}

    def _gp_inference(self, deps) -> GPInference:
        if deps not in self._gp:
            k = Kernels(**self._train(deps))
            self._gp[deps] = GPInference(self._fn, k, self._y, self._opts, False)
        return self._gp[deps]

    def _gradient_descent(self, g, with_nngp) -> GradientDescentMSE:
        """The gradient flow on ``g``'s kernel (the NTK's with the NNGP for its covariance)."""
        key = g + ("+nngp" if with_nngp and g == _NTK else "")
        if key not in self._gd:
            names = (_NNGP, _NTK) if key == "ntk+nngp" else (g,)
            k = self._train(names)
            kernels = Kernels(nngp=k.get(_NNGP), ntk=k[g])
            self._gd[key] = GradientDescentMSE(self._fn, kernels, self._y, self._lr, self._opts)
        return self._gd[key]

    def __call__(self, t=None, x_test=None, get=None, compute_cov=False):
        """Mean, or ``Gaussian(mean, covariance)`` with ``compute_cov``, at time(s) ``t``.

        Args:
          t: None (infinite time, by a refined Cholesky solve), or training times in steps
            of any shape (``np.inf`` allowed: by the eigendecomposition).
          x_test: test inputs ``(T, ...)``; None: the training points, as neural-tangents:
            the formulas with the regularised train kernel A = K + λI as test-train and
            test-test kernel, so that the mean at t = None is ``y_train`` and the covariance
            0 (``x_test=x_train`` gives K A⁻¹ y instead).
          get: ``"nngp"`` or ``"ntk"`` (that result alone), a tuple of them, or None (both):
            a ``Gaussians`` namedtuple with those fields in that order.
          compute_cov: also the covariance, full ``(T, T)`` / ``(T, T, O, O)``.

        Returns: means ``t.shape + (T, O...)`` (none of ``t.shape`` at t = None),
        covariances ``t.shape + (T, T[, O, O])``, in the kernel's dtype (float32 or float64).
        Raises ValueError, TypeError: bad ``get``, times, kernels of ``kernel_fn`` (shape,
        dtype, NaN), or as :func:`gp_inference` / :func:`gradient_descent_mse`.
        """
        fn = f"{self._fn}(...)"
        one, names = _canonical_get(fn, get)
        cov = check_bool(fn, "compute_cov", compute_cov)
        times = None if t is None else _check_times(fn, t)
        # the NTK's covariance needs the NNGP (the networks' prior at initialisation)
        deps = tuple(g for g in _GETS if g in names or (g == _NNGP and cov and _NTK in names))
        k_dd = self._train(deps)
        out = {}
        if x_test is None:
            for g in names:
                out[g] = self._on_train(g, times, cov, k_dd)
        else:
            k_td = self._call(x_test, self._x, deps, None)
            n_test = next(iter(k_td.values())).shape[0]
            k_tt = self._call(x_test, None, (_NNGP,), n_test)[_NNGP] if cov else None
            for g in names:
                out[g] = self._on_test(fn, g, times, k_td, k_tt)
        if one:
            return out[names[0]]
        return _gaussians(names)(*(out[g] for g in names))

    def _on_test(self, fn, g, times, k_td, k_tt):
        kts = Kernels(nngp=k_td.get(_NNGP), ntk=k_td[g])
        if times is None:
            post = self._gp_inference(tuple(k_td))
            res = (post.nngp if g == _NNGP else post.ntk)(kts, k_tt)
        elif g == _NTK:
            res = self._gradient_descent(g, k_tt is not None).ntk_ensemble(times, kts, k_tt)
        else:
            res = self._nngp_flow(fn, times, k_td[_NNGP], k_tt)
        return res if k_tt is not None else res.mean

    def _nngp_flow(self, fn, times, k_td, k_tt):
        """Gradient flow on the NNGP (the last layer trained alone): mean K_tx H(t) y,
        covariance K_tt − K_tx H(2t) K_xt, H(t) = A⁻¹ (I − exp(−A τ / n))."""
        gd = self._gradient_descent(_NNGP, False)
        n_test, kts, diag, ktt, u = gd._test_kernels(fn, k_td, k_tt, [_NTK])
        kts = {_NTK: kts[_NTK], _NNGP: kts[_NTK]}
        v, means, covs = gd._v, [], []
        for tk in times.reshape(-1):
            tau = tk * self._lr / self._y.size
            h = gd._weights(fn, tau, float(tk))
            h2 = h if ktt is None else gd._weights(fn, 2 * tau, float(tk))
            apply_h2 = lambda b, h2=h2: v @ (h2[:, None] * (v.T @ b))  # noqa: E731
            alpha = v @ (h[:, None] * (v.T @ gd._y))
            res = gd._predict(fn, n_test, kts, diag, ktt, None, alpha, apply_h2, u)
            means.append(res.mean)
            covs.append(res.covariance)
        mean = np.stack(means).reshape(times.shape + means[0].shape)
        cov = None if ktt is None else np.stack(covs).reshape(times.shape + covs[0].shape)
        return Gaussian(mean, cov)

    def _on_train(self, g, times, cov, k_dd):
        """neural-tangents' ``x_test=None``: the test formulas with A = K + λI (g's kernel) as
        test-train kernel: mean (I − exp(−A τ / n)) y; covariance V diag(w e^{−2wτ/n}) Vᵀ
        ("nngp") or E K E, E = exp(−A τ / n), K the NNGP ("ntk"); N(y, 0) at t = None."""
        lay = self._layout
        if times is None:
            dtype = compute_dtype(self._fn, self._opts.dtype, k_dd[g].dtype)
            mean = self._y.astype(dtype)
            if not cov:
                return mean
            return Gaussian(mean, np.zeros(lay.pair_shape(self._n, self._n), dtype))
        gd = self._gradient_descent(g, cov)
        v, y = gd._v, lay.flat_y(self._y)
        means, covs = [], []
        for tk in times.reshape(-1):
            e = 1.0 + gd._decay(tk * self._lr / self._y.size)  # exp(−w τ / n), 1 where null
            means.append(lay.unflat_y(v @ ((1.0 - e)[:, None] * (v.T @ y)), self._n))
            if cov:
                if g == _NNGP:
                    c = (v * (gd._w * e * e)) @ v.T
                else:
                    ev = v * e
                    c = ev @ (v.T @ gd._nngp2 @ v) @ ev.T
                covs.append(lay.unflat_cov((c + c.T) / 2, self._n))
        dt = gd.dtype
        mean = np.stack(means).reshape(times.shape + means[0].shape).astype(dt)
        if not cov:
            return mean
        return Gaussian(mean, np.stack(covs).reshape(times.shape + covs[0].shape).astype(dt))


def gradient_descent_mse_ensemble(
    kernel_fn,
    x_train,
    y_train,
    *,
    learning_rate: float = 1.0,
    diag_reg: float = 0.0,
    diag_reg_absolute_scale: bool = False,
    trace_axes=DEFAULTS.trace_axes,
    **kernel_fn_kwargs: Any,
) -> GradientDescentMSEEnsemble:
    """Infinite ensemble of wide networks trained by gradient flow on the MSE, from a kernel
    function (neural-tangents 0.6's ``gradient_descent_mse_ensemble``, the same formulas).

    With K the NNGP, Θ the NTK, A = K_g + λI = V diag(w) Vᵀ for ``get`` g, τ =
    ``learning_rate``·t, n = ``y_train.size``, H(t) = V diag((1 − e^{−wτ/n}) / w) Vᵀ:

        "nngp": mean K_tx H(t) y,  covariance K_tt − K_tx H(2t) K_xt
        "ntk":  mean Θ_tx H(t) y,  covariance K_tt + Θ_tx H K_xx H Θ_xt − (Θ_tx H K_xt + ᵀ)

    At t = None, H = A⁻¹: the posteriors of :func:`gp_inference` (``.nngp`` / ``.ntk``).

    Args:
      kernel_fn: ``kernel_fn(x1, x2, get, **kernel_fn_kwargs)`` as ``ntk_core.stax``'s (and
        neural-tangents' ``kernel_fn``): x2 None means x1; an array for ``get="nngp"`` or
        ``"ntk"``, for a tuple of names an object with ``.nngp`` and ``.ntk`` or a tuple in
        the order asked. Kernels ``(N1, N2)`` (``trace_axes=(-1,)``) or ``(N1, N2, O, O)``.
      x_train: training inputs ``(N, ...)`` (or a pytree of such arrays).
      y_train: targets ``(N, O...)``, float, finite.
      learning_rate: step size η > 0 (time is measured in steps of η).
      diag_reg, diag_reg_absolute_scale, trace_axes: as :func:`gp_inference`.
      **kernel_fn_kwargs: passed to every ``kernel_fn`` call.

    Returns :class:`GradientDescentMSEEnsemble`, ``predict_fn(t=None, x_test=None, get=None,
    compute_cov=False)``: see its ``__call__``. Kernels are computed at its first call that
    needs them (train-train once, both kinds in one call), factored once per kind.

    Raises TypeError: ``kernel_fn`` not callable, ``learning_rate`` not a number;
    ValueError: x_train and y_train of different N, ``learning_rate`` <= 0, as
    :func:`gp_inference`.

    Cost: ``kernel_fn`` on N² (train), T·N and T² (test) pairs; t = None: M³/3 flops per
    kind, M = N·O_kept; finite t: 9·M³ once per kind, then 2·T·M² per time.

    Example:
      >>> import numpy as np
      >>> from ntk_core import predict
      >>> def kernel_fn(x1, x2=None, get=None):       # an RBF kernel as both NNGP and NTK
      ...     x2 = x1 if x2 is None else x2
      ...     k = np.exp(-((x1[:, None, 0] - x2[None, :, 0]) ** 2))
      ...     return k if isinstance(get, str) else (k, k)
      >>> x = np.linspace(-1, 1, 5)[:, None]
      >>> predict_fn = predict.gradient_descent_mse_ensemble(kernel_fn, x, np.sin(3 * x),
      ...                                                     diag_reg=1e-4)
      >>> mean, cov = predict_fn(x_test=x[:2], get="ntk", compute_cov=True)
      >>> mean.shape, cov.shape
      ((2, 1), (2, 2))
      >>> predict_fn(t=np.array([1.0, 10.0]), x_test=x[:2], get="nngp").shape
      (2, 2, 1)

    References: Lee et al., "Wide Neural Networks of Any Depth Evolve as Linear Models Under
    Gradient Descent", NeurIPS 2019; Novak et al., "Neural Tangents", ICLR 2020.
    """
    fn = "gradient_descent_mse_ensemble"
    opts = _options(fn, diag_reg, diag_reg_absolute_scale, trace_axes, None, None)
    return GradientDescentMSEEnsemble(
        fn, kernel_fn, x_train, y_train, learning_rate, opts, kernel_fn_kwargs
    )


gradient_descent_mse_ensemble = _checked_arguments(gradient_descent_mse_ensemble)
