"""Reference architectures: Haiku twins of ``ntk_flax``'s (the weight transplant,
``params_from_flax``, lives in :mod:`ntk_core.testing`)."""

from __future__ import annotations

import haiku as hk
import jax


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

    References: LeCun et al., "Gradient-based learning applied to document recognition", 1998.
    """
    for i, features in enumerate((6, 16)):
        x = hk.Conv2D(features, 5, padding="SAME", name=f"Conv_{i}")(x)
        x = hk.avg_pool(jax.nn.relu(x), (1, 2, 2, 1), (1, 2, 2, 1), padding="VALID")
    x = x.reshape((x.shape[0], -1))
    for i, features in enumerate((120, 84)):
        x = jax.nn.relu(hk.Linear(features, name=f"Dense_{i}")(x))
    return hk.Linear(out_features, name=f"Dense_{2}")(x)
