"""Statistics of Θ(X, X) without forming it: Hutch++ / stochastic Lanczos estimates with a
standard error from NTK-vector products (the exact trace: ``ntk_core.spectrum.ntk_trace``).

Θ is the flat ``(M, M)`` kernel, M = N·O, of ``ntk_fn(..., trace_axes=())`` on x = x1 = x2
(entries Θ[i·O + a, j·O + b] = Θ[i, j, a, b]; several output leaves are concatenated per
sample), as :mod:`ntk_core.metrics` reads an ``(N, N, O, O)`` kernel. Each statistic is an
:class:`Estimate`; ``products`` counts NTK-vector products (one VJP and one JVP over the N
samples, :func:`ntk_core.ntk_vp_fn`). With ``m >= M`` the estimates form Θ from M products
and are exact (standard error 0). ``wrt=``: the statistics of Θ_S, the kernel of a parameter
subset (:mod:`ntk_core._kernel.subset`), at the cost of the subset's products. The adapters
reach them through :func:`kernel_model` (``ntk_core.adapters.matrix_free``).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from ntk_core._errors import bad, check_int
from ntk_core._functional.ntk_vp import _product, apply3_of, make_ntk_vp
from ntk_core._impl.base import EXACT_CPU_OPTIONS, jit_tuned
from ntk_core._jax import caches as _caches
from ntk_core._kernel import subset as _subset
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._kernel.caller import Caller, core
from ntk_core._kernel.checks import check_apply_fn, params_check
from ntk_core._kernel.engine import Engine
from ntk_core._kernel.function import KernelFunction
from ntk_core._kernel.model import flat_outputs
from ntk_core._kernel.options import DEFAULTS, make_options, refuse_options
from ntk_core._kernel.pipeline import Kind, Spec
from ntk_core._predict.linalg import check_finite, check_key, real_array

_COLUMNS = 16  # vectors per vmapped NTK-vector product
_NAN_FIX = "check the model: its outputs or gradients are NaN or Inf at these params and x"
_TARGETS_FIX = "pass targets shaped like apply_fn(params, x)"


class Estimate(NamedTuple):
    """One statistic: its ``estimate``, its ``standard_error`` (0.0 when exact) and the
    number of NTK-vector ``products`` it cost."""

    estimate: float
    standard_error: float
    products: int


class Model(NamedTuple):
    """The model whose Θ(x, x) the statistics read: ``apply3(params, x, aux)``, ``params``
    differentiated (with ``wrt``: the subset, the held leaves in ``aux``), ``check`` an
    adapter's ``check(params, x, None, aux)`` or None; messages name ``caller``."""

    caller: Caller
    apply3: Callable
    params: object
    x: object
    aux: object
    check: Callable | None = None


def core_model(fn: str, apply_fn, params, x, wrt) -> Model:
    """The :class:`Model` of a core statistic's ``(apply_fn, params, x, wrt=)``; ``wrt``
    splits ``params`` as the kernels do (:mod:`ntk_core._kernel.subset`)."""
    check_apply_fn(fn, apply_fn)
    wrt = make_options(fn, wrt=wrt).wrt
    check = params_check(fn, apply_fn)  # a Flax model.apply given more than params
    model = Model(core(fn, one_input=True), apply3_of(apply_fn), params, x, None, check)
    if wrt is None:
        return model
    selected, aux = _subset.split(fn, wrt, params, None, {})  # aux: (None, held leaves)
    check = check and _subset.OnSubset(check)
    return Model(model.caller, _subset.OnSubset(model.apply3), selected, x, aux, check)


def kernel_model(kernel, first, x, keywords: dict) -> Model:
    """The :class:`Model` of a kernel function of the NTK (``ntk_fn``, an adapter's
    ``kernel_fn``) called as ``kernel(first, x, **keywords)``: its parameters, fixed parts
    and subset (its ``wrt``), as its call would differentiate them."""
    engine = kernel._engine
    params, aux = engine._split(*kernel._bind(first, x, keywords))
    spec = engine.spec
    return Model(spec.caller or core(spec.fn_name, one_input=True), spec.apply3, params, x, aux,
                 spec.check)  # fmt: skip


