"""Empirical NTK / NNGP of Haiku models (``hk.Transformed``, ``hk.TransformedWithState``).

The adapter turns a transformed function into a pure ``apply3(params, x, aux)`` with
``aux = (state, rng)`` held fixed (the state the model returns is discarded), then
hands it to ``ntk_core`` through :mod:`ntk_core.adapters`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import haiku as hk
import jax
import jax.numpy as jnp

from ntk_core.adapters import (
    Caller,
    PureModel,
    adapter_model_failure,
    build_kernel,
    cached,
    check_apply_kwargs,
    checked_arguments,
    input_shape_mismatch,
)


def _model_apply(transformed, apply_kwargs):
    with_state = isinstance(transformed, hk.TransformedWithState)
    takes_rng = "rng" in inspect.signature(transformed.apply).parameters

    def apply3(params, x, aux):
        state, rng = aux
        args = [params]
        if with_state:
            args.append(state)
        if takes_rng:
            args.append(rng)
        out = transformed.apply(*args, x, **apply_kwargs)
        return out[0] if with_state else out

    return apply3, with_state, takes_rng


def _paths(tree) -> set[str]:
    return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}


def _foreign(fn_name: str, params, state, made) -> ValueError | None:
    """A ValueError for params (or state) whose entries differ from those
    ``transformed.init`` makes (``made``: its abstract output), else ``None``."""
    made_params, made_state = made if isinstance(made, tuple) else (made, None)
    fix = f"pass {'params, state' if made_state else 'params'} = transformed.init(key, x)"
    if (
        _paths(params) != _paths(made_params)
        and made_state
        and _paths(params) == _paths(made_state)
    ):
        return ValueError(f"{fn_name}: params holds the model's state. Fix: {fix}.")
    lacking = sorted(_paths(made_params) - _paths(params))
    if lacking:
        got = sorted(map(str, params))
        return ValueError(
            f"{fn_name}: params (modules {got}) lack {', '.join(lacking[:3])}, which "
            f"transformed.init makes. Fix: {fix} (for Flax models use ntk_flax.kernel)."
        )
    if made_state and state is not None and _paths(made_state) - _paths(state):
        return ValueError(f"{fn_name}: state lacks entries transformed.init makes. Fix: {fix}.")
    return None


def caller(name: str, *, built: bool = False, monte_carlo: bool = False) -> Caller:
    """``ntk_haiku.<name>`` as the core's messages name it, with its argument order."""
    order = "(model, x1, x2)" if monte_carlo else "(params, x1, x2)" if built else None
    return Caller(
        f"ntk_haiku.{name}",
        order or "(transformed, params, x1, x2)",
        model="the model",
        package="ntk_haiku",
        monte_carlo=monte_carlo,
        built=built,
    )


def check_transformed(fn_name: str, transformed) -> None:
    if not isinstance(transformed, (hk.Transformed, hk.TransformedWithState)):
        message = (
            f"{fn_name}: expected an hk.Transformed or hk.TransformedWithState, got "
            f"{type(transformed).__name__}. Fix: wrap the forward function: hk.transform(f)."
        )
        raise TypeError(message)


def make(caller: Caller, kind: str, transformed, options: dict, apply_kwargs=None):
    """The kernel function ``kernel(params, x1, x2=None, *, state=None, rng=None)`` of
    ``transformed`` for the public function ``caller``."""
    fn_name = caller.name
    check_transformed(fn_name, transformed)
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, "{'is_training': False}")
    apply3, with_state, takes_rng = _model_apply(transformed, apply_kwargs)

    def init(x):
        return transformed.init(jax.random.PRNGKey(0), x, **apply_kwargs)

    def failure(params, x1, aux) -> Exception | None:
        """The model's error on x1 (one abstract trace), ``None`` if it runs."""
        try:
            jax.eval_shape(apply3, params, x1, aux)
        except Exception as e:
            return e
        return None

    def check(params, x1, x2, aux):
        error = failure(params, x1, aux)
        if error is None:
            return
        state, rng = aux
        if takes_rng and rng is None and not failure(params, x1, (state, jax.random.PRNGKey(0))):
            message = (
                f"{fn_name}: the model needs a random key (e.g. dropout) but rng=None. Fix: "
                f"pass rng=jax.random.PRNGKey(0), the same key for every sample."
            )
            raise ValueError(message) from None
        try:  # what init makes, to compare with params and state (error path only)
            made = jax.eval_shape(init, x1)
        except Exception:  # init needs other model arguments (BatchNorm in eval mode)
            made = None
        problem = (
            input_shape_mismatch(
                fn_name,
                "params",
                params,
                lambda x: init(x)[0] if with_state else init(x),
                x1,
                "params = transformed.init(key, x1)",
            )
            or (made is not None and _foreign(fn_name, params, state, made))
            or adapter_model_failure(caller, "params and state" if with_state else "params", error)
        )
        raise problem from error

    def to_core(params, state=None, rng=None):
        """``(params, (state, rng))`` for the core, after checking them against the
        transform."""
        call = "params=params, state=state"
        check_state_and_rng(fn_name, with_state, takes_rng, state, rng, call)
        if not isinstance(params, Mapping):
            message = (
                f"{fn_name}: params must be the dict returned by transformed.init, got "
                f"{type(params).__name__}. Fix: pass it; the argument order is {caller.order}."
            )
            raise TypeError(message)
        if any(
            hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.integer)
            for v in jax.tree.leaves(params)
        ):
            message = (
                f"{fn_name}: params holds integer arrays, as Haiku state does (a counter). "
                f"Fix: pass params, state = transformed.init(key, x) in their places."
            )
            raise TypeError(message)
        return params, (state, rng)

    pure = PureModel(
        apply3,
        to_core,
        call_keywords=("state", "rng"),
        check=check,
        eval_hint="apply_kwargs={'is_training': False}",
    )
    return build_kernel(caller, kind, pure, options)


