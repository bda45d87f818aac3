"""Which axis of each value of a model's jaxpr holds the samples: a proof, primitive by
primitive, that row i of every output reads only row i of x (:func:`rows_separate`), so
that the independence probe (:mod:`ntk_core._kernel.probe`) compiles nothing for the
models it covers: dense, convolution, pooling, attention, normalisation over features,
embeddings, vmapped per-sample models; and, from the jaxprs on two batch sizes
(:func:`sized_by_n`), that N enters only as the samples' axis, never as a number the samples
see (``x / N``, ``jnp.arange(N)``, ``ones(N).sum()``, ``pos[:N]`` fail it)."""

from __future__ import annotations

import numpy as np
from jax.extend import core as jex
from jax.extend.core import primitives as prims

from ntk_core._jax.jaxpr_walk import call_body, inlined, is_literal

#: Primitives applied entry by entry (size-1 axes broadcast): the samples stay on their axis.
_ELEMENTWISE = frozenset(
    "abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp conj "
    "convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 "
    "expm1 floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max min "
    "mul ne neg nextafter not or pow real reduce_precision rem round rsqrt select_n "
    "sharding_constraint sign sin sinh sqrt square stop_gradient sub tan tanh xor "
    "bitcast_convert_type shift_left shift_right_arithmetic shift_right_logical".split()
)
_REDUCTIONS = frozenset(
    "argmax argmin reduce_and reduce_max reduce_min reduce_or reduce_prod reduce_sum".split()
)
#: Primitives along one axis (parameter ``axis`` or ``dimension``): any axis but the samples'.
_ALONG = frozenset("concatenate cumlogsumexp cummax cummin cumprod cumsum sort split".split())
_WINDOWS = frozenset(
    "reduce_window_max reduce_window_min reduce_window_sum select_and_gather_add".split()
)
_CUSTOM = (prims.custom_jvp_call_p,)  # custom_vjp: its backward pass is not a jaxpr here
#: The parameters that hold sizes (may scale with N); every other integer (an axis, a
#: loop's length, a precision's bits) must be equal on both batch sizes.
_SIZES = frozenset("shape new_sizes sizes slice_sizes limit_indices".split())
#: Random draws: one per sample along an axis of size N, as a batch of one draws (the
#: adapters' documented rngs= rule: every sample sees the same key).
_RANDOM = frozenset("random_bits rng_bit_generator rng_uniform".split())


def _dot_axis(p, shape, la, ra) -> int | None:
    """``dot_general``'s output axis of the samples (on lhs axis ``la``, rhs axis ``ra``)."""
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    lb, rb = list(lb), list(rb)
    if la is not None and ra is not None:  # both carry samples: paired as one batch axis
        return lb.index(la) if la in lb and ra in rb and lb.index(la) == rb.index(ra) else None
    if la is not None:
        free = [d for d in range(len(shape[0])) if d not in lc and d not in lb]
        return len(lb) + free.index(la) if la in free else None
    free = [d for d in range(len(shape[1])) if d not in rc and d not in rb]
    lhs_free = len(shape[0]) - len(lc) - len(lb)
    return len(lb) + lhs_free + free.index(ra) if ra in free else None


