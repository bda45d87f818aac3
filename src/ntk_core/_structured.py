"""Structured derivatives: the NTK of weights used in matrix products, convolutions,
embedding lookups and elementwise scales and shifts, without their Jacobians (or with
Jacobians formed cheaply).

Every rule writes the per-sample Jacobian of a weight use as a product of two
recorded quantities: the use's input ``x[a, c]`` and the cotangent ``g_o[a, k] =
∂f_o/∂y[a, k]`` at the use's output ``y``, for every output entry ``o``, where ``a``
runs over the output positions of the use (the sample's batch axis of size 1, a
sequence axis, the spatial positions of a convolution), ``c`` over the weight's input
coordinates and ``k`` over its output units:

    ∂f_o/∂W[c, k] = Σ_a x[a, c] g_o[a, k]

* ``dot_general`` (Dense, einsum projections): ``x`` is the layer input, free axes first.
* ``conv_general_dilated`` on its kernel operand (any strides, padding, lhs/rhs
  dilation and dimension numbers, ``feature_group_count = batch_group_count = 1``):
  ``x`` are the input patches, ``c = (input channel, window offset)`` in the kernel's
  ``rhs_spec`` order, extracted by padding and strided slicing (no convolution).
* ``gather`` of rows of a ``(V, D)`` table (``nn.Embed``, ``hk.Embed``, ``table[tokens]``,
  ``jnp.take``): ``x[a, c] = [token_a = c]`` (one-hot), so the Gram factor below is the
  token match ``[t1_a = t2_b]`` and is computed from the tokens without the one-hot;
  out-of-range tokens follow the lookup's mode (``clip`` clamps; ``fill`` and
  promise-in-bounds drop them, as the lookup's transpose does).
* A bias added right after a product or convolution, with one entry per output unit
  ``k`` broadcast over the positions ``a`` in any order, joins the use as a constant
  input column: Σ_ab (x1a·x2b + 1)(g1a·g2b) = K_W + (Σ_a g1a)·(Σ_b g2b).
* Elementwise scales ``y = x * view(s)`` (LayerNorm / BatchNorm scale, in either
  operand order) and shifts ``y = x ± view(b)`` (LayerNorm / BatchNorm bias, any bias
  not fused with a product), where ``view`` reshapes, transposes and broadcasts the
  leaf so that each row of the operand ``v = view(s)`` seen as (positions a, units k)
  holds every leaf entry once: ∂f_o/∂s[σ(k)] = Σ_a ∂f_o/∂v[a, k], where the probe δ
  sits on ``v`` itself (before the operation broadcasts it), so that the reverse pass
  forms ∂f_o/∂v = Σ_broadcast x·g_o (scale) or ±Σ g_o (shift) already reduced, and the
  cotangent at ``y`` is never written out. The scale's ``x`` is whatever it is
  multiplied by first: Flax and Haiku compute ``(x - mean) * (rsqrt(var + eps) * s)``,
  so the use is the product ``rsqrt(var + eps) * s`` (input-dependent in LayerNorm,
  running statistics in eval-mode BatchNorm); exact either way.

A use's NTK contribution is, per pair of uses (u, v) of one leaf,

    Σ_{a,b} (Σ_c x1[a, c] x2[b, c]) (Σ_k g1_o[a, k] g2_o'[b, k]),

either in this Gram form (``"gram"`` mode: features ``x`` and ``g``, the four-operand
contraction done pairwise by ``jnp.einsum(optimize="optimal")``) or from the per-sample
Jacobian ``J = Σ_a x[a, :]ᵀ g_o[a, :]`` formed once per sample (``"explicit"`` mode:
features ``J``, then a Jacobian contraction). :func:`choose_modes` picks per leaf from
the shapes: the Gram form costs about A_u·A_v·(C + O'·K) per pair of samples (less
when the einsum contracts one side's cotangents first), the explicit one O'·C·K (O'
kernel entries per pair). A Dense layer on vectors (A = 1) takes the Gram
form, (x1·x2)(g1·g2); a convolution over many positions the explicit one, which is
still much cheaper than differentiating the kernel through the convolution under
``vmap`` (a grouped convolution, slow on CPU).

Phase one (features, per sample, O(N)): the model's jaxpr (``jax.make_jaxpr``) is
evaluated by a small interpreter over public ``jax.extend.core`` objects that adds a
zero probe δ_u to the output of every structured use u and records its input; one
reverse pass per output entry gives ∂f/∂δ_u = g_u and, jointly, the explicit Jacobians
of the *fallback* leaves. Phase two (contract, O(N1·N2)): the contraction above per
pair of uses of the same leaf (weight tying sums its per-use Jacobians, so cross terms
between uses count), plus the Jacobian contraction of the fallback and explicit leaves.

Fallback (explicit per-leaf Jacobian from the joint reverse pass, the ``"jacobian"``
method) for every leaf used in any other way: a parameter inside a nonlinearity or
sliced (``b[:1]``), a view that repeats a leaf entry within a row of units, grouped
convolutions, a table used both in a lookup and a product (tied input/output
embeddings), the same leaf seen through different views by products, a leaf used both
elementwise and by a product, products of two parameters, or anything inside scan /
cond / while / custom_vjp. Sub-jaxprs of ``jit``, ``closed_call`` and ``checkpoint``
are inlined; ``custom_jvp`` functions (``jax.nn.relu``, ``gelu``) are evaluated with
their own rules.

Elementwise scales and shifts are always in the explicit mode (C = 1): their Gram form
A_u·A_v·O'·K per pair is never cheaper than the explicit O'·K. Their per-sample
Jacobian costs what the fallback's joint reverse pass would (the same reduction, now
labelled and available to per-leaf kernels); recording ``x`` and the cotangent at
``y`` instead writes out N·O·A·K values per use (a full feature map per BatchNorm),
which was no faster in the ResNet benchmark. All uses of one leaf form their
Jacobians in the leaf's own order, so scales and shifts of one leaf (through any
views) sum exactly.

Reference: Novak, Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent
Kernel", ICML 2022, section 3.3.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import string
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex

from . import _jacobian
from ._barrier import barrier
from ._model import per_sample

#: Primitives through which a parameter stays "the same numbers in another order".
_VIEW_PRIMITIVES = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p"})
#: Call-like primitives whose sub-jaxpr is evaluated inline.
_INLINE_PRIMITIVES = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint"}
)
#: Lookup modes of ``gather`` handled by the embedding rule.
_GATHER_MODES = frozenset({"CLIP", "FILL_OR_DROP", "PROMISE_IN_BOUNDS"})

#: Elementwise products and sums with a parameter view: always the explicit form.
ELEMENTWISE_KINDS = frozenset({"scale", "shift"})
#: What each kind of use is called in ``plan()`` labels.
KIND_NAMES = {
    "dot": "matrix product",
    "conv": "convolution",
    "gather": "embedding gather",
    "scale": "elementwise scale",
    "shift": "elementwise shift",
}


@dataclasses.dataclass(frozen=True)
class Use:
    """One structured use of a parameter leaf.

    ``kind`` is ``"dot"`` (``y = dot_general(x, view(W))``), ``"conv"`` (``y =
    conv_general_dilated(x, view(W))``), ``"gather"`` (``y = view(W)[tokens]``),
    ``"scale"`` (``y = x * view(s)``) or ``"shift"`` (``y = x ± view(b)``), the last two
    with ``view`` broadcasting the leaf over the positions. ``y_perm`` orders the axes of
    ``y`` as (position axes..., unit axes...), so that ``y.transpose(y_perm).reshape(A,
    K)`` is the use's output matrix.
    """

    path: tuple[int, ...]  # indices of the equation through inlined sub-jaxprs
    leaf: int
    kind: str
    x_side: int  # operand index of the recorded input (tokens for a gather)
    key: tuple  # uses of one leaf with equal keys pair up coordinate by coordinate
    y_shape: tuple[int, ...]
    y_dtype: str
    y_perm: tuple[int, ...]  # scale / shift: of the probed parameter operand
    a_size: int  # A: output positions
    w_free_size: int  # K: output units
    x_contract_size: int  # C: input coordinates (V for a gather)
    # dot: (x_free, x_contract); conv: geometry; gather: (mode,); scale / shift:
    # (probed operand, leaf order: the unit holding each leaf entry, or () for unit k)
    x_info: tuple = ()
    # A constant scalar the leaf was multiplied by before this use (W / 8, -W, c * W:
    # NTK parametrisation): the use's Jacobian is this times the unscaled one's.
    factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class Analysis:
    uses: tuple[Use, ...]
    fallback: tuple[int, ...]  # parameter leaves differentiated explicitly
    groups: tuple[tuple[int, ...], ...]  # use indices of each structured leaf
    biased: tuple[bool, ...] = ()  # per use: a bias added to its output is fused in
    bias_leaves: tuple[int, ...] = ()  # per use: the fused bias leaf, or -1
    fallback_reasons: tuple[str, ...] = ()  # per fallback leaf: why no rule covers it
    leaf_dtypes: tuple[str, ...] = ()  # per parameter leaf (its Jacobian's dtype)

    def leaves(self, n_leaves: int, modes: tuple[str, ...] | None = None) -> tuple:
        """``(n_leaves, fallback, groups, leaf of each group, mode of each group)`` for
        :func:`contract` (all modes ``"gram"`` unless given)."""
        group_leaves = tuple(self.uses[g[0]].leaf for g in self.groups)
        if modes is None:
            modes = ("gram",) * len(self.groups)
        return (n_leaves, self.fallback, self.groups, group_leaves, tuple(modes))

    def input_size(self, u: int) -> int:
        """C of use ``u`` with its fused bias column."""
        use = self.uses[u]
        return use.x_contract_size + int(bool(self.biased) and self.biased[u])


#: FLOP-equivalents of writing and reading back one value of an intermediate or output
#: array of the Gram form's einsums: the input Gram matrix (the token match of a
#: gather), the cotangent Gram matrix or the input Gram times one side's cotangents,
#: and each use pair's output. Those einsums contract a few values per output value
#: (A, K, a match's single 0/1), so they run at memory speed, not matmul speed: the
#: token model's embedding (A = 5, K = 8, O = 15, O' = 75) took 0.48 s for N = 256 in
#: the Gram form (0.8 GFLOP, 46 M intermediate values: ~10 ns per value) against 0.1 s
#: for the whole explicit-form kernel (XLA CPU, 2 cores). The same per-value cost as a
#: separate Jacobian einsum's output pass (``_jacobian.EINSUM_PASS_FLOPS``).
GRAM_VALUE_FLOPS = _jacobian.EINSUM_PASS_FLOPS


def pair_costs(analysis: Analysis, group, o_pair: int, o_out: int) -> tuple[float, float]:
    """Cost per pair of samples of one leaf, in FLOPs: (Gram form, explicit form).

    Gram, per pair of uses (u, v): 2·A_u·A_v·C for the input Gram matrix (C = 1 for a
    gather's token match), then the order with fewer FLOPs (the one
    ``jnp.einsum(optimize="optimal")`` takes) of 2·A_u·A_v·O'·K (the cotangent Gram
    matrix, A_u·A_v·O' values) and 2·(A_u·A_v·O·K + O'·min(A_u, A_v)·K) (the input Gram
    times one side's cotangents first, max(A_u, A_v)·O·K values), plus, when the uses
    have several positions (A_u·A_v > 1), :data:`GRAM_VALUE_FLOPS` per value of the
    input Gram matrix, that intermediate and the O' outputs (with one position each,
    the Gram form is two matrix products and a product of their outputs, values of the
    order of the explicit form's own output); explicit: 2·O'·C·K, the Jacobian
    contraction (merged with the other Jacobians into one einsum, so no output pass of
    its own). O' is the kernel
    entries per pair (traced axes included), O the output entries per sample.
    Elementwise scales and shifts (C = 1) have no Gram form (infinite cost): their Gram
    form would cost 2·A_u·A_v·O'·K, never less than the explicit 2·O'·K.
    """
    use = analysis.uses[group[0]]
    explicit = 2.0 * o_pair * analysis.input_size(group[0]) * use.w_free_size
    if use.kind in ELEMENTWISE_KINDS:
        return math.inf, explicit
    gram = 0.0
    for u, v in itertools.product(group, group):
        use_u, use_v = analysis.uses[u], analysis.uses[v]
        c = 1 if use_u.kind == "gather" else analysis.input_size(u)
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
    """Per group (structured leaf): ``"gram"`` or ``"explicit"``, the cheaper per pair
    (see :func:`pair_costs`); always ``"explicit"`` for elementwise scales and shifts."""
    modes = []
    for group in analysis.groups:
        gram, explicit = pair_costs(analysis, group, o_pair, o_out)
        modes.append("explicit" if explicit < gram else "gram")
    return tuple(modes)


def _sub_jaxpr(eqn):
    for name in ("jaxpr", "call_jaxpr"):
        sub = eqn.params.get(name)
        if isinstance(sub, jex.ClosedJaxpr):
            return sub.jaxpr, list(sub.consts)
        if isinstance(sub, jex.Jaxpr):
            return sub, []
    return None


def _inlined(eqn) -> bool:
    return eqn.primitive.name in _INLINE_PRIMITIVES and _sub_jaxpr(eqn) is not None


def _literal(v) -> bool:
    return isinstance(v, jex.Literal)


def _bind(eqn, invals):
    bound = eqn.primitive.get_bind_params(eqn.params)
    # Older JAX returns (sub-functions, params), newer JAX the params alone.
    if isinstance(bound, tuple) and len(bound) == 2 and isinstance(bound[1], dict):
        subfuns, params = bound
    else:
        subfuns, params = (), bound
    return eqn.primitive.bind(*subfuns, *invals, **params)


def _bias_fusable(eqns, leaf_shape, use: Use) -> bool:
    """Whether the bias view (the leaf through ``eqns``, then broadcast to ``y``) puts,
    at every output position, entry ``σ(k)`` of the leaf on unit ``k`` for one
    bijection σ: then its Jacobian is Σ_a g[a, k] up to a permutation of the entries.

    Decided exactly by replaying the view on the entry indices.
    """
    size = math.prod(leaf_shape)
    if size != use.w_free_size:
        return False
    try:
        idx = np.broadcast_to(_view_index(eqns, leaf_shape), use.y_shape)
    except Exception:  # an unexpected view: do not fuse
        return False
    mat = np.transpose(idx, use.y_perm).reshape(use.a_size, use.w_free_size)
    return bool((mat == mat[:1]).all() and np.array_equal(np.sort(mat[0]), np.arange(size)))


def _scaled(chain) -> tuple[tuple, float]:
    """The view chain without its constant scalings (they do not move entries, so
    uses that differ only by them pair up) and the product of their factors."""
    factor = 1.0
    for step in chain:
        if step[0] == "scale_by":
            factor *= step[1]
    return tuple(step for step in chain if step[0] != "scale_by"), factor


def _dot_use(eqn, ins, here):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    w_side = 0 if ins[0] is not None else 1
    leaf, chain, _ = ins[w_side]
    chain, factor = _scaled(chain)
    if lb or rb or any(step[0] == "broadcast_in_dim" for step in chain):
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
    k = math.prod(w_var.aval.shape[a] for a in w_free)
    return Use(
        here,
        leaf,
        "dot",
        x_side,
        ("dot", chain, w_contract, w_free, x_side),
        tuple(eqn.outvars[0].aval.shape),
        str(eqn.outvars[0].aval.dtype),
        y_perm,
        math.prod(x_var.aval.shape[a] for a in x_free),
        k,
        math.prod(x_var.aval.shape[a] for a in x_contract),
        (x_free, x_contract),
        factor=factor,
    )


def _conv_use(eqn, ins, here):
    if ins[0] is not None or ins[1] is None:
        return None  # only the kernel operand is a parameter
    p = eqn.params
    if p["feature_group_count"] != 1 or p["batch_group_count"] != 1:
        return None
    leaf, chain, _ = ins[1]
    chain, factor = _scaled(chain)
    if any(step[0] == "broadcast_in_dim" for step in chain):
        return None
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = (tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec))
    w_shape = tuple(eqn.invars[1].aval.shape)
    window = tuple(w_shape[d] for d in rhs_spec[2:])
    c_in = w_shape[rhs_spec[1]]
    y_shape = tuple(eqn.outvars[0].aval.shape)
    out_spatial = tuple(y_shape[d] for d in out_spec[2:])
    padding = tuple(tuple(int(v) for v in pad) for pad in p["padding"])
    geometry = (
        lhs_spec,
        window,
        tuple(p["window_strides"]),
        padding,
        tuple(p["lhs_dilation"] or (1,) * len(window)),
        tuple(p["rhs_dilation"] or (1,) * len(window)),
        out_spatial,
    )
    return Use(
        here,
        leaf,
        "conv",
        0,
        ("conv", chain, rhs_spec, w_shape),
        y_shape,
        str(eqn.outvars[0].aval.dtype),
        (out_spec[0],) + tuple(out_spec[2:]) + (out_spec[1],),
        y_shape[out_spec[0]] * math.prod(out_spatial),
        w_shape[rhs_spec[0]],
        c_in * math.prod(window),
        geometry,
        factor=factor,
    )


def _gather_use(eqn, ins, here):
    if ins[0] is None or ins[1] is not None:
        return None  # a parameter table looked up with non-parameter indices
    leaf, chain, _ = ins[0]
    chain, factor = _scaled(chain)
    if any(step[0] == "broadcast_in_dim" for step in chain):
        return None
    p = eqn.params
    dn = p["dimension_numbers"]
    table = tuple(eqn.invars[0].aval.shape)
    idx_shape = tuple(eqn.invars[1].aval.shape)
    y_shape = tuple(eqn.outvars[0].aval.shape)
    mode = getattr(p["mode"], "name", str(p["mode"]).rsplit(".", 1)[-1])
    ok = (
        len(table) == 2
        and tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,)
        and tuple(getattr(dn, "operand_batching_dims", ())) == ()
        and tuple(dn.offset_dims) == (len(y_shape) - 1,)
        and tuple(p["slice_sizes"]) == (1, table[1])
        and idx_shape[-1:] == (1,)
        and y_shape == idx_shape[:-1] + (table[1],)
        and mode in _GATHER_MODES
    )
    if not ok:
        return None
    return Use(
        here,
        leaf,
        "gather",
        1,
        ("gather", chain, table),
        y_shape,
        str(eqn.outvars[0].aval.dtype),
        tuple(range(len(y_shape))),
        math.prod(idx_shape[:-1]),
        table[1],
        table[0],
        (mode,),
        factor=factor,
    )


def _view_index(eqns, leaf_shape):
    """The leaf's entry indices ``arange(P)`` through the view equations ``eqns``, as
    concrete numpy integers (exact: the view moves entries, it does not combine them)."""
    idx = np.arange(math.prod(leaf_shape), dtype=np.int32).reshape(leaf_shape)
    for eqn in eqns:
        idx = _numpy_view(eqn, idx)
    return idx


def _numpy_view(eqn, idx: np.ndarray) -> np.ndarray:
    """One view equation applied to concrete numpy indices: with numpy for the view
    primitives (binding them on concrete values would compile one XLA program each,
    10 for the LeNet), by binding it otherwise."""
    name, params = eqn.primitive.name, eqn.params
    if name == "reshape" and params.get("dimensions") is None:
        return idx.reshape(params["new_sizes"])
    if name == "transpose":
        return np.transpose(idx, params["permutation"])
    if name == "squeeze":
        return np.squeeze(idx, axis=tuple(params["dimensions"]))
    if name == "expand_dims":
        return np.expand_dims(idx, tuple(params["dimensions"]))
    if name in ("copy", "copy_p"):
        return idx
    if name == "broadcast_in_dim":
        shape = tuple(params["shape"])
        placed = [1] * len(shape)
        for axis, dim in enumerate(params["broadcast_dimensions"]):
            placed[dim] = idx.shape[axis]
        return np.broadcast_to(idx.reshape(placed), shape)
    with jax.ensure_compile_time_eval():  # concrete even inside a jit trace
        return np.asarray(_bind(eqn, [idx]))


def _elementwise_use(eqn, ins, here, leaf_shape):
    """``y = x * view(s)`` (``"scale"``), ``y = x + view(b)``, ``x - view(b)`` or
    ``view(b) - x`` (``"shift"``), with exactly one operand a parameter view ``v``.

    The probe goes on the operand ``v`` itself (before the operation broadcasts it to
    ``y``), so the reverse pass returns ∂f/∂v = Σ_broadcast x·g_y (scale) or ±Σ g_y
    (shift), reduced where it is formed: the cotangent at ``y`` is never written out.
    Structured when every leaf entry appears at the same places in every row of ``v``
    seen as (positions a, units k): the axes along which ``v`` is constant (a
    broadcast) are the positions, the others the units, which must hold each leaf entry
    exactly once; then ∂f/∂s[σ(k)] = Σ_a ∂f/∂v[a, k] with σ the units' leaf entries.
    Decided exactly by replaying the view on the entry indices; None otherwise.
    """
    w_side = 0 if ins[0] is not None else 1
    leaf, chain, eqns = ins[w_side]
    _, factor = _scaled(chain)
    v_shape = tuple(eqn.invars[w_side].aval.shape)
    size = math.prod(leaf_shape)
    if size == 0:
        return None
    try:
        idx = _view_index(eqns, leaf_shape)
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
        here,
        leaf,
        "scale" if eqn.primitive.name == "mul" else "shift",
        1 - w_side,
        ("elementwise", tuple(leaf_shape)),  # Jacobians in the leaf's order: uses pair up
        v_shape,  # the probe's shape: the operand's, not the output's
        str(eqn.invars[w_side].aval.dtype),
        v_perm,
        a_size,
        size,
        1,
        (w_side, leaf_order),
        factor=factor,
    )


_RULES = {"dot_general": _dot_use, "conv_general_dilated": _conv_use, "gather": _gather_use}
#: Elementwise primitives with one parameter operand handled by :func:`_elementwise_use`.
_ELEMENTWISE_PRIMITIVES = frozenset({"mul", "add", "sub"})


#: Why a parameter used by one of these primitives falls back, for ``plan()``.
_PRIMITIVE_REASONS = {
    "custom_jvp_call": "passed through a function with a custom derivative (custom_jvp)",
    "custom_vjp_call": "passed through a function with a custom derivative (custom_vjp)",
    "custom_vjp_call_jaxpr": "passed through a function with a custom derivative (custom_vjp)",
    "scan": "used inside a loop (scan), which is not analysed",
    "while": "used inside a loop (while_loop), which is not analysed",
    "cond": "used inside a branch (cond), which is not analysed",
}


def _scalar(v, known: dict) -> float | None:
    """The value of a scalar literal or of a known scalar constant, else None."""
    if _literal(v):
        value = np.asarray(v.val)
        if value.ndim == 0 and np.isrealobj(value):
            return float(value)
        return None
    return known.get(v)


def _scalar_constants(constvars, consts) -> dict:
    """``{var: value}`` of the real scalar constants among a jaxpr's constants."""
    return {
        v: float(np.asarray(c))
        for v, c in zip(constvars, consts, strict=True)
        if np.ndim(c) == 0 and np.isrealobj(c) and not isinstance(c, jax.core.Tracer)
    }


def _constant_factor(eqn, ins, known: dict) -> float | None:
    """``f`` when ``eqn`` multiplies the one parameter view among its operands by a
    constant scalar: ``neg`` (-1), ``mul`` by a scalar (c), ``div`` by one (1 / c)."""
    name = eqn.primitive.name
    if name == "neg":
        return -1.0
    if name not in ("mul", "div") or len(ins) != 2 or (ins[0] is None) == (ins[1] is None):
        return None
    w_side = 0 if ins[0] is not None else 1
    if eqn.invars[w_side].aval.shape != eqn.outvars[0].aval.shape:
        return None  # the scalar broadcasts the view: not the same entries
    c = _scalar(eqn.invars[1 - w_side], known)
    if c is None:
        return None
    if name == "mul":
        return c
    return 1.0 / c if w_side == 0 and c != 0.0 else None


def _float_cast(eqn) -> bool:
    """A ``convert_element_type`` from a floating dtype to one that holds all its
    values (float32 → float64, bfloat16 → float32): the same numbers. A cast to a lower
    precision (a Flax ``dtype=jnp.bfloat16`` layer of float32 parameters) is not one:
    the Gram form would take the products of its inputs and cotangents exactly, where
    autodiff's Jacobian (and so ``"jacobian"``) rounds them to that precision, and the
    kernels would differ by ~1e-3."""
    a, b = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
    return bool(
        jnp.issubdtype(a, jnp.floating)
        and jnp.issubdtype(b, jnp.floating)
        and jnp.promote_types(a, b) == b
    )


def _function_name(eqn) -> str:
    """The name of the function a call-like equation wraps (``relu`` for
    ``jax.nn.relu``'s custom_jvp call), or "" where JAX does not record it."""
    for key in ("call_jaxpr", "fun_jaxpr", "jaxpr"):
        sub = eqn.params.get(key)
        info = getattr(getattr(sub, "jaxpr", sub), "debug_info", None)
        name = getattr(info, "func_name", None)
        if not isinstance(name, str):  # older JAX: only "relu at /path/file.py:12"
            where = getattr(info, "func_src_info", None)
            name = where.split(" at ")[0] if isinstance(where, str) else ""
        if name and not name.startswith("<"):
            return name
    return ""


#: Packages whose frames are not the user's code in a source location.
_LIBRARIES = ("jax", "jaxlib", "ntk_core", "ntk_flax", "ntk_haiku", "flax", "haiku", "numpy")


def _library_roots() -> tuple[str, ...]:
    """The folders of the standard library and of :data:`_LIBRARIES` already imported
    (nothing is imported here)."""
    files = tuple(getattr(sys.modules.get(name), "__file__", None) for name in _LIBRARIES)
    return _roots(files)


@functools.lru_cache(maxsize=8)
def _roots(files: tuple) -> tuple[str, ...]:
    roots = [sysconfig.get_paths()["stdlib"]]
    roots += [os.path.dirname(os.path.abspath(f)) for f in files if f]
    return tuple(root + os.sep for root in roots)


def _source_location(eqn) -> str:
    """Where the user's code created ``eqn``: ``"model.py:12, in MLP.__call__"``, the
    innermost frame of its traceback outside JAX, the Python standard library, Flax,
    Haiku and this library; "" where JAX recorded none."""
    try:
        frames = eqn.source_info.traceback.frames
    except AttributeError:
        return ""
    roots = _library_roots()
    for frame in frames:
        path = os.path.abspath(frame.file_name)
        if not path.startswith(roots):
            return f"{os.path.basename(path)}:{frame.line_num}, in {frame.function_name}"
    return ""


def _unpaired_reason(uses: list[Use], sites: list, indices: list[int]) -> str:
    """Why a leaf used several times (weight tying) falls back: its uses ``indices``
    have Jacobians of different views or operations, e.g. ``a matrix product (at
    model.py:4, in f) and a matrix product of another view of it (at model.py:6, in
    f)``; ``sites``: each use's equation (its source location is looked up here)."""
    parts, keys, kinds = [], set(), set()
    for u in indices:
        use = uses[u]
        if use.key in keys:
            continue
        keys.add(use.key)
        name = KIND_NAMES[use.kind]
        other = " of another view of it" if use.kind in kinds else ""
        kinds.add(use.kind)
        location = _source_location(sites[u])
        where = f" (at {location})" if location else ""
        article = "an" if name[0] in "aeiou" else "a"
        parts.append(f"{article} {name}{other}{where}")
    return (
        f"used by {' and '.join(parts)}, whose Jacobians do not pair up entry by entry "
        f"(weight tying through different views)"
    )


def _rule_miss_reason(eqn, ins) -> str:
    """Why :data:`_RULES` (or the elementwise rule) did not take this equation."""
    name = eqn.primitive.name
    if name in _ELEMENTWISE_PRIMITIVES:
        return f"an elementwise {name} whose broadcast repeats or drops parameter entries"
    chain = next(o[1] for o in ins if o is not None)
    if any(step[0] == "broadcast_in_dim" for step in chain):
        return f"broadcast before its {name}, so its entries repeat"
    if name == "dot_general":
        (_, _), (lb, rb) = eqn.params["dimension_numbers"]
        if lb or rb:
            return "a matrix product batched over the parameter's axes"
    if name == "conv_general_dilated":
        if ins[1] is None:
            return "the input operand of a convolution (not its kernel)"
        groups = eqn.params["feature_group_count"], eqn.params["batch_group_count"]
        if groups != (1, 1):
            return (
                f"the kernel of a grouped or depthwise convolution (feature_group_count="
                f"{groups[0]}, batch_group_count={groups[1]})"
            )
    if name == "gather":
        return "a gather other than a row lookup table[tokens] with integer tokens"
    return f"a {name} that no rule covers"


def analyse(closed: jex.ClosedJaxpr, n_param_leaves: int, fuse_bias: bool = True) -> Analysis:
    """Finds the structured uses of the first ``n_param_leaves`` inputs of ``closed``.

    With ``fuse_bias``, a bias added to the output of a product or convolution, one
    entry per output unit, joins that use as a constant input column; any other sum
    or product of a parameter view with a non-parameter is an elementwise shift or
    scale (:func:`_elementwise_use`) when its view allows.
    """
    uses: list[Use] = []
    use_sites: list = []  # per use: the equation whose source line names it (if tied)
    bad: dict[int, str] = {}  # leaf -> the first reason it falls back

    def fall_back(leaf: int, reason: str, eqn=None) -> None:
        """Records the first reason ``leaf`` falls back, with the user's line of
        ``eqn`` where JAX recorded it."""
        if leaf not in bad:
            where = "" if eqn is None else _source_location(eqn)
            bad[leaf] = f"{reason}; at {where}" if where else reason

    use_of_output: dict = {}  # output var of a dot / conv use -> use index
    bias_candidates: list[tuple[int, int, int, tuple]] = []  # (use, shift use, leaf, eqns)
    leaf_shapes = [tuple(v.aval.shape) for v in closed.jaxpr.invars[:n_param_leaves]]

    def walk(jaxpr, origins: dict, path: tuple, inside: str = "", call=None):
        # origins: var -> (leaf, view chain as hashable steps, view equations); call:
        # the outermost inlined call (jit) around ``jaxpr``, whose source location is
        # the user's (a jitted function's own trace may come from its cache).
        def origin(v):
            return None if _literal(v) else origins.get(v)

        readers: dict = {}  # var -> how many equations (or the outputs) read it
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if not _literal(v):
                    readers[v] = readers.get(v, 0) + 1
        for v in jaxpr.outvars:
            if not _literal(v):
                readers[v] = readers.get(v, 0) + 1

        for i, eqn in enumerate(jaxpr.eqns):
            here = path + (i,)
            ins = [origin(v) for v in eqn.invars]
            name = eqn.primitive.name
            if _inlined(eqn):  # scalar constants passed in stay known inside
                sub, consts = _sub_jaxpr(eqn)
                for outer, inner in zip(eqn.invars, sub.invars, strict=False):
                    value = _scalar(outer, known)
                    if value is None:  # a jaxpr JAX reuses for another call: forget
                        known.pop(inner, None)
                    else:
                        known[inner] = value
                known.update(_scalar_constants(sub.constvars, consts))
            if not any(o is not None for o in ins):
                if name == "convert_element_type":  # of a scalar constant: still known
                    value = _scalar(eqn.invars[0], known)
                    if value is not None:
                        known[eqn.outvars[0]] = value
                continue
            factor = _constant_factor(eqn, ins, known)
            if factor is not None:  # W / 8, -W, c * W: a view with a factor
                leaf, chain, eqns = next(o for o in ins if o is not None)
                origins[eqn.outvars[0]] = (leaf, chain + (("scale_by", factor),), eqns)
                continue
            if _inlined(eqn):
                sub, _ = _sub_jaxpr(eqn)
                sub_origins = {v: o for v, o in zip(sub.invars, ins, strict=True) if o is not None}
                name_here = eqn.params.get("name")
                within = f" inside {name_here}" if isinstance(name_here, str) else inside
                walk(sub, sub_origins, here, within, call or eqn)  # returned views: marked there
                continue
            if name in _VIEW_PRIMITIVES or name == "broadcast_in_dim":
                if len(eqn.invars) != 1:
                    for o in ins:
                        if o is not None:
                            fall_back(o[0], f"a {name} with several operands", call or eqn)
                    continue
                leaf, chain, eqns = ins[0]
                step = (name, tuple(sorted((k, repr(v)) for k, v in eqn.params.items())))
                origins[eqn.outvars[0]] = (leaf, chain + (step,), eqns + (eqn,))
                continue
            if name == "convert_element_type" and _float_cast(eqn):
                # A widening cast (float32 parameters meeting float64 inputs): the same
                # entries, so a view; not replayed on entry indices (``eqns``), whose
                # order it keeps.
                leaf, chain, eqns = ins[0]
                step = (name, str(eqn.outvars[0].aval.dtype))
                origins[eqn.outvars[0]] = (leaf, chain + (step,), eqns)
                continue
            if (
                name in _ELEMENTWISE_PRIMITIVES
                and len(ins) == 2
                and sum(o is not None for o in ins) == 1
            ):
                b_side = 0 if ins[0] is not None else 1
                leaf, _, eqns = ins[b_side]
                use = _elementwise_use(eqn, ins, here, leaf_shapes[leaf])
                if use is None:
                    fall_back(leaf, _rule_miss_reason(eqn, ins), call or eqn)
                    continue
                uses.append(use)
                use_sites.append(call or eqn)
                y = eqn.invars[1 - b_side]
                # A bias fuses with its product only when the product's output feeds
                # this add alone (so the cotangent at the product equals the one at the
                # bias) and the sum has the product's shape.
                if (
                    name == "add"
                    and not _literal(y)
                    and y in use_of_output
                    and readers.get(y) == 1
                    and tuple(eqn.outvars[0].aval.shape) == tuple(y.aval.shape)
                ):
                    bias_candidates.append((use_of_output[y], len(uses) - 1, leaf, eqns))
                continue
            rule = _RULES.get(name)
            n_params = sum(o is not None for o in ins)
            if rule is not None and n_params == 1:
                use = rule(eqn, ins, here)
                if use is not None:
                    uses.append(use)
                    use_sites.append(call or eqn)
                    use_of_output[eqn.outvars[0]] = len(uses) - 1
                    continue
                reason = _rule_miss_reason(eqn, ins)
            elif n_params > 1 and (rule is not None or name in _ELEMENTWISE_PRIMITIVES):
                reason = f"a {name} of two parameter views (e.g. W @ W or s * s)"
            elif name == "convert_element_type":
                a, b = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
                reason = (
                    f"cast to a lower precision ({a} -> {b}, convert_element_type), e.g. "
                    f"a Flax layer with dtype=jnp.{b}: autodiff's rounded Jacobian is used"
                    if jnp.issubdtype(b, jnp.floating)
                    else f"cast from {a} to {b} (convert_element_type)"
                )
            elif name in _PRIMITIVE_REASONS:
                reason = _PRIMITIVE_REASONS[name]
                function = _function_name(eqn)
                if function:  # e.g. "passed through relu, a function with ..."
                    reason = reason.replace("a function", f"{function}{inside}, a function")
            else:
                reason = f"used by {name}{inside}, which no rule covers"
            for o in ins:  # any other use of a parameter view
                if o is not None:
                    fall_back(o[0], reason, call or eqn)
        for v in jaxpr.outvars:
            o = None if _literal(v) else origins.get(v)
            if o is not None:
                fall_back(o[0], "returned by the model itself (a parameter view as output)")

    invars = closed.jaxpr.invars[:n_param_leaves]
    # The model's scalar constants (e.g. jnp.sqrt(2.0) closed over), and inside inlined
    # calls those passed in or closed over there.
    known = _scalar_constants(closed.jaxpr.constvars, closed.consts)
    walk(closed.jaxpr, {v: (i, (), ()) for i, v in enumerate(invars)}, ())
    by_leaf: dict[int, list[int]] = {}
    for u, use in enumerate(uses):
        by_leaf.setdefault(use.leaf, []).append(u)
    for leaf, members in by_leaf.items():
        if len({uses[u].key for u in members}) > 1:  # different views: no pairing
            fall_back(leaf, _unpaired_reason(uses, use_sites, members))
    uses_per_leaf = {leaf: len(m) for leaf, m in by_leaf.items()}
    fused: dict[int, int] = {}  # use index (in ``uses``) -> bias leaf
    absorbed_uses: set[int] = set()  # shift uses replaced by a fused bias
    for u, s, leaf, eqns in bias_candidates:
        use = uses[u]
        ok = (
            fuse_bias
            and leaf not in bad
            and uses_per_leaf[leaf] == 1  # this add is the bias's only use
            and uses[s].factor == 1.0  # a scaled bias stays an elementwise shift
            and use.leaf not in bad
            and uses_per_leaf[use.leaf] == 1
            and use.kind in ("dot", "conv")
            and _bias_fusable(eqns, leaf_shapes[leaf], use)
        )
        if ok:  # otherwise the add stays an elementwise shift
            fused[u] = leaf
            absorbed_uses.add(s)
    kept_index = [u for u, use in enumerate(uses) if use.leaf not in bad and u not in absorbed_uses]
    kept = [uses[u] for u in kept_index]
    biased = tuple(u in fused for u in kept_index)
    bias_leaves = tuple(fused.get(u, -1) for u in kept_index)
    groups: dict[int, list[int]] = {}
    for u, use in enumerate(kept):
        groups.setdefault(use.leaf, []).append(u)
    absorbed = set(fused.values())
    structured = set(groups) | absorbed
    fallback = tuple(i for i in range(n_param_leaves) if i not in structured)
    reasons = tuple(bad.get(i, "not used by the model: its kernel is zero") for i in fallback)
    return Analysis(
        tuple(kept),
        fallback,
        tuple(tuple(g) for g in groups.values()),
        biased,
        bias_leaves,
        reasons,
        tuple(str(v.aval.dtype) for v in invars),
    )


def _probe(use: Use, delta) -> tuple:
    """What :func:`_evaluate` does at a use: ``(recorded operand, delta)`` adds the
    delta to the output; ``(..., delta, operand)`` to that (parameter) operand."""
    if use.kind in ELEMENTWISE_KINDS:
        return (use.x_side, delta, use.x_info[0])
    return (use.x_side, delta)


def _conv_with_canonical_transpose(eqn, lhs, rhs):
    """``conv_general_dilated(lhs, rhs)`` as ``eqn`` binds it, with a JVP rule whose
    transpose (the reverse pass to ``lhs``) convolves with the flipped kernel
    materialised in the canonical (spatial..., in, out) order.

    Equal in value, and in every derivative, to the plain convolution (the tangent of
    ``lhs`` goes through the same kernel, laid out differently; that of ``rhs`` through
    the plain convolution). Without the materialised kernel, XLA on CPU compiles the
    transposed convolution inside a loop (``fori_loop``, ``lax.map``) as a naive loop
    nest, about 5x slower than the same convolution outside one; the chunked features
    run in such a loop.
    """
    params = eqn.params
    dn = params["dimension_numbers"]
    n_sp = len(dn.rhs_spec) - 2
    spatial = tuple(range(n_sp))
    # The kernel in physical order (spatial..., O, I): the transpose rule swaps O and I,
    # so its transposed convolution reads it as (spatial..., in, out).
    order = tuple(dn.rhs_spec[2:]) + (dn.rhs_spec[0], dn.rhs_spec[1])
    turned = dict(params, dimension_numbers=dn._replace(rhs_spec=(n_sp, n_sp + 1) + spatial))

    @jax.custom_jvp
    def conv(x, w):
        return _bind(eqn, [x, w])

    def conv_jvp(primals, tangents):
        x, w = primals
        dx, dw = tangents
        y = _bind(eqn, [x, w])
        t = None
        if not isinstance(dx, jax.custom_derivatives.SymbolicZero):
            # The transpose rule reverses this kernel: reverse it here first, behind a
            # barrier XLA cannot fold through, so that the two reversals cancel and the
            # transposed convolution reads a materialised, unreversed array.
            flipped = barrier(jnp.flip(jnp.transpose(w, order), spatial))
            t = eqn.primitive.bind(dx, jnp.flip(flipped, spatial), **turned)
        if not isinstance(dw, jax.custom_derivatives.SymbolicZero):
            tw = _bind(eqn, [x, dw])
            t = tw if t is None else t + tw
        if t is None:
            t = jnp.zeros_like(y)
        return y, t

    conv.defjvp(conv_jvp, symbolic_zeros=True)
    return conv(lhs, rhs)


def _evaluate(jaxpr, consts, args, probes: dict, records: dict, path=()):
    env = {}

    def read(v):
        return v.val if _literal(v) else env[v]

    for v, val in zip(jaxpr.constvars, consts, strict=True):
        env[v] = val
    for v, val in zip(jaxpr.invars, args, strict=True):
        env[v] = val
    for i, eqn in enumerate(jaxpr.eqns):
        here = path + (i,)
        invals = [read(v) for v in eqn.invars]
        if _inlined(eqn):
            sub, sub_consts = _sub_jaxpr(eqn)
            outs = _evaluate(sub, sub_consts, invals, probes, records, here)
        else:
            probe = probes.get(here)
            if probe is not None:
                records[here] = invals[probe[0]]
                if len(probe) == 3:  # the delta on a parameter operand
                    invals[probe[2]] = invals[probe[2]] + probe[1]
            if (
                eqn.primitive.name == "conv_general_dilated"
                and eqn.params["feature_group_count"] == 1
                and eqn.params["batch_group_count"] == 1
            ):
                outs = _conv_with_canonical_transpose(eqn, *invals)
            else:
                outs = _bind(eqn, invals)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            if probe is not None and len(probe) == 2:
                outs = [outs[0] + probe[1]]
        for v, val in zip(eqn.outvars, outs, strict=True):
            env[v] = val  # a dropped output (DropVar) is never read
    return [read(v) for v in jaxpr.outvars]


def analysis_for(
    apply3, params, x_one, aux, fuse_bias: bool = True
) -> tuple[Analysis, jex.ClosedJaxpr]:
    """The structured analysis of ``apply3`` on one sample (shapes suffice)."""
    closed = jax.make_jaxpr(per_sample(apply3))(params, x_one, aux)
    return analyse(closed, len(jax.tree.leaves(params)), fuse_bias), closed


def patches(x, geometry):
    """Input patches of a convolution: ``(C_in·W, A)`` for one sample's input ``x``.

    Rows follow the input channel, then the window offsets in the kernel's spatial
    order; columns the output positions (batch, then the spatial axes in the
    convolution's order), so that ``y[a, k] = Σ_c patches[c, a] · W'[c, k]`` with ``W'``
    the kernel transposed to ``(C_in, *window, K)``. Built from padding and strided
    slices only (exact, no convolution), in the layout that needs no transpose.
    """
    lhs_spec, window, strides, padding, lhs_dil, rhs_dil, out_spatial = geometry
    x = jnp.transpose(x, (lhs_spec[1], lhs_spec[0]) + tuple(lhs_spec[2:]))  # (C_in, B, *sp)
    zero = jnp.zeros((), x.dtype)
    config = [(0, 0, 0), (0, 0, 0)] + [
        (lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dil, strict=True)
    ]
    x = lax.pad(x, zero, config)
    slices = []
    for offset in itertools.product(*(range(w) for w in window)):
        start = [0, 0] + [o * d for o, d in zip(offset, rhs_dil, strict=True)]
        limit = list(x.shape[:2]) + [
            s + (n - 1) * st + 1 for s, n, st in zip(start[2:], out_spatial, strides, strict=True)
        ]
        slices.append(lax.slice(x, start, limit, (1, 1) + tuple(strides)))
    p = jnp.stack(slices, axis=1)  # (C_in, W, B, *out_spatial)
    return p.reshape((p.shape[0] * p.shape[1], -1))


def _bias_in_gram(analysis: Analysis, modes, u: int) -> bool:
    """Whether use ``u`` is a Dense layer with a fused bias in the Gram form: then
    (x·x' + 1)(g·g') adds 1 to the input Gram matrix (:func:`contract`) instead of a
    column of ones to the inputs (:func:`features`), whose copy and odd width cost
    about 4% of the MLP 784-1000-1 kernel on XLA CPU."""
    use = analysis.uses[u]
    return (
        bool(analysis.biased)
        and analysis.biased[u]
        and use.kind == "dot"
        and use.a_size == 1
        and _gram(analysis, modes, u)
    )


def _input_matrix(use: Use, xu, biased: bool):
    """The recorded input of one use, batched: ``(N, A, C)``; ``(N, C, A)`` for a
    convolution (its patches' natural layout); tokens ``(N, A)`` for a gather."""
    if use.kind == "gather":
        return xu.reshape((xu.shape[0], use.a_size))
    if use.kind == "conv":
        xu = jax.vmap(lambda v: patches(v, use.x_info))(xu)
        if biased:  # the fused bias: a constant input row
            xu = jnp.concatenate([xu, jnp.ones((xu.shape[0], 1, xu.shape[2]), xu.dtype)], axis=1)
        return xu
    x_free, x_contract = use.x_info
    perm = (0,) + tuple(1 + a for a in x_free) + tuple(1 + a for a in x_contract)
    xu = jnp.transpose(xu, perm).reshape((xu.shape[0], use.a_size, -1))
    if biased:  # the fused bias: a constant input column
        xu = jnp.concatenate([xu, jnp.ones(xu.shape[:2] + (1,), xu.dtype)], axis=-1)
    return xu


def _x_spec(use: Use, n: str, a: str, c: str) -> str:
    """Einsum subscripts of a use's input matrix (see :func:`_input_matrix`)."""
    return f"{n}{c}{a}" if use.kind == "conv" else f"{n}{a}{c}"


def _token_match(use: Use, t1, t2, mask_spec_batch_diagonal: bool):
    """``[t1_a = t2_b]`` for valid tokens, float: ``(N1, A, N2, B)``, or ``(N, A, B)`` on
    the batch diagonal. Out-of-range tokens are clamped (``clip``) or match nothing."""
    vocab = use.x_contract_size
    (mode,) = use.x_info

    def norm(t):
        if mode == "CLIP":
            return jnp.clip(t, 0, vocab - 1)
        return jnp.where((t >= 0) & (t < vocab), t, -1)

    t1, t2 = norm(t1), norm(t2)
    if mask_spec_batch_diagonal:
        eq = t1[:, :, None] == t2[:, None, :]
        valid = (t1 >= 0)[:, :, None]
    else:
        eq = t1[:, :, None, None] == t2[None, None, :, :]
        valid = (t1 >= 0)[:, :, None, None]
    return (eq & valid).astype(use.y_dtype)


def _explicit_jacobian(use: Use, xm, g):
    """``J[c, k] = Σ_a x[a, c] g[a, k]`` per sample and output entry: ``(N, *O, C, K)``.

    Written as the batched matrix product whose natural output is ``(N, C, O, K)``
    (other output orders make XLA on CPU copy the large input operand first).
    """
    lead = g.shape[:-2]
    g3 = g.reshape((g.shape[0], -1) + g.shape[-2:])  # (N, O, A, K)
    j = jnp.einsum(f"{_x_spec(use, 'n', 'a', 'c')},noak->ncok", xm, g3)
    return jnp.moveaxis(j, 1, 2).reshape(lead + (j.shape[1], j.shape[3]))


#: Kinds whose explicit Jacobian is built from the recorded operand itself (no input
#: matrix): convolutions (patches, chunked) and elementwise scales and shifts.
_RAW_INPUT_KINDS = frozenset({"conv"}) | ELEMENTWISE_KINDS
#: Kinds whose Use.factor goes on the recorded input (see :func:`features`).
_INPUT_SCALED = frozenset({"dot", "conv"})

#: Values of convolution patches formed at once when building per-sample Jacobians:
#: a few MiB, so that they stay in cache instead of crossing main memory.
_PATCH_CHUNK_VALUES = 2**19


def _conv_jacobian(use: Use, xu, g, biased: bool):
    """Per-sample kernel Jacobian of a convolution, ``(N, *O, C, K)``, from its recorded
    inputs ``(N, *lhs)`` and cotangents ``(N, *O, A, K)``: patches times cotangents,
    a few samples at a time (:func:`map_in_batches`) so that the patches, C/K times larger than
    the Jacobian, never exist for the whole batch at once."""
    lead = g.shape[:-2]
    g3 = g.reshape((g.shape[0], -1) + g.shape[-2:])  # (N, O, A, K)

    def one(args):
        x_i, g_i = args
        pm = patches(x_i, use.x_info)  # (C, A)
        if biased:
            pm = jnp.concatenate([pm, jnp.ones((1, pm.shape[1]), pm.dtype)], axis=0)
        return jnp.moveaxis(jnp.einsum("ca,oak->cok", pm, g_i), 0, 1)  # dot's own order

    rows = max(1, _PATCH_CHUNK_VALUES // max(1, use.a_size * use.x_contract_size))
    j = map_in_batches(jax.vmap(one), (xu, g3), rows)
    return j.reshape(lead + j.shape[-2:])


def map_in_batches(fn, args, most: int):
    """``fn(args)`` for a batched ``fn`` (leading axis N), at most ``most`` samples at
    a time in one XLA loop: the batches are evened out to ⌈N / ⌈N / most⌉⌉ samples and
    the last one overlaps its predecessor, so the program holds ``fn`` once
    (``lax.map(..., batch_size=)`` compiles it a second time for the remainder: 1.9 s
    instead of 1.1 s for the LeNet's features)."""
    n = jax.tree.leaves(args)[0].shape[0]
    if most >= n:
        return fn(args)
    pieces = -(-n // most)
    size = -(-n // pieces)

    def part(start):
        return fn(jax.tree.map(lambda v: lax.dynamic_slice_in_dim(v, start, size, 0), args))

    shapes = jax.eval_shape(part, 0)
    out = jax.tree.map(lambda s: jnp.zeros((n,) + s.shape[1:], s.dtype), shapes)

    def step(i, out):
        start = jnp.minimum(i * size, n - size)
        return jax.tree.map(
            lambda o, p: lax.dynamic_update_slice_in_dim(o, p, start, 0), out, part(start)
        )

    return lax.fori_loop(0, pieces, step, out)


def _one_hot_jacobian(use: Use, tokens, g):
    """Explicit per-sample Jacobian of a lookup: ``J[v, d] = Σ_a [t_a = v] g[a, d]``."""
    (mode,) = use.x_info
    vocab = use.x_contract_size
    if mode == "CLIP":
        tokens = jnp.clip(tokens, 0, vocab - 1)
    hot = jax.nn.one_hot(tokens, vocab, dtype=g.dtype)  # out of range: all zero
    return jnp.einsum("nav,n...ad->n...vd", hot, g)


def _elementwise_jacobian(use: Use, g):
    """Per-sample Jacobian of an elementwise scale or shift in the leaf's order,
    ``(N, *O, K)``, from the cotangents at its parameter operand ``(N, *O, A, K)``
    (Σ_broadcast x·g and ±Σ g already reduced by the reverse pass): ``Σ_a g[a, k]``."""
    _, leaf_order = use.x_info
    j = g[..., 0, :] if use.a_size == 1 else jnp.sum(g, axis=-2)
    return j[..., np.asarray(leaf_order)] if leaf_order else j


#: Bytes of per-sample intermediates that the features phase may hold at once: the
#: samples of a block are processed :func:`chunk_size` at a time, so that the forward
#: values, residuals and cotangents of the reverse passes (and the recorded inputs and
#: the cotangents at every use) of a whole block never coexist.
FEATURE_CHUNK_BYTES = 2**28


def _values_produced(jaxpr) -> int:
    """Values one evaluation of ``jaxpr`` writes (its equations' outputs, sub-jaxprs
    counted once)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
        sub = _sub_jaxpr(eqn)
        if sub is not None:
            total += _values_produced(sub[0])
    return total


def chunk_size(apply3, params, x, aux, out_tree, fuse_bias: bool, modes) -> int:
    """Samples of ``x`` whose structured features are computed together:

        B = FEATURE_CHUNK_BYTES // (itemsize · ((O + 2)·V + F)),  1 ≤ B ≤ N,

    then evened out to ⌈N / ⌈N / B⌉⌉ so that the chunks are about equal,
    with V the values one sample's forward pass writes, O the output entries per
    sample (the reverse passes keep the forward values, their residuals and O
    cotangents of each alive) and F the feature values of one sample (Jacobians of
    fallback leaves and explicit groups, inputs and cotangents of Gram-form uses).
    :func:`features_in_chunks` loops over them inside one compiled call.
    """
    x_one = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v)[1:], v.dtype), x)
    analysis, closed = analysis_for(apply3, params, x_one, aux, fuse_bias)
    n = np.shape(jax.tree.leaves(x)[0])[0]
    outs = out_tree.flatten_up_to(jax.eval_shape(per_sample(apply3), params, x_one, aux))
    out_size = sum(math.prod(o.shape) for o in outs)
    leaves = jax.tree.leaves(params)
    width = sum(math.prod(np.shape(leaves[i])) for i in analysis.fallback)
    for group, mode in zip(analysis.groups, modes, strict=True):
        if mode == "explicit":
            width += analysis.input_size(group[0]) * analysis.uses[group[0]].w_free_size
    gram_values = sum(
        use.a_size * (analysis.input_size(u) + out_size * use.w_free_size)
        for u, use in enumerate(analysis.uses)
        if _gram(analysis, modes, u)
    )
    itemsize = max((np.dtype(o.dtype).itemsize for o in outs), default=4)
    values = (out_size + 2) * _values_produced(closed.jaxpr) + out_size * width + gram_values
    most = int(min(n, max(1, FEATURE_CHUNK_BYTES // max(itemsize * values, 1))))
    pieces = -(-n // most)
    return -(-n // pieces)  # balanced: the overlapping last chunk repeats < pieces samples


def features_in_chunks(
    apply3, params, x, aux, out_tree, fuse_bias: bool, modes, merge_limits, chunk: int
):
    """:func:`features` of ``x`` computed ``chunk`` samples at a time in an XLA loop,
    written into the outputs in place: the transient memory of the forward and reverse
    passes is that of one chunk. The last chunk overlaps its predecessor (every step
    has the same shapes); the rows they share are written twice with equal values."""
    return map_in_batches(
        lambda xb: features(apply3, params, xb, aux, out_tree, fuse_bias, modes, merge_limits),
        x,
        chunk,
    )


def features(
    apply3, params, x, aux, out_tree, fuse_bias: bool = True, modes=None, merge_limits=None
):
    """Per-sample structured features of a batch.

    Returns a dict with ``"fallback"``: per output leaf, a list of explicit Jacobians
    ``(N, *O, P_l)``; ``"explicit"``: per output leaf, per ``"explicit"`` group, the
    Jacobian ``(N, *O, C·K)`` from the recorded inputs and cotangents; ``"merged"``: per
    output leaf, an empty list, or with ``merge_limits`` (per output leaf) the fallback
    and explicit Jacobians merged by :func:`ntk_core._jacobian.merge` (the narrow ones
    concatenated; ``"fallback"`` and ``"explicit"`` are then empty); ``"x"``: per use,
    layer inputs ``(N, A, C)`` (tokens ``(N, A)``; None for explicit groups); ``"g"``:
    per output leaf, per use, cotangents ``(N, *O, A, K)`` (None for explicit groups).
    """
    x_one = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype), x)
    analysis, closed = analysis_for(apply3, params, x_one, aux, fuse_bias)
    if modes is None:
        modes = ("gram",) * len(analysis.groups)
    param_leaves = jax.tree.leaves(params)

    def one(x_i):
        leaves_x = jax.tree.leaves(x_i)
        leaves_aux = jax.tree.leaves(aux)

        def run(fb, deltas):
            leaves = list(param_leaves)
            for i, v in zip(analysis.fallback, fb, strict=True):
                leaves[i] = v
            probes = {
                use.path: _probe(use, d) for use, d in zip(analysis.uses, deltas, strict=True)
            }
            records: dict = {}
            outs = _evaluate(
                closed.jaxpr, closed.consts, leaves + leaves_x + leaves_aux, probes, records
            )
            return outs, [records[use.path] for use in analysis.uses]

        fb0 = [param_leaves[i] for i in analysis.fallback]
        d0 = [jnp.zeros(use.y_shape, use.y_dtype) for use in analysis.uses]
        # Per output leaf: (Jacobians of the fallback leaves, cotangents at each use).
        jac, xs = jax.jacrev(run, argnums=(0, 1), has_aux=True)(fb0, d0)
        return jac, xs

    out_shapes = out_tree.flatten_up_to(jax.eval_shape(apply3, params, x, aux))
    biased = analysis.biased or (False,) * len(analysis.uses)

    # Inputs and cotangents of a use whose weights were widened (float32 parameters
    # meeting float64 inputs) are contracted in the promoted dtype, and each leaf's
    # kernel comes out in its own dtype, as its Jacobian would.
    leaf_dtypes = analysis.leaf_dtypes
    work = [jnp.promote_types(leaf_dtypes[use.leaf], use.y_dtype) for use in analysis.uses]

    # A constant factor of the weights (Use.factor) scales the recorded input of a
    # product or convolution (not a fused bias's ones, added later), else the cotangent.
    x_factors = [use.factor if use.kind in _INPUT_SCALED else 1.0 for use in analysis.uses]
    g_factors = [use.factor if use.kind not in _INPUT_SCALED else 1.0 for use in analysis.uses]

    def prepared(v, dtype, factor):
        if jnp.issubdtype(v.dtype, jnp.floating):  # not a gather's tokens
            v = v.astype(dtype)
        return v if factor == 1.0 else v * factor

    def batch(xb):
        jac, xs = jax.vmap(one)(xb)
        j_fb = [pair[0] for pair in jac]
        j_d = [
            [prepared(g, w, f) for g, w, f in zip(pair[1], work, g_factors, strict=True)]
            for pair in jac
        ]
        xs = [prepared(v, w, f) for v, w, f in zip(xs, work, x_factors, strict=True)]
        x_mats = [
            None
            if use.kind in _RAW_INPUT_KINDS and not _gram(analysis, modes, u)
            else _input_matrix(use, xu, b and not _bias_in_gram(analysis, modes, u))
            for u, (use, xu, b) in enumerate(zip(analysis.uses, xs, biased, strict=True))
        ]
        fallback, explicit, merged, g = [], [], [], []
        for k, o in enumerate(out_shapes):
            o_ndim = len(o.shape)  # (N, *O)
            fb_k = [j.reshape(j.shape[:o_ndim] + (-1,)) for j in j_fb[k]]
            per_use = []
            for use, gu in zip(analysis.uses, j_d[k], strict=True):
                # gu: (N, *O, *y) -> (N, *O, A, K)
                lead = gu.shape[:o_ndim]
                perm = tuple(range(o_ndim)) + tuple(o_ndim + a for a in use.y_perm)
                gu = jnp.transpose(gu, perm).reshape(lead + (use.a_size, use.w_free_size))
                per_use.append(gu)
            per_group = []
            for group, mode in zip(analysis.groups, modes, strict=True):
                if mode != "explicit":
                    continue
                total = None
                for u in group:
                    use = analysis.uses[u]
                    if use.kind == "gather":
                        j = _one_hot_jacobian(use, x_mats[u], per_use[u])
                    elif use.kind == "conv":
                        j = _conv_jacobian(use, xs[u], per_use[u], biased[u])
                    elif use.kind in ELEMENTWISE_KINDS:
                        j = _elementwise_jacobian(use, per_use[u])
                    else:
                        j = _explicit_jacobian(use, x_mats[u], per_use[u])
                    total = j if total is None else total + j
                leaf_dtype = leaf_dtypes[analysis.uses[group[0]].leaf]
                per_group.append(total.reshape(total.shape[:o_ndim] + (-1,)).astype(leaf_dtype))
            if merge_limits is None:
                fallback.append(fb_k)
                explicit.append(per_group)
                merged.append([])
            else:
                fallback.append([])
                explicit.append([])
                merged.append(_jacobian.merge(fb_k + per_group, merge_limits[k]))
            g.append([gu if _gram(analysis, modes, u) else None for u, gu in enumerate(per_use)])
        x_out = [xm if _gram(analysis, modes, u) else None for u, xm in enumerate(x_mats)]
        return {"fallback": fallback, "explicit": explicit, "merged": merged, "x": x_out, "g": g}

    return batch(x)


def _gram(analysis: Analysis, modes, u: int) -> bool:
    for group, mode in zip(analysis.groups, modes, strict=True):
        if u in group:
            return mode == "gram"
    return True


def _fresh_letters(used: str, n: int) -> list[str]:
    free = [c for c in string.ascii_letters if c not in used]
    return free[:n]


def _single_position_term(
    x1_spec, x2_spec, g_specs, out, x1, x2, g1, g2, precision, plus_one=False
):
    """The Gram form of two uses with one output position each (a Dense layer): the
    input Gram matrix ``(N1, N2)`` times the cotangent Gram matrix, as an elementwise
    product. (One einsum of all four operands lowers that product to a batched product
    of 1 x 1 matrices, about 2.5x slower on XLA CPU.) Subscripts as in
    :func:`contract`: the sample letter leads each input's, ``g_specs`` are the two
    cotangents'."""
    samples = x1_spec[0] if x1_spec[0] == x2_spec[0] else x1_spec[0] + x2_spec[0]
    # The size-1 position axes sum away.
    xx = _jacobian.pair_einsum(x1_spec, x2_spec, samples, x1, x2, precision)
    if plus_one:  # a fused bias (see _bias_in_gram)
        xx = xx + 1
    gg = _jacobian.pair_einsum(*g_specs.split(","), out, g1, g2, precision)
    # ``samples`` is in ``out``'s order (the N1 axis comes first): expand to its rank.
    return gg * xx.reshape(tuple(xx.shape[samples.index(s)] if s in samples else 1 for s in out))


def contract(layouts, analysis_leaves, analysis, f1, f2, precision):
    """Per output leaf, the list of each parameter leaf's kernel (they sum to the NTK);
    with merged features (``f1["merged"]``, see :func:`features`) the list starts with
    the kernels of the merged Jacobians instead of their leaves' own.

    ``analysis_leaves`` is ``(n_leaves, fallback leaf ids, groups of use indices, group
    leaf ids, group modes)`` and ``analysis`` the :class:`Analysis` they come from.
    """
    n_leaves, fallback, groups, group_leaves, modes = analysis_leaves
    kernels = []
    for k, layout in enumerate(layouts):
        lhs, rhs, out = layout.specs(n_contracted=1)
        n1_shape = next(
            a.shape[: layout.ndim]
            for a in (
                list(f1["fallback"][k])
                + list(f1["explicit"][k])
                + list(f1["merged"][k])
                + [gu for gu in f1["g"][k] if gu is not None]
            )
        )
        size = layout.trace_size(n1_shape)
        per_leaf = [None] * n_leaves

        def jacobian_term(a, b, specs=(lhs, rhs, out), size=size):
            return _jacobian.pair_einsum(*specs, a, b, precision) / size

        # Merged Jacobians (fallback leaves and explicit groups, not split per leaf).
        merged = [
            jacobian_term(a, b) for a, b in zip(f1["merged"][k], f2["merged"][k], strict=True)
        ]
        if not merged:
            for leaf, a, b in zip(fallback, f1["fallback"][k], f2["fallback"][k], strict=True):
                per_leaf[leaf] = jacobian_term(a, b)
        lo, ro, _ = layout.specs()
        ia, ib, c, kk = _fresh_letters(lo + ro + out, 4)
        explicit_index = 0
        for leaf, group, mode in zip(group_leaves, groups, modes, strict=True):
            if mode == "explicit":
                if merged:
                    continue
                a = f1["explicit"][k][explicit_index]
                b = f2["explicit"][k][explicit_index]
                explicit_index += 1
                per_leaf[leaf] = jacobian_term(a, b)
                continue
            total = None
            for u, v in itertools.product(group, group):
                use, use_v = analysis.uses[u], analysis.uses[v]
                g1, g2 = f1["g"][k][u], f2["g"][k][v]
                x1, x2 = f1["x"][u], f2["x"][v]
                if use.kind == "gather":
                    diagonal = lo[0] == ro[0]
                    match = _token_match(use, x1, x2, diagonal)
                    m_spec = f"{lo[0]}{ia}{ib}" if diagonal else f"{lo[0]}{ia}{ro[0]}{ib}"
                    term = jnp.einsum(
                        f"{m_spec},{lo}{ia}{kk},{ro}{ib}{kk}->{out}",
                        match,
                        g1,
                        g2,
                        precision=precision,
                        optimize="optimal",
                    )
                else:
                    x1_spec = _x_spec(use, lo[0], ia, c)
                    x2_spec = _x_spec(use_v, ro[0], ib, c)
                    g_specs = f"{lo}{ia}{kk},{ro}{ib}{kk}"
                    if use.a_size == 1 and use_v.a_size == 1:
                        # A fused bias's use is its leaf's only one (u == v).
                        term = _single_position_term(
                            x1_spec,
                            x2_spec,
                            g_specs,
                            out,
                            x1,
                            x2,
                            g1,
                            g2,
                            precision,
                            _bias_in_gram(analysis, modes, u),
                        )
                    else:
                        term = jnp.einsum(
                            f"{x1_spec},{x2_spec},{g_specs}->{out}",
                            x1,
                            x2,
                            g1,
                            g2,
                            precision=precision,
                            optimize="optimal",
                        )
                total = term if total is None else total + term
            per_leaf[leaf] = (total / size).astype(analysis.leaf_dtypes[leaf])
        # None: fused biases, and leaves in the merged Jacobians.
        kernels.append(merged + [term for term in per_leaf if term is not None])
    return kernels
