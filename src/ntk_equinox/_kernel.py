"""Empirical NTK / NNGP of Equinox models: params are the ``eqx.is_inexact_array`` leaves."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import equinox as eqx
import jax

from ntk_core.adapters import Caller, PureModel, bad, binds, build_kernel, cached, entry_kind
from ntk_core.adapters import check_inputs_option as check_inputs
from ntk_core.adapters import inputs_failure as failure
from ntk_core.adapters import spread_inputs as spread

_PACKAGE, _ORDER, _INFERENCE = "ntk_equinox", "(model, x1, x2)", "eqx.nn.inference_mode(model)"


@dataclasses.dataclass(frozen=True)
class _Apply:
    """``apply(params, x, arrays)`` of the array-free fixed part ``rest``, equal by its leaves."""

    rest: object = dataclasses.field(compare=False)
    key: tuple
    inputs: str

    def __call__(self, params, x, arrays):
        def one(x):
            args, kw = spread(_PACKAGE, self.inputs, x)  # x2: checked against x1
            return eqx.combine(params, arrays, self.rest)(*args, **kw)

        return jax.vmap(one)(x)


def _stateful(m) -> bool:  # BatchNorm, SpectralNorm; a Sequential only passes state on
    stateful = isinstance(m, eqx.nn.StatefulLayer) and m.is_stateful()
    return stateful and not isinstance(m, eqx.nn.Sequential)


def _split(fn_name: str, model, inputs: str) -> tuple:
    """``(params, other arrays, apply)`` of ``model``; TypeError / ValueError for bad input."""
    if not isinstance(model, eqx.Module) or not callable(model):
        got = type(model).__name__ + (" (no __call__)" if isinstance(model, eqx.Module) else "")
        what, fix = f"model must be an equinox.Module, got {got}", "pass the module first"
        raise bad(TypeError, fn_name, what, fix)
    held = [type(m).__name__ for m in jax.tree.leaves(model, is_leaf=_stateful) if _stateful(m)]
    if held:  # called as layer(x, state): the model is not a function of x alone
        what = f"the model holds the stateful layer {held[0]}, which needs an eqx.nn.State"
        raise bad(ValueError, fn_name, what, "hold the State in an apply_fn", see="equinox-state")
    params, rest = eqx.partition(model, eqx.is_inexact_array)
    if not jax.tree.leaves(params):
        what = f"the model {type(model).__name__} has no floating-point array leaves"
        raise bad(ValueError, fn_name, what, "hold its parameters as float arrays")
    arrays, rest = eqx.partition(rest, eqx.is_array)  # new after every jitted step
    leaves, treedef = jax.tree.flatten(rest)  # unhashable leaves (rare) by identity
    key = tuple((type(v), v if isinstance(v, Hashable) else id(v)) for v in leaves)
    return params, arrays, _Apply(rest, (treedef, key), inputs)


def _kernel_fn(fn, model, options: dict, name: str = ""):
    """The core's ``kernel(model, x1, x2=None)`` for models like ``model``; errors name ``name``."""
    name = name or f"{_PACKAGE}.{fn.__name__}"
    kind, built = entry_kind(fn)  # built: a *_fn, of (model, x1, x2)
    inputs = check_inputs(name, options.pop("inputs", "x"))
    apply = _split(name, model, inputs)[2]
    caller = Caller(name, _ORDER, model="the model", package=_PACKAGE, built=built)
    called = f"{name}(...){_ORDER}" if built else name

    def to_core(model):
        params, arrays, other = _split(called, model, inputs)
        if other != apply:
            what = "structure (layers, sizes)" if other.key[0] != apply.key[0] else "fixed fields"
            what = f"the model's {what} differ from those it was built for"
            raise bad(ValueError, called, what, f"build {name}(model) for it")
        return params, arrays

    def check(params, x1, x2, aux):
        args, kw = spread(name, inputs, x1)  # a TypeError for an x1 of another kind
        try:
            jax.eval_shape(apply, params, x1, aux)
        except Exception as e:  # the core names the others
            if not binds(model, args, kw):  # missing or unexpected arguments: where each goes
                raise failure(caller, "the model", e, _INFERENCE, "", (model, args, kw)) from e
            if isinstance(e, jax.errors.ConcretizationTypeError):  # the core's message: int(), if
                return
            try:  # a model written for a whole batch?
                jax.eval_shape(lambda p: eqx.combine(p, aux, apply.rest)(*args, **kw), params)
            except Exception:
                return  # no: the core reports the per-sample failure
            what = "the model fails on each sample x1[i] (it is vmapped over axis 0) but runs on x1"
            fix = "x1 one sample: pass x1[None]; a module for a batch: write it for one sample"
            raise bad(ValueError, name, what, fix) from e

    pure = PureModel(apply, to_core, (), check, _INFERENCE, model_kwargs="")
    build = lambda: build_kernel(caller, kind, pure, options)  # noqa: E731
    return build() if built else cached((name, apply, options), build)


