"""Structured derivatives (Novak et al., "Fast Finite Width Neural Tangent Kernel", ICML
2022, s. 3.3): the jaxpr analysis (:func:`analyse`), the features' interpreter
(:func:`features`) and the pairwise contraction (:func:`contract`) of the weight uses the
rules in :mod:`ntk_core._structured.rules` (the formulas) cover; every other leaf falls back
to its explicit Jacobian. Per leaf, :func:`choose_modes` picks the Gram or explicit form,
and :func:`late_modes` where, in one call, an explicit Jacobian is formed: in the features,
or in the contraction from the inputs and cotangents the features keep."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import os
import string
import sys
import sysconfig
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex
from jax.extend.core import primitives as prims

from ntk_core._impl import jacobian as _jacobian
from ntk_core._jax import jaxpr_walk as _walk
from ntk_core._jax.jaxpr_walk import bind, call_body, inlined, is_literal
from ntk_core._kernel.model import one_sample, per_sample_jaxpr
from ntk_core._structured import rules as _rules
from ntk_core._structured.rules import Subscripts, Use, View
from ntk_core._structured.rules._base import Scale, view_index
from ntk_core._structured.rules.conv import patches as patches

_VIEWS = frozenset({prims.reshape_p, prims.transpose_p, prims.squeeze_p, prims.copy_p})
_VIEWS |= {prims.broadcast_in_dim_p}
_CAST, _SCALINGS = prims.convert_element_type_p, frozenset({prims.mul_p, prims.div_p})

GRAM, EXPLICIT = "gram", "explicit"  # the two forms of a structured leaf's kernel
# The explicit form with its per-sample Jacobian formed in the contraction, not the
# features: the same FLOPs in one call, and the features keep a use's A·(C + O·K) inputs
# and cotangents instead of the O·C·K Jacobian, while one group's Jacobians at a time are
# alive (a ViT's 64 tokens of width 256: 4x fewer values; 16 GiB -> 4 GiB at N = 128).
# In tiles each tile would form them again, so only one call takes it (planner.configure).
LATE = "late"


class Structure(typing.NamedTuple):
    """How :func:`contract` splits the kernel by leaf (hashable: jit-static)."""

    n_leaves: int
    fallback: tuple[int, ...]  # leaves differentiated explicitly
    groups: tuple[tuple[int, ...], ...]  # per structured leaf, its use indices
    group_leaves: tuple[int, ...]
    modes: tuple[str, ...]  # per group, "gram", "explicit" or "late" (choose_modes, late_modes)


@dataclasses.dataclass(frozen=True)
class Analysis:
    uses: tuple[Use, ...]
    fallback: tuple[int, ...]  # parameter leaves differentiated explicitly
    groups: tuple[tuple[int, ...], ...]  # use indices of each structured leaf
    biased: tuple[bool, ...]  # per use: a bias added to its output is fused in
    bias_leaves: tuple[int, ...]  # per use: the fused bias leaf, or -1
    fallback_reasons: tuple[str, ...]  # per fallback leaf: why no rule covers it
    leaf_dtypes: tuple[str, ...]  # per parameter leaf (its Jacobian's dtype)

    def leaves(self, n_leaves: int, modes: tuple[str, ...] | None = None) -> Structure:
        """The :class:`Structure` of ``n_leaves`` leaves (modes default to ``"gram"``)."""
        return Structure(
            n_leaves=n_leaves,
            fallback=self.fallback,
            groups=self.groups,
            group_leaves=tuple(self.uses[g[0]].leaf for g in self.groups),
            modes=(GRAM,) * len(self.groups) if modes is None else tuple(modes),
        )

    def input_size(self, u: int) -> int:
        """C of use ``u`` with its fused bias column."""
        use = self.uses[u]
        return use.x_contract_size + int(self.biased[u])


#: FLOP-equivalents per value written by the Gram form's memory-bound einsums (token
#: model embedding, N = 256: 0.48 s Gram vs 0.1 s explicit, ~10 ns per value, XLA CPU).
GRAM_VALUE_FLOPS = _jacobian.EINSUM_PASS_FLOPS


def pair_costs(analysis: Analysis, group, o_pair: int, o_out: int) -> tuple[float, float]:
    """FLOPs per pair of samples of one leaf: (Gram form, explicit form).

    Gram, per use pair: 2·A_u·A_v·C (``gram_input_width``) plus the cheaper of
    2·A_u·A_v·O'·K and 2·(A_u·A_v·O·K + O'·min(A_u, A_v)·K), plus, when A_u·A_v > 1,
    :data:`GRAM_VALUE_FLOPS` per value written; explicit: 2·O'·C·K. No Gram form: inf.
    """
    use = analysis.uses[group[0]]
    explicit = 2.0 * o_pair * analysis.input_size(group[0]) * use.w_free_size
    if not use.rule.has_gram_form:
        return math.inf, explicit
    gram = 0.0
    for u, v in itertools.product(group, group):
        use_u, use_v = analysis.uses[u], analysis.uses[v]
        c = use_u.rule.gram_input_width(analysis.input_size(u))
        a_u, a_v, k = use_u.a_size, use_v.a_size, use_u.w_free_size
        first = (2.0 * a_u * a_v * o_pair * k, a_u * a_v * o_pair)
        second = (
            2.0 * (a_u * a_v * o_out * k + o_pair * min(a_u, a_v) * k),
            max(a_u, a_v) * o_out * k,
        )
        flops, values = min(first, second)
        gram += 2.0 * a_u * a_v * c + flops
        if a_u * a_v > 1:  # one position each: two matrix products, no intermediate
            gram += GRAM_VALUE_FLOPS * (a_u * a_v + values + o_pair)
    return gram, explicit


def choose_modes(analysis: Analysis, o_pair: int, o_out: int) -> tuple[str, ...]:
    """Per group, ``"gram"`` or ``"explicit"``: the cheaper by :func:`pair_costs`."""
    costs = (pair_costs(analysis, group, o_pair, o_out) for group in analysis.groups)
    return tuple(EXPLICIT if explicit < gram else GRAM for gram, explicit in costs)


def late_modes(analysis: Analysis, modes, o_out: int) -> tuple[str, ...]:
    """``modes`` with :data:`LATE` for each explicit group whose inputs and cotangents,
    Σ_u A_u·(C_u + O·K), hold fewer values per sample than its Jacobian, O·C·K."""
    late = []
    for group, mode in zip(analysis.groups, modes, strict=True):
        use = analysis.uses[group[0]]
        jacobian = o_out * analysis.input_size(group[0]) * use.w_free_size
        smaller = late_values(analysis, group, o_out) < jacobian
        late.append(LATE if mode == EXPLICIT and smaller else mode)
    return tuple(late)


def late_values(analysis: Analysis, group, o_out: int) -> int:
    """Values one sample's features keep for a :data:`LATE` group."""
    return sum(
        analysis.uses[u].a_size * (analysis.input_size(u) + o_out * analysis.uses[u].w_free_size)
        for u in group
    )


