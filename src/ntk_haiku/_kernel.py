"""Empirical NTK / NNGP of Haiku models (``hk.Transformed``, ``hk.TransformedWithState``):
``params`` differentiated, ``aux = (state, rng)`` held fixed (the returned state dropped).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from ntk_core.adapters import (
    Caller,
    PureModel,
    adapter_caller,
    bad,
    build_kernel,
    cached,
    check_apply_kwargs,
    checked_arguments,
    entry_kind,
    input_shape_mismatch,
    keyed,
)
from ntk_core.adapters import check_inputs_option as check_inputs
from ntk_core.adapters import inputs_failure as failure
from ntk_core.adapters import spread_inputs as spread

_PACKAGE, _INIT, _EVAL = "ntk_haiku", "transformed.init(key, x)", "{'is_training': False}"


def _model_apply(transformed, apply_kwargs, inputs, fn_name):
    with_state = isinstance(transformed, hk.TransformedWithState)
    takes_rng = "rng" in inspect.signature(transformed.apply).parameters

    def apply3(params, x, aux):
        state, rng = aux
        args = [params, *([state] if with_state else []), *([rng] if takes_rng else [])]
        x_args, kw = spread(fn_name, inputs, x, "x")
        out = transformed.apply(*args, *x_args, **kw, **apply_kwargs)
        return out[0] if with_state else out

    # equal for an equal transform and arguments: built again, nothing recompiles (issue 48)
    apply3 = keyed(apply3, "haiku", transformed, apply_kwargs, inputs, fn_name)
    return apply3, with_state, takes_rng


def _paths(tree) -> set[str]:
    return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}


def _foreign(fn_name: str, params, state, made) -> ValueError | None:
    """Params (or state) whose entries differ from those ``made`` by init, else None."""
    made_params, made_state = made if isinstance(made, tuple) else (made, None)
    fix = f"pass {'params, state' if made_state else 'params'} = {_INIT}"
    got, want = _paths(params), _paths(made_params)
    if got != want and made_state and got == _paths(made_state):
        return bad(ValueError, fn_name, "params holds the model's state", fix)
    lacking = sorted(want - got)
    if lacking:
        what = f"params (modules {sorted(map(str, params))}) lack {', '.join(lacking[:3])}"
        fix += " (for Flax models use ntk_flax.kernel)"
        return bad(ValueError, fn_name, what + ", which transformed.init makes", fix)
    if made_state and state is not None and _paths(made_state) - _paths(state):
        return bad(ValueError, fn_name, "state lacks entries transformed.init makes", fix)
    return None


def caller(fn: Callable, *, built: bool = False, monte_carlo: bool = False) -> Caller:
    """``fn`` as the core's messages name it, with the positional arguments of :func:`kernel`
    (``built``: of the kernel function it returns; ``monte_carlo``: ``fn``'s own)."""
    return adapter_caller(_PACKAGE, fn, kernel, built=built, monte_carlo=monte_carlo)


def check_transformed(fn_name: str, transformed) -> None:
    if not isinstance(transformed, (hk.Transformed, hk.TransformedWithState)):
        what = "expected an hk.Transformed or hk.TransformedWithState, got "
        fix = "wrap the forward function: hk.transform(f)"
        raise bad(TypeError, fn_name, what + type(transformed).__name__, fix)


def make(caller: Caller, kind: str, transformed, options: dict, apply_kwargs=None):
    """``kernel(params, x1, x2=None, *, state=None, rng=None)``; ``options``: core's, ``inputs``."""
    fn_name, options = caller.name, dict(options)
    check_transformed(fn_name, transformed)
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, _EVAL)
    inputs = check_inputs(fn_name, options.pop("inputs", "x"))
    apply3, with_state, takes_rng = _model_apply(transformed, apply_kwargs, inputs, fn_name)
    params_name = "params and state" if with_state else "params"

    def init(x):
        args, kw = spread(fn_name, inputs, x)
        return transformed.init(jax.random.PRNGKey(0), *args, **kw, **apply_kwargs)

    def call(x):  # the model's own call, its arrays left out
        args, kw = spread(fn_name, inputs, x)
        fixed = (None,) * (1 + with_state + takes_rng)
        return transformed.apply, (*fixed, *args), {**kw, **apply_kwargs}

    def fails(params, x1, aux) -> Exception | None:  # the error of one abstract trace
        try:
            jax.eval_shape(apply3, params, x1, aux)
        except Exception as e:
            return e
        return None

    def check(params, x1, x2, aux):
        spread(fn_name, inputs, x1)  # a TypeError for an x1 of another kind than inputs's
        error = fails(params, x1, aux)
        if error is None:
            return
        state, rng = aux
        if takes_rng and rng is None and not fails(params, x1, (state, jax.random.PRNGKey(0))):
            what = "the model needs a random key (e.g. dropout) but rng=None"
            fix = "pass rng=jax.random.PRNGKey(0), the same key for every sample"
            raise bad(ValueError, fn_name, what, fix) from None
        try:  # what init makes, to compare with params and state (error path only)
            made = jax.eval_shape(init, x1)
        except Exception:  # init needs other model arguments (BatchNorm in eval mode)
            made = None
        made_params = lambda x: init(x)[0] if with_state else init(x)  # noqa: E731
        point = "params = transformed.init(key, x1)"
        problem = (
            input_shape_mismatch(fn_name, "params", params, made_params, x1, point)
            or (made is not None and _foreign(fn_name, params, state, made))
            or failure(caller, params_name, error, f"apply_kwargs={_EVAL}", call=call(x1))
        )
        raise problem from error

    def to_core(params, state=None, rng=None):
        """``(params, (state, rng))`` for the core, checked against the transform."""
        if with_state and state is None and isinstance(params, tuple) and len(params) == 2:
            what = "params is a tuple of two, as transformed.init returns (params, state)"
            raise bad(ValueError, fn_name, what, "pass params, state=state")
        check_state_and_rng(fn_name, with_state, takes_rng, state, rng)
        check_params(fn_name, "params", params, f"pass it; the argument order is {caller.order}")
        leaves = jax.tree.leaves(params)
        if any(hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.integer) for v in leaves):
            what = "params holds integer arrays, as Haiku state does (a counter)"
            raise bad(TypeError, fn_name, what, f"pass params, state = {_INIT} in their places")
        return params, (state, rng)

    pure = PureModel(apply3, to_core, ("state", "rng"), check, f"apply_kwargs={_EVAL}")
    return build_kernel(caller, kind, pure, options)


