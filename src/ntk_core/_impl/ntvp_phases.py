"""``"ntvp"``: :mod:`ntk_core._impl.ntvp` per tile from the blocks' inputs (:data:`NTVP`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ntk_core._errors import bad, one_line
from ntk_core._impl import cost as _cost
from ntk_core._impl import ntvp as _ntvp
from ntk_core._impl.base import Impl
from ntk_core._jax.jaxpr_walk import equations
from ntk_core._kernel.model import replay


def _pairwise(config) -> bool:
    return config.vmap_axes is not None and config.layouts[0].batch_diagonal


def contract(params, xa, xb, aux, *, apply3, config):
    """The kernel of the inputs ``xa`` and ``xb`` (None: of ``xa`` with itself), in the
    parameters' promoted dtype."""
    with jax.default_matmul_precision(config.precision):
        args = (params, xa, xa if xb is None else xb, aux, config.vmap_axes, config.out_tree)
        single = replay(apply3, config.precision)
        fulls = _ntvp.full_kernels(apply3, *args, _pairwise(config), single)
    dtype = jnp.result_type(*jax.tree.leaves(params))
    fulls = [full.astype(dtype) for full in fulls]
    kernels = _ntvp.reduce(config.layouts, fulls, _pairwise(config))
    return jax.tree.unflatten(config.out_tree, kernels)


def model_failure(spec, checked, params, x1, x2, aux) -> Exception | None:
    """The error the model raises traced inside NTK-vector products on one sample (e.g.
    ``flax.nnx.scan``), or with ``vmap_axes=None`` on the whole batches (a batch of one
    is not the model's input there), or None."""
    vmap_axes = spec.options.vmap_axes

    def one(x):
        return x if vmap_axes is None else jax.tree.map(lambda a: a[:1], x)

    xb = x1 if x2 is None else x2
    pairwise = vmap_axes is not None and checked.layouts[0].batch_diagonal

    def trace(p, a, b, aux):
        single = replay(spec.apply3, spec.options.precision)
        return _ntvp.full_kernels(
            spec.apply3, p, a, b, aux, vmap_axes, checked.out_tree, pairwise, single
        )

    try:
        traced = jax.make_jaxpr(trace)(params, one(x1), one(xb), aux).jaxpr
        # A jax.custom_vjp has no jvp: its tangent is a custom_lin, which fails to lower.
        if any(e.primitive.name == "custom_lin" for e in equations(traced)):
            return TypeError("a jax.custom_vjp function has no forward-mode derivative (jvp)")
    except Exception as e:  # the model's own error, found by the first trace
        return e
    return None


def failure_message(fn_name: str, error: Exception) -> str:
    what = f"the model cannot run inside NTK-vector products ({one_line(error)[:200]})"
    return str(bad(ValueError, fn_name, what, "pass implementation='auto' or 'jacobian'"))


NTVP = Impl(
    estimate=_cost.ntvp_estimate,
    name="ntvp",
    title="NTK-vector products",
    features=None,
    contract=contract,
    separates_leaves=False,
    whole_batch_as="ntvp",
    pair_terms=lambda config: None,
    model_failure=model_failure,
    failure_message=failure_message,
)