def method_labels(analysis: Analysis, modes) -> dict[int, str]:
    """``plan()`` method per leaf, e.g. ``"structured (1 convolution, per-sample
    Jacobian)"`` or ``"jacobian (fallback: <reason>)"``."""
    methods = {}
    for group, mode in zip(analysis.groups, modes, strict=True):
        uses = [analysis.uses[u] for u in group]
        per_sample = ", per-sample Jacobian" if mode != GRAM else ""
        methods[uses[0].leaf] = f"structured ({uses[0].rule.label(uses)}{per_sample})"
    for u, leaf in enumerate(analysis.bias_leaves):
        if leaf >= 0:
            methods[leaf] = f"structured (bias fused with its {analysis.uses[u].name})"
    for leaf, reason in zip(analysis.fallback, analysis.fallback_reasons, strict=True):
        methods[leaf] = f"jacobian (fallback: {reason})"
    return methods


def _bias_fusable(eqns, leaf_shape, use: Use) -> bool:
    """Whether the bias view puts leaf entry σ(k) on unit k at every position, for one
    bijection σ (replayed exactly on the entry indices)."""
    size = math.prod(leaf_shape)
    if size != use.w_free_size:
        return False
    try:
        idx = np.broadcast_to(view_index(eqns, leaf_shape), use.y_shape)
    except Exception:  # an unexpected view: do not fuse
        return False
    mat = np.transpose(idx, use.y_perm).reshape(use.a_size, use.w_free_size)
    return bool((mat == mat[:1]).all() and np.array_equal(np.sort(mat[0]), np.arange(size)))


_PRIMITIVE_REASONS = {
    p: f"passed through a function with a custom derivative ({p.name[:10]})"
    for p in (prims.custom_jvp_call_p, prims.custom_vjp_call_p)
}
_LOOPS = {prims.scan_p: "loop (scan)", prims.while_p: "loop (while_loop)"}
_LOOPS[prims.cond_p] = "branch (cond)"
_PRIMITIVE_REASONS |= {p: f"used inside a {k}, which is not analysed" for p, k in _LOOPS.items()}


