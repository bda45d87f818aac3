"""ntk_core.infinite_kernel_fn: infinite-width kernels derived from a plain JAX model's
jaxpr, against the same network written with ntk_core.stax (float64, 1e-10), Monte Carlo,
and the refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ntk_core import adapters


def test_leaf_path_names_follow_tree_leaves_order():
    class Obj:  # a pytree with attribute keys
        def __init__(self, w):
            self.w = w

    jax.tree_util.register_pytree_with_keys(
        Obj, lambda o: (((jax.tree_util.GetAttrKey("w"), o.w),), None), lambda _, c: Obj(*c)
    )
    params = {"dense": {"w": jnp.ones(2), "b": jnp.zeros(1)}, "out": [jnp.ones(3), (Obj(1.0),)]}
    names = adapters.leaf_path_names(params)
    assert names == ["dense/b", "dense/w", "out/0", "out/1/0/w"]
    assert len(names) == len(jax.tree_util.tree_leaves(params))


# -- twins of stax networks: the same kernel to 1e-10 in float64 --------------------------

import math  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax import lax  # noqa: E402

import ntk_core  # noqa: E402
from ntk_core import stax  # noqa: E402


def _normal(shape, seed, std=1.0):
    return std * jax.random.normal(jax.random.PRNGKey(seed), shape)  # float64 under x64


def _dense_params(widths, seed=0, w_std=1.0, b_std=None):
    """Standard-parameterised weights (entries N(0, w_std²/fan_in)) and biases."""
    p = {}
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        p[f"w{i}"] = _normal((a, b), seed + i, w_std / math.sqrt(a))
        if b_std is not None:
            p[f"b{i}"] = _normal((b,), seed + 100 + i, b_std)
    return p


def _fc(phi):
    def apply_fn(p, x):
        h = x @ p["w0"] + p["b0"]
        h = phi(h) @ p["w1"] + p["b1"]
        return phi(h) @ p["w2"]

    return apply_fn


def _close(derived, reference, tol=1e-10):
    for name in ("nngp", "ntk"):
        a, b = np.asarray(getattr(derived, name)), np.asarray(getattr(reference, name))
        assert a.shape == b.shape and a.dtype == np.float64
        assert np.abs(a - b).max() <= tol * np.abs(b).max(), name


FC = [
    ("relu", jax.nn.relu, stax.Relu),
    ("erf", jax.scipy.special.erf, stax.Erf),
    ("gelu", lambda h: jax.nn.gelu(h, approximate=False), stax.Gelu),
    ("leaky", lambda h: jnp.where(h > 0, h, 0.1 * h), lambda: stax.LeakyRelu(0.1)),
    ("tanh", jnp.tanh, lambda: stax.ElementwiseNumerical(jnp.tanh, 25)),
]


@pytest.mark.parametrize("name,phi,layer", FC, ids=[f[0] for f in FC])
def test_fully_connected_twins_equal_stax_standard(name, phi, layer):
    with jax.enable_x64(True):
        x = np.random.RandomState(0).randn(5, 3)
        params = _dense_params([3, 9, 7, 2], w_std=1.5, b_std=0.1)
        derived = ntk_core.infinite_kernel_fn(_fc(phi), params, W_std=1.5, b_std=0.1)(x, None)
        std = dict(W_std=1.5, parameterization="standard")
        *_, kernel_fn = stax.serial(
            stax.Dense(9, b_std=0.1, **std),
            layer(),
            stax.Dense(7, b_std=0.1, **std),
            layer(),
            stax.Dense(2, **std),
        )
        _close(derived, kernel_fn(x, None))


def test_ntk_parameterised_w_over_sqrt_n_equals_stax_ntk():
    """σw·W / √n with W ~ N(0, 1) (prior W_std = √n: entries of variance W_std²/n = 1) and
    σb·b, b ~ N(0, 1), is the NTK parameterisation: stax's Dense(parameterization="ntk")."""

    def apply_fn(p, x):
        h = x @ (1.5 * p["w0"] / math.sqrt(3)) + 0.1 * p["b0"]
        h = jnp.maximum(h, 0)
        return (h @ p["w1"]) * (1.5 / math.sqrt(9))

    with jax.enable_x64(True):
        x = np.random.RandomState(1).randn(4, 3)
        params = {"w0": _normal((3, 9), 0), "b0": _normal((9,), 2), "w1": _normal((9, 1), 1)}
        derived = ntk_core.infinite_kernel_fn(
            apply_fn, params, W_std={"w0": math.sqrt(3), "w1": 3.0}, b_std=1.0
        )(x, None)
        *_, kernel_fn = stax.serial(stax.Dense(9, 1.5, 0.1), stax.Relu(), stax.Dense(1, 1.5))
        _close(derived, kernel_fn(x, None))


