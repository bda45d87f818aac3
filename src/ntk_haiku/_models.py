"""Reference architectures (Haiku twins of ``ntk_flax``'s) and weight transplant."""

from __future__ import annotations

import re
from collections.abc import Mapping

import haiku as hk
import jax
import numpy as np


def lenet(x, out_features: int = 1):
    """Haiku forward function of the LeNet of case C1; use inside ``hk.transform``.

    Conv(6, 5x5, SAME) → ReLU → avg-pool 2x2/2 → Conv(16, 5x5, SAME) → ReLU → avg-pool
    2x2/2 → flatten → Dense 120 → ReLU → Dense 84 → ReLU → Dense ``out_features``: the
    same architecture and module names (``Conv_0``, ``Conv_1``, ``Dense_0..2``) as
    ``ntk_flax.LeNet``, so ``params_from_flax(variables["params"])`` transplants its
    weights.

    Args:
      x: inputs ``(N, H, W, C)``, H and W multiples of 4.
      out_features: the output size O.

    Returns:
      Outputs ``(N, O)``, in the dtype of ``x`` and the parameters.

    Raises:
      Haiku's errors for inputs of another rank (this is a plain forward function).

    Cost: one forward pass, about 2·N·H·W·(3·25·6 + 6·25·16/4) multiply-adds for the
    convolutions.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import ntk_haiku
      >>> net = hk.without_apply_rng(hk.transform(ntk_haiku.lenet))
      >>> x = jnp.ones((2, 16, 16, 3))
      >>> net.apply(net.init(jax.random.PRNGKey(0), x), x).shape
      (2, 1)

    References:
      LeCun et al., "Gradient-based learning applied to document recognition", 1998;
      the users' case C1.
    """
    for i, features in enumerate((6, 16)):
        x = hk.Conv2D(features, 5, padding="SAME", name=f"Conv_{i}")(x)
        x = hk.avg_pool(jax.nn.relu(x), (1, 2, 2, 1), (1, 2, 2, 1), padding="VALID")
    x = x.reshape((x.shape[0], -1))
    for i, features in enumerate((120, 84)):
        x = jax.nn.relu(hk.Linear(features, name=f"Dense_{i}")(x))
    return hk.Linear(out_features, name=f"Dense_{2}")(x)


