"""Host linear algebra of :mod:`ntk_core.predict`: layouts, checks of host arguments (arrays,
targets, PRNG keys), and a solver of K + λI (Cholesky, else floored eigh) refined in float64
until corrections are <= :data:`ACCEPT`."""

from __future__ import annotations

import math

import jax
import numpy as np

from ntk_core._errors import NonFiniteError, bad, check_bool, check_real, must
from ntk_core._kernel.options import _axes

#: A solve is accepted when max|last correction| <= ACCEPT * max|x| per right-hand side.
ACCEPT = 1e-6
#: Refinement stops at max|correction| <= TARGET * max|x| (below float32 output rounding),
#: when corrections stop halving, or after MAX_REFINE steps.
TARGET, MAX_REFINE = 1e-7, 20
#: Entries per float64 row chunk when streaming a kernel (64 MiB).
_CHUNK_ENTRIES = 1 << 23


def unit_roundoff(dtype) -> float:
    """u = eps / 2 of a floating dtype (float32: 5.96e-8, float64: 1.11e-16)."""
    return float(np.finfo(dtype).eps) / 2


def row_chunks(n_rows: int, n_cols: int):
    """Slices of rows of about 64 MiB of float64."""
    rows = max(1, _CHUNK_ENTRIES // max(n_cols, 1))
    for start in range(0, n_rows, rows):
        yield slice(start, min(n_rows, start + rows))


NAN_KERNEL_FIX = "recompute it; NaN comes from NaN parameters or inputs, or float32 overflow"
MISSING_TARGETS = "drop or impute the samples with missing targets"
SAME_AXES = "compute it on the same inputs with the same trace_axes"
SEE_ILL = "ill-conditioned-kernel"


def check_finite(fn, name, arr, fix=NAN_KERNEL_FIX, *, first=0, unit="sample"):
    """Raises NonFiniteError naming the first non-finite entry along axis 0 (plus ``first``)."""
    bad_entries = ~np.isfinite(arr)
    if bad_entries.any():
        at = first + (int(np.argwhere(bad_entries)[0][0]) if bad_entries.ndim else 0)
        raise bad(NonFiniteError, fn, f"{name} contains NaN or Inf (first at {unit} {at})", fix)


def check_symmetric(fn, name, asym: float, kmax: float, dtype) -> None:
    """Raises unless ``asym`` = max |K - Kᵀ| <= 100·u·``kmax``."""
    if asym > 100 * unit_roundoff(dtype) * kmax:
        what = f"{name} is not symmetric: max |K - K^T| = {asym:.3e} for max |K| = {kmax:.3e}"
        fix = "pass the kernel of x with itself, or (K + K^T) / 2 (K^T: axes (1, 0, 3, 2) if 4-D)"
        raise bad(ValueError, fn, what, fix)


def check_prior_symmetric(fn, name, k: np.ndarray) -> None:
    """Raises unless a test prior ``(M, M)``, or per-sample blocks ``(M, O, O)``, is
    symmetric within :func:`check_symmetric`'s tolerance (a covariance must be)."""
    k64 = np.asarray(k, np.float64)
    asym = float(np.abs(k64 - np.swapaxes(k64, -1, -2)).max(initial=0.0))
    check_symmetric(fn, name, asym, float(np.abs(k64).max(initial=0.0)), k.dtype)


def compute_dtype(fn: str, dtype, kernel_dtype) -> np.dtype:
    if dtype is None:
        return np.dtype(np.float64 if np.dtype(kernel_dtype) == np.float64 else np.float32)
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise must(
            ValueError, fn, "dtype", "None, 'float32' or 'float64'", repr(dtype), eg="'float64'"
        )
    return d


def check_diag_reg(fn_name: str, diag_reg, absolute_scale) -> tuple[float, bool]:
    """``(diag_reg, diag_reg_absolute_scale)`` checked: a real number >= 0 and a bool."""
    fix = "pass e.g. diag_reg=1e-4 (or 0.0)"
    diag_reg = check_real(fn_name, "diag_reg", diag_reg, fix)
    return diag_reg, check_bool(fn_name, "diag_reg_absolute_scale", absolute_scale)


def as_host_array(fn_name: str, name: str, x) -> np.ndarray:
    try:
        arr = x if isinstance(x, np.ndarray) else np.asarray(x)
    except Exception:  # noqa: BLE001 - any conversion failure is reported
        arr = None
    if arr is None or not np.issubdtype(arr.dtype, np.floating):
        got = type(x).__name__ if arr is None else f"dtype {arr.dtype}"
        raise must(
            TypeError, fn_name, name, "a floating array", got, f"pass np.asarray({name}, float)"
        )
    return arr


def check_key(fn_name: str, key):
    """``key`` if it is one PRNG key (typed, or a raw uint32 pair)."""
    array = isinstance(key, jax.Array)
    raw = array and key.shape == (2,) and key.dtype == np.uint32
    if not (array and (jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) or raw)):
        got = type(key).__name__ + (f" of shape {key.shape}, dtype {key.dtype}" if array else "")
        raise must(
            TypeError, fn_name, "key", "one JAX PRNG key", got, "pass key=jax.random.PRNGKey(seed)"
        )
    return key


