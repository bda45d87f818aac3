"""Elementwise scales and shifts: ``y = x * view(s)`` (``"scale"``: LayerNorm /
BatchNorm scale, in either operand order) and ``y = x + view(b)``, ``x - view(b)``,
``view(b) - x`` (``"shift"``: LayerNorm / BatchNorm bias, any bias not fused with a
product), with exactly one operand a parameter view ``v = view(s)``.

Matches when every leaf entry appears at the same places in every row of ``v`` seen as
(positions a, units k): the axes along which ``v`` is constant (a broadcast) are the
positions (A), the others the units (K), which must hold each leaf entry exactly once
(decided exactly by replaying the view on the entry indices). With σ(k) the leaf entry
on unit k:

    ∂f_o/∂s[σ(k)] = Σ_a ∂f_o/∂v[a, k]

The probe δ sits on the operand ``v`` itself (before the operation broadcasts it), so
the reverse pass forms ∂f_o/∂v = Σ_broadcast x·g_o (scale) or ±Σ g_o (shift) already
reduced, and the cotangent at ``y`` is never written out. The scale's ``x`` is whatever
it is multiplied by first: Flax and Haiku compute ``(x - mean) * (rsqrt(var + eps) *
s)``, so the use is the product ``rsqrt(var + eps) * s`` (input-dependent in LayerNorm,
running statistics in eval-mode BatchNorm); exact either way.

Always the explicit form (C = 1, no Gram form): the Gram form's A_u·A_v·O'·K per pair
is never cheaper than the explicit O'·K. The per-sample Jacobian costs what the
fallback's joint reverse pass would (the same reduction, now labelled and available to
per-leaf kernels); recording ``x`` and the cotangent at ``y`` instead writes out
N·O·A·K values per use (a full feature map per BatchNorm), which was no faster in the
ResNet benchmark. All uses of one leaf form their Jacobians in the leaf's own order, so
scales and shifts of one leaf (through any views) sum exactly.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from ntk_core._jax.jaxpr_walk import is_literal
from ntk_core._structured.rules._base import Probe, Rule, Use, scaled, view_index


@dataclasses.dataclass(frozen=True)
class Broadcast:
    """Where the leaf sits in the operation."""

    operand: int  # the probed parameter operand
    #: The unit holding each leaf entry, or () when unit k holds entry k.
    leaf_order: tuple[int, ...]


class ElementwiseRule(Rule):
    """``mul``, ``add``, ``sub`` of a non-parameter and a parameter view."""

    primitives = frozenset({"mul", "add", "sub"})
    kind_names = {"scale": "elementwise scale", "shift": "elementwise shift"}
    has_gram_form = False

    def match(self, eqn, ins, here, leaf_shapes):
        """Structured when the view puts every leaf entry once in each row of units
        (module docstring); None otherwise."""
        w_side = 0 if ins[0] is not None else 1
        view = ins[w_side]
        leaf_shape = leaf_shapes[view.leaf]
        _, factor = scaled(view.chain)
        v_shape = tuple(eqn.invars[w_side].aval.shape)
        size = math.prod(leaf_shape)
        if size == 0:
            return None
        try:
            idx = view_index(view.eqns, leaf_shape)
        except Exception:  # an unexpected view: not structured
            return None
        if idx.shape != v_shape:
            return None
        units = tuple(d for d in range(len(v_shape)) if not (idx == idx.take([0], axis=d)).all())
        positions = tuple(d for d in range(len(v_shape)) if d not in units)
        v_perm = positions + units
        a_size = math.prod(v_shape[d] for d in positions)
        k_size = math.prod(v_shape[d] for d in units)
        row = np.transpose(idx, v_perm).reshape(a_size, k_size)[0]
        if k_size != size or not np.array_equal(np.sort(row), np.arange(size)):
            return None  # a leaf entry repeated over units (or missing): fall back
        order = np.argsort(row)
        leaf_order = () if np.array_equal(order, np.arange(size)) else tuple(int(i) for i in order)
        return Use(
            rule=self,
            kind="scale" if eqn.primitive.name == "mul" else "shift",
            path=here,
            leaf=view.leaf,
            x_side=1 - w_side,
            # Jacobians in the leaf's order: uses pair up.
            key=("elementwise", tuple(leaf_shape)),
            y_shape=v_shape,  # the probe's shape: the operand's, not the output's
            y_dtype=str(eqn.invars[w_side].aval.dtype),
            y_perm=v_perm,
            a_size=a_size,
            w_free_size=size,
            x_contract_size=1,
            info=Broadcast(w_side, leaf_order),
            factor=factor,
        )

    def miss_reason(self, eqn, ins):
        name = eqn.primitive.name
        return f"an elementwise {name} whose broadcast repeats or drops parameter entries"

    def bias_target(self, eqn, use: Use):
        """``y`` of ``y + view(b)``: a bias fuses with the product that computed ``y``."""
        y = eqn.invars[use.x_side]
        if eqn.primitive.name == "add" and not is_literal(y):
            return y
        return None

    def probe(self, use, delta):
        """δ on the parameter operand: the reverse pass gives the reduced ∂f/∂v."""
        return Probe(use.x_side, delta, use.info.operand)

    def input_features(self, use, x, bias_column):
        raise NotImplementedError("elementwise scales and shifts have no Gram form")

    def jacobian_input(self, use, x, bias_column):
        return None  # the Jacobian is the reduced cotangent alone

    def jacobian(self, use, xj, g, biased):
        """In the leaf's order, ``(N, *O, K)``, from the cotangents at the parameter
        operand ``(N, *O, A, K)`` (Σ_broadcast x·g and ±Σ g already reduced by the
        reverse pass): ``Σ_a g[a, k]``."""
        leaf_order = use.info.leaf_order
        j = g[..., 0, :] if use.a_size == 1 else jnp.sum(g, axis=-2)
        return j[..., np.asarray(leaf_order)] if leaf_order else j

    def label(self, uses):
        """e.g. ``"elementwise scale"``, ``"2 elementwise shifts"``, joined by "and"."""
        counts: dict[str, int] = {}
        for use in uses:
            counts[use.name] = counts.get(use.name, 0) + 1
        return " and ".join(n if c == 1 else f"{c} {n}s" for n, c in counts.items())


ELEMENTWISE = ElementwiseRule()
