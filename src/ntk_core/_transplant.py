"""Weight transplants between Flax and Haiku stacks of Dense/Linear and Conv/ConvND layers, both
storing kernels ``(..., in, out)``: renamed (``kernel`` <-> ``w``, ``bias`` <-> ``b``), paired
in order, arrays reused; plain dicts in and out, neither framework imported."""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from ntk_core._errors import bad, must

_FLAX_TO_HAIKU = {"kernel": "w", "bias": "b"}
_HAIKU_TO_FLAX = {v: k for k, v in _FLAX_TO_HAIKU.items()}
(_KERNEL, _BIAS), (_W, _B) = _FLAX_TO_HAIKU, _HAIKU_TO_FLAX
_NUMBERED = re.compile(r"^(.*?)_?(\d+)$")  # Dense_3, fc3: a prefix and a creation number
_PARAMS = "pass variables['params']"
_BY_HAND = "transplant their params by hand"


def params_from_flax(flax_params: Mapping, haiku_params: Mapping | None = None) -> dict:
    """Haiku params holding the weights of a Flax stack of Dense and Conv layers (``kernel``
    renamed ``w``, ``bias`` ``b``; arrays reused; leaves need not be arrays).

    Without ``haiku_params`` the Flax layer names are kept (they fit ``ntk_haiku.lenet``);
    with them, Flax layers pair in order with Haiku modules and take the Haiku names
    (``'mlp/~/linear_0'``, ...). Order: by kernel rank; within one, names sharing a prefix
    by their final number (``_3`` or ``3``), the bare name first (creation order in both frameworks,
    not in ``nn.Dense(1)(nn.Dense(8)(x))``); prefixes in mapping order (``init`` keeps
    creation order, ``jax.jit`` and ``jax.tree.map`` sort keys). Each pair's shapes and
    biases must agree.

    Args:
      flax_params: ``variables["params"]``: layer -> ``{"kernel", "bias"}`` (bias optional);
        nested modules and other layers (BatchNorm, Embed) are refused.
      haiku_params: ``None`` or the target's params (``transformed.init(key, x)`` or its
        ``jax.eval_shape``; names and shapes read): module -> ``{"w", "b"}``.

    Returns ``{module: {"w": kernel, "b": bias}}`` of the Flax leaves, named and ordered as
    Flax without ``haiku_params``, else as Haiku.

    Raises:
      TypeError: ``flax_params`` or ``haiku_params`` not a mapping.
      ValueError: a whole variables dict; nested modules or layers other than Dense/Conv;
        different numbers of layers of a kernel rank; a pair's shapes or biases differ;
        Flax keys in sorted order with kernels of equal shape under two name prefixes (the
        creation order is lost, e.g. after ``jax.tree.map``: a swap would go unnoticed;
        also from ``init`` where creation order happens to be sorted: pair by hand).

    Cost: no computation; the result shares the Flax arrays.

    Example:
      >>> import numpy as np
      >>> from ntk_core.testing import params_from_flax
      >>> flax = {"Dense_0": {"kernel": np.ones((3, 8)), "bias": np.zeros(8)},
      ...         "Dense_1": {"kernel": np.ones((8, 1)), "bias": np.zeros(1)}}
      >>> haiku = {"mlp/~/linear_0": {"w": np.ones((3, 8)), "b": np.ones(8)},
      ...          "mlp/~/linear_1": {"w": np.ones((8, 1)), "b": np.ones(1)}}
      >>> params = params_from_flax(flax, haiku)
      >>> params["mlp/~/linear_1"]["w"] is flax["Dense_1"]["kernel"]
      True

    References: Flax's ``nn.Dense``/``nn.Conv``, Haiku's ``hk.Linear``/``hk.ConvND`` docs.
    """
    fn = "params_from_flax"
    layers = _flax_layers(fn, flax_params, require_kernel=haiku_params is not None)
    if haiku_params is None:
        return {m: {_FLAX_TO_HAIKU[k]: v for k, v in ls.items()} for m, ls in layers.items()}
    modules = _haiku_modules(fn, haiku_params)
    pairs = _pairs(fn, layers, modules)
    return {m: {k: layers[pairs[m]][_HAIKU_TO_FLAX[k]] for k in ls} for m, ls in modules.items()}


