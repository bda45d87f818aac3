"""Empirical NTK / NNGP of ``flax.linen`` models (and ``flax.nnx`` ones, see ``_nnx``).

The adapter turns ``(model, variables)`` into a pure ``apply3(params, x, aux)`` where
``params = variables["params"]`` is differentiated and every other collection
(``batch_stats``, ...) travels in ``aux`` with the ``rngs``, held fixed; then it hands
it to ``ntk_core`` through :mod:`ntk_core.adapters`. ``variables`` is what a Flax
training loop holds: the dict ``model.init`` returns, a bare params dict
(``variables["params"]``, ``state.params``) or a train state (``.params`` plus
collections such as ``.batch_stats``; see ``_variables``). A ``flax.nnx`` module holds
its own state: ``variables=None`` uses its ``nnx.Param`` state as it is at each call.
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
    adapter_model_failure,
    build_kernel,
    cached,
    check_apply_kwargs,
    checked_arguments,
    input_shape_mismatch,
    is_nnx_module,
)
from ntk_flax import _nnx
from ntk_flax._variables import VariablesReader

_MUTABLE = flax.core.DenyList(["params"])


def refuse_apply_arguments(fn_name: str, apply_kwargs: dict, kernel: bool, rngs: bool) -> None:
    """``model.apply``'s own keywords (``mutable``, ``rngs``, ``method``) in
    ``apply_kwargs``: the adapter passes those itself."""
    fixes = {
        "mutable": "apply the model in evaluation mode (e.g. apply_kwargs={'train': False})"
        + (", or apply_kwargs={'train': True}, vmap_axes=None for training mode" if kernel else ""),
        "rngs": f"pass rngs={{'dropout': key}} to the {'kernel call' if kernel else 'call'}"
        if rngs
        else "run the model deterministically",
        "method": f"pass method= to {fn_name} itself",
    }
    for key, fix in fixes.items():
        if key in apply_kwargs:
            message = (
                f"{fn_name}: apply_kwargs holds {key!r}, an argument of model.apply that "
                f"{fn_name} passes itself. Fix: drop it and {fix}."
            )
            raise TypeError(message)


def _init_fn(model, method, apply_kwargs, rngs):
    """``x -> model.init(...)`` with the call's model arguments (for diagnoses under
    ``jax.eval_shape``: nothing is computed)."""

    def init(x):
        key = jax.random.PRNGKey(0)
        streams = {"params": key, "dropout": key, **(rngs or {})}
        return model.init(streams, x, method=method, **apply_kwargs)

    return init


def _missing_collections(fn_name: str, variables, init, x1) -> ValueError:
    """The ValueError for variables lacking a collection the model reads (Flax's
    ``ScopeCollectionNotFound``), naming those ``model.init`` makes that it lacks."""
    try:
        made = sorted(jax.eval_shape(init, x1))
    except Exception:  # the model cannot be initialised on x1: say what is known
        made = []
    missing = [c for c in made if c not in variables and c != "intermediates"]
    return ValueError(
        f"{fn_name}: variables (holding {sorted(variables)}) lacks the collection(s) "
        f"{missing or '?'}, which the model reads. Fix: pass the whole dict model.init(key, "
        f"x) returns, or add them: {{'params': ..., {', '.join(f'{c!r}: ...' for c in missing)}}}."
    )


def _model_apply(model, method, apply_kwargs):
    def apply3(params, x, aux):
        rest, rngs = aux
        out, _ = model.apply(
            {"params": params, **rest},
            x,
            method=method,
            rngs=rngs,
            mutable=_MUTABLE,
            **apply_kwargs,
        )
        return out

    return apply3


def caller(name: str, *, built: bool = False, monte_carlo: bool = False) -> Caller:
    """``ntk_flax.<name>`` as the core's messages name it, with its argument order."""
    order = "(model, x1, x2)" if monte_carlo else "(variables, x1, x2)" if built else None
    return Caller(
        f"ntk_flax.{name}",
        order or "(model, variables, x1, x2)",
        model="the model",
        package="ntk_flax",
        monte_carlo=monte_carlo,
        built=built,
    )


