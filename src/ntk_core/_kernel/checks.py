"""Checks of a kernel call beyond shapes: environment, dtypes and common mistakes.

The engine calls :func:`before_trace` at the top of its validation and
:func:`after_trace` once the model's outputs are known (both once per input signature);
the core API calls :func:`check_apply_fn` and :func:`params_check`. Each mistake found
raises a ``TypeError``/``ValueError`` naming the public function, what it received,
what it expected and the fix (see ``docs/errors.md``). Flax and Haiku objects are
recognised by their class names and modules, without importing either library.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._errors import NonFiniteError
from ntk_core._jax import environment as _environment
from ntk_core._kernel.caller import Caller


def non_finite_error(message: str) -> NonFiniteError:
    """The :class:`NonFiniteError` carrying ``message``."""
    return NonFiniteError(message)


def is_non_finite_error(error: BaseException) -> bool:
    """Whether ``error`` is a :class:`NonFiniteError`."""
    return isinstance(error, NonFiniteError)


def _classes(obj) -> list[tuple[str, str]]:
    return [(c.__module__, c.__name__) for c in type(obj).__mro__]


def _is_linen_module(obj) -> bool:
    return any(m.startswith("flax.linen") and n == "Module" for m, n in _classes(obj))


def is_nnx_module(obj) -> bool:
    """Whether ``obj`` is a ``flax.nnx.Module`` (by its classes: flax is not imported)."""
    return any(m.startswith("flax.nnx") and n == "Module" for m, n in _classes(obj))


def _is_haiku_transformed(obj) -> bool:
    return any(m.startswith("haiku") and n.startswith("Transformed") for m, n in _classes(obj))


NNX_RECIPE = (
    "graphdef, params, rest = nnx.split(model, nnx.Param, ...); k = ntk_core.empirical_ntk("
    "lambda p, x: nnx.merge(graphdef, p, rest)(x), params, x)"
)


def check_apply_fn(fn_name: str, apply_fn) -> None:
    """Refuses a Flax or Haiku model object passed where ``apply_fn(params, x)`` goes."""
    if _is_linen_module(apply_fn):
        raise TypeError(
            f"{fn_name}: apply_fn is the flax.linen module {type(apply_fn).__name__} itself; "
            f"expected a function apply_fn(params, x). Fix: use ntk_flax.kernel(model, "
            f"variables, x), or pass model.apply with params=variables."
        )
    if is_nnx_module(apply_fn):
        raise TypeError(
            f"{fn_name}: apply_fn is the flax.nnx module {type(apply_fn).__name__}; "
            f"expected a function apply_fn(params, x) of explicit params. Fix: use "
            f"ntk_flax.kernel(model, None, x) (None: the module's own nnx.Param state), or "
            f"{NNX_RECIPE}."
        )
    if _is_haiku_transformed(apply_fn):
        raise TypeError(
            f"{fn_name}: apply_fn is the Haiku {type(apply_fn).__name__} itself; expected a "
            f"function apply_fn(params, x). Fix: use ntk_haiku.kernel(transformed, params, "
            f"x), or pass hk.without_apply_rng(transformed).apply."
        )


def params_check(fn_name: str, apply_fn):
    """A per-signature ``check`` catching Flax variables misused with ``model.apply``."""
    inner = apply_fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    module = getattr(inner, "__self__", None)
    if module is None or not _is_linen_module(module) or inner != module.apply:
        return None  # not a linen module's own model.apply (bound methods compare so)
    name = type(module).__name__

    def check(params, x1, x2, aux):
        if not isinstance(params, Mapping) or "params" not in params:
            keys = sorted(params) if isinstance(params, Mapping) else type(params).__name__
            raise ValueError(
                f"{fn_name}: apply_fn is {name}.apply, which takes the variables dict "
                f"{{'params': ...}}, but params is {keys!r}. Fix: pass the whole dict "
                f"returned by model.init (variables, not variables['params']), or use "
                f"ntk_flax.kernel(model, variables, x)."
            )
        others = sorted(k for k in params if k != "params")
        if others:
            raise ValueError(
                f"{fn_name}: params holds the Flax collections {sorted(params)}; the NTK "
                f"would differentiate {others} too, as if they were parameters. Fix: use "
                f"ntk_flax.kernel(model, variables, x), which differentiates only 'params' "
                f"and holds the other collections fixed."
            )

    return check


# -- other libraries' wording --------------------------------------------------------------
# Where no exception class, attribute or signature tells what went wrong, the message of
# the other library's error is read here, one function per wording, each tested against
# the library itself (tests/core/test_wording.py, tests/flax/test_nnx_wording.py,
# tests/haiku/test_haiku_wording.py), so that a rewording fails the tests instead of
# silently turning a specific fix into the generic one.


def python_unexpected_keyword(error: BaseException) -> str | None:
    """The argument name in CPython's ``TypeError`` for a keyword argument a function
    does not take, ``"f() got an unexpected keyword argument 'name'"`` (CPython 3.11's
    wording, checked when this was written; 3.10 put the qualified name before it),
    else ``None``."""
    if not isinstance(error, TypeError):
        return None
    m = re.search(r"got an unexpected keyword argument '([^']+)'", str(error))
    return None if m is None else m.group(1)


def python_missing_arguments(error: BaseException) -> str | None:
    """The quoted names (``"'a'"``, ``"'a' and 'b'"``, ``"'a', 'b', and 'c'"``) in
    CPython's ``TypeError`` for required arguments not given, ``"f() missing 2 required
    positional arguments: 'a' and 'b'"`` (or ``keyword-only``; CPython 3.11's wording),
    else ``None``."""
    if not isinstance(error, TypeError):
        return None
    m = re.search(
        r"missing \d+ required (?:positional |keyword-only )?arguments?: (.+)$", str(error)
    )
    return None if m is None else m.group(1)


def nnx_mode_missing(error: BaseException) -> bool:
    """Whether ``error`` is flax.nnx's for a layer told neither whether it is
    deterministic nor given rngs: ``nnx.Dropout`` (and ``MultiHeadAttention``) raise a
    ``ValueError`` from ``flax.nnx.module.first_from`` worded ``"No `deterministic`
    argument was provided to Dropout. ..."`` (flax 0.12.8; this check read
    ``'deterministic'`` in quotes, an earlier wording) or ``"`deterministic` is False,
    but no `rngs` argument was provided to Dropout ..."`` (flax 0.12.8)."""
    text = str(error)
    return (
        re.search(r"No [`']deterministic[`'] argument", text) is not None
        or "but no `rngs` argument was provided" in text
    )


