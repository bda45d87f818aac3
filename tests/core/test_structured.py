"""Structured derivatives: which leaves get the Gram identity, the fallbacks, and the
models that stress the jaxpr interpreter (scan, checkpoint, custom_jvp/custom_vjp,
weights seen through different views, sequence axes), each against the reference."""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import frameworks
import ntk_core
import reference
from ntk_core._jax.jaxpr_walk import values_written

DN = ("NHWC", "HWIO", "NHWC")


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
    """x W feeds the bias add and the output: the bias is not fused (an elementwise
    shift instead)."""
    y = x @ p[0]
    return jnp.tanh(y + p[1]) @ p[2] + y[:, :3]


def scalar_bias(p, x):
    """A one-entry bias broadcast over every unit: not one entry per unit, not fused."""
    return jnp.tanh(x @ p[0] + p[1][:1]) @ p[2]


def left_weight(p, x):
    """The weight as the left operand: (W^T x^T)^T (the bias after the transpose is
    an elementwise shift)."""
    return jnp.tanh((p[0].T @ x.T).T + p[1]) @ p[2]


def gelu_checkpointed(p, x):
    layer = jax.checkpoint(lambda w, h: jax.nn.gelu(h @ w))
    return layer(p[0], x + p[1]) @ p[2]


def scan_layers(p, x):
    def body(h, w):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(body, x, jnp.stack([p[0], p[0] * 0.5]))
    return h @ p[2]


def scale_after_product(p, x):
    """An elementwise scale of a product's output, then a nonlinearity."""
    return jnp.tanh((x @ p[0]) * p[1]) @ p[2]


def param_in_nonlinearity(p, x):
    return jnp.tanh((x @ p[0]) * jnp.tanh(p[1])) @ p[2]


TANH_LINE = param_in_nonlinearity.__code__.co_firstlineno + 1  # its plan reason's line


def transposed_tying(p, x):
    h = jnp.tanh(x @ p[0])  # (N, 4) -> (N, 4)
    return jnp.tanh(h @ p[0].T) @ p[2]


TIED_LINE = transposed_tying.__code__.co_firstlineno + 1


def custom_vjp_activation(p, x):
    return clipped_identity(jnp.tanh(x @ p[0])) @ p[2]


def sequence_einsum(p, x):
    h = jnp.einsum("nsd,de->nse", x.reshape(x.shape[0], 2, 2), p[0][:2, :])
    return jnp.einsum("nse,eo->nso", jnp.tanh(h), p[2]).mean(axis=1)


SHIFT = "structured (elementwise shift, per-sample Jacobian)"
FB = "jacobian (fallback: "  # then the reason no rule covers the leaf
HERE = os.path.basename(
    __file__
)  # fallback reasons end with the user's line: "; at <file>:<line>, in <function>"
UNUSED = f"{FB}not used by the model: its kernel is zero)"
SCALE = "structured (elementwise scale, per-sample Jacobian)"

MODELS = {
    # name: (model, the prefix of each leaf's plan label)
    "mlp_softplus": (mlp, ["structured", "structured (bias fused", "structured"]),
    "product_read_twice": (product_read_twice, ["structured", SHIFT, "structured"]),
    "scalar_bias": (scalar_bias, ["structured", f"{FB}used by slice", "structured"]),
    "left_weight": (left_weight, ["structured", SHIFT, "structured"]),
    "checkpoint_gelu": (gelu_checkpointed, ["structured", SHIFT, "structured"]),
    "scan": (scan_layers, [f"{FB}used by ", UNUSED, "structured"]),  # stack: JAX-version-dependent
    "scale_after_product": (scale_after_product, ["structured", SCALE, "structured"]),
    "param_in_nonlinearity": (
        param_in_nonlinearity,
        [
            "structured",
            f"{FB}used by tanh, which no rule covers; at {HERE}:{TANH_LINE}, in",
            "structured",
        ],
    ),
    "transposed_tying": (
        transposed_tying,
        [
            f"{FB}used by a matrix product (at {HERE}:{TIED_LINE}, in transposed_tying) and a "
            f"matrix product of another view of it (at {HERE}:{TIED_LINE + 1}, in "
            f"transposed_tying), whose Jacobians do not pair up",
            UNUSED,
            "structured",
        ],
    ),
    "custom_vjp": (custom_vjp_activation, ["structured", UNUSED, "structured"]),
    "sequence_einsum": (
        sequence_einsum,
        [f"{FB}used by slice", UNUSED, "structured"],
    ),
}


def _cast(p, x):
    """Computed in bfloat16 from float32 parameters (a Flax dtype=jnp.bfloat16 layer)."""
    h = x.astype(jnp.bfloat16) @ p[0].astype(jnp.bfloat16)
    return jnp.tanh(h.astype(jnp.float32) + p[1]) @ p[2]


def _custom_jvp_param(p, x):
    return jnp.tanh(x @ p[0] + jax.nn.relu(p[1])) @ p[2]


@jax.custom_jvp
def _bounded(w):
    return jnp.tanh(w)


_bounded.defjvp(lambda w, t: (jnp.tanh(w[0]), t[0] * (1.0 - jnp.tanh(w[0]) ** 2)))


@jax.jit
def _bounded_twice(w):
    return 2.0 * _bounded(w)


def _bounded_param(p, x):  # a custom_jvp function inside a jitted one
    return jnp.tanh(x @ p[0] + _bounded_twice(p[1])) @ p[2]


def _scan_closure(p, x):
    h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h @ p[0] + p[1]), None), x, None, length=2)
    return h @ p[2]


@pytest.mark.parametrize(
    "f, reasons",
    [
        (_cast, [r"cast to a lower precision \(float32 -> bfloat16, convert_element_type\)"]),
        # The function's name where JAX records it (not in its custom_jvp calls before 0.5)
        (_custom_jvp_param, [None, r"passed through (relu, )?a function with a custom deriv"]),
        (
            _bounded_param,
            [None, r"passed through (_bounded inside _bounded_twice, )?a function with a"],
        ),
        (_scan_closure, [r"used inside a loop \(scan\)", r"used inside a loop \(scan\)"]),
    ],
)
@pytest.mark.filterwarnings("ignore:.*computes in half precision:UserWarning")  # bf16 model
def test_plan_says_why_a_leaf_falls_back(f, reasons):
    """Each fallback leaf's plan label names what stopped the rules (``reasons``:
    regular expressions), and the kernel still equals the reference."""
    p = _params((4, 4), (4,), (4, 3))
    x1 = jax.random.normal(jax.random.PRNGKey(1), (3, 4))
    plan = ntk_core.plan(f, p, x1, trace_axes=(), implementation="structured")
    for leaf, reason in zip(plan.leaves[: len(reasons)], reasons, strict=True):
        if reason is None:
            assert leaf.method.startswith("structured"), leaf.method
        else:
            if jax.__version_info__ >= (0, 10):  # names recorded: required
                reason = reason.replace(")?", ")")
            assert re.match(re.escape(FB) + reason, leaf.method), leaf.method
    assert plan.leaves[2].method.startswith("structured")
    assert re.search(re.escape(FB) + reasons[-1], str(plan))
    k = ntk_core.empirical_ntk(f, p, x1, trace_axes=(), implementation="structured")
    expected = reference.ntk(f, p, x1, None, trace_axes=())[0]
    if f is _cast:  # the same bfloat16 Jacobians as "jacobian"; the reference's whole-
        # batch reverse pass rounds its bfloat16 products in another order
        kj = ntk_core.empirical_ntk(f, p, x1, trace_axes=(), implementation="jacobian")
        reference.assert_close(k, np.asarray(kj, np.float64))
        np.testing.assert_allclose(k, expected, atol=1e-2 * np.abs(expected).max())
    else:
        reference.assert_close(k, expected)