def _conv(x, w, strides=(1, 1), padding="SAME"):
    return lax.conv_general_dilated(
        x, w, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"), precision="highest"
    )


def _avg_pool(h):
    return lax.reduce_window(h, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4


READOUTS = {
    "flatten": (lambda h: h.reshape(h.shape[0], -1), 3 * 3 * 4, lambda: [stax.Flatten()]),
    "avgpool_gap": (  # one network for both pools (one compile fewer)
        lambda h: _avg_pool(h).mean((1, 2)),
        4,
        lambda: [stax.AvgPool((2, 2), (2, 2)), stax.GlobalAvgPool()],
    ),
}


@pytest.mark.parametrize("readout", sorted(READOUTS))
def test_cnn_twins_equal_stax(readout):
    pool, width, layers = READOUTS[readout]

    def apply_fn(p, x):
        h = jax.nn.relu(_conv(x, p["c0"]) + p["b0"])
        h = jax.nn.relu(_conv(h, p["c1"], padding="VALID"))
        return pool(h) @ p["w"]

    with jax.enable_x64(True):
        x = np.random.RandomState(2).randn(3, 4, 4, 2)
        params = {
            "c0": _normal((3, 3, 2, 5), 0, 1.3 / math.sqrt(18)),
            "b0": jnp.zeros(5),
            "c1": _normal((2, 2, 5, 4), 1, 1.3 / math.sqrt(20)),
            "w": _normal((width, 1), 2, 1.3 / math.sqrt(width)),
        }
        derived = ntk_core.infinite_kernel_fn(apply_fn, params, W_std=1.3, b_std=0.0)(x, None)
        std = dict(W_std=1.3, parameterization="standard")
        *_, kernel_fn = stax.serial(
            stax.Conv(5, (3, 3), padding="SAME", b_std=0.0, **std),
            stax.Relu(),
            stax.Conv(4, (2, 2), padding="VALID", **std),
            stax.Relu(),
            *layers(),
            stax.Dense(1, **std),
        )
        _close(derived, kernel_fn(x, None))


def test_residual_block_and_layer_norm_equal_stax():
    """h = Dense(x); r = h + Dense(relu(h)) (FanInSum of independent branches); then
    LayerNorm over the channels (mean and variance in jnp), erf, Dense."""

    def apply_fn(p, x):
        h = x @ p["w0"] + p["b0"]
        r = h + jax.nn.relu(h) @ p["w1"]
        mean = r.mean(-1, keepdims=True)
        r = (r - mean) / jnp.sqrt(jnp.var(r, -1, keepdims=True) + 1e-3)
        return jax.scipy.special.erf(r) @ p["w2"]

    with jax.enable_x64(True):
        x = np.random.RandomState(3).randn(4, 3)
        params = _dense_params([3, 8, 8, 1], w_std=1.2, b_std=None)
        params["b0"] = _normal((8,), 5, 0.2)
        kf = ntk_core.infinite_kernel_fn(apply_fn, params, W_std=1.2, b_std=0.2)
        derived = kf(x, None)
        std = dict(W_std=1.2, parameterization="standard")
        *_, kernel_fn = stax.serial(
            stax.Dense(8, b_std=0.2, **std),
            stax.FanOut(2),
            stax.parallel(stax.Identity(), stax.serial(stax.Relu(), stax.Dense(8, **std))),
            stax.FanInSum(),
            stax.LayerNorm(eps=1e-3),
            stax.Erf(),
            stax.Dense(1, **std),
        )
        _close(derived, kernel_fn(x, None))
        report = kf.report(x)
    for part in ("FanInSum", "Normalise", "Erf(1, 1, 0) (closed form", "w1: W_std=1.2"):
        assert part in report


def test_monte_carlo_ntk_approaches_derived_kernel_with_layer_norm_gain_and_zero_biases():
    """The mean empirical NTK of the model itself over initialisations approaches the
    derived kernel as the width grows, for the rules stax has no layer for: zero-initialised
    trainable biases (b_std = 0, gradient 1), LayerNorm's learnable gain (ones) and shift
    (zeros). NTK-parameterised (W ~ N(0, 1) scaled by 1/√fan_in), so that these O(1) terms
    are not drowned by the standard parameterisation's width·Σ, and the kernel is the same
    at every width."""

    def apply_fn(p, x):
        n = p["w1"].shape[0]
        h = x @ p["w0"] * (1 / math.sqrt(3)) + p["b0"]
        h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
        h = jax.nn.relu(h * p["gain"] + p["shift"])
        return h @ p["w1"] * (1 / math.sqrt(n)) + p["b1"]

    def init(width):
        def init_fn(key):
            k0, k1 = jax.random.split(key)
            return {
                "w0": jax.random.normal(k0, (3, width)),
                "w1": jax.random.normal(k1, (width, 1)),
                "b0": jnp.zeros(width),
                "gain": jnp.ones(width),
                "shift": jnp.zeros(width),
                "b1": jnp.zeros(1),
            }

        return init_fn

    with jax.enable_x64(True):
        x = np.random.RandomState(4).randn(3, 3)
        width = 2048
        priors = {"w0": math.sqrt(3), "w1": math.sqrt(width), "gain": 1.0}
        kernel_fn = ntk_core.infinite_kernel_fn(
            apply_fn, init(width)(jax.random.PRNGKey(0)), W_std=priors, b_std=0.0
        )
        exact = np.asarray(kernel_fn(x, None, "ntk"))
        errors = []
        for width in (16, 128, 2048):
            mc = ntk_core.monte_carlo_kernels(
                init(width),
                apply_fn,
                x,
                key=jax.random.PRNGKey(1),
                n_samples=32,
                batch_size_samples=32,
            )
            errors.append(np.linalg.norm(mc.ntk - exact) / np.linalg.norm(exact))
    assert errors[0] > errors[1] > errors[2] and errors[2] < 0.01, errors


def test_priors_are_checked_against_the_values_and_reported():
    """A weight leaf whose fan_in·mean(W²) contradicts its prior warns, naming it and its
    estimate (the kernel follows the prior: it equals the one with the right values)."""

    def apply_fn(p, x):
        return jnp.tanh(x @ p["dense"]["w"]) @ p["out"][0]

    params = {
        "dense": {"w": _normal((3, 400), 0, 2.0 / math.sqrt(3))},
        "out": [_normal((400, 1), 1, 1 / math.sqrt(400))],
    }
    assert adapters.leaf_path_names(params) == ["dense/w", "out/0"]
    x = np.random.RandomState(5).randn(2, 3).astype(np.float32)
    kernel_fn = ntk_core.infinite_kernel_fn(apply_fn, params, W_std={"dense/w": 1.0, "out/0": 1.0})
    with pytest.warns(
        UserWarning, match=r"the weight 'dense/w' has .* = 1\.9\d, but its prior W_std is 1"
    ):
        k = kernel_fn(x, None, "nngp")
    right = {"dense": {"w": params["dense"]["w"] / 2}, "out": params["out"]}
    again = ntk_core.infinite_kernel_fn(apply_fn, right, W_std=1.0)(x, None, "nngp")
    np.testing.assert_array_equal(np.asarray(k), np.asarray(again))
    report = kernel_fn.report(x)
    assert "quadrature of tanh" in report and "dense/w: W_std=1" in report


def test_gain_multiplied_into_the_statistics_first_as_flax_does():
    """Flax's LayerNorm multiplies its scale into rsqrt(var + ε) before the activations:
    the same layers (Normalise, Gain, Bias) and kernel as the gain applied after (whose
    kernel the Monte Carlo test above checks), here before a non-ReLU nonlinearity."""

    def after(p, x):
        h = x @ p["w"]
        h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-6)
        return jax.nn.gelu(h * p["gain"] + p["shift"], approximate=True) @ p["v"]

    def flax_order(p, x):
        h = x @ p["w"]
        mean, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
        mul = jax.lax.rsqrt(var + 1e-6) * p["gain"]
        return jax.nn.gelu((h - mean) * mul + p["shift"], approximate=True) @ p["v"]

    with jax.enable_x64(True):
        params = {
            "w": _normal((3, 6), 0, 1 / math.sqrt(3)),
            "gain": jnp.ones(6),
            "shift": jnp.zeros(6),
            "v": _normal((6, 1), 1, 1 / math.sqrt(6)),
        }
        x = np.random.RandomState(6).randn(3, 3)
        priors = dict(W_std={"w": 1.0, "gain": 1.0, "v": 1.0}, b_std=0.0)
        ref = ntk_core.infinite_kernel_fn(after, params, **priors)
        got = ntk_core.infinite_kernel_fn(flax_order, params, **priors)
        _close(got(x, None), ref(x, None), tol=1e-12)
        kinds = [line.split()[1] for line in got.report(x).splitlines()[1:]]
    assert kinds == ["Input", "Dense", "Normalise", "Gain", "Bias", "Nonlinearity", "Dense"]


