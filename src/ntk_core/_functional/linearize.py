"""Linearized and Taylor-expanded networks: ``linearize`` and ``taylor_expand``.

Both expand ``apply_fn`` in its parameters around a fixed point θ0 (``params0``) and
return a function of new parameters θ; the derivatives are directional derivatives
along δ = θ − θ0 from ``jax.jvp`` (forward mode), so no Jacobian is ever formed. The
framework adapters (``ntk_flax``, ``ntk_haiku``) build a pure ``apply(params, x)`` and
call :func:`expansion` with their own names for messages.

Leaves of θ0 that are not floating point (integers, booleans, PRNG keys) have no tangent
(JAX's ``float0``): the expansion holds them at their θ0 values.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._errors import bad, check_int
from ntk_core._kernel.checks import check_apply_fn

_REFERENCE = (
    "Lee, Xiao, Schoenholz, Bahri, Novak, Sohl-Dickstein, Pennington, "
    '"Wide Neural Networks of Any Depth Evolve as Linear Models Under Gradient '
    'Descent", NeurIPS 2019'
)


def check_degree(fn_name: str, degree) -> int:
    """``degree`` as an int; TypeError for a non-int (bool included), ValueError below 0."""
    return check_int(fn_name, "degree", degree, "pass e.g. degree=2 (1: the linearisation)", low=0)


def _dtype(leaf):
    """The dtype JAX gives ``leaf`` (float64 NumPy data is float32 with x64 off)."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        dtype = np.result_type(leaf)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # PRNG keys
        return dtype
    return jax.dtypes.canonicalize_dtype(dtype)


def _differentiable(dtype) -> bool:
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and bool(
        jnp.issubdtype(dtype, jnp.inexact)
    )


def _concrete(leaf):
    """``leaf`` as a NumPy array, or ``None`` for a traced value (inside jax.jit)."""
    try:
        if jax.dtypes.issubdtype(_dtype(leaf), jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return np.asarray(leaf)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _shown(paths: list[str]) -> str:
    return "[" + ", ".join(paths[:4]) + (f", ... ({len(paths)} in all)]" if len(paths) > 4 else "]")


class _Point:
    """The expansion point θ0: its leaves (as JAX arrays, a snapshot), tree structure and
    which leaves get a tangent; checks parameters given at call time against it.

    ``point_arg`` names θ0 as its function received it (``"params0"``,
    ``"variables['params']"``), ``point_name`` describes it in call-time messages.
    """

    def __init__(self, fn_name: str, params0, point_arg: str, point_name: str):
        self.fn_name, self.point_name = fn_name, point_name
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(params0)
        self.paths = [jax.tree_util.keystr(path) for path, _ in flat]
        self.leaves = []
        for path, leaf in zip(self.paths, (leaf for _, leaf in flat), strict=True):
            try:
                array = jnp.asarray(leaf)
            except TypeError:
                array = None
            if array is None or not _numeric(array.dtype):
                got = f"{type(leaf).__name__} {_short(leaf)}"
                what = f"{point_arg}{path} is {got}, not a numeric array"
                raise bad(TypeError, fn_name, what, f"keep only arrays in {point_arg}")
            self.leaves.append(array)
        self.differentiable = [_differentiable(a.dtype) for a in self.leaves]
        self.tree = jax.tree_util.tree_unflatten(self.treedef, self.leaves)

    def tangent(self, params, params_name: str):
        """δ = params − θ0 as a pytree like θ0 (``float0`` zeros for leaves without a
        tangent), after checking params' structure, shapes, dtypes and, outside
        ``jax.jit``, that leaves without a tangent equal θ0's."""
        fn, point = self.fn_name, f"the expansion point ({self.point_name})"
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        if treedef != self.treedef:
            raise self._structure_error(params_name, flat, treedef)
        deltas = []
        for (_, leaf), path, ref, diff in zip(
            flat, self.paths, self.leaves, self.differentiable, strict=True
        ):
            shape = tuple(np.shape(leaf))
            if shape != ref.shape:
                what = f"{params_name}{path} has shape {shape}, but {point} has shape "
                what += f"{ref.shape} there"
                raise bad(ValueError, fn, what, "pass parameters of the same model")
            try:
                dtype = _dtype(leaf)
            except TypeError:
                dtype = None
            if dtype != ref.dtype:
                got = dtype if dtype is not None else type(leaf).__name__
                what = (
                    f"{params_name}{path} has dtype {got}, but {point} has dtype {ref.dtype} there"
                )
                fix = "cast the parameters to the expansion point's dtypes"
                raise bad(TypeError, fn, what, fix)
            if diff:
                deltas.append(jnp.asarray(leaf) - ref)
                continue
            given, held = _concrete(leaf), _concrete(ref)
            if given is not None and held is not None and not np.array_equal(given, held):
                what = f"{params_name}{path}, of dtype {ref.dtype}, has no derivative, and its "
                what += f"value differs from that of {point}"
                raise bad(ValueError, fn, what, "pass its value at the expansion point")
            deltas.append(np.zeros(ref.shape, jax.dtypes.float0))
        return jax.tree_util.tree_unflatten(self.treedef, deltas)

    def _structure_error(self, params_name: str, flat, treedef) -> ValueError:
        fn, point = self.fn_name, f"the expansion point ({self.point_name})"
        paths = [jax.tree_util.keystr(path) for path, _ in flat]
        missing = [p for p in self.paths if p not in set(paths)]
        extra = [p for p in paths if p not in set(self.paths)]
        if missing or extra:
            detail = (
                f"it has {len(paths)} leaves {_shown(paths)}, the expansion point "
                f"{len(self.paths)} {_shown(self.paths)}"
                + (f"; missing {_shown(missing)}" if missing else "")
                + (f"; not in the expansion point {_shown(extra)}" if extra else "")
            )
        else:
            detail = (
                f"the same leaves in other containers: {_short(treedef, 160)} against "
                f"{_short(self.treedef, 160)}"
            )
        what = f"{params_name} does not have the tree structure of {point} ({detail})"
        return bad(ValueError, fn, what, "pass parameters structured like the expansion point")


def _numeric(dtype) -> bool:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return bool(jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_))


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_float0(leaf) -> bool:
    return getattr(leaf, "dtype", None) == jax.dtypes.float0