_SQRT2 = jnp.sqrt(2.0)  # a constant the models close over (a jaxpr constvar)


@jax.jit
def _scaled_dense(w, x):  # the constant reaches the jitted call as an argument
    return x @ (w / _SQRT2)


SCALED_MODELS = {
    # NTK parametrisation: weights times a constant before their product; plan labels of
    # (w, b, v, e) for the used leaves
    "divided": (
        lambda p, x: jnp.tanh(x @ (p[0] / 8.0) + p[1]) @ (p[2] / 3.0),
        ["structured (1 matrix product)", "structured (bias fused", "structured (1 matrix"],
    ),
    "negated_and_scaled_bias": (
        lambda p, x: jnp.tanh(x @ (-p[0]) + p[1] * 0.5) @ p[2],
        ["structured (1 matrix product)", SHIFT, "structured (1 matrix"],
    ),
    "constant_on_the_left": (
        lambda p, x: jnp.tanh(x @ (0.125 * p[0]) + p[1]) @ (p[2] * _SQRT2),
        ["structured (1 matrix product)", "structured (bias fused", "structured (1 matrix"],
    ),
    "inside_jit": (
        lambda p, x: jnp.tanh(_scaled_dense(p[0], x) + p[1]) @ p[2],
        ["structured (1 matrix product)", SHIFT, "structured (1 matrix"],  # not fused across
    ),
    "same_weight_two_factors": (
        lambda p, x: jnp.tanh(x @ (p[0] * 0.5) + (x @ p[0]) * 2.0 + p[1]) @ p[2],
        ["structured (2 matrix products", SHIFT, "structured (1 matrix"],
    ),
}


@pytest.mark.parametrize("name", list(SCALED_MODELS))
def test_constant_scaled_weights_keep_their_rule(name):
    """W / c, -W and c * W (c a literal or a closed-over constant) keep the matrix
    product's Gram form, with the factor squared in the kernel, instead of an explicit
    per-sample Jacobian; a scaled bias is not fused (its Jacobian carries the factor)."""
    f, methods = SCALED_MODELS[name]
    p = _params((4, 4), (4,), (4, 3))
    x1 = jax.random.normal(jax.random.PRNGKey(1), (3, 4))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (2, 4))
    plan = ntk_core.plan(f, p, x1, x2, trace_axes=(), implementation="structured")
    for leaf, expected in zip(plan.leaves, methods, strict=True):
        assert leaf.method.startswith(expected), (leaf.method, expected)
    k = ntk_core.empirical_ntk(f, p, x1, x2, trace_axes=(), implementation="structured")
    reference.assert_close(k, reference.ntk(f, p, x1, x2, trace_axes=())[0])
    per_leaf = ntk_core.empirical_ntk_per_leaf(f, p, x1, x2, trace_axes=())
    for got, leaf in zip(per_leaf, p, strict=True):  # each leaf's own kernel
        only = lambda q, x, leaf=leaf, p=p: f([q if v is leaf else v for v in p], x)
        expected = reference.ntk(only, leaf, x1, x2, trace_axes=())[0]
        reference.assert_close(got, expected)


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
    for leaf, expected in zip(plan.leaves, methods, strict=True):
        assert leaf.method.startswith(expected), (leaf.method, expected)
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


@pytest.mark.parametrize("implementation", ["jacobian", "ntvp"])
def test_plan_of_another_implementation_says_what_structured_would_do(implementation):
    """When "jacobian" or "ntvp" runs (asked for, or chosen by "auto"), each leaf also
    carries the method "structured" would use, fallback reasons included; nothing when
    "structured" cannot run (vmap_axes=None)."""
    f = param_in_nonlinearity
    p = _params((4, 4), (4,), (4, 3))
    x = jnp.ones((5, 4))
    other = ntk_core.plan(f, p, x, trace_axes=(), implementation=implementation)
    structured = ntk_core.plan(f, p, x, trace_axes=(), implementation="structured")
    assert [leaf.method for leaf in other.leaves] == [implementation] * 3
    assert [leaf.structured for leaf in other.leaves] == [leaf.method for leaf in structured.leaves]
    tanh = (
        f"{FB}used by tanh, which no rule covers; at {HERE}:{TANH_LINE}, in param_in_nonlinearity)"
    )
    assert other.leaves[1].structured == tanh
    assert all(leaf.structured == "" for leaf in structured.leaves)
    text = str(other)
    assert "(implementation='structured' would use)" in text
    assert f"{implementation}  ({tanh})" in text
    whole = ntk_core.plan(f, p, x, vmap_axes=None, implementation=implementation)
    assert all(leaf.structured == "" for leaf in whole.leaves)
    assert "would use" not in str(whole)


def test_plan_counts_the_triangular_contraction(monkeypatch):
    """Estimated FLOPs are a·N (features) + b·N² (contraction) while the Gram matrix is
    contracted whole (N < 2·TRIANGLE_MIN_BLOCK); from N = 256 on, only (k + 1)/2k of the
    pairs are contracted by the feature methods, while NTK-vector products, which have
    no features, still compute all of them; and all of them again where the features
    pass TRIANGLE_MAX_FEATURE_BYTES (the blocks would copy them) or the pair work is
    below TRIANGLE_MIN_PAIR_BYTES (the block loop would compile longer than it saves)."""
    from ntk_core._impl import phases as _implementations

    least = _implementations.TRIANGLE_MIN_PAIR_BYTES
    assert _implementations.triangle_blocks(1000, 0.9 * least / 1000) == 1
    assert _implementations.triangle_blocks(1000, 1.1 * least / 1000) == 7
    monkeypatch.setattr(_implementations, "TRIANGLE_MIN_PAIR_BYTES", 0)
    p = _params((6, 5), (5,), (5, 2))
    k = _implementations.triangle_blocks(256)
    assert k == 256 // _implementations.TRIANGLE_MIN_BLOCK > 1
    assert (
        _implementations.triangle_blocks(256, _implementations.TRIANGLE_MAX_FEATURE_BYTES + 1) == 1
    )
    flops = {}
    for n in (32, 64, 256, "whole"):
        if n == "whole":
            monkeypatch.setattr(_implementations, "TRIANGLE_MAX_FEATURE_BYTES", 0)
        x = jnp.ones((256 if n == "whole" else n, 6))
        plan = ntk_core.plan(mlp, p, x, trace_axes=())
        flops[n] = {e.implementation: e.flops for e in plan.estimates}
    for impl in ["jacobian", "structured"]:
        f32, f64 = flops[32][impl], flops[64][impl]
        # Solve a·N + b·N² through N = 32 and N = 64, then predict N = 256.
        b = (f64 - 2 * f32) / (64**2 - 2 * 32**2)
        a = (f32 - b * 32**2) / 32
        share = (k + 1) / (2 * k)
        np.testing.assert_allclose(flops[256][impl], a * 256 + share * b * 256**2, rtol=1e-9)
        np.testing.assert_allclose(flops["whole"][impl], a * 256 + b * 256**2, rtol=1e-9)
    f32, f64 = flops[32]["ntvp"], flops[64]["ntvp"]
    b = (f64 - 2 * f32) / (64**2 - 2 * 32**2)
    np.testing.assert_allclose(flops[256]["ntvp"], (f32 - b * 32**2) / 32 * 256 + b * 256**2)


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


