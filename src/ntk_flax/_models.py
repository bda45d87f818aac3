"""Reference architectures used by the demo, the tests and the benchmarks."""

from __future__ import annotations

import flax.linen as nn


class LeNet(nn.Module):
    """LeNet-style CNN of neural-tangents' batching report (case C1).

    Conv(6, 5x5, SAME) → ReLU → avg-pool 2x2/2 → Conv(16, 5x5, SAME) → ReLU → avg-pool
    2x2/2 → flatten → Dense 120 → ReLU → Dense 84 → ReLU → Dense ``out_features``.
    Inputs ``(N, H, W, C)`` (``(N, 32, 32, 3)`` in C1), outputs ``(N, out_features)``.
    Module names (``Conv_0``, ``Conv_1``, ``Dense_0``..``Dense_2``) match
    ``ntk_haiku.lenet`` so weights transplant with ``ntk_haiku.params_from_flax``.
    """

    out_features: int = 1

    @nn.compact
    def __call__(self, x):
        for i, features in enumerate((6, 16)):
            x = nn.Conv(features, (5, 5), padding="SAME", name=f"Conv_{i}")(x)
            x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        for i, features in enumerate((120, 84)):
            x = nn.relu(nn.Dense(features, name=f"Dense_{i}")(x))
        return nn.Dense(self.out_features, name="Dense_2")(x)
