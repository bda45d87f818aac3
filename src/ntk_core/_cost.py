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
* ``"structured"``: (N1 + N2)·O·3F for the cotangents and fallback Jacobians, plus
  per pair 2·O'·P_fallback and, per structured leaf, the cheaper of its Gram form
  Σ_{u,v} 2·A_u·A_v·(C + O'·K) (or 2·(A_u·A_v·(C + O·K) + O'·A·K) when that order is
  cheaper; a gather's token match counts C = 1), plus
  ``_structured.GRAM_VALUE_FLOPS`` per value its memory-bound einsums write (the
  input Gram matrix, the intermediate, the output) when A_u·A_v > 1, and its explicit
  form 2·O'·C·K (``_structured.choose_modes``, the choice the computation makes), the
  explicit form adding 2·O·A·C·K per sample and use to build the Jacobian (and A·C to
  slice a convolution's patches); memory (N1 + N2)·(O·P_fallback + per structured leaf
  Σ_u A_u·(C + O·K) in the Gram form, O·C·K in the explicit one).

``"auto"`` takes the cheapest in FLOPs among those whose features fit in
:data:`JACOBIAN_MEMORY_BUDGET` bytes (``"ntvp"`` if none does).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.extend import core as jex_core

from ._structured import choose_modes, pair_costs

#: Bytes of per-sample Jacobians above which ``"auto"`` avoids ``"jacobian"``.
JACOBIAN_MEMORY_BUDGET = 4 * 2**30


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one parameter leaf enters the kernel."""

    path: str  # e.g. "['Dense_0']['kernel']"
    size: int
    method: str  # "structured (1 matrix product)", "jacobian (fallback)", "ntvp", ...


@dataclasses.dataclass(frozen=True)
class Plan:
    """What an NTK call does: the implementation used, every estimate, each leaf."""

    implementation: str
    estimates: tuple  # CostEstimate for each implementation considered
    leaves: tuple[LeafPlan, ...]

    def __str__(self) -> str:
        lines = [f"implementation: {self.implementation}"]
        for e in self.estimates:
            mib = e.memory_bytes / 2**20
            lines.append(f"  {e.implementation:<10} {e.flops:12.3e} FLOPs  {mib:10.1f} MiB")
        for leaf in self.leaves:
            lines.append(f"  {leaf.path:<40} {leaf.size:>10}  {leaf.method}")
        return "\n".join(lines)


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


def estimate(
    single_fn, params, x_one, aux, *, n1, n2, pairs, out_sizes, pair_sizes, symmetric, analysis
):
    """Cost estimates of ``"jacobian"`` and ``"ntvp"`` for one call.

    Args:
      single_fn: ``f(params, x_i, aux)`` on one sample.
      x_one: one sample (ShapeDtypeStructs are fine).
      pairs: pairs of samples in the kernel (N1·N2, or N on the batch diagonal).
      out_sizes: output entries per sample, per output leaf.
      pair_sizes: kernel entries per pair of samples (or per sample on the batch
        diagonal), per output leaf.
      symmetric: x2 is x1 (Jacobians computed once).
      analysis: the structured analysis of ``single_fn`` (``_structured.Analysis``).

    Returns:
      Estimates for ``"jacobian"``, ``"ntvp"`` and ``"structured"``.
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
    leaf_sizes = [math.prod(p.shape) for p in jax.tree.leaves(params)]
    p_fallback = sum(leaf_sizes[i] for i in analysis.fallback)
    o_pair = sum(pair_sizes)
    per_pair = 2.0 * o_pair * p_fallback
    per_sample = out_total * p_fallback  # values stored per sample
    per_sample_flops = 0.0  # beyond the reverse pass
    for group, mode in zip(analysis.groups, choose_modes(analysis, o_pair, out_total), strict=True):
        gram, explicit = pair_costs(analysis, group, o_pair, out_total)
        for u in group:
            use = analysis.uses[u]
            a, c, k = use.a_size, analysis.input_size(u), use.w_free_size
            if use.kind == "conv":  # patches
                per_sample_flops += a * c
            if mode == "explicit":
                per_sample_flops += 2.0 * out_total * a * c * k
        if mode == "explicit":
            use = analysis.uses[group[0]]
            per_sample += out_total * analysis.input_size(group[0]) * use.w_free_size
            per_pair += explicit
        else:
            for u in group:
                use = analysis.uses[u]
                c = 1 if use.kind == "gather" else analysis.input_size(u)
                per_sample += use.a_size * (c + out_total * use.w_free_size)
            per_pair += gram
    structured = CostEstimate(
        "structured",
        n_jac * (out_total * 3 * forward + per_sample_flops) + pairs * per_pair,
        float(n_jac * per_sample * itemsize),
    )
    return jac, ntvp, structured


def choose(estimates) -> str:
    """The cheapest estimate in FLOPs whose memory fits the budget (else ``"ntvp"``)."""
    fitting = [e for e in estimates if e.memory_bytes <= JACOBIAN_MEMORY_BUDGET]
    if not fitting:
        return "ntvp"
    return min(fitting, key=lambda e: e.flops).implementation