def test_pass_cost_splits_the_reverse_pass_by_closed_form():
    """x (d) -> Dense h -> relu -> Dense o, and a conv: each product's FLOPs land in the
    right bucket (weights alone: weight gradient; activations: activation gradient; the
    input alone: nothing)."""
    from ntk_core._impl import cost as _cost

    d, h, o = 7, 5, 3

    def f(p, x):
        return jax.nn.relu(x @ p[0]) @ p[1]

    p = [jnp.ones((d, h)), jnp.ones((h, o))]
    closed = jax.make_jaxpr(f)(p, jnp.ones(d))
    cost = _cost.pass_cost(closed.jaxpr, [(True, False)] * 2 + [(False, True)])
    assert cost.grad_weights_dot == 2 * d * h + 2 * h * o
    assert cost.grad_activations == 2 * h * o  # relu(x @ W1) depends on both
    assert cost.grad_weights_conv == 0
    assert cost.forward == 2 * d * h + 2 * h * o + h  # + the relu, one per value

    def conv(p, x):  # (1, 6, 6, 2) * (3, 3, 2, 4), SAME
        y = jax.lax.conv_general_dilated(x, p, (1, 1), "SAME", dimension_numbers=DN)
        return jnp.sum(y)

    closed = jax.make_jaxpr(conv)(jnp.ones((3, 3, 2, 4)), jnp.ones((1, 6, 6, 2)))
    cost = _cost.pass_cost(closed.jaxpr, [(True, False), (False, True)])
    assert cost.grad_weights_conv == 2 * 36 * 4 * (3 * 3 * 2)
    assert cost.grad_activations == 0


def test_auto_prefers_structured_where_per_sample_conv_gradients_are_slow():
    """On CPU per-sample convolution kernel gradients run far below the matrix-product
    rate: a CNN's "jacobian" is estimated slower than "structured", which forms the same
    Jacobians from patches and cotangents."""
    from ntk_core._impl import cost as _cost

    def cnn(p, x):
        y = jax.lax.conv_general_dilated(x, p[0], (1, 1), "SAME", dimension_numbers=DN)
        y = jax.lax.conv_general_dilated(jax.nn.relu(y), p[1], (1, 1), "SAME", dimension_numbers=DN)
        return jnp.mean(y, axis=(1, 2)) @ p[2]

    p = [jnp.ones((3, 3, 3, 16)), jnp.ones((3, 3, 16, 16)), jnp.ones((16, 10))]
    plan = ntk_core.plan(cnn, p, jnp.ones((64, 16, 16, 3)))
    seconds = {e.implementation: e.seconds for e in plan.estimates}
    assert plan.implementation == "structured"
    assert seconds["structured"] < seconds["jacobian"] < seconds["ntvp"]
    assert _cost.rates_for("cpu").conv_weight_grad_slowdown > 1


@pytest.mark.parametrize("implementation", ["jacobian", "structured", "auto"])
@pytest.mark.parametrize("name", ["tied", "tokens", "dict_input"])
def test_per_leaf_kernels_sum_to_total_and_match_reference(name, implementation):
    import numpy as np

    import core_zoo

    entry = core_zoo.ZOO[name]
    f, p = core_zoo.apply_fn(entry), entry.params
    x1, x2 = core_zoo.inputs(entry)
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
        expected = _leaf_reference(name, i)
        for k in range(n_out):
            reference.assert_close(kernels[i * n_out + k], expected[k])


@functools.cache
def _leaf_reference(name, i):
    """The float64 reference NTK (``trace_axes=()``) of zoo model ``name`` restricted to
    its parameter leaf ``i``: one per model and leaf, shared by the implementations."""
    import core_zoo

    entry = core_zoo.ZOO[name]
    x1, x2 = core_zoo.inputs(entry)
    f_leaf, leaf = reference.leaf_alone(core_zoo.apply_fn(entry), entry.params, i)
    return reference.ntk(f_leaf, leaf, x1, x2, trace_axes=())


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


@pytest.mark.parametrize("vmap_axes", [0, None])
def test_a_custom_vjp_model_is_never_given_to_ntk_vector_products(vmap_axes):
    """A jax.custom_vjp has no jvp, which NTK-vector products need; with vmap_axes=None
    the jvp traces and only fails when lowered. "auto" avoids them (the kernel equals the
    float64 reference) and an explicit "ntvp" is refused with the fix."""
    p, x1 = _params((4, 5), (5,), (5, 3)), jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    x2 = x1[:3] + 1.0
    for b in (None, x2):
        k = ntk_core.empirical_ntk(custom_vjp_activation, p, x1, b, vmap_axes=vmap_axes)
        reference.assert_close(k, reference.ntk(custom_vjp_activation, p, x1, b)[0])
    with pytest.raises(ValueError, match=r"cannot run inside NTK-vector products.*custom_vjp"):
        ntk_core.empirical_ntk(
            custom_vjp_activation, p, x1, x2, vmap_axes=vmap_axes, implementation="ntvp"
        )


# -- convolutions, biases over positions, embedding lookups -------------------------------


def _conv(x, w, strides=(1, 1), padding="SAME", lhs_dil=None, rhs_dil=None, dn=None):
    return jax.lax.conv_general_dilated(
        x,
        w,
        strides,
        padding,
        lhs_dilation=lhs_dil,
        rhs_dilation=rhs_dil,
        dimension_numbers=dn or ("NHWC", "HWIO", "NHWC"),
    )


def conv_nhwc_strided(p, x):
    """NHWC / HWIO, stride 2, explicit padding, kernel dilation 2, bias (K,) broadcast."""
    h = jnp.tanh(_conv(x, p[0], (2, 2), ((1, 1), (0, 1)), rhs_dil=(2, 1)) + p[1])
    return h.reshape(h.shape[0], -1) @ p[2]


def conv_nchw_dilated(p, x):
    """NCHW / OIHW (Haiku's NCHW layout), input dilation, asymmetric explicit padding,
    bias (K, 1, 1) broadcast over the spatial positions."""
    y = _conv(
        jnp.transpose(x, (0, 3, 1, 2)),
        jnp.transpose(p[0], (3, 2, 0, 1)),
        (1, 2),
        ((1, 0), (2, 1)),
        lhs_dil=(2, 1),
        dn=("NCHW", "OIHW", "NCHW"),
    )
    h = jax.nn.relu(y + p[1][:, None, None])
    return h.reshape(h.shape[0], -1) @ p[2]


def conv_twice(p, x):
    """One kernel applied twice (weight tying through a convolution, two strides)."""
    h = jnp.tanh(_conv(x, p[0], (1, 1), "SAME"))
    h = jnp.tanh(_conv(h, p[0], (2, 2), "VALID") + p[1])
    return h.reshape(h.shape[0], -1) @ p[2]


def conv_kernel_elsewhere(p, x):
    """The kernel also enters a sum of squares: its Jacobian comes from the fallback."""
    h = jnp.tanh(_conv(x, p[0]) + p[1])
    return h.reshape(h.shape[0], -1) @ p[2] + jnp.sum(p[0] ** 2)


def conv_grouped(p, x):
    """A grouped convolution (feature_group_count=3): fallback."""
    y = jax.lax.conv_general_dilated(
        x,
        p[0],
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=3,
    )
    return jnp.tanh(y + p[1]).reshape(x.shape[0], -1) @ p[2]


def conv_one_position(p, x):
    """A 'VALID' convolution covering the whole image (one output position): the Gram
    form; then a 1x1 convolution (A = 1)."""
    h = jnp.tanh(_conv(x, p[0], padding="VALID") + p[1])  # (N, 1, 1, 3)
    return h.reshape(h.shape[0], -1) @ p[2]


def conv_1d(p, x):
    """A 1-D convolution (NWC / WIO) over a length-6 signal."""
    y = jax.lax.conv_general_dilated(
        x.reshape(x.shape[0], 6, 2), p[0], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
    )
    return jnp.tanh(y + p[1]).reshape(x.shape[0], -1) @ p[2]


