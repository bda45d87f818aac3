"""NTK spectra without forming the kernel: ARPACK on NTK-vector products, or on a
stored Gram matrix read in row chunks. Public through :mod:`ntk_core.spectrum`.

The solver is scipy's ``eigsh`` (ARPACK's implicitly restarted Lanczos method) on a
``scipy.sparse.linalg.LinearOperator`` of size M = N·O in float64: either
:func:`ntk_core.ntk_vp_fn` (one VJP and one JVP per product, in the parameters'
dtype, converted to float64 for ARPACK) or a formed kernel streamed from memory or
a memory-mapped ``.npy`` file (:mod:`ntk_core._analysis.host_kernel`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np
import scipy.linalg
import scipy.sparse.linalg

from ntk_core._analysis.host_kernel import HostKernel, eigenvalues_of
from ntk_core._api import _get
from ntk_core._functional.ntk_vp import make_ntk_vp
from ntk_core._jax import caches as _caches
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._kernel.caller import Caller, core
from ntk_core._kernel.checks import check_apply_fn
from ntk_core._predict.linalg import bad, check_int, check_real

# The public functions of this module of (apply_fn, params, x), as their messages
# name them (ntk_core._kernel.caller).
_NTK_OPERATOR = core("ntk_operator", one_input=True)
_NTK_EIGSH = core("ntk_eigsh", one_input=True)
_NTK_TRACE = core("ntk_trace", one_input=True)

#: Valid values of ``which``: largest (``"LA"``) or smallest (``"SA"``) algebraic.
WHICH = ("LA", "SA")
#: Seed of the fixed Gaussian starting vector v0 of ARPACK.
SEED = 0
#: The fix of a ``which="SA"`` run that did not converge.
_SA_HINT = "; the smallest eigenvalues cluster near 0 and converge slowly: for a formed kernel, "
_SA_HINT += "condition_number(kernel) is exact"


class Eigenpairs(NamedTuple):
    """Extreme eigenvalues and eigenvectors of a kernel (see :func:`ntk_eigsh`).

    ``eigenvalues``: float64 ``(k,)``, largest first for ``which="LA"``, smallest first
    for ``"SA"``. ``eigenvectors``: float64, unit norm in the flat ``(N·O)`` space,
    laid out like the outputs with the pair index last: ``(N, O..., k)`` (``(N, k)``
    for ``(N, N)`` kernels; a pytree of such leaves for pytree outputs), so that
    ``eigenvectors[..., i]`` is a ``v`` for :func:`ntk_core.ntk_vp_fn`; each sign is
    fixed so that the entry of largest magnitude is positive. ``matvecs``: the number
    of operator products used.
    """

    eigenvalues: np.ndarray
    eigenvectors: Any
    matvecs: int


class NoConvergence(scipy.sparse.linalg.ArpackNoConvergence):
    """ARPACK stopped before k eigenpairs converged; a scipy
    ``ArpackNoConvergence`` whose message starts with the public function's name and
    gives the fix. ``eigenvalues`` and ``eigenvectors`` hold the converged pairs (flat).
    """

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
            fix = "look for float32 overflow in the model (scale inputs or parameters), or float64"
            raise bad(ValueError, self.fn_name, what, fix)
        return out

    def _rmatvec(self, v):
        return self._matvec(v)

    def _adjoint(self):
        return self


def _ntk_operator(caller: Caller, apply_fn, params, x, batch_size, precision):
    ntk_vp = make_ntk_vp(caller, apply_fn, params, x, batch_size, precision)
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


def ntk_operator(apply_fn, params, x, *, batch_size=None, precision="highest"):
    """The NTK Θ(x, x) as a ``scipy.sparse.linalg.LinearOperator``, never formed.

    ``op @ v`` for a float64 ``v`` of length M = N·O (the outputs flattened row-major,
    ``v.reshape(-1)`` of a ``(N, O)`` array; pytree outputs concatenated leaf by leaf in
    ``jax.tree.leaves`` order) returns Θ v in float64, from one call of
    :func:`ntk_core.ntk_vp_fn` (computed in the parameters' dtype). Hand it to any
    scipy solver that takes one: ``eigsh``, ``lobpcg``, ``cg`` (Θ + λI), ...
    Symmetric: ``op.H`` is ``op``. ``op.matvecs`` counts the products so far.

    Args:
      apply_fn, params, x, batch_size, precision: as :func:`ntk_core.ntk_vp_fn` (x with
        N samples; Θ is the N1 = N2 = N kernel with ``trace_axes=()``).

    Returns:
      A ``LinearOperator`` of shape ``(M, M)``, dtype float64.

    Raises:
      TypeError, ValueError: as :func:`ntk_core.ntk_vp_fn`; a product that comes out
        NaN or Inf.

    Cost: per product, one VJP and one JVP over the N samples (see
    :func:`ntk_core.ntk_vp_fn`) and 2·M float64 conversions.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from ntk_core import spectrum
      >>> op = spectrum.ntk_operator(lambda w, x: x @ w, jnp.ones((3, 2)), jnp.eye(3))
      >>> op.shape, (op @ np.ones(6)).round(4).tolist()   # Θ = I_N ⊗ I_O here
      ((6, 6), [1.0, 1.0, 1.0, 1.0, 1.0, 1.0])

    References:
      Lehoucq, Sorensen, Yang, "ARPACK Users' Guide", SIAM 1998 (the solver these
      operators are made for); Novak, Sohl-Dickstein, Schoenholz, "Fast Finite Width
      Neural Tangent Kernel", ICML 2022 (NTK-vector products).
    """
    return _ntk_operator(_NTK_OPERATOR, apply_fn, params, x, batch_size, precision)[0]


def kernel_operator(kernel):
    """A formed kernel as a float64 ``scipy.sparse.linalg.LinearOperator``, streamed.

    ``op @ v`` reads the kernel in row chunks of about 64 MiB of float64 (a read-only
    memory map is never loaded whole) and returns K v in float64. Rows and columns in
    the flat order of :func:`ntk_operator` (sample, then output entry).

    Args:
      kernel: ``(N, N)`` or ``(N, N, O, O)`` (output axes zipped), numpy array, memory
        map or jax array (copied to the host once), finite and symmetric.

    Returns:
      A ``LinearOperator`` of shape ``(M, M)``, M = N·O, dtype float64, with ``matvecs``.

    Raises:
      ValueError: a kernel that is not square, not symmetric (max |K − Kᵀ| above
        100·u·max |K|, u of its dtype) or not finite.
      TypeError: a non-floating kernel.

    Cost: one validation pass over the rows and one over the columns; then per product
    2·M² flops and one read of the kernel.

    Example:
      >>> import numpy as np
      >>> from ntk_core import spectrum
      >>> (spectrum.kernel_operator(2 * np.eye(3)) @ np.ones(3)).tolist()
      [2.0, 2.0, 2.0]

    References:
      Lehoucq, Sorensen, Yang, "ARPACK Users' Guide", SIAM 1998.
    """
    return _kernel_operator("kernel_operator", kernel)[0]


def _kernel_operator(fn_name, kernel):
    k = HostKernel(fn_name, "kernel", kernel)
    k.check_symmetric()

    def unflat(vectors):
        return vectors.reshape((k.n,) + k.out_shape + (-1,))

    return _Operator(fn_name, k.m, k.matvec), unflat, k


def _check_solver_options(fn, k, which, tol, maxiter, ncv, m) -> None:
    check_int(fn, "k", k, f"pass k <= M = N·O = {m}, the kernel's size", high=m)
    if not isinstance(which, str) or which not in WHICH:
        what = f"which must be one of {', '.join(map(repr, WHICH))}, got {which!r}"
        raise bad(ValueError, fn, what, "which='LA' for the largest eigenvalues, 'SA' the smallest")
    fix = "pass e.g. tol=1e-6, or 0 for machine precision"
    check_real(fn, "tol", tol, fix, high=1.0, type_error=ValueError)
    fix = "leave it None (scipy's default) or pass a larger int"
    check_int(fn, "maxiter", maxiter, fix, optional=True, type_error=ValueError)
    fix = f"leave it None (scipy's default), or k < ncv <= M = N·O = {m}"
    check_int(fn, "ncv", ncv, fix, k + 1, m, optional=True, type_error=ValueError)


def _solve(fn, op: _Operator, dense, k, which, tol, maxiter, ncv):
    """(eigenvalues, flat eigenvectors (M, k)) in the order of ``which``, signs fixed."""
    m = op.shape[0]
    if m <= 2 * k + 1:  # Lanczos would span the whole space: solve densely
        w, v = scipy.linalg.eigh(dense(), check_finite=False)
    else:
        v0 = np.random.default_rng(SEED).standard_normal(m)
        try:
            w, v = scipy.sparse.linalg.eigsh(
                op, k=k, which=which, tol=tol, maxiter=maxiter, ncv=ncv, v0=v0
            )
        except scipy.sparse.linalg.ArpackNoConvergence as e:
            what = f"ARPACK did not converge: {len(e.eigenvalues)} of the k={k} eigenpairs met "
            what += f"tol={tol} after {op.matvecs} products (maxiter={maxiter})"
            fix = (
                "raise maxiter, loosen tol, or raise ncv (Lanczos vectors, default max(2k + 1, 20))"
            )
            fix += _SA_HINT if which == "SA" else ""
            msg = f"{fn}: {what}. Fix: {fix}."
            raise NoConvergence(msg, e.eigenvalues, e.eigenvectors) from None
    order = np.argsort(w)
    order = order[::-1][:k] if which == "LA" else order[:k]
    w, v = w[order], v[:, order]
    flip = v[np.argmax(np.abs(v), axis=0), np.arange(v.shape[1])] < 0
    v[:, flip] *= -1
    return np.asarray(w, np.float64), np.asarray(v, np.float64)


_SOLVER_DOC = """k: the number of eigenpairs, 1 <= k <= M = N·O (default 20).
      which: ``"LA"`` (default): the k largest eigenvalues, largest first; ``"SA"``: the
        k smallest, smallest first. ARPACK finds the largest quickly (they are well
        separated in NTK spectra); the smallest of a kernel cluster near 0 and may need
        many restarts or not converge (:func:`condition_number` of a formed kernel is
        exact).
      tol: ARPACK's relative accuracy of the Ritz values, >= 0 (0: machine precision);
        a converged pair has residual ‖K v − λ v‖ <= tol·|λ|, so |λ − λ_true| <= tol·|λ|
        (and typically about tol²·|λ|²/gap). Default 1e-6.
      maxiter: most Arnoldi restarts (``None``: scipy's default, 10·M).
      ncv: Lanczos vectors kept (``None``: scipy's default min(M, max(2k + 1, 20))).
        More vectors, fewer products per converged pair.

    Determinism: the starting vector is fixed (a Gaussian vector of seed
    :data:`SEED`), so the same kernel gives the same products and the same result;
    eigenvector signs are fixed by their largest entry. For M <= 2k + 1 the operator
    is formed (M products, or the stored kernel) and solved densely
    (``scipy.linalg.eigh``)."""


def _doc(fn):
    if fn.__doc__:
        fn.__doc__ = fn.__doc__.replace("{solver}", _SOLVER_DOC)
    return fn


@_doc
def ntk_eigsh(
    apply_fn,
    params,
    x,
    *,
    k: int = 20,
    which: str = "LA",
    tol: float = 1e-6,
    maxiter: int | None = None,
    ncv: int | None = None,
    batch_size: int | None = None,
    precision: str = "highest",
) -> Eigenpairs:
    """Top-k eigenpairs of the empirical NTK Θ(x, x), matrix-free (never formed).

    Θ is the full ``(N·O, N·O)`` NTK (``trace_axes=()``, N1 = N2 = N), Θ v from
    :func:`ntk_core.ntk_vp_fn` (one VJP and one JVP), handed to ARPACK
    (``scipy.sparse.linalg.eigsh``) as a float64 :func:`ntk_operator`.

    Args:
      apply_fn, params, x, batch_size, precision: as :func:`ntk_core.ntk_vp_fn`.
      {solver}

    Accuracy: the products are computed in the parameters' dtype, so with float32 each
    carries round-off of about 1e-7·λ_max, which bounds the accuracy of every
    eigenvalue in absolute terms (relative error about 1e-7·λ_max/λ_i); float64
    parameters (``jax_enable_x64``) make it 1e-16·λ_max.

    Returns:
      :class:`Eigenpairs` ``(eigenvalues (k,), eigenvectors (N, O..., k), matvecs)``,
      float64 numpy arrays.

    Raises:
      TypeError, ValueError: as :func:`ntk_core.ntk_vp_fn`; k outside [1, M], which not
        ``"LA"``/``"SA"``, tol outside [0, 1), bad maxiter or ncv; a product that comes
        out NaN or Inf.
      NoConvergence: no convergence within maxiter (a scipy ArpackNoConvergence; the
        message gives the fix; ``.eigenvalues`` holds the converged ones).

    Cost: ``matvecs`` products, each one VJP and one JVP over the N samples (about 4
    forward passes of FLOPs; 3 unbatched). Measured: the top 20 of the MLP 784-1000-1
    NTK took 125 products at N = 500 and 141 at N = 2000 (ncv = 41;
    ``benchmarks/bench_spectrum.py``), the top 5 of a small tanh MLP 21. Memory: the
    model's passes on one batch, P for u, and ARPACK's ncv·M float64 vectors; never the
    N·O x N·O kernel.

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

    References:
      Lehoucq, Sorensen, Yang, "ARPACK Users' Guide", SIAM 1998; Novak,
      Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
    """
    fn = _NTK_EIGSH.name
    check_apply_fn(fn, apply_fn)
    op, unflat = _ntk_operator(_NTK_EIGSH, apply_fn, params, x, batch_size, precision)
    _check_solver_options(fn, k, which, tol, maxiter, ncv, op.shape[0])
    w, v = _solve(fn, op, lambda: _symmetric(op @ np.eye(op.shape[0])), k, which, tol, maxiter, ncv)
    return Eigenpairs(w, unflat(v), op.matvecs)


def _symmetric(a: np.ndarray) -> np.ndarray:
    return (a + a.T) / 2


@_doc
def kernel_eigsh(
    kernel,
    *,
    k: int = 20,
    which: str = "LA",
    tol: float = 1e-6,
    maxiter: int | None = None,
    ncv: int | None = None,
) -> Eigenpairs:
    """Top-k eigenpairs of a formed kernel, read in row chunks (memory maps welcome).

    The kernel as a float64 :func:`kernel_operator` handed to ARPACK
    (``scipy.sparse.linalg.eigsh``): each product reads the kernel once in chunks of
    about 64 MiB, so a 10 GB ``np.load(path, mmap_mode="r")`` kernel is never loaded.

    Args:
      kernel: ``(N, N)`` or ``(N, N, O, O)`` (output axes zipped; the ``(N·O, N·O)``
        matrix, rows ordered sample then output), numpy array, memory map or jax array
        (copied to the host once); finite and symmetric.
      {solver}

    Returns:
      :class:`Eigenpairs` ``(eigenvalues (k,), eigenvectors (N, k) or (N, O..., k),
      matvecs)``, float64.

    Raises:
      ValueError: a kernel that is not square, not symmetric (to 100·u·max|K|) or not
        finite; k, which, tol, maxiter or ncv out of range (as :func:`ntk_eigsh`).
      TypeError: a non-floating kernel, k not an int.
      NoConvergence: as :func:`ntk_eigsh`.

    Cost: one validation pass over rows and columns, then ``matvecs`` products of 2·M²
    flops each, every one a read of the kernel; memory one row chunk and ncv·M float64.

    Example:
      >>> import numpy as np
      >>> from ntk_core import spectrum
      >>> phi = np.random.default_rng(0).standard_normal((100, 8))
      >>> kern = phi @ phi.T                                   # (N, N) = (100, 100)
      >>> top = spectrum.kernel_eigsh(kern, k=3)
      >>> exact = np.linalg.eigvalsh(kern)[::-1][:3]
      >>> bool(np.allclose(top.eigenvalues, exact, rtol=1e-10)), top.eigenvectors.shape
      (True, (100, 3))

    References:
      Lehoucq, Sorensen, Yang, "ARPACK Users' Guide", SIAM 1998.
    """
    fn = "kernel_eigsh"
    op, unflat, host = _kernel_operator(fn, kernel)
    _check_solver_options(fn, k, which, tol, maxiter, ncv, op.shape[0])
    w, v = _solve(fn, op, host.dense, k, which, tol, maxiter, ncv)
    return Eigenpairs(w, unflat(v), op.matvecs)


@_caches.lru_cache(maxsize=64)
def _flattened(apply_fn):
    """``apply_fn`` with its output leaves flattened to ``(N, O_l)`` and concatenated
    (cached, so the kernel function behind :func:`ntk_trace` is reused)."""

    def apply(params, x):
        leaves = jax.tree.leaves(apply_fn(params, x))
        flat = [leaf.reshape(leaf.shape[0], -1) for leaf in leaves]
        return flat[0] if len(flat) == 1 else jax.numpy.concatenate(flat, axis=1)

    return apply


def ntk_trace(
    apply_fn, params, x, *, batch_size=None, implementation="auto", precision="highest"
) -> float:
    """tr Θ(x, x) of the full ``(N·O, N·O)`` NTK from its diagonal, at O(N) cost.

        tr Θ = Σ_i Σ_a Θ[i, i, a, a] = Σ_i Σ_a ‖∂f_a(x_i)/∂θ‖²

    the sum of all eigenvalues. Computed by :func:`ntk_core.empirical_ntk` with
    ``trace_axes=()`` and every axis diagonal (the per-sample, per-output diagonal,
    ``(N, O)``, no averaging), on the outputs flattened per sample and concatenated
    over output leaves; with the kernel's default ``vmap_axes=0`` (samples independent).

    Args:
      apply_fn, params, x: as :func:`ntk_core.ntk_vp_fn` (x with N samples, i.e. the
        N1 = N2 = N kernel).
      batch_size, implementation, precision: as :func:`ntk_core.empirical_ntk`
        (:mod:`ntk_core._kernel.options`).

    Returns:
      tr Θ as a Python float (summed in float64).

    Raises:
      TypeError, ValueError: as :func:`ntk_core.empirical_ntk` (messages name
        ``ntk_trace``).

    Cost: the per-sample diagonal: N·O entries, the per-sample derivatives of each
    sample once (e.g. ``"jacobian"``: N·O reverse passes, memory of one batch's
    Jacobians); no pair of distinct samples.

    Example:
      >>> import jax.numpy as jnp
      >>> from ntk_core import spectrum
      >>> spectrum.ntk_trace(lambda w, x: x @ w, jnp.ones((3, 2)), jnp.eye(3))  # Σ ‖x_i‖²·O
      6.0

    References:
      Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018 (tr Θ = Σ_i
      tr Θ(x_i, x_i), the sum of the per-sample diagonal blocks).
    """
    fn = _NTK_TRACE.name
    check_apply_fn(fn, apply_fn)
    try:
        flat = _flattened(apply_fn)
    except TypeError:  # unhashable callable
        flat = _flattened.__wrapped__(apply_fn)
    options = dict(
        trace_axes=(),
        diagonal_axes=(0, 1),
        implementation=implementation,
        precision=precision,
        batch_size=batch_size,
        progress=False,
    )
    diag = _get("ntk", _NTK_TRACE, flat, options)(params, x, None)
    return float(np.sum(np.asarray(diag, np.float64)))


def condition_number(kernel=None, *, eigenvalues=None) -> float:
    """Condition number λ_max / λ_min of a symmetric kernel (2-norm, for PSD kernels).

    From all eigenvalues of a formed kernel (dense, float64), or from ``eigenvalues``
    you give. λ_min <= 0 gives ``inf`` (singular: an empirical NTK with N·O > P has
    rank at most P). Values above about 1/u of the kernel's dtype (float32: 1.7e7) are
    not meaningful: the kernel's own round-off, u·λ_max, then exceeds λ_min. Top-k
    eigenvalues from :func:`ntk_eigsh` give λ_1/λ_k only, a lower bound; with
    ``which="SA"`` the smallest converge slowly (see :func:`ntk_eigsh`).

    Args:
      kernel: ``(N, N)`` or ``(N, N, O, O)`` (output axes zipped; numpy, memory map or
        jax array), finite and symmetric.
      eigenvalues: instead of ``kernel`` (keyword-only): a 1-D array of eigenvalues.

    Returns:
      λ_max / λ_min as a Python float (``inf`` when λ_min <= 0).

    Raises:
      TypeError: both or neither of kernel and eigenvalues given; non-floating kernel.
      ValueError: kernel not square, not symmetric or 1-D (a per-sample diagonal, or
        eigenvalues passed positionally); NaN or Inf; eigenvalues not 1-D or complex.

    Cost: with ``kernel``, one float64 eigenvalue decomposition of the ``(M, M)``
    matrix (M = N·O): about 4/3·M³ flops and 8·M² bytes.

    Example:
      >>> import numpy as np
      >>> from ntk_core import spectrum
      >>> spectrum.condition_number(np.diag([4.0, 2.0, 1.0]))   # (N, N) = (3, 3)
      4.0
      >>> spectrum.condition_number(eigenvalues=[3.0, 0.0])
      inf

    References:
      Golub and Van Loan, "Matrix Computations", 4th ed., 2013, section 2.6 (the
      2-norm condition number of a symmetric positive definite matrix).
    """
    w = eigenvalues_of("condition_number", kernel, eigenvalues)
    lo, hi = float(w.min()), float(w.max())
    return math.inf if lo <= 0 else hi / lo


ntk_operator = _checked_arguments(ntk_operator)
ntk_eigsh = _checked_arguments(ntk_eigsh)
ntk_trace = _checked_arguments(ntk_trace)
kernel_operator = _checked_arguments(kernel_operator)
kernel_eigsh = _checked_arguments(kernel_eigsh)
condition_number = _checked_arguments(condition_number)