def _scalar(v, known: dict) -> float | None:
    if not is_literal(v):
        return known.get(v)
    value = np.asarray(v.val)
    return float(value) if value.ndim == 0 and np.isrealobj(value) else None


def _scalar_constants(constvars, consts) -> dict:
    return {
        v: float(np.asarray(c))
        for v, c in zip(constvars, consts, strict=True)
        if np.ndim(c) == 0 and np.isrealobj(c) and not isinstance(c, jax.core.Tracer)
    }


def _constant_factor(eqn, ins, known: dict) -> float | None:
    """The factor when ``eqn`` scales the parameter view by a constant (neg, mul, div)."""
    primitive = eqn.primitive
    if primitive is prims.neg_p:
        return -1.0
    if primitive not in _SCALINGS or len(ins) != 2 or (ins[0] is None) == (ins[1] is None):
        return None
    w_side = 0 if ins[0] is not None else 1
    if eqn.invars[w_side].aval.shape != eqn.outvars[0].aval.shape:
        return None  # the scalar broadcasts the view: not the same entries
    c = _scalar(eqn.invars[1 - w_side], known)
    if c is None or primitive is prims.mul_p:
        return c
    return 1.0 / c if w_side == 0 and c != 0.0 else None


def _function_name(eqn) -> str | None:
    """The function a call-like equation wraps (``relu``), or None."""
    for sub in _walk.sub_jaxprs(eqn):
        info = getattr(sub, "debug_info", None)
        name = getattr(info, "func_name", None)
        if not isinstance(name, str):  # older JAX: only "relu at /path/file.py:12"
            where = getattr(info, "func_src_info", None)
            name = where.split(" at ")[0] if isinstance(where, str) else None
        if name and not name.startswith("<"):
            return name
    return None


_LIBRARIES = ("jax", "jaxlib", "numpy", "flax", "haiku", "equinox")
_LIBRARIES += ("ntk_core", "ntk_flax", "ntk_haiku", "ntk_equinox")


@functools.lru_cache(maxsize=8)
def _roots(files: tuple) -> tuple[str, ...]:
    roots = [sysconfig.get_paths()["stdlib"]]
    roots += [os.path.dirname(os.path.abspath(f)) for f in files if f]
    return tuple(root + os.sep for root in roots)


def _source_location(eqn) -> str | None:
    """The user's frame that created ``eqn``, ``"model.py:12, in MLP.__call__"``, or None."""
    try:
        frames = eqn.source_info.traceback.frames
    except AttributeError:
        return None
    roots = _roots(tuple(getattr(sys.modules.get(n), "__file__", None) for n in _LIBRARIES))
    for frame in frames:
        path = os.path.abspath(frame.file_name)
        if not path.startswith(roots):
            return f"{os.path.basename(path)}:{frame.line_num}, in {frame.function_name}"
    return None


def _unpaired_reason(uses: list[Use], sites: list, indices: list[int]) -> str:
    """Why a tied leaf whose uses see different views falls back (with their lines)."""
    parts, keys, kinds = [], set(), set()
    for u in indices:
        use = uses[u]
        if use.key in keys:
            continue
        keys.add(use.key)
        other = " of another view of it" if use.kind in kinds else ""
        kinds.add(use.kind)
        location = _source_location(sites[u])
        where = f" (at {location})" if location else ""
        article = "an" if use.name[0] in "aeiou" else "a"
        parts.append(f"{article} {use.name}{other}{where}")
    return (
        f"used by {' and '.join(parts)}, whose Jacobians do not pair up entry by entry "
        f"(weight tying through different views)"
    )