CONV_MODELS = {
    # name: (model, x shape, (kernel, bias, readout) shapes, expected methods)
    "nhwc_strided": (
        conv_nhwc_strided,
        (5, 4, 3),
        ((3, 2, 3, 3), (3,), (12, 2)),
        ["structured (1 convolution", "structured (bias", "structured"],
    ),
    "nchw_dilated": (
        conv_nchw_dilated,
        (3, 4, 2),
        ((2, 3, 2, 3), (3,), (45, 2)),
        ["structured (1 convolution", "structured (bias", "structured"],
    ),
    "twice": (
        conv_twice,
        (4, 4, 3),
        ((2, 2, 3, 3), (3,), (12, 2)),
        ["structured (2 convolutions", SHIFT, "structured"],
    ),
    "kernel_elsewhere": (
        conv_kernel_elsewhere,
        (4, 4, 3),
        ((2, 2, 3, 3), (3,), (48, 2)),
        [f"{FB}used by integer_pow", SHIFT, "structured"],
    ),
    "grouped": (
        conv_grouped,
        (4, 4, 3),
        ((2, 2, 1, 3), (3,), (48, 2)),
        [f"{FB}the kernel of a grouped or depthwise convolution", SHIFT, "structured"],
    ),
    "one_position": (
        conv_one_position,
        (3, 3, 2),
        ((3, 3, 2, 3), (3,), (3, 2)),
        ["structured (1 convolution)", "structured (bias", "structured"],
    ),
    "conv_1d": (
        conv_1d,
        (12,),
        ((3, 2, 3), (3,), (18, 2)),
        ["structured (1 convolution", "structured (bias", "structured"],
    ),
}


@pytest.mark.parametrize("form", ["convolution", "matmul"])
@pytest.mark.parametrize("name", list(CONV_MODELS))
def test_convolution_rule_matches_reference_and_plan(name, form, monkeypatch, request):
    """Each model with its convolutions evaluated as convolutions, or as patches times
    the kernel matrix (``conv.MATMUL_MAX_POSITIONS``: small feature maps; on a TPU also
    ``TPU_MATMUL_MAX_CONTRACTION``: few channels); the compiled
    programs of either form are dropped before and after (other tests get the default)."""
    from ntk_core._jax.caches import clear_caches
    from ntk_core._structured.rules import conv

    calls = []
    matmul = conv.conv_as_matmul
    bound = 0 if form == "convolution" else 10**9
    monkeypatch.setattr(conv, "MATMUL_MAX_POSITIONS", bound)
    monkeypatch.setattr(conv, "TPU_MATMUL_MAX_CONTRACTION", bound)  # read on a TPU only
    monkeypatch.setattr(conv, "conv_as_matmul", lambda *a: calls.append(1) or matmul(*a))
    clear_caches()
    request.addfinalizer(clear_caches)
    f, x_shape, shapes, methods = CONV_MODELS[name]
    p = _params(*shapes, seed=3)
    x1 = jax.random.normal(jax.random.PRNGKey(1), (3, *x_shape))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (2, *x_shape))
    k = ntk_core.empirical_ntk(f, p, x1, x2, trace_axes=(), implementation="structured")
    reference.assert_close(k, reference.ntk(f, p, x1, x2, trace_axes=())[0])
    grouped = name == "grouped"  # a fallback: evaluated as JAX does
    assert bool(calls) == (form == "matmul" and not grouped), (form, len(calls))
    plan = ntk_core.plan(f, p, x1, x2, trace_axes=(), implementation="structured")
    for leaf, expected in zip(plan.leaves, methods, strict=True):
        assert leaf.method.startswith(expected), (leaf.method, expected)


def test_patches_follow_the_kernel_layout():
    """conv(x, W) equals the patches times the kernel in (C_in, window) order, for
    NHWC and NCHW layouts, strides, padding and both dilations."""
    from ntk_core._structured import analysis as _structured

    x = jax.random.normal(jax.random.PRNGKey(0), (1, 7, 6, 3))
    w = jax.random.normal(jax.random.PRNGKey(1), (3, 2, 3, 4))  # HWIO
    for dn, xt, wt in [
        (("NHWC", "HWIO", "NHWC"), x, w),
        (("NCHW", "OIHW", "NCHW"), jnp.transpose(x, (0, 3, 1, 2)), jnp.transpose(w, (3, 2, 0, 1))),
    ]:
        for strides, padding, lhs_dil, rhs_dil in [
            ((1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1)),
            ((2, 3), ((2, 0), (1, 2)), (2, 1), (1, 2)),
            ((1, 2), ((0, -1), (0, 0)), (1, 1), (2, 1)),
        ]:
            y = jax.lax.conv_general_dilated(
                xt, wt, strides, padding, lhs_dil, rhs_dil, dn, precision="highest"
            )
            conv = functools.partial(
                jax.lax.conv_general_dilated,
                window_strides=strides,
                padding=padding,
                lhs_dilation=lhs_dil,
                rhs_dilation=rhs_dil,
                dimension_numbers=dn,
            )
            closed = jax.make_jaxpr(conv)(xt, wt)
            eqn = closed.jaxpr.eqns[0]
            use = _structured._rules.CONV.match(
                eqn, [None, _structured.View(0, (), ())], (0,), None
            )
            pm = _structured.patches(xt, use.info)  # (C_in * window, A)
            spec = eqn.params["dimension_numbers"]
            w_ckw = jnp.transpose(
                wt, (spec.rhs_spec[1],) + tuple(spec.rhs_spec[2:]) + (spec.rhs_spec[0],)
            )
            y_ak = jnp.transpose(y, use.y_perm).reshape(use.a_size, use.w_free_size)
            expected = jnp.einsum(
                "ca,ck->ak", pm, w_ckw.reshape(-1, w_ckw.shape[-1]), precision="highest"
            )
            reference.assert_close(y_ak, np.asarray(expected, np.float64))


def seq_dense_bias(p, x):
    """A Dense layer over a sequence axis with its bias (A = 2 positions per sample)."""
    h = jnp.tanh(x.reshape(x.shape[0], 2, 2) @ p[0] + p[1])
    return jnp.einsum("nlk,ko->no", h, p[2])


def unit_major_bias(p, x):
    """The weight as the left operand of dot_general: units before the positions,
    y[k, n, l]; the bias broadcast over the trailing axes (b[:, None, None])."""
    xs = x.reshape(x.shape[0], 2, 2)
    y = jax.lax.dot_general(p[0], xs, (((0,), (2,)), ((), ()))) + p[1][:, None, None]
    return jnp.einsum("knl,ko->no", jnp.tanh(y), p[2])


def permuted_bias(p, x):
    """Units (2, 2) from a (D, 2, 2) weight; the bias (4,) enters transposed, a
    permutation of the units: still one entry per unit."""
    xs = x.reshape(x.shape[0], 2, 2)
    y = jnp.einsum("nld,dhe->nlhe", xs, p[0])
    y = y + p[1].reshape(2, 2).T
    return jnp.einsum("nlhe,heo->no", jnp.tanh(y), p[2])


def position_bias(p, x):
    """A bias that varies over positions (one entry per (position, unit)): not fused,
    an elementwise shift with every (position, unit) a unit."""
    y = x.reshape(x.shape[0], 2, 2) @ p[0] + p[1].reshape(2, 2)
    return jnp.einsum("nlk,ko->no", jnp.tanh(y), p[2])


BIAS_MODELS = {
    # name: (model, parameter shapes, the bias's method)
    "seq_dense_bias": (seq_dense_bias, ((2, 4), (4,), (4, 3)), "structured (bias"),
    "unit_major_bias": (unit_major_bias, ((2, 4), (4,), (4, 3)), "structured (bias"),
    "permuted_bias": (permuted_bias, ((2, 2, 2), (4,), (2, 2, 3)), "structured (bias"),
    "position_bias": (position_bias, ((2, 2), (4,), (2, 3)), SHIFT),
}


