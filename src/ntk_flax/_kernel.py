"""Empirical NTK / NNGP of ``flax.linen`` models (``flax.nnx`` ones: ``_nnx``).

``variables["params"]`` is differentiated; other collections and ``rngs`` travel in
``aux``, held fixed. What ``variables`` may be: ``_variables``.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.core
import flax.errors
import flax.linen as nn
import jax

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
    is_nnx_module,
    keyed,
)
from ntk_core.adapters import check_inputs_option as check_inputs
from ntk_core.adapters import inputs_failure as failure
from ntk_core.adapters import spread_inputs as spread
from ntk_flax import _nnx
from ntk_flax._variables import PARAMS, VariablesReader, entries

_PACKAGE = "ntk_flax"
_MUTABLE = flax.core.DenyList([PARAMS])
_EVAL = f"apply_kwargs={_nnx.TRAIN_OFF}"


def refuse_apply_arguments(fn_name: str, apply_kwargs: dict) -> None:
    """Refuses ``model.apply``'s own keywords in ``apply_kwargs``: the adapter passes those."""
    fixes = dict(
        mutable=f"apply the model in evaluation mode (e.g. {_EVAL})",
        rngs="pass rngs={'dropout': key} to the kernel call, or none",
        method=f"pass method= to {fn_name} itself",
    )
    for key, fix in fixes.items():
        if key in apply_kwargs:
            what = f"apply_kwargs holds {key!r}, an argument of model.apply that {fn_name} passes"
            raise bad(TypeError, fn_name, what, f"drop it and {fix}", see="flax-apply-kwargs")


def not_a_module(fn_name: str, model, fix: str) -> TypeError:
    what = f"model must be a flax.linen.Module or a flax.nnx.Module, got {type(model).__name__}"
    return bad(TypeError, fn_name, what, fix)


def _missing_collections(fn_name: str, variables, init, x1) -> ValueError:
    """Variables lacking a collection the model reads (Flax's ``ScopeCollectionNotFound``)."""
    try:
        made = sorted(jax.eval_shape(init, x1))
    except Exception:  # the model cannot be initialised on x1: say what is known
        made = []
    missing = [c for c in made if c not in variables and c != "intermediates"]
    what = f"variables (holding {sorted(variables)}) lacks the collection(s) {missing or '?'}"
    fix = f"pass the whole dict model.init(key, x) returns, or add them: {entries(missing)}"
    return bad(ValueError, fn_name, what + ", which the model reads", fix)


def _model_apply(model, method, apply_kwargs, inputs, fn_name):
    """``apply3``, equal for an equal model and arguments: a function built again (a seed
    loop's ``ntk_sketch_fn``) reuses the compiled programs (issue 48)."""

    def apply3(params, x, aux):
        rest, rngs = aux
        args, kw = spread(fn_name, inputs, x, "x")
        kw.update(method=method, rngs=rngs, mutable=_MUTABLE)
        return model.apply({PARAMS: params, **rest}, *args, **kw, **apply_kwargs)[0]

    return keyed(apply3, "linen", model, method, apply_kwargs, inputs, fn_name)


def caller(fn: Callable, *, built: bool = False, monte_carlo: bool = False) -> Caller:
    """``fn`` as the core's messages name it, with the positional arguments of :func:`kernel`
    (``built``: of the kernel function it returns; ``monte_carlo``: ``fn``'s own)."""
    return adapter_caller(_PACKAGE, fn, kernel, built=built, monte_carlo=monte_carlo)