def is_real_dtype(dtype) -> bool:
    """A floating or integer dtype (not bool, complex or object)."""
    return np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)


def real_array(fn_name: str, name: str, y) -> np.ndarray:
    """``y`` (targets, labels) as a finite numpy array of floating or integer numbers."""
    arr = np.asarray(y)
    if not is_real_dtype(arr.dtype):
        got, fix = f"dtype {arr.dtype}", "encode them as numbers, e.g. one-hot or ±1"
        raise must(TypeError, fn_name, name, "real numbers", got, fix)
    check_finite(fn_name, name, arr, MISSING_TARGETS)
    return arr


def check_rows_finite(fn_name: str, name: str, arr: np.ndarray, fix=NAN_KERNEL_FIX) -> None:
    """:func:`check_finite` in row chunks."""
    flat = arr.reshape(len(arr) if arr.ndim else 1, math.prod(arr.shape[1:]))  # empty too
    for rows in row_chunks(flat.shape[0], flat.shape[1]):
        check_finite(fn_name, name, flat[rows], fix, first=rows.start)


def finite_host_array(fn_name: str, name: str, x, fix=NAN_KERNEL_FIX) -> np.ndarray:
    """:func:`as_host_array`, then :func:`check_rows_finite`."""
    arr = as_host_array(fn_name, name, x)
    check_rows_finite(fn_name, name, arr, fix)
    return arr


def flat_pairs(k: np.ndarray, o: int) -> np.ndarray:
    """``(n1, n2, O1, O1, ...)`` → ``(n1·O, n2·O)`` (``k`` itself when 2-D)."""
    if k.ndim == 2:
        return k
    m = (k.ndim - 2) // 2
    order = [0] + [2 + 2 * i for i in range(m)] + [1] + [3 + 2 * i for i in range(m)]
    return np.transpose(k, order).reshape(k.shape[0] * o, k.shape[1] * o)