@pytest.mark.parametrize("name", list(BIAS_MODELS))
def test_bias_over_positions(name):
    f, shapes, bias_method = BIAS_MODELS[name]
    p = _params(*shapes, seed=5)
    x1 = jax.random.normal(jax.random.PRNGKey(1), (3, 4))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (2, 4))
    k = ntk_core.empirical_ntk(f, p, x1, x2, trace_axes=(), implementation="structured")
    reference.assert_close(k, reference.ntk(f, p, x1, x2, trace_axes=())[0])
    plan = ntk_core.plan(f, p, x1, x2, trace_axes=(), implementation="structured")
    assert plan.leaves[1].method.startswith(bias_method), plan.leaves[1].method


def _lookup_model(lookup, tied=False):
    def f(p, tokens):
        h = jnp.tanh(lookup(p[0], tokens))  # (N, L, D)
        if tied:  # the table again as the output projection (tied embeddings)
            return jnp.einsum("nld,vd->nv", h, p[0])
        return jnp.einsum("nld,do->no", h, p[1])

    return f


LOOKUPS = {
    # name: (lookup, tokens in range, vocabulary)
    "index": (lambda t, i: t[i], True),
    "take_clip": (lambda t, i: jnp.take(t, i, axis=0, mode="clip"), False),
    "take_fill": (lambda t, i: jnp.take(t, i, axis=0, mode="fill", fill_value=0.0), False),
    "index_out_of_range": (lambda t, i: t[i], False),
}


@pytest.mark.parametrize("vocab", [5, 600], ids=["explicit", "gram"])
@pytest.mark.parametrize("name", list(LOOKUPS))
def test_embedding_gather_rule(name, vocab):
    """Repeated tokens, out-of-range tokens (clamped, dropped or filled as the lookup
    does), both the explicit and the token-match (Gram) form: the Gram form's
    memory-bound token match pays only for a vocabulary much larger than the positions
    squared (A = 3 positions, 600 tokens)."""
    lookup, in_range = LOOKUPS[name]
    f = _lookup_model(lookup)
    p = _params((vocab, 3), (3, 2), seed=7)
    low, high = (0, vocab) if in_range else (-vocab - 3, vocab + 3)
    t1 = jax.random.randint(jax.random.PRNGKey(1), (4, 3), low, high)
    t1 = t1.at[0].set(t1[0, 0])  # a sample repeating one token
    t2 = jax.random.randint(jax.random.PRNGKey(2), (3, 3), low, high).at[1].set(t1[0])
    outside = any(bool(((t < -vocab) | (t >= vocab)).any()) for t in (t1, t2))
    if name == "index_out_of_range" and outside:  # refused since issue 48 (test_embedding_ids)
        with pytest.raises(ValueError, match=rf"outside \[-{vocab}, {vocab}\) for the {vocab}"):
            ntk_core.empirical_ntk(f, p, t1, t2, implementation="structured")
        return
    for axes in [dict(trace_axes=()), dict(trace_axes=(-1,), diagonal_axes=(0,))]:
        x2 = t1[:4] if "diagonal_axes" in axes else t2
        k = ntk_core.empirical_ntk(f, p, t1, x2, implementation="structured", **axes)
        reference.assert_close(k, reference.ntk(f, p, t1, x2, **axes)[0])
    plan = ntk_core.plan(f, p, t1, t2, trace_axes=(), implementation="structured")
    method = plan.leaves[0].method
    assert method.startswith("structured (embedding gather"), method
    assert ("per-sample Jacobian" in method) == (vocab == 5), method


def test_tied_embedding_falls_back_and_matches():
    f = _lookup_model(lambda t, i: t[i], tied=True)
    p = _params((6, 3), (3, 2), seed=8)
    t1 = jax.random.randint(jax.random.PRNGKey(1), (3, 4), 0, 6)
    t2 = jax.random.randint(jax.random.PRNGKey(2), (2, 4), 0, 6)
    k = ntk_core.empirical_ntk(f, p, t1, t2, trace_axes=(), implementation="structured")
    reference.assert_close(k, reference.ntk(f, p, t1, t2, trace_axes=())[0])
    plan = ntk_core.plan(f, p, t1, t2, trace_axes=(), implementation="structured")
    assert plan.leaves[0].method.startswith(f"{FB}used by an embedding gather (at {HERE}:")
    assert "and a matrix product (at" in plan.leaves[0].method


def test_embedding_used_twice_sums_its_uses():
    """The same table looked up with two token streams (one shifted): cross terms."""

    def f(p, tokens):
        h = jnp.tanh(p[0][tokens] + p[0][(tokens + 1) % 7])
        return jnp.einsum("nld,do->no", h, p[1])

    p = _params((7, 3), (3, 2), seed=9)
    t1 = jax.random.randint(jax.random.PRNGKey(1), (3, 4), 0, 7)
    t2 = jax.random.randint(jax.random.PRNGKey(2), (2, 4), 0, 7)
    k = ntk_core.empirical_ntk(f, p, t1, t2, trace_axes=(), implementation="structured")
    reference.assert_close(k, reference.ntk(f, p, t1, t2, trace_axes=())[0])
    plan = ntk_core.plan(f, p, t1, t2, trace_axes=(), implementation="structured")
    assert plan.leaves[0].method.startswith("structured (2 embedding gathers"), plan.leaves[0]


@frameworks.requires("haiku")
def test_haiku_conv_nchw_and_embed_are_structured():
    """Haiku's NCHW Conv2D (bias (K, 1, 1)) and Embed, against the reference."""
    import haiku as hk

    def image_net(x):
        h = jax.nn.relu(hk.Conv2D(3, 2, stride=2, data_format="NCHW")(x))
        return hk.Linear(2)(h.reshape(h.shape[0], -1))

    def token_net(t):
        return hk.Linear(2)(jnp.tanh(hk.Embed(9, 4)(t)).reshape(t.shape[0], -1))

    cases = [
        (image_net, jax.random.normal(jax.random.PRNGKey(1), (3, 2, 5, 4))),
        (token_net, jax.random.randint(jax.random.PRNGKey(1), (3, 3), 0, 9)),
    ]
    for net, x in cases:
        model = hk.without_apply_rng(hk.transform(net))
        p = model.init(jax.random.PRNGKey(0), x)
        k = ntk_core.empirical_ntk(model.apply, p, x, trace_axes=(), implementation="structured")
        reference.assert_close(k, reference.ntk(model.apply, p, x, None, trace_axes=())[0])
        plan = ntk_core.plan(model.apply, p, x, trace_axes=(), implementation="structured")
        assert all(leaf.method.startswith("structured") for leaf in plan.leaves), str(plan)
        assert any(
            "convolution" in leaf.method or "embedding gather" in leaf.method
            for leaf in plan.leaves
        )


# -- elementwise scales and shifts (LayerNorm / BatchNorm scale and bias) -----------------


def scale_shift(p, x):
    """The plain-JAX ``x * s + b``."""
    return jnp.tanh(x * p[0] + p[1]) @ p[2]


def transposed_views(p, x):
    """``view(s) * x`` with s seen as a transposed (2, 2) matrix (the units hold the
    leaf's entries in another order), then ``h - view(b)`` (a shift with a minus sign)."""
    h = p[0].reshape(2, 2).T * x.reshape(x.shape[0], 2, 2)
    h = h - p[1].reshape(2, 2)
    return jnp.tanh(h).reshape(x.shape[0], 4) @ p[2]


