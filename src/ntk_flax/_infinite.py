"""Infinite-width NNGP / NTK of Flax models (``ntk_core.infinite_kernel_fn``), with the
priors read from the layers' initialisers.

linen: the model runs once (abstractly, on the first call's x1) under
``nn.intercept_methods``; each ``nn.Dense`` / ``nn.DenseGeneral`` / ``nn.Conv`` it calls
shows its ``kernel_init``, ``bias_init`` and ``use_bias``. nnx modules do not keep their
initialisers: ``nnx.Linear`` / ``nnx.Conv`` weights are taken to have Flax's default
(``lecun_normal``, W_std = 1), biases that are all zero b_std = 0; others must be given.
"""

from __future__ import annotations

import math
import types

import flax.core
import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from ntk_core.adapters import (
    DeferredInfinite,
    Prior,
    bad,
    check_apply_kwargs,
    checked_arguments,
    is_nnx_module,
    truncated_normal_moments,
)
from ntk_flax import _nnx
from ntk_flax._kernel import not_a_module, refuse_apply_arguments
from ntk_flax._variables import PARAMS

_NAME = "ntk_flax.infinite_kernel_fn"
_INITIALIZERS = "jax._src.nn.initializers"
# jax's variance_scaling divides the truncated normal's stddev by this rounded constant
# (the std of N(0, 1) truncated to (-2, 2)); the exact variance uses the closed form.
_JAX_TRUNCATION = 0.87962566103423978


def _join(path: str, leaf: str) -> str:
    return f"{path}/{leaf}" if path else leaf


def _fans(shape, in_axis, out_axis, batch_axis) -> tuple[float, float]:
    """fan_in, fan_out of a weight of ``shape`` as jax's variance_scaling counts them."""
    size = lambda axes: (  # noqa: E731
        shape[axes] if isinstance(axes, int) else math.prod(shape[a] for a in axes)
    )
    if isinstance(in_axis, int) and in_axis == -2 and len(shape) <= 1:
        raise ValueError(f"a {len(shape)}-D shape has no input axis")
    receptive = math.prod(shape) / size(in_axis) / size(out_axis) / size(batch_axis)
    return size(in_axis) * receptive, size(out_axis) * receptive


def entry_variance(init, shape, gain: bool = False) -> float | str:
    """E[w²] of one entry that the ``jax.nn.initializers`` function ``init`` draws for a
    weight of ``shape``, read from its closure, exactly; or why it cannot be read. A weight
    or bias must be centred; a ``gain`` (a LayerNorm's scale) may be constant (``ones``)."""
    if init is jax.nn.initializers.zeros:
        return 0.0
    if init is jax.nn.initializers.ones:
        return 1.0 if gain else "jax.nn.initializers.ones is not centred"
    if getattr(init, "__module__", None) != _INITIALIZERS or not hasattr(init, "__code__"):
        return f"{getattr(init, '__qualname__', type(init).__name__)} is not a known initialiser"
    name = init.__qualname__.split(".<locals>")[0]
    cells = [c.cell_contents for c in init.__closure__ or ()]
    free = types.SimpleNamespace(**dict(zip(init.__code__.co_freevars, cells, strict=True)))
    if name == "constant" and (gain or not np.any(np.asarray(free.value))):
        return float(np.mean(np.square(np.broadcast_to(free.value, shape))))
    if name == "normal":
        return float(free.stddev) ** 2
    if name == "truncated_normal":
        mean, moment = truncated_normal_moments(float(free.lower), float(free.upper))
        if abs(mean) > 1e-12:
            return "truncated_normal with lower != -upper draws entries of non-zero mean"
        return float(free.stddev) ** 2 * moment
    if name != "variance_scaling":
        why = "draws in [0, scale): its entries are not centred" if name == "uniform" else ""
        return f"jax.nn.initializers.{name} {why or 'has no known variance'}"
    try:
        fan_in, fan_out = _fans(tuple(shape), free.in_axis, free.out_axis, free.batch_axis)
    except (ValueError, IndexError, TypeError) as e:
        return f"variance_scaling cannot count the fans of the shape {tuple(shape)} ({e})"
    fan = dict(
        fan_in=fan_in,
        fan_out=fan_out,
        fan_avg=(fan_in + fan_out) / 2,
        fan_geo_avg=math.sqrt(fan_in * fan_out),
    ).get(free.mode)
    if fan is None:
        return f"variance_scaling has the unknown mode {free.mode!r}"
    variance = float(free.scale) / fan
    if free.distribution == "truncated_normal":
        return variance * truncated_normal_moments(-2.0, 2.0)[1] / _JAX_TRUNCATION**2
    if free.distribution in ("normal", "uniform"):  # uniform on ±√(3·variance)
        return variance
    return f"variance_scaling has the unknown distribution {free.distribution!r}"


