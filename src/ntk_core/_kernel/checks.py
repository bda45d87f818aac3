"""Checks of a kernel call beyond shapes (environment, dtypes, common mistakes), each
raising ``bad(...)``; Flax and Haiku objects are recognised by class name, unimported."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._errors import NonFiniteError, bad, one_line
from ntk_core._jax import environment as _environment
from ntk_core._kernel.caller import Caller

#: (package, class name) of the framework classes recognised here: Haiku's name is a prefix
#: (Transformed, TransformedWithState), Flax's exact (the type of an nnx Module class,
#: ModuleMeta, is not a module).
_LINEN, _NNX, _HAIKU = ("flax.linen", "Module"), ("flax.nnx", "Module"), ("haiku", "Transformed")


def _is(obj, kind: tuple[str, str]) -> bool:
    """Whether ``obj``'s class or a base is ``kind``'s (a package and a class name)."""
    package, name = kind
    exact = kind is not _HAIKU
    for c in type(obj).__mro__:
        if c.__module__.startswith(package) and (
            c.__name__ == name if exact else c.__name__.startswith(name)
        ):
            return True
    return False


def is_nnx_module(obj) -> bool:
    """Whether ``obj`` is a ``flax.nnx.Module`` (by its classes)."""
    return _is(obj, _NNX)


def check_apply_fn(fn_name: str, apply_fn, entry: str = "kernel") -> None:
    """Refuses a Flax/Haiku model object (naming the adapter's ``entry``) or a non-callable."""
    name = type(apply_fn).__name__
    flax, haiku = _is(apply_fn, _LINEN) or is_nnx_module(apply_fn), _is(apply_fn, _HAIKU)
    package = "ntk_flax" if flax else "ntk_haiku" if haiku else ""
    if package or not callable(apply_fn):
        what = f"is the model {name}, not" if package else "must be a callable"
        fix = f"use {package}.{entry} with the model" if package else "pass e.g. model.apply"
        raise bad(TypeError, fn_name, f"apply_fn {what} apply_fn(params, x), got {name}", fix)


def params_check(fn_name: str, apply_fn):
    """A per-signature ``check`` refusing Flax variables beyond ``params`` to ``model.apply``."""
    inner = apply_fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    module = getattr(inner, "__self__", None)
    if module is None or not _is(module, _LINEN) or inner != module.apply:
        return None  # not a linen module's own model.apply (bound methods compare so)

    def check(params, x1, x2, aux):
        keys = sorted(params) if isinstance(params, Mapping) else type(params).__name__
        if keys != ["params"]:
            what = f"model.apply needs the variables {{'params': ...}} alone, got {keys!r}"
            raise bad(ValueError, fn_name, what, "use ntk_flax.kernel(model, variables, x)")

    return check


def samples_interact_error(fn_name: str, what: str, fix: str) -> ValueError:
    """The ValueError for a model whose samples interact where they must not (``what``:
    what the independence probe found)."""
    return bad(ValueError, fn_name, what, fix, see="samples-interact")


def model_failed(fn_name: str, what: str, fix: str) -> ValueError:
    """An adapter's ValueError for a model that fails on x1 (``what``: how)."""
    return bad(
        ValueError, fn_name, f"applying the model to x1 failed: {what}", fix, see="model-failed"
    )


def adapter_model_failure(caller: Caller, params_name: str, error: Exception, mode: str):
    """An adapter's ValueError for a model that fails on x1 (``mode``: how its framework
    leaves training mode, as ``PureModel.eval_hint``)."""
    mine = "" if caller.monte_carlo else f"{params_name} from this model's init, "
    fix = f"check {mine}x1's shape and the mode ({mode})"
    return model_failed(caller.name, one_line(error), fix)


def _numeric(dtype, kinds=(jnp.number, jnp.bool_)) -> bool:
    """Of one of ``kinds`` (default: numbers and booleans), ml_dtypes included."""
    try:
        return any(jnp.issubdtype(dtype, kind) for kind in kinds)
    except TypeError:
        return False


def leaked_tracer_error(fn_name: str, error: Exception) -> ValueError:
    """The ValueError for JAX's ``UnexpectedTracerError`` in the model."""
    first = str(error).strip().splitlines()[0]
    what = f"the model uses a leaked tracer: {first}"
    return bad(ValueError, fn_name, what, "pass it through params or x", see="leaked-tracer")


def model_call_error(fn_name: str, doing: str, error: Exception, fix: str) -> ValueError:
    """The ValueError for the model's own failure while ``doing``."""
    if isinstance(error, jax.errors.UnexpectedTracerError):
        return leaked_tracer_error(fn_name, error)
    if isinstance(error, jax.errors.ConcretizationTypeError):  # int(), bool(), `if` of a value
        fix = "branch with jnp.where or lax.cond; hold fixed values as Python numbers (static)"
    return bad(ValueError, fn_name, f"{doing} failed with {one_line(error)}", fix)


def order_hint(caller: Caller) -> str:
    """ "the argument order is ...", with neural-tangents' order where it applies."""
    nt = caller.neural_tangents_order
    return f"the argument order is {caller.order}" + (f", not neural-tangents' {nt}" if nt else "")


def check_values(fn_name: str, trees: dict) -> None:
    """TypeError for a ``jax.ShapeDtypeStruct`` (a shape without values) in ``trees``
    (name: pytree); run on every call, as signatures are cached."""
    for name, tree in trees.items():
        if any(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(tree)):
            path, leaf = next(
                (p, v)
                for p, v in jax.tree_util.tree_leaves_with_path(tree)
                if isinstance(v, jax.ShapeDtypeStruct)
            )
            what = f"{name}{jax.tree_util.keystr(path)} is a jax.ShapeDtypeStruct, a shape"
            what += f" without values: {leaf.shape}"
            raise bad(TypeError, fn_name, what, "pass arrays (plan() needs them too)")


def before_trace(fn_name: str, params, x1, x2, options) -> None:
    """Environment and dtype checks that need no trace of the model."""
    _environment.check_backend(fn_name)
    for name, tree in dict(x1=x1, x2=x2).items():
        for leaf in jax.tree.leaves(tree):
            dtype = getattr(leaf, "dtype", None)
            if dtype is not None and not _numeric(dtype):
                what = f"{name} has dtype {dtype}; expected numbers"  # (key<fry>: no np.dtype)
                raise bad(TypeError, fn_name, what, "encode the inputs as numbers (token ids)")
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not _numeric(leaf.dtype, (jnp.floating,)):
            where = jax.tree_util.keystr(path)
            what = f"params{where} has dtype {leaf.dtype}; expected real floating point"
            raise bad(TypeError, fn_name, what, "keep only real weights in params")


def after_trace(fn, apply3, params, x1, aux, options, kernel="NTK", closed=None):
    """Precision warnings for ``kernel`` (``closed``: a jaxpr, or None), once the model's
    outputs passed the callers' checks."""
    _environment.check_model_precision(
        fn, apply3, params, x1, aux, options.precision, kernel, closed
    )


_leaf_all_finite = jax.jit(lambda v: jnp.all(jnp.isfinite(v)))


def all_finite(leaf) -> bool | None:
    """Whether an array has no NaN/Inf (host for numpy); None when abstract."""
    if isinstance(leaf, np.ndarray):
        return bool(np.isfinite(leaf).all())
    return concrete_bool(_leaf_all_finite(leaf))


def concrete_bool(value) -> bool | None:
    """``bool(value)``, or None for an abstract value."""
    try:
        return bool(value)
    except (jax.errors.TracerBoolConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_finite_input(fn_name: str, name: str, x) -> None:
    """NonFiniteError naming ``x``'s first sample with NaN/Inf (once a result was non-finite)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(x):
        try:
            floating = jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
        except (TypeError, ValueError):  # strings, objects: refused by the validation
            continue
        if np.ndim(leaf) == 0 or not floating or all_finite(leaf) is not False:
            continue  # scalars are refused by the validation that follows
        values = np.asarray(leaf)
        bad_rows = ~np.isfinite(values).reshape(values.shape[0], -1).all(axis=1)
        i = int(np.argmax(bad_rows))
        kind = "NaN" if np.isnan(values[i]).any() else "Inf"
        what = f"{name}{jax.tree_util.keystr(path)} contains {kind} values, first in sample {i}"
        raise bad(NonFiniteError, fn_name, what, "clean or drop those samples")


def check_finite_inputs(fn_name: str, x1, x2, params=None) -> None:
    """NonFiniteError naming the first NaN/Inf of x1, x2 or ``params`` (a result was)."""
    for name, x in dict(x1=x1, x2=x2).items():  # x2 None: no leaves
        check_finite_input(fn_name, name, x)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) and all_finite(leaf) is False:
            what = f"params{jax.tree_util.keystr(path)} contains NaN or Inf"
            fix = "check the training step that made them (a NaN loss or gradient)"
            raise bad(NonFiniteError, fn_name, what, fix)