def _sample_axis(eqn, axes: list) -> int | None:
    """The axis of the equation's outputs that holds the samples, where ``axes`` holds its
    operands' (None: reads no sample); None where the equation may mix samples or is not
    covered."""
    p, name = eqn.params, eqn.primitive.name
    shape = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    if name == "dot_general":
        return _dot_axis(p, shape, axes[0], axes[1])
    found = {a for a in axes if a is not None}
    if len(found) != 1:
        return None
    (k,) = found
    if name in _ELEMENTWISE:
        rank = len(eqn.outvars[0].aval.shape)
        ranks = {len(s) for s, a in zip(shape, axes, strict=True) if a is not None}
        return k if ranks == {rank} else None
    if name in _REDUCTIONS or name == "squeeze":
        gone = p["axes"] if name in _REDUCTIONS else p["dimensions"]
        return None if k in gone else k - sum(d < k for d in gone)
    if name in _ALONG:
        return None if p.get("axis", p.get("dimension")) == k else k
    if name == "rev":
        return None if k in p["dimensions"] else k
    if name == "transpose":
        return list(p["permutation"]).index(k)
    if name == "reshape":  # row-major: the axes up to the samples' unchanged
        same = p.get("dimensions") is None and p["new_sizes"][: k + 1] == shape[0][: k + 1]
        return k if same else None
    if name == "broadcast_in_dim":
        j = p["broadcast_dimensions"][k]
        return j if p["shape"][j] == shape[0][k] else None
    if name == "slice":
        step = 1 if p["strides"] is None else p["strides"][k]
        whole = (p["start_indices"][k], p["limit_indices"][k], step) == (0, shape[0][k], 1)
        return k if whole else None
    if name == "dynamic_slice":
        alone = axes[0] == k and all(a is None for a in axes[1:])
        return k if alone and p["slice_sizes"][k] == shape[0][k] else None
    if name == "pad":
        return k if axes[1] is None and tuple(p["padding_config"][k]) == (0, 0, 0) else None
    if name in _WINDOWS:
        keys = ("window_dimensions", "window_strides", "base_dilation", "window_dilation")
        alone = all(p[key][k] == 1 for key in keys) and tuple(p["padding"][k]) == (0, 0)
        return k if alone else None
    if name == "conv_general_dilated":
        lhs, _, out = p["dimension_numbers"]
        alone = axes[1] is None and k == lhs[0] and p["batch_group_count"] == 1
        return out[0] if alone else None
    if name == "gather":
        d = p["dimension_numbers"]
        if d.operand_batching_dims or None not in axes:  # both: rows read other rows
            return None
        if axes[1] is not None:  # indices into a table (embeddings); last axis: the index
            batch = [i for i in range(len(eqn.outvars[0].aval.shape)) if i not in d.offset_dims]
            return batch[k] if k < len(shape[1]) - 1 else None
        kept = [i for i in range(len(shape[0])) if i not in d.collapsed_slice_dims]
        whole = p["slice_sizes"][k] == shape[0][k] and k not in d.start_index_map
        return d.offset_dims[kept.index(k)] if whole and k in kept else None
    return None


def _constant_axis(eqn, v, sized: dict, n: int):
    """The axis of size N of output ``v`` of an equation that reads no sample: None (it has
    none), a broadcast's new axis (the same for every sample: a pseudo sample axis) or a
    random draw's, or False (an axis sized by N otherwise: a slice to N, an iota)."""
    dims = sized.get(v, ())
    if not dims:
        return None
    operand = eqn.invars[0] if eqn.invars and not is_literal(eqn.invars[0]) else None
    grown = eqn.primitive.name == "broadcast_in_dim" and not sized.get(operand, ())
    grown = grown or eqn.primitive.name in _RANDOM  # a draw per sample (dropout with a key)
    shape = tuple(getattr(v.aval, "shape", ()))
    return dims[0] if grown and len(dims) == 1 and shape[dims[0]] == n else False


def _axes(jaxpr, axes: list, n: int, sized: dict | None) -> list | None:
    """The axis holding the samples of each output of ``jaxpr`` (None: reads no sample),
    given its inputs'; None where some equation may mix samples or is not covered. With
    ``sized`` (the axes of size N of each value, :func:`sized_by_n`) an axis of size N
    that is not the samples' is not covered either."""
    if len(jaxpr.invars) != len(axes):
        return None
    env = dict(zip(jaxpr.invars, axes, strict=True))

    def read(v):
        return None if is_literal(v) else env.get(v)

    for eqn in jaxpr.eqns:
        a = [read(v) for v in eqn.invars]
        body = call_body(eqn) if inlined(eqn) or eqn.primitive in _CUSTOM else None
        if all(x is None for x in a) and (sized is None or body is None):
            if sized is None:
                continue  # reads no sample: the same for every sample
            outs = [_constant_axis(eqn, v, sized, n) for v in eqn.outvars]
            if any(k is False for k in outs):  # (not `False in outs`: 0 == False)
                return None
            env.update(zip(eqn.outvars, outs, strict=True))
            continue
        if body is not None:
            outs = _axes(body[0], a[len(a) - len(body[0].invars) :], n, sized)
        elif eqn.primitive is prims.cond_p and a[0] is None:
            branches = [_axes(br.jaxpr, a[1:], n, sized) for br in eqn.params["branches"]]
            outs = branches[0] if all(b == branches[0] for b in branches) else None
        else:
            k = _sample_axis(eqn, a)
            outs = None if k is None else [k] * len(eqn.outvars)
        if outs is None:
            return None
        for v, k in zip(eqn.outvars, outs, strict=True):
            if k is not None and tuple(getattr(v.aval, "shape", ()))[k : k + 1] != (n,):
                return None
            if sized is not None and set(sized.get(v, ())) - {k}:
                return None  # an axis of size N that is not the samples' (x[:, :N])
            env[v] = k
    return [read(v) for v in jaxpr.outvars]


