"""Issue 27's kernels in the adapters. ``wrt=`` with each framework's parameter names:
the same MLP in Flax linen, nnx, Haiku and equinox (weights transplanted from Flax) gives
the same head-only and biases-only kernels, equal to a float64 Jacobian contraction of the
plain JAX model with respect to those leaves alone. The pseudo-NTK (``pntk``): every
adapter equals (1/O) Σ_ab of the float64 full NTK."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import frameworks
import reference

frameworks.skip_module_unless("flax", "haiku", "equinox")

import equinox as eqx  # noqa: E402
import flax.linen as nn  # noqa: E402
import haiku as hk  # noqa: E402
from flax import nnx  # noqa: E402

import ntk_equinox  # noqa: E402
import ntk_flax  # noqa: E402
import ntk_haiku  # noqa: E402

X = jax.random.normal(jax.random.PRNGKey(0), (5, 4))


class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(8)(x))  # created in forward order: Dense_0, Dense_1 (the head)
        return nn.Dense(3)(h)


class Nnx(nnx.Module):
    def __init__(self, p):
        def linear(name, a, b):  # the Flax layer's weights (initialisers that return them)
            w, bias = p[name]["kernel"], p[name]["bias"]
            rngs = nnx.Rngs(0)
            return nnx.Linear(a, b, kernel_init=lambda *_: w, bias_init=lambda *_: bias, rngs=rngs)

        self.hidden, self.head = linear("Dense_0", 4, 8), linear("Dense_1", 8, 3)

    def __call__(self, x):
        return self.head(jnp.tanh(self.hidden(x)))


def _plain(p, x):
    h = jnp.tanh(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    return h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


def _haiku(x):
    return hk.nets.MLP([8, 3], activation=jnp.tanh)(x)


def _equinox(p):
    mlp = eqx.nn.MLP(4, 3, 8, 1, activation=jnp.tanh, key=jax.random.PRNGKey(1))
    for i, name in enumerate(("Dense_0", "Dense_1")):
        at = lambda m, i=i: (m.layers[i].weight, m.layers[i].bias)  # noqa: E731
        mlp = eqx.tree_at(at, mlp, (p[name]["kernel"].T, p[name]["bias"]))
    return mlp


@pytest.mark.parametrize("subset", ["head", "biases"])
def test_every_adapter_gives_the_subsets_kernel_in_its_own_names(subset):
    variables = Linen().init(jax.random.PRNGKey(2), X)
    p = variables["params"]
    net = hk.without_apply_rng(hk.transform(_haiku))
    hp = ntk_haiku.params_from_flax(p, net.init(jax.random.PRNGKey(3), X))
    if subset == "head":
        flax_wrt, nnx_wrt, haiku_wrt, eqx_wrt = "Dense_1", "head", "mlp/~/linear_1", "layers/1"
        chosen = ["Dense_1/bias", "Dense_1/kernel"]
    else:
        flax_wrt = haiku_wrt = lambda path: path[-1] in ("bias", "b")  # noqa: E731
        nnx_wrt = lambda path: "bias" in path  # noqa: E731 (nnx paths end in "value")
        eqx_wrt = lambda path: path[-1] == "bias"  # noqa: E731
        chosen = ["Dense_0/bias", "Dense_1/bias"]

    def of_subset(sub, x):
        full = {k: dict(v) for k, v in p.items()}
        for name, leaf in zip(chosen, sub, strict=True):
            module, entry = name.split("/")
            full[module][entry] = leaf
        return _plain(full, x)

    sub = [p[n.split("/")[0]][n.split("/")[1]] for n in chosen]
    (expected,) = reference.ntk(of_subset, sub, X, None, trace_axes=())
    kernels = {
        "linen": ntk_flax.kernel(Linen(), variables, X, trace_axes=(), wrt=flax_wrt),
        "nnx": ntk_flax.kernel(Nnx(p), None, X, trace_axes=(), wrt=nnx_wrt),
        "haiku": ntk_haiku.kernel(net, hp, X, trace_axes=(), wrt=haiku_wrt),
        "equinox": ntk_equinox.kernel(_equinox(p), X, trace_axes=(), wrt=eqx_wrt),
    }
    whole = np.asarray(ntk_flax.kernel(Linen(), variables, X, trace_axes=()), np.float64)
    assert np.abs(whole - expected).max() > 1e-2 * np.abs(whole).max()  # a real subset
    for k in kernels.values():
        reference.assert_close(k, expected)


def test_every_adapter_gives_the_pseudo_ntk():
    variables = Linen().init(jax.random.PRNGKey(2), X)
    p = variables["params"]
    net = hk.without_apply_rng(hk.transform(_haiku))
    hp = ntk_haiku.params_from_flax(p, net.init(jax.random.PRNGKey(3), X))
    (full,) = reference.ntk(_plain, p, X, None, trace_axes=())  # (N, N, O, O)
    expected = full.sum(axis=(2, 3)) / full.shape[2]
    kernels = [
        ntk_flax.pntk(Linen(), variables, X),
        ntk_flax.pntk_fn(Nnx(p))(None, X),
        ntk_haiku.pntk(net, hp, X),
        ntk_haiku.pntk_fn(net)(hp, X),
        ntk_equinox.pntk(_equinox(p), X),
        ntk_equinox.pntk_fn(_equinox(p))(_equinox(p), X),
    ]
    for k in kernels:
        reference.assert_close(k, expected)
    with pytest.raises(TypeError, match="ntk_haiku.pntk: the pseudo-NTK takes no trace_axes"):
        ntk_haiku.pntk(net, hp, X, trace_axes=())
