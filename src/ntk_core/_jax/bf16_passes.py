"""float32 products at HIGHEST written as six bfloat16 products at DEFAULT (TPUs).

A TPU's matrix unit multiplies bfloat16 (8-bit mantissa) and accumulates in float32.
``precision=HIGHEST`` on float32 operands asks it for float32 accuracy, which it gets
from six bfloat16 passes: each operand is cut into three bfloat16 parts whose sum is the
float32 value (24 mantissa bits = 3 x 8), and the products of parts whose orders add up to
at most 2 are summed,

    a·b ≈ a_hi·b_hi + a_hi·b_mid + a_mid·b_hi + a_hi·b_lo + a_lo·b_hi + a_mid·b_mid,

dropping terms of relative size ≤ 2^-24 (Henry, Tang & Heinecke, "Leveraging the bfloat16
artificial intelligence datatype for higher-precision computations", ARITH 2019).

Written out here, each pass a plain bfloat16 product at DEFAULT, the same arithmetic
compiles several times faster on a TPU v5e (jax 0.10.2): XLA's HIGHEST form of the MLP's
10 000 x 784 @ 784 x 1 000 product compiles in 12.0-12.4 s, the six passes in 4.6 s, at
the same error (1.6e-7 against 1.4e-7 vs float64) and run time (benchmarks/README.md,
"Why the MLP's first call takes 19-24 s"). The parts are cut by clearing mantissa bits,
not by rounding through bfloat16: XLA folds a float32 -> bfloat16 -> float32 round trip
away (excess precision), which leaves DEFAULT's error (2.3e-3).

:func:`rewrite` applies it to every float32 ``dot_general`` and ``conv_general_dilated``
at HIGHEST in a traced function (both are bilinear, so the split holds for each), inside
loops, conditionals and calls; everything else is bound unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex
from jax.extend.core import primitives as prims

from ntk_core._jax.jaxpr_walk import bind, call_body, inlined, is_literal

#: Whether the library's programs use the six passes: None on TPUs only, False (the default
#: until measured on a TPU across issue 51's cases),
#: True or False everywhere (benchmarks compare both; tests run them on the CPU).
ENABLED: bool | None = False
#: The parts' dtype: None (bfloat16, float32 on the CPU), or a dtype name (benchmarks).
PARTS: str | None = None
_PRODUCTS = frozenset({prims.dot_general_p, prims.conv_general_dilated_p})
#: The six (a part, b part) pairs, smallest terms first (summed in that order).
_PASSES = ((2, 0), (0, 2), (1, 1), (1, 0), (0, 1), (0, 0))
_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


def active() -> bool:
    """Whether the library's programs are rewritten now (:data:`ENABLED`; the backend is
    asked at call time, never at import)."""
    return jax.default_backend() == "tpu" if ENABLED is None else ENABLED


def _top16(x):
    """x with the low 16 bits of its float32 pattern cleared: exact in bfloat16."""
    bits = lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def split3(x, dtype=jnp.bfloat16):
    """float32 ``x`` as (hi, mid, lo), each exact in bfloat16, with hi + mid + lo = x
    (exactly for normal numbers; parts below bfloat16's normal range are flushed on TPUs,
    an error of at most 2^-126 absolute), held as ``dtype`` (bfloat16, or float32: XLA's
    CPU runs no bfloat16 x bfloat16 -> float32 products)."""
    hi = _top16(x)
    rest = x - hi
    mid = _top16(rest)
    lo = rest - mid
    return tuple(part.astype(dtype) for part in (hi, mid, lo))


def _part_dtype():
    if PARTS is not None:
        return jnp.dtype(PARTS)
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def _is_highest_f32(eqn) -> bool:
    if eqn.primitive not in _PRODUCTS:
        return False
    dtypes = {v.aval.dtype for v in eqn.invars}
    return dtypes == {jnp.dtype(jnp.float32)} and eqn.params.get("precision") == _HIGHEST


def _six_passes(eqn, a, b):
    """``eqn``'s product of float32 ``a`` and ``b`` as six bfloat16 products at DEFAULT."""
    params = dict(eqn.params, precision=None, preferred_element_type=jnp.dtype(jnp.float32))
    dtype = _part_dtype()
    a3, b3 = split3(a, dtype), split3(b, dtype)
    out = None
    for i, j in _PASSES:
        term = eqn.primitive.bind(a3[i], b3[j], **params)
        out = term if out is None else out + term
    return out


def _avals(variables):
    return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
            for v in variables]  # fmt: skip


def _closed(closed):
    """A ClosedJaxpr with the same signature, its products rewritten."""
    fn = functools.partial(evaluate, closed.jaxpr, list(closed.consts))
    return jax.make_jaxpr(lambda *args: fn(*args))(*_avals(closed.jaxpr.invars))


def _params(params: dict) -> dict:
    """``params`` with each ClosedJaxpr inside (scan, while, cond bodies) rewritten."""
    out = {}
    for name, value in params.items():
        if isinstance(value, jex.ClosedJaxpr):
            value = _closed(value)
        elif isinstance(value, (tuple, list)) and any(
            isinstance(v, jex.ClosedJaxpr) for v in value
        ):
            value = type(value)(_closed(v) if isinstance(v, jex.ClosedJaxpr) else v for v in value)
        out[name] = value
    return out


def evaluate(jaxpr, consts, *args):
    """The values of ``jaxpr``'s outputs, with its HIGHEST float32 products (and those of
    the calls, loops and branches inside) as six bfloat16 passes."""
    env = {}

    def read(v):
        return v.val if is_literal(v) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if _is_highest_f32(eqn):
            outs = [_six_passes(eqn, *invals)]
        elif inlined(eqn):  # jit, remat, closed calls: evaluated in place
            body, body_consts = call_body(eqn)
            outs = evaluate(body, body_consts, *invals)
        elif eqn.primitive.name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
            body, body_consts = call_body(eqn)  # no derivative is taken after this
            outs = evaluate(body, body_consts, *invals)
        else:
            rewritten = eqn.replace(params=_params(eqn.params))
            outs = bind(rewritten, invals)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def rewrite(fn, static_argnames=()):
    """``fn`` with every float32 product at HIGHEST (``dot_general``, ``conv_general_dilated``)
    computed as six bfloat16 products at DEFAULT. Call it inside ``jax.jit`` (with the same
    ``static_argnames``): it traces ``fn`` once per trace of the jit. The other arguments
    are pytrees of arrays."""

    @functools.wraps(fn)
    def rewritten(*args, **kwargs):
        static = {k: v for k, v in kwargs.items() if k in static_argnames}
        dynamic = {k: v for k, v in kwargs.items() if k not in static_argnames}
        bound = functools.partial(fn, **static)
        closed, shape = jax.make_jaxpr(bound, return_shape=True)(*args, **dynamic)
        leaves = jax.tree.leaves((args, dynamic))
        outs = evaluate(closed.jaxpr, list(closed.consts), *leaves)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return rewritten
