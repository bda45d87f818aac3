"""``linearize`` and ``taylor_expand``: ``apply_fn`` expanded in its parameters around θ0 by
nested ``jax.jvp`` (no Jacobian), non-floating leaves held; adapters call :func:`expansion`."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._errors import NonFiniteError, bad, check_int, one_line
from ntk_core._kernel.checks import all_finite, check_apply_fn

#: The highest Taylor degree: d nested JVPs trace 2^d streams (d = 10: 29 s for one 3 x 2
#: tanh layer outside jax.jit; d = 30 never ended; d = 1000 overflowed Python's stack).
MAX_DEGREE = 10


def check_degree(fn_name: str, degree) -> int:
    """``degree`` as an int; TypeError for a non-int (bool included), ValueError outside
    [0, :data:`MAX_DEGREE`]."""
    fix = "pass e.g. degree=2 (1: the linearisation; each degree doubles the cost)"
    return check_int(fn_name, "degree", degree, fix, low=0, high=MAX_DEGREE)


def _dtype(leaf):
    """The dtype JAX gives ``leaf`` (float64 NumPy data is float32 with x64 off)."""
    return jnp.result_type(leaf)


def _differentiable(dtype) -> bool:
    extended = jax.dtypes.issubdtype(dtype, jax.dtypes.extended)  # PRNG keys
    return not extended and bool(jnp.issubdtype(dtype, jnp.inexact))


def _concrete(leaf):
    """``leaf`` as a NumPy array, or ``None`` when traced."""
    try:
        if jax.dtypes.issubdtype(_dtype(leaf), jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return np.asarray(leaf)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _shown(paths: list[str]) -> str:
    return "[" + ", ".join(paths[:4]) + (f", ... ({len(paths)} in all)]" if len(paths) > 4 else "]")


class _Point:
    """The expansion point θ0 (a snapshot of its leaves), checking call-time parameters;
    ``point_arg`` names θ0 as received, ``point_name`` in call-time messages."""

    def __init__(self, fn_name: str, params0, point_arg: str, point_name: str):
        self.fn_name, self.point = fn_name, f"the expansion point ({point_name})"
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
        for path, leaf, diff in zip(self.paths, self.leaves, self.differentiable, strict=True):
            if diff and all_finite(leaf) is False:  # every expansion would be NaN
                what = f"{point_arg}{path} contains NaN or Inf"
                fix = "expand around finite parameters (a NaN loss or gradient made these?)"
                raise bad(NonFiniteError, fn_name, what, fix)

    def tangent(self, params, params_name: str):
        """δ = params − θ0 (``float0`` for leaves without a tangent), after checking params'
        structure, shapes, dtypes and, outside ``jax.jit``, the fixed leaves' values."""
        fn, point = self.fn_name, self.point
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        if treedef != self.treedef:
            raise self._structure_error(params_name, flat, treedef)
        deltas = []
        for (_, leaf), path, ref, diff in zip(
            flat, self.paths, self.leaves, self.differentiable, strict=True
        ):
            shape, at = tuple(np.shape(leaf)), params_name + path
            if shape != ref.shape:
                what = f"{at} has shape {shape}, but {point} has shape {ref.shape} there"
                raise bad(ValueError, fn, what, "pass parameters of the same model")
            try:
                dtype = _dtype(leaf)
            except TypeError:
                dtype = None
            if dtype != ref.dtype:
                got = dtype if dtype is not None else type(leaf).__name__
                what = f"{at} has dtype {got}, but {point} has dtype {ref.dtype} there"
                raise bad(
                    TypeError, fn, what, "cast the parameters to the expansion point's dtypes"
                )
            if diff:
                deltas.append(jnp.asarray(leaf) - ref)
                continue
            given, held = _concrete(leaf), _concrete(ref)
            if given is not None and held is not None and not np.array_equal(given, held):
                what = f"{at}, of dtype {ref.dtype}, has no derivative, and its value differs"
                what += f" from that of {point}"
                raise bad(ValueError, fn, what, "pass its value at the expansion point")
            deltas.append(np.zeros(ref.shape, jax.dtypes.float0))
        return jax.tree_util.tree_unflatten(self.treedef, deltas)

    def _structure_error(self, params_name: str, flat, treedef) -> ValueError:
        fn, point = self.fn_name, self.point
        paths = [jax.tree_util.keystr(path) for path, _ in flat]
        missing = [p for p in self.paths if p not in set(paths)]
        extra = [p for p in paths if p not in set(self.paths)]
        if missing or extra:
            detail = f"missing {_shown(missing)}, not in the expansion point {_shown(extra)}"
        else:
            detail = f"the same leaves in other containers: {_short(treedef, 160)} against "
            detail += f"{_short(self.treedef, 160)}"
        what = f"{params_name} does not have the tree structure of {point} ({detail})"
        return bad(ValueError, fn, what, "pass parameters structured like the expansion point")


def _numeric(dtype) -> bool:
    key = jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    return key or bool(jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_))


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _derivatives(apply_fn: Callable, args, kwargs, primal, tangent, degree: int) -> list:
    """[g(θ0), Dg(θ0)[δ], ..., D^degree g(θ0)[δ, ..., δ]], g = ``apply_fn(·, *args, **kwargs)``,
    by nested ``jax.jvp`` (``float0`` tangents as zeros, for the next level to differentiate)."""

    def level(k: int) -> Callable:
        if k == 0:
            return lambda p: [apply_fn(p, *args, **kwargs)]
        lower = level(k - 1)

        def derivatives(p):
            values, tangents = jax.jvp(lower, (p,), (tangent,))
            zero = lambda t, v: jnp.zeros_like(v) if t.dtype == jax.dtypes.float0 else t  # noqa: E731
            return [*values, jax.tree.map(zero, tangents[-1], values[0])]

        return derivatives

    return level(degree)(primal)


