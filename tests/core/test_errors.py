"""Documented errors of the core API beyond the bad-input table, by type and one key
fragment; a failed call leaves no state behind; messages follow their caller."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
from ntk_core._kernel import checks as _checks

W = jnp.ones((3, 2))
X = jnp.ones((4, 3))


def f(w, x):
    return jnp.tanh(x @ w)


#: The documented errors of the core API that the bad-input table (test_bad_input.py)
#: does not already call: each its exception type and one key fragment.
CASES = [
    # (id, call, exception type, message fragment)
    (
        "trace_axes bool",
        lambda: ntk_core.empirical_ntk(f, W, X, trace_axes=True),
        TypeError,
        r"trace_axes must be an int or a sequence of ints, got bool True",
    ),
    (
        "trace_axes float",
        lambda: ntk_core.empirical_ntk(f, W, X, trace_axes=(1.0,)),
        TypeError,
        r"trace_axes must be an int or a sequence of ints, got tuple \(1.0,\)",
    ),
    (
        "vmap_axes True",
        lambda: ntk_core.empirical_ntk(f, W, X, vmap_axes=True),
        ValueError,
        r"vmap_axes must be 0",
    ),
    (
        "scalar x1",
        lambda: ntk_core.empirical_ntk(f, W, 1.0),
        ValueError,
        r"x1 holds a scalar.*Fix: pass x1\[None\]",
    ),
    ("x1 no arrays", lambda: ntk_core.empirical_ntk(f, W, {}), ValueError, r"x1 has no arrays"),
    (
        "nngp axes out of range",
        lambda: ntk_core.empirical_nngp(f, W, X, trace_axes=(5,)),
        ValueError,
        r"empirical_nngp: trace_axes contains 5",
    ),
    (
        "softmax over the batch",
        lambda: ntk_core.empirical_ntk(
            lambda w, x: jax.nn.softmax(x @ w, axis=0), W, X * jnp.arange(1.0, 5.0)[:, None]
        ),
        ValueError,
        r"depends on the other samples",
    ),
]


@pytest.mark.parametrize("call, exc, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_errors_leave_no_partial_state():
    """A failed call does not poison the cache: a correct call afterwards works."""
    kernel = ntk_core.ntk_fn(f)
    with pytest.raises(ValueError):
        kernel(W, jnp.ones((0, 3)))
    np.testing.assert_allclose(kernel(W, X).shape, (4, 4))


def test_argument_order_from_the_caller_not_its_name():
    """A core function and an adapter's each get their own argument order and model
    noun in a message from the Caller made where they are defined, not from their
    names: here both have the same made-up name."""
    from ntk_core._kernel.caller import Caller, core
    from ntk_core._kernel.engine import Engine
    from ntk_core._kernel.model import from_apply_fn
    from ntk_core._kernel.options import make_options
    from ntk_core._kernel.pipeline import Spec

    name = "made_up.kernel_fn"  # neither a core name nor an adapter's
    in_core = core(name)
    in_adapter = Caller(name, "(model, variables, x1, x2)", model="the model", package="x")

    def message(caller, x1, apply_fn=f):
        options = make_options(name)
        engine = Engine(Spec(name, "ntk", from_apply_fn(apply_fn), options, caller=caller))
        with pytest.raises(ValueError) as e:
            engine(W, x1)
        return str(e.value)

    x1 = {"a": jnp.ones((4, 3)), "b": jnp.ones((5, 3))}  # batch sizes disagree
    assert message(in_core, x1).endswith(
        "the argument order is (params, x1, x2), not neural-tangents' (x1, x2, params)."
    )
    assert message(in_adapter, x1).endswith("the argument order is (model, variables, x1, x2).")
    no_batch = lambda w, x: jnp.tanh(x @ w).sum(0)  # noqa: E731
    assert "make apply_fn return one row" in message(in_core, X, no_batch)
    assert "make the model return one row" in message(in_adapter, X, no_batch)
    one_input = core(name, one_input=True)
    assert _checks.order_hint(one_input) == (
        "the argument order is (params, x), not neural-tangents' (f, x_train, params)"
    )


def test_kernel_function_argument_errors_name_the_method_and_unknown_keywords():
    """After a new-user trial (helper-19): a misnamed keyword is named beside the missing
    argument, and errors of .plan say .plan."""
    kernel = ntk_core.ntk_fn(lambda w, x: x @ w)
    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    with pytest.raises(TypeError, match=r"'x1'; got the keyword argument\(s\) 'x'"):
        kernel(w, x=x)
    with pytest.raises(TypeError, match=r"^ntk_fn\(\.\.\.\)\.plan\(\.\.\.\): too many positional"):
        kernel.plan(w, x, x, x)
    assert "out='k.npy'" in repr(ntk_core.ntk_fn(lambda w, x: x @ w, batch_size=2, out="k.npy"))