def check_state_and_rng(fn_name, with_state, takes_rng, state, rng, call) -> None:
    """Refuses a ``state`` / ``rng`` the transform does not take, or a missing state;
    ``call`` shows how the caller passes params and state in the fix."""
    if with_state and state is None:
        message = (
            f"{fn_name}: this hk.TransformedWithState needs its state. Fix: pass "
            f"state=state from params, state = transformed.init(key, x)."
        )
        raise ValueError(message)
    if with_state and not isinstance(state, Mapping):
        message = (
            f"{fn_name}: state must be the mapping returned by transformed.init(key, x) "
            f"(its second value), got {type(state).__name__}. Fix: pass it as {call}."
        )
        raise TypeError(message)
    if not with_state and state is not None:
        message = (
            f"{fn_name}: state was given but the model is a plain hk.Transformed. Fix: drop "
            f"state=, or use hk.transform_with_state."
        )
        raise ValueError(message)
    if rng is not None and not takes_rng:
        message = (
            f"{fn_name}: rng was given but the model was built with hk.without_apply_rng "
            f"and takes none. Fix: drop rng=."
        )
        raise ValueError(message)


def _cached(name: str, kind: str, transformed, apply_kwargs, options: dict):
    """The kernel function of ``ntk_haiku.<name>``, built once per model, apply_kwargs
    and options (:func:`ntk_core.adapters.cached`)."""
    key = (f"ntk_haiku.{name}", transformed, apply_kwargs, options)
    return cached(key, lambda: make(caller(name), kind, transformed, options, apply_kwargs))


@checked_arguments("ntk_haiku.kernel_fn")
def kernel_fn(transformed, *, apply_kwargs=None, **options) -> Callable:
    """Jitted empirical NTK of a Haiku model, reusable across training steps.

    Args:
      transformed: ``hk.Transformed`` (with or without apply rng) or
        ``hk.TransformedWithState``.
      apply_kwargs: extra keyword arguments of the forward function, e.g.
        ``{"is_training": False}``.
      **options: the kernel options of :func:`ntk_core.ntk_fn`.

    Returns:
      ``kernel(params, x1, x2=None, *, state=None, rng=None)`` -> the NTK of x1 (N1
      samples) and x2 (N2; ``None``: x1), ``(N1, N2)`` for ``(N, O)`` outputs by
      default. Only ``params`` is differentiated; ``state`` (required for
      ``hk.TransformedWithState``) and ``rng`` are held fixed.

    Raises:
      TypeError, ValueError: not a transformed function; params not this model's;
        missing or unexpected state; ``rng`` missing or not taken; a model whose samples
        interact (BatchNorm with ``is_training=True``) with ``vmap_axes=0``; the model
        failing on x1; and the errors of :func:`ntk_core.ntk_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> ntk_haiku.kernel_fn(net, trace_axes=())(net.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4, 3, 3)
    """
    return make(caller("kernel_fn", built=True), "ntk", transformed, options, apply_kwargs)


@checked_arguments("ntk_haiku.nngp_fn")
def nngp_fn(transformed, *, apply_kwargs=None, **options) -> Callable:
    """Jitted empirical NNGP kernel f(x1)·f(x2) of a Haiku model; see :func:`kernel_fn`.

    Args:
      transformed, apply_kwargs: as :func:`kernel_fn`.
      **options: those of :func:`ntk_core.nngp_fn` (no ``implementation``).

    Returns:
      ``kernel(params, x1, x2=None, *, state=None, rng=None)`` -> ``(N1, N2)`` for
      ``(N, O)`` outputs by default, in the outputs' dtype.

    Raises:
      As :func:`kernel_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> ntk_haiku.nngp_fn(net)(net.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)
    """
    return make(caller("nngp_fn", built=True), "nngp", transformed, options, apply_kwargs)