def factor_before_input(p, x):
    """LayerNorm's order over 2 positions of 4 units: the scale first meets the
    input-dependent factor rsqrt(var + eps), then the centred input."""
    xs = x.reshape(x.shape[0], 2, 4)
    mean = xs.mean(-1, keepdims=True)
    var = jnp.square(xs - mean).mean(-1, keepdims=True)
    h = (xs - mean) * (jax.lax.rsqrt(var + 1e-3) * p[0]) + p[1]
    return jnp.tanh(h).mean(axis=1) @ p[2]


def constant_factor(p, x):
    """A literal times the scale (a scale whose input is a constant), then the input."""
    return jnp.tanh(x * (2.0 * p[0]) + p[1]) @ p[2]


def shift_then_scale(p, x):
    """``(view(b) - x) * s``: the bias on the left of a subtraction, before the scale."""
    return jnp.tanh((p[1] - x) * p[0]) @ p[2]


def tied_elementwise(p, x):
    """One leaf used as two scales (through different views) and a shift: the
    per-use Jacobians, all in the leaf's order, are summed."""
    h = jnp.tanh(x * p[0])
    return jnp.tanh(h * p[0].reshape(1, 4) + p[0] + p[1]) @ p[2]


def scale_and_product(p, x):
    """s as an elementwise scale and as the weight of a product: fallback."""
    return jnp.tanh(x * p[0] + p[1]) @ p[2] + (x @ p[0])[:, None]


def square_of_scale(p, x):
    """``x * (s * s)``: a product of two parameter views, fallback."""
    return jnp.tanh(x * (p[0] * p[0]) + p[1]) @ p[2]


def repeated_over_units(p, x):
    """s tiled twice along the units (broadcast, then merged by a reshape): each entry
    appears twice per row, fallback."""
    h = x * jnp.broadcast_to(p[0], (2, 4)).reshape(8)
    return jnp.tanh(h.reshape(x.shape[0], 2, 4).mean(axis=1) + p[1]) @ p[2]


ELEMENTWISE_MODELS = {
    # name: (model, input size, plan labels of (s, b, W))
    "scale_shift": (scale_shift, 4, [SCALE, SHIFT, "structured (1 matrix product"]),
    "transposed_views": (transposed_views, 4, [SCALE, SHIFT, "structured"]),
    "factor_before_input": (factor_before_input, 8, [SCALE, SHIFT, "structured"]),
    "constant_factor": (constant_factor, 4, [SCALE, SHIFT, "structured"]),
    "shift_then_scale": (shift_then_scale, 4, [SCALE, SHIFT, "structured"]),
    "tied_elementwise": (
        tied_elementwise,
        4,
        [
            "structured (2 elementwise scales and elementwise shift, per-sample Jacobian)",
            SHIFT,
            "structured",
        ],
    ),
    "scale_and_product": (
        scale_and_product,
        4,
        [f"{FB}used by an elementwise scale (at {HERE}:", SHIFT, "structured"],
    ),
    "square_of_scale": (
        square_of_scale,
        4,
        [f"{FB}a mul of two parameter views", SHIFT, "structured"],
    ),
    "repeated_over_units": (
        repeated_over_units,
        8,
        [
            f"{FB}an elementwise mul whose broadcast repeats or drops parameter entries; at {HERE}:",
            SHIFT,
            "structured",
        ],
    ),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE_MODELS))
def test_elementwise_rules_match_reference_and_plan(name):
    """Exact labels, so that a silent fallback (or a wrong match) fails."""
    f, d, methods = ELEMENTWISE_MODELS[name]
    p = _params((4,), (4,), (4, 3), seed=11)
    p[0] = p[0] + 1.5  # scales away from 0
    x1 = jax.random.normal(jax.random.PRNGKey(1), (3, d))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (2, d))
    k = ntk_core.empirical_ntk(f, p, x1, x2, trace_axes=(), implementation="structured")
    reference.assert_close(k, reference.ntk(f, p, x1, x2, trace_axes=())[0])
    plan = ntk_core.plan(f, p, x1, x2, trace_axes=(), implementation="structured")
    for leaf, expected in zip(plan.leaves, methods, strict=True):
        assert leaf.method.startswith(expected), (leaf.method, expected)
        if "elementwise" in expected and not expected.startswith(FB):  # the whole label
            assert leaf.method == expected


#: Non-trivial running statistics of the evaluation-mode BatchNorms below.
_STATS = {"mean": jnp.linspace(-0.5, 0.5, 4), "var": jnp.linspace(0.5, 2.0, 4)}


def _norm_model(kind):
    """``(apply(params, x), params)`` of a normalisation layer between (N, 3, 4) inputs
    and per-position logits (N, 3, 2), with non-trivial parameters and running
    statistics. ``kind`` is ``"<framework>_<layer>"``: ``jax`` (``core_zoo``'s layers,
    computed as Flax computes them, under Flax's parameter names), ``flax`` or ``haiku``;
    ``layernorm`` or ``batchnorm`` (evaluation mode)."""
    framework, layer = kind.split("_")
    x = jax.random.normal(jax.random.PRNGKey(5), (4, 3, 4))
    if framework == "jax":
        import core_zoo

        name = "LayerNorm_0" if layer == "layernorm" else "BatchNorm_0"

        def f(p, x):
            if layer == "layernorm":
                h = core_zoo.layer_norm(p[name], x)
            else:
                h = core_zoo.batch_norm_eval(p[name], _STATS, x)
            return core_zoo.dense(p["Dense_0"], jnp.tanh(h))  # per position: (N, 3, 2)

        params = {
            name: {"scale": jnp.ones(4), "bias": jnp.zeros(4)},
            "Dense_0": {
                "kernel": jax.random.normal(jax.random.PRNGKey(0), (4, 2)) / 2.0,
                "bias": jnp.zeros(2),
            },
        }
        return f, jax.tree.map(lambda v: v + 0.3, params)  # non-trivial
    if framework == "flax":
        import flax.linen as nn

        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                if layer == "layernorm":
                    h = nn.LayerNorm()(x)
                else:
                    h = nn.BatchNorm(use_running_average=True)(x)
                return nn.Dense(2)(jnp.tanh(h))  # per position: outputs (N, 3, 2)

        model = Net()
        variables = model.init(jax.random.PRNGKey(0), x)
        params = jax.tree.map(lambda v: v + 0.3, variables["params"])  # non-trivial
        rest = {"batch_stats": {"BatchNorm_0": _STATS}} if layer == "batchnorm" else {}
        return (lambda p, x: model.apply({"params": p, **rest}, x)), params
    import haiku as hk

    def net(x, is_training=False):
        if layer == "layernorm":
            h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
        else:
            h = hk.BatchNorm(True, True, 0.5)(x, is_training=is_training)
        return hk.Linear(2)(jnp.tanh(h))

    model = hk.without_apply_rng(hk.transform_with_state(net))
    params, state = model.init(jax.random.PRNGKey(0), x, is_training=True)
    params = jax.tree.map(lambda v: v + 0.3, params)
    _, state = model.apply(params, state, 3.0 * x + 1.0, is_training=True)  # running stats
    return (lambda p, x: model.apply(p, state, x)[0]), params


@pytest.mark.parametrize(
    "kind",
    [
        "jax_batchnorm",
        pytest.param("flax_batchnorm", marks=frameworks.requires("flax")),
        pytest.param("haiku_layernorm", marks=frameworks.requires("haiku")),
        pytest.param("haiku_batchnorm", marks=frameworks.requires("haiku")),
    ],
)  # LayerNorm in plain JAX and Flax: test_layernorm_all_axes_and_per_leaf
def test_norm_layers_are_elementwise_scales_and_shifts(kind):
    f, p = _norm_model(kind)
    x1 = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 4))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 4))
    k = ntk_core.empirical_ntk(f, p, x1, x2, implementation="structured")
    reference.assert_close(k, reference.ntk(f, p, x1, x2)[0])
    plan = ntk_core.plan(f, p, x1, x2, implementation="structured")
    methods = {leaf.path: leaf.method for leaf in plan.leaves}
    norm = {path: m for path, m in methods.items() if "Norm" in path or "norm" in path}
    assert len(norm) == 2, methods
    for path, method in norm.items():
        assert method == (SCALE if "scale" in path else SHIFT), (path, method)
    assert all(m.startswith("structured") for m in methods.values()), methods


