"""Structured derivatives: which leaves get the Gram identity, the fallbacks, and the
models that stress the jaxpr interpreter (scan, checkpoint, custom_jvp/custom_vjp,
weights seen through different views, sequence axes), each against the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import ntk_core
import reference


def _params(*shapes, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [
        jax.random.normal(k, s) / (s[0] ** 0.5 if len(s) > 1 else 1.0)
        for k, s in zip(keys, shapes, strict=True)
    ]


@jax.custom_vjp
def clipped_identity(x):
    return x


clipped_identity.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))


def mlp(p, x):
    return jax.nn.softplus(x @ p[0] + p[1]) @ p[2]


def product_read_twice(p, x):
    """x W feeds the bias add and the output: the bias must not be fused."""
    y = x @ p[0]
    return jnp.tanh(y + p[1]) @ p[2] + y[:, :3]


def scalar_bias(p, x):
    """A one-entry bias broadcast over every unit: not one entry per unit, not fused."""
    return jnp.tanh(x @ p[0] + p[1][:1]) @ p[2]


def left_weight(p, x):
    """The weight as the left operand: (W^T x^T)^T."""
    return jnp.tanh((p[0].T @ x.T).T + p[1]) @ p[2]


def gelu_checkpointed(p, x):
    layer = jax.checkpoint(lambda w, h: jax.nn.gelu(h @ w))
    return layer(p[0], x + p[1]) @ p[2]


def scan_layers(p, x):
    def body(h, w):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(body, x, jnp.stack([p[0], p[0] * 0.5]))
    return h @ p[2]


def param_in_nonlinearity(p, x):
    return jnp.tanh((x @ p[0]) * p[1]) @ p[2]


def transposed_tying(p, x):
    h = jnp.tanh(x @ p[0])  # (N, 4) -> (N, 4)
    return jnp.tanh(h @ p[0].T) @ p[2]


def custom_vjp_activation(p, x):
    return clipped_identity(jnp.tanh(x @ p[0])) @ p[2]


def sequence_einsum(p, x):
    h = jnp.einsum("nsd,de->nse", x.reshape(x.shape[0], 2, 2), p[0][:2, :])
    return jnp.einsum("nse,eo->nso", jnp.tanh(h), p[2]).mean(axis=1)


MODELS = {
    "mlp_softplus": (mlp, ["structured", "structured", "structured"]),  # bias fused
    "product_read_twice": (product_read_twice, ["structured", "jacobian (fallback)", "structured"]),
    "scalar_bias": (scalar_bias, ["structured", "jacobian (fallback)", "structured"]),
    "left_weight": (left_weight, ["structured", "jacobian (fallback)", "structured"]),
    "checkpoint_gelu": (gelu_checkpointed, ["structured", "jacobian (fallback)", "structured"]),
    "scan": (scan_layers, ["jacobian (fallback)", "jacobian (fallback)", "structured"]),
    "param_in_nonlinearity": (
        param_in_nonlinearity,
        ["structured", "jacobian (fallback)", "structured"],
    ),
    "transposed_tying": (
        transposed_tying,
        ["jacobian (fallback)", "jacobian (fallback)", "structured"],
    ),
    "custom_vjp": (custom_vjp_activation, ["structured", "jacobian (fallback)", "structured"]),
    "sequence_einsum": (
        sequence_einsum,
        ["jacobian (fallback)", "jacobian (fallback)", "structured"],
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_structured_matches_reference_and_plan(name):
    f, methods = MODELS[name]
    p = _params((4, 4), (4,), (4, 3))
    x1 = jax.random.normal(jax.random.PRNGKey(1), (3, 4))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (2, 4))
    k = ntk_core.empirical_ntk(f, p, x1, x2, trace_axes=(), implementation="structured")
    reference.assert_close(k, reference.ntk(f, p, x1, x2, trace_axes=())[0])
    plan = ntk_core.plan(f, p, x1, x2, trace_axes=(), implementation="structured")
    assert plan.implementation == "structured"
    assert [
        leaf.method.split(" (")[0] if "structured" in leaf.method else leaf.method
        for leaf in plan.leaves
    ] == methods
    assert [leaf.size for leaf in plan.leaves] == [16, 4, 12]


def test_plan_reports_every_leaf_and_matches_auto():
    f = mlp
    p = _params((4, 4), (4,), (4, 3))
    x = jnp.ones((5, 4))
    plan = ntk_core.plan(f, p, x)
    assert {e.implementation for e in plan.estimates} == {"jacobian", "ntvp", "structured"}
    assert all(e.flops > 0 and e.memory_bytes > 0 for e in plan.estimates)
    assert plan.implementation == ntk_core.ntk_fn(f).implementation_for(p, x)
    assert [leaf.path for leaf in plan.leaves] == ["[0]", "[1]", "[2]"]
    assert "implementation: " in str(plan)


def test_auto_never_structured_without_per_sample_independence():
    p = _params((4, 4), (4,), (4, 3))
    plan = ntk_core.plan(mlp, p, jnp.ones((5, 4)), vmap_axes=None)
    assert "structured" not in {e.implementation for e in plan.estimates}
    assert plan.implementation != "structured"


def test_structured_picked_for_wide_mlp():
    """C2's MLP 784-1000-1: the Gram identity is orders of magnitude cheaper."""
    p = [jnp.ones((784, 1000)), jnp.zeros(1000), jnp.ones((1000, 1))]
    plan = ntk_core.plan(
        lambda p, x: jax.nn.relu(x @ p[0] + p[1]) @ p[2], p, jnp.ones((1000, 784)), trace_axes=()
    )
    flops = {e.implementation: e.flops for e in plan.estimates}
    assert plan.implementation == "structured"
    assert flops["structured"] * 100 < flops["jacobian"]


