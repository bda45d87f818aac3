"""The structured rules (dot, conv, gather, elementwise), one module each, one registry.

A use ``y = op(x, view(W))`` with positions a (A), input coordinates c (C), units k (K)
and cotangent g_o[a, k] = ∂f_o/∂y[a, k] has ∂f_o/∂W[c, k] = Σ_a x[a, c] g_o[a, k], and two
uses of a leaf the Gram term Σ_ab (Σ_c x1[a, c] x2[b, c]) (Σ_k g1_o[a, k] g2_o'[b, k]).
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

#: The rules, in the order the analysis asks them (the first match decides).
REGISTRY: tuple[Rule, ...] = (DOT, CONV, GATHER, ELEMENTWISE)


def rule_for(primitive) -> Rule | None:
    """The first rule of :data:`REGISTRY` for ``primitive`` (an equation's), or None."""
    return next((rule for rule in REGISTRY if primitive in rule.primitives), None)