def params_from_flax(flax_params: Mapping, haiku_params: Mapping | None = None) -> dict:
    """Haiku params holding the weights of a Flax stack of Dense and Conv layers.

    Flax and Haiku store Dense and Conv kernels in the same layout (``(in, out)`` and
    ``(*window, in, out)``), so a transplant only renames: ``kernel`` becomes ``w`` and
    ``bias`` becomes ``b``; the arrays are reused, not copied or transposed.

    Without ``haiku_params`` the Flax layer names are kept:
    ``{"Dense_0": {"kernel": W, "bias": b}}`` becomes ``{"Dense_0": {"w": W, "b": b}}``,
    which fits Haiku models whose modules carry the Flax names (``ntk_haiku.lenet``,
    the twin of ``ntk_flax.LeNet``). Leaves need not be arrays (a per-leaf kernel tree
    or a plan's methods laid out like the params are renamed the same way).

    With ``haiku_params`` (what ``transformed.init(key, x)`` returns, or
    ``jax.eval_shape`` of it: only its names and shapes are read) the Flax layers are
    paired in order with the Haiku modules and the result carries the Haiku names, so
    ``nn.Dense`` layers fit ``hk.nets.MLP`` (``'mlp/~/linear_0'``, ...) and
    ``nn.Conv``/``nn.Dense`` layers fit ``hk.Conv2D``/``hk.Linear`` with Haiku's default
    names (``'conv2_d'``, ``'conv2_d_1'``, ``'linear'``, ``'linear_1'``, ...). The order:

    * layers pair kind by kind, the kind being the kernel's rank (2 for Dense/Linear,
      N + 2 for an N-D Conv), so how Conv and Dense layers interleave in the forward
      pass does not matter;
    * within a kind, names sharing a prefix up to a final ``_<number>`` are ordered by
      that number, the bare name first (``Dense_2`` before ``Dense_10``; ``linear``,
      ``linear_1``, ..., ``linear_10``; ``nn.Sequential``'s ``layers_0``, ``layers_2``).
      Both frameworks number layers in order of construction, which is the order of
      the forward pass when each layer is created where it is applied (not so in
      ``nn.Dense(1)(nn.Dense(8)(x))``, whose outer ``Dense_0`` is created first);
    * different prefixes of one kind keep the order in which they first appear in the
      mapping. That is creation order for the dicts ``init`` returns, but alphabetical
      after ``jax.jit``, ``jax.eval_shape`` or ``jax.tree.map``, which sort keys: where
      one kind spans several prefixes (``hk.nets.MLP`` followed by a bare
      ``hk.Linear``: ``'mlp/~/linear_0'``, ..., ``'linear'``), pass ``init``'s own dict.

    Every pair is checked: the Flax ``kernel`` has the shape of the Haiku ``w``, and a
    ``bias`` is present on both with the shape of ``b``, or on neither.

    Args:
      flax_params: a Flax ``params`` collection (``variables["params"]``) mapping layer
        names to ``{"kernel": (..., in, out), "bias": (out,)}`` (``bias`` optional).
        Nested modules and other parameters (BatchNorm, LayerNorm, Embed) are refused.
      haiku_params: optional Haiku params of the target model, mapping module names to
        ``{"w": (..., in, out), "b": (out,)}`` (``b`` optional), e.g.
        ``transformed.init(key, x)``; ``None`` keeps the Flax names.

    Returns:
      A dict of dicts of the Flax leaves: ``{module: {"w": kernel, "b": bias}}``, with
      the Flax layer names and order when ``haiku_params`` is ``None``, otherwise with
      the Haiku module names in ``haiku_params``'s order, each leaf keeping its Flax
      shape and dtype.

    Raises:
      TypeError: ``flax_params`` or ``haiku_params`` is not a mapping.
      ValueError: ``flax_params`` is a whole variables dict (pass its ``"params"``),
        holds nested modules or a layer other than Dense/Conv; ``haiku_params`` holds a
        module other than ``hk.Linear``/``hk.ConvND``; the two have different numbers
        of layers of some kernel rank; or a pair's shapes or biases differ.

    Cost: no computation and no inputs ``(N, ...)``; the result shares the Flax arrays.

    Example:
      >>> import flax.linen as nn, haiku as hk, jax, jax.numpy as jnp
      >>> import ntk_haiku
      >>> class MLP(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         h = jnp.tanh(nn.Dense(8)(x))
      ...         return nn.Dense(1)(h)
      >>> x = jnp.ones((4, 3))
      >>> variables = MLP().init(jax.random.PRNGKey(0), x)
      >>> net = hk.without_apply_rng(hk.transform(
      ...     lambda x: hk.nets.MLP([8, 1], activation=jnp.tanh)(x)))
      >>> template = net.init(jax.random.PRNGKey(1), x)
      >>> params = ntk_haiku.params_from_flax(variables["params"], template)
      >>> {name: params[name]["w"].shape for name in params}
      {'mlp/~/linear_0': (3, 8), 'mlp/~/linear_1': (8, 1)}
      >>> bool(jnp.allclose(net.apply(params, x), MLP().apply(variables, x), atol=1e-6))
      True

    References:
      Flax's ``nn.Dense`` / ``nn.Conv`` and Haiku's ``hk.Linear`` / ``hk.ConvND``
      documentation: both store kernels as ``(..., in, out)``.
    """
    layers = _flax_layers(flax_params, require_kernel=haiku_params is not None)
    if haiku_params is None:
        return {
            layer: {_FLAX_TO_HAIKU[k]: v for k, v in leaves.items()}
            for layer, leaves in layers.items()
        }
    modules = _haiku_modules(haiku_params)
    flax_kinds = _by_kind(layers, "kernel")
    haiku_kinds = _by_kind(modules, "w")
    if {r: len(n) for r, n in flax_kinds.items()} != {r: len(n) for r, n in haiku_kinds.items()}:
        message = (
            f"params_from_flax: got {len(layers)} Flax layers ({_listed(flax_kinds)}) but "
            f"{len(modules)} Haiku modules ({_listed(haiku_kinds)}). Fix: build the Haiku model "
            f"from the same layers (one hk.Linear per nn.Dense, one hk.ConvND per nn.Conv)."
        )
        raise ValueError(message)
    pairs = {}
    for rank, flax_names in flax_kinds.items():
        haiku_names = haiku_kinds[rank]
        for i, (layer, module) in enumerate(zip(flax_names, haiku_names, strict=True)):
            _check_pair(layer, layers[layer], module, modules[module], i, len(flax_names))
            pairs[module] = layer
    return {
        module: {k: layers[pairs[module]][_HAIKU_TO_FLAX[k]] for k in leaves}
        for module, leaves in modules.items()
    }


_FLAX_TO_HAIKU = {"kernel": "w", "bias": "b"}
_HAIKU_TO_FLAX = {v: k for k, v in _FLAX_TO_HAIKU.items()}
_NUMBERED = re.compile(r"^(.*)_(\d+)$")


