"""ntk_haiku.infinite_kernel_fn (issue 50): priors read from Haiku's initialisers against
their own draws at a large width (the default w_init's uncorrected truncation against
scipy); kernels against neural-tangents 0.6.5's recorded stax kernel of hk.nets.MLP
(benchmarks/dump_nt_adapter_references.py) and ntk_core.stax twins (a CNN with Flatten; a
WideResNet block, LayerNorm, AvgPool and a global mean), in float64."""

from __future__ import annotations

import math

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import ntk_haiku
from adapter_reference import (
    REF,
    assert_draws_match_priors,
    assert_neural_tangents,
    resnet_block_twin,
)
from ntk_core import stax
from ntk_haiku._infinite import _reader

hi = hk.initializers


def forward(x):
    x = hk.Linear(2048)(x)  # TruncatedNormal(1/√fan_in), zeros
    x = hk.Linear(
        1024, w_init=hi.VarianceScaling(2.0, "fan_avg", "uniform"), b_init=hi.RandomNormal(0.05)
    )(x)
    x = hk.Linear(512, w_init=hi.RandomUniform(-0.1, 0.1), b_init=hi.Constant(0.0))(x)
    return hk.Conv1D(64, 3, w_init=hi.VarianceScaling(2.0, "fan_in", "truncated_normal"))(
        x[..., None]
    )


def test_priors_match_each_initialisers_draws():
    net, x = hk.transform(forward), jnp.ones((1, 256))
    params = net.init(jax.random.PRNGKey(0), x)
    priors = {p.path: p for p in _reader(net, {})(x)}
    expected = {  # the documented variances, not read from the initialisers
        "linear/w": math.sqrt(scipy.stats.truncnorm(-2, 2).var()),
        "linear_1/w": math.sqrt(2048 * 2.0 / ((2048 + 1024) / 2)),
        "linear_2/w": math.sqrt(1024 * 0.1**2 / 3),
        "conv1_d/w": math.sqrt(2.0),
        "linear/b": 0.0,
        "linear_1/b": 0.05,
        "linear_2/b": 0.0,
        "conv1_d/b": 0.0,
    }
    assert {p: q.std for p, q in priors.items()} == pytest.approx(expected, rel=1e-12)
    # the initialisers' own draws agree
    assert_draws_match_priors(
        priors, lambda path: params[path.rsplit("/", 1)[0]][path.rsplit("/", 1)[1]]
    )


def test_a_custom_initialiser_needs_its_prior():
    net = hk.without_apply_rng(
        hk.transform(lambda x: hk.Linear(3, w_init=lambda s, d: jnp.ones(s, d))(x))
    )
    x = jnp.ones((2, 4))
    params = net.init(jax.random.PRNGKey(0), x)
    with pytest.raises(
        ValueError, match=r"the weight 'linear/w' \(w_init of Linear 'linear'\) has no known"
    ):
        ntk_haiku.infinite_kernel_fn(net, params)(x)


def test_held_out_neural_tangents_mlp_and_a_cnn_twin():
    with jax.enable_x64(True):
        net = hk.transform(lambda x: hk.nets.MLP([64, 64, 1])(x))
        x1 = jnp.asarray(REF["haiku_mlp/x1"])
        assert_neural_tangents(
            "haiku_mlp", ntk_haiku.infinite_kernel_fn(net, net.init(jax.random.PRNGKey(0), x1))
        )

        def cnn(x):
            x = jax.nn.relu(hk.Conv2D(8, 3, b_init=hi.RandomNormal(0.1))(x))
            return hk.Linear(2)(hk.Flatten()(x))

        net, x = hk.transform(cnn), jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, 5, 2)))
        kernel_fn = ntk_haiku.infinite_kernel_fn(net, net.init(jax.random.PRNGKey(0), x))
        ours = kernel_fn(x, None, ("nngp", "ntk"))
        w = math.sqrt(scipy.stats.truncnorm(-2, 2).var())
        conv = stax.Conv(8, (3, 3), padding="SAME", W_std=w, b_std=0.1, parameterization="standard")
        dense = stax.Dense(2, W_std=w, b_std=0.0, parameterization="standard")
        twin = stax.serial(conv, stax.Relu(), stax.Flatten(), dense)[2](x, None, ("nngp", "ntk"))
        for a, b in zip(ours, twin, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def twin(x):
    """Flax's Twin (tests/flax/test_infinite_flax.py) in Haiku: a WideResNet block (two
    convs and the residual add), LayerNorm over the channels, AvgPool and a global mean."""
    h = hk.Conv1D(4, 3)(x)
    r = hk.Conv1D(4, 3)(jax.nn.relu(hk.Conv1D(4, 3)(jax.nn.relu(h))))
    norm = hk.LayerNorm(axis=-1, create_scale=False, create_offset=False, eps=1e-3)
    h = hk.avg_pool(jax.nn.relu(norm(h + r)), (2, 1), (2, 1), "VALID")
    return hk.Linear(1)(h.mean(1))


def test_resnet_block_layer_norm_and_pools_twin_stax():
    """Haiku's default w_init (truncated normal, σw² ≈ 0.7737 per fan-in), zero biases."""
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(4).normal(size=(3, 6, 2)))  # 1-D: cheap
        net = hk.without_apply_rng(hk.transform(twin))
        ours = ntk_haiku.infinite_kernel_fn(net, net.init(jax.random.PRNGKey(0), x))(x, None)
        w = math.sqrt(scipy.stats.truncnorm(-2, 2).var())
        ref = resnet_block_twin(w)(x, None)
        for a, b in zip(ours, ref, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
