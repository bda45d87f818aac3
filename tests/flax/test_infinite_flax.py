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
from adapter_reference import (
    REF,
    assert_draws_match_priors,
    assert_neural_tangents,
    resnet_block_twin,
)
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
    # the initialisers' own draws agree
    assert_draws_match_priors(priors, lambda path: params[path.split("/")[0]][path.split("/")[1]])


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


def test_nnx_equals_its_stax_twin():
    # (Flax CNNs: test_resnet_block_layer_norm_and_pools_twin_stax; Flatten: Haiku's twin)
    with jax.enable_x64(True):
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


class Twin(nn.Module):
    """A WideResNet block (two convs and the residual add), LayerNorm over the channels,
    AvgPool and a global mean: stax's test layers in one tiny network."""

    @nn.compact
    def __call__(self, x):
        h = nn.Conv(4, (3,))(x)
        r = nn.Conv(4, (3,))(nn.relu(nn.Conv(4, (3,))(nn.relu(h))))
        h = nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-3)(h + r)
        h = nn.avg_pool(nn.relu(h), (2,), (2,))
        return nn.Dense(1)(h.mean(1))


def test_resnet_block_layer_norm_and_pools_twin_stax():
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(4).normal(size=(3, 6, 2)))  # 1-D: cheap
        model = Twin()
        ours = ntk_flax.infinite_kernel_fn(model, model.init(jax.random.PRNGKey(0), x))
        twin = resnet_block_twin(1.0)
        for a, b in zip(ours(x, None), twin(x, None), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


class Stack(nn.Module):
    """Dense, then three [ReLU, Dense] layers as one nn.scan over stacked weights (or
    unrolled), BatchNorm in eval mode."""

    scanned: bool

    @nn.compact
    def __call__(self, x):
        class Layer(nn.Module):
            @nn.compact
            def __call__(self, h, _):
                return nn.Dense(6, bias_init=init.normal(0.1))(nn.relu(h)), None

        h = nn.Dense(6)(x)
        if self.scanned:
            scan = nn.scan(
                Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
            )
            h, _ = scan()(h, None)
        else:
            for _ in range(3):
                h, _ = Layer()(h, None)
        return nn.BatchNorm(use_running_average=True)(h)


def test_scanned_layers_and_eval_batch_norm_equal_their_unrolled_stax_twin():
    """nn.scan is unrolled, each layer's slice of the stacked kernel its own weight (its
    prior read and checked per slice); BatchNorm with its initial statistics is the
    constant 1/√(1 + ε) with its learnable scale (a gain of ones: NTK += c²Σ) and bias
    (NTK += 1): NNGP c²Σ and NTK c²(Θ + Σ) + 1 of the stax network before it."""
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(5).normal(size=(3, 4)))
        model = Stack(scanned=True)  # the stax twin below is its unrolled network
        kernel_fn = ntk_flax.infinite_kernel_fn(model, model.init(jax.random.PRNGKey(0), x))
        ours, report = kernel_fn(x, None), kernel_fn.report(x)
        dense = lambda b: stax.Dense(6, 1.0, b, parameterization="standard")  # noqa: E731
        stack = [stax.serial(stax.Relu(), dense(0.1)) for _ in range(3)]
        sigma, theta = stax.serial(dense(0.0), *stack)[2](x, None)
        c2 = float(jax.lax.rsqrt(jnp.float32(1 + 1e-5))) ** 2  # as the model: float32 stats
        np.testing.assert_allclose(ours.nngp, c2 * sigma, rtol=1e-10)
        np.testing.assert_allclose(ours.ntk, c2 * (theta + sigma) + 1, rtol=1e-10)
    assert "BatchNorm_0/scale: W_std=1 (mean square)" in report
    assert "ScanLayer_0/Dense_0/kernel[2]: W_std=1" in report  # per layer, lecun_normal
