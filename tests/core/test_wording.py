"""The checks that replaced readings of other libraries' error messages, and the
generic fix given with a model's own error."""

from __future__ import annotations

import inspect
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
from ntk_core._kernel import checks as _checks
from ntk_core._kernel.arguments import _first_missing
from ntk_core._kernel.caller import Caller


def _error(call) -> BaseException:
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - the error is the value under test
        return e
    raise AssertionError("the call did not fail")


def test_adapter_model_failure_monte_carlo_flag():
    """The caller's monte_carlo field decides the generic fix, whatever its name."""
    e = ValueError("bad")
    mine = "check p from this model's init"
    kernel = Caller("ntk_haiku.kernel", "(transformed, params, x1, x2)", model="the model")
    assert mine not in str(
        _checks.adapter_model_failure(replace(kernel, monte_carlo=True), "p", e, "eval")
    )
    assert mine in str(_checks.adapter_model_failure(kernel, "p", e, "eval"))
    named = replace(kernel, name="ntk_haiku.monte_carlo_kernels")  # the name says nothing
    assert mine in str(_checks.adapter_model_failure(named, "p", e, "eval"))


def _signatures():
    def f(a, b=1, /, c=2, *args, d, e=3, **kwargs):
        pass

    def g(a, b, *, c, d=4):
        pass

    def h(a, /, b):
        pass

    return [inspect.signature(fn) for fn in (f, g, h)]


CALLS = [
    ((), {}),
    ((1,), {}),
    ((1, 2), {}),
    ((1, 2, 3), {}),
    ((1, 2, 3, 4, 5), {}),
    ((1,), {"b": 2}),
    ((1,), {"d": 1}),
    ((1, 2), {"c": 3}),
    ((1, 2), {"d": 3}),
    ((1, 2), {"a": 3}),
    ((), {"a": 1, "b": 2}),
    ((1, 2, 3), {"c": 1}),
]


@pytest.mark.parametrize("signature", _signatures(), ids=["f", "g", "h"])
@pytest.mark.parametrize("args, kwargs", CALLS)
def test_first_missing_agrees_with_signature_bind(signature, args, kwargs):
    """``_first_missing`` names the parameter ``Signature.bind`` reports missing (read
    from its message here, in the test only), and nothing when bind fails otherwise."""
    try:
        signature.bind(*args, **kwargs)
        reported = None
    except TypeError as e:
        prefix = "missing a required argument: "
        reported = str(e).removeprefix(prefix).strip("'") if str(e).startswith(prefix) else None
    assert _first_missing(signature, args, kwargs) == reported


def test_missing_keyword_only_option_message():
    with pytest.raises(TypeError, match=r"Fix: pass key=\.\.\. by keyword \(it is keyword-only\)"):
        ntk_core.monte_carlo_kernels(lambda k: jnp.ones(3), lambda p, x: x @ p, jnp.ones((2, 3)))


def test_non_finite_errors_are_marked():
    """Non-finite inputs and kernels raise a plain ValueError that callers recognise by
    its mark, other ValueErrors are not marked."""
    x = np.ones((3, 2))
    x[1, 0] = np.nan
    with pytest.raises(ValueError, match=r"x1 contains NaN values") as info:
        _checks.check_finite_input("empirical_ntk", "x1", x)
    assert type(info.value) is ntk_core.NonFiniteError and isinstance(info.value, ValueError)


def test_monte_carlo_reports_a_non_finite_kernel_by_type():
    """A kernel that comes out non-finite from finite inputs is named with its
    initialisation (recognised by its mark, not its words), and stays marked."""

    def apply_fn(w, x):
        return jnp.log(x @ w)  # NaN where x @ w < 0

    with pytest.raises(ValueError, match=r"in initialisation 0 .*non-finite") as info:
        ntk_core.monte_carlo_kernels(
            lambda k: -jnp.ones((2, 1)),
            apply_fn,
            jnp.ones((3, 2)),
            key=jax.random.PRNGKey(0),
            n_samples=2,
        )
    assert isinstance(info.value, ntk_core.NonFiniteError)


def test_params_check_recognises_model_apply_by_identity():
    """``model.apply`` of a linen module is recognised as that bound method, not by
    its name: another method of the module is not."""
    nn = pytest.importorskip("flax.linen")

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

        def features(self, x):
            return x

    model = Dense()
    assert _checks.params_check("empirical_ntk", model.apply) is not None
    assert _checks.params_check("empirical_ntk", model.features) is None
    assert _checks.params_check("empirical_ntk", lambda p, x: x) is None
