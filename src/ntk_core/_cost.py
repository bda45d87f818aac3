"""Analytic cost model behind ``implementation="auto"``.

FLOPs are counted from the shapes in the jaxpr of one single-sample forward pass
(``dot_general`` and ``conv_general_dilated`` exactly, every other primitive as one
operation per output element), never from XLA's cost analysis, which reports wrong or
-1 FLOPs on CPU and GPU. Estimates, with F the forward FLOPs of one sample, O the
output entries per sample, O' the kernel entries per pair of samples and P the
parameter count:

* ``"jacobian"``: (N1 + N2)·O·3F for the Jacobians, plus 2·N1·N2·O'·P for the
  contraction; memory (N1 + N2)·O·P values.
* ``"ntvp"``: N2·O·3F for the VJPs plus N1·N2·O·3F for the JVPs; memory O·P + N1·O·O.

``"auto"`` takes the cheaper in FLOPs unless the Jacobians exceed
:data:`JACOBIAN_MEMORY_BUDGET` bytes, in which case it takes ``"ntvp"``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.extend import core as jex_core

#: Bytes of per-sample Jacobians above which ``"auto"`` avoids ``"jacobian"``.
JACOBIAN_MEMORY_BUDGET = 4 * 2**30


def _sub_jaxprs(params):
    for value in params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, jex_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex_core.Jaxpr):
                yield item


def _shape_size(var) -> int:
    shape = getattr(getattr(var, "aval", None), "shape", None)
    return math.prod(shape) if shape is not None else 0


def jaxpr_flops(jaxpr) -> float:
    """FLOPs of a jaxpr counted from its shapes (sub-jaxprs included; scans times length)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        out_size = sum(_shape_size(v) for v in eqn.outvars)
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs_shape = eqn.invars[0].aval.shape
            total += 2.0 * out_size * math.prod(lhs_shape[d] for d in lhs_contract)
        elif name == "conv_general_dilated":
            rhs_shape = eqn.invars[1].aval.shape
            rhs_spec = eqn.params["dimension_numbers"].rhs_spec
            per_output = math.prod(rhs_shape[d] for d in rhs_spec[1:])
            total += 2.0 * out_size * per_output
        else:
            total += out_size
        repeat = eqn.params.get("length", 1) if name == "scan" else 1
        for sub in _sub_jaxprs(eqn.params):
            total += repeat * jaxpr_flops(sub)
    return total


@dataclasses.dataclass(frozen=True)
class CostEstimate:
    """Estimated FLOPs and memory (bytes) of one implementation for one call."""

    implementation: str
    flops: float
    memory_bytes: float


def estimate(single_fn, params, x_one, aux, *, n1, n2, pairs, out_sizes, pair_sizes, symmetric):
    """Cost estimates of ``"jacobian"`` and ``"ntvp"`` for one call.

    Args:
      single_fn: ``f(params, x_i, aux)`` on one sample.
      x_one: one sample (ShapeDtypeStructs are fine).
      pairs: pairs of samples in the kernel (N1·N2, or N on the batch diagonal).
      out_sizes: output entries per sample, per output leaf.
      pair_sizes: kernel entries per pair of samples (or per sample on the batch
        diagonal), per output leaf.
      symmetric: x2 is x1 (Jacobians computed once).
    """
    closed = jax.make_jaxpr(single_fn)(params, x_one, aux)
    forward = max(jaxpr_flops(closed.jaxpr), 1.0)
    n_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
    itemsize = max((jax.numpy.dtype(p.dtype).itemsize for p in jax.tree.leaves(params)), default=4)
    out_total = sum(out_sizes)
    n_jac = n1 if symmetric else n1 + n2
    jac = CostEstimate(
        "jacobian",
        n_jac * out_total * 3 * forward + 2.0 * pairs * sum(pair_sizes) * n_params,
        float(n_jac * out_total * n_params * itemsize),
    )
    ntvp = CostEstimate(
        "ntvp",
        n2 * out_total * 3 * forward + pairs * out_total * 3 * forward,
        float(out_total * n_params * itemsize + n1 * out_total * max(out_sizes) * itemsize),
    )
    return jac, ntvp


def choose(jac: CostEstimate, ntvp: CostEstimate) -> str:
    if jac.memory_bytes > JACOBIAN_MEMORY_BUDGET:
        return "ntvp"
    return "jacobian" if jac.flops <= ntvp.flops else "ntvp"