def make(caller: Caller, kind: str, model, options: dict, method=None, apply_kwargs=None):
    """The kernel function ``kernel(variables, x1, x2=None, *, rngs=None)`` of a linen
    or nnx ``model`` for the public function ``caller``."""
    fn_name = caller.name
    if is_nnx_module(model):  # flax.nnx: the module's own state, split per call
        return _nnx.make(caller, kind, model, method, apply_kwargs, options)
    if not isinstance(model, nn.Module):
        message = (
            f"{fn_name}: model must be a flax.linen.Module or a flax.nnx.Module, got "
            f"{type(model).__name__}. Fix: pass the module instance; the argument order is "
            f"(model, variables, x1, x2)."
        )
        raise TypeError(message)
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, "{'train': False}")
    refuse_apply_arguments(fn_name, apply_kwargs, True, not caller.monte_carlo)
    apply3 = _model_apply(model, method, apply_kwargs)
    vmap_axes = options.get("vmap_axes", 0)
    read = VariablesReader(
        caller,
        lambda rngs: _init_fn(model, method, apply_kwargs, rngs),
        lambda rngs: lambda v, x: model.apply(v, x, method=method, rngs=rngs, **apply_kwargs),
    )

    def check(params, x1, x2, aux):
        rest, rngs = aux
        variables = {"params": params, **rest}
        try:
            jax.eval_shape(
                lambda v, x: model.apply(v, x, method=method, rngs=rngs, **apply_kwargs),
                variables,
                x1,
            )
        except flax.errors.InvalidRngError as e:
            rngs = "" if caller.monte_carlo else ", or pass rngs={'dropout': key}"
            message = (
                f"{fn_name}: the model needs a random key ({e}). Fix: run it "
                f"deterministically (e.g. apply_kwargs={{'train': False}}){rngs}."
            )
            raise ValueError(message) from None
        except flax.errors.ModifyScopeVariableError as e:
            if vmap_axes is not None:
                message = (
                    f"{fn_name}: the model updates its variables when applied ({e}), as "
                    f"BatchNorm in training mode does. Fix: apply it in evaluation mode (e.g. "
                    f"apply_kwargs={{'train': False}}), or pass vmap_axes=None."
                )
                raise ValueError(message) from None
        except flax.errors.ScopeCollectionNotFound as e:
            failure = read.misread(variables, x1, rngs, e) or _missing_collections(
                fn_name, variables, _init_fn(model, method, apply_kwargs, rngs), x1
            )
            raise failure from None
        except flax.errors.ScopeParamShapeError as e:
            init = _init_fn(model, method, apply_kwargs, rngs)
            mismatch = input_shape_mismatch(
                fn_name,
                "variables",
                params,
                lambda x: init(x)["params"],
                x1,
                "variables = model.init(key, x1)",
            )
            raise (mismatch or adapter_model_failure(caller, "variables", e)) from None
        except Exception as e:
            failure = read.misread(variables, x1, rngs, e)
            raise failure or adapter_model_failure(caller, "variables", e) from e

    def to_core(variables, x1, rngs=None):
        """``(params, (other collections, rngs))`` for the core from what ``variables``
        is (see ``_variables``): a variables dict, a bare params dict or a train state."""
        variables = read(variables, x1, rngs)
        rest = {k: v for k, v in variables.items() if k != "params"}
        return variables["params"], (rest, rngs)

    pure = PureModel(
        apply3,
        to_core,
        call_keywords=("rngs",),
        check=check,
        eval_hint="use_running_average=True / apply_kwargs={'train': False}",
        to_core_reads_x1=True,
    )
    return build_kernel(caller, kind, pure, options)


def _cached(name: str, kind: str, model, method, apply_kwargs, options: dict):
    """The kernel function of ``ntk_flax.<name>``, built once per model, model keywords
    and options (:func:`ntk_core.adapters.cached`)."""
    key = (f"ntk_flax.{name}", model, method, apply_kwargs, options)
    return cached(key, lambda: make(caller(name), kind, model, options, method, apply_kwargs))