def haiku_apply_without_rng(error: BaseException) -> bool:
    """Whether ``error`` is Haiku's for an ``apply`` that takes an rng but got something
    else in its place (``transformed.apply(params, x)``): the ``ValueError`` of
    ``haiku._src.transform.to_prng_sequence``, worded from ``RNG_ERROR_TPL`` as ``"Apply
    must be called with an RNG as the second argument, ..."`` (dm-haiku 0.0.17)."""
    return "must be called with an RNG" in str(error)


def _model_argument_fix(error: Exception) -> str:
    """The fix when the model's own call lacks an argument (``train``, ``is_training``)
    or got one it does not take (a misspelt key of ``apply_kwargs``), else ``""``."""
    if nnx_mode_missing(error):  # flax.nnx Dropout without a mode, or without rngs
        return (
            "the model needs to know whether it is deterministic (dropout): call "
            "model.eval() first (nnx), or pass apply_kwargs={'deterministic': True}"
        )
    unexpected = python_unexpected_keyword(error)
    if unexpected is not None:
        return (
            f"the model does not take the keyword argument {unexpected!r}, which "
            f"apply_kwargs passes: use the names of the model's own arguments (its "
            f"__call__ signature) in apply_kwargs"
        )
    missing = python_missing_arguments(error)
    if missing is None:
        return ""
    first = missing.split(",")[0].split(" and ")[0].strip()
    return (
        f"the model's own argument(s) {missing} are missing: pass them with "
        f"apply_kwargs={{{first}: False}} (for example)"
    )


def adapter_model_failure(caller: Caller, params_name: str, error: Exception) -> ValueError:
    """An adapter's ValueError for a model that fails on x1: the model's own error, then
    the fix (the specific one for a missing or unexpected model argument). The Monte
    Carlo kernels' (``caller.monte_carlo``) parameters come from their own init."""
    if caller.monte_carlo:  # the parameters come from its own init
        generic = (
            "check that x1 has the per-sample shape and dtype the model expects, batch "
            "axis first (x1[None] for a single sample)"
        )
    else:
        generic = (
            f"check that {params_name} come from this model's init and that x1 has the "
            f"shape it expects, batch axis first (x1[None] for a single sample)"
        )
    fix = _model_argument_fix(error) or generic
    return ValueError(
        f"{caller.name}: applying the model to x1 failed with {type(error).__name__}: "
        f"{' '.join(str(error).split()).rstrip('.')}. Fix: {fix}."
    )


