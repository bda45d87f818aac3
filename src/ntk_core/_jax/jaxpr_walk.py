"""Walking jaxprs (public ``jax.extend.core`` only): :func:`sub_jaxprs` / :func:`equations`
visit every jaxpr inside an equation's parameters; :func:`call_body` / :func:`inlined` give
the one body of a call-like equation, evaluated in place by an interpreter."""

from __future__ import annotations

import math

from jax.extend import core as jex
from jax.extend.core import primitives as prims

#: Call-like primitives whose sub-jaxpr is evaluated inline. jit and remat are public
#: primitive objects only in newer JAX (jax 0.4.35 has neither ``jit_p`` nor ``pjit_p`` nor
#: ``remat_p`` in ``jax.extend.core.primitives``): there they are matched by name.
_JIT = getattr(prims, "jit_p", None) or getattr(prims, "pjit_p", None)
_REMAT = getattr(prims, "remat_p", None)
_BY_NAME = frozenset(
    ({"pjit", "jit"} if _JIT is None else set())
    | ({"remat", "remat2", "checkpoint"} if _REMAT is None else set())
)
INLINE_PRIMITIVES = frozenset({prims.closed_call_p, prims.call_p, _JIT, _REMAT} - {None})


def is_literal(v) -> bool:
    """Whether an equation operand is a literal."""
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
    """The operands of ``eqn`` that ``sub``'s inputs receive: all (``jit``, ``scan``), all but
    the first (a ``cond`` branch), or None (a ``while`` loop's own constants)."""
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
    """``(jaxpr, consts)`` of an equation's ``jaxpr`` or ``call_jaxpr`` parameter, or None."""
    for name in ("jaxpr", "call_jaxpr"):
        sub = eqn.params.get(name)
        if isinstance(sub, jex.ClosedJaxpr):
            return sub.jaxpr, list(sub.consts)
        if isinstance(sub, jex.Jaxpr):
            return sub, []
    return None


def inlined(eqn) -> bool:
    """Whether ``eqn`` is a call (:data:`INLINE_PRIMITIVES`) evaluated in place."""
    call = eqn.primitive in INLINE_PRIMITIVES or eqn.primitive.name in _BY_NAME
    return call and call_body(eqn) is not None


def bind(eqn, invals):
    """The equation's primitive applied to ``invals`` with the equation's parameters."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    # Older JAX returns (sub-functions, params), newer JAX the params alone.
    old = isinstance(bound, tuple) and len(bound) == 2 and isinstance(bound[1], dict)
    subfuns, params = bound if old else ((), bound)
    return eqn.primitive.bind(*subfuns, *invals, **params)


def entries(v) -> int:
    """Entries of the array a jaxpr variable holds (0 without a shape: a token)."""
    shape = getattr(getattr(v, "aval", None), "shape", None)
    return math.prod(shape) if shape is not None else 0


def values_written(jaxpr) -> int:
    """Values one evaluation of ``jaxpr`` writes (its equations' outputs, each sub-jaxpr
    once): the forward pass's residuals, read by the cost model."""
    return sum(entries(v) for eqn in equations(jaxpr) for v in eqn.outvars)