@checked_arguments("ntk_flax.kernel_fn")
def kernel_fn(
    model: nn.Module, *, method: str | Callable | None = None, apply_kwargs=None, **options
) -> Callable:
    """Jitted empirical NTK of a Flax model, reusable across training steps.

    Args:
      model: a ``flax.linen.Module`` or a ``flax.nnx.Module``.
      method: passed to ``model.apply`` (a name or function; nnx: a name); default
        ``__call__``.
      apply_kwargs: extra keyword arguments of the model, e.g. ``{"train": False}``.
      **options: the kernel options of :func:`ntk_core.ntk_fn`.

    Returns:
      ``kernel(variables, x1, x2=None, *, rngs=None)`` -> the NTK of x1 (N1 samples)
      and x2 (N2; ``None``: x1), ``(N1, N2)`` for ``(N, O)`` outputs by default. Only
      ``params`` is differentiated; other collections and ``rngs`` are held fixed.
    Raises:
      TypeError, ValueError: ``model`` not a linen or nnx module; ``variables`` not this
        model's (or lacking a collection it reads); a model that needs an rng, or whose
        samples interact (BatchNorm in training mode) with ``vmap_axes=0``; the model
        failing on x1; and the errors of :func:`ntk_core.ntk_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> ntk_flax.kernel_fn(model, trace_axes=())(model.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4, 3, 3)
    """
    return make(caller("kernel_fn", built=True), "ntk", model, options, method, apply_kwargs)


@checked_arguments("ntk_flax.nngp_fn")
def nngp_fn(
    model: nn.Module, *, method: str | Callable | None = None, apply_kwargs=None, **options
) -> Callable:
    """Jitted empirical NNGP kernel f(x1)·f(x2) of a Flax model; see :func:`kernel_fn`.

    Args:
      model, method, apply_kwargs: as :func:`kernel_fn`.
      **options: those of :func:`ntk_core.nngp_fn` (no ``implementation``).

    Returns:
      ``kernel(variables, x1, x2=None, *, rngs=None)`` -> ``(N1, N2)`` for ``(N, O)``
      outputs by default, in the outputs' dtype.
    Raises:
      As :func:`kernel_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> ntk_flax.nngp_fn(model)(model.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)
    """
    return make(caller("nngp_fn", built=True), "nngp", model, options, method, apply_kwargs)


@checked_arguments("ntk_flax.kernel")
def kernel(
    model: nn.Module,
    variables,
    x1,
    x2=None,
    *,
    method: str | Callable | None = None,
    apply_kwargs=None,
    rngs=None,
    **options,
):
    """Empirical NTK of a Flax model between x1 and x2 (x1 if None).

    Θ(x1, x2)[i, j, a, b] = Σ_p ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p over the ``params``
    collection; the built kernel function is cached.

    Args:
      model, method, apply_kwargs: as :func:`kernel_fn`.
      variables: ``model.init``'s dict, a bare params dict or a train state; for nnx
        ``None`` (the module's own ``nnx.Param`` state) or such a state.
      x1: array or pytree of arrays, batch axis 0 of size N1.
      x2: ``None`` (x2 is x1) or like x1 with N2 samples.
      rngs: random keys for ``model.apply`` (e.g. ``{"dropout": key}``), the same for
        every sample.

    Returns:
      ``(N1, N2)`` for ``(N, O)`` outputs by default, ``(N1, N2, O, O)`` with
      ``trace_axes=()``.
    Raises:
      As :func:`kernel_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> ntk_flax.kernel(model, model.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)
    """
    fn = _cached("kernel", "ntk", model, method, apply_kwargs, options)
    return fn(variables, x1, x2, rngs=rngs)


