"""The checks that read Haiku's error messages, each against Haiku itself: a rewording
fails here instead of silently turning a specific message into the generic one."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

import ntk_haiku
from ntk_haiku._kernel import haiku_missing_parameter, haiku_missing_state

X = jnp.ones((4, 3))
net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(2)(x)))
PARAMS = net.init(jax.random.PRNGKey(0), X)


def counted(x):
    return x * hk.get_state("count", (), jnp.float32)  # no init: must be given


stateful = hk.without_apply_rng(hk.transform_with_state(counted))


def test_missing_parameter_wording():
    with pytest.raises(ValueError) as info:
        net.apply({"linear": {"w": PARAMS["linear"]["w"]}}, X)
    assert haiku_missing_parameter(info.value) == ("b", "linear")
    assert haiku_missing_state(info.value) is None


def test_missing_state_wording():
    with pytest.raises(ValueError) as info:
        stateful.apply({}, {}, X)
    assert haiku_missing_state(info.value) == ("count", "~")
    assert haiku_missing_parameter(info.value) is None


def test_rng_needed_is_told_by_running_with_a_key():
    """A model that draws random numbers, given no rng: the message says so, decided by
    running it with a key, not by Haiku's words; a model that takes an rng but fails
    for another reason gets the other message."""
    drop = hk.transform(lambda x: hk.dropout(hk.next_rng_key(), 0.5, hk.Linear(2)(x)))
    params = drop.init(jax.random.PRNGKey(0), X)
    with pytest.raises(ValueError, match=r"^ntk_haiku.kernel: the model needs a random key"):
        ntk_haiku.kernel(drop, params, X)
    with pytest.raises(ValueError, match=r"asks for parameter 'b' of module 'linear'"):
        ntk_haiku.kernel(drop, {"linear": {"w": params["linear"]["w"]}}, X)
