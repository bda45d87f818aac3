"""ntk_haiku against the float64 reference, and its documented errors."""

from __future__ import annotations

import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compiles
import ntk_core
import ntk_haiku
import reference

X = jax.random.normal(jax.random.PRNGKey(0), (4, 3))


def mlp(x):
    return hk.Linear(2)(jnp.tanh(hk.Linear(5)(x)))


def bn_net(x, is_training):
    h = hk.Linear(4)(x)
    h = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.5)(h, is_training)
    return hk.Linear(2)(jax.nn.relu(h))


def dropout_net(x):
    return hk.Linear(2)(hk.dropout(hk.next_rng_key(), 0.5, hk.Linear(6)(x)))


@pytest.mark.parametrize("without_rng", [False, True], ids=["transform", "without_apply_rng"])
def test_transformed_matches_reference(without_rng):
    net = hk.transform(mlp)
    params = net.init(jax.random.PRNGKey(1), X)
    if without_rng:
        net = hk.without_apply_rng(net)
        f = net.apply
    else:
        f = lambda p, x: net.apply(p, None, x)  # noqa: E731
    x2 = X[:2] * 2.0
    k = ntk_haiku.kernel(net, params, X, x2, trace_axes=())
    reference.assert_close(k, reference.ntk(f, params, X, x2, trace_axes=())[0])
    g = ntk_haiku.nngp(net, params, X, x2)
    reference.assert_close(g, reference.nngp(f, params, X, x2)[0])


def _bn():
    net = hk.transform_with_state(bn_net)
    params, state = net.init(jax.random.PRNGKey(1), X, True)
    _, state = net.apply(params, state, None, 2.0 * X + 1.0, True)  # non-trivial statistics
    return net, params, state


def test_with_state_eval_mode_matches_reference():
    net, params, state = _bn()

    def f(p, x):
        return net.apply(p, state, None, x, False)[0]

    k = ntk_haiku.kernel(net, params, X, state=state, apply_kwargs={"is_training": False})
    reference.assert_close(k, reference.ntk(f, params, X, None)[0])


def test_kernel_per_leaf_with_state_matches_each_leafs_reference():
    net, params, state = _bn()
    kw = dict(state=state, apply_kwargs={"is_training": False}, trace_axes=())
    x2 = X[:2] * 2.0

    def f(p, x):
        return net.apply(p, state, None, x, False)[0]

    per_leaf = ntk_haiku.kernel_per_leaf(net, params, X, x2, **kw)
    assert jax.tree.structure(per_leaf) == jax.tree.structure(params)
    expected_total = reference.ntk(f, params, X, x2, trace_axes=())[0]
    scale = np.abs(expected_total).max()
    for i, got in enumerate(jax.tree.leaves(per_leaf)):
        g, leaf = reference.leaf_alone(f, params, i)
        reference.assert_close(got, reference.ntk(g, leaf, X, x2, trace_axes=())[0], scale=scale)
    reference.assert_close(
        sum(np.asarray(k, np.float64) for k in jax.tree.leaves(per_leaf)), expected_total
    )
    kernel = ntk_haiku.kernel_per_leaf_fn(net, apply_kwargs={"is_training": False}, trace_axes=())
    again = kernel(params, X, x2, state=state)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(per_leaf), strict=True):
        np.testing.assert_array_equal(a, b)


def test_plan_lists_the_params_leaves_with_their_methods():
    net, params, state = _bn()
    kw = dict(apply_kwargs={"is_training": False}, implementation="structured")
    plan = ntk_haiku.plan(net, params, X, state=state, **kw)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert [leaf.path for leaf in plan.leaves] == paths  # params only, not the state
    assert [leaf.size for leaf in plan.leaves] == [v.size for v in jax.tree.leaves(params)]
    methods = {leaf.path: leaf.method for leaf in plan.leaves}
    assert methods["['linear']['w']"] == "structured (1 matrix product)"
    assert methods["['batch_norm']['scale']"].startswith("structured (elementwise scale")
    kernel = ntk_haiku.kernel_fn(net, **kw)
    assert kernel.plan(params, X, state=state).leaves == plan.leaves
    assert kernel.implementation_for(params, X, state=state) == plan.implementation

    # A parameter inside a nonlinearity: the plan names the fallback and its reason.
    def scaled(x):
        return jnp.tanh(hk.get_parameter("s", [3], init=jnp.ones)) * x

    net = hk.without_apply_rng(hk.transform(scaled))
    (leaf,) = ntk_haiku.plan(net, net.init(None, X), X, implementation="structured").leaves
    assert leaf.path == "['~']['s']"
    assert leaf.method.startswith("jacobian (fallback: used by tanh, which no rule covers; at ")
    line = scaled.__code__.co_firstlineno + 1
    # the function's qualified name where JAX records it (jaxlib >= 0.5), else its name
    assert re.search(rf"; at test_haiku_adapter.py:{line}, in (\S+\.)?scaled\)$", leaf.method)