def test_constant_scaling_in_float32_is_a_closed_form():
    # the chain's float32 constants meet the float64 check's values (regression: with x64
    # off, 2.0 * relu(h) fell back to quadrature, and was refused after a non-Gaussian layer)
    rng = np.random.default_rng(3)
    params = {
        "w1": jnp.asarray(rng.normal(size=(4, 32)) / 2, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(32, 1)) / 6, jnp.float32),
    }

    def apply(p, x):
        return (2.0 * jax.nn.relu(x @ p["w1"])) @ p["w2"]

    kernel_fn = ntk_core.infinite_kernel_fn(apply, params, W_std=1.0, b_std=0.0)
    x = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
    assert "ABRelu(0, 2) (closed form" in kernel_fn.report(x)
    dense = lambda n: stax.Dense(n, 1.0, None, parameterization="standard")  # noqa: E731
    *_, twin = stax.serial(dense(32), stax.ABRelu(0.0, 2.0), dense(1))
    ours, theirs = kernel_fn(x, None), twin(x, None)
    for get in ("nngp", "ntk"):
        a, b = np.asarray(getattr(ours, get)), np.asarray(getattr(theirs, get))
        assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max()


def test_repeated_layers_run_as_one_scanned_step_and_keep_their_own_priors():
    # 6 x [Dense, Erf], the fourth layer's W_std different: the equal layers run as one
    # scanned step, the different one stays its own (equal signatures only: no silent merge)
    rng = np.random.default_rng(5)
    width, depth = 16, 6
    stds = [2.0 if i == 3 else 1.5 for i in range(depth)]
    fans = [3] + [width] * (depth - 1)
    params = {
        f"w{i}": jnp.asarray(stds[i] * rng.normal(size=(fans[i], width)) / math.sqrt(fans[i]))
        for i in range(depth)
    }
    params["out"] = jnp.asarray(rng.normal(size=(width, 1)) / math.sqrt(width))
    w_std = {f"w{i}": stds[i] for i in range(depth)} | {"out": 1.0}

    def apply(p, x):
        for i in range(depth):
            x = jax.scipy.special.erf(x @ p[f"w{i}"])
        return x @ p["out"]

    dense = lambda n, s: stax.Dense(n, s, None, parameterization="standard")  # noqa: E731
    layers = []
    for s in stds:
        layers += [dense(width, s), stax.Erf()]
    *_, twin = stax.serial(*layers, dense(1, 1.0))
    with jax.enable_x64(True):
        x = jnp.asarray(rng.normal(size=(5, 3)))
        kernel_fn = ntk_core.infinite_kernel_fn(apply, params, W_std=w_std, b_std=0.0)
        ours, theirs = kernel_fn(x, None), twin(x, None)
        program = str(jax.make_jaxpr(lambda a: kernel_fn(a, None, "ntk"))(x))
    for get in ("nngp", "ntk"):
        a, b = np.asarray(getattr(ours, get)), np.asarray(getattr(theirs, get))
        assert np.abs(a - b).max() <= 1e-10 * np.abs(b).max(), get
    assert "scan" in program  # layers 4-6 (three equal [Dense, Erf] after the different one)