def check_params(fn_name: str, name: str, params, fix: str) -> None:
    """Refuses ``params`` (named ``name``) that are not a mapping, as ``transformed.init``'s."""
    if not isinstance(params, Mapping):
        what = f"{name} must be the dict returned by transformed.init, got {type(params).__name__}"
        raise bad(TypeError, fn_name, what, fix)


def check_state_and_rng(fn_name, with_state, takes_rng, state, rng) -> None:
    """Refuses a missing state, or a state / rng the transform does not take."""
    fix = f"pass state=state from params, state = {_INIT}"
    if with_state and state is None:
        raise bad(ValueError, fn_name, "this hk.TransformedWithState needs its state", fix)
    if with_state and not isinstance(state, Mapping):
        what = f"state must be the mapping returned by {_INIT} (its second value), got "
        raise bad(TypeError, fn_name, what + type(state).__name__, fix)
    if not with_state and state is not None:
        what = "state was given but the model is a plain hk.Transformed"
        raise bad(ValueError, fn_name, what, "drop state=, or use hk.transform_with_state")
    if rng is not None and not takes_rng:
        what = "rng was given but the model was built with hk.without_apply_rng and takes none"
        raise bad(ValueError, fn_name, what, "drop rng=")
    if rng is not None and not isinstance(rng, jax.Array | np.ndarray):  # e.g. rng=0
        what = f"rng must be a PRNG key, got {type(rng).__name__} {rng!r:.40}"
        raise bad(TypeError, fn_name, what, "pass rng=jax.random.PRNGKey(0)")


