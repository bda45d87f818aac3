"""NTK spectra: ARPACK (``scipy.sparse.linalg.eigsh``) on float64 operators of size M = N·O,
from NTK-vector products (:func:`ntk_core.ntk_vp_fn`) or a kernel read in row chunks."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np
import scipy.linalg
import scipy.sparse.linalg

from ntk_core._analysis.host_kernel import HostKernel, eigenvalues_of
from ntk_core._errors import bad, check_int, check_real, must
from ntk_core._functional.ntk_vp import apply3_of, make_ntk_vp
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._kernel.caller import Caller, core
from ntk_core._kernel.checks import check_apply_fn
from ntk_core._kernel.options import DEFAULTS

_NTK_OPERATOR = core("ntk_operator", one_input=True)
_NTK_EIGSH = core("ntk_eigsh", one_input=True)

#: Valid values of ``which``: largest (``"LA"``) or smallest (``"SA"``) algebraic.
WHICH = (_LARGEST, _SMALLEST) = ("LA", "SA")
#: Seed of the fixed Gaussian starting vector v0 of ARPACK.
SEED = 0
_SA_HINT = "; the smallest converge slowly: condition_number(kernel) of a formed kernel is exact"


class Eigenpairs(NamedTuple):
    """Extreme eigenpairs (:func:`ntk_eigsh`): float64 ``eigenvalues (k,)`` in ``which``'s order;
    unit ``eigenvectors (N, O..., k)`` (``(N, k)`` for ``(N, N)``; pytrees for pytree outputs),
    largest entry positive; ``matvecs``, the products used."""

    eigenvalues: np.ndarray
    eigenvectors: Any
    matvecs: int


class NoConvergence(scipy.sparse.linalg.ArpackNoConvergence):
    """ARPACK stopped early (an ``ArpackNoConvergence``; holds the converged pairs)."""

    def __init__(self, msg, eigenvalues, eigenvectors):
        super().__init__(msg, eigenvalues, eigenvectors)
        self.args = (msg,)


class _Operator(scipy.sparse.linalg.LinearOperator):
    """A symmetric float64 operator from a function of float64 ``(M,)`` vectors."""

    def __init__(self, fn_name: str, m: int, product):
        super().__init__(dtype=np.dtype(np.float64), shape=(m, m))
        self.fn_name, self.product, self.matvecs = fn_name, product, 0

    def _matvec(self, v):
        self.matvecs += 1
        out = self.product(np.asarray(v, np.float64).reshape(-1))
        if not np.isfinite(out).all():
            what = f"a kernel-vector product came out NaN or Inf (max |v| = {np.abs(v).max():.3e})"
            raise bad(ValueError, self.fn_name, what, "look for float32 overflow, or use float64")
        return out

    def _adjoint(self):  # symmetric; scipy's rmatvec and .T then use _matvec
        return self


def _ntk_operator(caller: Caller, apply_fn, params, x, batch_size, precision):
    check_apply_fn(caller.name, apply_fn)
    ntk_vp = make_ntk_vp(caller, apply3_of(apply_fn), params, x, None, batch_size, precision)
    leaves, tree = jax.tree.flatten(ntk_vp.outputs)
    sizes = [math.prod(o.shape) for o in leaves]
    splits = np.cumsum(sizes)[:-1]

    def product(v):
        parts = np.split(v, splits)
        tangent = [p.reshape(o.shape).astype(o.dtype) for p, o in zip(parts, leaves, strict=True)]
        out = jax.tree.leaves(ntk_vp(jax.tree.unflatten(tree, tangent)))
        return np.concatenate([np.asarray(o, np.float64).reshape(-1) for o in out])

    def unflat(vectors):  # (M, k) -> leaves (N, O..., k)
        parts = np.split(vectors, splits)
        shaped = [p.reshape(o.shape + (-1,)) for p, o in zip(parts, leaves, strict=True)]
        return jax.tree.unflatten(tree, shaped)

    return _Operator(caller.name, sum(sizes), product), unflat


def ntk_operator(apply_fn, params, x, *, batch_size=None, precision=DEFAULTS.precision):
    """The NTK Θ(x, x) as a float64 ``scipy.sparse.linalg.LinearOperator``, never formed.

    ``op @ v`` (v of length M = N·O: outputs flattened row-major, pytree leaves concatenated)
    is Θ v by :func:`ntk_core.ntk_vp_fn` (arguments and errors as there; ValueError for a
    NaN or Inf product): one VJP and one JVP. Symmetric; ``op.matvecs`` counts products.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from ntk_core import spectrum
      >>> op = spectrum.ntk_operator(lambda w, x: x @ w, jnp.ones((3, 2)), jnp.eye(3))
      >>> op.shape, (op @ np.ones(6)).round(4).tolist()   # Θ = I_N ⊗ I_O here
      ((6, 6), [1.0, 1.0, 1.0, 1.0, 1.0, 1.0])

    References: Novak et al., "Fast Finite Width Neural Tangent Kernel", ICML 2022.
    """
    return _ntk_operator(_NTK_OPERATOR, apply_fn, params, x, batch_size, precision)[0]


def kernel_operator(kernel):
    """A formed kernel as a float64 ``LinearOperator`` ``(M, M)``, read in 64 MiB row chunks.

    ``kernel``: ``(N, N)`` or ``(N, N, O, O)`` (numpy, memmap or jax). Raises ValueError (not
    square, symmetric to 100·u·max|K|, or finite), TypeError (non-floating). Cost: 2·M²
    flops and one read of the kernel per product.

    Example:
      >>> import numpy as np
      >>> from ntk_core import spectrum
      >>> (spectrum.kernel_operator(2 * np.eye(3)) @ np.ones(3)).tolist()
      [2.0, 2.0, 2.0]
    """
    return _kernel_operator("kernel_operator", kernel)[0]


def _kernel_operator(fn_name, kernel):
    k = HostKernel(fn_name, kernel)
    k.check_symmetric()
    return _Operator(fn_name, k.m, k.matvec), k


def _check_solver_options(fn, k, which, tol, maxiter, ncv, m) -> None:
    check_int(fn, "k", k, f"pass k <= M = N·O = {m}, the kernel's size", high=m)
    if not isinstance(which, str) or which not in WHICH:
        raise must(ValueError, fn, "which", "'LA' or 'SA'", repr(which), eg="'LA'")
    opt = dict(optional=True, type_error=ValueError)
    check_real(fn, "tol", tol, "pass e.g. 1e-6 (0: machine eps)", high=1.0, type_error=ValueError)
    check_int(fn, "maxiter", maxiter, "pass None or a larger int", **opt)
    check_int(fn, "ncv", ncv, f"pass None, or k < ncv <= M = N·O = {m}", k + 1, m, **opt)


def _solve(fn, op: _Operator, dense, k, which, tol, maxiter, ncv):
    """(eigenvalues, flat eigenvectors (M, k)) in the order of ``which``, signs fixed."""
    m = op.shape[0]
    if m <= 2 * k + 1:  # Lanczos would span the whole space: solve densely
        w, v = scipy.linalg.eigh(dense(), check_finite=False)
    else:
        v0 = np.random.default_rng(SEED).standard_normal(m)
        try:
            options = dict(k=k, which=which, tol=tol, maxiter=maxiter, ncv=ncv, v0=v0)
            w, v = scipy.sparse.linalg.eigsh(op, **options)
        except scipy.sparse.linalg.ArpackNoConvergence as e:
            n, hint = len(e.eigenvalues), _SA_HINT if which == _SMALLEST else ""
            what = f"ARPACK did not converge: {n} of k={k} eigenpairs after {op.matvecs} products"
            msg = str(bad(ValueError, fn, what, f"raise maxiter, loosen tol, or raise ncv{hint}"))
            raise NoConvergence(msg, e.eigenvalues, e.eigenvectors) from None
    order = np.argsort(w)[::-1][:k] if which == _LARGEST else np.argsort(w)[:k]
    w, v = w[order], v[:, order]
    flip = v[np.argmax(np.abs(v), axis=0), np.arange(v.shape[1])] < 0
    v[:, flip] *= -1
    return np.asarray(w, np.float64), np.asarray(v, np.float64)


def ntk_eigsh(
    apply_fn,
    params,
    x,
    *,
    k: int = 20,
    which: str = _LARGEST,
    tol: float = 1e-6,
    maxiter: int | None = None,
    ncv: int | None = None,
    batch_size: int | None = None,
    precision: str = DEFAULTS.precision,
) -> Eigenpairs:
    """Top-k eigenpairs of the empirical NTK Θ(x, x) (``trace_axes=()``), matrix-free.

    ARPACK on :func:`ntk_operator` from a Gaussian start vector of seed :data:`SEED`
    (deterministic); for M <= 2k + 1, the operator formed and solved densely.

    Args:
      apply_fn, params, x, batch_size, precision: as :func:`ntk_core.ntk_vp_fn`.
      k: eigenpairs wanted, 1 <= k <= M = N·O.
      which: ``"LA"``: largest first; ``"SA"``: smallest first (converge slowly;
        :func:`condition_number` of a formed kernel is exact).
      tol: relative accuracy of the eigenvalues, >= 0 (0: machine precision).
      maxiter: most Arnoldi restarts (None: scipy's 10·M); ncv: Lanczos vectors (None:
        scipy's min(M, max(2k + 1, 20))).

    Returns :class:`Eigenpairs`; eigenvalues accurate to about u·λ_max (parameters' dtype).

    Raises TypeError, ValueError (as :func:`ntk_core.ntk_vp_fn`; k, which, tol, maxiter or
    ncv out of range; a NaN or Inf product), NoConvergence (not converged within maxiter).

    Cost: ``matvecs`` products (125 for the top 20 of an MLP 784-1000-1 at N = 500), each a
    VJP and a JVP; memory ncv·M float64.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import ntk_core
      >>> from ntk_core import spectrum
      >>> apply_fn = lambda w, x: jnp.tanh(x @ w["a"]) @ w["b"]
      >>> k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
      >>> w = {"a": jax.random.normal(k1, (4, 16)), "b": jax.random.normal(k2, (16, 1))}
      >>> x = jax.random.normal(k3, (30, 4))                   # N = 30, O = 1
      >>> top = spectrum.ntk_eigsh(apply_fn, w, x, k=3)
      >>> top.eigenvalues.shape, top.eigenvectors.shape
      ((3,), (30, 1, 3))
      >>> theta = np.asarray(ntk_core.empirical_ntk(apply_fn, w, x, trace_axes=()))
      >>> exact = np.linalg.eigvalsh(theta.reshape(30, 30).astype(np.float64))[::-1][:3]
      >>> bool(np.allclose(top.eigenvalues, exact, rtol=1e-5))
      True

    References: Lehoucq, Sorensen, Yang, "ARPACK Users' Guide", SIAM 1998.
    """
    fn = _NTK_EIGSH.name
    check_apply_fn(fn, apply_fn)
    op, unflat = _ntk_operator(_NTK_EIGSH, apply_fn, params, x, batch_size, precision)
    _check_solver_options(fn, k, which, tol, maxiter, ncv, op.shape[0])

    def dense():
        a = op @ np.eye(op.shape[0])
        return (a + a.T) / 2

    w, v = _solve(fn, op, dense, k, which, tol, maxiter, ncv)
    return Eigenpairs(w, unflat(v), op.matvecs)


def kernel_eigsh(
    kernel,
    *,
    k: int = 20,
    which: str = _LARGEST,
    tol: float = 1e-6,
    maxiter: int | None = None,
    ncv: int | None = None,
) -> Eigenpairs:
    """Top-k eigenpairs of a formed kernel read in row chunks (memory maps welcome).

    ``kernel`` as :func:`kernel_operator`; ``k, which, tol, maxiter, ncv``, the result and
    the errors as :func:`ntk_eigsh`. Cost: ``matvecs`` products of 2·M² flops.

    Example:
      >>> import numpy as np
      >>> from ntk_core import spectrum
      >>> phi = np.random.default_rng(0).standard_normal((100, 8))
      >>> kern = phi @ phi.T                                   # (N, N) = (100, 100)
      >>> top = spectrum.kernel_eigsh(kern, k=3)
      >>> exact = np.linalg.eigvalsh(kern)[::-1][:3]
      >>> bool(np.allclose(top.eigenvalues, exact, rtol=1e-10)), top.eigenvectors.shape
      (True, (100, 3))
    """
    fn = "kernel_eigsh"
    op, host = _kernel_operator(fn, kernel)
    _check_solver_options(fn, k, which, tol, maxiter, ncv, op.shape[0])
    w, v = _solve(fn, op, host.dense, k, which, tol, maxiter, ncv)
    return Eigenpairs(w, v.reshape((host.n,) + host.out_shape + (-1,)), op.matvecs)


def condition_number(kernel=None, *, eigenvalues=None) -> float:
    """λ_max / λ_min of a symmetric kernel (``inf`` when λ_min <= 0), a Python float.

    ``kernel``: ``(N, N)`` or ``(N, N, O, O)`` (all eigenvalues, dense float64, 4/3·M³ flops),
    or keyword-only ``eigenvalues``, a 1-D array. Errors as :func:`ntk_core.metrics.effective_rank`.

    Example:
      >>> import numpy as np
      >>> from ntk_core import spectrum
      >>> spectrum.condition_number(np.diag([4.0, 2.0, 1.0]))   # (N, N) = (3, 3)
      4.0
      >>> spectrum.condition_number(eigenvalues=[3.0, 0.0])
      inf

    References: Golub, Van Loan, "Matrix Computations", 4th ed., 2013, section 2.6.
    """
    w = eigenvalues_of("condition_number", kernel, eigenvalues)
    lo, hi = float(w.min()), float(w.max())
    return math.inf if lo <= 0 else hi / lo


ntk_operator = _checked_arguments(ntk_operator)
ntk_eigsh = _checked_arguments(ntk_eigsh)
kernel_operator = _checked_arguments(kernel_operator)
kernel_eigsh = _checked_arguments(kernel_eigsh)
condition_number = _checked_arguments(condition_number)