def _derivatives(g: Callable, primal, tangent, degree: int) -> list:
    """[g(θ0), Dg(θ0)[δ], ..., D^degree g(θ0)[δ, ..., δ]] by ``degree`` nested ``jax.jvp``.

    Level k is the JVP of level k − 1 (which returns the derivatives up to order k − 1):
    the tangent of its last output is the order-k derivative. Tangents of non-floating
    outputs (``float0``) become zeros of the output's dtype, so that the next level can
    differentiate them; the sum skips them.
    """

    def level(k: int) -> Callable:
        if k == 0:
            return lambda p: [g(p)]
        lower = level(k - 1)

        def derivatives(p):
            values, tangents = jax.jvp(lower, (p,), (tangent,))
            top = jax.tree.map(
                lambda t, v: jnp.zeros_like(v) if _is_float0(t) else t, tangents[-1], values[0]
            )
            return [*values, top]

        return derivatives

    return level(degree)(primal)


def _taylor_sum(terms: list):
    """Σ_k terms[k] / k! in Horner form; output leaves that are not floating point (no
    derivatives) are those of terms[0]."""
    total = terms[-1]
    for k in range(len(terms) - 2, -1, -1):

        def add(term, acc, k=k):
            if not _differentiable(term.dtype):
                return term
            return term + (acc if k == 0 else acc / (k + 1))

        total = jax.tree.map(add, terms[k], total)
    return total


def expansion(
    fn_name: str,
    apply_fn: Callable,
    params0,
    degree: int,
    *,
    params_name: str = "params",
    point_arg: str = "params0",
    point_name: str = "params0",
) -> Callable:
    """The degree-``degree`` expansion of ``apply_fn`` around ``params0`` as a function
    ``(params, *args, **kwargs)``; messages start with ``fn_name``, call the parameters
    given at call time ``params_name`` and θ0 ``point_arg`` / ``point_name`` (see
    :class:`_Point`)."""
    point = _Point(fn_name, params0, point_arg, point_name)

    def expanded(params, *args, **kwargs):
        delta = point.tangent(params, params_name)

        def g(p):
            return apply_fn(p, *args, **kwargs)

        if degree == 0:
            return g(point.tree)
        if degree == 1:  # one jax.jvp
            out, tangent_out = jax.jvp(g, (point.tree,), (delta,))
            return _taylor_sum([out, tangent_out])
        return _taylor_sum(_derivatives(g, point.tree, delta, degree))

    return expanded