def public(fn: Callable) -> Callable:
    """``checked_arguments`` naming ``ntk_haiku.<fn.__name__>``."""
    return checked_arguments(f"{_PACKAGE}.{fn.__name__}")(fn)


def _kernel_of(fn: Callable, transformed, apply_kwargs, options: dict):
    """The kernel function of the entry point ``fn``: new for ``*_fn``, else cached."""
    kind, built = entry_kind(fn)

    def build():
        return make(caller(fn, built=built), kind, transformed, options, apply_kwargs)

    return build() if built else cached((fn, transformed, apply_kwargs, options), build)


@public
def kernel_fn(transformed, *, apply_kwargs=None, **options) -> Callable:
    """:func:`kernel` built once: ``kernel(params, x1, x2=None, *, state=None, rng=None)``.

    Args: ``transformed`` an ``hk.Transformed`` (with or without apply rng) or
    ``hk.TransformedWithState``; ``apply_kwargs`` the forward function's keyword
    arguments, e.g. ``{"is_training": False}``; ``inputs`` how x1 / x2 reach the forward
    function: ``"x"`` (default) as its one argument, ``"args"`` a tuple ``f(*x)``,
    ``"kwargs"`` a dict ``f(**x)`` (every array with N on axis 0, e.g. ids and mask).
    Returns: the kernel function, whose results are :func:`kernel`'s.
    Raises: TypeError, ValueError: not a transformed function; params not this model's;
    missing or unexpected state; ``rng`` missing or not taken; a model whose samples
    interact (BatchNorm with ``is_training=True``) with ``vmap_axes=0``; the model failing
    on x1; ``inputs`` not one of the three, or x1 not the tuple / dict it names.
    Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> ntk_haiku.kernel_fn(net, trace_axes=())(net.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4, 3, 3)
    """
    return _kernel_of(kernel_fn, transformed, apply_kwargs, options)


@public
def nngp_fn(transformed, *, apply_kwargs=None, **options) -> Callable:
    """:func:`nngp` built once: ``kernel(params, x1, x2=None, *, state=None, rng=None)``.

    Args: as :func:`kernel_fn`; ``**options``: :func:`ntk_core.nngp_fn`'s.
    Returns: the kernel function, whose results are :func:`nngp`'s.
    Raises: as :func:`kernel_fn`. Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> ntk_haiku.nngp_fn(net)(net.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)
    """
    return _kernel_of(nngp_fn, transformed, apply_kwargs, options)


@public
def kernel(transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options):
    """Empirical NTK Θ(x1, x2)[i, j, a, b] = Σ_p ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p of a
    Haiku model, θ = ``params``; ``state`` and ``rng`` held fixed.

    Args: ``transformed``, ``apply_kwargs``, ``inputs`` as :func:`kernel_fn`; ``params`` from
    ``transformed.init``; ``x1`` N1 samples on axis 0; ``x2`` N2 samples, or ``None`` for
    x1; ``state`` an ``hk.TransformedWithState``'s (required there); ``rng`` a PRNG key
    for models that need one, the same for every sample.
    Returns: ``(N1, N2)`` for ``(N, O)`` outputs by default, ``(N1, N2, O, O)`` with
    ``trace_axes=()``.
    Raises: as :func:`kernel_fn`. Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> ntk_haiku.kernel(net, net.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)
    """
    fn = _kernel_of(kernel, transformed, apply_kwargs, options)
    return fn(params, x1, x2, state=state, rng=rng)


@public
def nngp(transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options):
    """Empirical NNGP kernel K[i, j, a, b] = f_a(x1_i) · f_b(x2_j) of a Haiku model.

    Args: as :func:`kernel`; ``**options``: :func:`ntk_core.nngp_fn`'s.
    Returns: ``(N1, N2)`` for ``(N, O)`` outputs by default, in the outputs' dtype.
    Raises: as :func:`kernel_fn`. Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> ntk_haiku.nngp(net, net.init(jax.random.PRNGKey(0), x), x, trace_axes=()).shape
      (4, 4, 3, 3)
    """
    fn = _kernel_of(nngp, transformed, apply_kwargs, options)
    return fn(params, x1, x2, state=state, rng=rng)


