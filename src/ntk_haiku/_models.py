"""Reference architectures (Haiku twins of ``ntk_flax``'s) and weight transplant."""

from __future__ import annotations

import re
from collections.abc import Mapping

import haiku as hk
import jax
import numpy as np

from ntk_core.adapters import bad


def lenet(x, out_features: int = 1):
    """Haiku forward function of ``ntk_flax.LeNet`` (same layers and module names, so
    ``params_from_flax(variables["params"])`` transplants its weights); use inside
    ``hk.transform``.

    Args: ``x`` inputs ``(N, H, W, C)``, H and W multiples of 4; ``out_features`` O.
    Returns: outputs ``(N, O)`` in the dtype of ``x`` and the parameters.
    Raises: Haiku's errors for inputs of another rank.
    Cost: one forward pass, about 2·N·H·W·(3·25·6 + 6·25·16/4) multiply-adds.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(ntk_haiku.lenet)), jnp.ones((2, 16, 16, 3))
      >>> net.apply(net.init(jax.random.PRNGKey(0), x), x).shape
      (2, 1)

    References: LeCun et al., "Gradient-based learning applied to document recognition",
    1998.
    """
    for i, features in enumerate((6, 16)):
        x = hk.Conv2D(features, 5, padding="SAME", name=f"Conv_{i}")(x)
        x = hk.avg_pool(jax.nn.relu(x), (1, 2, 2, 1), (1, 2, 2, 1), padding="VALID")
    x = x.reshape((x.shape[0], -1))
    for i, features in enumerate((120, 84)):
        x = jax.nn.relu(hk.Linear(features, name=f"Dense_{i}")(x))
    return hk.Linear(out_features, name=f"Dense_{2}")(x)