def test_loops_over_stacked_layers_are_unrolled():
    """A lax.scan over stacked weights and biases, and a fori_loop indexing them, are the
    stax FC net: each step's slice its own leaf ("ws[1]"), the stack's prior per slice."""
    rng = np.random.default_rng(7)
    depth, width = 3, 6

    def scanned(p, x):
        step = lambda h, wb: (jax.nn.relu(h) @ wb[0] + wb[1], None)  # noqa: E731
        h, _ = lax.scan(step, x @ p["w0"], (p["ws"], p["bs"]))
        return jax.nn.relu(h) @ p["out"]

    def looped(p, x):
        step = lambda i, h: jax.nn.relu(h) @ p["ws"][i] + p["bs"][i]  # noqa: E731
        return jax.nn.relu(lax.fori_loop(0, depth, step, x @ p["w0"])) @ p["out"]

    dense = lambda n, b=None: stax.Dense(n, 1.5, b, parameterization="standard")  # noqa: E731
    hidden = [stax.serial(stax.Relu(), dense(width, 0.1)) for _ in range(depth)]
    *_, twin = stax.serial(dense(width), *hidden, stax.Relu(), dense(1))
    with jax.enable_x64(True):
        p = {
            "w0": jnp.asarray(1.5 * rng.normal(size=(3, width)) / math.sqrt(3)),
            "ws": jnp.asarray(1.5 * rng.normal(size=(depth, width, width)) / math.sqrt(width)),
            "bs": jnp.asarray(0.1 * rng.normal(size=(depth, width))),
            "out": jnp.asarray(1.5 * rng.normal(size=(width, 1)) / math.sqrt(width)),
        }
        x = jnp.asarray(rng.normal(size=(4, 3)))
        reference = twin(x, None)
        for apply_fn in (scanned, looped):
            kernel_fn = ntk_core.infinite_kernel_fn(apply_fn, p, W_std=1.5, b_std=0.1)
            _close(kernel_fn(x, None), reference)
        report = kernel_fn.report(x)
    assert "ws[2]: W_std=1.5" in report and "bias bs[0]: b_std=0.1" in report