def make(caller: Caller, kind: str, model, options: dict, method=None, apply_kwargs=None):
    """``kernel(variables, x1, x2=None, *, rngs=None)``; ``options``: the core's, ``inputs``."""
    fn_name, options = caller.name, dict(options)
    inputs = check_inputs(fn_name, options.pop("inputs", "x"))
    if is_nnx_module(model):  # flax.nnx: the module's own state, split per call
        return _nnx.make(caller, kind, model, method, apply_kwargs, options, inputs)
    if not isinstance(model, nn.Module):
        raise not_a_module(fn_name, model, f"pass the module instance first: {caller.order}")
    if not (method is None or callable(method) or callable(getattr(model, str(method), None))):
        what = f"method={method!r} names no method of {type(model).__name__}"
        raise bad(TypeError, fn_name, what, "pass a method's name or function, or None")
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, _nnx.TRAIN_OFF)
    refuse_apply_arguments(fn_name, apply_kwargs)
    apply3 = _model_apply(model, method, apply_kwargs, inputs, fn_name)
    vmap_axes = options.get("vmap_axes", 0)

    def apply_fn(rngs):
        def apply(v, x):
            args, kw = spread(fn_name, inputs, x)
            return model.apply(v, *args, method=method, rngs=rngs, **kw, **apply_kwargs)

        return apply

    def init_fn(rngs):  # x -> model.init(...), run under eval_shape
        def init(x):
            key = jax.random.PRNGKey(0)
            args, kw = spread(fn_name, inputs, x)
            streams = {PARAMS: key, "dropout": key, **(rngs or {})}
            return model.init(streams, *args, method=method, **kw, **apply_kwargs)

        return init

    read = VariablesReader(caller, init_fn, apply_fn)

    def call(x):  # the module method's own call
        args, kw = spread(fn_name, inputs, x)
        fn = getattr(model, method or "__call__") if not callable(method) else method
        return fn, (model, *args) if callable(method) else args, {**kw, **apply_kwargs}

    def check(params, x1, x2, aux):
        rest, rngs = aux
        variables = {PARAMS: params, **rest}
        spread(fn_name, inputs, x1)  # a TypeError for an x1 of another kind than inputs's
        try:
            jax.eval_shape(apply_fn(rngs), variables, x1)
        except flax.errors.InvalidRngError as e:
            fix = f"pass {_EVAL}" + ("" if caller.monte_carlo else " or rngs={'dropout': key}")
            raise bad(ValueError, fn_name, f"the model needs a random key ({e})", fix) from None
        except flax.errors.ModifyScopeVariableError as e:
            if vmap_axes is not None:
                what = f"the model updates its variables ({e}), as BatchNorm in training mode does"
                fix = f"use {_EVAL} (or a module built in eval mode), or pass vmap_axes=None"
                raise bad(ValueError, fn_name, what, fix) from None
        except flax.errors.ScopeCollectionNotFound as e:
            misread = read.misread(variables, x1, rngs, e)
            raise misread or _missing_collections(fn_name, variables, init_fn(rngs), x1) from None
        except flax.errors.ScopeParamShapeError as e:
            init, point = init_fn(rngs), "variables = model.init(key, x1)"
            made = lambda x: init(x)[PARAMS]  # noqa: E731
            mismatch = input_shape_mismatch(fn_name, "variables", params, made, x1, point)
            raise (mismatch or failure(caller, "variables", e, _EVAL, call=call(x1))) from None
        except Exception as e:
            failed = failure(caller, "variables", e, _EVAL, call=call(x1))
            raise read.misread(variables, x1, rngs, e) or failed from e

    def to_core(variables, x1, rngs=None):
        """``(params, (other collections, rngs))`` of what ``variables`` is (``_variables``)."""
        variables = read(variables, x1, rngs)
        rest = {k: v for k, v in variables.items() if k != PARAMS}
        return variables[PARAMS], (rest, rngs)

    hint = f"use_running_average=True / {_EVAL}"
    pure = PureModel(apply3, to_core, ("rngs",), check, hint, to_core_reads_x1=True)
    return build_kernel(caller, kind, pure, options)


def public(fn: Callable) -> Callable:
    """``checked_arguments`` naming ``ntk_flax.<fn.__name__>``."""
    return checked_arguments(f"{_PACKAGE}.{fn.__name__}")(fn)