@checked_arguments("ntk_haiku.kernel")
def kernel(transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options):
    """Empirical NTK of a Haiku model between x1 and x2 (x1 if None).

    Θ(x1, x2)[i, j, a, b] = Σ_p ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p over ``params``; the
    built kernel function is cached.

    Args:
      transformed, apply_kwargs: as :func:`kernel_fn`.
      params: the params returned by ``transformed.init``.
      x1: array or pytree of arrays, batch axis 0 of size N1.
      x2: ``None`` (x2 is x1) or like x1 with N2 samples.
      state: the state of an ``hk.TransformedWithState`` (required there).
      rng: a PRNG key for models that need one, the same for every sample.

    Returns:
      ``(N1, N2)`` for ``(N, O)`` outputs by default, ``(N1, N2, O, O)`` with
      ``trace_axes=()``.

    Raises:
      As :func:`kernel_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> ntk_haiku.kernel(net, net.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)
    """
    fn = _cached("kernel", "ntk", transformed, apply_kwargs, options)
    return fn(params, x1, x2, state=state, rng=rng)


@checked_arguments("ntk_haiku.nngp")
def nngp(transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options):
    """Empirical NNGP kernel f(x1)·f(x2) of a Haiku model; see :func:`kernel`.

    Args:
      transformed, params, x1 (N1 samples), x2 (N2 or ``None``), state, rng,
        apply_kwargs: as :func:`kernel`.
      **options: those of :func:`ntk_core.nngp_fn`.

    Returns:
      ``(N1, N2)`` for ``(N, O)`` outputs by default, in the outputs' dtype.

    Raises:
      As :func:`kernel_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> ntk_haiku.nngp(net, net.init(jax.random.PRNGKey(0), x), x, trace_axes=()).shape
      (4, 4, 3, 3)
    """
    fn = _cached("nngp", "nngp", transformed, apply_kwargs, options)
    return fn(params, x1, x2, state=state, rng=rng)


@checked_arguments("ntk_haiku.kernel_per_leaf_fn")
def kernel_per_leaf_fn(transformed, *, apply_kwargs=None, **options) -> Callable:
    """Jitted empirical NTK of a Haiku model split by parameter leaf (Σ_l Θ_l = Θ).

    Args:
      transformed, apply_kwargs, **options: as :func:`kernel_fn` (``implementation``
        not ``"ntvp"``).

    Returns:
      ``kernel(params, x1, x2=None, *, state=None, rng=None)`` -> a dict like
      ``params`` of ``(N1, N2)`` kernels (by default), one per leaf.

    Raises:
      As :func:`kernel_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> k = ntk_haiku.kernel_per_leaf_fn(net)(net.init(jax.random.PRNGKey(0), x), x)
      >>> k["linear"]["w"].shape
      (4, 4)
    """
    built = caller("kernel_per_leaf_fn", built=True)
    return make(built, "ntk_per_leaf", transformed, options, apply_kwargs)


@checked_arguments("ntk_haiku.kernel_per_leaf")
def kernel_per_leaf(
    transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options
):
    """Empirical NTK of a Haiku model split by parameter leaf; the leaves sum to :func:`kernel`.

    Args:
      transformed, params, x1 (N1 samples), x2 (N2 or ``None``), state, rng,
        apply_kwargs: as :func:`kernel`.
      **options: as :func:`kernel_per_leaf_fn`.

    Returns:
      A dict like ``params`` of ``(N1, N2)`` kernels by default.

    Raises:
      As :func:`kernel_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> k = ntk_haiku.kernel_per_leaf(net, net.init(jax.random.PRNGKey(0), x), x)
      >>> sorted(k["linear"]), float(k["linear"]["b"][0, 0])  # the bias's kernel: 1
      (['b', 'w'], 1.0)
    """
    fn = _cached("kernel_per_leaf", "ntk_per_leaf", transformed, apply_kwargs, options)
    return fn(params, x1, x2, state=state, rng=rng)


@checked_arguments("ntk_haiku.plan")
def plan(transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options):
    """What :func:`kernel` with these arguments would do, without computing it.

    Args:
      transformed, params, x1 (N1 samples), x2 (N2 or ``None``), state, rng,
        apply_kwargs, **options: as :func:`kernel`.

    Returns:
      The ``Plan`` of :func:`ntk_core.plan`: the implementation chosen, estimates, and
      each parameter leaf's path, size and method.

    Raises:
      As :func:`kernel_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> p = ntk_haiku.plan(net, net.init(jax.random.PRNGKey(0), x), x)
      >>> [(leaf.path, leaf.size) for leaf in p.leaves]
      [("['linear']['b']", 3), ("['linear']['w']", 6)]
    """
    fn = _cached("plan", "ntk", transformed, apply_kwargs, options)
    return fn.plan(params, x1, x2, state=state, rng=rng)
