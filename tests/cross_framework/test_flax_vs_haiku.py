"""The same architecture in Flax and Haiku, with weights transplanted, gives the same
outputs, NTK and NNGP (every axes setting of the reference grid)."""

from __future__ import annotations

import functools

import flax.linen as nn
import haiku as hk
import jax
import numpy as np
import pytest

import ntk_flax
import ntk_haiku
import reference


class FlaxMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16, name="Dense_0")(x))
        return nn.Dense(3, name="Dense_1")(h)


def haiku_mlp(x):
    h = jax.nn.relu(hk.Linear(16, name="Dense_0")(x))
    return hk.Linear(3, name="Dense_1")(h)


TWINS = {
    "mlp": (FlaxMLP(), haiku_mlp, (7,)),
    "lenet": (
        ntk_flax.LeNet(out_features=2),
        functools.partial(ntk_haiku.lenet, out_features=2),
        (32, 32, 3),
    ),
}

AXES = {
    "trace": dict(trace_axes=(-1,)),
    "full": dict(trace_axes=()),
    "diag_out": dict(trace_axes=(), diagonal_axes=(-1,)),
    "diag_batch": dict(trace_axes=(), diagonal_axes=(0,)),
}


@functools.cache
def _twins(name):
    flax_model, haiku_fn, shape = TWINS[name]
    x1 = jax.random.normal(jax.random.PRNGKey(1), (3, *shape))
    variables = flax_model.init(jax.random.PRNGKey(0), x1)
    net = hk.without_apply_rng(hk.transform(haiku_fn))
    params = ntk_haiku.params_from_flax(variables["params"])
    # The transplanted tree has exactly Haiku's own structure and shapes.
    own = net.init(jax.random.PRNGKey(0), x1)
    assert jax.tree.structure(own) == jax.tree.structure(params)
    assert jax.tree.map(np.shape, own) == jax.tree.map(np.shape, params)
    return flax_model, variables, net, params, x1


def _x2(name, axes):
    shape = TWINS[name][2]
    return jax.random.normal(jax.random.PRNGKey(2), (3 if axes == "diag_batch" else 2, *shape))


@pytest.mark.parametrize("name", list(TWINS))
def test_same_outputs(name):
    flax_model, variables, net, params, x1 = _twins(name)
    out_flax = np.asarray(flax_model.apply(variables, x1), np.float64)
    reference.assert_close(net.apply(params, x1), out_flax)


@pytest.mark.parametrize("axes", list(AXES))
@pytest.mark.parametrize("name", list(TWINS))
def test_same_ntk_and_nngp(name, axes):
    flax_model, variables, net, params, x1 = _twins(name)
    x2 = _x2(name, axes)
    k_flax = ntk_flax.kernel(flax_model, variables, x1, x2, **AXES[axes])
    k_haiku = ntk_haiku.kernel(net, params, x1, x2, **AXES[axes])
    reference.assert_close(k_haiku, np.asarray(k_flax, np.float64))
    g_flax = ntk_flax.nngp(flax_model, variables, x1, x2, **AXES[axes])
    g_haiku = ntk_haiku.nngp(net, params, x1, x2, **AXES[axes])
    reference.assert_close(g_haiku, np.asarray(g_flax, np.float64))


@pytest.mark.parametrize("name, axes", [("mlp", "trace"), ("lenet", "full")])
def test_same_kernel_per_leaf_and_plan(name, axes):
    """Leaf by leaf, through the transplant's renaming (kernel -> w, bias -> b): the
    same per-leaf kernels, and the same method for each leaf in the plans."""
    flax_model, variables, net, params, x1 = _twins(name)
    x2 = _x2(name, axes)
    k_flax = ntk_flax.kernel_per_leaf(flax_model, variables, x1, x2, **AXES[axes])
    k_haiku = ntk_haiku.kernel_per_leaf(net, params, x1, x2, **AXES[axes])
    as_haiku = ntk_haiku.params_from_flax(k_flax)
    assert jax.tree.structure(as_haiku) == jax.tree.structure(k_haiku)
    scale = np.abs(np.asarray(ntk_flax.kernel(flax_model, variables, x1, x2, **AXES[axes]))).max()
    for a, b in zip(jax.tree.leaves(k_haiku), jax.tree.leaves(as_haiku), strict=True):
        reference.assert_close(a, np.asarray(b, np.float64), scale=scale)
    plan_flax = ntk_flax.plan(flax_model, variables, x1, x2, **AXES[axes])
    plan_haiku = ntk_haiku.plan(net, params, x1, x2, **AXES[axes])
    assert plan_flax.implementation == plan_haiku.implementation
    methods_flax = ntk_haiku.params_from_flax(
        jax.tree.unflatten(
            jax.tree.structure(variables["params"]), [leaf.method for leaf in plan_flax.leaves]
        )
    )
    assert jax.tree.leaves(methods_flax) == [leaf.method for leaf in plan_haiku.leaves]