def kernel(model, x1, x2=None, **options):
    """Empirical NTK Θ(x1, x2)[i, j, a, b] = Σ_p ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p of an
    ``eqx.Module``, θ its ``eqx.is_inexact_array`` leaves; others fixed (arrays traced).

    Args: ``model`` a callable ``eqx.Module`` of ONE sample, vmapped over ``x1``'s N1 samples
    (axis 0); ``x2`` N2 samples or ``None`` (x1); ``**options``: :func:`ntk_core.ntk_fn`'s and
    ``inputs``: ``"args"`` for x a tuple (``model(*x_i)``), ``"kwargs"`` a dict (``model(**x_i)``).
    Returns: ``(N1, N2)`` for outputs ``(O,)``, ``(N1, N2, O, O)`` with ``trace_axes=()``.
    Raises: TypeError: ``model`` not a callable ``eqx.Module``, x1 not the tuple / dict
    ``inputs`` names; ValueError: no floating array leaves, a stateful layer, a model written
    for a whole batch, ``inputs`` not ``"x"``, ``"args"`` or ``"kwargs"``; the core's errors,
    prefixed ``ntk_equinox.kernel:``. Cost: as :func:`ntk_core.ntk_fn`; new weights reuse the
    compiled programs. References: Jacot, Gabriel, Hongler, NeurIPS 2018; Novak et al., 2022.
    Example:
      >>> import equinox as eqx, jax, ntk_equinox
      >>> mlp = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.PRNGKey(0))
      >>> ntk_equinox.kernel(mlp, jax.numpy.ones((4, 3)), trace_axes=()).shape
      (4, 4, 2, 2)
    """
    return _kernel_fn(kernel, model, options)(model, x1, x2)


def kernel_fn(model, **options):
    """:func:`kernel` built once for models shaped like ``model``: ``kernel(model, x1, x2=None)``
    with each step's model. Args:, Returns:, Raises: (and a ValueError for another structure),
    Cost: as :func:`kernel` (N1 samples). Example: ``kernel_fn(mlp)(mlp, x)``. References: Jacot."""
    return _kernel_fn(kernel_fn, model, options)


def nngp(model, x1, x2=None, **options):
    """Empirical NNGP K(x1, x2)[i, j, a, b] = f_a(x1_i) · f_b(x2_j). Returns: ``(N1, N2)`` by
    default. Args:, Raises: as :func:`kernel`; options ``ntk_core.nngp_fn``'s. Cost: a forward
    pass, N1·N2·O products. Example: ``ntk_equinox.nngp(mlp, x)``. References: Lee et al. 2018."""
    return _kernel_fn(nngp, model, options)(model, x1, x2)


def plan(model, x1, x2=None, **options):
    """What :func:`kernel` would do (x1: N1 samples, x2: N2), not computed. Returns: a ``Plan``.
    Args:, Raises: as ``kernel``. Cost: a trace. Example: ``plan(mlp, x)``. References: Novak."""
    return _kernel_fn(plan, model, options).plan(model, x1, x2)


def pntk(model, x1, x2=None, **options):
    """Pseudo-NTK, the NTK of Σ_a f_a / √O: Returns: ``(N1, N2)``; Args:, Raises: as :func:`kernel`
    (no trace_axes); Cost: one output NTK. Example: ``pntk(mlp, x)``. References: Mohamadi 2023."""
    return _kernel_fn(pntk, model, options)(model, x1, x2)


def pntk_fn(model, **options):
    """:func:`pntk` built once for models like ``model``: ``kernel(model, x1, x2)`` (x1: N1
    samples). Args:, Returns:, Raises:, Cost, Example, References: as :func:`pntk`."""
    return _kernel_fn(pntk_fn, model, options)