class FlatLayout:
    """Neural-tangents kernel layout ``(N1, N2, k1, k1, ...)`` (kept output axes zipped, traced
    ones absent) to flat ``(N1·K_o, N2·K_o)`` kernels and ``(N·K_o, R)`` targets, and back."""

    def __init__(self, fn_name: str, y_shape: tuple[int, ...], trace_axes):
        if len(y_shape) < 2:
            what = f"y_train must have shape (N, O...), got {y_shape}"
            raise bad(ValueError, fn_name, what, "pass y_train[:, None] for one output")
        if 0 in y_shape:
            what = f"y_train of shape {y_shape} is empty"
            raise bad(ValueError, fn_name, what, "pass at least one training sample and output")
        ((axes,), nd) = _axes(fn_name, trace_axes=trace_axes), len(y_shape)
        canon = [a % nd for a in axes if -nd <= a < nd]
        if len(canon) < len(axes) or 0 in canon or len(set(canon)) < len(canon):
            what = f"trace_axes={axes} must name distinct output axes 1..{nd - 1} of y {y_shape}"
            raise bad(ValueError, fn_name, what, "pass the kernels' trace_axes, e.g. (-1,) or ()")
        self.fn_name, self.n, self.traced = fn_name, y_shape[0], tuple(sorted(canon))
        self.kept = tuple(a for a in range(1, nd) if a not in self.traced)
        self.kept_shape = tuple(y_shape[a] for a in self.kept)
        self.traced_shape = tuple(y_shape[a] for a in self.traced)
        self.ko, self.r = math.prod(self.kept_shape), math.prod(self.traced_shape)
        self.y_shape, self._zipped = y_shape, tuple(s for k in self.kept_shape for s in (k, k))

    def pair_shape(self, n1: int, n2: int) -> tuple[int, ...]:
        return (n1, n2) + self._zipped

    def diag_shape(self, n1: int) -> tuple[int, ...]:
        return (n1,) + self._zipped

    def check_pair(self, name, k, n1, n2, fn_name=None) -> int:
        """Checks a kernel of shape pair_shape(n1, n2) (n1 None: any); returns n1."""
        any_rows = n1 is None
        n1 = k.shape[0] if (n1 is None and k.ndim) else n1
        if k.shape != (want := self.pair_shape(n1, n2)):
            y = self.y_shape
            if any_rows:  # a test kernel: any number of rows M
                want = "(" + ", ".join(["M", *map(str, want[1:])]) + ")"
            what = f"{name} has shape {k.shape}, expected {want} for y_train of shape {y}"
            fix = SAME_AXES
            if any_rows and k.ndim >= 2 and k.shape[0] == n2 != k.shape[1]:
                fix = f"pass {name} with the test samples first (axes 0 and 1 swapped?), or {fix}"
            raise bad(ValueError, fn_name or self.fn_name, what, fix)
        return n1

    def flat(self, k: np.ndarray) -> np.ndarray:
        return flat_pairs(k, self.ko)

    def flat_diag(self, k: np.ndarray) -> np.ndarray:
        m = len(self.kept)
        order = [0] + [1 + 2 * i for i in range(m)] + [2 + 2 * i for i in range(m)]
        return np.transpose(k, order).reshape(k.shape[0], self.ko, self.ko)

    def unflat_cov(self, c: np.ndarray, t: int) -> np.ndarray:
        if not self.kept:
            return c
        m = len(self.kept)
        c = c.reshape((t,) + self.kept_shape + (t,) + self.kept_shape)
        order = [0, m + 1] + [i for j in range(m) for i in (1 + j, m + 2 + j)]
        return np.transpose(c, order)

    def unflat_diag(self, v: np.ndarray) -> np.ndarray:
        t = v.shape[0]
        if not self.kept:
            return v.reshape(t)
        m = len(self.kept)
        v = v.reshape((t,) + self.kept_shape + self.kept_shape)
        order = [0] + [i for j in range(m) for i in (1 + j, 1 + m + j)]
        return np.transpose(v, order)

    def flat_y(self, y: np.ndarray) -> np.ndarray:
        y = np.moveaxis(y, self.kept + self.traced, range(1, len(self.y_shape)))
        return y.reshape(y.shape[0] * self.ko, self.r)

    def unflat_y(self, f: np.ndarray, n: int) -> np.ndarray:
        f = f.reshape((n,) + self.kept_shape + self.traced_shape)
        return np.moveaxis(f, range(1, len(self.y_shape)), self.kept + self.traced)


def scan_train_kernel(fn_name: str, name: str, k2: np.ndarray, dtype) -> tuple[float, float]:
    """Checks a flat train kernel is finite and symmetric; returns (mean diag, max |K|)."""
    m = k2.shape[0]
    diag_sum, kmax, asym = 0.0, 0.0, 0.0
    for rows in row_chunks(m, m):
        block = np.asarray(k2[rows], np.float64)
        check_finite(fn_name, name, block, first=rows.start, unit="row")
        diag_sum += float(np.trace(block[:, rows]))
        kmax = max(kmax, float(np.abs(block).max()))
        asym = max(asym, float(np.abs(block - np.asarray(k2[:, rows], np.float64).T).max()))
    check_symmetric(fn_name, name, asym, kmax, dtype)
    return diag_sum / m, kmax