@pytest.mark.parametrize("implementation", ["jacobian", "structured", "auto"])
@pytest.mark.parametrize("name", ["tied", "tokens", "dict_input"])
def test_per_leaf_kernels_sum_to_total_and_match_reference(name, implementation):
    import numpy as np

    import zoo

    entry = zoo.ZOO[name]
    f, p = zoo.apply_fn(entry), entry.variables["params"]
    x1, x2 = zoo.inputs(entry)
    per_leaf = ntk_core.empirical_ntk_per_leaf(
        f, p, x1, x2, trace_axes=(), implementation=implementation
    )
    assert jax.tree.structure(
        per_leaf, is_leaf=lambda v: isinstance(v, tuple)
    ) == jax.tree.structure(p)
    total = ntk_core.empirical_ntk(f, p, x1, x2, trace_axes=(), implementation=implementation)
    leaves = jax.tree.leaves(p)
    n_out = len(jax.tree.leaves(total))
    kernels = jax.tree.leaves(per_leaf)
    assert len(kernels) == len(leaves) * n_out
    for k in range(n_out):
        summed = sum(np.asarray(kernels[j * n_out + k], np.float64) for j in range(len(leaves)))
        reference.assert_close(summed, np.asarray(jax.tree.leaves(total)[k], np.float64))
    # Each leaf's kernel against the reference restricted to that leaf.
    for i in (0, len(leaves) - 1):

        def f_leaf(leaf, x, i=i):
            new = list(leaves)
            new[i] = leaf
            return f(jax.tree.unflatten(jax.tree.structure(p), new), x)

        expected = reference.ntk(f_leaf, leaves[i], x1, x2, trace_axes=())
        for k in range(n_out):
            reference.assert_close(kernels[i * n_out + k], expected[k])


def test_bias_fusion_reported_and_exact():
    p = _params((4, 4), (4,), (4, 3))
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    plan = ntk_core.plan(mlp, p, x, implementation="structured")
    assert [leaf.method for leaf in plan.leaves] == [
        "structured (1 matrix product)",
        "structured (bias fused with its matrix product)",
        "structured (1 matrix product)",
    ]
    # Split per leaf, the bias keeps its own kernel (no fusion) and the sum is unchanged.
    per_leaf = ntk_core.empirical_ntk_per_leaf(mlp, p, x, implementation="structured")
    total = ntk_core.empirical_ntk(mlp, p, x, implementation="structured")
    reference.assert_close(sum(jax.tree.leaves(per_leaf)), reference.ntk(mlp, p, x, None)[0])
    reference.assert_close(total, reference.ntk(mlp, p, x, None)[0])


def test_per_leaf_refuses_ntvp():
    with pytest.raises(
        ValueError,
        match=r"empirical_ntk_per_leaf: per-leaf kernels need implementation 'jacobian', 'structured' or 'auto', got 'ntvp'",
    ):
        ntk_core.empirical_ntk_per_leaf(
            mlp, _params((4, 4), (4,), (4, 3)), jnp.ones((3, 4)), implementation="ntvp"
        )
