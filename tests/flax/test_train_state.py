"""ntk_flax's linen entry points take what a Flax training loop holds: the variables
dict, a bare params dict (``variables["params"]``, ``state.params``) or a train state;
anything else is refused with the fix."""

from __future__ import annotations

import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import ntk_flax
import reference


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


class BatchNormMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(4)(x))
        return nn.Dense(2)(jnp.tanh(h))


class BatchStatsState(train_state.TrainState):
    """The common TrainState subclass of Flax's BatchNorm examples."""

    batch_stats: Any = None


X1 = jax.random.normal(jax.random.PRNGKey(0), (3, 5))
X2 = jax.random.normal(jax.random.PRNGKey(1), (2, 5))
MODEL = MLP()
VARIABLES = MODEL.init(jax.random.PRNGKey(2), X1)
BN_MODEL = BatchNormMLP()
BN_KW = dict(apply_kwargs={"train": False})


def _bn_variables():
    """Variables with non-trivial running statistics (one training-mode pass)."""
    variables = BN_MODEL.init(jax.random.PRNGKey(3), X1)
    _, updates = BN_MODEL.apply(variables, 3.0 * X1 + 1.0, train=True, mutable=["batch_stats"])
    return {**variables, **updates}


def _state(model, params, cls=train_state.TrainState, **extra):
    return cls.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1), **extra)


