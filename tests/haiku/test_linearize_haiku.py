"""ntk_haiku.linearize / ntk_haiku.taylor_expand: an MLP (hk.transform, with and without
apply rng) and a BatchNorm model (hk.transform_with_state, evaluation mode) against the
model at the expansion point and ntk_core's expansion of the equivalent pure function
elsewhere; the adapter's documented errors."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
import ntk_haiku

X = jax.random.normal(jax.random.PRNGKey(0), (4, 3))


def _close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-6)


def _shift(tree, seed, scale=0.5):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    moved = [a + scale * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, moved)


def _expand(degree, transformed, params0, **kwargs):
    if degree == 1:
        return ntk_haiku.linearize(transformed, params0, **kwargs)
    return ntk_haiku.taylor_expand(transformed, params0, degree, **kwargs)


def mlp(x):
    return hk.Linear(2)(jnp.tanh(hk.Linear(8)(x)))


def bn_net(x, is_training):
    h = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.5)(
        hk.Linear(8)(x), is_training
    )
    return hk.Linear(2)(jnp.tanh(h))


MLP = hk.transform(mlp)
PARAMS = MLP.init(jax.random.PRNGKey(1), X)


@pytest.mark.parametrize("degree", [1, 2])
@pytest.mark.parametrize("without_rng", [False, True], ids=["transform", "without_apply_rng"])
def test_mlp(without_rng, degree):
    net = hk.without_apply_rng(MLP) if without_rng else MLP

    def pure(p, x):
        return net.apply(p, x) if without_rng else net.apply(p, None, x)

    f = _expand(degree, net, PARAMS)
    _close(f(PARAMS, X), pure(PARAMS, X))
    params = _shift(PARAMS, 2)
    expected = ntk_core.taylor_expand(pure, PARAMS, degree)(params, X)
    _close(f(params, X), expected)
    assert not np.allclose(expected, pure(params, X))
    grads = jax.jit(jax.grad(lambda p: jnp.sum(f(p, X) ** 2)))(params)
    core = ntk_core.taylor_expand(pure, PARAMS, degree)
    reference = jax.grad(lambda p: jnp.sum(core(p, X) ** 2))(params)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True):
        _close(a, b)


def test_transform_with_state_batchnorm_in_evaluation_mode():
    net = hk.transform_with_state(bn_net)
    params, state = net.init(jax.random.PRNGKey(3), X, is_training=True)
    _, state = net.apply(params, state, None, 3.0 * X + 1.0, is_training=True)  # statistics
    f_lin = ntk_haiku.linearize(net, params, state=state, apply_kwargs={"is_training": False})

    def pure(p, x):
        return net.apply(p, state, None, x, is_training=False)[0]

    _close(f_lin(params, X), pure(params, X))
    shifted = _shift(params, 4)
    _close(f_lin(shifted, X), ntk_core.linearize(pure, params)(shifted, X))


NET = hk.without_apply_rng(MLP)
STATEFUL = hk.transform_with_state(bn_net)
F_LIN = ntk_haiku.linearize(NET, PARAMS)

ERRORS = [
    (lambda: ntk_haiku.linearize(mlp, PARAMS), TypeError, r"^ntk_haiku.linearize: expected an hk.Transformed or hk.TransformedWithState, got function\. Fix: wrap"),
    (lambda: ntk_haiku.linearize(STATEFUL, PARAMS), ValueError, r"^ntk_haiku.linearize: this hk.TransformedWithState needs its state\. Fix: pass state=state"),
    (lambda: ntk_haiku.linearize(STATEFUL, PARAMS, state=[1]), TypeError, r"^ntk_haiku.linearize: state must be the mapping returned by transformed.init\(key, x\) .* got list"),
    (lambda: ntk_haiku.linearize(NET, PARAMS, state={}), ValueError, r"^ntk_haiku.linearize: state was given but the model is a plain hk.Transformed"),
    (lambda: ntk_haiku.linearize(NET, PARAMS, rng=jax.random.PRNGKey(0)), ValueError, r"^ntk_haiku.linearize: rng was given but the model was built with hk.without_apply_rng"),
    (lambda: ntk_haiku.linearize(NET, [1.0]), TypeError, r"^ntk_haiku.linearize: params0 must be the dict returned by transformed.init, got list\. Fix:"),
    (lambda: ntk_haiku.linearize(NET, PARAMS, apply_kwargs=3), TypeError, r"^ntk_haiku.linearize: apply_kwargs must be a dict"),
    (lambda: ntk_haiku.taylor_expand(NET, PARAMS, "2"), TypeError, r"^ntk_haiku.taylor_expand: degree must be an int in \[0, 10\], got '2' \(str\)"),
    (lambda: F_LIN({"linear": PARAMS["linear"]}, X), ValueError, r"^ntk_haiku.linearize: params does not have the tree structure of the expansion point \(params0\) .*missing \[\['linear_1'\]\['b'\]"),
    (lambda: F_LIN({**PARAMS, "linear_1": {"w": jnp.ones((5, 8)), "b": jnp.zeros(8)}}, X), ValueError, r"^ntk_haiku.linearize: params\['linear_1'\]\['w'\] has shape \(5, 8\), but the expansion point \(params0\) has shape \(3, 8\) there"),
    (lambda: ntk_core.linearize(MLP, PARAMS), TypeError, r"^linearize: apply_fn is the model Transformed.* Fix: use ntk_haiku.linearize"),
]  # fmt: skip


@pytest.mark.parametrize("call, error, pattern", ERRORS, ids=range(len(ERRORS)))
def test_documented_errors(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()