def analyse(closed: jex.ClosedJaxpr, n_param_leaves: int, fuse_bias: bool = True) -> Analysis:
    """The structured uses of the first ``n_param_leaves`` inputs of ``closed``: each
    parameter is followed through its views to the rule that matches its use, else it
    falls back with a reason; with ``fuse_bias`` a bias right after a product or
    convolution joins it as a constant input column."""
    uses: list[Use] = []
    use_sites: list = []  # per use: the equation whose source line names it (if tied)
    bad: dict[int, str] = {}  # leaf -> the first reason it falls back

    def fall_back(leaf: int, reason: str, eqn=None) -> None:
        if leaf not in bad:
            where = None if eqn is None else _source_location(eqn)
            bad[leaf] = f"{reason}; at {where}" if where else reason

    use_of_output: dict = {}  # output var of a use that takes a bias -> use index
    bias_candidates: list[tuple[int, int, int, tuple]] = []  # (use, shift use, leaf, eqns)
    leaf_shapes = [tuple(v.aval.shape) for v in closed.jaxpr.invars[:n_param_leaves]]

    def walk(jaxpr, origins: dict, path: tuple, inside: str = "", call=None):
        # origins: var -> View; call: the outermost inlined call (its location is the user's).
        def origin(v):
            return None if is_literal(v) else origins.get(v)

        readers: dict = {}  # var -> how many equations (or the outputs) read it
        for v in [v for eqn in jaxpr.eqns for v in eqn.invars] + list(jaxpr.outvars):
            if not is_literal(v):
                readers[v] = readers.get(v, 0) + 1

        for i, eqn in enumerate(jaxpr.eqns):
            here = path + (i,)
            ins = [origin(v) for v in eqn.invars]
            primitive, name = eqn.primitive, eqn.primitive.name
            if inlined(eqn):  # scalar constants passed in stay known inside
                sub, consts = call_body(eqn)
                for outer, inner in zip(eqn.invars, sub.invars, strict=False):
                    value = _scalar(outer, known)
                    if value is None:  # a jaxpr JAX reuses for another call: forget
                        known.pop(inner, None)
                    else:
                        known[inner] = value
                known.update(_scalar_constants(sub.constvars, consts))
                if any(o is not None for o in ins):  # returned views: marked inside
                    pairs = zip(sub.invars, ins, strict=True)
                    sub_origins = {v: o for v, o in pairs if o is not None}
                    name_here = eqn.params.get("name")
                    within = f" inside {name_here}" if isinstance(name_here, str) else inside
                    walk(sub, sub_origins, here, within, call or eqn)
                continue
            if not any(o is not None for o in ins):
                if primitive is _CAST:  # of a scalar constant: still known
                    value = _scalar(eqn.invars[0], known)
                    if value is not None:
                        known[eqn.outvars[0]] = value
                continue
            factor = _constant_factor(eqn, ins, known)
            if factor is not None:  # W / 8, -W, c * W: a view with a factor
                view = next(o for o in ins if o is not None)
                origins[eqn.outvars[0]] = view._replace(chain=view.chain + (Scale(factor),))
                continue
            if primitive in _VIEWS:
                if len(eqn.invars) != 1:
                    for o in ins:
                        if o is not None:
                            fall_back(o.leaf, f"a {name} with several operands", call or eqn)
                    continue
                view = ins[0]
                step = (primitive, tuple(sorted((k, repr(v)) for k, v in eqn.params.items())))
                origins[eqn.outvars[0]] = View(view.leaf, view.chain + (step,), view.eqns + (eqn,))
                continue
            if primitive is _CAST:
                # A widening cast (float32 -> float64): the same numbers, a view that keeps
                # the entries' order (not in ``eqns``). A narrowing one is not: autodiff's
                # Jacobian rounds to it, the Gram form would not (~1e-3 apart).
                a, b = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
                floats = jnp.issubdtype(a, jnp.floating) and jnp.issubdtype(b, jnp.floating)
                if floats and jnp.promote_types(a, b) == b:
                    step = (primitive, str(b))
                    origins[eqn.outvars[0]] = ins[0]._replace(chain=ins[0].chain + (step,))
                    continue
            rule = _rules.rule_for(primitive)
            n_params = sum(o is not None for o in ins)
            if rule is not None and n_params == 1:
                use = rule.match(eqn, ins, here, leaf_shapes)
                if use is not None:
                    uses.append(use)
                    use_sites.append(call or eqn)
                    if rule.takes_bias:
                        use_of_output[eqn.outvars[0]] = len(uses) - 1
                    y = rule.bias_target(eqn, use)
                    # A bias fuses only when the product's output feeds this add alone.
                    if (
                        y is not None
                        and y in use_of_output
                        and readers.get(y) == 1
                        and tuple(eqn.outvars[0].aval.shape) == tuple(y.aval.shape)
                    ):
                        view = next(o for o in ins if o is not None)
                        bias_candidates.append(
                            (use_of_output[y], len(uses) - 1, use.leaf, view.eqns)
                        )
                    continue
                reason = rule.miss_reason(eqn, ins)
            elif n_params > 1 and rule is not None:
                reason = f"a {name} of two parameter views (e.g. W @ W or s * s)"
            elif primitive is _CAST:
                a, b = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
                reason = (
                    f"cast to a lower precision ({a} -> {b}, convert_element_type), e.g. "
                    f"a Flax layer with dtype=jnp.{b}: autodiff's rounded Jacobian is used"
                    if jnp.issubdtype(b, jnp.floating)
                    else f"cast from {a} to {b} (convert_element_type)"
                )
            elif primitive in _PRIMITIVE_REASONS:
                reason = _PRIMITIVE_REASONS[primitive]
                function = _function_name(eqn)
                if function:  # e.g. "passed through relu, a function with ..."
                    reason = reason.replace("a function", f"{function}{inside}, a function")
            else:
                reason = f"used by {name}{inside}, which no rule covers"
            for o in ins:  # any other use of a parameter view
                if o is not None:
                    fall_back(o.leaf, reason, call or eqn)
        for v in jaxpr.outvars:
            o = None if is_literal(v) else origins.get(v)
            if o is not None:
                fall_back(o.leaf, "returned by the model itself (a parameter view as output)")

    invars = closed.jaxpr.invars[:n_param_leaves]
    # The known scalar constants (e.g. jnp.sqrt(2.0) closed over), updated inside calls.
    known = _scalar_constants(closed.jaxpr.constvars, closed.consts)
    walk(closed.jaxpr, {v: View(i, (), ()) for i, v in enumerate(invars)}, ())
    by_leaf: dict[int, list[int]] = {}
    for u, use in enumerate(uses):
        by_leaf.setdefault(use.leaf, []).append(u)
    for leaf, members in by_leaf.items():
        if len({uses[u].key for u in members}) > 1:  # different views: no pairing
            fall_back(leaf, _unpaired_reason(uses, use_sites, members))
    fused: dict[int, int] = {}  # use index (in ``uses``) -> bias leaf
    absorbed_uses: set[int] = set()  # shift uses replaced by a fused bias
    for u, s, leaf, eqns in bias_candidates:
        use = uses[u]
        alone = len(by_leaf[leaf]) == 1 and len(by_leaf[use.leaf]) == 1  # their only uses
        # A scaled bias, or one that does not fuse, stays an elementwise shift.
        ok = fuse_bias and alone and uses[s].factor == 1.0 and not {leaf, use.leaf} & set(bad)
        if ok and use.rule.takes_bias and _bias_fusable(eqns, leaf_shapes[leaf], use):
            fused[u] = leaf
            absorbed_uses.add(s)
    kept_index = [u for u, use in enumerate(uses) if use.leaf not in bad and u not in absorbed_uses]
    kept = [uses[u] for u in kept_index]
    biased = tuple(u in fused for u in kept_index)
    bias_leaves = tuple(fused.get(u, -1) for u in kept_index)
    groups: dict[int, list[int]] = {}
    for u, use in enumerate(kept):
        groups.setdefault(use.leaf, []).append(u)
    structured = set(groups) | set(fused.values())
    fallback = tuple(i for i in range(n_param_leaves) if i not in structured)
    reasons = tuple(bad.get(i, "not used by the model: its kernel is zero") for i in fallback)
    dtypes = tuple(str(v.aval.dtype) for v in invars)
    groups_ = tuple(tuple(g) for g in groups.values())
    return Analysis(tuple(kept), fallback, groups_, biased, bias_leaves, reasons, dtypes)