def _layer_priors(path: str, module, kernel_shape: tuple, where: str) -> list[Prior]:
    """The priors of one recognised layer's ``kernel`` and ``bias`` leaves."""
    if isinstance(module, nn.DenseGeneral):
        if module.batch_dims:
            why = "DenseGeneral with batch_dims holds one layer per batch index"
            return [Prior(_join(path, "kernel"), "weight", None, why, where)]
        n_in = math.prod(kernel_shape[: len(kernel_shape) - len(np.atleast_1d(module.features))])
        init_shape = (n_in, math.prod(kernel_shape) // n_in)  # kernel_init sees it flattened
    else:  # Dense (in, out), Conv (*window, in / groups, out): fan_in = all but the last axis
        init_shape, n_in = kernel_shape, math.prod(kernel_shape[:-1])
    bias_shape = (init_shape[-1],)  # DenseGeneral: its features flattened, as bias_init sees
    leaves = [("kernel", "weight", module.kernel_init, init_shape, n_in)]
    leaves += [("bias", "bias", module.bias_init, bias_shape, 1)] if module.use_bias else []
    return [
        Prior.read(
            _join(path, leaf), kind, entry_variance(init, shape), f"{leaf}_init of {where}", fan
        )
        for leaf, kind, init, shape, fan in leaves
    ]


def _norm_priors(path: str, module, where: str) -> list[Prior]:
    """A LayerNorm's (or an eval-mode BatchNorm's) learnable ``scale`` (a gain: its mean
    square) and ``bias``; a BatchNorm's running statistics are constants of the model."""
    leaves = (
        ("scale", "gain", module.use_scale, module.scale_init),
        ("bias", "bias", module.use_bias, module.bias_init),
    )
    return [
        Prior.read(
            _join(path, leaf),
            kind,
            entry_variance(init, (1,), kind == "gain"),
            f"{leaf}_init of {where}",
        )
        for leaf, kind, use, init in leaves
        if use
    ]


_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.LayerNorm, nn.BatchNorm)


def _linen_reader(model, variables, method, apply_kwargs):
    """``read(x1)``: the priors of every recognised layer the model calls on x1."""

    def read(x1):
        found = {}

        def intercept(next_fun, args, kwargs, context):
            module = context.module
            out = next_fun(*args, **kwargs)
            if isinstance(module, _LAYERS) and context.method_name == "__call__":
                # the kernel as the layer sees it: one layer's slice inside nn.scan
                kernel = module.variables.get(PARAMS, {}).get("kernel")
                found[tuple(module.scope.path)] = (module, np.shape(kernel))
            return out

        def run(v, x):
            rngs = {"dropout": jax.random.PRNGKey(0)}
            mutable = flax.core.DenyList([PARAMS])
            return model.apply(v, x, method=method, rngs=rngs, mutable=mutable, **apply_kwargs)

        with nn.intercept_methods(intercept):
            jax.eval_shape(run, variables, x1)
        params, priors = variables[PARAMS], []
        for scope_path, (module, kernel_shape) in found.items():
            node = params
            for key in scope_path:  # a layer without parameters (LayerNorm without scale)
                node = node.get(key, {}) if hasattr(node, "get") else {}
            path = "/".join(scope_path)  # "" for the model itself: its leaves are "kernel"
            where = f"{type(module).__name__} {path!r}" if path else "the model"
            if isinstance(module, nn.LayerNorm | nn.BatchNorm):
                priors += _norm_priors(path, module, where)
            elif "kernel" in node:
                priors += _layer_priors(path, module, tuple(kernel_shape), where)
        return priors

    return read


def _nnx_priors(module) -> list[Prior]:
    """nnx layers do not keep their initialisers: Flax's defaults, checked where possible."""
    priors = []
    for graph_path, node in nnx.iter_graph(module):
        if not isinstance(node, (nnx.Linear, nnx.Conv)):
            continue
        path = "/".join(str(p) for p in graph_path)
        where = f"{type(node).__name__} {path!r}" if path else "the model"
        priors.append(Prior(_join(path, "kernel"), "weight", 1.0, "", where))  # lecun_normal
        if node.use_bias:
            zero = not np.any(np.asarray(node.bias[...]))
            why = "nnx modules do not keep their bias_init, and this bias is not all zero"
            priors.append(Prior(_join(path, "bias"), "bias", 0.0 if zero else None, why, where))
    return priors