@checked_arguments("ntk_flax.nngp")
def nngp(
    model: nn.Module,
    variables,
    x1,
    x2=None,
    *,
    method: str | Callable | None = None,
    apply_kwargs=None,
    rngs=None,
    **options,
):
    """Empirical NNGP kernel f(x1)·f(x2) of a Flax model; see :func:`kernel`.

    Args:
      model, variables, x1 (N1 samples), x2 (N2 or ``None``), method, apply_kwargs,
        rngs: as :func:`kernel`.
      **options: those of :func:`ntk_core.nngp_fn`.

    Returns:
      ``(N1, N2)`` for ``(N, O)`` outputs by default, in the outputs' dtype.
    Raises:
      As :func:`kernel_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> ntk_flax.nngp(model, model.init(jax.random.PRNGKey(0), x), x, trace_axes=()).shape
      (4, 4, 3, 3)
    """
    fn = _cached("nngp", "nngp", model, method, apply_kwargs, options)
    return fn(variables, x1, x2, rngs=rngs)


@checked_arguments("ntk_flax.kernel_per_leaf_fn")
def kernel_per_leaf_fn(
    model: nn.Module, *, method: str | Callable | None = None, apply_kwargs=None, **options
) -> Callable:
    """Jitted empirical NTK of a Flax model split by parameter leaf (Σ_l Θ_l = Θ).

    Args:
      model, method, apply_kwargs, **options: as :func:`kernel_fn` (``implementation``
        not ``"ntvp"``).

    Returns:
      ``kernel(variables, x1, x2=None, *, rngs=None)`` -> a tree like ``params`` of
      ``(N1, N2)`` kernels (by default), one per leaf.
    Raises:
      As :func:`kernel_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> k = ntk_flax.kernel_per_leaf_fn(model)(model.init(jax.random.PRNGKey(0), x), x)
      >>> k["kernel"].shape
      (4, 4)
    """
    built = caller("kernel_per_leaf_fn", built=True)
    return make(built, "ntk_per_leaf", model, options, method, apply_kwargs)


@checked_arguments("ntk_flax.kernel_per_leaf")
def kernel_per_leaf(
    model: nn.Module,
    variables,
    x1,
    x2=None,
    *,
    method: str | Callable | None = None,
    apply_kwargs=None,
    rngs=None,
    **options,
):
    """Empirical NTK of a Flax model split by parameter leaf; the leaves sum to :func:`kernel`.

    Args:
      model, variables, x1 (N1 samples), x2 (N2 or ``None``), method, apply_kwargs,
        rngs: as :func:`kernel`.
      **options: as :func:`kernel_per_leaf_fn`.

    Returns:
      A tree like ``params`` (nnx: an ``nnx.State``) of ``(N1, N2)`` kernels by default.
    Raises:
      As :func:`kernel_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> k = ntk_flax.kernel_per_leaf(model, model.init(jax.random.PRNGKey(0), x), x)
      >>> sorted(k), float(k["bias"][0, 0])  # the bias's kernel: 1 for every pair
      (['bias', 'kernel'], 1.0)
    """
    fn = _cached("kernel_per_leaf", "ntk_per_leaf", model, method, apply_kwargs, options)
    return fn(variables, x1, x2, rngs=rngs)


@checked_arguments("ntk_flax.plan")
def plan(
    model: nn.Module,
    variables,
    x1,
    x2=None,
    *,
    method: str | Callable | None = None,
    apply_kwargs=None,
    rngs=None,
    **options,
):
    """What :func:`kernel` with these arguments would do, without computing it.

    Args:
      model, variables, x1 (N1 samples), x2 (N2 or ``None``), method, apply_kwargs,
        rngs, **options: as :func:`kernel`.

    Returns:
      The ``Plan`` of :func:`ntk_core.plan`: the implementation chosen, estimates, and
      each parameter leaf's path, size and method.
    Raises:
      As :func:`kernel_fn`.

    Options, Cost and References: see :func:`ntk_core.ntk_fn`.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> p = ntk_flax.plan(model, model.init(jax.random.PRNGKey(0), x), x)
      >>> [(leaf.path, leaf.size) for leaf in p.leaves]
      [("['bias']", 3), ("['kernel']", 6)]
    """
    fn = _cached("plan", "ntk", model, method, apply_kwargs, options)
    return fn.plan(variables, x1, x2, rngs=rngs)
