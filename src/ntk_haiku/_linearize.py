"""Linearized and Taylor-expanded Haiku models: the kernels' pure apply, ``state`` and
``rng`` held fixed, handed to :func:`ntk_core.adapters.expansion`."""

from __future__ import annotations

from collections.abc import Callable

from ntk_core.adapters import check_apply_kwargs, check_degree, expansion
from ntk_core.adapters import check_inputs_option as check_inputs
from ntk_haiku import _kernel


def _expanded(fn: Callable, degree: int, transformed, params0, state, rng, apply_kwargs, inputs):
    fn_name = f"{_kernel._PACKAGE}.{fn.__name__}"
    degree = check_degree(fn_name, degree)
    _kernel.check_transformed(fn_name, transformed)
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, _kernel._EVAL)
    inputs = check_inputs(fn_name, inputs)
    apply3, with_state, takes_rng = _kernel._model_apply(transformed, apply_kwargs, inputs, fn_name)
    _kernel.check_state_and_rng(fn_name, with_state, takes_rng, state, rng)
    _kernel.check_params(fn_name, "params0", params0, f"pass params0 = {_kernel._INIT}")

    def apply(params, x):
        return apply3(params, x, (state, rng))

    return expansion(fn_name, apply, params0, degree)


def linearize(
    transformed, params0, *, state=None, rng=None, apply_kwargs=None, inputs="x"
) -> Callable:
    """The linearisation f_lin(θ, x) = f(θ0, x) + J(θ0, x)·(θ − θ0) of a Haiku model in its
    parameters, θ0 = ``params0``; ``state`` and ``rng`` held fixed at the values given (the
    returned state dropped). Maths and cost: :func:`ntk_core.linearize`.

    Args:
      transformed, state, rng, apply_kwargs, inputs: as :func:`ntk_haiku.kernel` (x: f_lin's).
      params0: the params returned by ``transformed.init``: the expansion point.
    Returns:
      Pure ``f_lin(params, x)``, ``params`` like ``params0``: the outputs, e.g. ``(N1, O)``.
    Raises:
      TypeError: not a transformed function; ``params0`` or ``state`` not a mapping; at
        call time, a parameter of another dtype than in ``params0``.
      ValueError: a missing or unexpected ``state``; ``rng`` for a transform that takes
        none; at call time, ``params`` of another structure or leaf shape.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([8, 1])(x)))
      >>> x = jnp.ones((4, 2))
      >>> params0 = net.init(jax.random.PRNGKey(0), x)
      >>> f_lin = ntk_haiku.linearize(net, params0)
      >>> bool(jnp.allclose(f_lin(params0, x), net.apply(params0, x)))
      True

    References: Lee et al., NeurIPS 2019, as :func:`ntk_core.linearize`.
    """
    return _expanded(linearize, 1, transformed, params0, state, rng, apply_kwargs, inputs)


def taylor_expand(
    transformed, params0, degree: int, *, state=None, rng=None, apply_kwargs=None, inputs="x"
) -> Callable:
    """The degree-``degree`` Taylor polynomial of a Haiku model in its parameters:
    Σ_{k=0..degree} (1/k!) D^k f(θ0, x)[θ − θ0, ...]; maths and cost:
    :func:`ntk_core.taylor_expand`. ``degree=1`` is :func:`linearize`.

    Args:
      transformed, params0, state, rng, apply_kwargs, inputs: as :func:`linearize`.
      degree: an int in [0, 10].
    Returns:
      ``f_taylor(params, x)``: the outputs, e.g. ``(N1, O)``.
    Raises:
      TypeError, ValueError: as :func:`linearize`; ``degree`` not an int, or outside [0, 10].
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x)))
      >>> x = jnp.ones((4, 2))
      >>> p0 = net.init(jax.random.PRNGKey(0), x)
      >>> f0 = ntk_haiku.taylor_expand(net, p0, 0)  # degree 0: f(params0, x)
      >>> bool(jnp.allclose(f0(jax.tree.map(lambda p: p + 1.0, p0), x), net.apply(p0, x)))
      True

    References: Lee et al., NeurIPS 2019 (as :func:`linearize`).
    """
    args = (transformed, params0, state, rng, apply_kwargs, inputs)
    return _expanded(taylor_expand, degree, *args)
