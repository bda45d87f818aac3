"""Matrix products: ``y = dot_general(x, view(W))`` (Dense layers, einsum projections).

Matches a ``dot_general`` with one parameter operand (either side) seen through a view
that does not broadcast it, and no batch dimensions. The recorded input ``x`` is the
other operand with its free axes first: ``x[a, c]`` with ``a`` the free axes of ``x``
(A positions: the sample's batch axis of size 1, a sequence axis) and ``c`` its
contracted axes (C); ``k`` runs over the free axes of ``W`` (K units). Per sample and
output entry ``o``:

    ∂f_o/∂W[c, k] = Σ_a x[a, c] g_o[a, k]

and per pair of uses, Σ_ab (x1_a·x2_b)(g1_a·g2_b): a Dense layer on vectors (A = 1)
is (x1·x2)(g1·g2). A bias added right after it joins as a constant input column
(:attr:`DotRule.takes_bias`); with A = 1 in the Gram form, as a 1 added to the input
Gram matrix instead (its copy and odd width cost about 4% of the MLP 784-1000-1 kernel
on XLA CPU).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from ntk_core._structured.rules._base import (
    Rule,
    Use,
    broadcast_reason,
    broadcasts,
    scaled,
)


@dataclasses.dataclass(frozen=True)
class DotAxes:
    """The recorded input's axes: free (positions) and contracted (coordinates)."""

    x_free: tuple[int, ...]
    x_contract: tuple[int, ...]


class DotRule(Rule):
    """``dot_general`` with one parameter operand: inputs ``(N, A, C)``."""

    primitives = frozenset({"dot_general"})
    kind_names = {"dot": "matrix product"}
    takes_bias = True
    scales_input = True

    def match(self, eqn, ins, here, leaf_shapes):
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        w_side = 0 if ins[0] is not None else 1
        chain, factor = scaled(ins[w_side].chain)
        if lb or rb or broadcasts(chain):
            return None
        x_side = 1 - w_side
        x_var, w_var = eqn.invars[x_side], eqn.invars[w_side]
        x_contract = tuple(lc if x_side == 0 else rc)
        w_contract = tuple(rc if x_side == 0 else lc)
        x_free = tuple(a for a in range(len(x_var.aval.shape)) if a not in x_contract)
        w_free = tuple(a for a in range(len(w_var.aval.shape)) if a not in w_contract)
        y_ndim = len(eqn.outvars[0].aval.shape)
        # y = (x_free..., w_free...) for x on the left, (w_free..., x_free...) otherwise.
        if x_side == 0:
            y_perm = tuple(range(y_ndim))
        else:
            y_perm = tuple(range(len(w_free), y_ndim)) + tuple(range(len(w_free)))
        return Use(
            rule=self,
            kind="dot",
            path=here,
            leaf=ins[w_side].leaf,
            x_side=x_side,
            key=("dot", chain, w_contract, w_free, x_side),
            y_shape=tuple(eqn.outvars[0].aval.shape),
            y_dtype=str(eqn.outvars[0].aval.dtype),
            y_perm=y_perm,
            a_size=math.prod(x_var.aval.shape[a] for a in x_free),
            w_free_size=math.prod(w_var.aval.shape[a] for a in w_free),
            x_contract_size=math.prod(x_var.aval.shape[a] for a in x_contract),
            info=DotAxes(x_free, x_contract),
            factor=factor,
        )

    def miss_reason(self, eqn, ins):
        reason = broadcast_reason(eqn, ins)
        if reason is not None:
            return reason
        (_, _), (lb, rb) = eqn.params["dimension_numbers"]
        if lb or rb:
            return "a matrix product batched over the parameter's axes"
        return f"a {eqn.primitive.name} that no rule covers"

    def input_features(self, use, x, bias_column):
        """``(N, A, C)``: the free axes, then the contracted ones (and a column of
        ones for a fused bias)."""
        axes = use.info
        perm = (0,) + tuple(1 + a for a in axes.x_free) + tuple(1 + a for a in axes.x_contract)
        x = jnp.transpose(x, perm).reshape((x.shape[0], use.a_size, -1))
        if bias_column:  # the fused bias: a constant input column
            x = jnp.concatenate([x, jnp.ones(x.shape[:2] + (1,), x.dtype)], axis=-1)
        return x

    def jacobian(self, use, xj, g, biased):
        """``J[c, k] = Σ_a x[a, c] g[a, k]`` per sample and output entry: ``(N, *O, C, K)``.

        Written as the batched matrix product whose natural output is ``(N, C, O, K)``
        (other output orders make XLA on CPU copy the large input operand first).
        """
        lead = g.shape[:-2]
        g3 = g.reshape((g.shape[0], -1) + g.shape[-2:])  # (N, O, A, K)
        j = jnp.einsum(f"{self.x_spec('n', 'a', 'c')},noak->ncok", xj, g3)
        return jnp.moveaxis(j, 1, 2).reshape(lead + (j.shape[1], j.shape[3]))

    def bias_in_gram(self, use: Use) -> bool:
        """A Dense layer on vectors (A = 1): (x·x' + 1)(g·g')."""
        return use.a_size == 1


DOT = DotRule()
