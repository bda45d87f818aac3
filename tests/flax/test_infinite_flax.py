"""ntk_flax.infinite_kernel_fn (issue 50): priors read from Flax's initialisers, against
the initialisers' own draws at a large width and scipy's truncated normal; kernels against
neural-tangents 0.6.5's recorded stax kernels (benchmarks/dump_nt_adapter_references.py)
and against ntk_core.stax twins, in float64."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx

import ntk_flax
from adapter_reference import REF, assert_neural_tangents
from ntk_core import stax
from ntk_core._derived.adapter_priors import merge
from ntk_core.adapters import leaf_path_names, truncated_normal_moments
from ntk_flax._infinite import _linen_reader

init = nn.initializers


def test_truncated_normal_moments_are_scipys():
    for lower, upper in ((-2.0, 2.0), (-1.0, 3.0), (-math.inf, 1.5), (-0.5, 0.5)):
        mean, second = truncated_normal_moments(lower, upper)
        dist = scipy.stats.truncnorm(lower, upper)
        assert mean == pytest.approx(dist.mean(), rel=1e-12, abs=1e-14)
        assert second == pytest.approx(dist.moment(2), rel=1e-12)


class Layers(nn.Module):
    """One layer per initialiser under test, each wide enough to estimate its variance."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(2048)(x)  # lecun_normal, zeros
        x = nn.Dense(
            1024,
            kernel_init=init.variance_scaling(2.0, "fan_avg", "uniform"),
            bias_init=init.normal(0.05),
        )(x)
        x = nn.Dense(512, kernel_init=init.truncated_normal(0.02), bias_init=init.constant(0.0))(x)
        x = nn.Conv(64, (3,), kernel_init=init.he_normal())(x[..., None])
        return nn.LayerNorm()(x)


def test_priors_match_each_initialisers_draws():
    model, x = Layers(), jnp.ones((1, 256))
    variables = model.init(jax.random.PRNGKey(0), x)
    priors = {p.path: p for p in _linen_reader(model, variables, None, {})(x)}
    params = variables["params"]
    fan_avg = (2048 + 1024) / 2
    expected = {  # the documented variances, not read from the initialisers
        "Dense_0/kernel": 1.0,
        "Dense_1/kernel": math.sqrt(2048 * 2.0 / fan_avg),
        "Dense_2/kernel": math.sqrt(1024 * 0.02**2 * scipy.stats.truncnorm(-2, 2).var()),
        "Conv_0/kernel": math.sqrt(2.0),
        "Dense_0/bias": 0.0,
        "Dense_1/bias": 0.05,
        "Dense_2/bias": 0.0,
        "Conv_0/bias": 0.0,
        "LayerNorm_0/scale": 1.0,
        "LayerNorm_0/bias": 0.0,
    }
    assert {p: q.std for p, q in priors.items()} == pytest.approx(expected, rel=1e-12)
    assert priors["LayerNorm_0/scale"].kind == "gain"
    for path, prior in priors.items():  # the initialisers' own draws agree
        layer, leaf = path.split("/")
        values = np.asarray(params[layer][leaf], np.float64)
        fan_in = math.prod(values.shape[:-1]) if prior.kind == "weight" else 1
        estimate = fan_in * np.mean(values**2)
        assert estimate == pytest.approx(
            prior.std**2, rel=6 / math.sqrt(values.size / 2), abs=1e-12
        )


def test_an_unknown_initialiser_needs_its_prior():
    model, x = nn.Dense(3, kernel_init=init.orthogonal()), jnp.ones((2, 4))
    variables = model.init(jax.random.PRNGKey(0), x)
    with pytest.raises(
        ValueError, match=r"the weight 'kernel' \(kernel_init of the model\) has no known"
    ):
        ntk_flax.infinite_kernel_fn(model, variables)(x)
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4)))
        ours = ntk_flax.infinite_kernel_fn(model, variables, W_std={"kernel": 1.0})(x, None, "ntk")
        twin = stax.Dense(3, W_std=1.0, b_std=0.0, parameterization="standard")[2](x, None, "ntk")
        np.testing.assert_allclose(ours, twin, rtol=1e-10)


class ReluMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(1)(x)