def _kernel_of(fn: Callable, model, method, apply_kwargs, options: dict):
    """The kernel function of the entry point ``fn``: new for ``*_fn``, else cached."""
    kind, built = entry_kind(fn)

    def build():
        return make(caller(fn, built=built), kind, model, options, method, apply_kwargs)

    return build() if built else cached((fn, model, method, apply_kwargs, options), build)


@public
def kernel_fn(model, *, method=None, apply_kwargs=None, **options) -> Callable:
    """:func:`kernel` built once: ``kernel(variables, x1, x2=None, *, rngs=None)``.

    Args: ``model`` a ``flax.linen.Module`` or ``flax.nnx.Module``; ``method`` what
    ``model.apply`` calls (nnx: a name), default ``__call__``; ``apply_kwargs`` the
    model's keyword arguments, e.g. ``{"train": False}``; ``inputs`` how x1 / x2 reach
    the model: ``"x"`` (default) as its one argument, ``"args"`` a tuple ``model(*x)``,
    ``"kwargs"`` a dict ``model(**x)`` (every array with N on axis 0, e.g. ids and mask).
    Returns: the kernel function, whose results are :func:`kernel`'s.
    Raises: TypeError, ValueError: ``model`` not a linen or nnx module; ``variables`` not
    this model's, or lacking a collection it reads; a model that needs an rng, or updates
    its variables (BatchNorm in training mode) with ``vmap_axes=0``; the model failing on x1;
    ``inputs`` not one of the three, or x1 not the tuple / dict it names.
    Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> ntk_flax.kernel_fn(model, trace_axes=())(model.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4, 3, 3)
    """
    return _kernel_of(kernel_fn, model, method, apply_kwargs, options)


@public
def nngp_fn(model, *, method=None, apply_kwargs=None, **options) -> Callable:
    """:func:`nngp` built once: ``kernel(variables, x1, x2=None, *, rngs=None)``.

    Args: as :func:`kernel_fn`; ``**options``: :func:`ntk_core.nngp_fn`'s.
    Returns: the kernel function, whose results are :func:`nngp`'s.
    Raises: as :func:`kernel_fn`. Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> ntk_flax.nngp_fn(model)(model.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)
    """
    return _kernel_of(nngp_fn, model, method, apply_kwargs, options)


@public
def kernel(model, variables, x1, x2=None, *, method=None, apply_kwargs=None, rngs=None, **options):
    """Empirical NTK Θ(x1, x2)[i, j, a, b] = Σ_p ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p of a
    Flax model, θ its ``params`` collection; other collections and ``rngs`` held fixed.

    Args: ``model``, ``method``, ``apply_kwargs``, ``inputs`` as :func:`kernel_fn`; ``variables``
    ``model.init``'s dict, a bare params dict or a train state (nnx: ``None`` for the
    module's own ``nnx.Param`` state, or such a state); ``x1`` N1 samples on axis 0;
    ``x2`` N2 samples, or ``None`` for x1; ``rngs`` e.g. ``{"dropout": key}``, the same
    for every sample.
    Returns: ``(N1, N2)`` for ``(N, O)`` outputs by default, ``(N1, N2, O, O)`` with
    ``trace_axes=()``.
    Raises: as :func:`kernel_fn`. Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> ntk_flax.kernel(model, model.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)
    """
    return _kernel_of(kernel, model, method, apply_kwargs, options)(variables, x1, x2, rngs=rngs)


@public
def nngp(model, variables, x1, x2=None, *, method=None, apply_kwargs=None, rngs=None, **options):
    """Empirical NNGP kernel K[i, j, a, b] = f_a(x1_i) · f_b(x2_j) of a Flax model.

    Args: as :func:`kernel`; ``**options``: :func:`ntk_core.nngp_fn`'s.
    Returns: ``(N1, N2)`` for ``(N, O)`` outputs by default, in the outputs' dtype.
    Raises: as :func:`kernel_fn`. Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> ntk_flax.nngp(model, model.init(jax.random.PRNGKey(0), x), x, trace_axes=()).shape
      (4, 4, 3, 3)
    """
    return _kernel_of(nngp, model, method, apply_kwargs, options)(variables, x1, x2, rngs=rngs)