def test_batchnorm_training_refused_with_vmap_axes_0_and_exact_with_none():
    net, params, state = _bn()
    with pytest.raises(
        ValueError,
        match=r"ntk_haiku.kernel: the model's output for one sample depends on the other samples",
    ):
        ntk_haiku.kernel(net, params, X, state=state, apply_kwargs={"is_training": True})

    def f(p, x):
        return net.apply(p, state, None, x, True)[0]

    k = ntk_haiku.kernel(
        net,
        params,
        X,
        state=state,
        apply_kwargs={"is_training": True},
        vmap_axes=None,
        trace_axes=(),
    )
    reference.assert_close(k, reference.ntk(f, params, X, None, trace_axes=())[0])


def test_rng_for_dropout():
    net = hk.transform(dropout_net)
    params = net.init(jax.random.PRNGKey(1), X)
    with pytest.raises(
        ValueError, match=r"ntk_haiku.kernel: the model needs a random key .* pass rng="
    ):
        ntk_haiku.kernel(net, params, X)
    k = ntk_haiku.kernel(net, params, X, rng=jax.random.PRNGKey(3))
    assert k.shape == (4, 4) and np.isfinite(np.asarray(k)).all()


def test_kernel_fn_reused_without_recompiling():
    calls = []

    def counted(x):
        calls.append(1)
        return mlp(x)

    net = hk.without_apply_rng(hk.transform(counted))
    params = net.init(jax.random.PRNGKey(1), X)
    kernel = ntk_haiku.kernel_fn(net)
    first = kernel(params, X)
    n = len(calls)
    params2 = jax.tree.map(lambda p: p * 1.5, params)
    second = kernel(params2, X)
    assert len(calls) == n
    assert not np.allclose(first, second)


NET = hk.transform(mlp)
PARAMS = NET.init(jax.random.PRNGKey(0), X)
BN_NET, BN_PARAMS, BN_STATE = _bn()

ERRORS = [
    (
        "state missing",
        lambda: ntk_haiku.kernel(BN_NET, BN_PARAMS, X, apply_kwargs={"is_training": False}),
        ValueError,
        r"ntk_haiku.kernel: this hk.TransformedWithState needs its state",
    ),
    (
        "state given to plain transform",
        lambda: ntk_haiku.kernel(NET, PARAMS, X, state={}),
        ValueError,
        r"state was given but the model is a plain hk.Transformed",
    ),
    (
        "rng given to without_apply_rng",
        lambda: ntk_haiku.kernel(hk.without_apply_rng(NET), PARAMS, X, rng=jax.random.PRNGKey(0)),
        ValueError,
        r"built with hk.without_apply_rng and takes none",
    ),
    (
        "not transformed",
        lambda: ntk_haiku.kernel(mlp, PARAMS, X),
        TypeError,
        r"expected an hk.Transformed or hk.TransformedWithState",
    ),
    (
        "params not a dict",
        lambda: ntk_haiku.kernel(NET, [1.0], X),
        TypeError,
        r"params must be the dict returned by transformed.init",
    ),
    (
        "unknown option",
        lambda: ntk_haiku.kernel(NET, PARAMS, X, is_training=False),
        TypeError,
        r"unknown option\(s\) 'is_training'",
    ),
    (
        "wrong input shape",
        lambda: ntk_haiku.kernel(NET, PARAMS, jnp.ones((4, 7))),
        ValueError,
        r"ntk_haiku.kernel: applying the model to x1 failed",
    ),
    (
        "implementation_for with a state for a plain transform",
        lambda: ntk_haiku.kernel_fn(NET).implementation_for(PARAMS, X, state={}),
        ValueError,
        r"^ntk_haiku.kernel_fn: state was given but the model is a plain hk.Transformed",
    ),
    (
        "params of another model (a leaf missing), told by comparing with init",
        lambda: ntk_haiku.kernel(
            hk.transform(dropout_net), {"linear": {"w": PARAMS["linear"]["w"]}}, X
        ),
        ValueError,
        r"^ntk_haiku.kernel: params \(modules \['linear'\]\) lack \['linear'\]\['b'\], \['linear_1'\]",
    ),
    (
        "per-leaf kernel with ntvp",
        lambda: ntk_haiku.kernel_per_leaf(NET, PARAMS, X, implementation="ntvp"),
        ValueError,
        r"^ntk_haiku.kernel_per_leaf: per-leaf kernels need implementation 'jacobian', "
        r"'structured' or 'auto', got 'ntvp'",
    ),
    (
        "bad trace axes",
        lambda: ntk_haiku.kernel(NET, PARAMS, X, trace_axes=(3,)),
        ValueError,
        r"ntk_haiku.kernel: trace_axes contains 3, out of range",
    ),
]