def _equal(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _reference(model, variables, x1, x2, **kw):
    rest = {k: v for k, v in variables.items() if k != "params"}

    def f(p, x):
        return model.apply({"params": p, **rest}, x, **kw)

    return reference.ntk(f, variables["params"], x1, x2)[0]


def test_bare_params_and_train_state_give_the_variables_kernel():
    forms = [VARIABLES["params"], _state(MODEL, VARIABLES["params"])]
    for fn in (ntk_flax.kernel, ntk_flax.nngp, ntk_flax.kernel_per_leaf):
        expected = fn(MODEL, VARIABLES, X1, X2)
        for given in forms:
            _equal(fn(MODEL, given, X1, X2), expected)
    plan = ntk_flax.plan(MODEL, VARIABLES, X1, X2)
    kernel = ntk_flax.kernel_fn(MODEL)
    for given in forms:
        assert ntk_flax.plan(MODEL, given, X1, X2).leaves == plan.leaves
        assert kernel.implementation_for(given, X1, X2) == plan.implementation
        _equal(kernel(given, X1, X2), ntk_flax.kernel(MODEL, VARIABLES, X1, X2))
    reference.assert_close(
        ntk_flax.kernel(MODEL, forms[1], X1, X2), _reference(MODEL, VARIABLES, X1, X2)
    )


def test_a_train_state_restored_as_a_dict_reads_as_the_train_state():
    """orbax restores a TrainState saved without a target as a dict with 'params',
    'opt_state' and 'step' (a new user's finding: it used to fail in Flax's apply with a
    fix about x1's shape); it is read as the train state it was."""
    state = _state(MODEL, VARIABLES["params"])
    as_dict = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
    _equal(ntk_flax.kernel(MODEL, as_dict, X1, X2), ntk_flax.kernel(MODEL, VARIABLES, X1, X2))
    variables = _bn_variables()
    stats = {"params": variables["params"], "batch_stats": variables["batch_stats"], "step": 3}
    _equal(
        ntk_flax.kernel(BN_MODEL, stats, X1, **BN_KW),
        ntk_flax.kernel(BN_MODEL, variables, X1, **BN_KW),
    )


def test_batchnorm_train_state_subclass_carries_batch_stats():
    variables = _bn_variables()
    expected = ntk_flax.kernel(BN_MODEL, variables, X1, **BN_KW)
    stats = variables["batch_stats"]
    state = _state(BN_MODEL, variables["params"], BatchStatsState, batch_stats=stats)
    _equal(ntk_flax.kernel(BN_MODEL, state, X1, **BN_KW), expected)
    # A TrainState created with the whole variables dict as its params.
    _equal(ntk_flax.kernel(BN_MODEL, _state(BN_MODEL, variables), X1, **BN_KW), expected)
    reference.assert_close(expected, _reference(BN_MODEL, variables, X1, None, train=False))


def test_batchnorm_without_its_statistics_is_refused_with_the_fix():
    variables = _bn_variables()
    with pytest.raises(ValueError) as info:
        ntk_flax.kernel(BN_MODEL, variables["params"], X1, **BN_KW)
    assert str(info.value).startswith(
        "ntk_flax.kernel: variables is a bare params dict without the collection(s) "
        "['batch_stats'], which the model reads. Fix: pass {'params': ..., 'batch_stats': ...}"
    )
    plain = _state(BN_MODEL, variables["params"])
    for state in (plain, _state(BN_MODEL, variables["params"], BatchStatsState)):  # None
        with pytest.raises(ValueError) as info:
            ntk_flax.kernel_fn(BN_MODEL, **BN_KW)(state, X1)
        message = str(info.value)
        assert message.startswith(
            f"ntk_flax.kernel_fn: variables is a {type(state).__name__} without the "
            f"collection(s) ['batch_stats']"
        )
        assert "or a TrainState that carries them. See docs/errors.md#flax-variables" in message


class NamedParams(nn.Module):
    """Its first layer is named ``params``: its params dict has a top-level 'params' key."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(jnp.tanh(nn.Dense(4, name="params")(x)))


def test_params_dict_with_a_layer_named_params_is_refused_not_misread():
    """Such a params dict looks like a variables dict; Flax's apply refuses the model's
    real variables dict too ({'params': {'params': ...}})."""
    model = NamedParams()
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5))
    params = model.init(jax.random.PRNGKey(1), x)["params"]
    assert set(params) == {"params", "Dense_0"}
    pattern = (
        r"^ntk_flax.kernel: variables is this model's bare params dict, whose top-level layer "
        r"is named 'params' \(the model failed with ScopeParamNotFoundError\)\. Fix: rename "
        r"that layer"
    )
    with pytest.raises(ValueError, match=pattern):
        ntk_flax.kernel(model, params, x)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match=pattern):
        ntk_flax.kernel(model, state, x)
    with pytest.raises(ValueError, match=r"ApplyScopeInvalidVariablesStructureError"):
        ntk_flax.kernel(model, {"params": params}, x)  # Flax's own refusal


def test_other_inputs_are_refused_with_the_fix():
    params = VARIABLES["params"]
    other = {"Conv_0": params["Dense_1"], "Dense_0": params["Dense_0"]}  # another model's
    with pytest.raises(ValueError) as info:
        ntk_flax.nngp(MODEL, other, X1)
    assert re.match(
        r"ntk_flax.nngp: variables looks like the parameters of another model: top-level names "
        r"\['Conv_0', 'Dense_0'\], where model.init makes \['Dense_0', 'Dense_1'\] for this one\. "
        r"Fix: pass the model they belong to, or this model's",
        str(info.value),
    )
    lacking = {"Dense_0": params["Dense_0"], "Dense_1": {"kernel": params["Dense_1"]["kernel"]}}
    with pytest.raises(ValueError) as info:  # this model's layers, one parameter short
        ntk_flax.kernel(MODEL, _state(MODEL, lacking), X1)
    assert re.match(
        r"ntk_flax.kernel: variables is a TrainState whose .params lack 1 of the 4 parameters "
        r"model.init makes \(\['Dense_1'\]\['bias'\]\)\. Fix: pass this model's",
        str(info.value),
    )

    class Holder:  # .params but no .apply_fn: not read as a train state
        def __init__(self, params):
            self.params = params

    with pytest.raises(TypeError) as info:
        ntk_flax.kernel(MODEL, Holder(params), X1)
    assert re.match(
        r"ntk_flax.kernel: variables must be the dict returned by model.init\(...\), its "
        r"\['params'\] or a train state, got Holder \(it has .params but no .apply_fn\)\. Fix: ",
        str(info.value),
    )
    state = _state(MODEL, params).replace(params=[1.0])
    with pytest.raises(
        TypeError, match=r"^ntk_flax.kernel: variables is a TrainState whose \.params is list"
    ):
        ntk_flax.kernel(MODEL, state, X1)


class Stack(nn.Module):
    """MLP's layers under other names (layers_0, layers_1): another model's parameters."""

    def setup(self):
        self.layers = [nn.Dense(8), nn.Dense(3)]

    def __call__(self, x):
        return self.layers[1](nn.relu(self.layers[0](x)))


def test_another_models_train_state_is_named_as_such():
    """The issue's case: a TrainState of Stack given with MLP, as a state, its .params, a
    dict restored from a checkpoint and a variables dict: each says the parameters look
    like another model's and names both sets of layers."""
    variables = Stack().init(jax.random.PRNGKey(4), X1)
    state = _state(Stack(), variables["params"])
    names = r"top-level names \['layers_0', 'layers_1'\], where model.init makes \['Dense_0', "
    names += r"'Dense_1'\] for this one"
    fix = r"\. Fix: pass the model they belong to, or this model's model.init\(key, x\), its "
    forms = [
        (state, r"variables is a TrainState whose .params look like"),
        (state.params, r"variables looks like"),
        (
            dict(params=state.params, step=0, opt_state=None),
            r"variables is a train state dict whose",
        ),
        (variables, r"variables\['params'\] looks like"),
    ]
    for given, subject in forms:
        with pytest.raises(ValueError) as info:
            ntk_flax.kernel(MODEL, given, X1, X2)
        tail = r" \(the model failed with ScopeParamNotFoundError\)" if given is variables else ""
        pattern = (
            rf"ntk_flax.kernel: {subject}.* the parameters of another model: {names}{tail}{fix}"
        )
        assert re.match(pattern, str(info.value)), str(info.value)


def test_bare_params_for_inputs_of_another_shape_name_the_shape():
    """A bare params dict goes through the same shape diagnosis as a variables dict."""
    with pytest.raises(ValueError) as info:
        ntk_flax.kernel(MODEL, VARIABLES["params"], jnp.ones((2, 7)))
    assert str(info.value).startswith(
        "ntk_flax.kernel: applying the model to x1 failed: x1 has per-sample shape (7,), but "
        "variables were made by model.init for inputs of per-sample shape (5,)"
    )


TRACES = []


class Counting(nn.Module):
    @nn.compact
    def __call__(self, x):
        TRACES.append(1)  # runs only while JAX traces (init and apply)
        return nn.Dense(2)(jnp.tanh(nn.Dense(4)(x)))


def test_train_states_of_later_steps_neither_retrace_nor_reinitialise():
    model = Counting()
    x = jax.random.normal(jax.random.PRNGKey(0), (5, 3))
    y = jax.random.normal(jax.random.PRNGKey(1), (5, 2))
    variables = model.init(jax.random.PRNGKey(2), x)
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=optax.adam(1e-2)
    )

    @jax.jit
    def step(state):
        def loss(p):
            return jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    states = []
    for _ in range(4):  # a short training run, before any kernel is computed
        state = step(state)
        states.append(state)
    kernel = ntk_flax.kernel_fn(model, trace_axes=())
    first = kernel(states[0], x)
    kernel(states[0].params, x)
    n = len(TRACES)
    for state in states[1:]:
        later = kernel(state, x)
        _equal(kernel(state.params, x), later)
        _equal(later, kernel({"params": state.params}, x))
    assert len(TRACES) == n  # no new abstract init, trace or compilation
    assert not np.allclose(first, later)
