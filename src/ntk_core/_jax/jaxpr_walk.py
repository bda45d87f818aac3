"""Walking jaxprs: the equations of a jaxpr and of the sub-jaxprs inside them.

Shared by the structured analysis and interpreter (:mod:`ntk_core._structured.analysis`), the
precision checks (:mod:`ntk_core._jax.environment`) and the cost model
(:mod:`ntk_core._impl.cost`). Built on public ``jax.extend.core`` objects only.

Two views of a sub-jaxpr:

* :func:`sub_jaxprs` / :func:`equations`: every jaxpr in an equation's parameters
  (``jit``, ``custom_jvp``, ``scan``, both branches of ``cond``, ...), for checks that
  look at every equation wherever it runs (:func:`sub_operands`: which of the
  equation's operands a sub-jaxpr's inputs receive, for walks that follow values into
  it, such as the cost model's);
* :func:`call_body` / :func:`inlined`: the one body of a call-like equation (``jit``,
  ``closed_call``, ``checkpoint``) whose inputs and outputs are the equation's own, so
  that an interpreter can evaluate it in place.
"""

from __future__ import annotations

import math

from jax.extend import core as jex

#: Call-like primitives whose sub-jaxpr is evaluated inline.
INLINE_PRIMITIVES = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint"}
)


def is_literal(v) -> bool:
    """Whether an equation operand is a literal (a constant written into the jaxpr)."""
    return isinstance(v, jex.Literal)


def sub_jaxprs(eqn):
    """The jaxprs inside an equation's parameters (jit, custom_jvp, scan, cond, ...)."""
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jex.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex.Jaxpr):
                yield item


def sub_operands(eqn, sub):
    """The operands of ``eqn`` that the inputs of its sub-jaxpr ``sub`` receive, told by
    their count: all of them (``jit``, ``scan``, ``custom_jvp``), all but the first
    (a ``cond`` branch: the index comes first), or None when the counts match neither
    (a ``while`` loop's condition and body, which take their own constants)."""
    if len(sub.invars) == len(eqn.invars):
        return list(eqn.invars)
    if len(sub.invars) == len(eqn.invars) - 1:
        return list(eqn.invars[1:])
    return None


def equations(jaxpr):
    """Every equation of a jaxpr, those of its sub-jaxprs included (depth first)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for inner in sub_jaxprs(eqn):
            yield from equations(inner)


def call_body(eqn):
    """``(jaxpr, consts)`` of an equation's ``jaxpr`` or ``call_jaxpr`` parameter (the
    body of ``jit``, ``closed_call``, ``checkpoint``, ``custom_jvp_call``, ``scan``),
    or None."""
    for name in ("jaxpr", "call_jaxpr"):
        sub = eqn.params.get(name)
        if isinstance(sub, jex.ClosedJaxpr):
            return sub.jaxpr, list(sub.consts)
        if isinstance(sub, jex.Jaxpr):
            return sub, []
    return None


def inlined(eqn) -> bool:
    """Whether ``eqn`` is a call (:data:`INLINE_PRIMITIVES`) whose body is evaluated in
    place: its operands are the body's inputs, its outputs the body's."""
    return eqn.primitive.name in INLINE_PRIMITIVES and call_body(eqn) is not None


def bind(eqn, invals):
    """The equation's primitive applied to ``invals`` with the equation's parameters."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    # Older JAX returns (sub-functions, params), newer JAX the params alone.
    if isinstance(bound, tuple) and len(bound) == 2 and isinstance(bound[1], dict):
        subfuns, params = bound
    else:
        subfuns, params = (), bound
    return eqn.primitive.bind(*subfuns, *invals, **params)


def entries(v) -> int:
    """Entries of the array a jaxpr variable holds (0 without a shape: a token)."""
    shape = getattr(getattr(v, "aval", None), "shape", None)
    return math.prod(shape) if shape is not None else 0


def values_written(jaxpr) -> int:
    """Values one evaluation of ``jaxpr`` writes: its equations' outputs, each
    sub-jaxpr counted once (the forward pass's residuals; a reverse pass writes about
    as many cotangents). Read by the cost model and the features' chunk size."""
    total = 0
    for eqn in jaxpr.eqns:
        total += sum(entries(v) for v in eqn.outvars)
        for sub in sub_jaxprs(eqn):
            total += values_written(sub)
    return total