class C3Erf(nn.Module):
    """Case C3's network: 13 x Dense(511) + erf, Dense(1), W_std = 1.5, b_std = 0.05."""

    @nn.compact
    def __call__(self, x):
        kw = dict(
            kernel_init=init.variance_scaling(1.5**2, "fan_in", "normal"),
            bias_init=init.normal(0.05),
        )
        for _ in range(13):
            x = jax.scipy.special.erf(nn.Dense(511, **kw)(x))
        return nn.Dense(1, **kw)(x)


def c3_draws(model, x):
    """C3's parameters drawn by numpy as its initialisers describe them (W ~ N(0, 1.5² /
    fan_in), b ~ N(0, 0.05²)): 3.4M float64 draws without compiling the model's init."""
    rng = np.random.default_rng(3)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)
    std = lambda path, s: 1.5 / math.sqrt(s.shape[0]) if path[-1].key == "kernel" else 0.05  # noqa: E731
    return jax.tree_util.tree_map_with_path(
        lambda p, s: rng.normal(size=s.shape) * std(p, s), shapes
    )


@pytest.mark.parametrize("name, model", [("flax_mlp", ReluMLP()), ("c3_erf", C3Erf())])
def test_held_out_neural_tangents_kernels(name, model):
    with jax.enable_x64(True):
        x1 = jnp.asarray(REF[f"{name}/x1"])
        variables = (
            model.init(jax.random.PRNGKey(0), x1) if name != "c3_erf" else c3_draws(model, x1)
        )
        assert_neural_tangents(name, ntk_flax.infinite_kernel_fn(model, variables))


def test_cnn_and_nnx_equal_their_stax_twin():
    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(
                nn.Conv(8, (3, 3), kernel_init=init.variance_scaling(2.0, "fan_in", "normal"))(x)
            )
            return nn.Dense(2)(x.reshape(x.shape[0], -1))

    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, 5, 2)))
        model = CNN()
        ours = ntk_flax.infinite_kernel_fn(model, model.init(jax.random.PRNGKey(0), x))(
            x, None, ("nngp", "ntk")
        )
        conv = stax.Conv(
            8, (3, 3), padding="SAME", W_std=math.sqrt(2), b_std=0.0, parameterization="standard"
        )
        dense = stax.Dense(2, W_std=1.0, b_std=0.0, parameterization="standard")
        twin = stax.serial(conv, stax.Relu(), stax.Flatten(), dense)[2](x, None, ("nngp", "ntk"))
        for a, b in zip(ours, twin, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)

        mlp = nnx.Sequential(
            nnx.Linear(4, 16, rngs=nnx.Rngs(0), param_dtype=jnp.float64),
            nnx.relu,
            nnx.Linear(16, 1, rngs=nnx.Rngs(1), param_dtype=jnp.float64),
        )
        x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 4)))
        kernel_fn = ntk_flax.infinite_kernel_fn(mlp, b_std={"layers/2/bias": 0.1})
        assert kernel_fn.priors[1] == {"layers/0/bias": 0.0, "layers/2/bias": 0.1}
        ours = kernel_fn(x, None, ("nngp", "ntk"))
        dense = lambda n, b: stax.Dense(n, W_std=1.0, b_std=b, parameterization="standard")  # noqa: E731
        twin = stax.serial(dense(16, 0.0), stax.Relu(), dense(1, 0.1))[2](x, None, ("nngp", "ntk"))
        for a, b in zip(ours, twin, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_given_priors_replace_the_read_ones():
    model = nn.Sequential([nn.Dense(16), nn.LayerNorm(), nn.relu, nn.Dense(1)])
    x = jnp.ones((2, 4))
    variables = model.init(jax.random.PRNGKey(0), x)
    read = _linen_reader(model, variables, None, {})(x)
    names = leaf_path_names(variables["params"])
    w, b = merge("f", read, 1.5, {"layers_3/bias": 0.2}, names=names)
    # one float for every weight: the LayerNorm's scale is a gain, which keeps its ones
    assert w == {name: 1.5 for name in names} | {"layers_1/scale": 1.0}
    assert b == {"layers_0/bias": 0.0, "layers_1/bias": 0.0, "layers_3/bias": 0.2}
    w, _ = merge("f", read, {"layers_0/kernel": 2.0}, None, names=names)
    assert w == pytest.approx(
        {"layers_0/kernel": 2.0, "layers_1/scale": 1.0, "layers_3/kernel": 1.0}, rel=1e-15
    )
