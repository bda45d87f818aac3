"""Elementwise scales ``x * view(s)`` and shifts ``x ± view(b)`` (norm layers, unfused
biases). The view's constant axes are the positions (A), the others the units (K), which
must hold each leaf entry once: ∂f_o/∂s[σ(k)] = Σ_a ∂f_o/∂v[a, k]. The probe sits on the
operand v, so the reverse pass reduces it; always the explicit form (C = 1), in leaf order."""

from __future__ import annotations

import collections
import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives as prims

from ntk_core._jax.jaxpr_walk import is_literal
from ntk_core._structured.rules._base import Probe, Rule, Use, scaled, view_index


@dataclasses.dataclass(frozen=True)
class Broadcast:
    operand: int  # the probed parameter operand
    leaf_order: tuple[int, ...]  # the unit holding each leaf entry; (): unit k holds k


class ElementwiseRule(Rule):
    """``mul``, ``add``, ``sub`` of a non-parameter and a parameter view."""

    primitives = frozenset({prims.mul_p, prims.add_p, prims.sub_p})
    kind_names = {"scale": "elementwise scale", "shift": "elementwise shift"}
    has_gram_form = False

    def match(self, eqn, ins, here, leaf_shapes):
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
        kind = "scale" if eqn.primitive is prims.mul_p else "shift"
        key, info = (tuple(leaf_shape),), Broadcast(w_side, leaf_order)
        y = eqn.invars[w_side]  # the probe sits on the parameter operand
        sizes = (a_size, size, 1)
        return self.use(here, view.leaf, 1 - w_side, key, y, v_perm, sizes, info, factor, kind)

    def miss_reason(self, eqn, ins):
        name = eqn.primitive.name
        return f"an elementwise {name} whose broadcast repeats or drops parameter entries"

    def bias_target(self, eqn, use: Use):
        """``y`` of ``y + view(b)`` (a bias that may fuse with ``y``'s product)."""
        y = eqn.invars[use.x_side]
        return y if eqn.primitive is prims.add_p and not is_literal(y) else None

    def probe(self, use, delta):
        return Probe(use.x_side, delta, use.info.operand)

    def input_features(self, use, x, bias_column):
        raise NotImplementedError("elementwise scales and shifts have no Gram form")

    def jacobian_input(self, use, x, bias_column):
        return None  # the Jacobian is the reduced cotangent alone

    def jacobian(self, use, xj, g, biased):
        """``Σ_a g[a, k]`` in the leaf's order: ``(N, *O, K)``."""
        leaf_order = use.info.leaf_order
        j = g[..., 0, :] if use.a_size == 1 else jnp.sum(g, axis=-2)
        return j[..., np.asarray(leaf_order)] if leaf_order else j

    def label(self, uses):
        counts = collections.Counter(use.name for use in uses)  # first-seen order
        return " and ".join(n if c == 1 else f"{c} {n}s" for n, c in counts.items())


ELEMENTWISE = ElementwiseRule()
