"""The structured rules: one module per primitive family, one registry.

Every rule writes the per-sample Jacobian of a weight use ``y = op(x, view(W))`` as a
product of the use's input ``x[a, c]`` and the cotangent ``g_o[a, k] = ∂f_o/∂y[a, k]``
(positions a: A, input coordinates c: C, units k: K):

    ∂f_o/∂W[c, k] = Σ_a x[a, c] g_o[a, k]

and the NTK of two uses of one leaf as the Gram identity
Σ_ab (Σ_c x1[a, c] x2[b, c]) (Σ_k g1_o[a, k] g2_o'[b, k]), or from that Jacobian.

* ``dot.py``: ``dot_general`` (Dense, einsum projections; "matrix product"),
* ``conv.py``: ``conv_general_dilated`` on its kernel, via input patches
  ("convolution"),
* ``gather.py``: ``gather`` of table rows, via token matches ("embedding gather"),
* ``elementwise.py``: ``mul``, ``add``, ``sub`` by a broadcast parameter (norm scales
  and shifts, unfused biases; "elementwise scale" / "elementwise shift").

The interface is :class:`Rule` (in ``_base.py``): ``match`` / ``miss_reason`` for the
analysis, ``probe`` / ``evaluate`` / ``input_features`` / ``jacobian_input`` /
``jacobian`` for the per-sample features, ``gram_term`` / ``gram_input_width`` for the
pairwise part, ``kind_names`` / ``label`` for ``plan()``; a rule records what it knows
of an equation in a typed payload (:attr:`Use.info`).

**Adding a rule touches one file (its module, exporting one :class:`Rule` instance)
plus one line in** :data:`REGISTRY`. The analysis asks, for each equation with exactly
one parameter operand, the first rule of :data:`REGISTRY` whose ``primitives`` hold the
equation's primitive; the features and the pairwise part ask each use's own rule
(:attr:`Use.rule`). Test a new rule in ``tests/core/test_structured.py`` against the
Jacobian contraction and the float64 reference. ``_cost.py`` costs its uses from their
shapes (A, C, K), like a matrix product's, unless it is given a term of its own there.
"""

from __future__ import annotations

from ntk_core._structured.rules._base import Probe as Probe
from ntk_core._structured.rules._base import Rule as Rule
from ntk_core._structured.rules._base import Subscripts as Subscripts
from ntk_core._structured.rules._base import Use as Use
from ntk_core._structured.rules._base import View as View
from ntk_core._structured.rules.conv import CONV
from ntk_core._structured.rules.dot import DOT
from ntk_core._structured.rules.elementwise import ELEMENTWISE
from ntk_core._structured.rules.gather import GATHER

#: The rules, in the order the analysis asks them (the first whose ``primitives`` hold
#: an equation's primitive decides).
REGISTRY: tuple[Rule, ...] = (
    DOT,
    CONV,
    GATHER,
    ELEMENTWISE,
)


def rule_for(primitive: str, rules: tuple[Rule, ...] | None = None) -> Rule | None:
    """The first rule of ``rules`` (default: :data:`REGISTRY`, read at call time)
    whose ``primitives`` hold ``primitive``, or None."""
    for rule in REGISTRY if rules is None else rules:
        if primitive in rule.primitives:
            return rule
    return None
