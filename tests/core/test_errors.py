"""Each documented error of the core API, matched on its message."""

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


CASES = [
    # (id, call, exception type, message pattern)
    (
        "apply_fn not callable",
        lambda: ntk_core.ntk_fn("f"),
        TypeError,
        r"ntk_fn: apply_fn must be a callable",
    ),
    (
        "trace_axes str",
        lambda: ntk_core.empirical_ntk(f, W, X, trace_axes="-1"),
        TypeError,
        r"empirical_ntk: trace_axes must be an int or a sequence",
    ),
    (
        "trace_axes bool",
        lambda: ntk_core.empirical_ntk(f, W, X, trace_axes=True),
        TypeError,
        r"trace_axes must be an int .* got the bool",
    ),
    (
        "trace_axes float",
        lambda: ntk_core.empirical_ntk(f, W, X, trace_axes=(1.0,)),
        TypeError,
        r"trace_axes must contain only ints",
    ),
    (
        "trace_axes duplicated",
        lambda: ntk_core.empirical_ntk(f, W, X, trace_axes=(-1, -1)),
        ValueError,
        r"names the same axis twice",
    ),
    (
        "trace_axes duplicated after normalising",
        lambda: ntk_core.empirical_ntk(f, W, X, trace_axes=(1, -1)),
        ValueError,
        r"names the same axis twice for the output of shape \(4, 2\)",
    ),
    (
        "trace_axes out of range",
        lambda: ntk_core.empirical_ntk(f, W, X, trace_axes=(2,)),
        ValueError,
        r"trace_axes contains 2, out of range for the output of shape \(4, 2\); expected axes in \[-2, 1\]",
    ),
    (
        "diagonal_axes out of range",
        lambda: ntk_core.empirical_ntk(f, W, X, diagonal_axes=(-3,)),
        ValueError,
        r"diagonal_axes contains -3, out of range",
    ),
    (
        "overlapping axes",
        lambda: ntk_core.empirical_ntk(f, W, X, trace_axes=(1,), diagonal_axes=(-1,)),
        ValueError,
        r"axis 1 of the output .* is in both trace_axes=\(1,\) and diagonal_axes=\(-1,\)",
    ),
    (
        "trace batch axis",
        lambda: ntk_core.empirical_ntk(f, W, X, trace_axes=(0, 1)),
        ValueError,
        r"traces the batch axis 0 .* Fix: use diagonal_axes=\(0,\)",
    ),
    (
        "vmap_axes 1",
        lambda: ntk_core.empirical_ntk(f, W, X, vmap_axes=1),
        ValueError,
        r"vmap_axes must be 0 .* or None, got 1",
    ),
    (
        "vmap_axes True",
        lambda: ntk_core.empirical_ntk(f, W, X, vmap_axes=True),
        ValueError,
        r"vmap_axes must be 0",
    ),
    (
        "unknown implementation",
        lambda: ntk_core.empirical_ntk(f, W, X, implementation="fast"),
        ValueError,
        r"implementation must be one of 'auto', 'jacobian', 'ntvp', 'structured', got 'fast'",
    ),
    (
        "implementation int",
        lambda: ntk_core.empirical_ntk(f, W, X, implementation=1),
        ValueError,
        r"implementation=1 is neural-tangents' NtkImplementation.JACOBIAN_CONTRACTION.*"
        r"Fix: pass implementation='jacobian'",
    ),
    (
        "unknown precision",
        lambda: ntk_core.empirical_ntk(f, W, X, precision="tf32"),
        ValueError,
        r"precision must be one of 'highest', 'high', 'default', got 'tf32'",
    ),
    (
        "empty params",
        lambda: ntk_core.empirical_ntk(f, {}, X),
        ValueError,
        r"empirical_ntk: params has no arrays",
    ),
    (
        "integer params",
        lambda: ntk_core.empirical_ntk(f, jnp.ones((3, 2), jnp.int32), X),
        TypeError,
        r"params has dtype int32",
    ),
    (
        "empty x1",
        lambda: ntk_core.empirical_ntk(f, W, jnp.ones((0, 3))),
        ValueError,
        r"x1 is empty \(shapes",
    ),
    (
        "empty x2",
        lambda: ntk_core.empirical_ntk(f, W, X, jnp.ones((0, 3))),
        ValueError,
        r"x2 is empty \(shapes",
    ),
    ("scalar x1", lambda: ntk_core.empirical_ntk(f, W, 1.0), ValueError, r"x1 holds a scalar"),
    ("x1 no arrays", lambda: ntk_core.empirical_ntk(f, W, {}), ValueError, r"x1 has no arrays"),
    (
        "ragged batch",
        lambda: ntk_core.empirical_ntk(lambda w, x: x["a"] @ w, W, {"a": X, "b": jnp.ones((3, 1))}),
        ValueError,
        r"the arrays of x1 disagree on the batch size",
    ),
    (
        "x1 x2 shapes differ",
        lambda: ntk_core.empirical_ntk(f, W, X, jnp.ones((2, 5))),
        ValueError,
        r"x1 and x2 differ in their non-batch shapes",
    ),
    (
        "x1 x2 structures differ",
        lambda: ntk_core.empirical_ntk(lambda w, x: x["a"] @ w, W, {"a": X}, {"b": X}),
        ValueError,
        r"x1 and x2 have different pytree structures",
    ),
    (
        "params do not fit the model",
        lambda: ntk_core.empirical_ntk(f, jnp.ones((5, 2)), X),
        ValueError,
        r"calling the model on x1 \(shapes \(4, 3\)\) failed with TypeError.*Fix: check params",
    ),
    (
        "output without batch axis",
        lambda: ntk_core.empirical_ntk(lambda w, x: jnp.sum(x @ w), W, X),
        ValueError,
        r"the output has shape \(\) but x1 has 4 samples",
    ),
    (
        "integer output",
        lambda: ntk_core.empirical_ntk(lambda w, x: jnp.argmax(x @ w, -1), W, X),
        TypeError,
        r"the output has dtype int32; expected floating point",
    ),
    (
        "batch diagonal with different N",
        lambda: ntk_core.empirical_ntk(f, W, X, jnp.ones((2, 3)), diagonal_axes=(0,)),
        ValueError,
        r"needs N1 == N2, got N1=4 and N2=2",
    ),
    (
        "nngp with implementation",
        lambda: ntk_core.empirical_nngp(f, W, X, implementation="jacobian"),
        TypeError,
        r"implementation",
    ),
    (
        "nngp axes out of range",
        lambda: ntk_core.empirical_nngp(f, W, X, trace_axes=(5,)),
        ValueError,
        r"empirical_nngp: trace_axes contains 5",
    ),
]


