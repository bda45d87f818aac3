"""Infinite-width NNGP / NTK of Haiku models (``ntk_core.infinite_kernel_fn``), with the
priors read from the parameters' initialisers.

At the first call, ``transformed.init`` runs abstractly on x1 inside an ``hk.custom_creator``,
which shows every parameter's full name (its leaf path, ``"mlp/~/linear_0/w"``) and the
``init`` object it is created with: the default ``w_init`` of ``hk.Linear`` / ``hk.ConvND``
is ``TruncatedNormal(1 / √fan_in)`` (truncation NOT corrected: W_std² = E[z²] of N(0, 1)
truncated to ±2 ≈ 0.7737, in closed form), biases default to zeros.
"""

from __future__ import annotations

import inspect
import math

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from ntk_core.adapters import (
    DeferredInfinite,
    Prior,
    bad,
    check_apply_kwargs,
    checked_arguments,
    leaf_path_names,
    truncated_normal_moments,
)
from ntk_haiku._kernel import check_transformed

_NAME = "ntk_haiku.infinite_kernel_fn"
_INITS = hk.initializers


def _zero(value) -> bool:
    return not np.any(np.asarray(value))


def _haiku_fan(shape, axes) -> tuple[float, float]:
    """The fan Haiku's VarianceScaling divides by (its own rule, at least 1)."""
    if len(shape) < 1:
        return 1.0, 1.0
    if len(shape) == 1:  # a bias
        return float(shape[0]), float(shape[0])
    if len(shape) == 2:
        return float(shape[0]), float(shape[1])
    if axes is not None:
        fan_in = math.prod(shape[i] for i in axes)
        return float(fan_in), float(math.prod(shape) / fan_in)
    receptive = math.prod(shape[:-2])
    return float(shape[-2] * receptive), float(shape[-1] * receptive)


def entry_variance(init, shape, gain: bool = False) -> float | str:
    """E[w²] of one entry that the Haiku initialiser ``init`` draws for ``shape``, exactly;
    or why it cannot be read. A ``gain`` (a LayerNorm's scale) may be constant (ones)."""
    if init is jnp.zeros or init is np.zeros:
        return 0.0
    if gain and init is jnp.ones:
        return 1.0
    if isinstance(init, _INITS.Constant):
        if gain:
            return float(np.mean(np.square(np.broadcast_to(init.constant, shape))))
        return 0.0 if _zero(init.constant) else "Constant(c != 0) is not centred"
    if isinstance(init, _INITS.RandomNormal):
        return float(init.stddev) ** 2 if _zero(init.mean) else "RandomNormal with mean != 0"
    if isinstance(init, _INITS.TruncatedNormal):
        mean, moment = truncated_normal_moments(float(init.lower), float(init.upper))
        if not _zero(init.mean) or abs(mean) > 1e-12:
            return "TruncatedNormal with mean != 0 or lower != -upper is not centred"
        return float(np.asarray(init.stddev)) ** 2 * moment
    if isinstance(init, _INITS.RandomUniform):
        if float(init.minval) != -float(init.maxval):
            return f"RandomUniform({init.minval}, {init.maxval}) is not centred"
        return float(init.maxval) ** 2 / 3
    if isinstance(init, _INITS.VarianceScaling):
        fan_in, fan_out = _haiku_fan(tuple(shape), init.fan_in_axes)
        fan = dict(fan_in=fan_in, fan_out=fan_out).get(init.mode, (fan_in + fan_out) / 2)
        variance = init.scale / max(1.0, fan)
        if init.distribution == "truncated_normal":  # stddev / this rounded constant, as Haiku
            return variance * truncated_normal_moments(-2.0, 2.0)[1] / 0.87962566103423978**2
        return variance  # normal, or uniform on ±√(3·variance)
    return f"{getattr(init, '__qualname__', type(init).__name__)} is not a known initialiser"


def _stored_paths(records: list, stored: dict) -> list:
    """The path each creator's record is stored under: its own name, or, inside
    ``hk.layer_stack`` (whose stacked parameters no creator sees: its layers' names are
    the inner ones), the one stacked path that ends with it and holds its shape per
    layer. A module is stacked where one of its records is not stored as it was created,
    or where an earlier module claimed its names; None where a stacked path is ambiguous."""
    modules: dict = {}
    for i, record in enumerate(records):
        modules.setdefault(id(record[1]), []).append(i)
    claimed, out = set(), [None] * len(records)
    for indices in modules.values():
        names = [records[i][0] for i in indices]
        direct = all(stored.get(records[i][0]) == records[i][2] for i in indices)
        if direct and not claimed & set(names):
            claimed |= set(names)
            for i in indices:
                out[i] = records[i][0]
            continue
        for i in indices:
            name, shape = records[i][0], records[i][2]
            stacks = [
                path
                for path, held in stored.items()
                if path.endswith("/" + name)
                and len(held) > len(shape)
                and held[len(held) - len(shape) :] == shape
            ]
            out[i] = stacks[0] if len(stacks) == 1 else None
    return out