@pytest.mark.parametrize("call, exc, pattern", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_error(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_batch_size_gives_the_one_call_kernel():
    net = hk.without_apply_rng(hk.transform(mlp))
    x1 = jax.random.normal(jax.random.PRNGKey(3), (11, 3))
    x2 = jax.random.normal(jax.random.PRNGKey(4), (7, 3))
    params = net.init(jax.random.PRNGKey(1), x1)
    for fn, ref in ((ntk_haiku.kernel, reference.ntk), (ntk_haiku.nngp, reference.nngp)):
        for x in (x2, None):
            batched = fn(net, params, x1, x, trace_axes=(), batch_size=4)
            one_call = np.asarray(fn(net, params, x1, x, trace_axes=()))
            assert isinstance(batched, np.ndarray) and batched.shape == one_call.shape
            assert np.abs(batched - one_call).max() <= 1e-5 * np.abs(one_call).max()
            reference.assert_close(batched, ref(net.apply, params, x1, x, trace_axes=())[0])
    bn = hk.transform_with_state(bn_net)
    params, state = bn.init(jax.random.PRNGKey(1), x1, True)
    kernel = ntk_haiku.kernel_fn(bn, apply_kwargs={"is_training": False}, batch_size=4)
    expected = ntk_haiku.kernel(
        bn, params, x1, x2, state=state, apply_kwargs={"is_training": False}
    )
    batched = kernel(params, x1, x2, state=state)
    assert np.abs(batched - expected).max() <= 1e-5 * np.abs(expected).max()


def test_out_of_core_kernel_equals_the_in_memory_one(tmp_path):
    """Issue 19: out= and resume= reach the blocked engine through the Haiku adapter."""
    net = hk.without_apply_rng(hk.transform(mlp))
    x1 = jax.random.normal(jax.random.PRNGKey(3), (11, 3))
    params = net.init(jax.random.PRNGKey(1), x1)
    path = str(tmp_path / "k.npy")
    in_memory = ntk_haiku.kernel(net, params, x1, trace_axes=(), batch_size=4)
    written = ntk_haiku.kernel(net, params, x1, trace_axes=(), batch_size=4, out=path)
    assert isinstance(written, np.memmap) and np.array_equal(written, in_memory)
    reference.assert_close(written, reference.ntk(net.apply, params, x1, None, trace_axes=())[0])
    again = ntk_haiku.kernel(net, params, x1, trace_axes=(), batch_size=4, out=path, resume=True)
    assert np.array_equal(again, in_memory)  # finished: returned as it is


COMPILES = compiles.counter()


def test_functions_built_again_with_a_new_key_compile_nothing_new():
    """Issue 48: a seed loop. Each ntk_sketch_fn, kernel_fn and Monte Carlo average built
    again for the same transform (a new key, the same shapes) runs the programs of the
    first one (before: one compile per new function), with the results of the core's
    sketch for the same key and k and of the float64 reference."""
    net = hk.without_apply_rng(hk.transform(mlp))
    params = net.init(jax.random.PRNGKey(1), X)
    keys = jax.random.split(jax.random.PRNGKey(2), 2)

    def run(key):
        return (
            ntk_haiku.ntk_sketch_fn(net, k=16, key=key)(params, X),
            ntk_haiku.kernel_fn(net)(params, X),
            ntk_haiku.monte_carlo_kernels(net, X, key=key, n_samples=2).ntk,
        )

    jax.block_until_ready(run(keys[0]))
    before = len(COMPILES)
    phi, theta, mc = jax.block_until_ready(run(keys[1]))
    assert len(COMPILES) == before
    core = ntk_core.ntk_sketch_fn(net.apply, k=16, key=keys[1])(params, X)
    np.testing.assert_allclose(phi, core, rtol=1e-5, atol=1e-6 * float(np.abs(core).max()))
    reference.assert_close(theta, reference.ntk(net.apply, params, X, None)[0])

    def both(ps, x):  # side by side, no parameter shared: its traced NTK is the mean
        return jnp.concatenate([net.apply(p, x) for p in ps], axis=-1)

    inits = [net.init(k, X[:1]) for k in jax.random.split(keys[1], 2)]
    reference.assert_close(mc, reference.ntk(both, inits, X, None)[0])