def batch_centred(w, x):
    h = x @ w
    return h - h.mean(axis=0, keepdims=True)


CASES += [
    (
        "samples interact under vmap_axes=0",
        lambda: ntk_core.empirical_ntk(batch_centred, W, X + jnp.arange(4.0)[:, None]),
        ValueError,
        r"empirical_ntk: the model's output for one sample depends on the other samples of its batch.* or pass vmap_axes=None",
    ),
    (
        "softmax over the batch",
        lambda: ntk_core.empirical_ntk(
            lambda w, x: jax.nn.softmax(x @ w, axis=0), W, X * jnp.arange(1.0, 5.0)[:, None]
        ),
        ValueError,
        r"depends on the other samples",
    ),
    (
        "x2 integer where x1 float",
        lambda: ntk_core.empirical_ntk(f, W, X, jnp.ones((2, 3), jnp.int32)),
        TypeError,
        r"x1 has dtype float32 where x2 has int32",
    ),
    (
        "nested list input",
        lambda: ntk_core.empirical_ntk(f, W, [[1.0, 2.0, 3.0]]),
        ValueError,
        r"x1 holds a scalar .*np.asarray\(x\)",
    ),
    (
        "params and x swapped",
        lambda: ntk_core.empirical_ntk(f, X, {"w": W, "b": jnp.ones(2)}),
        ValueError,
        r"disagree on the batch size .* the argument order is \(params, x1, x2\)",
    ),
    (
        "single sample without batch axis",
        lambda: ntk_core.empirical_ntk(f, W, jnp.ones(3)),
        ValueError,
        r"the output has shape \(2,\) but x1 has 3 samples .* add a batch axis \(x1\[None\]\)",
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
    with pytest.raises(
        TypeError,
        match=r"^ntk_fn\(\.\.\.\)\(\.\.\.\): missing a required "
        r"argument: 'x1'; got the keyword argument\(s\) 'x' .*Fix: call it as "
        r"kernel\(params, x1, x2=None\)",
    ):
        kernel(w, x=x)
    with pytest.raises(
        TypeError,
        match=r"^ntk_fn\(\.\.\.\)\.plan\(\.\.\.\): 4 positional "
        r"arguments.*Fix: call it as kernel\.plan\(params, x1, x2=None\)",
    ):
        kernel.plan(w, x, x, x)
    assert "out='k.npy'" in repr(ntk_core.ntk_fn(lambda w, x: x @ w, batch_size=2, out="k.npy"))
