"""Empirical NTK / NNGP of ``flax.nnx`` modules: each call splits the module as it is
(``nnx.split(model, nnx.Param, ...)``); ``nnx.Param`` is differentiated, the graph and
other state travel in ``aux``, held fixed (``.eval()`` / ``.train()`` recompile)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import flax.errors
import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ntk_core.adapters import Caller, PureModel, bad, build_kernel, check_apply_kwargs, keyed
from ntk_core.adapters import inputs_failure as failure
from ntk_core.adapters import spread_inputs as spread
from ntk_flax._variables import names, shown

PARAM, DETERMINISTIC, TRAIN_OFF = "nnx.Param state", "{'deterministic': True}", "{'train': False}"


def _method(fn_name: str, model, method) -> str:
    if method is None:
        return type(model).__call__.__name__
    if not isinstance(method, str) or not callable(getattr(model, method, None)):
        what = f"method must name a method of the nnx module {type(model).__name__}, got {method!r}"
        raise bad(TypeError, fn_name, what, "pass its name, or method=None for __call__")
    return method


#: ``nnx.Variable``, and flax < 0.12's separate ``nnx.VariableState`` (0.12: a lazy alias).
_VARIABLE_CLASSES = (nnx.Variable,) + tuple(
    c for c in (vars(nnx).get("VariableState"),) if isinstance(c, type)
)


def _variables(rest) -> list[tuple[str, type]]:
    """(path, variable type) of each array leaf of an nnx state, in leaf order."""
    found, is_variable = [], lambda v: isinstance(v, _VARIABLE_CLASSES)
    for path, v in jax.tree_util.tree_leaves_with_path(rest, is_leaf=is_variable):
        kind = getattr(v, "type", type(v))
        keys = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        found += [(keys, kind)] * len(jax.tree.leaves(v))
    return found


# Variables a call may write without changing the function: outputs of the call
# (sow's Intermediate, perturb's Perturbation), read by no later call.
_OUTPUTS = tuple(
    t for t in (getattr(nnx, "Intermediate", None), getattr(nnx, "Perturbation", None)) if t
)


def _abstract(tree):
    def one(a):
        return jax.ShapeDtypeStruct(np.shape(a), getattr(a, "dtype", None) or jnp.result_type(a))

    return jax.tree.map(one, tree)


def _state_changes(graphdef, params, rest, x, name, apply_kwargs, inputs) -> list | None:
    """(path, Variable type) of each variable the call writes (``None``: the structure), from
    one abstract trace (unchanged ones pass straight through); outputs (``sow``, ``perturb``)
    and RNG state the output does not depend on (``nnx.RNN``'s zero carry) are not reported."""
    parts = nnx.split(nnx.merge(graphdef, params, rest), nnx.Param, _OUTPUTS, ...)[1:]
    params, outputs, other = parts

    def call(params, outputs, other, x):
        module = nnx.merge(graphdef, params, outputs, other)
        args, kw = spread("", inputs, x)
        y = getattr(module, name)(*args, **kw, **apply_kwargs)
        _, params_after, _, other_after = nnx.split(module, nnx.Param, _OUTPUTS, ...)
        return y, params_after, other_after

    closed, shapes = jax.make_jaxpr(call, return_shape=True)(*_abstract((*parts, x)))
    jaxpr, n_y = closed.jaxpr, len(jax.tree.leaves(shapes[0]))
    n_params, n_outputs = len(jax.tree.leaves(params)), len(jax.tree.leaves(outputs))
    start = n_params + n_outputs
    inputs = jaxpr.invars[:n_params] + jaxpr.invars[start : start + len(jax.tree.leaves(other))]
    after = jaxpr.outvars[n_y:]
    if len(after) != len(inputs):  # the call added or removed state
        return None
    variables = _variables(params) + _variables(other)
    changed = [(p, k) for (p, k), v, a in zip(variables, inputs, after, strict=True) if a is not v]
    if changed and all(issubclass(kind, nnx.RngState) for _, kind in changed):
        rng_in = [
            v for (_, k), v in zip(variables, inputs, strict=True) if issubclass(k, nnx.RngState)
        ]
        if not _depends_on(jaxpr, jaxpr.outvars[:n_y], rng_in):
            return []
    return changed


def _depends_on(jaxpr, outvars, invars) -> bool:
    """Whether an ``outvars`` is computed from an ``invars`` (an equation: from all its inputs)."""
    needed = {v for v in outvars if not isinstance(v, jex.core.Literal)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            needed.update(v for v in eqn.invars if not isinstance(v, jex.core.Literal))
    return any(v in needed for v in invars)


def _in_eval_mode(module) -> bool:
    """Every mode flag (``deterministic``, ``use_running_average``) is set, and there is one."""
    flags = [
        getattr(node, flag)
        for _, node in nnx.iter_graph(module)
        if isinstance(node, nnx.Module)
        for flag in ("deterministic", "use_running_average")
        if isinstance(getattr(node, flag, None), bool)
    ]
    return bool(flags) and all(flags)


def _refuse_state_changes(fn_name: str, changed: list | None, module, monte_carlo: bool) -> None:
    """Refuses the writes :func:`_state_changes` found; ``monte_carlo``: a function builds it."""
    kinds = [kind for _, kind in changed or ()]
    random = any(issubclass(kind, nnx.RngState) for kind in kinds)
    switch = f"apply_kwargs={DETERMINISTIC if random else TRAIN_OFF}"
    fix = "call .eval() on the module where it is built" if monte_carlo else "model.eval()"
    fix = f"{fix}, or pass {switch}"
    if not (random or any(issubclass(kind, nnx.BatchStat) for kind in kinds)):  # Dropout, BatchNorm
        fix = "keep state writes out of the forward pass"
    elif _in_eval_mode(module):
        fix = (
            f"its layers are in evaluation mode, so let __call__ take the switch and pass {switch}"
        )
    writes = [f"{kind.__name__} at {path}" for path, kind in changed or ()] or ["its structure"]
    what = f"the nnx module changes its own state when called ({shown(writes)})"
    raise bad(ValueError, fn_name, what, fix, see="nnx-state")


def _refuse_stateful_arguments(fn_name: str, apply_kwargs: dict, error: Exception) -> None:
    """Refuses a failed write to an nnx object in ``apply_kwargs`` (flax's TraceContextError)."""
    stateful = [k for k, v in apply_kwargs.items() if isinstance(v, nnx.Rngs | nnx.Variable)]
    if stateful and isinstance(error, flax.errors.TraceContextError):
        what = f"the call writes the state of {stateful} given in apply_kwargs"
        fix = "make the call deterministic (.eval()) and drop them"
        raise bad(ValueError, fn_name, what, fix, see="nnx-state") from error


def model_apply(name: str, apply_kwargs: dict, inputs: str, fn_name: str) -> Callable:
    """``apply3(params, x, (graphdef, rest))`` of the method ``name``, the module rebuilt."""

    def apply3(params, x, aux):
        graphdef, rest = aux
        # fresh variables at this trace level: a call may advance RNG state it does not
        # draw from (nnx.RNN's zero carry), which nnx allows only in the creating trace
        rest = jax.tree.map(lambda a: a, rest)
        args, kw = spread(fn_name, inputs, x, "x")
        return getattr(nnx.merge(graphdef, params, rest), name)(*args, **kw, **apply_kwargs)

    # equal for equal arguments (the graph travels in aux): built again, nothing recompiles
    return keyed(apply3, "nnx", name, apply_kwargs, inputs, fn_name)


def make(caller: Caller, kind: str, model, method, apply_kwargs, options, inputs) -> Callable:
    """The kernel function ``call(variables, x1, x2=None, *, rngs=None)``, ``variables``
    ``None`` (the module's ``nnx.Param`` state now) or such a state; Monte Carlo:
    ``call((params, rest), x1, x2=None)`` of one initialisation, ``model`` a template."""
    fn_name, monte_carlo = caller.name, caller.monte_carlo
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, DETERMINISTIC)
    name = _method(fn_name, model, method)
    apply3 = model_apply(name, apply_kwargs, inputs, fn_name)

    def check(params, x1, x2, aux):
        spread(fn_name, inputs, x1)  # a TypeError for an x1 of another kind than inputs's
        try:
            jax.eval_shape(apply3, params, x1, aux)
        except Exception as e:
            _refuse_stateful_arguments(fn_name, apply_kwargs, e)
            args, kw = spread(fn_name, inputs, x1)
            call = getattr(model, name), args, {**kw, **apply_kwargs}
            raise failure(caller, "variables", e, "model.eval()", call=call) from e
        graphdef, rest = aux
        changed = _state_changes(graphdef, params, rest, x1, name, apply_kwargs, inputs)
        if changed != []:
            module = nnx.merge(graphdef, params, rest)
            _refuse_state_changes(fn_name, changed, module, monte_carlo)

    def to_core(variables, rngs=None):
        if rngs is not None:
            what = "rngs was given, but an nnx module carries its own nnx.Rngs"
            raise bad(TypeError, fn_name, what, "drop rngs= (model.eval() for no dropout)")
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if variables is not None:
            fix = "pass nnx.state(model, nnx.Param) of this model, or None for its own"
            leaves = jax.tree_util.tree_leaves_with_path(params)
            if jax.tree.structure(variables) != jax.tree.structure(params):
                paths = shown([jax.tree_util.keystr(p) for p, _ in leaves], 4)
                what = f"variables do not have the structure of the module's {PARAM} [{paths}]"
                if isinstance(variables, Mapping) and not set(params) <= set(variables):
                    what += ": they look like another model's, with top-level names "
                    what += f"{names(variables)} where the module has {names(params)}"
                    fix = "pass the module they belong to, or nnx.state(model, nnx.Param) of "
                    fix += "this one, or None for its own"
                raise bad(ValueError, fn_name, what, fix + " (a dict: nnx.replace_by_pure_dict)")
            wrong = [
                f"{jax.tree_util.keystr(path)} {np.shape(got)} (expected {np.shape(want)})"
                for (path, want), got in zip(leaves, jax.tree.leaves(variables), strict=True)
                if np.shape(got) != np.shape(want)
            ]
            if wrong:
                what = f"variables do not have the shapes of the module's {PARAM}: "
                raise bad(ValueError, fn_name, what + shown(wrong, 3), fix)
            params = variables
        return params, (graphdef, rest)

    def of_state(state):
        """``(params, (graphdef, rest))`` of one initialisation ``state = (params, rest)``."""
        params, rest = state
        return params, (nnx.split(model, nnx.Param, ...)[0], rest)

    keywords = () if monte_carlo else ("rngs",)
    pure = PureModel(apply3, of_state if monte_carlo else to_core, keywords, check, "model.eval()")
    return build_kernel(caller, kind, pure, options)
