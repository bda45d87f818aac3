"""Matrix products ``y = dot_general(x, view(W))`` (no batch dims, W not broadcast): ``a``
the free axes of x, ``c`` its contracted axes, ``k`` the free axes of W. A Dense layer on
vectors (A = 1) is (x1·x2)(g1·g2); its fused bias adds 1 to x1·x2 instead of a column."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax.extend.core import primitives as prims

from ntk_core._structured.rules._base import Rule, Use, broadcast_reason, broadcasts, scaled


@dataclasses.dataclass(frozen=True)
class DotAxes:
    x_free: tuple[int, ...]
    x_contract: tuple[int, ...]


class DotRule(Rule):
    """``dot_general`` with one parameter operand: inputs ``(N, A, C)``."""

    primitives = frozenset({prims.dot_general_p})
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
        shape = x_var.aval.shape
        a, c = math.prod(shape[d] for d in x_free), math.prod(shape[d] for d in x_contract)
        sizes = (a, math.prod(w_var.aval.shape[d] for d in w_free), c)
        key, info = (chain, w_contract, w_free, x_side), DotAxes(x_free, x_contract)
        y = eqn.outvars[0]
        return self.use(here, ins[w_side].leaf, x_side, key, y, y_perm, sizes, info, factor)

    def miss_reason(self, eqn, ins):
        (_, _), (lb, rb) = eqn.params["dimension_numbers"]
        if (lb or rb) and broadcast_reason(eqn, ins) is None:
            return "a matrix product batched over the parameter's axes"
        return super().miss_reason(eqn, ins)

    def input_features(self, use, x, bias_column):
        """``(N, A, C)``: free axes, then contracted ones (and a bias column of ones)."""
        axes = use.info
        perm = (0,) + tuple(1 + a for a in axes.x_free) + tuple(1 + a for a in axes.x_contract)
        c = math.prod(x.shape[1 + a] for a in axes.x_contract)  # not -1: C may be 0
        x = jnp.transpose(x, perm).reshape((x.shape[0], use.a_size, c))
        if bias_column:
            x = jnp.concatenate([x, jnp.ones(x.shape[:2] + (1,), x.dtype)], axis=-1)
        return x

    def jacobian(self, use, xj, g, biased):
        """``J[c, k] = Σ_a x[a, c] g[a, k]``: ``(N, *O, C, K)``, via ``(N, C, O, K)`` (no copy)."""
        lead = g.shape[:-2]
        g3 = g.reshape((g.shape[0], math.prod(lead[1:])) + g.shape[-2:])  # (N, O, A, K)
        j = jnp.einsum(f"{self.x_spec('n', 'a', 'c')},noak->ncok", xj, g3)
        return jnp.moveaxis(j, 1, 2).reshape(lead + (j.shape[1], j.shape[3]))

    def bias_in_gram(self, use: Use) -> bool:
        """A Dense layer on vectors (A = 1): (x·x' + 1)(g·g')."""
        return use.a_size == 1


DOT = DotRule()