def params_from_flax(flax_params: Mapping, haiku_params: Mapping | None = None) -> dict:
    """Haiku params holding the weights of a Flax stack of Dense and Conv layers: both store
    kernels as ``(..., in, out)``, so ``kernel`` is renamed ``w`` and ``bias`` ``b``; the
    arrays are reused, not copied. Leaves need not be arrays (a per-leaf kernel tree is
    renamed the same way).

    Without ``haiku_params`` the Flax layer names are kept (they fit ``ntk_haiku.lenet``).
    With them, Flax layers pair in order with Haiku modules, and the result carries the
    Haiku names (``'mlp/~/linear_0'``, ``'conv2_d_1'``, ...). Order: kind by kind (the
    kernel's rank); within a kind, by the final ``_<number>`` of names sharing a prefix,
    the bare name first (creation order in both frameworks, not so in
    ``nn.Dense(1)(nn.Dense(8)(x))``); different prefixes in
    their order in the mapping (``init``'s dict keeps creation order, ``jax.jit`` and
    ``jax.tree.map`` sort keys). Each pair's shapes and biases must agree.

    Args:
      flax_params: ``variables["params"]``: layer name -> ``{"kernel", "bias"}`` (bias
        optional); nested modules and other layers (BatchNorm, Embed) are refused.
      haiku_params: ``None`` or the target's params (``transformed.init(key, x)`` or its
        ``jax.eval_shape``): module name -> ``{"w", "b"}``.

    Returns:
      ``{module: {"w": kernel, "b": bias}}`` of the Flax leaves, in Flax's names and order
      without ``haiku_params``, else in Haiku's.

    Raises:
      TypeError: ``flax_params`` or ``haiku_params`` not a mapping.
      ValueError: a whole variables dict; nested modules or layers other than Dense/Conv
        (Linear/ConvND); different numbers of layers of a kernel rank; a pair's shapes
        or biases differ.

    Cost: no computation; the result shares the Flax arrays.

    Example:
      >>> import flax.linen as nn, haiku as hk, jax, jax.numpy as jnp, ntk_haiku
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

    References: Flax's ``nn.Dense`` / ``nn.Conv`` and Haiku's ``hk.Linear`` /
    ``hk.ConvND`` documentation.
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
        what = f"got {len(layers)} Flax layers ({_listed(flax_kinds)}) but {len(modules)} Haiku "
        fix = "build the Haiku model from the same layers (hk.Linear for nn.Dense, ConvND for Conv)"
        raise bad(ValueError, _FN, what + f"modules ({_listed(haiku_kinds)})", fix)
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
_FN, _PARAMS = "params_from_flax", "pass variables['params']"


def _other(swapped: bool, framework: str) -> str:
    if swapped:
        return f"these look like {framework} params: pass the Flax params first"
    return f"transplant the other {'layers' if framework == 'Haiku' else 'modules'}' params by hand"


def _flax_layers(flax_params, require_kernel: bool) -> Mapping:
    """``flax_params`` after checking it is a flat collection of Dense/Conv layers."""
    if not isinstance(flax_params, Mapping):
        what = f"flax_params must be a Flax params collection, got {type(flax_params).__name__}"
        raise bad(TypeError, _FN, what, _PARAMS)
    inner = flax_params.get("params")
    if isinstance(inner, Mapping) and any(isinstance(v, Mapping) for v in inner.values()):
        what = f"got a Flax variables dict (collections {sorted(map(str, flax_params))}); "
        raise bad(ValueError, _FN, what + "expected its 'params' collection", _PARAMS)
    for layer, leaves in flax_params.items():
        if not isinstance(leaves, Mapping):
            what = f"Flax layer {layer!r} holds a {type(leaves).__name__}, not a mapping"
            fix = f"{_PARAMS} (a lone layer's as {{'Dense_0': variables['params']}})"
            raise bad(ValueError, _FN, what, fix)
        nested = sorted(str(k) for k, v in leaves.items() if isinstance(v, Mapping))
        if nested:
            what = f"Flax module {layer!r} holds submodules {nested}"
            fix = "create the Dense/Conv layers in the top module, or map their params by hand"
            raise bad(ValueError, _FN, what, fix)
        others = set(leaves) - set(_FLAX_TO_HAIKU)
        if others or (require_kernel and "kernel" not in leaves):
            haiku_like = leaves and set(leaves) <= set(_HAIKU_TO_FLAX)
            what = f"Flax layer {layer!r} holds {sorted(map(str, leaves))}, not 'kernel' and "
            raise bad(ValueError, _FN, what + "'bias' (Dense, Conv)", _other(haiku_like, "Haiku"))
    return flax_params


def _haiku_modules(haiku_params) -> Mapping:
    """``haiku_params`` after checking it holds only ``hk.Linear``/``hk.ConvND``."""
    if not isinstance(haiku_params, Mapping):
        what = (
            f"haiku_params must be the Haiku model's params dict, got {type(haiku_params).__name__}"
        )
        raise bad(TypeError, _FN, what, "pass params from transformed.init(key, x)")
    for module, leaves in haiku_params.items():
        held = sorted(map(str, leaves)) if isinstance(leaves, Mapping) else None
        if held is None or set(held) - set(_HAIKU_TO_FLAX) or "w" not in held:
            flax_like = held is not None and set(held) <= set(_FLAX_TO_HAIKU)
            got = held if held is not None else type(leaves).__name__
            what = f"Haiku module {module!r} holds {got}, not 'w' and 'b' (hk.Linear, hk.ConvND)"
            raise bad(ValueError, _FN, what, _other(flax_like, "Flax"))
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
        what = f"{where}: {with_bias!r} has a bias and {without!r} has none"
        fix = "match use_bias= of the Flax layer and with_bias= of the Haiku module"
        raise bad(ValueError, _FN, what, fix)
    for flax_name, haiku_name in _FLAX_TO_HAIKU.items():
        if flax_name not in flax_leaves:
            continue
        got, want = _shape(flax_leaves[flax_name]), _shape(haiku_leaves[haiku_name])
        if got != want:
            what = f"{where}: {flax_name} has shape {got} but {haiku_name} has shape {want}"
            raise bad(ValueError, _FN, what, "give the Haiku modules the Flax layers' sizes")