def _flax_layers(flax_params, require_kernel: bool) -> Mapping:
    """``flax_params`` after checking it is a flat collection of Dense/Conv layers."""
    if not isinstance(flax_params, Mapping):
        message = (
            f"params_from_flax: flax_params must be a Flax params collection, got "
            f"{type(flax_params).__name__}. Fix: pass variables['params']."
        )
        raise TypeError(message)
    inner = flax_params.get("params")
    if isinstance(inner, Mapping) and any(isinstance(v, Mapping) for v in inner.values()):
        message = (
            f"params_from_flax: got a Flax variables dict (collections "
            f"{sorted(map(str, flax_params))}); expected its 'params' collection. Fix: pass "
            f"variables['params']."
        )
        raise ValueError(message)
    for layer, leaves in flax_params.items():
        if not isinstance(leaves, Mapping):
            message = (
                f"params_from_flax: Flax layer {layer!r} holds a {type(leaves).__name__}, not "
                f"a mapping. Fix: pass variables['params'] (a lone layer's as "
                f"{{'Dense_0': variables['params']}})."
            )
            raise ValueError(message)
        nested = sorted(str(k) for k, v in leaves.items() if isinstance(v, Mapping))
        if nested:
            message = (
                f"params_from_flax: Flax module {layer!r} holds submodules {nested}. Fix: "
                f"create the Dense/Conv layers in the top module, or map their params by hand."
            )
            raise ValueError(message)
        others = set(leaves) - set(_FLAX_TO_HAIKU)
        if others or (require_kernel and "kernel" not in leaves):
            haiku_like = leaves and set(leaves) <= set(_HAIKU_TO_FLAX)
            message = (
                f"params_from_flax: Flax layer {layer!r} holds {sorted(map(str, leaves))}, not "
                f"'kernel' and 'bias' (Dense, Conv). Fix: "
                + (
                    "these look like Haiku params: pass the Flax params first."
                    if haiku_like
                    else "transplant the other layers' params by hand."
                )
            )
            raise ValueError(message)
    return flax_params


def _haiku_modules(haiku_params) -> Mapping:
    """``haiku_params`` after checking it holds only ``hk.Linear``/``hk.ConvND``."""
    if not isinstance(haiku_params, Mapping):
        message = (
            f"params_from_flax: haiku_params must be the Haiku model's params dict, got "
            f"{type(haiku_params).__name__}. Fix: pass params from transformed.init(key, x)."
        )
        raise TypeError(message)
    for module, leaves in haiku_params.items():
        held = sorted(map(str, leaves)) if isinstance(leaves, Mapping) else None
        if held is None or set(held) - set(_HAIKU_TO_FLAX) or "w" not in held:
            flax_like = held is not None and set(held) <= set(_FLAX_TO_HAIKU)
            message = (
                f"params_from_flax: Haiku module {module!r} holds "
                f"{held if held is not None else type(leaves).__name__}, not 'w' and 'b' "
                f"(hk.Linear, hk.ConvND). Fix: "
                + (
                    "these look like Flax params: pass the Flax params first."
                    if flax_like
                    else "transplant the other modules' params by hand."
                )
            )
            raise ValueError(message)
    return haiku_params


def _natural(names: list) -> list:
    """``names`` grouped by prefix (first appearance), by final number within one."""

    def split(name):
        match = _NUMBERED.match(str(name))
        return (match[1], int(match[2])) if match else (str(name), 0)

    first: dict[str, int] = {}
    for position, name in enumerate(names):
        first.setdefault(split(name)[0], position)
    return sorted(names, key=lambda name: (first[split(name)[0]], split(name)[1]))


def _by_kind(layers: Mapping, kernel: str) -> dict[int, list]:
    """Layer names by kernel rank (ascending), each list in pairing order."""
    kinds: dict[int, list] = {}
    for name, leaves in layers.items():
        kinds.setdefault(len(_shape(leaves[kernel])), []).append(name)
    return {rank: _natural(kinds[rank]) for rank in sorted(kinds)}


def _listed(kinds: dict[int, list]) -> str:
    return "; ".join(f"rank {rank}: {names}" for rank, names in kinds.items()) or "none"


def _shape(leaf) -> tuple:
    return tuple(leaf.shape) if hasattr(leaf, "shape") else np.shape(leaf)


def _check_pair(layer, flax_leaves, module, haiku_leaves, index, count) -> None:
    where = (
        f"Flax layer {layer!r} and Haiku module {module!r} (pair {index + 1} of {count} "
        f"with rank-{len(_shape(flax_leaves['kernel']))} kernels)"
    )
    if ("bias" in flax_leaves) != ("b" in haiku_leaves):
        with_bias, without = (layer, module) if "bias" in flax_leaves else (module, layer)
        message = (
            f"params_from_flax: {where}: {with_bias!r} has a bias and {without!r} has none. "
            f"Fix: match use_bias= of the Flax layer and with_bias= of the Haiku module."
        )
        raise ValueError(message)
    for flax_name, haiku_name in _FLAX_TO_HAIKU.items():
        if flax_name not in flax_leaves:
            continue
        got, want = _shape(flax_leaves[flax_name]), _shape(haiku_leaves[haiku_name])
        if got != want:
            message = (
                f"params_from_flax: {where}: {flax_name} has shape {got} but {haiku_name} has "
                f"shape {want}. Fix: give the Haiku modules the Flax layers' sizes, in order."
            )
            raise ValueError(message)