def linearize(apply_fn: Callable, params0) -> Callable:
    """The linearisation of ``apply_fn`` in its parameters around ``params0``.

    Returns ``f_lin(params, x, *args, **kwargs)`` computing

        f_lin(θ, x) = f(θ0, x) + J(θ0, x)·(θ − θ0),   J = ∂f/∂θ at θ0,

    with f = ``apply_fn`` and θ0 = ``params0``: the first-order Taylor polynomial in the
    parameters (neural-tangents' ``nt.linearize``). ``f_lin`` is linear (affine) in θ;
    trained by gradient descent on the MSE it follows the NTK dynamics of
    :func:`ntk_core.predict.gradient_descent_mse` with the NTK of ``apply_fn`` at θ0.
    J·(θ − θ0) is one forward-mode directional derivative (``jax.jvp``); the Jacobian is
    never formed. ``f_lin`` is a pure function: it can be called inside ``jax.jit``,
    ``jax.grad`` (gradients with respect to ``params``: training the linearised model),
    ``jax.vmap``; wrap it in ``jax.jit`` for speed.

    Args:
      apply_fn: ``apply_fn(params, x, *args, **kwargs) -> outputs``, outputs a pytree
        of arrays, e.g. ``(N1, O...)`` for a batch x of N1 samples.
      params0: the expansion point θ0, any pytree (dicts, lists, tuples, ...) of arrays
        of total size P. Floating leaves (real or complex) are expanded; integer,
        boolean and PRNG-key leaves have no derivative (JAX's ``float0`` tangent) and are
        held at their θ0 values. The leaves are copied to JAX arrays once, here.

    Returns:
      ``f_lin(params, x, *args, **kwargs)``: the outputs of ``apply_fn`` (same pytree
      structure, shapes ``(N1, O...)`` and dtypes) of the linearised model at ``params``,
      which must have θ0's tree structure, leaf shapes and dtypes (float64 NumPy data
      counts as float32 when ``jax_enable_x64`` is off, as in JAX). ``x``, ``*args`` and
      ``**kwargs`` go to ``apply_fn`` unchanged and are not differentiated. Output
      leaves that are not floating point are f(θ0, x)'s.

    Raises:
      TypeError: ``apply_fn`` not callable (a Flax module or Haiku transformed gets the
        adapter to use instead); a leaf of ``params0`` that is not a numeric array;
        at call time, a leaf of ``params`` whose dtype differs from θ0's.
      ValueError: at call time, ``params`` with another tree structure (the message
        names the leaves missing or added) or leaf shape than θ0; outside ``jax.jit``,
        an integer / boolean / key leaf of ``params`` whose value differs from θ0's
        (inside ``jax.jit`` their values are not checked, and θ0's are used).

    Cost: one ``jax.jvp`` per call, about 2–3 forward passes of compute (2.8 in FLOPs
    for a 4-layer, 256-wide tanh MLP under ``jax.jit``, by XLA's cost analysis) and no
    per-sample or per-output work; memory of a forward pass with its primal and tangent
    activations, plus P for θ − θ0 (a Jacobian would take N1·O·P). ``jax.grad`` through
    ``f_lin`` (training) costs about one backpropagation through f (2.8 forward passes
    for that MLP) and stores the activations of the forward pass.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import ntk_core
      >>> f = lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"]
      >>> params0 = {"w": jnp.full((3, 4), 0.3), "v": jnp.full((4, 1), 0.5)}
      >>> f_lin = ntk_core.linearize(f, params0)
      >>> x = jnp.ones((5, 3))                           # N1 = 5 samples
      >>> f_lin(params0, x).shape                        # (N1, O)
      (5, 1)
      >>> bool(jnp.allclose(f_lin(params0, x), f(params0, x)))  # exact at θ0
      True
      >>> step = jax.tree.map(jnp.ones_like, params0)
      >>> at = lambda s: jax.tree.map(lambda p, d: p + s * d, params0, step)
      >>> d1, d2 = f_lin(at(1.0), x) - f_lin(params0, x), f_lin(at(2.0), x) - f_lin(params0, x)
      >>> bool(jnp.allclose(d2, 2 * d1))                 # affine in θ
      True
      >>> loss = lambda p: 0.5 * jnp.mean((f_lin(p, x) - 1.0) ** 2)
      >>> jax.jit(jax.grad(loss))(params0)["w"].shape    # train the linearised model
      (3, 4)

    References:
      {reference}
    """
    check_apply_fn("linearize", apply_fn, "linearize")
    return expansion("linearize", apply_fn, params0, 1)


