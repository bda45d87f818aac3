"""Linearized and Taylor-expanded Equinox models: the model's inexact-array leaves expanded
around ``model0``'s, everything else held at ``model0``'s, by
:func:`ntk_core.adapters.expansion`."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx

from ntk_core.adapters import bad, check_degree, expansion
from ntk_core.adapters import check_inputs_option as check_inputs
from ntk_equinox._kernel import _PACKAGE, _split
from ntk_equinox._statistics import public


def _expanded(fn: Callable, degree: int, model0, inputs: str) -> Callable:
    name = f"{_PACKAGE}.{fn.__name__}"
    degree, inputs = check_degree(name, degree), check_inputs(name, inputs)
    params0, arrays0, apply = _split(name, model0, inputs)
    point = dict(params_name="model", point_arg="model0", point_name="model0")
    # every array expanded: the core holds integer ones and refuses another value eagerly
    whole = eqx.combine(params0, arrays0)
    at = expansion(
        name, lambda w, x: apply(*_floats(w, x)), whole, degree, **point, inputs_fix=_X_FIX
    )

    def expanded(model, x):
        params, arrays, other = _split(name, model, inputs)
        if other != apply:
            what = "the model's structure or fixed fields differ from model0's"
            raise bad(ValueError, name, what, "pass model0 with new weights (eqx.tree_at)")
        return at(eqx.combine(params, arrays), x)

    return expanded


def _floats(whole, x) -> tuple:
    """``(floating arrays, x, other arrays)``: ``_Apply``'s arguments from a module's arrays."""
    floats, others = eqx.partition(whole, eqx.is_inexact_array)
    return floats, x, others


_X_FIX = "x holds N1 samples on axis 0 (one sample: x[None]); a model of several arguments: "
_X_FIX += "inputs='args' or 'kwargs'"


@public
def linearize(model0, *, inputs: str = "x") -> Callable:
    """The linearisation f_lin(θ, x) = f(θ0, x) + J(θ0, x)·(θ − θ0) of an ``eqx.Module``, θ
    its ``eqx.is_inexact_array`` leaves, θ0 ``model0``'s; every other field is held at
    ``model0``'s. Maths and cost: :func:`ntk_core.linearize`.

    Args: ``model0`` a callable ``eqx.Module`` of one sample (the expansion point);
    ``inputs`` as :func:`ntk_equinox.kernel`. Returns: pure ``f_lin(model, x)``, ``model``
    shaped like ``model0`` and vmapped over x's N1 samples: the outputs, e.g. ``(N1, O)``.
    Raises: TypeError, ValueError: as :func:`ntk_equinox.kernel` for ``model0``; at call
    time, a model of another structure, fixed fields, leaf shape or dtype than ``model0``,
    another integer array outside jit (inside it ``model0``'s is used), a model failing on x.
    Cost: one ``jax.jvp`` over the P parameters per call (2-3 forward passes).
    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, ntk_equinox
      >>> mlp, x = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.PRNGKey(0)), jnp.ones((4, 3))
      >>> f_lin = ntk_equinox.linearize(mlp)
      >>> bool(jnp.allclose(f_lin(mlp, x), jax.vmap(mlp)(x)))
      True

    References: Lee et al., NeurIPS 2019, as :func:`ntk_core.linearize`.
    """
    return _expanded(linearize, 1, model0, inputs)


@public
def taylor_expand(model0, degree: int, *, inputs: str = "x") -> Callable:
    """The degree-``degree`` Taylor polynomial Σ_{k=0..degree} (1/k!) D^k f(θ0, x)[θ − θ0,
    ...] of an ``eqx.Module`` in its inexact-array leaves (others held at ``model0``'s);
    ``degree=1`` is :func:`linearize`. Maths and cost: :func:`ntk_core.taylor_expand`.

    Args: ``model0``, ``inputs`` as :func:`linearize`; ``degree`` an int in [0, 10].
    Returns: ``f_taylor(model, x)``: the outputs for x's N1 samples, e.g. ``(N1, O)``.
    Raises: as :func:`linearize`; TypeError / ValueError for a ``degree`` not an int, or
    outside [0, 10]. Cost: ``degree`` nested JVPs, as :func:`ntk_core.taylor_expand`.
    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, ntk_equinox
      >>> lin, x = eqx.nn.Linear(2, 3, key=jax.random.PRNGKey(0)), jnp.ones((4, 2))
      >>> f0 = ntk_equinox.taylor_expand(lin, 0)  # degree 0: the model0's outputs
      >>> moved = jax.tree.map(lambda a: a + 1.0, lin)
      >>> bool(jnp.allclose(f0(moved, x), jax.vmap(lin)(x)))
      True

    References: Lee et al., NeurIPS 2019 (as :func:`linearize`).
    """
    return _expanded(taylor_expand, degree, model0, inputs)