def _evaluate(jaxpr, consts, args, probes: dict, records: dict, path=()):
    """The outputs of ``jaxpr`` with the probes (by use path) added, the recorded operands
    written into ``records``."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return v.val if is_literal(v) else env[v]

    for i, eqn in enumerate(jaxpr.eqns):
        here = path + (i,)
        invals = [read(v) for v in eqn.invars]
        if inlined(eqn):
            sub, sub_consts = call_body(eqn)
            outs = _evaluate(sub, sub_consts, invals, probes, records, here)
        else:
            probe = probes.get(here)
            if probe is not None:
                records[here] = invals[probe.record]
                if probe.operand is not None:  # the delta on a parameter operand
                    invals[probe.operand] = invals[probe.operand] + probe.delta
            rule = _rules.rule_for(eqn.primitive)
            outs = bind(eqn, invals) if rule is None else rule.evaluate(eqn, invals)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            if probe is not None and probe.operand is None:
                outs = [outs[0] + probe.delta]
        for v, val in zip(eqn.outvars, outs, strict=True):
            env[v] = val  # a dropped output (DropVar) is never read
    return [read(v) for v in jaxpr.outvars]


def analysis_for(
    apply3, params, x_one, aux, fuse_bias: bool = True, *, precision: str
) -> tuple[Analysis, jex.ClosedJaxpr]:
    """The analysis of ``apply3`` on one sample, and the per-sample jaxpr it read."""
    closed = per_sample_jaxpr(apply3, params, x_one, aux, precision=precision)
    return analyse(closed, len(jax.tree.leaves(params)), fuse_bias), closed


def _bias_in_gram(analysis: Analysis, modes, u: int) -> bool:
    """Whether use ``u``'s fused bias adds 1 to its input Gram matrix (not a column)."""
    use = analysis.uses[u]
    return analysis.biased[u] and use.rule.bias_in_gram(use) and _gram(analysis, modes, u)