def params_from_haiku(haiku_params: Mapping, flax_params: Mapping | None = None) -> dict:
    """Flax params holding the weights of a Haiku stack of ``hk.Linear`` / ``hk.ConvND``: the
    reverse of :func:`params_from_flax` (``w`` renamed ``kernel``, ``b`` ``bias``), with its
    pairing order and checks. ``haiku_params``: module -> ``{"w", "b"}`` (``b`` optional);
    ``flax_params``: ``None`` (Haiku names kept) or the target's ``variables["params"]`` (or
    its ``jax.eval_shape``; names and shapes read), giving Flax's names and order.

    Returns ``{layer: {"kernel": w, "bias": b}}`` sharing the Haiku arrays (no computation).
    Raises TypeError, ValueError as :func:`params_from_flax`, naming ``params_from_haiku``.

    Example:
      >>> import numpy as np
      >>> from ntk_core.testing import params_from_haiku
      >>> haiku = {"linear": {"w": np.ones((3, 8)), "b": np.zeros(8)},
      ...          "linear_1": {"w": np.ones((8, 1))}}
      >>> flax = {"Dense_0": {"kernel": np.zeros((3, 8)), "bias": np.zeros(8)},
      ...         "Dense_1": {"kernel": np.zeros((8, 1))}}
      >>> params = params_from_haiku(haiku, flax)
      >>> sorted(params), params["Dense_1"]["kernel"] is haiku["linear_1"]["w"]
      (['Dense_0', 'Dense_1'], True)
    """
    fn = "params_from_haiku"
    modules = _haiku_modules(fn, haiku_params)
    if flax_params is None:
        return {m: {_HAIKU_TO_FLAX[k]: v for k, v in ls.items()} for m, ls in modules.items()}
    layers = _flax_layers(fn, flax_params, require_kernel=True)
    pairs = {layer: module for module, layer in _pairs(fn, layers, modules).items()}
    return {f: {k: modules[pairs[f]][_FLAX_TO_HAIKU[k]] for k in ls} for f, ls in layers.items()}


def _pairs(fn, layers: Mapping, modules: Mapping) -> dict:
    """``{haiku module: flax layer}``, paired kind by kind in order, each pair checked."""
    flax_kinds, haiku_kinds = _by_kind(layers, _KERNEL), _by_kind(modules, _W)
    if {r: len(n) for r, n in flax_kinds.items()} != {r: len(n) for r, n in haiku_kinds.items()}:
        flax, haiku = _listed(flax_kinds), _listed(haiku_kinds)
        what = f"got {len(layers)} Flax layers ({flax}) but {len(modules)} Haiku modules ({haiku})"
        raise bad(ValueError, fn, what, "build the Haiku model from the same layers")
    keys = list(map(str, layers))
    sorted_keys, pairs = keys == sorted(keys), {}  # creation order may be lost (not Haiku's:
    for rank, flax_names in flax_kinds.items():  # it numbers every name it repeats)
        if sorted_keys:
            _order_shown(fn, flax_names, layers)
        for i, (layer, module) in enumerate(zip(flax_names, haiku_kinds[rank], strict=True)):
            _check_pair(fn, layer, layers[layer], module, modules[module], i, len(flax_names))
            pairs[module] = layer
    return pairs


def _other(swapped: bool) -> str:
    """The fix for leaves of another kind: the other framework's (swapped arguments) or not."""
    return "these hold the other framework's names: swap the two arguments" if swapped else _BY_HAND


def _flax_layers(fn, flax_params, require_kernel: bool) -> Mapping:
    """``flax_params`` after checking it is a flat collection of Dense/Conv layers."""
    if not isinstance(flax_params, Mapping):
        got = type(flax_params).__name__
        raise must(TypeError, fn, "flax_params", "a Flax params collection", got, _PARAMS)
    inner = flax_params.get("params")
    if isinstance(inner, Mapping) and any(isinstance(v, Mapping) for v in inner.values()):
        keys = sorted(map(str, flax_params))
        what = f"got a Flax variables dict (collections {keys}); expected its 'params' collection"
        raise bad(ValueError, fn, what, _PARAMS)
    for layer, leaves in flax_params.items():
        if not isinstance(leaves, Mapping):
            what = f"Flax layer {layer!r} holds a {type(leaves).__name__}, not a mapping"
            fix = f"{_PARAMS} (a lone layer's as {{'Dense_0': variables['params']}})"
            raise bad(ValueError, fn, what, fix)
        nested = sorted(str(k) for k, v in leaves.items() if isinstance(v, Mapping))
        if nested:
            what = f"Flax module {layer!r} holds submodules {nested}"
            fix = f"create the Dense/Conv layers in the top module, or {_BY_HAND}"
            raise bad(ValueError, fn, what, fix)
        others = set(leaves) - set(_FLAX_TO_HAIKU)
        if others or (require_kernel and _KERNEL not in leaves):
            haiku_like = leaves and set(leaves) <= set(_HAIKU_TO_FLAX)
            what = f"Flax layer {layer!r} holds {sorted(map(str, leaves))}, not kernel and bias"
            raise bad(ValueError, fn, what, _other(haiku_like))
    return flax_params


