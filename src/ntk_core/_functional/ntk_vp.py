"""``ntk_vp_fn``: matrix-free NTK-vector products Θ(X, X)·v, one VJP then one JVP (neural-
tangents' ``empirical_ntk_vp_fn``); not the ``"ntvp"`` implementation, which forms a kernel."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._errors import NonFiniteError, bad, check_int
from ntk_core._jax import caches as _caches
from ntk_core._kernel import checks as _checks
from ntk_core._kernel import probe as _probe
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._kernel.caller import Caller, core
from ntk_core._kernel.checks import all_finite, check_finite_input
from ntk_core._kernel.ids import check_ids
from ntk_core._kernel.model import from_apply_fn
from ntk_core._kernel.options import DEFAULTS, make_options
from ntk_core._kernel.validate import batch_size as _batch_size
from ntk_core._kernel.validate import describe as _describe


def _whole(apply3, params, x, aux, v):
    """Θ v on the whole batch: ``jax.linearize``, its transpose, the linear map again."""
    _, f_lin = jax.linearize(lambda p: apply3(p, x, aux), params)
    (u,) = jax.linear_transpose(f_lin, params)(v)
    return f_lin(u)


def _batched(apply3, params, x, aux, v, b: int):
    """Θ v in batches of ``b``: u = Σ_b J_bᵀ v_b (scan of VJPs), then J_b u (map of JVPs)."""
    n = jax.tree.leaves(x)[0].shape[0]
    k, r = divmod(n, b)

    def head(tree):
        return jax.tree.map(lambda a: a[: k * b].reshape((k, b) + a.shape[1:]), tree)

    def tail(tree):
        return jax.tree.map(lambda a: a[k * b :], tree)

    def pull(xb, vb):
        _, vjp_fn = jax.vjp(lambda p: apply3(p, xb, aux), params)
        return vjp_fn(vb)[0]

    u = jax.tree.map(jnp.zeros_like, params)
    if k:
        step = lambda acc, xv: (jax.tree.map(jnp.add, acc, pull(*xv)), None)  # noqa: E731
        u, _ = jax.lax.scan(step, u, (head(x), head(v)))
    if r:
        u = jax.tree.map(jnp.add, u, pull(tail(x), tail(v)))

    def push(xb):
        return jax.jvp(lambda p: apply3(p, xb, aux), (params,), (u,))[1]

    parts = []
    if k:
        out = jax.lax.map(push, head(x))
        parts.append(jax.tree.map(lambda a: a.reshape((k * b,) + a.shape[2:]), out))
    if r:
        parts.append(push(tail(x)))
    return jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


@_caches.lru_cache(maxsize=64)
def _product(apply3, precision: str, batch_size: int | None) -> Callable:
    """The jitted ``product(params, x, aux, v)``, shared per ``(apply3, precision,
    batch_size)`` (``aux`` held fixed, as the kernels' ``apply3(params, x, aux)``)."""

    def product(params, x, aux, v):
        with jax.default_matmul_precision(precision):
            if batch_size is None:
                return _whole(apply3, params, x, aux, v)
            return _batched(apply3, params, x, aux, v, batch_size)

    return jax.jit(product)


def _check_params(fn: str, params) -> None:
    if not jax.tree.leaves(params):
        what = f"params has no arrays (got {type(params).__name__})"
        raise bad(ValueError, fn, what, "pass the model's parameters (from its init)")
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if all_finite(leaf) is False:
            what = f"params{jax.tree_util.keystr(path)} contains NaN or Inf"
            raise bad(NonFiniteError, fn, what, "check the initialisation or training step")


def checked_inputs(caller: Caller, params, x, options, name: str = "x") -> tuple:
    """``(N, params, x)``: params and x checked (arrays, finite, one batch size N), as jax
    arrays; messages name ``caller`` and ``x`` as ``name`` (``"x2"`` for a second input)."""
    fn = caller.name
    _checks.check_values(fn, {"params": params, name: x})
    _checks.before_trace(fn, params, x, None, options)
    _check_params(fn, params)
    n = _batch_size(caller, name, x)
    check_finite_input(fn, name, x)
    return n, *jax.tree.map(jnp.asarray, (params, x))


def _outputs(caller: Caller, apply3, params, x, aux, n: int):
    """The model's outputs as ``jax.ShapeDtypeStruct`` leaves and their tree."""
    fn = caller.name
    try:
        out = jax.eval_shape(apply3, params, x, aux)
    except Exception as e:  # the model's own error, with context
        doing = f"calling apply_fn(params, x) on x of shapes {_describe(x)}"
        fix = f"check params and x's per-sample shape ({_checks.order_hint(caller)})"
        raise _checks.model_call_error(fn, doing, e, fix) from e
    leaves, tree = jax.tree.flatten(out)
    if not leaves:
        raise bad(ValueError, fn, f"apply_fn returned no arrays ({out!r})", "return the outputs")
    for i, leaf in enumerate(leaves):
        where = "the output" if len(leaves) == 1 else f"output leaf {i}"
        if not leaf.shape or leaf.shape[0] != n:
            what = f"{where} has shape {leaf.shape} but x has {n} samples"
            raise bad(ValueError, fn, what, "return one row per sample (x[None] for one sample)")
        _check_floating(fn, where, leaf.dtype, "return the model's float outputs")
    return [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in leaves], tree


def _check_floating(fn: str, where: str, dtype, fix: str) -> None:
    if not jnp.issubdtype(dtype, jnp.floating):
        raise bad(TypeError, fn, f"{where} has dtype {dtype}; expected real floating point", fix)


_V_FIX = "pass v shaped like ntk_vp.outputs"


def _check_v(call: str, outputs, tree, v):
    """``v`` checked and cast to the outputs' dtypes."""
    leaves, v_tree = jax.tree.flatten(v)
    if v_tree != tree:
        what = f"v has the pytree structure {v_tree}; expected the outputs' {tree}"
        raise bad(TypeError, call, what, _V_FIX)
    checked = []
    for i, (leaf, o) in enumerate(zip(leaves, outputs, strict=True)):
        where = "v" if len(outputs) == 1 else f"leaf {i} of v"
        shape = tuple(np.shape(leaf))
        if shape != tuple(o.shape):
            same_size = np.size(leaf) == np.prod(o.shape)
            hint = f" (v.reshape({', '.join(map(str, o.shape))}))" if same_size else ""
            what = f"{where} has shape {shape}; expected the outputs' {tuple(o.shape)}"
            raise bad(ValueError, call, what, _V_FIX + hint)
        dtype = jnp.result_type(leaf)
        _check_floating(call, where, dtype, "pass e.g. v.astype(np.float32)")
        leaf = leaf if dtype == o.dtype else leaf.astype(o.dtype)
        if all_finite(leaf) is False:
            raise bad(NonFiniteError, call, f"{where} contains NaN or Inf", "pass a finite v")
        checked.append(leaf)
    return jax.tree.unflatten(tree, checked)


def ntk_vp_fn(
    apply_fn: Callable,
    params,
    x,
    *,
    batch_size: int | None = None,
    precision: str = DEFAULTS.precision,
) -> Callable:
    """Returns a jitted function ``ntk_vp(v) = Θ(x, x) v``, never forming Θ or J.

    (Θ v)[i, a] = Σ_{j, b} Θ[i, j, a, b] v[j, b], Θ the NTK of :func:`ntk_fn` (x1 = x2 = x,
    ``trace_axes=()``), as u = Jᵀ v (one VJP) then Θ v = J u (one JVP), J ``(N·O, P)``.

    Args:
      apply_fn: ``apply_fn(params, x) -> outputs``, floating arrays ``(N, O...)``; samples
        may interact when ``batch_size=None``.
      params: pytree of floating arrays (total size P); x: pytree of arrays with batch axis
        0 of size N; both held (as jax arrays).
      batch_size: ``None``: one VJP and one JVP over all N; an int B: VJPs summed over
        batches of B (``lax.scan``), then JVPs per batch (``lax.map``); needs independent
        samples (checked by a probe).
      precision: the matmul precision of both passes, as in :func:`ntk_fn`.

    Returns ``ntk_vp(v)``: v a pytree like the outputs (leaves ``(N, O...)``, real floating,
    cast to the outputs' dtype) -> Θ v, ``jax.Array`` leaves in that layout; ``ntk_vp.outputs``:
    the ``jax.ShapeDtypeStruct`` pytree v must match. New values do not recompile.

    Raises:
      TypeError: ``apply_fn`` not callable (or a Flax/Haiku model), non-floating params or
        outputs, ``batch_size`` not an int; v of another structure, or non-floating.
      ValueError: params without arrays or non-finite; x empty, inconsistent or non-finite;
        the model failing on x; outputs without the batch axis; ``batch_size`` <= 0 or with
        interacting samples; an invalid ``precision``; v of the wrong shape or non-finite.

    Cost: per call one reverse and one forward pass (about 4 forward passes; 3 unbatched);
    memory: one batch's activations, u (P), v and Θ v (N·O each).

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> apply_fn = lambda w, x: jnp.tanh(x @ w)
      >>> w, x = jnp.ones((3, 2)) / 3, jnp.eye(3)
      >>> ntk_vp = ntk_core.ntk_vp_fn(apply_fn, w, x, batch_size=2)
      >>> ntk_vp.outputs.shape
      (3, 2)
      >>> theta = ntk_core.empirical_ntk(apply_fn, w, x, trace_axes=())  # (N1, N2, O, O)
      >>> v = jnp.ones((3, 2))
      >>> bool(jnp.allclose(ntk_vp(v), jnp.einsum("ijab,jb->ia", theta, v), rtol=1e-5))
      True

    References: Novak, Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent
    Kernel", ICML 2022 (section 3.2).
    """
    _checks.check_apply_fn(_NTK_VP_FN.name, apply_fn)
    return make_ntk_vp(_NTK_VP_FN, apply3_of(apply_fn), params, x, None, batch_size, precision)


#: :func:`ntk_vp_fn` as its messages name it (ntk_core._kernel.caller).
_NTK_VP_FN = core("ntk_vp_fn", one_input=True)


def apply3_of(apply_fn) -> Callable:
    """``apply_fn(params, x)`` as ``apply3(params, x, aux)``, the same object per ``apply_fn``
    when hashable (so the jitted products are shared)."""
    try:
        return from_apply_fn(apply_fn)
    except TypeError:  # unhashable apply_fn
        return from_apply_fn.__wrapped__(apply_fn)


def make_ntk_vp(
    caller: Caller, apply3, params, x, aux, batch_size, precision, check=None
) -> Callable:
    """:func:`ntk_vp_fn` of ``apply3(params, x, aux)`` (``aux`` held fixed), errors naming
    ``caller``; ``check(params, x, None, aux)``: an adapter's model check, run first."""
    fn = caller.name
    options = make_options(fn, precision=precision)
    batch_size = check_int(fn, "batch_size", batch_size, "pass e.g. 1000, or None", optional=True)
    n, params, x = checked_inputs(caller, params, x, options)
    if check is not None:
        check(params, x, None, aux)
    outputs, tree = _outputs(caller, apply3, params, x, aux, n)
    check_ids(fn, apply3, params, x, aux, precision=precision, name="x")  # ids out of range
    _checks.after_trace(fn, apply3, params, x, aux, options)
    batched = batch_size is not None and batch_size < n
    found = batched and _probe.samples_interact(apply3, params, x, None, aux, fn_name=fn)
    if found:
        raise _checks.samples_interact_error(fn, found, "pass batch_size=None, or evaluation mode")
    try:
        product = _product(apply3, precision, batch_size)
    except TypeError:  # unhashable apply3
        product = _product.__wrapped__(apply3, precision, batch_size)
    call = f"{fn}(...)(v)"

    def ntk_vp(v):
        return product(params, x, aux, _check_v(call, outputs, tree, v))

    ntk_vp.outputs = jax.tree.unflatten(tree, outputs)
    ntk_vp.arguments = (params, x, aux)  # as checked, on the device
    return ntk_vp


ntk_vp_fn = _checked_arguments(ntk_vp_fn)