class _Flat(NamedTuple):
    """Θ as a map on flat float64 vectors of length ``m`` = M (host numpy)."""

    fn: str
    model: Model
    outputs: object  # jax.ShapeDtypeStruct pytree
    m: int
    product: Callable  # (M, c) -> (M, c): Θ times each column
    ravel: Callable  # outputs-like pytree -> (M,)


@_caches.lru_cache(maxsize=64)
def _columns(apply3, precision: str, batch_size: int | None, tree, leaves) -> Callable:
    """Jitted Θ V for the rows of V ``(c, M)``: ``ntk_vp_fn``'s product, vmapped (outputs:
    ``ShapeDtypeStruct`` ``leaves`` of ``tree``)."""
    single = _product.__wrapped__(apply3, precision, batch_size)
    zeros = jax.tree.unflatten(tree, [jnp.zeros(o.shape, o.dtype) for o in leaves])
    unravel = ravel_pytree(zeros)[1]

    def one(params, x, aux, v):
        out = single(params, x, aux, unravel(v))
        return jnp.concatenate([a.reshape(-1) for a in jax.tree.leaves(out)])

    return jit_tuned(jax.vmap(one, in_axes=(None, None, None, 0)), EXACT_CPU_OPTIONS)


def _flat(model: Model, batch_size, precision) -> _Flat:
    """Checks the arguments (as ``ntk_vp_fn``) and returns Θ on flat vectors (leaf by leaf,
    each row-major: i·O + a for one output array; the statistics do not depend on it)."""
    fn = model.caller.name
    ntk_vp = make_ntk_vp(model.caller, *model[1:5], batch_size, precision, model.check)
    params, x, aux = ntk_vp.arguments
    outputs = ntk_vp.outputs
    leaves, tree = jax.tree.flatten(outputs)
    args = (model.apply3, precision, batch_size, tree, tuple(leaves))
    try:
        columns = _columns(*args)
    except TypeError:  # unhashable apply3
        columns = _columns.__wrapped__(*args)
    size = sum(math.prod(o.shape) for o in leaves)
    dtype = jnp.result_type(*(o.dtype for o in leaves))

    def ravel(tree) -> np.ndarray:
        leaves = jax.tree.leaves(tree)
        return np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in leaves])

    def product(v: np.ndarray) -> np.ndarray:
        c = v.shape[1]
        rows = np.zeros((-(-c // _COLUMNS) * _COLUMNS, size), dtype)  # one compiled shape
        rows[:c] = v.T
        parts = [columns(params, x, aux, rows[i : i + _COLUMNS]) for i in range(0, c, _COLUMNS)]
        out = np.concatenate([np.asarray(a) for a in parts])[:c]
        check_finite(fn, "an NTK-vector product Θ v", out, _NAN_FIX, unit="vector")
        return out.T.astype(np.float64)

    checked = model._replace(params=params, x=x, aux=aux)
    return _Flat(fn, checked, outputs, size, product, ravel)


def check_m(fn: str, m, low: int = 4, example: int = 60) -> int:
    """``m`` NTK-vector products, an int >= ``low``."""
    return check_int(fn, "m", m, f"pass e.g. m={max(low, example)} (products Θ v)", low)


def check_steps(fn: str, steps) -> int:
    """``steps`` Lanczos steps per vector, a positive int."""
    return check_int(fn, "steps", steps, "pass e.g. steps=15 (Lanczos steps per vector)")


def _exact_kernel(op: _Flat) -> np.ndarray:
    """Θ from M products with the unit vectors, symmetrised (round-off)."""
    theta = op.product(np.eye(op.m))
    return (theta + theta.T) / 2


def model_trace(model: Model, batch_size, implementation, precision) -> float:
    """tr Θ of ``model`` exact, as :func:`ntk_trace` (the kernel's diagonal, O(N), summed in
    float64); errors name ``model.caller``."""
    fn, apply3 = model.caller.name, flat_outputs(model.apply3)
    options = make_options(fn, trace_axes=(), diagonal_axes=(0, 1), progress=False,
                           batch_size=batch_size, implementation=implementation,
                           precision=precision)  # fmt: skip

    def build():
        return Engine(Spec(fn, Kind.NTK, apply3, options, model.check, caller=model.caller))

    engine = _caches.cached(("matrix_free.trace", model.caller, apply3, options), build)
    diag = engine(model.params, model.x, None, model.aux)
    return float(np.sum(np.asarray(diag, np.float64)))


def _trace(op: _Flat, batch_size, precision) -> float:
    """tr Θ of ``op`` exact (:func:`model_trace`)."""
    return model_trace(op.model, batch_size, DEFAULTS.implementation, precision)


def _hutchpp(op: _Flat, m: int, key) -> Estimate:
    """Hutch++ for tr(Θ²) = ‖Θ‖²_F with ``m`` products (``m >= M``: exact)."""
    if m >= op.m:
        theta = _exact_kernel(op)
        return Estimate(float(np.vdot(theta, theta)), 0.0, op.m)
    k = m // 3
    probes = m - 2 * k
    k_sketch, k_probe = jax.random.split(key)
    s = np.asarray(jax.random.normal(k_sketch, (op.m, k)), np.float64)
    q, _ = np.linalg.qr(op.product(s))  # (M, k): the sketch of Θ's top range
    head = float(np.sum(np.square(op.product(q))))  # tr(Qᵀ Θ² Q)
    g = np.asarray(jax.random.rademacher(k_probe, (op.m, probes)), np.float64)
    g -= q @ (q.T @ g)  # (I − Q Qᵀ) g
    z = np.sum(np.square(op.product(g)), axis=0)  # gᵀ (I−P) Θ² (I−P) g, one per probe
    se = float(np.std(z, ddof=1) / math.sqrt(probes))
    return Estimate(head + float(np.mean(z)), se, 2 * k + probes)


def ntk_frobenius_sq(
    apply_fn: Callable,
    params,
    x,
    *,
    key,
    m: int = 60,
    batch_size: int | None = None,
    precision: str = DEFAULTS.precision,
    wrt=DEFAULTS.wrt,
) -> Estimate:
    """‖Θ‖²_F = tr(Θ²) of Θ(x, x) by Hutch++ on NTK-vector products, unbiased.

    Hutch++ with k = m // 3: Q = orth(Θ S), S ``(M, k)`` Gaussian; then

        ‖Θ‖²_F ≈ ‖Θ Q‖²_F + (1/l) Σ_j ‖Θ (I − Q Qᵀ) g_j‖²,   l = m − 2k Rademacher g_j

    (the first term exact given Q, the second Hutchinson's estimate of the rest, whose mean
    given Q is the rest exactly, so the estimate is unbiased). standard_error: the l terms'
    sample standard deviation / √l (the whole error, as the mean given Q is exact).
    ``m >= M`` (= N·O): Θ from M products, exact. Products: m (or M).

    Args:
      apply_fn, params, x, batch_size, precision: as :func:`ntk_core.ntk_vp_fn`
        (outputs ``(N, O...)``, M = N·O).
      key: a JAX PRNG key (seeded, reproducible); m: the number of products, an int >= 4.
      wrt: a parameter subset, as in :func:`ntk_core.ntk_fn`: the statistic of its kernel
        Θ_S (P below is the subset's size); ``None`` (default): all parameters.

    Returns an :class:`Estimate` of ‖Θ‖²_F (float64 on the host). Raises TypeError (key not
    a JAX key, m not an int) and ValueError (m < 4), besides :func:`ntk_core.ntk_vp_fn`'s.
    Cost: m NTK-vector products (each about 4 forward passes over N), memory M·m/3 floats.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from ntk_core import spectrum
      >>> f = lambda w, x: x @ w                                   # Θ = x xᵀ ⊗ I_O
      >>> x = jnp.array([[1.0, 2.0], [3.0, 0.0]])                  # N = 2, O = 3, M = 6
      >>> r = spectrum.ntk_frobenius_sq(f, jnp.zeros((2, 3)), x, key=jax.random.PRNGKey(0))
      >>> round(r.estimate, 3), r.standard_error, r.products       # m >= M: exact
      (372.0, 0.0, 6)

    References: Meyer, Musco, Musco, Woodruff, "Hutch++: Optimal Stochastic Trace
    Estimation", SOSA 2021 (algorithm 1, on A = Θ², sketch Θ S).
    """
    fn = "ntk_frobenius_sq"
    model_of = lambda: core_model(fn, apply_fn, params, x, wrt)  # noqa: E731
    return frobenius_sq(fn, model_of, key, m, batch_size, precision)


def frobenius_sq(fn: str, model_of: Callable[[], Model], key, m, batch_size, precision):
    """:func:`ntk_frobenius_sq` of ``model_of()`` (built after the arguments' checks)."""
    m = check_m(fn, m)
    key = check_key(fn, key)
    return _hutchpp(_flat(model_of(), batch_size, precision), m, key)


def _lanczos_entropy(op: _Flat, z: np.ndarray, steps: int, total: float) -> np.ndarray:
    """zᵀ(−P log P)z per column z of ``z`` ``(M, c)`` by Lanczos quadrature, P = Θ / total:
    ``steps`` steps, all columns at once, full reorthogonalisation (twice)."""
    norms = np.linalg.norm(z, axis=0)
    basis, alphas, betas = [z / norms], [], []
    for j in range(steps):
        w = op.product(basis[j])
        alphas.append(np.sum(basis[j] * w, axis=0))
        for _ in range(2):
            for b in basis:
                w -= b * np.sum(b * w, axis=0)
        if j == steps - 1:
            break
        beta = np.linalg.norm(w, axis=0)
        beta = np.where(beta > 1e-10 * np.max(np.abs(alphas), axis=0), beta, 0.0)  # exhausted
        betas.append(beta)
        basis.append(np.divide(w, beta, out=np.zeros_like(w), where=beta > 0))
    a, b = np.array(alphas).T, np.array(betas).T.reshape(z.shape[1], -1)  # (c, steps(-1))
    t = np.zeros((z.shape[1], len(alphas), len(alphas)))
    i = np.arange(len(alphas))
    t[:, i, i] = a
    t[:, i[:-1], i[1:]] = t[:, i[1:], i[:-1]] = b
    theta, u = np.linalg.eigh(t)
    p = np.abs(theta) / total
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    return -(norms**2) * np.sum(u[:, 0, :] ** 2 * plogp, axis=1)


def ntk_effective_rank(
    apply_fn: Callable,
    params,
    x,
    *,
    key,
    m: int = 400,
    steps: int = 15,
    batch_size: int | None = None,
    precision: str = DEFAULTS.precision,
    wrt=DEFAULTS.wrt,
) -> Estimate:
    """The effective rank of :func:`ntk_core.metrics.effective_rank` of Θ(x, x), estimated.

        erank = exp(H),  H = −Σ_i p_i log p_i = tr(−P log P),  p_i = λ_i / tr Θ, P = Θ / tr Θ

    tr Θ exact (:func:`ntk_core.spectrum.ntk_trace`); H by stochastic Lanczos quadrature
    (SLQ), deflated as in Hutch++: with k = m // (1 + 2·steps), Q = orth(Θ S) (S ``(M, k)``
    Gaussian) and k Rademacher g_j,

        H ≈ Σ_i q_iᵀ(−P log P)q_i + (1/k) Σ_j h_j,   h_j = z_jᵀ(−P log P)z_j, z_j = (I − QQᵀ)g_j

    each quadratic form from ``steps`` Lanczos steps on Θ (Gauss quadrature). standard_error:
    exp(H)·s_H (delta method), s_H the h_j's sample standard deviation / √k; it omits the
    quadrature error (falls with ``steps``, nil at ``steps >= M``; measured +0.4 standard
    errors at steps = 8 on a 192-row MLP kernel) and exp's Jensen bias (≈ exp(H)·s_H²/2).
    ``m >= M``: the exact eigenvalues of Θ formed from M products.

    Args:
      apply_fn, params, x, batch_size, precision: as :func:`ntk_core.ntk_vp_fn`; wrt: as
        :func:`ntk_frobenius_sq` (the subset's kernel, its trace too).
      key: a JAX PRNG key; m: products in all, an int >= 8·(1 + 2·steps) (k >= 8);
      steps: Lanczos steps per vector (int >= 1, capped at M).

    Returns an :class:`Estimate` (float64; products k·(1 + 2·steps)). Raises TypeError (key,
    m or steps of the wrong type), ValueError (m too small, steps < 1; samples that
    interact), besides :func:`ntk_core.ntk_vp_fn`'s. Cost: m products plus the exact trace
    (the kernel's diagonal: N per-sample Jacobians); memory 2·k·steps·M floats.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from ntk_core import spectrum
      >>> f = lambda w, x: x @ w                                   # Θ = x xᵀ ⊗ I_O
      >>> x = jnp.eye(2)                                           # Θ = I_6
      >>> r = spectrum.ntk_effective_rank(f, jnp.zeros((2, 3)), x, key=jax.random.PRNGKey(0))
      >>> round(r.estimate, 6), r.products
      (6.0, 6)

    References: Ubaru, Chen, Saad, "Fast Estimation of tr(f(A)) via Stochastic Lanczos
    Quadrature", SIAM J. Matrix Anal. Appl. 38(4), 2017; Roy, Vetterli, "The effective
    rank", EUSIPCO 2007; Meyer et al., "Hutch++", SOSA 2021.
    """
    fn = "ntk_effective_rank"
    model_of = lambda: core_model(fn, apply_fn, params, x, wrt)  # noqa: E731
    return effective_rank(fn, model_of, key, m, steps, batch_size, precision)


def effective_rank(fn: str, model_of: Callable[[], Model], key, m, steps, batch_size, precision):
    """:func:`ntk_effective_rank` of ``model_of()`` (built after the arguments' checks)."""
    steps = check_steps(fn, steps)
    key = check_key(fn, key)
    op = _flat(model_of(), batch_size, precision)
    return _effective_rank(op, key, m, steps, lambda: _trace(op, batch_size, precision))


#: Fewest probes k of the effective rank (m >= k·(1 + 2·steps)): on the 192-row MLP kernel
#: of tests/core/test_matrix_free.py, steps = 8, 40 seeds, k = 2 / 4 / 6 / 8 gave a bias of
#: +20 / +17 / +5 / +6 % and |error| > 2 standard errors in 28 / 15 / 10 / 5 % of seeds.
MIN_RANK_PROBES = 8


def min_rank_products(steps: int, size: int) -> int:
    """The fewest products m of the effective rank with ``steps`` Lanczos steps on a kernel
    of ``size`` = N·O rows (at m >= size it is exact)."""
    return min(MIN_RANK_PROBES * (1 + 2 * min(steps, size)), size)


def check_tracked_m(fn: str, m, steps: int, n: int, rows=None, *, late=False) -> int:
    """``m`` of matrix-free tracking (``KernelTracker(m=)``) on ``n`` probe samples: at least
    :func:`min_rank_products` of the kernel's ``rows`` = N·O. Without ``rows`` (O is known
    only from the model's outputs, at the first update, unless y gives it) the bound for
    O = 1 is checked, and the error's fix is the m that suffices for any O; ``late``: the
    update's check, once the model's outputs give O."""
    cap = MIN_RANK_PROBES * (1 + 2 * steps)  # the fewest products once N·O >= cap
    low = min_rank_products(steps, n if rows is None else rows)
    if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m >= low or low < 4:
        return check_m(fn, m, max(4, low), example=max(400, cap))  # Hutch++ needs 4 anyway
    size = f"{n}·O" if rows is None else f"{n}·{rows // n}"  # N probe samples, O outputs
    what = f"m must be an int >= {low}, got {m}: the effective rank with steps={steps} takes "
    what += f"min({MIN_RANK_PROBES}·(1 + 2·steps), N·O) = min({cap}, {size}) NTK-vector products"
    fix = f"pass m >= {low}, or fewer steps"
    if late:  # the constructor passed it: say why only now
        what += f"; O is known only now, the constructor could check m >= {min(cap, n)} only"
    if rows is None and n < cap:  # the minimum grows with O, unknown before the first update
        what += ", O (outputs per sample) being known only at the first update"
        fix = f"pass m >= {cap} (enough for any O), or fewer steps"
    raise bad(ValueError, fn, what, fix)


def _effective_rank(op: _Flat, key, m, steps: int, trace: Callable[[], float]) -> Estimate:
    """SLQ of :func:`ntk_effective_rank` on ``op``; ``trace()``: tr Θ exact (when needed)."""
    steps = min(steps, op.m)
    m = check_m(op.fn, m, low=min_rank_products(steps, op.m), example=400)
    if m >= op.m:
        lam = np.abs(np.linalg.eigvalsh(_exact_kernel(op)))
        p = lam[lam > 0] / lam.sum()
        return Estimate(math.exp(-float(np.sum(p * np.log(p)))), 0.0, op.m)
    total = trace()
    k = m // (1 + 2 * steps)  # sketch columns = residual probes
    k_sketch, k_probe = jax.random.split(key)
    q, _ = np.linalg.qr(op.product(np.asarray(jax.random.normal(k_sketch, (op.m, k)), np.float64)))
    g = np.asarray(jax.random.rademacher(k_probe, (op.m, k)), np.float64)
    g -= q @ (q.T @ g)  # (I − Q Qᵀ) g
    h = _lanczos_entropy(op, np.concatenate([q, g], axis=1), steps, total)
    erank = math.exp(float(np.sum(h[:k]) + np.mean(h[k:])))
    se = erank * float(np.std(h[k:], ddof=1)) / math.sqrt(k)
    return Estimate(erank, se, k + 2 * k * steps)


def ntk_kernel_alignment(
    apply_fn: Callable,
    params,
    x,
    y,
    *,
    key,
    m: int = 60,
    batch_size: int | None = None,
    precision: str = DEFAULTS.precision,
    wrt=DEFAULTS.wrt,
) -> Estimate:
    """Kernel-target alignment of :func:`ntk_core.metrics.kernel_alignment` of Θ(x, x), estimated.

        A = ⟨y, Θ y⟩ / (‖Θ‖_F ‖y‖²)      (y flat, length M = N·O)

    ⟨y, Θ y⟩ exact from one product; ‖Θ‖²_F by :func:`ntk_frobenius_sq` with m − 1 products
    (estimate F, standard error s_F); ``m >= M``: both from Θ formed, exact. standard_error:
    A·s_F / (2F) (delta method on F^(−1/2)); A = c/√F is biased at second order, by about
    (3/8)·A·(s_F/F)².

    Args:
      apply_fn, params, x, key, batch_size, precision, wrt: as :func:`ntk_frobenius_sq`.
      y: real targets shaped like the outputs ``(N, O...)`` (a pytree for pytree outputs).
      m: products in all, an int >= 5.

    Returns an :class:`Estimate` (float64). Raises TypeError (key not a JAX key; y not
    numeric or of another structure), ValueError (y's shape, NaN or Inf, all zeros; m < 5),
    besides :func:`ntk_core.ntk_vp_fn`'s. Cost: m products.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from ntk_core import spectrum
      >>> f = lambda w, x: x @ w                                   # Θ = x xᵀ ⊗ I_O
      >>> x, y = jnp.eye(2), jnp.ones((2, 3))                      # Θ = I_6: A = 6/(√6·6)
      >>> r = spectrum.ntk_kernel_alignment(f, jnp.zeros((2, 3)), x, y, key=jax.random.PRNGKey(0))
      >>> round(r.estimate, 6), r.products
      (0.408248, 6)

    References: Cristianini et al., "On Kernel-Target Alignment", NIPS 2001; Meyer et al.,
    "Hutch++", SOSA 2021.
    """
    fn = "ntk_kernel_alignment"
    model_of = lambda: core_model(fn, apply_fn, params, x, wrt)  # noqa: E731
    return kernel_alignment(fn, model_of, y, key, m, batch_size, precision)


def kernel_alignment(fn: str, model_of: Callable[[], Model], y, key, m, batch_size, precision):
    """:func:`ntk_kernel_alignment` of ``model_of()`` (built after the arguments' checks)."""
    m = check_m(fn, m, low=5)
    key = check_key(fn, key)
    op = _flat(model_of(), batch_size, precision)
    v = _targets(fn, op, y)
    if m >= op.m:  # Θ from M products, exact (c read from it: no product more)
        theta = _exact_kernel(op)
        return _alignment(op, v, lambda: Estimate(float(np.vdot(theta, theta)), 0.0, op.m), theta)
    return _alignment(op, v, lambda: _hutchpp(op, m - 1, key))


def _alignment(op: _Flat, v: np.ndarray, frobenius: Callable[[], Estimate], theta=None):
    """A = ⟨v, Θ v⟩ / (√F ‖v‖²) from one product (or ``theta``, Θ formed) and ``frobenius()``,
    F's :class:`Estimate`."""
    c = float(v @ (op.product(v[:, None])[:, 0] if theta is None else theta @ v)) / float(v @ v)
    f = frobenius()
    if f.estimate <= 0.0:
        raise bad(ValueError, op.fn, "the kernel is all zeros", "pass a model that uses its params")
    a = c / math.sqrt(f.estimate)
    return Estimate(a, abs(a) * f.standard_error / (2 * f.estimate), f.products + (theta is None))


def _targets(fn: str, op: _Flat, y) -> np.ndarray:
    """``y`` as the flat float64 vector of length M, checked against the outputs."""
    leaves, tree = jax.tree.flatten(op.outputs)
    y_leaves, y_tree = jax.tree.flatten(y)
    if y_tree != tree:
        what = f"y has the pytree structure {y_tree}; expected the outputs' {tree}"
        raise bad(TypeError, fn, what, _TARGETS_FIX)
    for o, t in zip(leaves, y_leaves, strict=True):
        arr = real_array(fn, "y", t)
        if arr.shape != tuple(o.shape):
            what = f"y has shape {arr.shape}; expected the outputs' shape {tuple(o.shape)}"
            raise bad(ValueError, fn, what, _TARGETS_FIX)
    v = op.ravel(jax.tree.unflatten(tree, y_leaves))
    if not v.any():
        raise bad(ValueError, fn, "y is all zeros", "pass non-zero targets")
    return v


ntk_frobenius_sq = _checked_arguments(ntk_frobenius_sq)
ntk_effective_rank = _checked_arguments(ntk_effective_rank)
ntk_kernel_alignment = _checked_arguments(ntk_kernel_alignment)


def ntk_trace(
    apply_fn,
    params,
    x,
    *,
    batch_size=None,
    implementation=DEFAULTS.implementation,
    precision=DEFAULTS.precision,
    wrt=DEFAULTS.wrt,
) -> float:
    """tr Θ(x, x) = Σ_i Σ_a ‖∂f_a(x_i)/∂θ‖² (the eigenvalue sum), a Python float, at O(N) cost.

    The diagonal of :func:`ntk_core.empirical_ntk` (``trace_axes=()``, ``diagonal_axes=(0,
    1)``) summed in float64; arguments and errors as there (``apply_fn, params, x``).

    Example:
      >>> import jax.numpy as jnp
      >>> from ntk_core import spectrum
      >>> spectrum.ntk_trace(lambda w, x: x @ w, jnp.ones((3, 2)), jnp.eye(3))  # Σ ‖x_i‖²·O
      6.0

    References: Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018.
    """
    model = core_model("ntk_trace", apply_fn, params, x, wrt)
    return model_trace(model, batch_size, implementation, precision)


ntk_trace = _checked_arguments(ntk_trace)


#: The statistics an adapter reaches through :func:`of_kernel`, by their core names: the
#: estimates' (public, internal) functions, None for the exact trace.
_STATISTICS = dict(
    ntk_trace=None,
    ntk_frobenius_sq=(ntk_frobenius_sq, frobenius_sq),
    ntk_effective_rank=(ntk_effective_rank, effective_rank),
    ntk_kernel_alignment=(ntk_kernel_alignment, kernel_alignment),
)
STATISTICS = tuple(_STATISTICS)
#: The kernel options the statistics read; ``implementation`` only ``ntk_trace``.
_TAKEN = ("precision", "batch_size", "wrt")


def of_kernel(statistic: str, kernel, first, x, keywords: dict, arguments: dict):
    """``statistic`` (one of :data:`STATISTICS`) of Θ(x, x) of the model of ``kernel``, an
    NTK kernel function (``adapters.build_kernel(..., "ntk", ...)``) as ``kernel(first, x,
    **keywords)`` sees it: its options ``precision``, ``batch_size`` and ``wrt`` (and
    ``implementation`` for the trace), others refused; ``arguments``: the statistic's own
    (``key``, ``m``, ``steps``, ``y``; None: the core function's default)."""
    if statistic not in STATISTICS:
        what = f"unknown statistic {statistic!r}"
        raise bad(ValueError, "adapters.matrix_free", what, f"pass one of {STATISTICS}")
    fn, o = kernel.name, kernel.options
    estimate = _STATISTICS[statistic]
    taken = _TAKEN if estimate else (*_TAKEN, "implementation")
    refuse_options(fn, o, taken, "the statistic is of the (N·O, N·O) kernel Θ(x, x)")
    model_of = lambda: kernel_model(kernel, first, x, keywords)  # noqa: E731
    if estimate is None:
        return model_trace(model_of(), o.batch_size, o.implementation, o.precision)
    public, internal = estimate
    parameters = inspect.signature(public).parameters.values()
    defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
    args = {k: defaults.get(k) if v is None else v for k, v in arguments.items()}
    return internal(fn, model_of, **args, batch_size=o.batch_size, precision=o.precision)


class Tracked(NamedTuple):
    """One :class:`~ntk_core.KernelTracker` step's matrix-free statistics of Θ(x, x):
    ``trace`` exact, the others :class:`Estimate` (``alignment`` None without targets)."""

    trace: float
    frobenius_sq: Estimate
    effective_rank: Estimate
    alignment: Estimate | None


def tracked(fn: str, kernel, first, x, keywords: dict, y, key, m: int, steps: int) -> Tracked:
    """The statistics of Θ(x, x) of the model of ``kernel`` (an NTK kernel function with
    ``trace_axes=()``) as ``kernel(first, x, **keywords)`` sees it: the exact trace; ‖Θ‖²_F
    by Hutch++ with ``m`` products; the effective rank by SLQ with ``m`` products of
    ``steps`` Lanczos steps; the alignment with ``y`` (host float64 ``(N, O...)`` or None)
    from one more product and the same ‖Θ‖²_F. ``key``: split in two (F, rank)."""
    is_function = isinstance(kernel, KernelFunction)
    if not is_function or kernel.kind != Kind.NTK:
        got = type(kernel).__name__ + (f" of kind {kernel.kind!r}" if is_function else "")
        what = f"matrix-free tracking reads the model from an NTK kernel function, got {got}"
        raise bad(TypeError, fn, what, "pass e.g. ntk_core.ntk_fn(f, trace_axes=())")
    o = kernel.options
    if o.trace_axes or o.diagonal_axes:
        t, d = o.trace_axes, o.diagonal_axes
        what = f"matrix-free tracking needs the full kernel, got trace_axes={t}, diagonal_axes={d}"
        raise bad(ValueError, fn, what, "build it with trace_axes=(), or track exactly (m=None)")
    batch_size = o.batch_size if isinstance(o.batch_size, int) else None  # VJPs in batches
    op = _flat(kernel_model(kernel, first, x, keywords), batch_size, o.precision)
    op = op._replace(fn=fn)
    n = jax.tree.leaves(op.outputs)[0].shape[0]
    check_tracked_m(fn, m, steps, n, op.m, late=True)  # O known now: the constructor knew N
    trace = model_trace(op.model, o.batch_size, o.implementation, o.precision)
    k_frobenius, k_rank = jax.random.split(key)
    frobenius = _hutchpp(op, check_m(fn, m), k_frobenius)
    rank = _effective_rank(op, k_rank, m, steps, lambda: trace)
    if y is None:
        return Tracked(trace, frobenius, rank, None)
    leaves = jax.tree.leaves(op.outputs)
    if len(leaves) == 1 and np.size(y) == math.prod(leaves[0].shape):
        y = np.reshape(y, leaves[0].shape)  # (N,) labels of (N, 1) outputs
    alignment = _alignment(op, _targets(fn, op, y), lambda: frobenius)
    return Tracked(trace, frobenius, rank, alignment)