def taylor_expand(apply_fn: Callable, params0, degree: int) -> Callable:
    """The degree-``degree`` Taylor polynomial of ``apply_fn`` in its parameters at ``params0``.

    Returns ``f_taylor(params, x, *args, **kwargs)`` computing

        f_taylor(θ, x) = Σ_{k=0..degree} (1/k!) D^k f(θ0, x)[δ, ..., δ],   δ = θ − θ0,

    with D^k f[δ, ..., δ] the k-th directional derivative of f = ``apply_fn`` along δ
    (neural-tangents' ``nt.taylor_expand``). ``degree=0`` gives f(θ0, x) for any θ;
    ``degree=1`` gives :func:`linearize`'s ``f_lin`` (the same computation); for a
    model polynomial in its parameters of degree ≤ ``degree`` it is the model itself.
    The derivatives come from ``degree`` nested ``jax.jvp`` calls (forward mode of
    forward mode), which every differentiable JAX operation supports and which compose
    with ``jax.jit``, ``jax.grad`` and ``jax.vmap``; no Jacobian or Hessian is formed.
    The terms are summed in Horner form, f + (D f + (D²f + ...)/2)/1.

    Args:
      apply_fn, params0: as in :func:`linearize` (outputs e.g. ``(N1, O...)`` for a
        batch of N1 samples; params0 of total size P).
      degree: a non-negative int.

    Returns:
      ``f_taylor(params, x, *args, **kwargs)``: outputs of ``apply_fn``'s structure,
      shapes ``(N1, O...)`` and dtypes, for ``params`` of θ0's structure, leaf shapes
      and dtypes (as :func:`linearize`).

    Raises:
      TypeError: as :func:`linearize`, and ``degree`` not an int (``True`` included).
      ValueError: as :func:`linearize`, and a negative ``degree``.

    Cost: degree 0, one forward pass; degree 1, one JVP (as :func:`linearize`); degree
    d ≥ 2, d nested JVPs. Each level carries the previous level's primal and tangent
    computations, 2^d streams in all, but every tangent is the same δ and under
    ``jax.jit`` XLA merges the identical streams, so compute grows about linearly: for a
    4-layer, 256-wide tanh MLP (XLA's FLOP count, in forward passes) degree 1: 2.8,
    2: 4.3, 3: 5.8, 4: 7.4; ``jax.grad`` through it: 2.8, 8.6, 18.8 (degrees 1–3).
    Called outside ``jax.jit`` nothing is merged: about 2^d. Memory is that of the live
    streams' activations, independent of N1·O·P (no Jacobian or Hessian is formed).

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> f = lambda p, x: (x @ p["a"]) * (x @ p["b"])  # quadratic in the parameters
      >>> params0 = {"a": jnp.ones((3, 2)), "b": jnp.ones((3, 2))}
      >>> params = {"a": jnp.full((3, 2), 2.0), "b": jnp.full((3, 2), -1.0)}
      >>> x = jnp.ones((4, 3))                           # N1 = 4 samples
      >>> [ntk_core.taylor_expand(f, params0, d)(params, x)[0, 0].item() for d in range(4)]
      [9.0, 0.0, -18.0, -18.0]
      >>> f(params, x)[0, 0].item()                      # degree 2 is exact here
      -18.0

    References:
      {reference}
    """
    check_apply_fn("taylor_expand", apply_fn, "taylor_expand")
    degree = check_degree("taylor_expand", degree)
    return expansion("taylor_expand", apply_fn, params0, degree)


for _fn in (linearize, taylor_expand):
    if _fn.__doc__:  # None under python -OO
        _fn.__doc__ = _fn.__doc__.replace("{reference}", _REFERENCE)
del _fn
