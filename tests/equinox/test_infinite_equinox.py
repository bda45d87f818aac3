"""ntk_equinox.infinite_kernel_fn (issue 50): the priors of equinox's fixed uniform
initialiser against its own draws at a large width; the kernel of eqx.nn.MLP against
neural-tangents 0.6.5's recorded stax kernel (benchmarks/dump_nt_adapter_references.py);
a channels-first (NCHW) CNN against its ntk_core.stax twin, in float64."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_equinox
from adapter_reference import assert_neural_tangents
from ntk_core import stax
from ntk_equinox._infinite import _priors


def test_priors_match_the_uniform_initialisers_draws():
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    model = eqx.nn.Sequential(
        [eqx.nn.Linear(256, 2048, key=keys[0]), eqx.nn.Conv1d(8, 64, 5, key=keys[1])]
    )
    params = eqx.partition(model, eqx.is_inexact_array)[0]
    priors = {p.path: p for p in _priors(model, params)}
    expected = {  # uniform in ±1/√fan_in: variance 1/(3·fan_in)
        "layers/0/weight": math.sqrt(1 / 3),
        "layers/0/bias": math.sqrt(1 / (3 * 256)),
        "layers/1/weight": math.sqrt(1 / 3),
        "layers/1/bias": math.sqrt(1 / (3 * 8 * 5)),
    }
    assert {p: q.std for p, q in priors.items()} == pytest.approx(expected, rel=1e-12)
    for index, fan_in in ((0, 256), (1, 8 * 5)):  # the initialiser's own draws agree
        layer = model.layers[index]
        for leaf, fan in (("weight", fan_in), ("bias", 1)):
            values = np.asarray(getattr(layer, leaf), np.float64)
            std = priors[f"layers/{index}/{leaf}"].std
            tol = 6 / math.sqrt(values.size / 2)
            assert fan * np.mean(values**2) == pytest.approx(std**2, rel=tol)


def test_held_out_neural_tangents_mlp():
    with jax.enable_x64(True):
        mlp = eqx.nn.MLP(
            5, 1, 64, 2, activation=jax.nn.relu, key=jax.random.PRNGKey(0), dtype=jnp.float64
        )
        assert_neural_tangents("equinox_mlp", ntk_equinox.infinite_kernel_fn(mlp))


LIN = 24


class Twin(eqx.Module):
    """NCHW: Conv2d, a WideResNet block (two convs and the residual add), LayerNorm over
    the channels at each position, AvgPool2d, then Flatten and a global mean, each read
    out by its own Linear and summed: stax's test layers in one tiny network."""

    convs: list
    norm: eqx.nn.LayerNorm
    pool: eqx.nn.AvgPool2d
    outs: list

    def __init__(self, key):
        keys = jax.random.split(key, 5)
        f64 = dict(dtype=jnp.float64)
        self.convs = [
            eqx.nn.Conv2d(n, 4, 3, padding="SAME", key=k, **f64)
            for n, k in zip((2, 4, 4), keys[:3], strict=True)
        ]
        self.norm = eqx.nn.LayerNorm(4, eps=1e-3, use_weight=False, use_bias=False)
        self.pool = eqx.nn.AvgPool2d(2, 2)
        self.outs = [
            eqx.nn.Linear(LIN, 1, key=keys[3], **f64),
            eqx.nn.Linear(4, 1, key=keys[4], **f64),
        ]

    def __call__(self, x):
        h = self.convs[0](x)
        h = h + self.convs[2](jax.nn.relu(self.convs[1](jax.nn.relu(h))))
        norm = jax.vmap(jax.vmap(self.norm, in_axes=1, out_axes=1), in_axes=2, out_axes=2)
        h = self.pool(jax.nn.relu(norm(h)))  # (4, 3, 2)
        return self.outs[0](h.reshape(-1)) + self.outs[1](h.mean(axis=(1, 2)))


def drawn(model, seed):
    """``model``'s Conv / Linear layers drawn by numpy as equinox's initialiser draws
    them (uniform in ±1/√fan_in): no eager compilation of jax's sampler per shape."""
    rng = np.random.default_rng(seed)

    def fill(layer):
        if not isinstance(layer, (eqx.nn.Conv, eqx.nn.Linear)):
            return layer
        lim = 1 / math.sqrt(math.prod(layer.weight.shape[1:]))
        new = [jnp.asarray(rng.uniform(-lim, lim, a.shape)) for a in (layer.weight, layer.bias)]
        return eqx.tree_at(lambda m: (m.weight, m.bias), layer, new)

    layers = (eqx.nn.Conv, eqx.nn.Linear)
    return jax.tree.map(fill, model, is_leaf=lambda m: isinstance(m, layers))


def test_channels_first_resnet_block_layer_norm_pools_and_flatten_twin_stax():
    """Images of 6 x 4 (not square: positions read in the wrong order would change the
    kernels); equinox's priors σw² = 1/3, σb² = 1/(3·fan_in)."""
    with jax.enable_x64(True):
        model = drawn(eqx.filter_eval_shape(Twin, jax.random.PRNGKey(0)), 0)
        x = jnp.asarray(np.random.default_rng(4).normal(size=(3, 2, 6, 4)))
        kernel_fn = ntk_equinox.infinite_kernel_fn(model)
        ours = kernel_fn(x, None)
        w = math.sqrt(1 / 3)
        conv = lambda n: stax.Conv(  # noqa: E731
            4,
            (3, 3),
            padding="SAME",
            W_std=w,
            b_std=math.sqrt(1 / (3 * n * 9)),
            parameterization="standard",
        )
        dense = lambda n: stax.Dense(1, w, math.sqrt(1 / (3 * n)), parameterization="standard")  # noqa: E731
        twin = stax.serial(
            conv(2),
            stax.FanOut(2),
            stax.parallel(stax.Identity(), stax.serial(stax.Relu(), conv(4), stax.Relu(), conv(4))),
            stax.FanInSum(),
            stax.LayerNorm(eps=1e-3),
            stax.Relu(),
            stax.AvgPool((2, 2), (2, 2)),
            stax.FanOut(2),
            stax.parallel(
                stax.serial(stax.Flatten(), dense(24)),
                stax.serial(stax.GlobalAvgPool(), dense(4)),
            ),
            stax.FanInSum(),
        )[2](jnp.moveaxis(x, 1, -1), None)  # stax: channels last
        for a, b in zip(ours, twin, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    assert "Input         <- x      (6, 4, 2)  perm (0, 2, 3, 1)" in kernel_fn.report(x)