#: Bytes of per-sample intermediates the features phase may hold at once (:func:`chunk_size`).
FEATURE_CHUNK_BYTES = 2**28
#: On a GPU or TPU, for samples whose intermediates take at most SMALL_SAMPLE_BYTES: each
#: chunk's HIGHEST products split their weights into bfloat16 parts again, and on a TPU
#: v5e the MLP 784-1000-1's kernel at N = 10 000 (47 KB a sample) took 24.5 ms in
#: chunks of 2 500 and 20.8 ms in one (benchmarks/README.md, "Warm targets"; LeNet, 3 MB
#: a sample, now takes chunks of 250 instead of 84). Larger samples keep the
#: CPU's budget: ResNet-18 (over 0.5 GB a sample) two a step was slower (108 ms against
#: 99 ms for its 8 x 8 kernel), and the ViT of issue 51 (0.3 GB) three a step compiled
#: in 26.8 s against 20.7 s one a step (one run each).
ACCELERATOR_FEATURE_CHUNK_BYTES = 2**30
SMALL_SAMPLE_BYTES = 2**24


def feature_chunk_bytes(per_sample: int) -> int:
    """The features chunk's budget for samples of ``per_sample`` bytes of intermediates."""
    small = per_sample <= SMALL_SAMPLE_BYTES and jax.default_backend() != "cpu"
    return ACCELERATOR_FEATURE_CHUNK_BYTES if small else FEATURE_CHUNK_BYTES


def chunk_size(apply3, params, x, aux, fuse_bias: bool, modes, *, precision) -> int:
    """Samples whose features are computed together: B = :func:`feature_chunk_bytes` //
    (itemsize·((O + 2)·V + F)) in [1, N], evened to ⌈N / ⌈N / B⌉⌉ (V: values one forward
    pass writes, O: outputs per sample, F: feature values per sample)."""
    analysis, closed = analysis_for(
        apply3, params, one_sample(x), aux, fuse_bias, precision=precision
    )
    n = np.shape(jax.tree.leaves(x)[0])[0]
    outs = closed.out_avals
    out_size = sum(math.prod(o.shape) for o in outs)
    leaves = jax.tree.leaves(params)
    width = sum(math.prod(np.shape(leaves[i])) for i in analysis.fallback)
    for group, mode in zip(analysis.groups, modes, strict=True):
        if mode == EXPLICIT:
            width += analysis.input_size(group[0]) * analysis.uses[group[0]].w_free_size
    gram_values = sum(
        use.a_size * (analysis.input_size(u) + out_size * use.w_free_size)
        for u, use in enumerate(analysis.uses)
        if _kept(analysis, modes, u)
    )
    itemsize = max((np.dtype(o.dtype).itemsize for o in outs), default=4)
    values = _walk.values_written(closed.jaxpr)
    return feature_chunk(n, out_size, values, out_size * width + gram_values, itemsize)


