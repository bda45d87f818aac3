"""Linearized and Taylor-expanded Flax models: the kernels' pure apply, other collections
held at the expansion point, handed to :func:`ntk_core.adapters.expansion`."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import flax.linen as nn
import jax
from flax import nnx

from ntk_core.adapters import (
    bad,
    check_apply_kwargs,
    check_degree,
    check_like,
    expansion,
    is_nnx_module,
)
from ntk_core.adapters import check_inputs_option as check_inputs
from ntk_flax import _nnx
from ntk_flax._kernel import _PACKAGE, _model_apply, not_a_module, refuse_apply_arguments
from ntk_flax._variables import PARAMS


def _linen_params(fn_name: str, variables):
    """``variables["params"]``, after checking that ``variables`` is a Flax variables dict."""
    if not isinstance(variables, Mapping) or PARAMS not in variables:
        got = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
        what = "variables must be the dict model.init returns, with a 'params' collection, got "
        cls = ValueError if isinstance(variables, Mapping) else TypeError
        raise bad(cls, fn_name, f"{what}{got}", "pass model.init(key, x), or {'params': params}")
    return variables[PARAMS]


def _linen_parts(fn_name: str, model, variables, method, apply_kwargs, inputs):
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, _nnx.TRAIN_OFF)
    refuse_apply_arguments(fn_name, apply_kwargs)
    if variables is None:
        what = "variables is None, but a flax.linen module holds no parameters"
        raise bad(ValueError, fn_name, what, "pass the expansion point, model.init(key, x)")
    params0 = _linen_params(fn_name, variables)
    rest0 = {k: v for k, v in variables.items() if k != PARAMS}  # held fixed
    apply3 = _model_apply(model, method, apply_kwargs, inputs, fn_name)

    def apply(params, x):
        return apply3(params, x, (rest0, None))

    def params_of(variables):
        return _linen_params(fn_name, variables)

    at = "variables['params']"
    return apply, params0, params_of, dict(params_name=at, point_arg=at)


def _nnx_parts(fn_name: str, model, variables, method, apply_kwargs, inputs):
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, _nnx.DETERMINISTIC)
    apply3 = _nnx.model_apply(_nnx._method(fn_name, model, method), apply_kwargs, inputs, fn_name)
    graphdef, params0, rest = nnx.split(model, nnx.Param, ...)
    rest0 = jax.tree.map(lambda a: a, rest)  # new Variables: in-place updates don't reach
    names = dict(params_name="params", point_arg="variables")
    if variables is None:
        names.update(point_name=f"the module's {_nnx.PARAM} when {fn_name} was called")
    else:  # another expansion point of the same structure
        if is_nnx_module(variables):
            variables = nnx.state(variables, nnx.Param)
        check_like(fn_name, variables, params0, "variables", f"the module's {_nnx.PARAM}")
        params0 = variables

    def apply(params, x):
        return apply3(params, x, (graphdef, rest0))

    def params_of(params):
        return nnx.state(params, nnx.Param) if is_nnx_module(params) else params

    return apply, params0, params_of, names


def _expanded(fn: Callable, degree: int, model, variables, method, apply_kwargs, inputs):
    fn_name = f"{_PACKAGE}.{fn.__name__}"
    degree = check_degree(fn_name, degree)
    args = (fn_name, model, variables, method, apply_kwargs, check_inputs(fn_name, inputs))
    if is_nnx_module(model):
        parts = _nnx_parts(*args)
    elif isinstance(model, nn.Module):
        parts = _linen_parts(*args)
    else:
        fix = f"pass the module (a plain apply_fn goes to ntk_core.{fn.__name__})"
        raise not_a_module(fn_name, model, fix)
    apply, params0, params_of, names = parts
    names.setdefault("point_name", f"the variables given to {fn_name}")
    expanded = expansion(fn_name, apply, params0, degree, **names)

    def f(params, x):
        return expanded(params_of(params), x)

    return f


def linearize(model, variables=None, *, method=None, apply_kwargs=None, inputs="x") -> Callable:
    """The linearisation f_lin(θ, x) = f(θ0, x) + J(θ0, x)·(θ − θ0) of a Flax model in its
    parameters θ (linen: ``params``; nnx: the ``nnx.Param`` variables), θ0 those of
    ``variables``; other collections and variables are held at their θ0 values. Maths
    and cost: :func:`ntk_core.linearize`.

    Args:
      model: a ``flax.linen.Module`` or a ``flax.nnx.Module`` (``model.eval()`` first for
        BatchNorm and Dropout in evaluation mode).
      variables: linen: ``model.init``'s dict (only ``params`` is read); nnx: ``None``
        (the module's ``nnx.Param`` state now, copied) or such a state.
      method, apply_kwargs, inputs: as :func:`ntk_flax.kernel_fn` (x: f_lin's).
    Returns:
      Pure ``f_lin(variables, x)`` (nnx: ``f_lin(params, x)``, ``params`` an ``nnx.Param``
      state or a module of the same structure): the outputs, e.g. ``(N1, O)``.
    Raises:
      TypeError: ``model`` not a linen or nnx module; linen ``variables`` not a dict;
        ``apply_kwargs`` holding ``mutable``, ``rngs`` or ``method``; an nnx ``method``
        the module lacks; at call time, a parameter of another dtype.
      ValueError: linen ``variables`` without ``params`` or ``None``; ``variables`` or
        call-time parameters of another structure or shape than θ0.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(1)]), jnp.ones((4, 2))
      >>> variables = model.init(jax.random.PRNGKey(0), x)
      >>> f_lin = ntk_flax.linearize(model, variables)
      >>> bool(jnp.allclose(f_lin(variables, x), model.apply(variables, x)))
      True
      >>> from flax import nnx
      >>> module = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
      >>> ntk_flax.linearize(module)(nnx.state(module, nnx.Param), x).shape
      (4, 3)

    References: Lee et al., NeurIPS 2019, as :func:`ntk_core.linearize`.
    """
    return _expanded(linearize, 1, model, variables, method, apply_kwargs, inputs)


def taylor_expand(
    model, variables, degree: int, *, method=None, apply_kwargs=None, inputs="x"
) -> Callable:
    """The degree-``degree`` Taylor polynomial of a Flax model in its parameters:
    Σ_{k=0..degree} (1/k!) D^k f(θ0, x)[θ − θ0, ...]; maths and cost:
    :func:`ntk_core.taylor_expand`. ``degree=1`` is :func:`linearize`.

    Args:
      model, variables, method, apply_kwargs, inputs: as :func:`linearize`.
      degree: an int in [0, 10].
    Returns:
      ``f_taylor(variables, x)`` as :func:`linearize`'s ``f_lin``, e.g. ``(N1, O)``.
    Raises:
      TypeError, ValueError: as :func:`linearize`; ``degree`` not an int, or outside [0, 10].
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))  # linear in its parameters
      >>> v0 = model.init(jax.random.PRNGKey(0), x)
      >>> v1 = jax.tree.map(lambda p: p + 1.0, v0)
      >>> bool(jnp.allclose(ntk_flax.taylor_expand(model, v0, 2)(v1, x), model.apply(v1, x)))
      True

    References: Lee et al., NeurIPS 2019 (as :func:`linearize`).
    """
    return _expanded(taylor_expand, degree, model, variables, method, apply_kwargs, inputs)
