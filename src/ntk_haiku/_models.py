"""Reference architectures (Haiku twins of ``ntk_flax``'s) and weight transplant."""

from __future__ import annotations

from collections.abc import Mapping

import haiku as hk
import jax


def lenet(x, out_features: int = 1):
    """Haiku forward function of the LeNet of case C1; use inside ``hk.transform``.

    The same architecture and module names as ``ntk_flax.LeNet``: inputs
    ``(N, H, W, C)``, outputs ``(N, out_features)``.
    """
    for i, features in enumerate((6, 16)):
        x = hk.Conv2D(features, 5, padding="SAME", name=f"Conv_{i}")(x)
        x = hk.avg_pool(jax.nn.relu(x), (1, 2, 2, 1), (1, 2, 2, 1), padding="VALID")
    x = x.reshape((x.shape[0], -1))
    for i, features in enumerate((120, 84)):
        x = jax.nn.relu(hk.Linear(features, name=f"Dense_{i}")(x))
    return hk.Linear(out_features, name=f"Dense_{2}")(x)


def params_from_flax(flax_params: Mapping) -> dict:
    """Haiku params from a Flax ``params`` collection of Dense / Conv layers.

    ``{"Dense_0": {"kernel": W, "bias": b}}`` becomes ``{"Dense_0": {"w": W, "b": b}}``:
    Flax and Haiku store Dense and Conv kernels in the same layout (``(in, out)`` and
    ``(H, W, in, out)``), so no transposition is needed. Nested Flax modules are not
    supported.

    Raises:
      ValueError: a layer with parameters other than ``kernel`` and ``bias``.
    """
    names = {"kernel": "w", "bias": "b"}
    out = {}
    for layer, leaves in flax_params.items():
        if not isinstance(leaves, Mapping) or set(leaves) - set(names):
            raise ValueError(
                f"params_from_flax: layer {layer!r} holds {sorted(leaves)}; only Dense and "
                f"Conv layers (kernel, bias) can be transplanted."
            )
        out[layer] = {names[k]: v for k, v in leaves.items()}
    return out