def matmul64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` in float64, ``a`` streamed in row chunks."""
    out = np.empty((a.shape[0],) + b.shape[1:], np.float64)
    b64 = np.asarray(b, np.float64)
    for rows in row_chunks(a.shape[0], a.shape[1]):
        out[rows] = np.asarray(a[rows], np.float64) @ b64
    return out


#: Random probes of :func:`numerical_rank` (a rank below half of them is exact w.h.p.).
RANK_PROBES = 64


def numerical_rank(k2: np.ndarray, dtype, probes: int = RANK_PROBES) -> tuple[int, int, float]:
    """``(r, c, drop)``: rank r (eigenvalues > M·u·λ_max) of a flat PSD kernel seen by c probes
    (exact for M <= c, else a K Ω sketch: Halko et al. 2011; 2·M²·c flops) and σ_r / σ_{r+1}."""
    import scipy.linalg  # not at import: 0.3 s off `import ntk_core`

    m = k2.shape[0]
    c = min(m, probes)
    if m <= probes:
        s = np.abs(scipy.linalg.eigvalsh(np.asarray(k2, np.float64), check_finite=False))
    else:
        omega = np.random.default_rng(0).standard_normal((m, probes))
        s = scipy.linalg.svdvals(matmul64(k2, omega), check_finite=False)
    s = np.sort(s)[::-1]
    if not s.size or s[0] <= 0:
        return 0, c, math.inf
    r = int(np.count_nonzero(s > m * unit_roundoff(dtype) * s[0]))
    drop = math.inf if r >= s.size or s[r] <= 0 else float(s[r - 1] / s[r])
    return r, c, drop


class Solver:
    """Solves ``(K + λ I) x = b`` for a flat symmetric ``K``, refined in float64."""

    def __init__(self, fn_name, k2, lam, dtype, *, reg_scale=1.0, eigh=False):
        import scipy.linalg  # not at import: 0.3 s off `import ntk_core`

        self.fn_name, self.k2, self.lam, self.dtype = fn_name, k2, lam, np.dtype(dtype)
        self.m, self.reg_scale, self.u = k2.shape[0], reg_scale, unit_roundoff(self.dtype)
        self._eigs, self._chol = None, None
        self._cho_solve = scipy.linalg.cho_solve
        if not eigh:
            # a is C-ordered and symmetric: a.T is the same matrix in Fortran order, so
            # LAPACK factors it in place (upper of a.T = lower of a), no second copy.
            a = self._regularised_copy()
            try:
                self._chol = scipy.linalg.cho_factor(a.T, overwrite_a=True, check_finite=False)
                if np.isfinite(np.diagonal(self._chol[0])).all():
                    return
            except np.linalg.LinAlgError:
                pass
            del a
            self._chol = None
        w, v = scipy.linalg.eigh(self._regularised_copy(), overwrite_a=True, check_finite=False)
        w = w.astype(np.float64)
        wmax = max(float(np.abs(w).max()), np.finfo(np.float64).tiny)
        # the kernel's entries carry the round-off of their own dtype
        tol = self.m * max(self.u, unit_roundoff(k2.dtype)) * wmax
        if w.min() < -tol:
            what = f"K + λI is not positive semi-definite: eigenvalue {w.min():.2e} < −{tol:.2e}"
            needed = self.lam - float(w.min())  # the λ that would make K + λI PSD
            fix = "pass a kernel (not a difference of two), or "
            if reg_scale > 0:
                fix += f"diag_reg > {needed / reg_scale:.1e}"
            else:  # a relative diag_reg scales a mean diagonal <= 0: no value helps
                what += f"; its mean diagonal is {reg_scale:.2e} <= 0"
                fix += f"diag_reg_absolute_scale=True with diag_reg > {needed:.1e}"
            raise bad(ValueError, fn_name, what, fix)
        self._eigs = (w, v)
        self._w_floored = np.maximum(w, self.u * wmax)

    @property
    def method(self) -> str:
        return "eigh" if self._chol is None else "cholesky"

    def _regularised_copy(self) -> np.ndarray:
        a = np.empty((self.m, self.m), self.dtype)
        for rows in row_chunks(self.m, self.m):
            a[rows] = self.k2[rows]
        a[np.diag_indices(self.m)] += self.dtype.type(self.lam)
        return a

    def _apply_inverse(self, b: np.ndarray) -> np.ndarray:
        b = np.asarray(b, self.dtype)
        if self._chol is not None:
            x = self._cho_solve(self._chol, b, check_finite=False)
        else:
            v = self._eigs[1]
            with np.errstate(divide="ignore", invalid="ignore"):  # K + λI = 0: solve() raises
                x = v @ ((v.T @ b) / self._w_floored.astype(self.dtype)[:, None])
        return np.asarray(x, np.float64)

    def matvec(self, x: np.ndarray) -> np.ndarray:
        return matmul64(self.k2, x) + self.lam * x

    def solve(self, b: np.ndarray) -> np.ndarray:
        """``(K + λ I)⁻¹ b`` for ``b`` ``(M, R)``, float64, refined and checked."""
        b = np.asarray(b, np.float64)
        x = self._apply_inverse(b)
        active, prev, rel = np.ones(b.shape[1], bool), None, np.zeros(b.shape[1])
        for _ in range(MAX_REFINE):
            if not active.any():
                break
            d = self._apply_inverse(b[:, active] - self.matvec(x[:, active]))
            x[:, active] = xa = x[:, active] + d
            scale = np.maximum(np.abs(xa).max(axis=0), np.finfo(np.float64).tiny)
            rel_a = np.abs(d).max(axis=0) / scale
            rel[active] = rel_a
            done = rel_a <= TARGET
            if prev is not None:  # stagnating or diverging columns stop too
                done |= rel_a > 0.5 * prev
            prev = rel_a[~done]
            active[np.flatnonzero(active)[done]] = False
        if not np.isfinite(x).all() or rel.max() > ACCEPT:
            self._raise_ill_conditioned()
        return x

    def _raise_ill_conditioned(self) -> None:
        """Raises with the 2-norm condition number κ: exact after eigh, else 30 power steps on
        K + λI and on its inverse."""
        w_min = 0.0
        if self._eigs is not None:
            lam_max, w_min = float(self._eigs[0].max()), float(self._eigs[0].min())
            kappa = lam_max / w_min if w_min > 0 else math.inf
        else:
            rng = np.random.default_rng(0)
            v1, v2 = rng.standard_normal((self.m, 1)), rng.standard_normal((self.m, 1))
            lam_max = _power(self.matvec, v1)
            kappa = lam_max * max(_power(self._apply_inverse, v2), np.finfo(np.float64).tiny)
        if not lam_max > 0 or not self.reg_scale > 0:  # K = 0: a relative λ is 0 as well
            what = f"K + λI is singular: the kernel is all zeros (λ = {self.lam:g})"
            fix = "check that the outputs depend on the parameters (wrt=), or pass "
            fix += "diag_reg_absolute_scale=True with diag_reg > 0"
            raise bad(ValueError, self.fn_name, what, fix, see=SEE_ILL)

        # raise λ until the refined solve is accepted: float64 residuals of a lower-precision
        # solve converge while κ·u <= 0.01; a float64 solve's own error stays at κ·u, which
        # must reach ACCEPT / 4. λ >= u·λ_max / that, plus twice any negative eigenvalue
        # (round-off of the kernel's own entries); in the caller's units
        def suggest(u, target):  # the power of ten of diag_reg giving κ·u <= target
            need = u * lam_max / target + 2 * max(-w_min, 0.0)
            return 10 ** math.ceil(math.log10(max(need / self.reg_scale, 1e-300)))

        cond = f"{kappa:.2e}" if math.isfinite(kappa) else f"inf ({w_min:.2e} .. {lam_max:.2e})"
        what = f"K + λI is too ill-conditioned for {self.dtype.name}: condition number ≈ {cond}"
        if self.u > unit_roundoff(np.float64):  # float64 residuals: κ·u <= 0.01 converges
            wide = suggest(unit_roundoff(np.float64), ACCEPT / 4)
            fix = f"raise diag_reg to about {suggest(self.u, 0.01):.0e}, or pass "
            fix += f"dtype='float64' with diag_reg about {wide:.0e}"
        else:
            fix = f"raise diag_reg to about {suggest(self.u, ACCEPT / 4):.0e}"
        raise bad(ValueError, self.fn_name, what, fix, see=SEE_ILL)


def _power(op, v) -> float:
    """‖op(v)‖ after 30 power steps from ``v``."""
    norm = 1.0
    for _ in range(30):
        v = op(v / np.linalg.norm(v))
        norm = float(np.linalg.norm(v))
    return norm