def _nnx_kernel_fn(module, method, apply_kwargs, W_std, b_std):
    graphdef, state, rest = nnx.split(module, nnx.Param, ...)
    params = nnx.to_pure_dict(state)  # leaf paths "layers/0/kernel", as the priors name them
    name = _nnx._method(_NAME, module, method)

    def apply_fn(p, x):
        params = jax.tree.map(lambda v: v, state)  # a copy of the state, filled with p
        nnx.replace_by_pure_dict(params, p)
        return getattr(nnx.merge(graphdef, params, rest), name)(x, **apply_kwargs)

    return DeferredInfinite(
        _NAME, apply_fn, params, lambda x: _nnx_priors(module), W_std, b_std, eager=True
    )


@checked_arguments(_NAME)
def infinite_kernel_fn(
    model, variables=None, *, W_std=None, b_std=None, method=None, apply_kwargs=None
):
    """Infinite-width NNGP and NTK of a Flax model, as every hidden width grows, in its own
    (standard) parameterisation: :func:`ntk_core.infinite_kernel_fn` of
    ``model.apply({"params": p, **other collections}, x)``, priors read from the layers.

    Args: ``model`` a ``flax.linen.Module`` (with ``variables``, ``model.init``'s dict or
    its ``"params"``) or a ``flax.nnx.Module`` (``variables`` ``None``); ``W_std`` /
    ``b_std`` ``None`` (read: linen's ``kernel_init`` / ``bias_init`` of each ``nn.Dense``,
    ``nn.DenseGeneral``, ``nn.Conv``: Flax's ``lecun_normal`` gives W_std = 1, the
    ``variance_scaling`` family W_std² = fan_in · Var(w), ``normal(s)`` and
    ``truncated_normal``, ``zeros`` gives b_std = 0), one float for every weight / bias,
    or a Mapping from a leaf's path (``"Dense_0/kernel"``: ``ntk_core.adapters.leaf_path_names``)
    to a float, which replaces what was read; ``method``, ``apply_kwargs`` as
    :func:`ntk_flax.kernel_fn` (e.g. ``{"train": False}``).
    Returns: the core's kernel function ``kernel_fn(x1, x2=None, get=None, **options)``:
    NNGP / NTK of shape ``(N1, N2)`` for x1 (N1, ...) and x2 (N2, ...); linen: built at its
    first call (the layers are seen on x1), attributes such as ``report(x)`` likewise.
    Raises: TypeError: ``model`` not a Flax module, ``W_std`` / ``b_std`` not a float or a
    Mapping; ValueError (at the first call for linen): a layer whose initialiser has no
    known variance (``jax.nn.initializers.uniform``, orthogonal, a custom function, an nnx
    bias that is not zero) and no ``W_std`` / ``b_std`` for its path; the core's errors.
    Cost: one abstract trace of the model on x1 to read the priors; then as the core's.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(1)]), jnp.ones((3, 2))
      >>> kernel_fn = ntk_flax.infinite_kernel_fn(model, model.init(jax.random.PRNGKey(0), x))
      >>> kernel_fn(x, None, "ntk").shape
      (3, 3)

    References: Novak et al., "Neural Tangents", ICLR 2020; Yang, "Tensor Programs I", 2019.
    """
    apply_kwargs = check_apply_kwargs(_NAME, apply_kwargs, _nnx.TRAIN_OFF)
    refuse_apply_arguments(_NAME, apply_kwargs)
    if is_nnx_module(model):
        if variables is not None:
            what = "variables must be None for an nnx module (its own nnx.Param state is used)"
            raise bad(TypeError, _NAME, what, "call infinite_kernel_fn(module)")
        return _nnx_kernel_fn(model, method, apply_kwargs, W_std, b_std)
    if not isinstance(model, nn.Module):
        raise not_a_module(_NAME, model, f"pass the module first: {_NAME}(model, variables)")
    if not isinstance(variables, dict | flax.core.FrozenDict):
        what = f"variables must be model.init's dict, got {type(variables).__name__}"
        raise bad(TypeError, _NAME, what, "pass variables = model.init(key, x)")
    variables = dict(variables) if PARAMS in variables else {PARAMS: variables}
    rest = {k: v for k, v in variables.items() if k != PARAMS}

    def apply_fn(params, x):
        mutable = flax.core.DenyList([PARAMS])
        v = {PARAMS: params, **rest}
        out = model.apply(v, x, method=method, mutable=mutable, **apply_kwargs)
        return out[0]

    read = _linen_reader(model, variables, method, apply_kwargs)
    return DeferredInfinite(_NAME, apply_fn, variables[PARAMS], read, W_std, b_std)