def feature_chunk(n: int, out_total: int, values: int, feature_values: int, itemsize: int) -> int:
    """Samples per features chunk (the cost model's too): see :func:`chunk_size`."""
    per = itemsize * ((out_total + 2) * values + feature_values)
    most = int(min(n, max(1, feature_chunk_bytes(per) // max(per, 1))))
    pieces = -(-n // most)
    return -(-n // pieces)  # balanced: the overlapping last chunk repeats < pieces samples


#: Per output leaf: fallback Jacobians ``(N, *O, P_l)``, explicit groups' ``(N, *O, C·K)``
#: (with ``merge_limits``: both in ``merged``), per use cotangents ``g`` ``(N, *O, A, K)``;
#: per use, inputs ``x`` ``(N, A, C)`` (in ``x`` and ``g``, None for explicit groups).
Features = collections.namedtuple("Features", "fallback explicit merged x g")


def features(apply3, params, x, aux, fuse_bias, modes, merge_limits, *, precision, columns=False):
    """Per-sample structured features of a batch (:class:`Features`); ``columns``: every
    fused bias as an input column of ones, never a 1 added to the input Gram matrix (the
    sketch of :mod:`ntk_core._functional.sketch` reads the inputs, not their Gram form)."""
    analysis, closed = analysis_for(
        apply3, params, one_sample(x), aux, fuse_bias, precision=precision
    )
    param_leaves = jax.tree.leaves(params)

    def one(x_i):
        def run(fb, deltas):
            leaves = list(param_leaves)
            for i, v in zip(analysis.fallback, fb, strict=True):
                leaves[i] = v
            pairs = zip(analysis.uses, deltas, strict=True)
            probes = {u.path: u.rule.probe(u, d) for u, d in pairs}
            records: dict = {}
            args = leaves + jax.tree.leaves(x_i) + jax.tree.leaves(aux)
            outs = _evaluate(closed.jaxpr, closed.consts, args, probes, records)
            return outs, [records[use.path] for use in analysis.uses]

        fb0 = [param_leaves[i] for i in analysis.fallback]
        d0 = [jnp.zeros(use.y_shape, use.y_dtype) for use in analysis.uses]
        # Per output leaf: (Jacobians of the fallback leaves, cotangents at each use).
        return jax.jacrev(run, argnums=(0, 1), has_aux=True)(fb0, d0)

    # Widened uses contract in the promoted dtype; each leaf's kernel in its own dtype.
    leaf_dtypes = analysis.leaf_dtypes
    work = [jnp.promote_types(leaf_dtypes[use.leaf], use.y_dtype) for use in analysis.uses]

    # Use.factor scales the recorded input (Rule.scales_input) or else the cotangent.
    x_factors = [use.factor if use.rule.scales_input else 1.0 for use in analysis.uses]
    g_factors = [1.0 if use.rule.scales_input else use.factor for use in analysis.uses]

    def prepared(v, dtype, factor):
        if jnp.issubdtype(v.dtype, jnp.floating):  # not a gather's tokens
            v = v.astype(dtype)
        return v if factor == 1.0 else v * factor

    jac, xs = jax.vmap(one)(x)
    j_fb = [pair[0] for pair in jac]
    j_d = [
        [prepared(g, w, f) for g, w, f in zip(pair[1], work, g_factors, strict=True)]
        for pair in jac
    ]
    xs = [prepared(v, w, f) for v, w, f in zip(xs, work, x_factors, strict=True)]
    # Per use: its Gram-form inputs, or what its explicit Jacobian reads of them.
    x_mats = []
    biased = analysis.biased
    for u, (use, xu, b) in enumerate(zip(analysis.uses, xs, biased, strict=True)):
        bias_column = b and (columns or not _bias_in_gram(analysis, modes, u))
        form = use.rule.input_features if _gram(analysis, modes, u) else use.rule.jacobian_input
        x_mats.append(form(use, xu, bias_column))
    fallback, explicit, merged, g = [], [], [], []  # per output leaf
    for k, o in enumerate(closed.out_avals):  # one sample's output leaves
        o_ndim = 1 + len(o.shape)  # (N, *O)
        # Leaves flattened (not -1: a leaf or an output may hold no values).
        fb_k = [j.reshape(j.shape[:o_ndim] + (math.prod(j.shape[o_ndim:]),)) for j in j_fb[k]]
        per_use = []
        for use, gu in zip(analysis.uses, j_d[k], strict=True):
            # gu: (N, *O, *y) -> (N, *O, A, K)
            lead = gu.shape[:o_ndim]
            perm = tuple(range(o_ndim)) + tuple(o_ndim + a for a in use.y_perm)
            gu = jnp.transpose(gu, perm).reshape(lead + (use.a_size, use.w_free_size))
            per_use.append(gu)
        per_group = [
            _group_jacobian(analysis, group, x_mats, per_use)
            for group, mode in zip(analysis.groups, modes, strict=True)
            if mode == EXPLICIT
        ]
        if merge_limits is None:
            parts = (fb_k, per_group, [])
        else:
            parts = ([], [], _jacobian.merge(fb_k + per_group, merge_limits[k]))
        for dest, part in zip((fallback, explicit, merged), parts, strict=True):
            dest.append(part)
        g.append([gu if _kept(analysis, modes, u) else None for u, gu in enumerate(per_use)])
    x_out = [xm if _kept(analysis, modes, u) else None for u, xm in enumerate(x_mats)]
    return Features(fallback, explicit, merged, x_out, g)


def _group_jacobian(analysis: Analysis, group, x_mats, per_use):
    """One explicit group's per-sample Jacobians ``(N, *O, C·K)`` in its leaf's dtype, from
    its uses' inputs (``jacobian_input`` form) and cotangents ``(N, *O, A, K)``."""
    total = None
    for u in group:
        use = analysis.uses[u]
        j = use.rule.jacobian(use, x_mats[u], per_use[u], analysis.biased[u])
        total = j if total is None else total + j
    o_ndim = per_use[group[0]].ndim - 2
    flat = total.reshape(total.shape[:o_ndim] + (math.prod(total.shape[o_ndim:]),))
    return flat.astype(analysis.leaf_dtypes[analysis.uses[group[0]].leaf])


def _after(value, side):
    """``side``'s (inputs, cotangents) made to depend on ``value``: its smallest floating
    array plus 0·(one entry of ``value``), which XLA does not fold (0·NaN is NaN). A data
    dependence orders the late groups on every backend; XLA's CPU compiler drops an
    ``optimization_barrier`` before scheduling, and without an order it held every
    group's Jacobians at once (2.3 GB for a ViT at N = 16, not 0.17)."""
    xs, gs = dict(side[0]), dict(side[1])
    floating = [(d, u) for d in (xs, gs) for u in d if jnp.issubdtype(d[u].dtype, jnp.floating)]
    d, u = min(floating, key=lambda du: du[0][du[1]].size)  # cotangents are always floating
    d[u] = d[u] + (value.reshape(-1)[0] * 0).astype(d[u].dtype)
    return xs, gs


def _kept(analysis: Analysis, modes, u: int) -> bool:
    """Whether the features keep use ``u``'s inputs and cotangents (Gram and late forms)."""
    for group, mode in zip(analysis.groups, modes, strict=True):
        if u in group:
            return mode != EXPLICIT
    return True


def _gram(analysis: Analysis, modes, u: int) -> bool:
    for group, mode in zip(analysis.groups, modes, strict=True):
        if u in group:
            return mode == GRAM
    return True


def contract(layouts, structure: Structure, analysis, f1, f2, precision):
    """Per output leaf, each parameter leaf's kernel (they sum to the NTK), led by the
    merged Jacobians' kernels when ``f1.merged`` holds them."""
    kernels = []
    for k, layout in enumerate(layouts):
        lhs, rhs, out = layout.specs(n_contracted=1)
        kinds = (f1.fallback, f1.explicit, f1.merged, f1.g)
        first = next(a for kind in kinds for a in kind[k] if a is not None)
        size = layout.trace_size(first.shape[: layout.ndim])
        per_leaf = [None] * structure.n_leaves

        def jacobian_term(a, b, specs=(lhs, rhs, out), size=size):
            return _jacobian.pair_einsum(*specs, a, b, precision) / size

        # Merged Jacobians (fallback leaves and explicit groups, not split per leaf).
        pairs = zip(f1.merged[k], f2.merged[k], strict=True)
        merged = [jacobian_term(a, b) for a, b in pairs]
        if not merged:
            pairs = zip(f1.fallback[k], f2.fallback[k], strict=True)
            for leaf, (a, b) in zip(structure.fallback, pairs, strict=True):
                per_leaf[leaf] = jacobian_term(a, b)
        lo, ro, _ = layout.specs()
        fresh = [c for c in string.ascii_letters if c not in lo + ro + out]
        letters = Subscripts(lo, ro, out, *fresh[:4])
        explicit = zip(f1.explicit[k], f2.explicit[k], strict=True)
        x1, x2, g1, g2 = f1.x, f2.x, f1.g[k], f2.g[k]
        last = None  # the last late group's kernel
        for group, leaf, mode in zip(*structure[2:], strict=True):  # groups, leaves, modes
            if mode == EXPLICIT:
                if not merged:
                    per_leaf[leaf] = jacobian_term(*next(explicit))
                continue
            if mode == LATE:  # formed here (for x2=None once), one group after another
                sides = [({u: x1[u] for u in group}, {u: g1[u] for u in group})]
                if f2 is not f1:
                    sides.append(({u: x2[u] for u in group}, {u: g2[u] for u in group}))
                if last is not None:  # after the last group's kernel: one group alive
                    sides = [_after(last, side) for side in sides]
                jacobians = [_group_jacobian(analysis, group, *side) for side in sides]
                last = per_leaf[leaf] = jacobian_term(jacobians[0], jacobians[-1])
                continue
            total = None
            for u, v in itertools.product(group, group):
                use, plus_one = analysis.uses[u], _bias_in_gram(analysis, structure.modes, u)
                args = (x1[u], x2[v], g1[u], g2[v], letters, precision, plus_one)
                term = use.rule.gram_term(use, analysis.uses[v], *args)
                total = term if total is None else total + term
            per_leaf[leaf] = (total / size).astype(analysis.leaf_dtypes[leaf])
        # None: fused biases, and leaves in the merged Jacobians.
        kernels.append(merged + [term for term in per_leaf if term is not None])
    return kernels