_ROLES = {"w": "weight", "b": "bias", "scale": "gain", "offset": "bias"}


def _priors(records: list, stored: dict) -> list[Prior]:
    """The priors of the ``w`` / ``b`` parameters of ``hk.Linear`` and ``hk.ConvND``
    modules and the ``scale`` / ``offset`` of ``hk.LayerNorm``; ``stored``: path -> shape
    of the parameters as ``init`` returns them."""
    priors = []
    paths = _stored_paths(records, stored)
    for (full_name, module, shape, init), path in zip(records, paths, strict=True):
        leaf = full_name.rsplit("/", 1)[-1]
        norm = isinstance(module, hk.LayerNorm) and leaf in ("scale", "offset")
        if not (norm or (isinstance(module, hk.Linear | hk.ConvND) and leaf in ("w", "b"))):
            continue
        if path is None:
            continue
        kind = _ROLES[leaf]
        where = f"{leaf}_init of {type(module).__name__} {module.module_name!r}"
        fan = math.prod(shape[:-1]) if kind == "weight" else 1  # (in, out), (*window, in / g, out)
        variance = entry_variance(init, shape, kind == "gain")
        priors.append(Prior.read(path, kind, variance, where, fan))
    return priors


def _reader(transformed, apply_kwargs):
    def read(x1):
        records = []

        def creator(next_creator, shape, dtype, init, context):
            records.append((context.full_name, context.module, tuple(shape), init))
            return next_creator(shape, dtype, init)

        def init_seen(x):  # the user's init, nested in a transform of ours to see its creators
            with hk.custom_creator(creator):
                return transformed.init(jax.random.PRNGKey(0), x, **apply_kwargs)

        outer = hk.transform(init_seen)
        shapes = jax.eval_shape(lambda x: outer.apply({}, jax.random.PRNGKey(0), x), x1)
        leaves = jax.tree_util.tree_leaves(shapes)
        stored = {n: tuple(v.shape) for n, v in zip(leaf_path_names(shapes), leaves, strict=True)}
        return _priors(records, stored)

    return read


@checked_arguments(_NAME)
def infinite_kernel_fn(transformed, params, *, W_std=None, b_std=None, apply_kwargs=None):
    """Infinite-width NNGP and NTK of a Haiku model, as every hidden width grows, in its own
    (standard) parameterisation: :func:`ntk_core.infinite_kernel_fn` of
    ``transformed.apply(params, None, x)``, priors read from the initialisers.

    Args: ``transformed`` an ``hk.Transformed`` (``hk.without_apply_rng`` too); ``params``
    ``transformed.init``'s; ``W_std`` / ``b_std`` ``None`` (read from each ``hk.Linear`` /
    ``hk.ConvND`` parameter's ``init``: the default ``w_init`` gives W_std² ≈ 0.7737,
    ``TruncatedNormal``, ``RandomNormal``, centred ``RandomUniform``, ``VarianceScaling``
    (W_std² = fan_in · Var(w)), ``Constant(0)`` / zeros b_std = 0), one float for every
    weight / bias, or a Mapping from a leaf's path (``"mlp/~/linear_0/w"``) to a float,
    which replaces what was read; ``apply_kwargs`` the model's keywords.
    Returns: the core's kernel function ``kernel_fn(x1, x2=None, get=None, **options)``
    (NNGP / NTK ``(N1, N2)`` for x1 (N1, ...), x2 (N2, ...)), built at its first call
    (the parameters' initialisers are seen on x1); attributes such as ``report(x)`` likewise.
    Raises: TypeError: not an ``hk.Transformed``, ``W_std`` / ``b_std`` not a float or a
    Mapping; ValueError (at the first call): an initialiser without a known variance (a
    non-centred one, a custom function) and no ``W_std`` / ``b_std`` for its path; the core's.
    Cost: one abstract ``transformed.init`` on x1; then as the core's.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.transform(lambda x: hk.nets.MLP([8, 1])(x)), jnp.ones((3, 2))
      >>> kernel_fn = ntk_haiku.infinite_kernel_fn(net, net.init(jax.random.PRNGKey(0), x))
      >>> kernel_fn(x, None, "ntk").shape
      (3, 3)

    References: Novak et al., "Neural Tangents", ICLR 2020; Yang, "Tensor Programs I", 2019.
    """
    check_transformed(_NAME, transformed)
    if isinstance(transformed, hk.TransformedWithState):
        what = "an hk.TransformedWithState's state (e.g. BatchNorm statistics) has no rule"
        raise bad(TypeError, _NAME, what, "pass an hk.Transformed of a model without state")
    apply_kwargs = check_apply_kwargs(_NAME, apply_kwargs, "{'is_training': False}")

    rng = (None,) if "rng" in inspect.signature(transformed.apply).parameters else ()

    def apply_fn(p, x):
        return transformed.apply(p, *rng, x, **apply_kwargs)

    read = _reader(transformed, apply_kwargs)
    return DeferredInfinite(_NAME, apply_fn, params, read, W_std, b_std)