def rows_separate(closed, batched: list[bool], n: int, sized: dict | None = None) -> bool:
    """Whether every output of ``closed`` (a jaxpr of the model on a batch of ``n``) holds
    the samples on axis 0, row i reading only row i of the inputs marked in ``batched``
    (theirs on axis 0): a proof by :func:`_sample_axis`'s rules; False: not shown. With
    ``sized`` (:func:`sized_by_n`), also that every axis of size N is the samples' (or a
    constant broadcast along it)."""
    try:
        outs = _axes(closed.jaxpr, [0 if b else None for b in batched], n, sized)
    except (KeyError, AttributeError, IndexError, TypeError, ValueError):
        return False  # parameters laid out as another JAX version does: not shown
    return outs is not None and all(k == 0 for k in outs)


def _same_value(a, b, na: int, nb: int, sized: dict, size: bool = False) -> bool:
    """Whether equation parameters ``a`` (of the trace on ``na`` samples) and ``b`` (on
    ``nb``) agree: integers of a ``size`` parameter may differ as sizes that scale with N;
    sub-jaxprs are compared equation by equation; functions (custom rules' thunks) by
    type only."""
    if isinstance(a, bool) or isinstance(b, bool) or type(a) is not type(b):
        return type(a) is type(b) and a == b
    if isinstance(a, int):
        return a == b or (size and a * nb == b * na)
    if isinstance(a, float):
        return a == b or (a != a and b != b)  # NaN fill values
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(
            _same_value(x, y, na, nb, sized, size) for x, y in zip(a, b, strict=True)
        )
    if isinstance(a, jex.ClosedJaxpr):
        same = _same_consts(a.consts, b.consts)
        return same and _same_jaxpr(a.jaxpr, b.jaxpr, na, nb, sized)
    if isinstance(a, jex.Jaxpr):
        return _same_jaxpr(a, b, na, nb, sized)
    if callable(a) or hasattr(a, "call_wrapped"):  # functions, JAX's wrapped thunks
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # arrays: not compared
        return False


def _same_consts(a, b) -> bool:
    return len(a) == len(b) and all(
        x is y or (np.shape(x) == np.shape(y) and np.array_equal(x, y, equal_nan=True))
        for x, y in zip(a, b, strict=True)
    )


def _record(u, v, sized: dict) -> bool:
    """Notes the axes where value ``u`` (trace on na samples) and ``v`` differ in size."""
    p, q = tuple(getattr(u.aval, "shape", ())), tuple(getattr(v.aval, "shape", ()))
    sized[u] = tuple(d for d, (i, j) in enumerate(zip(p, q, strict=False)) if i != j)
    return len(p) == len(q)


def _same_jaxpr(a, b, na: int, nb: int, sized: dict) -> bool:
    """Equation by equation: the same primitives on corresponding operands, literals equal,
    sizes scaled with N only in :data:`_SIZES` parameters."""
    counts = [(len(a.constvars), len(a.invars), len(a.eqns), len(a.outvars))]
    if counts != [(len(b.constvars), len(b.invars), len(b.eqns), len(b.outvars))]:
        return False
    pairs = list(zip([*a.constvars, *a.invars], [*b.constvars, *b.invars], strict=True))
    env = dict(pairs)
    if not all(_record(u, v, sized) for u, v in pairs):
        return False

    def same(u, v) -> bool:
        if is_literal(u) or is_literal(v):
            return is_literal(u) and is_literal(v) and np.array_equal(u.val, v.val, equal_nan=True)
        return env.get(u) is v

    for e, f in zip(a.eqns, b.eqns, strict=True):
        if e.primitive is not f.primitive or e.params.keys() != f.params.keys():
            return False
        if len(e.invars) != len(f.invars) or not all(map(same, e.invars, f.invars)):
            return False
        for key in e.params:
            size = key in _SIZES  # an iota sized by N: not a broadcast, refused by _axes
            if not _same_value(e.params[key], f.params[key], na, nb, sized, size):
                return False
        if len(e.outvars) != len(f.outvars):
            return False
        if not all(_record(u, v, sized) for u, v in zip(e.outvars, f.outvars, strict=True)):
            return False
        env.update(zip(e.outvars, f.outvars, strict=True))
    return all(map(same, a.outvars, b.outvars))


def sized_by_n(closed_a, closed_b, na: int, nb: int) -> dict | None:
    """For two jaxprs of one model, on batches of ``na`` and ``nb`` samples, that are the
    same computation with N only as a size (no literal, constant or parameter value
    differs but sizes that scale with N): the axes of each value of the first whose size
    is N's, for :func:`rows_separate` (which refuses an iota or a slice sized by N). None:
    not shown (``x / N``, a loop of N steps, an axis numbered N, a Python branch on N, or
    JAX tracing sizes differently)."""
    sized: dict = {}
    try:
        return sized if _same_value(closed_a, closed_b, na, nb, sized) else None
    except (TypeError, ValueError, AttributeError):
        return None
