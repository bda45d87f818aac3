"""The same architecture in Flax and Haiku, with weights transplanted, gives the same
outputs, NTK and NNGP (every axes setting of the reference grid).

Two transplants: Haiku twins whose modules carry the Flax names
(``params_from_flax(flax_params)``), and Haiku models with Haiku's own module names
(``hk.nets.MLP``, default ``hk.Linear``/``hk.Conv2D`` names), mapped in order
(``params_from_flax(flax_params, haiku_params)``).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_flax
import ntk_haiku
import reference
from ntk_core.testing import assert_kernels_close, assert_same_ntk


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
    assert_kernels_close(k_haiku, k_flax)  # the helper users get (ntk_core.testing)
    g_flax = ntk_flax.nngp(flax_model, variables, x1, x2, **AXES[axes])
    g_haiku = ntk_haiku.nngp(net, params, x1, x2, **AXES[axes])
    assert_kernels_close(g_haiku, g_flax)


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


# Flax models against Haiku models with Haiku's own module names, mapped in order by
# params_from_flax(flax_params, haiku_params).


class FlaxTanhMLP(nn.Module):
    widths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for width in self.widths[:-1]:
            x = jnp.tanh(nn.Dense(width)(x))
        return nn.Dense(self.widths[-1])(x)


class FlaxDenseConvNet(nn.Module):
    """Dense, Conv, Conv (no bias), Dense, Dense: the kinds interleave."""

    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(4)(x))  # over channels: (N, H, W, 3) -> (N, H, W, 4)
        x = jnp.tanh(nn.Conv(5, (3, 3))(x))
        x = jnp.tanh(nn.Conv(6, (2, 2), use_bias=False)(x))
        x = jnp.tanh(nn.Dense(8)(x.reshape((x.shape[0], -1))))
        return nn.Dense(2)(x)


def haiku_dense_conv_net(x):
    x = jnp.tanh(hk.Linear(4)(x))  # linear
    x = jnp.tanh(hk.Conv2D(5, 3)(x))  # conv2_d
    x = jnp.tanh(hk.Conv2D(6, 2, with_bias=False)(x))  # conv2_d_1
    x = jnp.tanh(hk.Linear(8)(x.reshape((x.shape[0], -1))))  # linear_1
    return hk.Linear(2)(x)  # linear_2


DEEP = (8,) * 11 + (2,)  # square layers: only the order (Dense_2 < Dense_10) tells them apart

MAPPED = {
    "mlp": (
        FlaxTanhMLP((16, 16, 3)),
        lambda x: hk.nets.MLP([16, 16, 3], activation=jnp.tanh)(x),
        (7,),
    ),
    "deep_mlp": (
        FlaxTanhMLP(DEEP),
        lambda x: hk.nets.MLP(list(DEEP), activation=jnp.tanh)(x),
        (8,),
    ),
    "deep_sequential": (  # layers_0, layers_2, ..., layers_22 (activations in between)
        nn.Sequential(
            [layer for width in DEEP[:-1] for layer in (nn.Dense(width), nn.tanh)]
            + [nn.Dense(DEEP[-1])]
        ),
        lambda x: hk.nets.MLP(list(DEEP), activation=jnp.tanh)(x),
        (8,),
    ),
    "sequential": (
        nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(8), nn.tanh, nn.Dense(2)]),
        lambda x: hk.Sequential([hk.Linear(8), jnp.tanh, hk.Linear(8), jnp.tanh, hk.Linear(2)])(x),
        (5,),
    ),
    "dense_conv": (FlaxDenseConvNet(), haiku_dense_conv_net, (6, 6, 3)),
}

HAIKU_NAMES = {
    "mlp": ["mlp/~/linear_0", "mlp/~/linear_1", "mlp/~/linear_2"],
    "deep_mlp": [f"mlp/~/linear_{i}" for i in range(12)],
    "deep_sequential": [f"mlp/~/linear_{i}" for i in range(12)],
    "sequential": ["linear", "linear_1", "linear_2"],
    "dense_conv": ["linear", "conv2_d", "conv2_d_1", "linear_1", "linear_2"],
}


@functools.cache
def _mapped(name):
    flax_model, haiku_fn, shape = MAPPED[name]
    x1 = jax.random.normal(jax.random.PRNGKey(1), (3, *shape))
    variables = flax_model.init(jax.random.PRNGKey(0), x1)
    net = hk.without_apply_rng(hk.transform(haiku_fn))
    template = net.init(jax.random.PRNGKey(3), x1)
    params = ntk_haiku.params_from_flax(variables["params"], template)
    return flax_model, variables, net, template, params, x1


def _assert_relative(actual, expected, rtol):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err, scale = np.abs(actual - expected).max(), np.abs(expected).max()
    assert scale > 0 and err <= rtol * scale, f"max error {err:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("name", list(MAPPED))
def test_mapped_params_have_haiku_names_shapes_and_flax_values(name):
    _, variables, _, template, params, _ = _mapped(name)
    assert list(params) == list(template) == HAIKU_NAMES[name]
    assert jax.tree.structure(params) == jax.tree.structure(template)
    assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, template)
    # Every Flax array lands in exactly one Haiku leaf, none is the template's.
    flax_ids = sorted(id(leaf) for leaf in jax.tree.leaves(variables["params"]))
    assert sorted(id(leaf) for leaf in jax.tree.leaves(params)) == flax_ids


@pytest.mark.parametrize(
    "name, flax_name",
    [("deep_mlp", "Dense_{}"), ("deep_sequential", "layers_{}")],
)
def test_deep_stack_maps_in_numeric_order(name, flax_name):
    """The i-th Flax layer to the i-th Haiku module: numbers compared as numbers, where
    alphabetical order would pair layers_10 (the 6th) with linear_1 (the 2nd)."""
    _, variables, _, _, params, _ = _mapped(name)
    step = 2 if name == "deep_sequential" else 1
    for i in range(len(DEEP)):
        layer = variables["params"][flax_name.format(step * i)]
        assert params[f"mlp/~/linear_{i}"]["w"] is layer["kernel"]
        assert params[f"mlp/~/linear_{i}"]["b"] is layer["bias"]


@pytest.mark.parametrize("name", ["deep_mlp", "deep_sequential", "dense_conv"])
def test_mapping_does_not_depend_on_dict_order(name):
    """jax.jit and jax.eval_shape return dicts with alphabetically sorted keys
    ('Dense_10' before 'Dense_2', 'linear' before 'conv2_d'): the same mapping."""
    flax_model, variables, net, _, params, x1 = _mapped(name)
    sorted_variables = jax.jit(flax_model.init)(jax.random.PRNGKey(0), x1)
    sorted_template = jax.eval_shape(net.init, jax.random.PRNGKey(3), x1)
    assert list(sorted_variables["params"]) != list(variables["params"])
    assert list(sorted_template) == sorted(sorted_template)
    again = ntk_haiku.params_from_flax(sorted_variables["params"], sorted_template)
    assert list(again) == sorted(params)
    assert jax.tree.structure(again) == jax.tree.structure(dict(sorted(params.items())))
    for module in params:
        for leaf in params[module]:
            np.testing.assert_array_equal(again[module][leaf], params[module][leaf])


@pytest.mark.parametrize("name", list(MAPPED))
def test_mapped_same_outputs_and_ntk(name):
    flax_model, variables, net, _, params, x1 = _mapped(name)
    x2 = jax.random.normal(jax.random.PRNGKey(2), (2, *MAPPED[name][2]))
    _assert_relative(net.apply(params, x1), flax_model.apply(variables, x1), rtol=1e-6)
    k_flax = ntk_flax.kernel(flax_model, variables, x1, x2, trace_axes=())
    k_haiku = ntk_haiku.kernel(net, params, x1, x2, trace_axes=())
    assert k_haiku.shape == (3, 2, *net.apply(params, x1).shape[1:] * 2)
    _assert_relative(k_haiku, k_flax, rtol=1e-5)
    # The user-facing check on core kernels of both apply functions, with another
    # implementation than the adapters' "auto" (each is checked against the float64
    # reference in tests/core; here the claim is the mapping of the weights).
    rest = {k: v for k, v in variables.items() if k != "params"}

    def flax_fn(p, x):
        return flax_model.apply({"params": p, **rest}, x)

    assert_same_ntk(
        flax_fn, variables["params"], net.apply, params, x1, x2, trace_axes=(),
        implementation="jacobian",
    )  # fmt: skip


@pytest.mark.parametrize("name", list(MAPPED))
def test_haiku_to_flax_transplant(name):
    """ntk_flax.params_from_haiku, the reverse: Haiku's own weights in the Flax model give
    Haiku's outputs and NTK, and the round trip returns the very same arrays."""
    flax_model, variables, net, template, _, x1 = _mapped(name)
    flax_params = ntk_flax.params_from_haiku(template, variables["params"])
    assert jax.tree.structure(flax_params) == jax.tree.structure(variables["params"])
    rest = {k: v for k, v in variables.items() if k != "params"}

    def flax_fn(p, x):
        return flax_model.apply({"params": p, **rest}, x)

    _assert_relative(flax_fn(flax_params, x1), net.apply(template, x1), rtol=1e-6)
    assert_same_ntk(net.apply, template, flax_fn, flax_params, x1, implementation="structured")
    back = ntk_haiku.params_from_flax(flax_params, template)
    assert all(
        a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(template), strict=True)
    )