def _haiku_modules(fn, haiku_params) -> Mapping:
    """``haiku_params`` after checking it holds only ``hk.Linear``/``hk.ConvND``."""
    if not isinstance(haiku_params, Mapping):
        got, fix = type(haiku_params).__name__, "pass params from transformed.init(key, x)"
        raise must(TypeError, fn, "haiku_params", "the Haiku model's params dict", got, fix)
    for module, leaves in haiku_params.items():
        held = sorted(map(str, leaves)) if isinstance(leaves, Mapping) else None
        if held is None or set(held) - set(_HAIKU_TO_FLAX) or _W not in held:
            flax_like = held is not None and set(held) <= set(_FLAX_TO_HAIKU)
            got = held if held is not None else type(leaves).__name__
            what = f"Haiku module {module!r} holds {got}, not 'w' and 'b' (hk.Linear, hk.ConvND)"
            raise bad(ValueError, fn, what, _other(flax_like))
    return haiku_params


def _order_shown(fn, names: list, layers: Mapping) -> None:
    """Refuses a pairing order that Flax layer names in a sorted mapping cannot show
    (``jax.jit`` and ``jax.tree.map`` sort keys, losing creation order): kernels of one
    shape under two name prefixes (``embed``, ``proj``), which no shape check tells apart."""
    seen: dict[tuple, str] = {}
    for name in names:
        shape, prefix = _shape(layers[name][_KERNEL]), _key(name)[0]
        if seen.setdefault(shape, prefix) != prefix:
            what = f"Flax layers {names} are in sorted order with equal kernel shapes {shape}, so "
            fix = "name the layers in creation order (Dense_0, Dense_1, ...), or pair by hand"
            raise bad(ValueError, fn, what + "their creation order is unknown", fix)


def _key(name) -> tuple:
    """(prefix, final number) of a name: ``Dense_3`` -> ("Dense", 3), ``head`` -> ("head", 0)."""
    return (m[1], int(m[2])) if (m := _NUMBERED.match(str(name))) else (str(name), 0)


def _natural(names: list) -> list:
    """``names`` grouped by prefix (first appearance), by final number within one."""
    keys = {n: _key(n) for n in names}
    first: dict[str, int] = {}
    for prefix, _ in keys.values():
        first.setdefault(prefix, len(first))
    return sorted(names, key=lambda n: (first[keys[n][0]], keys[n][1]))


def _by_kind(layers: Mapping, kernel: str) -> dict[int, list]:
    """Layer names by kernel rank (ascending), each list in pairing order."""
    kinds: dict[int, list] = {}
    for name, leaves in layers.items():
        kinds.setdefault(len(_shape(leaves[kernel])), []).append(name)
    return {rank: _natural(kinds[rank]) for rank in sorted(kinds)}


def _listed(kinds: dict[int, list]) -> str:
    return "; ".join(f"rank {rank}: {names}" for rank, names in kinds.items()) or "none"


def _shape(leaf) -> tuple:
    return tuple(np.shape(leaf))  # .shape where there is one


def _check_pair(fn, layer, flax_leaves, module, haiku_leaves, index, count) -> None:
    rank = len(_shape(flax_leaves[_KERNEL]))
    where = f"Flax layer {layer!r}, Haiku module {module!r} (rank-{rank} pair {index + 1}/{count})"
    if (_BIAS in flax_leaves) != (_B in haiku_leaves):
        with_bias, without = (layer, module) if _BIAS in flax_leaves else (module, layer)
        what = f"{where}: {with_bias!r} has a bias and {without!r} has none"
        raise bad(ValueError, fn, what, "match use_bias= (Flax) and with_bias= (Haiku)")
    for flax_name, haiku_name in _FLAX_TO_HAIKU.items():
        if flax_name not in flax_leaves:
            continue
        got, want = _shape(flax_leaves[flax_name]), _shape(haiku_leaves[haiku_name])
        if got != want:
            what = f"{where}: {flax_name} has shape {got} but {haiku_name} has shape {want}"
            raise bad(ValueError, fn, what, "give the Haiku modules the Flax layers' sizes")
