"""Reference architectures used by the demo, the tests and the benchmarks."""

from __future__ import annotations

import flax.linen as nn


class LeNet(nn.Module):
    """LeNet CNN of neural-tangents' batching report (case C1): two Conv(5x5, SAME) → ReLU
    → avg-pool 2x2/2 blocks (6, 16 features), then Dense 120 → 84 → ``out_features``.
    Inputs ``(N, H, W, C)``, outputs ``(N, out_features)``; module names match
    ``ntk_haiku.lenet`` (``ntk_haiku.params_from_flax`` transplants the weights).
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
