"""The checks of ``flax.nnx`` errors, each against flax itself: by class where flax
exports one, by its words otherwise (a rewording fails here instead of silently
turning a specific fix into the generic one)."""

from __future__ import annotations

import flax.errors
import jax.numpy as jnp
import pytest
from flax import nnx

import ntk_flax
from ntk_flax import _nnx


class Drop(nnx.Module):
    def __init__(self, rngs=None, **dropout):
        self.dense = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5, rngs=rngs, **dropout)

    def __call__(self, x):
        return self.drop(self.dense(x))


X = jnp.ones((4, 3))


def test_mode_missing_fix():
    """A Dropout told neither its mode nor given rngs: flax's own error, then the fix."""
    with pytest.raises(ValueError, match=r"deterministic.*Fix: .*model.eval\(\)"):
        ntk_flax.kernel(Drop(), None, X)


def test_trace_context_error_is_exported():
    """The class the adapter checks by (its name is only the fallback)."""
    assert isinstance(flax.errors.TraceContextError, type)
    error = flax.errors.TraceContextError("x")
    assert _nnx._is_trace_context_error(error)
    assert not _nnx._is_trace_context_error(ValueError("TraceContextError"))


def test_variable_classes():
    state = nnx.state(Drop(), nnx.Param)
    found = _nnx._variables(state)
    assert [kind for _, kind in found] == ["Param", "Param"]
