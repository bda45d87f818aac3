"""ntk_flax.linearize / ntk_flax.taylor_expand: linen models (an MLP, and one with
BatchNorm in evaluation mode) and nnx modules against the model itself at the expansion
point and against ntk_core's expansion of the equivalent pure function elsewhere; the
adapters' documented errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ntk_core
import ntk_flax

X = jax.random.normal(jax.random.PRNGKey(0), (4, 3))


def _close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-6)


def _shift(tree, seed, scale=0.5):
    """``tree`` with independent normal noise added to every leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    moved = [a + scale * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, moved)


def _expand(degree, model, variables=None):
    if degree == 1:
        return ntk_flax.linearize(model, variables)
    return ntk_flax.taylor_expand(model, variables, degree)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(jnp.tanh(nn.Dense(8)(x)))


class BatchNormMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(8)(x))
        return nn.Dense(2)(jnp.tanh(h))


class NNXMLP(nnx.Module):
    def __init__(self, rngs, batch_norm=False):
        self.l1 = nnx.Linear(3, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.5, rngs=rngs) if batch_norm else None
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        h = self.l1(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.l2(jnp.tanh(h))


LINEN = MLP()
LINEN_VARIABLES = LINEN.init(jax.random.PRNGKey(1), X)


@pytest.mark.parametrize("degree", [1, 2])
def test_linen_mlp(degree):
    model, variables = LINEN, LINEN_VARIABLES
    f = _expand(degree, model, variables)
    _close(f(variables, X), model.apply(variables, X))  # the model at the expansion point
    params = _shift(variables["params"], 2)

    def pure(p, x):
        return model.apply({"params": p}, x)

    core = ntk_core.taylor_expand(pure, variables["params"], degree)
    _close(f({"params": params}, X), core(params, X))
    assert not np.allclose(f({"params": params}, X), model.apply({"params": params}, X))
    if degree > 1:
        return
    # pure: through jax.jit and jax.grad (training the linearised model)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(f({"params": p}, X) ** 2)))(params)
    expected = jax.grad(lambda p: jnp.sum(core(p, X) ** 2))(params)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        _close(a, b)


def test_linen_batchnorm_in_evaluation_mode_holds_the_statistics_fixed():
    model = BatchNormMLP()
    variables = model.init(jax.random.PRNGKey(3), X)
    _, updates = model.apply(variables, 3.0 * X + 1.0, train=True, mutable=["batch_stats"])
    variables = {**variables, **updates}  # non-trivial running statistics
    f_lin = ntk_flax.linearize(model, variables, apply_kwargs={"train": False})
    _close(f_lin(variables, X), model.apply(variables, X, train=False))
    stats = variables["batch_stats"]

    def pure(p, x):
        return model.apply({"params": p, "batch_stats": stats}, x, train=False)

    params = _shift(variables["params"], 4)
    expected = ntk_core.linearize(pure, variables["params"])(params, X)
    _close(f_lin({"params": params}, X), expected)
    zeroed = jax.tree.map(jnp.zeros_like, stats)  # call-time statistics are not read
    _close(f_lin({"params": params, "batch_stats": zeroed}, X), expected)


@pytest.mark.parametrize("batch_norm", [False, True], ids=["mlp", "batchnorm_eval"])
@pytest.mark.parametrize("degree", [1, 2])
def test_nnx_module(degree, batch_norm):
    model = NNXMLP(nnx.Rngs(5), batch_norm=batch_norm)
    if batch_norm:  # non-trivial statistics, then evaluation mode
        model.bn.mean[...] = jax.random.normal(jax.random.PRNGKey(6), (8,))
        model.bn.var[...] = 0.5 + jax.random.uniform(jax.random.PRNGKey(7), (8,))
        model.eval()
    before = model(X)
    f = _expand(degree, model)
    state0 = jax.tree.map(lambda a: a, nnx.state(model, nnx.Param))  # a copy
    _close(f(state0, X), before)
    _close(f(model, X), before)  # a module: its nnx.Param state is read

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # the documented recipe

    def pure(p, x):
        return nnx.merge(graphdef, p, rest)(x)

    shifted = _shift(state0, 8)
    expected = ntk_core.taylor_expand(pure, params, degree)(shifted, X)
    _close(f(shifted, X), expected)
    nnx.update(model, shifted)  # an in-place update does not move the expansion point
    _close(f(state0, X), before)
    _close(f(model, X), expected)
    # another expansion point, given as variables
    moved = _expand(degree, model, shifted)
    _close(moved(shifted, X), model(X))


def test_nnx_train_the_linearised_state_with_jit_and_grad():
    model = NNXMLP(nnx.Rngs(9))
    f_lin = ntk_flax.linearize(model)
    state = nnx.state(model, nnx.Param)
    grads = jax.jit(jax.grad(lambda s: jnp.sum(f_lin(s, X) ** 2)))(state)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    core = ntk_core.linearize(lambda p, x: nnx.merge(graphdef, p, rest)(x), params)
    expected = jax.grad(lambda s: jnp.sum(core(s, X) ** 2))(state)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        _close(a, b)


NNX_MODEL = NNXMLP(nnx.Rngs(10))
F_LIN = ntk_flax.linearize(LINEN, LINEN_VARIABLES)
BAD_SHAPE = {
    "params": {
        **LINEN_VARIABLES["params"],
        "Dense_1": {"kernel": jnp.ones((5, 8)), "bias": jnp.zeros(8)},  # the (3, 8) layer
    }
}

ERRORS = [
    (lambda: ntk_flax.linearize(object(), {}), TypeError, r"^ntk_flax.linearize: model must be a flax.linen.Module or a flax.nnx.Module, got object\. Fix:.*ntk_core.linearize"),
    (lambda: ntk_flax.linearize(LINEN), ValueError, r"^ntk_flax.linearize: variables is None, but a flax.linen module holds no parameters\. Fix:"),
    (lambda: ntk_flax.linearize(LINEN, [1.0]), TypeError, r"^ntk_flax.linearize: variables must be the dict model.init returns, with a 'params' collection, got list\. Fix:"),
    (lambda: ntk_flax.linearize(LINEN, LINEN_VARIABLES["params"]), ValueError, r"^ntk_flax.linearize: variables must be the dict model.init returns, with a 'params' collection, got \['Dense_0', 'Dense_1'\]\. Fix:"),
    (lambda: ntk_flax.linearize(LINEN, LINEN_VARIABLES, apply_kwargs={"mutable": True}), TypeError, r"^ntk_flax.linearize: apply_kwargs holds 'mutable', an argument of model.apply .* Fix: drop it"),
    (lambda: ntk_flax.linearize(LINEN, LINEN_VARIABLES, apply_kwargs={"method": "f"}), TypeError, r"^ntk_flax.linearize: apply_kwargs holds 'method'.* Fix: drop it and pass method= to ntk_flax.linearize itself"),
    (lambda: ntk_flax.linearize(LINEN, LINEN_VARIABLES, apply_kwargs="train"), TypeError, r"^ntk_flax.linearize: apply_kwargs must be a dict"),
    (lambda: ntk_flax.taylor_expand(LINEN, LINEN_VARIABLES, 2.0), TypeError, r"^ntk_flax.taylor_expand: degree must be an int in \[0, 10\], got 2\.0"),
    (lambda: ntk_flax.taylor_expand(LINEN, LINEN_VARIABLES, -2), ValueError, r"^ntk_flax.taylor_expand: degree must be an int in \[0, 10\], got -2"),
    (lambda: F_LIN({"params": {"Dense_0": LINEN_VARIABLES["params"]["Dense_0"]}}, X), ValueError, r"^ntk_flax.linearize: variables\['params'\] does not have the tree structure of the expansion point \(the variables given to ntk_flax.linearize\) .*missing \[\['Dense_1'\]\['bias'\]"),
    (lambda: F_LIN(BAD_SHAPE, X), ValueError, r"^ntk_flax.linearize: variables\['params'\]\['Dense_1'\]\['kernel'\] has shape \(5, 8\), but the expansion point \(the variables given to ntk_flax.linearize\) has shape \(3, 8\) there"),
    (lambda: F_LIN(LINEN_VARIABLES["params"], X), ValueError, r"^ntk_flax.linearize: variables must be the dict model.init returns, with a 'params' collection"),
    (lambda: ntk_flax.linearize(NNX_MODEL, {"a": jnp.ones(3)}), ValueError, r"^ntk_flax.linearize: variables does not have the tree structure of the expansion point \(the module's nnx.Param state\)"),
    (lambda: ntk_flax.linearize(NNX_MODEL, method="features"), TypeError, r"^ntk_flax.linearize: method must name a method of the nnx module NNXMLP, got 'features'"),
    (lambda: ntk_flax.linearize(NNX_MODEL)({"a": jnp.ones(3)}, X), ValueError, r"^ntk_flax.linearize: params does not have the tree structure of the expansion point \(the module's nnx.Param state when ntk_flax.linearize was called\)"),
    (lambda: ntk_core.linearize(LINEN, LINEN_VARIABLES), TypeError, r"^linearize: apply_fn is the model MLP.* Fix: use ntk_flax.linearize"),
    (lambda: ntk_core.taylor_expand(NNX_MODEL, None, 2), TypeError, r"^taylor_expand: apply_fn is the model NNXMLP.* ntk_flax.taylor_expand"),
]  # fmt: skip


@pytest.mark.parametrize("call, error, pattern", ERRORS, ids=range(len(ERRORS)))
def test_documented_errors(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()