@public
def pntk_fn(model, *, method=None, apply_kwargs=None, **options) -> Callable:
    """:func:`pntk` built once: ``kernel(variables, x1, x2=None, *, rngs=None)``.

    Args: as :func:`kernel_fn` (no ``trace_axes``). Returns: the kernel function, whose
    results are :func:`pntk`'s. Raises: as :func:`kernel_fn`. Options, Cost and
    References: see :func:`ntk_core.pntk_fn`.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> ntk_flax.pntk_fn(model)(model.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)
    """
    return _kernel_of(pntk_fn, model, method, apply_kwargs, options)


@public
def pntk(model, variables, x1, x2=None, *, method=None, apply_kwargs=None, rngs=None, **options):
    """Pseudo-NTK of a Flax model: the NTK of Σ_a f_a / √O, ``(N1, N2)`` at the cost of
    one output (:func:`ntk_core.pntk_fn`: its relation to the full and traced NTK).

    Args: as :func:`kernel` (no ``trace_axes``). Returns: ``(N1, N2)`` (``(N1,)`` with
    ``diagonal_axes=(0,)``). Raises: as :func:`kernel_fn`; TypeError for ``trace_axes``.
    Options, Cost and References: see :func:`ntk_core.pntk_fn`.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> ntk_flax.pntk(model, model.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)
    """
    return _kernel_of(pntk, model, method, apply_kwargs, options)(variables, x1, x2, rngs=rngs)


@public
def kernel_per_leaf_fn(model, *, method=None, apply_kwargs=None, **options) -> Callable:
    """:func:`kernel_per_leaf` built once: ``kernel(variables, x1, x2=None, *, rngs=None)``.

    Args: as :func:`kernel_fn` (``implementation`` not ``"ntvp"``).
    Returns: the kernel function, whose results are :func:`kernel_per_leaf`'s.
    Raises: as :func:`kernel_fn`. Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> k = ntk_flax.kernel_per_leaf_fn(model)(model.init(jax.random.PRNGKey(0), x), x)
      >>> k["kernel"].shape
      (4, 4)
    """
    return _kernel_of(kernel_per_leaf_fn, model, method, apply_kwargs, options)


@public
def kernel_per_leaf(
    model, variables, x1, x2=None, *, method=None, apply_kwargs=None, rngs=None, **options
):
    """:func:`kernel` split by parameter leaf: Θ_l, with Σ_l Θ_l = Θ.

    Args: as :func:`kernel` (``implementation`` not ``"ntvp"``).
    Returns: a tree like ``params`` (nnx: an ``nnx.State``) of ``(N1, N2)`` kernels by
    default.
    Raises: as :func:`kernel_fn`. Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> k = ntk_flax.kernel_per_leaf(model, model.init(jax.random.PRNGKey(0), x), x)
      >>> sorted(k), float(k["bias"][0, 0])  # the bias's kernel: 1 for every pair
      (['bias', 'kernel'], 1.0)
    """
    fn = _kernel_of(kernel_per_leaf, model, method, apply_kwargs, options)
    return fn(variables, x1, x2, rngs=rngs)


@public
def plan(model, variables, x1, x2=None, *, method=None, apply_kwargs=None, rngs=None, **options):
    """What :func:`kernel` with these arguments would do, not computed.

    Args: as :func:`kernel`.
    Returns: :func:`ntk_core.plan`'s ``Plan`` (implementation, estimates, each leaf's
    path, size and method).
    Raises: as :func:`kernel_fn`. Options, Cost and References: see :func:`ntk_core.ntk_fn`.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> p = ntk_flax.plan(model, model.init(jax.random.PRNGKey(0), x), x)
      >>> [(leaf.path, leaf.size) for leaf in p.leaves]
      [("['bias']", 3), ("['kernel']", 6)]
    """
    fn = _kernel_of(plan, model, method, apply_kwargs, options)
    return fn.plan(variables, x1, x2, rngs=rngs)