_AXES = [
    dict(trace_axes=(-1,)),
    dict(trace_axes=()),
    dict(trace_axes=(), diagonal_axes=(-1,)),
    dict(trace_axes=(-1,), diagonal_axes=(0,)),
]


@pytest.mark.parametrize(
    "kind", ["jax_layernorm", pytest.param("flax_layernorm", marks=frameworks.requires("flax"))]
)
def test_layernorm_all_axes_and_per_leaf(kind):
    """LayerNorm (Flax's, and the plain-JAX one computed the same way) between two
    output axes: every axes setting, and the per-leaf kernels of the scale and bias
    (bias fusion off there: Dense biases become shifts)."""
    f, p = _norm_model(kind)
    x1 = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 4))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 4))
    full = reference.full_ntk(f, p, x1, x2)[0]
    full_same = reference.full_ntk(f, p, x1, None)[0]
    for axes in _AXES:
        batch_diag = 0 in axes.get("diagonal_axes", ())
        k = ntk_core.empirical_ntk(
            f, p, x1, None if batch_diag else x2, implementation="structured", **axes
        )
        expected = reference.reduce_full(
            full_same if batch_diag else full, axes["trace_axes"], axes.get("diagonal_axes", ())
        )
        reference.assert_close(k, expected)
    per_leaf = ntk_core.empirical_ntk_per_leaf(f, p, x1, x2, implementation="structured")
    leaves, treedef = jax.tree.flatten(p)
    kernels = jax.tree.leaves(per_leaf)
    reference.assert_close(sum(kernels), reference.ntk(f, p, x1, x2)[0])
    for i in (2, 3):  # LayerNorm bias and scale
        leaf = leaves[i]

        def f_leaf(v, x, i=i):
            return f(jax.tree.unflatten(treedef, leaves[:i] + [v] + leaves[i + 1 :]), x)

        reference.assert_close(kernels[i], reference.ntk(f_leaf, leaf, x1, x2)[0])
    plan = ntk_core.plan(f, p, x1, x2, implementation="structured")
    assert sorted(leaf.method for leaf in plan.leaves if "LayerNorm" in leaf.path) == [
        SCALE,
        SHIFT,
    ]


@pytest.mark.parametrize(
    "framework", ["jax", pytest.param("flax", marks=frameworks.requires("flax"))]
)
def test_batchnorm_training_mode_is_differentiated_whole_batch(framework):
    """Training-mode BatchNorm couples the samples: with vmap_axes=None there is no
    per-sample structure, so "structured" runs the Jacobian contraction (exact)."""
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 3))
    if framework == "jax":
        import core_zoo

        def f(p, x):
            return jnp.tanh(core_zoo.batch_norm_train(p, x))

        params = {"scale": jnp.ones(3) + 0.3, "bias": jnp.zeros(3) + 0.3}
    else:
        import flax.linen as nn

        model = nn.BatchNorm(use_running_average=False)
        variables = model.init(jax.random.PRNGKey(0), x)

        def f(p, x):
            out, _ = model.apply({**variables, "params": p}, x, mutable=["batch_stats"])
            return jnp.tanh(out)

        params = jax.tree.map(lambda v: v + 0.3, variables["params"])
    k = ntk_core.empirical_ntk(f, params, x, implementation="structured", vmap_axes=None)
    reference.assert_close(k, reference.ntk(f, params, x, None)[0])
    plan = ntk_core.plan(f, params, x, implementation="structured", vmap_axes=None)
    assert plan.implementation == "jacobian"
    assert "implementation='structured' with vmap_axes=None" in str(plan)


def test_narrow_jacobians_merged_into_one_contraction():
    """The kernel (not split per leaf) contracts the narrow per-leaf Jacobians as one
    concatenated matrix and keeps a wide one apart, per dtype; the merged kernel
    matches the reference (and the per-leaf sums, see the per-leaf test above)."""
    from ntk_core._impl import jacobian as _jacobian

    assert _jacobian.merge_groups([3, 5000, 4, 2], ["float32"] * 3 + ["bfloat16"], 100) == [
        [0, 2],
        [3],
        [1],
    ]
    p = _params((20, 40), (40,), (40, 3))  # leaves of 800, 40 and 120 weights
    x1 = jax.random.normal(jax.random.PRNGKey(1), (16, 20))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (17, 20))
    # N = 16, O = 3 outputs, O' = 9 kernel values per pair (trace_axes=()).
    assert 120 <= _jacobian.merge_limit(16, 3, 9) < 800
    fn = ntk_core.ntk_fn(mlp, trace_axes=(), implementation="jacobian")
    engine = fn._engine
    feats = engine.implementation(engine.prepare(p, x1, x2)[1]).features(p, x1, None)
    assert [m.shape[-1] for m in feats[0]] == [40 + 120, 800]
    reference.assert_close(fn(p, x1, x2), reference.ntk(mlp, p, x1, x2, trace_axes=())[0])


@pytest.mark.parametrize(
    "a_spec, b_spec, out, sizes",
    [
        ("nk", "mk", "nm", {}),  # plain Gram
        ("nak", "mbk", "nm", {"a": 1, "b": 1}),  # size-1 position axes summed away
        ("nock", "mpck", "nmop", {"o": 3, "p": 3, "c": 1}),  # trace_axes=(): rows N*O
        ("nock", "mock", "nm", {"o": 3, "c": 2}),  # traced output axis contracted
        ("nok", "mok", "nmo", {"o": 3}),  # diagonal output axis: a batched product
        ("nok", "npk", "nop", {"o": 2, "p": 2}),  # batch diagonal (one sample letter)
        ("nakc", "mbkc", "mn", {"a": 2, "b": 2}),  # axes summed apart, output swapped
        ("nnk", "mk", "nm", {}),  # a letter repeated in one operand: its diagonal
    ],
)
def test_pair_einsum_equals_einsum(a_spec, b_spec, out, sizes):
    """The two-operand contraction every Gram and Jacobian term goes through, as one
    2-D matrix product, equals numpy's float64 einsum for each kind of axis."""
    from ntk_core._impl import jacobian as _jacobian

    sizes = {"n": 5, "m": 4, "k": 7, "c": 3} | sizes
    rng = np.random.default_rng(0)
    a = rng.standard_normal([sizes[s] for s in a_spec]).astype(np.float32)
    b = rng.standard_normal([sizes[s] for s in b_spec]).astype(np.float32)
    got = _jacobian.pair_einsum(a_spec, b_spec, out, jnp.asarray(a), jnp.asarray(b), "highest")
    expected = np.einsum(f"{a_spec},{b_spec}->{out}", a.astype(np.float64), b.astype(np.float64))
    assert got.dtype == jnp.float32 and got.shape == expected.shape
    reference.assert_close(got, expected)