def _numeric(dtype) -> bool:
    """Numbers and booleans, bfloat16 and the other ml_dtypes included."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_))
    except TypeError:
        return False


def leaked_tracer_error(fn_name: str, error: Exception) -> ValueError:
    """The ValueError for a model that uses a leaked tracer (JAX's
    ``UnexpectedTracerError``): a value traced by an earlier transformation, e.g. a
    variable captured inside a ``jax.jit``-ed function and used after it returned."""
    return ValueError(
        f"{fn_name}: the model uses a value traced by an earlier JAX transformation that "
        f"has already finished (a leaked tracer, e.g. a closure over a variable of a "
        f"jax.jit-ed or jax.grad-ed function, used after that function returned), so it "
        f"cannot be evaluated here. Fix: pass that value to the model through params, x "
        f"or aux instead of closing over it, or compute it outside any transformation. "
        f"JAX's report: {str(error).strip().splitlines()[0]}"
    )


def model_call_error(fn_name: str, doing: str, error: Exception, fix: str) -> ValueError:
    """The ValueError for the model's own failure while ``doing`` (e.g. "calling the
    model on x1 (shapes ...)"): its type and message on one line, then ``fix``; a
    leaked tracer gets :func:`leaked_tracer_error`."""
    if isinstance(error, jax.errors.UnexpectedTracerError):
        return leaked_tracer_error(fn_name, error)
    text = " ".join(str(error).split()).rstrip(".")
    return ValueError(f"{fn_name}: {doing} failed with {type(error).__name__}: {text}. Fix: {fix}.")


def order_hint(caller: Caller) -> str:
    """ "the argument order is ...", with neural-tangents' order where it applies (the
    core functions, whose (params, x1, x2) users of neural-tangents' (x1, x2, params)
    get wrong)."""
    hint = f"the argument order is {caller.order}"
    if caller.neural_tangents_order:
        hint += f", not neural-tangents' {caller.neural_tangents_order}"
    return hint


def model_call_fix(params, error: Exception, caller: Caller) -> str:
    """The fix for "calling the model failed": the specific one for a Haiku apply that
    expects an rng, else the generic one with a hint for a likely mix-up of params."""
    if haiku_apply_without_rng(error):
        return (
            "this is a Haiku apply that expects an rng argument: use "
            "ntk_haiku.kernel(transformed, params, x, rng=key) (it handles rng and state; "
            "rng=key only if the model draws random numbers), or pass "
            "hk.without_apply_rng(transformed).apply for a model that draws none, or "
            "lambda p, x: transformed.apply(p, key, x) to fix one key"
        )
    fix = (
        "check that params belong to this model and that x1 has the per-sample shape and "
        f"dtype it expects (argument order: {caller.order[1:-1]})"
    )
    if isinstance(params, Mapping) and "params" in params:
        fix += (
            "; params has a top-level 'params' key: if it is a Flax variables dict, pass "
            "variables['params'] to an apply_fn that adds {'params': ...} itself, or use "
            "ntk_flax.kernel(model, variables, x)"
        )
    return fix


def before_trace(fn_name: str, params, x1, x2, options) -> None:
    """Environment and dtype checks that need no trace of the model."""
    _environment.check_backend(fn_name)
    for name, tree in (("x1", x1), ("x2", x2)):
        for leaf in jax.tree.leaves(tree):
            dtype = getattr(leaf, "dtype", None)
            if dtype is not None and not _numeric(dtype):
                raise TypeError(
                    f"{fn_name}: {name} contains an array of dtype {np.dtype(dtype)}; "
                    f"expected numbers (floating point, or integer tokens). Fix: encode the "
                    f"inputs as numbers, e.g. token ids or features, before the call."
                )
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not _numeric(leaf.dtype):
            raise TypeError(
                f"{fn_name}: params contains the non-numeric leaf "
                f"{jax.tree_util.keystr(path)} = {leaf!r} (dtype {leaf.dtype}); every leaf of "
                f"params is differentiated, so all must be floating-point arrays. Fix: keep "
                f"only the weights in params and close over other values in apply_fn."
            )
        if np.dtype(leaf.dtype).kind == "c":
            raise TypeError(
                f"{fn_name}: params contains an array of dtype {np.dtype(leaf.dtype)}; "
                f"the empirical NTK here is defined for real "
                f"parameters. Fix: split complex weights into real and imaginary parts "
                f"(two real leaves) inside apply_fn."
            )


def after_trace(
    fn_name: str, apply3, params, x1, x2, aux, out_leaves, options, kernel: str = "NTK", closed=None
) -> None:
    """Checks that need the model's outputs (already validated), and precision warnings
    (worded for ``kernel``, "NTK" or "NNGP"); ``closed``: the model's jaxpr when the
    caller has traced it already (under the kernel's matmul precision)."""
    for i, leaf in enumerate(out_leaves):
        if np.dtype(leaf.dtype).kind == "c":
            where = "the output" if len(out_leaves) == 1 else f"output leaf {i}"
            raise TypeError(
                f"{fn_name}: {where} has dtype {leaf.dtype}; kernels need real "
                f"floating-point outputs. Fix: return the real and imaginary parts as "
                f"separate outputs (e.g. jnp.stack([z.real, z.imag], -1))."
            )
    _environment.check_precision_option(fn_name, options.precision)
    _environment.check_model_precision(
        fn_name, apply3, params, x1, aux, options.precision, kernel, closed
    )


def runs_in_neural_tangents_order(apply3, params, x1, x2, aux) -> bool:
    """True when a failed call ``kernel(params, x1, x2)`` was meant as neural-tangents'
    ``kernel(x1, x2, params)``: the model runs with ``x2`` as its parameters on both
    ``params`` and ``x1`` as inputs, giving one output per sample of each, but not in
    the order given (up to four abstract traces, on the error path only)."""

    def outputs(p, x):
        try:
            return jax.tree.leaves(jax.eval_shape(lambda p, x: apply3(p, x, aux), p, x))
        except Exception:
            return None

    def batch(x):
        sizes = {np.shape(v)[0] if np.ndim(v) else None for v in jax.tree.leaves(x)}
        return sizes.pop() if len(sizes) == 1 else None

    for p, x in ((x2, params), (x2, x1)):  # swapped: both must run, per sample
        out = outputs(p, x)
        if not out or batch(x) is None or any(o.shape[:1] != (batch(x),) for o in out):
            return False
    return outputs(params, x1) is None or outputs(params, x2) is None


_leaf_all_finite = jax.jit(lambda v: jnp.all(jnp.isfinite(v)))


def all_finite(leaf) -> bool | None:
    """Whether an array has no NaN/Inf: on the host for numpy arrays, one jitted
    reduction on the device otherwise; None for an abstract value (under jax.jit)."""
    if isinstance(leaf, np.ndarray):
        return bool(np.isfinite(leaf).all())
    return concrete_bool(_leaf_all_finite(leaf))


def concrete_bool(value) -> bool | None:
    """``bool(value)``, or None for an abstract value (under an outer ``jax.jit``)."""
    try:
        return bool(value)
    except (jax.errors.TracerBoolConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_finite_input(fn_name: str, name: str, x) -> None:
    """Raises the ValueError of :func:`non_finite_error` naming the first sample of ``x``
    with a NaN or Inf.

    One reduction per floating input leaf (on the host for numpy arrays). The kernel
    functions call it only once their result came out non-finite
    (:func:`check_finite_inputs`): a first call compiles no reduction for it.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(x):
        try:
            floating = jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
        except (TypeError, ValueError):  # strings, objects: refused by the validation
            continue
        if np.ndim(leaf) == 0 or not floating:
            continue  # scalars are refused by the validation that follows
        ok = all_finite(leaf)
        if ok is None or ok:
            continue
        values = np.asarray(leaf)
        bad = ~np.isfinite(values).reshape(values.shape[0], -1).all(axis=1)
        i = int(np.argmax(bad))
        kind = "NaN" if np.isnan(values[i]).any() else "Inf"
        where = f"{name}{jax.tree_util.keystr(path)}"
        raise non_finite_error(
            f"{fn_name}: {where} contains {kind} values, first in sample {i} (axis 0; "
            f"{int(bad.sum())} of {values.shape[0]} samples are affected); a kernel of "
            f"non-finite inputs is meaningless. Fix: clean or drop those samples first, e.g. "
            f"keep = np.isfinite(x).reshape(len(x), -1).all(axis=1); x = x[keep]."
        )


def check_finite_inputs(fn_name: str, x1, x2) -> None:
    """:func:`check_finite_input` of ``x1`` and of ``x2`` (when given)."""
    check_finite_input(fn_name, "x1", x1)
    if x2 is not None:
        check_finite_input(fn_name, "x2", x2)
