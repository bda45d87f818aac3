"""A cross-framework check to copy into your own tests: the same network in Flax and in
Haiku, with the Flax weights transplanted, has the same NTK (every implementation).

Run it with ``python -m pytest examples/test_same_ntk.py``; the fixtures
``assert_same_ntk`` and ``assert_kernels_close`` come from ntk-jax's pytest plugin
(``--ntk-implementation structured`` checks one implementation only). Without pytest,
import the same functions from ``ntk_core.testing``.
"""

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp

import ntk_flax
import ntk_haiku


class FlaxMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(16)(x))  # layers created in forward order: Dense_0, Dense_1
        return nn.Dense(3)(h)


def haiku_mlp(x):
    return hk.nets.MLP([16, 3], activation=jnp.tanh)(x)


def test_flax_and_haiku_mlp_have_the_same_ntk(assert_same_ntk):
    x1 = jax.random.normal(jax.random.PRNGKey(0), (6, 5))
    x2 = jax.random.normal(jax.random.PRNGKey(1), (4, 5))
    variables = FlaxMLP().init(jax.random.PRNGKey(2), x1)
    net = hk.without_apply_rng(hk.transform(haiku_mlp))
    template = net.init(jax.random.PRNGKey(3), x1)  # only its names and shapes are read
    params = ntk_haiku.params_from_flax(variables["params"], template)

    def flax_fn(p, x):
        return FlaxMLP().apply({"params": p}, x)

    assert_same_ntk(flax_fn, variables["params"], net.apply, params, x1, x2, trace_axes=())


def test_adapters_agree(assert_kernels_close):
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 5))
    variables = FlaxMLP().init(jax.random.PRNGKey(2), x)
    net = hk.without_apply_rng(hk.transform(haiku_mlp))
    params = ntk_haiku.params_from_flax(variables["params"], net.init(jax.random.PRNGKey(3), x))
    k_flax = ntk_flax.kernel(FlaxMLP(), variables, x)
    k_haiku = ntk_haiku.kernel(net, params, x)
    assert_kernels_close(k_flax, k_haiku)