@public
def pntk_fn(transformed, *, apply_kwargs=None, **options) -> Callable:
    """:func:`pntk` built once: ``kernel(params, x1, x2=None, *, state=None, rng=None)``.

    Args: as :func:`kernel_fn` (no ``trace_axes``). Returns: the kernel function, whose
    results are :func:`pntk`'s. Raises: as :func:`kernel_fn`. Options, Cost and
    References: see :func:`ntk_core.pntk_fn`.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> ntk_haiku.pntk_fn(net)(net.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)
    """
    return _kernel_of(pntk_fn, transformed, apply_kwargs, options)


@public
def pntk(transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options):
    """Pseudo-NTK of a Haiku model: the NTK of Σ_a f_a / √O, ``(N1, N2)`` at the cost of
    one output (:func:`ntk_core.pntk_fn`: its relation to the full and traced NTK).

    Args: as :func:`kernel` (no ``trace_axes``). Returns: ``(N1, N2)`` (``(N1,)`` with
    ``diagonal_axes=(0,)``). Raises: as :func:`kernel_fn`; TypeError for ``trace_axes``.
    Options, Cost and References: see :func:`ntk_core.pntk_fn`.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> ntk_haiku.pntk(net, net.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)
    """
    fn = _kernel_of(pntk, transformed, apply_kwargs, options)
    return fn(params, x1, x2, state=state, rng=rng)


@public
def kernel_per_leaf_fn(transformed, *, apply_kwargs=None, **options) -> Callable:
    """:func:`kernel_per_leaf` built once: ``kernel(params, x1, x2=None, *, state, rng)``.

    Args: as :func:`kernel_fn` (``implementation`` not ``"ntvp"``).
    Returns: the kernel function, whose results are :func:`kernel_per_leaf`'s.
    Raises: as :func:`kernel_fn`. Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> k = ntk_haiku.kernel_per_leaf_fn(net)(net.init(jax.random.PRNGKey(0), x), x)
      >>> k["linear"]["w"].shape
      (4, 4)
    """
    return _kernel_of(kernel_per_leaf_fn, transformed, apply_kwargs, options)


@public
def kernel_per_leaf(
    transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options
):
    """:func:`kernel` split by parameter leaf: Θ_l, with Σ_l Θ_l = Θ.

    Args: as :func:`kernel` (``implementation`` not ``"ntvp"``).
    Returns: a dict like ``params`` of ``(N1, N2)`` kernels by default.
    Raises: as :func:`kernel_fn`. Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> k = ntk_haiku.kernel_per_leaf(net, net.init(jax.random.PRNGKey(0), x), x)
      >>> sorted(k["linear"]), float(k["linear"]["b"][0, 0])  # the bias's kernel: 1
      (['b', 'w'], 1.0)
    """
    fn = _kernel_of(kernel_per_leaf, transformed, apply_kwargs, options)
    return fn(params, x1, x2, state=state, rng=rng)


@public
def plan(transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options):
    """What :func:`kernel` with these arguments would do, not computed.

    Args: as :func:`kernel`.
    Returns: :func:`ntk_core.plan`'s ``Plan`` (implementation, estimates, each leaf's
    path, size and method).
    Raises: as :func:`kernel_fn`. Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> p = ntk_haiku.plan(net, net.init(jax.random.PRNGKey(0), x), x)
      >>> [(leaf.path, leaf.size) for leaf in p.leaves]
      [("['linear']['b']", 3), ("['linear']['w']", 6)]
    """
    fn = _kernel_of(plan, transformed, apply_kwargs, options)
    return fn.plan(params, x1, x2, state=state, rng=rng)