def test_features_in_chunks_match_reference_directly_and_under_jit(monkeypatch):
    """With a feature budget of a few samples, the structured features are computed in
    chunks inside an XLA loop (the last one overlapping its predecessor, N = 7 not a
    multiple of the chunk), directly and under an outer ``jax.jit``; the convolutions'
    reverse passes run through the canonical-kernel transpose. Both match the float64
    reference, for x2=None and a second input."""
    from ntk_core._structured import analysis as _structured

    f, x_shape, shapes, _ = CONV_MODELS["twice"]
    p = _params(*shapes, seed=3)
    x1 = jax.random.normal(jax.random.PRNGKey(1), (7, *x_shape))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (5, *x_shape))
    fn = ntk_core.ntk_fn(f, trace_axes=(), implementation="structured")
    kf = fn._engine
    one = jax.ShapeDtypeStruct(x_shape, x1.dtype)
    analysis, closed = _structured.analysis_for(kf.spec.apply3, p, one, None, precision="highest")
    per_sample = 4 * (2 + 2) * values_written(closed.jaxpr)
    monkeypatch.setattr(_structured, "FEATURE_CHUNK_BYTES", 3 * per_sample)
    cases = [(fn(p, x1), None), (jax.jit(fn)(p, x1, x2), x2)]
    chunks = set(kf._chunks.values())
    assert chunks and max(chunks) < 5, chunks  # every call really ran in chunks
    for k, second in cases:
        reference.assert_close(k, reference.ntk(f, p, x1, second, trace_axes=())[0])


def test_kernel_differentiable_through_structured_convolutions(monkeypatch):
    """The convolutions' reverse passes run through a custom JVP rule (canonical kernel
    layout); the kernel stays differentiable with respect to the parameters, in reverse
    and forward mode, in chunks: the gradient of a weighted sum of the NTK equals that
    of the Jacobian contraction (plain JAX autodiff through no custom rule), and the
    forward-mode derivative along a direction equals the gradient's projection."""
    from ntk_core._structured import analysis as _structured

    f, x_shape, shapes, _ = CONV_MODELS["nchw_dilated"]
    p = _params(*shapes, seed=3)
    x = jax.random.normal(jax.random.PRNGKey(1), (5, *x_shape))
    monkeypatch.setattr(_structured, "FEATURE_CHUNK_BYTES", 1)  # one sample per chunk

    weights = jax.random.normal(jax.random.PRNGKey(4), (5, 5, 2, 2))

    def loss(impl):
        fn = ntk_core.ntk_fn(f, trace_axes=(), implementation=impl)
        return lambda q: jnp.vdot(weights, fn(q, x))

    grads = {impl: jax.grad(loss(impl))(p) for impl in ("structured", "jacobian")}
    pairs = zip(
        jax.tree.leaves(grads["structured"]), jax.tree.leaves(grads["jacobian"]), strict=True
    )
    for a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))
    # Forward mode along one direction, against the reverse-mode gradient.
    direction = jax.tree.map(lambda v: jnp.ones_like(v) / v.size, p)
    _, tangent = jax.jvp(loss("structured"), (p,), (direction,))
    expected = sum(
        float(jnp.vdot(g, d))
        for g, d in zip(jax.tree.leaves(grads["jacobian"]), jax.tree.leaves(direction), strict=True)
    )
    np.testing.assert_allclose(float(tangent), expected, rtol=2e-4)


# -- the rule registry (ntk_core._structured.rules) -----------------------------------------------------
def test_every_registered_rule_has_the_interface():
    """Each rule of the registry is a Rule with its own primitives (no two rules claim
    one: the later would never be asked), plan() names for its kinds, and the rule
    methods the analysis, the features and the pairwise part call."""
    from ntk_core._structured import rules as _rules

    claimed: dict = {}
    for rule in _rules.REGISTRY:
        assert isinstance(rule, _rules.Rule), rule
        assert isinstance(rule.primitives, frozenset) and rule.primitives, rule
        for primitive in rule.primitives:
            assert primitive not in claimed, (primitive, rule, claimed[primitive])
            claimed[primitive] = rule
            assert _rules.rule_for(primitive) is rule
        assert rule.kind_names and all(
            isinstance(k, str) and isinstance(n, str) and n for k, n in rule.kind_names.items()
        ), rule
        for method in (
            "match",
            "miss_reason",
            "bias_target",
            "probe",
            "evaluate",
            "input_features",
            "jacobian_input",
            "jacobian",
            "x_spec",
            "gram_input_width",
            "bias_in_gram",
            "gram_term",
            "label",
        ):
            assert callable(getattr(rule, method)), (rule, method)
        assert not getattr(type(rule), "__abstractmethods__", None), rule
    assert _rules.rule_for(jax.lax.tanh_p) is None


def test_toy_rule_in_a_temporary_registry_is_picked_up(monkeypatch):
    """A rule placed first in a temporary registry takes the uses of its primitive:
    the analysis records it on each use, the features and the pairwise part call it,
    its label names the leaf, and the kernel still matches the reference."""
    from ntk_core._structured import analysis as _structured
    from ntk_core._structured import rules as _rules
    from ntk_core._structured.rules.dot import DotRule

    calls = {"match": 0, "gram_term": 0}

    class ToyProduct(DotRule):
        kind_names = {"toy": "toy product"}

        def match(self, eqn, ins, here, leaf_shapes):
            calls["match"] += 1
            use = super().match(eqn, ins, here, leaf_shapes)
            return None if use is None else dataclasses.replace(use, kind="toy")

        def gram_term(self, *args):
            calls["gram_term"] += 1
            return super().gram_term(*args)

    toy = ToyProduct()
    monkeypatch.setattr(_rules, "REGISTRY", (toy,) + _rules.REGISTRY)

    def toy_model(p, x):  # a function of its own: no compilation of another test reused
        return jnp.tanh(x @ p[0] + p[1]) @ p[2]

    p = _params((4, 4), (4,), (4, 3))
    x1 = jax.random.normal(jax.random.PRNGKey(1), (3, 4))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (2, 4))
    one = jax.ShapeDtypeStruct((4,), x1.dtype)
    apply3 = lambda q, x, aux: toy_model(q, x)  # noqa: E731
    analysis, _ = _structured.analysis_for(apply3, p, one, None, precision="highest")
    assert [(u.rule, u.kind) for u in analysis.uses] == [(toy, "toy"), (toy, "toy")]
    modes = _structured.choose_modes(analysis, 9, 3)
    assert _structured.method_labels(analysis, modes) == {
        0: "structured (1 toy product)",
        1: "structured (bias fused with its toy product)",
        2: "structured (1 toy product)",
    }
    k = ntk_core.empirical_ntk(toy_model, p, x1, x2, trace_axes=(), implementation="structured")
    reference.assert_close(k, reference.ntk(toy_model, p, x1, x2, trace_axes=())[0])
    assert calls["match"] >= 2 and calls["gram_term"] >= 2, calls


@pytest.mark.parametrize(
    "f, shapes, d",
    [
        (mlp, ((4, 4), (4,), (4, 3)), 4),
        (product_read_twice, ((4, 4), (4,), (4, 3)), 4),
        (seq_dense_bias, ((2, 4), (4,), (4, 3)), 4),
        (scale_shift, ((4,), (4,), (4, 3)), 4),
    ],
)
def test_method_labels_are_the_plan_labels(f, shapes, d):
    """The rules' labels (``_structured.method_labels``) are what plan() shows."""
    from ntk_core._structured import analysis as _structured

    p = _params(*shapes, seed=2)
    x = jax.random.normal(jax.random.PRNGKey(1), (3, d))
    one = jax.ShapeDtypeStruct((d,), x.dtype)
    analysis, _ = _structured.analysis_for(
        lambda q, v, aux: f(q, v), p, one, None, precision="highest"
    )
    labels = _structured.method_labels(analysis, _structured.choose_modes(analysis, 9, 3))
    plan = ntk_core.plan(f, p, x, trace_axes=(), implementation="structured")
    assert [leaf.method for leaf in plan.leaves] == [
        labels.get(i, "jacobian (fallback)") for i in range(len(p))
    ]