def _taylor_sum(terms: list):
    """Σ_k terms[k] / k! in Horner form; non-floating leaves are terms[0]'s."""
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
    inputs_fix: str = "give x as the model takes it at the expansion point",
) -> Callable:
    """The degree-``degree`` expansion of ``apply_fn`` around ``params0``, a function
    ``(params, *args, **kwargs)``; messages name ``fn_name``, ``params_name``, ``point_arg``;
    a model that fails on the call's inputs is a ValueError with ``inputs_fix``."""
    point = _Point(fn_name, params0, point_arg, point_name)

    def expanded(params, *args, **kwargs):
        swapped = args and jax.tree.structure(args[0]) == point.treedef
        if swapped and jax.tree.structure(params) != point.treedef:
            what = f"the second argument has the structure of {point.point}, {params_name} not"
            raise bad(ValueError, fn_name, what, f"call it as ({params_name}, x)")
        delta = point.tangent(params, params_name)
        try:
            return _taylor_sum(_derivatives(apply_fn, args, kwargs, point.tree, delta, degree))
        except Exception as e:
            try:  # the model itself on these inputs?
                jax.eval_shape(lambda: apply_fn(point.tree, *args, **kwargs))
            except Exception:
                what = f"calling the model on its inputs failed with {one_line(e)}"
                raise bad(ValueError, fn_name, what, inputs_fix) from e
            raise

    return expanded


def linearize(apply_fn: Callable, params0) -> Callable:
    """The linearisation of ``apply_fn`` in its parameters around ``params0``.

    Returns ``f_lin(params, x, *args, **kwargs)`` computing

        f_lin(θ, x) = f(θ0, x) + J(θ0, x)·(θ − θ0),   J = ∂f/∂θ at θ0,

    f = ``apply_fn``, θ0 = ``params0`` (neural-tangents' ``nt.linearize``); trained on the
    MSE it follows :func:`ntk_core.predict.gradient_descent_mse` with the NTK at θ0.
    ``f_lin`` is pure: usable under ``jax.jit``, ``jax.grad`` (in ``params``), ``jax.vmap``.

    Args:
      apply_fn: ``apply_fn(params, x, *args, **kwargs) -> outputs`` (pytree, e.g. ``(N1, O...)``).
      params0: θ0, any pytree of arrays (total size P), copied once; floating leaves are
        expanded, integer, boolean and PRNG-key leaves held at θ0.

    Returns ``f_lin``: outputs of ``apply_fn``'s structure, shapes and dtypes, for ``params``
    of θ0's (float64 NumPy data is float32 without x64); ``x``, ``*args``, ``**kwargs`` go to
    ``apply_fn`` undifferentiated; non-floating output leaves are f(θ0, x)'s.

    Raises:
      TypeError: ``apply_fn`` not callable (a Flax or Haiku model names the adapter); a
        leaf of ``params0`` not a numeric array; at call time, a leaf dtype differing from θ0's.
      ValueError: at call time, another tree structure (naming missing or added leaves) or
        leaf shape; outside ``jax.jit``, a non-floating leaf whose value differs from θ0's.

    Cost: one ``jax.jvp`` per call, about 2–3 forward passes (2.8 for a 4-layer, 256-wide
    tanh MLP under ``jax.jit``); memory of a forward pass with tangents plus P (a Jacobian:
    N1·O·P). ``jax.grad`` through ``f_lin``: about one backpropagation.

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

    References: Lee, Xiao, Schoenholz, Bahri, Novak, Sohl-Dickstein, Pennington, "Wide Neural
    Networks of Any Depth Evolve as Linear Models Under Gradient Descent", NeurIPS 2019.
    """
    fn = "linearize"
    check_apply_fn(fn, apply_fn, fn)
    return expansion(fn, apply_fn, params0, 1)


def taylor_expand(apply_fn: Callable, params0, degree: int) -> Callable:
    """The degree-``degree`` Taylor polynomial of ``apply_fn`` in its parameters at ``params0``.

    Returns ``f_taylor(params, x, *args, **kwargs)`` computing

        f_taylor(θ, x) = Σ_{k=0..degree} (1/k!) D^k f(θ0, x)[δ, ..., δ],   δ = θ − θ0

    (neural-tangents' ``nt.taylor_expand``), by ``degree`` nested ``jax.jvp`` summed in Horner
    form. ``degree=0``: f(θ0, x); ``degree=1``: :func:`linearize`; exact for a model
    polynomial in its parameters of degree ≤ ``degree``.

    Args: ``apply_fn``, ``params0`` as :func:`linearize`; ``degree``, an int in [0, 10].

    Returns ``f_taylor``, as :func:`linearize`'s ``f_lin``.

    Raises: as :func:`linearize`; TypeError: ``degree`` not an int (``True`` included);
    ValueError: ``degree`` negative or above 10 (the cost doubles with each degree).

    Cost: degree d ≥ 2: d nested JVPs, 2^d streams that ``jax.jit`` merges to about linear
    growth (4-layer, 256-wide tanh MLP, in forward passes: 2.8, 4.3, 5.8, 7.4 for d = 1–4;
    ``jax.grad``: 2.8, 8.6, 18.8 for d = 1–3); about 2^d outside ``jax.jit``. Memory: the
    live streams' activations, no Jacobian or Hessian.

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

    References: as :func:`linearize`.
    """
    fn = "taylor_expand"
    check_apply_fn(fn, apply_fn, fn)
    return expansion(fn, apply_fn, params0, check_degree(fn, degree))
