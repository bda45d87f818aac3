"""Infinite-width NNGP / NTK of Equinox models (``ntk_core.infinite_kernel_fn``), with the
priors of ``eqx.nn.Linear`` / ``eqx.nn.Conv`` layers (inside ``MLP``, ``Sequential`` or any
module) from their one fixed initialiser: weight and bias uniform in ±1/√fan_in
(``equinox.nn._misc.default_init``), so W_std² = fan_in · lim²/3 = 1/3 and
b_std² = 1/(3·fan_in). A model holds no record of weights the user replaced
(``eqx.tree_at``): the core's value check warns, and ``W_std=`` / ``b_std=`` say them.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax

from ntk_core.adapters import DeferredInfinite, Prior, checked_arguments, leaf_path_names
from ntk_equinox._kernel import _split

_NAME = "ntk_equinox.infinite_kernel_fn"
_LAYERS = (eqx.nn.Linear, eqx.nn.Conv)


def _fan_in(layer) -> int:
    if isinstance(layer, eqx.nn.Linear):
        return 1 if layer.in_features == "scalar" else int(layer.in_features)
    return layer.in_channels // layer.groups * math.prod(layer.kernel_size)


def _priors(model, params) -> list[Prior]:
    """The priors of every Linear / Conv layer's ``weight`` and ``bias`` leaves, named as
    the core names ``params``' leaves (the layers' arrays are those very objects)."""
    names = {
        id(leaf): name
        for leaf, name in zip(jax.tree.leaves(params), leaf_path_names(params), strict=True)
    }
    priors = []
    for layer in jax.tree.leaves(model, is_leaf=lambda m: isinstance(m, _LAYERS)):
        if not isinstance(layer, _LAYERS) or id(layer.weight) not in names:
            continue
        fan_in = _fan_in(layer)
        path = names[id(layer.weight)].rsplit("/", 1)[0]
        where = f"{type(layer).__name__} {path!r} (uniform in ±1/√{fan_in})"
        std = math.sqrt(1 / 3) if fan_in else 1.0  # lim = 1 when fan_in = 0 (no weights)
        priors.append(Prior(names[id(layer.weight)], "weight", std, "", where))
        if id(layer.bias) in names:
            bias_std = math.sqrt(1 / (3 * max(fan_in, 1)))
            priors.append(Prior(names[id(layer.bias)], "bias", bias_std, "", where))
    return priors


@checked_arguments(_NAME)
def infinite_kernel_fn(model, *, W_std=None, b_std=None):
    """Infinite-width NNGP and NTK of an Equinox model, as every hidden width grows, in its
    own (standard) parameterisation: :func:`ntk_core.infinite_kernel_fn` of
    ``jax.vmap(model)(x)`` with the model's floating arrays as parameters.

    Args: ``model`` a callable ``eqx.Module`` of one sample; ``W_std`` / ``b_std`` ``None``
    (read: every ``eqx.nn.Linear`` / ``eqx.nn.Conv`` draws weights and biases uniform in
    ±1/√fan_in, so W_std = 1/√3 and b_std = 1/√(3·fan_in)), one float for every weight /
    bias, or a Mapping from a leaf's path (``"layers/0/weight"``) to a float, which replaces
    what was read (weights the user replaced, ``eqx.tree_at``, need it).
    Returns: the core's kernel function ``kernel_fn(x1, x2=None, get=None, **options)``:
    NNGP / NTK of shape ``(N1, N2)`` for x1 (N1, ...) and x2 (N2, ...).
    Raises: TypeError: ``model`` not a callable ``eqx.Module``, ``W_std`` / ``b_std`` not a
    float or a Mapping; ValueError: a stateful layer, no floating leaves; the core's errors.
    Cost: a walk over the model's layers; then as the core's.
    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, ntk_equinox
      >>> mlp = eqx.nn.MLP(2, 1, 8, 1, key=jax.random.PRNGKey(0))
      >>> ntk_equinox.infinite_kernel_fn(mlp)(jnp.ones((3, 2)), None, "ntk").shape
      (3, 3)

    References: Novak et al., "Neural Tangents", ICLR 2020; Yang, "Tensor Programs I", 2019.
    """
    params, arrays, apply = _split(_NAME, model, "x")

    def apply_fn(p, x):
        return apply(p, x, arrays)

    return DeferredInfinite(
        _NAME, apply_fn, params, lambda x: _priors(model, params), W_std, b_std, eager=True
    )
