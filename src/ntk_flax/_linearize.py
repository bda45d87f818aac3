"""Linearized and Taylor-expanded Flax models (``flax.linen`` and ``flax.nnx``).

Builds the pure apply the kernels use (``_kernel._model_apply`` for linen,
``_nnx.model_apply`` for nnx) with every collection but the parameters held fixed at
its values at the expansion point, and hands it to ``ntk_core``'s expansion
(:func:`ntk_core.adapters.expansion`); no maths here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import flax.linen as nn
import jax
from flax import nnx

from ntk_core.adapters import check_apply_kwargs, check_degree, check_like, expansion, is_nnx_module
from ntk_flax import _nnx
from ntk_flax._kernel import _model_apply, refuse_apply_arguments


def _linen_params(fn_name: str, name: str, variables):
    """``variables["params"]``, after checking that ``variables`` is a Flax variables dict."""
    if not isinstance(variables, Mapping) or "params" not in variables:
        got = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
        message = (
            f"{fn_name}: {name} must be the dict model.init returns, with a 'params' "
            f"collection, got {got}. Fix: pass model.init(key, x), or {{'params': params}}."
        )
        raise (ValueError if isinstance(variables, Mapping) else TypeError)(message)
    return variables["params"]


def _linen_parts(fn_name: str, model, variables, method, apply_kwargs):
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, "{'train': False}")
    refuse_apply_arguments(fn_name, apply_kwargs, False, False)
    if variables is None:
        message = (
            f"{fn_name}: variables is None, but a flax.linen module holds no parameters. "
            f"Fix: pass the expansion point, variables = model.init(key, x)."
        )
        raise ValueError(message)
    params0 = _linen_params(fn_name, "variables", variables)
    rest0 = {k: v for k, v in variables.items() if k != "params"}  # held fixed
    apply3 = _model_apply(model, method, apply_kwargs)

    def apply(params, x):
        return apply3(params, x, (rest0, None))

    def params_of(variables):
        return _linen_params(fn_name, "variables", variables)

    names = dict(
        params_name="variables['params']",
        point_arg="variables['params']",
        point_name=f"the variables given to {fn_name}",
    )
    return apply, params0, params_of, names


def _nnx_parts(fn_name: str, model, variables, method, apply_kwargs):
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, "{'deterministic': True}")
    apply3 = _nnx.model_apply(_nnx._method(fn_name, model, method), apply_kwargs)
    graphdef, params0, rest = nnx.split(model, nnx.Param, ...)
    rest0 = jax.tree.map(lambda a: a, rest)  # new Variables: in-place updates don't reach
    point_name = f"the module's nnx.Param state when {fn_name} was called"
    if variables is not None:  # another expansion point of the same structure
        if is_nnx_module(variables):
            variables = nnx.state(variables, nnx.Param)
        check_like(fn_name, variables, params0, "variables", "the module's nnx.Param state")
        params0 = variables
        point_name = f"the variables given to {fn_name}"

    def apply(params, x):
        return apply3(params, x, (graphdef, rest0))

    def params_of(params):
        return nnx.state(params, nnx.Param) if is_nnx_module(params) else params

    names = dict(params_name="params", point_arg="variables", point_name=point_name)
    return apply, params0, params_of, names


def _expanded(fn_name: str, degree: int, model, variables, method, apply_kwargs) -> Callable:
    if is_nnx_module(model):
        parts = _nnx_parts(fn_name, model, variables, method, apply_kwargs)
    elif isinstance(model, nn.Module):
        parts = _linen_parts(fn_name, model, variables, method, apply_kwargs)
    else:
        message = (
            f"{fn_name}: model must be a flax.linen.Module or a flax.nnx.Module, got "
            f"{type(model).__name__}. Fix: pass the module instance (a plain apply_fn(params, "
            f"x) goes to ntk_core.{fn_name.split('.')[-1]})."
        )
        raise TypeError(message)
    apply, params0, params_of, names = parts
    expanded = expansion(fn_name, apply, params0, degree, **names)

    def f(params, x):
        return expanded(params_of(params), x)

    return f


def linearize(
    model, variables=None, *, method: str | Callable | None = None, apply_kwargs=None
) -> Callable:
    """The linearisation of a Flax model in its parameters around ``variables``.

    f_lin(θ, x) = f(θ0, x) + J(θ0, x)·(θ − θ0), with θ the model's parameters (the
    ``params`` collection for linen, the ``nnx.Param`` variables for nnx) and θ0 those of
    ``variables``; see :func:`ntk_core.linearize` (one ``jax.jvp`` per call, no
    Jacobian). Every other collection or variable (BatchNorm statistics, RNG state) is
    held fixed at its value at the expansion point, like the kernels do.

    - ``flax.linen``: returns ``f_lin(variables, x)``; only ``variables["params"]`` is
      read, so ``{"params": params}`` suffices (other collections given are ignored).
    - ``flax.nnx``: returns ``f_lin(params, x)`` with ``params`` an
      ``nnx.State`` of ``nnx.Param`` variables, ``nnx.state(model, nnx.Param)`` (what
      ``nnx.split(model, nnx.Param, ...)`` and optax training of that state give), or an
      nnx module of the same structure, whose ``nnx.Param`` state is read. The
      expansion point is the module's state when ``linearize`` is called (copied:
      later in-place updates of the module do not move it), or ``variables``. Call
      ``model.eval()`` first for BatchNorm and Dropout in evaluation mode (in training
      mode the expansion normalises by each batch's statistics and, its RNG state being
      held fixed too, draws the same dropout mask at every call).

    ``f_lin`` is pure: use it inside ``jax.jit`` and ``jax.grad`` (to train the
    linearised model).

    Args:
      model: a ``flax.linen.Module`` or a ``flax.nnx.Module``.
      variables: linen: the dict returned by ``model.init`` (``params`` plus any other
        collections); nnx: ``None`` (the module's own ``nnx.Param`` state) or such a
        state.
      method: the method applied (a name or function for linen, a name for nnx);
        default ``__call__``.
      apply_kwargs: extra keyword arguments of the model, e.g. ``{"train": False}``.

    Returns:
      ``f_lin(params_or_variables, x)`` with the model's outputs, e.g. ``(N1, O)`` for
      a batch x of N1 samples, in the model's dtypes.

    Raises:
      TypeError: ``model`` not a linen or nnx module; linen ``variables`` not a dict;
        ``apply_kwargs`` holding ``mutable``, ``rngs`` or ``method``; an nnx ``method``
        the module does not have; at call time, a parameter of another dtype.
      ValueError: linen ``variables`` without ``params`` or ``None``; nnx ``variables``
        (or, at call time, parameters) of another structure or shape than the
        module's ``nnx.Param`` state; at call time, linen parameters of another
        structure or shape than ``variables["params"]``.

    Cost: as :func:`ntk_core.linearize`: one JVP (about 2–3 forward passes) per call,
    memory of a forward pass (no N1·O·P Jacobian).

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import ntk_flax
      >>> model = nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(1)])
      >>> x = jnp.ones((4, 2))                           # N1 = 4 samples
      >>> variables = model.init(jax.random.PRNGKey(0), x)
      >>> f_lin = ntk_flax.linearize(model, variables)
      >>> f_lin(variables, x).shape                      # (N1, O)
      (4, 1)
      >>> bool(jnp.allclose(f_lin(variables, x), model.apply(variables, x)))
      True

      nnx: a function of the ``nnx.Param`` state.

      >>> from flax import nnx
      >>> module = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
      >>> f_lin = ntk_flax.linearize(module)
      >>> f_lin(nnx.state(module, nnx.Param), x).shape
      (4, 3)

    References:
      Lee et al., "Wide Neural Networks of Any Depth Evolve as Linear Models Under
      Gradient Descent", NeurIPS 2019.
    """
    return _expanded("ntk_flax.linearize", 1, model, variables, method, apply_kwargs)


def taylor_expand(
    model, variables, degree: int, *, method: str | Callable | None = None, apply_kwargs=None
) -> Callable:
    """The degree-``degree`` Taylor polynomial of a Flax model in its parameters.

    f_taylor(θ, x) = Σ_{k=0..degree} (1/k!) D^k f(θ0, x)[θ − θ0, ..., θ − θ0] by nested
    ``jax.jvp`` (see :func:`ntk_core.taylor_expand`), with θ and θ0 and the returned
    function's arguments as in :func:`linearize`: ``f_taylor(variables, x)`` for linen,
    ``f_taylor(params, x)`` for nnx (pass ``variables=None`` for the module's own
    state). ``degree=1`` is :func:`linearize`.

    Args:
      model, variables, method, apply_kwargs: as in :func:`linearize` (``variables``
        positional: ``None`` for an nnx module's own state).
      degree: a non-negative int.

    Returns:
      ``f_taylor(params_or_variables, x)``: the model's outputs, e.g. ``(N1, O)`` for
      N1 samples.

    Raises:
      TypeError: as :func:`linearize`, and ``degree`` not an int.
      ValueError: as :func:`linearize`, and a negative ``degree``.

    Cost: as :func:`ntk_core.taylor_expand`: ``degree`` nested JVPs per call (under
    ``jax.jit`` about 4 forward passes at degree 2 and 6 at degree 3; outside it up to
    2^degree), memory independent of N1·O·P.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import ntk_flax
      >>> model = nn.Dense(3)                            # linear in its parameters
      >>> x = jnp.ones((4, 2))
      >>> v0 = model.init(jax.random.PRNGKey(0), x)
      >>> v1 = jax.tree.map(lambda p: p + 1.0, v0)
      >>> f2 = ntk_flax.taylor_expand(model, v0, 2)
      >>> bool(jnp.allclose(f2(v1, x), model.apply(v1, x)))
      True

    References:
      Lee et al., "Wide Neural Networks of Any Depth Evolve as Linear Models Under
      Gradient Descent", NeurIPS 2019.
    """
    degree = check_degree("ntk_flax.taylor_expand", degree)
    return _expanded("ntk_flax.taylor_expand", degree, model, variables, method, apply_kwargs)
