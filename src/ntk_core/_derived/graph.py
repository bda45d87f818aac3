"""The jaxpr walk: a plain JAX model ``apply_fn(params, x)`` as a graph of infinite-width
layers (:class:`Graph`), each node a kernel map of :mod:`ntk_core._infinite`'s rules.

Every value of the traced program is read as one of a few symbols, by what it depends on:

- :class:`Const`: neither params nor x (evaluated: the scalings are numbers);
- :class:`Param`: a linear view of one parameter leaf (transposed, reshaped, cast,
  broadcast, times a constant): a weight, a bias or a gain where it meets x;
- :class:`Opaque`: any other function of the params (refused where it meets x);
- :class:`Act`: a node of the graph, an (N, *S, C) activation with i.i.d. channels;
- :class:`Affine`: a matrix product or convolution with a weight leaf, not yet finished
  (a constant scaling and biases may still join it);
- :class:`Chain`: f(u, q) of one node's pre-activation u (and its variance q): a chain
  of elementwise operations, one nonlinearity when it is used;
- :class:`Stat`: a per-sample, per-position channel statistic of one node, which at
  infinite width is the deterministic E[f(u, q)] (LayerNorm's mean and variance).

Samples stay apart (the batch axis 0 is never reduced, the kernel is per pair of
samples). Nodes are channels-last, (N, *S, C); an activation symbol may hold its node's
values in another order (``axes``: each array axis's axis of the node, None for an
inserted unit axis), as channels-first convolutions (equinox's NCHW) and the transposes
around them leave them; each rule reads where the channels and positions are from it.
An input whose first layer reads it channels-first is walked again as if transposed to
channels-last (:attr:`Graph.input_perm`: the kernel function transposes x so).

Each operation on the activations is recognised by a rule (:data:`X_RULES`, the
elementwise family) that returns its symbol, or None where its parameters do not fit:
then one refusal (:func:`unmapped`) names the primitive, its operands' shapes and
parameters, its source line, what is mapped and the Monte Carlo alternative. Specific
messages remain only where they say more: weight tying, a non-Gaussian input, branches
sharing a weight, a parameter that is not one leaf or not one entry per channel.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex
from jax.extend.core import primitives as prims

from ntk_core._derived.paths import caller
from ntk_core._errors import bad
from ntk_core._jax import jaxpr_walk

MONTE_CARLO = (
    "for this model's kernels at its finite width use Monte Carlo kernels: "
    "ntk_flax / ntk_haiku / ntk_equinox.monte_carlo_kernels(model, x1, key=..., "
    "n_samples=...), or for a plain JAX model ntk_core.monte_carlo_kernels(init_fn, apply_fn, "
    "x1, key=..., n_samples=...) with your own init_fn(key) -> params"
)
#: What the walk maps, for the refusal of what it does not.
MAPPED = (
    "the derivation maps x @ W and convolutions (W one leaf; channels last or first), "
    "per-channel biases and gains, elementwise chains of one pre-activation, sums over all "
    "positions, window sums, Flatten, channel concatenations, sums of independent branches, "
    "LayerNorm's statistics, transposes and unit axes that keep each position's channels"
)

#: Elementwise primitives (by name: several are not exported by jax.extend).
ELEMENTWISE = frozenset(
    "add sub mul div neg max min abs sign exp exp2 log log1p expm1 tanh logistic erf erfc "
    "erf_inv sin cos tan atan asin acos sinh cosh asinh acosh atanh sqrt rsqrt cbrt "
    "integer_pow pow square select_n ge gt le lt eq ne convert_element_type and or not "
    "atan2 clamp reduce_precision copy copy_p".split()
)
#: Layout primitives looked through (on parameters always; on activations when a no-op).
LAYOUT = frozenset(
    "transpose reshape broadcast_in_dim convert_element_type squeeze expand_dims copy copy_p "
    "reduce_precision".split()
)
CALLS = frozenset(
    "pjit jit closed_call core_call custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr "
    "remat remat2 checkpoint".split()
)
#: Casts: a chain runs in the kernel's dtype, whatever the trace's.
CASTS = frozenset({prims.convert_element_type_p, prims.reduce_precision_p, prims.copy_p})
SUMS = frozenset({prims.add_p, prims.sub_p})  # of a bias, or of two branches
SCALINGS = frozenset({prims.mul_p, prims.div_p})  # by a constant


# ----- symbols -----


@dataclasses.dataclass(frozen=True)
class Const:
    value: np.ndarray


@dataclasses.dataclass(frozen=True)
class Param:
    leaf: int
    shape: tuple
    scale: float = 1.0
    views: tuple = ()


@dataclasses.dataclass(frozen=True)
class Opaque:
    leaves: frozenset
    shape: tuple
    via: str = ""  # the primitive that made it (stop_gradient: named in messages)


@dataclasses.dataclass(frozen=True)
class Act:
    node: int
    shape: tuple
    axes: tuple | None = None  # per array axis its node's axis (None: a unit axis); see _axes


@dataclasses.dataclass(frozen=True)
class Affine:
    node_in: int
    shape: tuple
    kind: Kind  # Dense or Conv
    leaf: int
    fan_in: int
    scale: float
    conv: dict | None
    biases: tuple  # ((leaf, scale), ...)
    source: str
    views: tuple
    axes: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Flipped:
    """W @ xᵀ (C_out, N): a Dense layer as vmap writes ``weight @ x`` (equinox), before
    its transpose back to (N, C_out)."""

    affine: Affine


@dataclasses.dataclass(frozen=True)
class Gained:
    """``inner`` times a gain parameter, the multiplication not yet applied: Flax's
    LayerNorm multiplies its scale into rsqrt(var + ε) before the activations."""

    inner: object
    param: Param


@dataclasses.dataclass(frozen=True)
class Chain:
    base: int
    shape: tuple
    f: Callable  # f(u, q)
    prims: tuple
    uses_q: bool
    source: str
    pre: Chain | None = None  # f = post(pre.f): a function of an earlier normalisation
    post: Callable | None = None
    axes: tuple | None = None


def _axes(sym) -> tuple:
    """Which axis of its node each array axis of ``sym`` holds (0 the samples, 1.. the
    positions in order, the last the channels; None an inserted unit axis): the node's own
    channels-last order unless a transpose, a unit axis or a channels-first layer moved them."""
    axes = getattr(sym, "axes", None)
    return tuple(range(len(sym.shape))) if axes is None else tuple(axes)


def _canon(shape, axes) -> tuple:
    """The node's (channels-last) shape of an array of ``shape`` whose axes hold ``axes``."""
    out = [0] * sum(a is not None for a in axes)
    for size, a in zip(shape, axes, strict=True):
        if a is not None:
            out[a] = size
    return tuple(out)


def _channel(axes) -> int:
    """The array axis holding the channels."""
    return axes.index(sum(a is not None for a in axes) - 1)


class _Relayout(Exception):  # noqa: N818 - control flow, never seen by users
    """The input's first layer reads it in another order than channels-last: walk again
    with the input's array axes holding ``axes`` of its node."""

    def __init__(self, axes):
        super().__init__(axes)
        self.axes = axes


@dataclasses.dataclass(frozen=True)
class Stat:
    base: int
    g: Callable  # g(q): E over u ~ N(0, q)
    factor: float  # the value is factor·g(q) (a channel sum: factor C until divided)


@dataclasses.dataclass(frozen=True)
class Refused:
    """A value the walk cannot map, refused only where it is used (a loop's stacked
    per-step activations that the model drops)."""

    error: Exception


# ----- the graph -----

#: The layers a graph is made of (rules.py maps each, report.py prints its name).
Kind = enum.Enum(
    "Kind",
    "Input Dense Conv Bias Gain Nonlinearity Scale Normalise SumPool GlobalSumPool Flatten "
    "FanInSum FanInConcat",
)


@dataclasses.dataclass
class Node:
    """One layer: its :data:`Kind`, its ``inputs`` (node ids), what it is made of (``info``,
    a namespace: leaves, widths, the φ, ...), its source line and what the walk looked
    through to find it."""

    id: int
    kind: Kind
    inputs: tuple
    shape: tuple
    gaussian: bool
    top: frozenset  # the weights (or "x") its value last passed: independence of branches
    info: types.SimpleNamespace
    source: str = ""
    looked: tuple = ()


@dataclasses.dataclass
class Graph:
    nodes: list
    output: int
    roles: dict  # leaf -> ("weight" | "bias" | "gain", fan_in, source)
    names: list  # leaf path names (then the slices', "w[3]")
    parents: dict = dataclasses.field(default_factory=dict)  # slice leaf -> (leaf, index)
    input_perm: tuple | None = None  # x.transpose(input_perm) is channels-last (None: x is)


#: Sources of the calls being walked: an equation of a body traced apart (a library's
#: jitted function) has no user frame of its own and is reported at its call's.
_OUTER: list[str] = []


def _source(eqn) -> str:
    try:
        from jax._src import source_info_util

        text = source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - a message detail only
        text = ""
    return text or (_OUTER[-1] if _OUTER else "an unknown line")


def refuse(eqn, what: str, fix: str = MONTE_CARLO) -> Exception:
    """The walk's message: ``"{primitive} at {source line}: {what}. Fix: {fix}."``."""
    lead = f"{eqn.primitive.name} at {_source(eqn)}: " if eqn is not None else ""
    return bad(ValueError, caller(), lead + what, fix, see="infinite-kernel-fn")


def _shown(value) -> bool:
    """Whether an equation parameter is worth a message: short, not a body or a function."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    body = any(isinstance(i, (jex.ClosedJaxpr, jex.Jaxpr)) or callable(i) for i in items)
    return value is not None and not body and len(str(value)) <= 80


#: The equation being walked and its operands' symbols (messages write x's shapes (N, ...)).
_CURRENT: list = [None]


def shape_text(shape, batched: bool) -> str:
    """A traced shape as the user sees it: the samples' axis as N (the walk traces 2)."""
    shape = tuple(shape)
    if not batched or not shape:
        return str(shape)
    return "(" + ", ".join(["N", *map(str, shape[1:])]) + ")"


def traced_failure(fn: str, x_shape, error: Exception) -> Exception:
    """The model itself failed when traced on inputs of per-sample shape ``x_shape[1:]``
    (x of a rank or size it was not built for, most often)."""
    first = (str(error).strip().splitlines() or [""])[0][:300].rstrip(".")
    what = (
        f"the model failed when traced on x of shape {shape_text(x_shape, True)} (rank "
        f"{len(x_shape)}, per sample {tuple(x_shape[1:])}): {type(error).__name__}: {first}"
    )
    fix = "pass x1 of the shape the model was built for (the x given to its init), N first"
    return bad(type(error) if isinstance(error, TypeError) else ValueError, fn, what, fix)


def unmapped(eqn, what: str | None = None) -> Exception:
    """The one refusal of an operation on the activations the walk does not map (a max or
    a softmax, a loop, a transpose, a strided reshape, a dot or convolution of another
    layout, ...): its primitive, operands' shapes and parameters tell which it is, unless
    ``what`` says it (where the equation is only where a value was used)."""
    if what is None:
        current = _CURRENT[0]
        syms = current[1] if current is not None and current[0] is eqn else [None] * len(eqn.invars)
        shapes = " and ".join(
            shape_text(v.aval.shape, _x_dependent(s)) for v, s in zip(eqn.invars, syms, strict=True)
        )
        params = ", ".join(f"{k}={v}" for k, v in eqn.params.items() if _shown(v))
        what = f"this operation on {shapes}" + (f" with {params}" if params else "")
    return refuse(eqn, f"{what} has no infinite-width rule; {MAPPED}")


def _times(eqn, c):
    """The factor of a scaling ``eqn`` by the constant ``c`` (a mul, or a div by c)."""
    return c if eqn.primitive is prims.mul_p else 1 / c


def _x_dependent(sym) -> bool:
    return isinstance(sym, (Act, Affine, Chain, Stat, Flipped, Gained))


def _scalar(c: Const, eqn):
    """A constant's one value (a constant array of equal entries), else refused: channels
    scaled differently are not i.i.d."""
    v = np.asarray(c.value)
    if v.size == 0:
        return 0.0
    first = v.reshape(-1)[0]
    same = (v == first) | (np.isnan(v) & np.isnan(first)) if v.dtype.kind in "fc" else v == first
    if v.size > 1 and not np.all(same):
        raise unmapped(eqn, "a constant whose entries differ (channels no longer alike)")
    return first.item() if hasattr(first, "item") else first


class Walker:
    def __init__(self, names, leaf_shapes, deg_stat: int = 40, relayout: bool = True):
        self.relayout = relayout  # whether the input's order may still be read anew
        self.nodes: list[Node] = []
        self.roles: dict = {}
        self.names = names
        self._made: dict = {}  # id(symbol) -> (symbol, node): one node per symbol
        self.leaf_shapes = list(leaf_shapes)
        self.parents: dict = {}  # a slice leaf -> (its stacked leaf, index): per-layer weights
        self._slices: dict = {}  # (leaf, index) -> slice leaf
        x_nodes, w_nodes = np.polynomial.hermite.hermgauss(deg_stat)
        self._gh = (x_nodes, w_nodes / math.sqrt(math.pi))  # E_{u~N(0,q)} f = Σ w f(√(2q) x)

    # -- nodes --

    def add(self, kind, inputs, shape, gaussian, top, info, eqn=None, looked=()) -> int:
        node = Node(
            len(self.nodes),
            kind,
            tuple(inputs),
            tuple(shape),
            gaussian,
            top,
            types.SimpleNamespace(**info),
            _source(eqn) if eqn is not None else "",
            tuple(looked),
        )
        self.nodes.append(node)
        return node.id

    def on(self, kind, node, shape, eqn, gaussian=None, axes=None, **info) -> Act:
        """A layer of one input ``node`` (its Gaussianity unless given, its weights), its
        value an array of ``shape`` whose axes hold ``axes`` of the new node."""
        base = self.nodes[node]
        gaussian = base.gaussian if gaussian is None else gaussian
        canon = _canon(shape, axes) if axes is not None else shape
        return Act(self.add(kind, (node,), canon, gaussian, base.top, info, eqn), shape, axes)

    def act(self, sym, eqn) -> Act:
        """``sym`` as a node, in its own array layout."""
        node = self.node(sym, eqn)
        inner = sym.inner if isinstance(sym, Gained) else sym
        return Act(node, inner.shape, getattr(inner, "axes", None))

    def _from_input(self, sym) -> bool:
        """Whether ``sym``'s values are the input's, position by position and channel by
        channel (through elementwise layers and window sums only): its order still free."""
        if not self.relayout or isinstance(sym, (Affine, Flipped, Gained, Stat)):
            return False
        node = self.nodes[sym.base if isinstance(sym, Chain) else sym.node]
        same = (Kind.Nonlinearity, Kind.Scale, Kind.Normalise, Kind.Bias, Kind.Gain, Kind.SumPool)
        while node.kind in same:
            node = self.nodes[node.inputs[0]]
        return node.kind is Kind.Input

    def _reorder(self, sym, batch, channel, spatial):
        """The input read anew (:class:`_Relayout`) where ``sym`` (from the input, its
        order still free) has its samples at array axis ``batch``, its channels at
        ``channel`` and its positions at ``spatial`` (in order); None where it cannot be."""
        axes = _axes(sym)
        picked = [axes[i] for i in (batch, *spatial, channel)]
        if not self._from_input(sym) or None in picked or picked[0] != 0:
            return None
        new = [0] * len(picked)  # the first walk's input axes are its array's: label = axis
        for j, label in enumerate(picked):
            new[label] = j
        raise _Relayout(tuple(new))

    def channels(self, node_id) -> int:
        return self.nodes[node_id].shape[-1]

    def slice_leaf(self, leaf: int, index: int) -> int:
        """The leaf id of ``leaf[index]``: a layer's own weight in a stack of layers' (a
        scan's xs, ``ws[i]``), named ``"w[3]"``, its prior the stack's."""
        key = (leaf, index)
        if key not in self._slices:
            self._slices[key] = len(self.names)
            self.names.append(f"{self.names[leaf]}[{index}]")
            self.leaf_shapes.append(self.leaf_shapes[leaf][1:])
            self.parents[len(self.names) - 1] = key
        return self._slices[key]

    def _lineage(self, leaf) -> set:
        out = {leaf}
        while leaf in self.parents:
            leaf = self.parents[leaf][0]
            out.add(leaf)
        return out

    def use(self, leaf, role, fan_in, eqn):
        mine = self._lineage(leaf)  # a stack used whole and sliced: tied too
        tied = next((u for u in self.roles if u in mine or leaf in self._lineage(u)), None)
        if tied is not None:
            name = self.names[leaf]
            first = self.roles[tied][2]
            what = f"the parameter {name!r} is used twice (weight tying: its first use at {first})"
            raise refuse(eqn, f"{what}; the infinite-width limit assumes each weight is used once")
        self.roles[leaf] = (role, fan_in, _source(eqn) if eqn is not None else "")

    def gaussian(self, eqn, node_id, what):
        """Refuses ``what`` of a value that is no Gaussian process at infinite width (a
        nonlinearity's output, or a sum with one): its kernel needs the whole law."""
        base = self.nodes[node_id]
        if not base.gaussian:
            origin = base  # back through per-channel biases, gains and scalings
            while origin.kind in (Kind.Bias, Kind.Gain, Kind.Scale) and origin.inputs:
                before = self.nodes[origin.inputs[0]]
                if before.gaussian:
                    break
                origin = before
            what = (
                f"{what} of a non-Gaussian input (the output of {base.kind.name} at {base.source}"
                + (f", after {origin.kind.name} at {origin.source}" if origin is not base else "")
                + ")"
            )
            fix = (
                "insert a Dense or Conv layer between them (a constant shift counts as a "
                "nonlinearity here: BatchNorm in eval mode is derived with zero running means, "
                "its initial statistics), or " + MONTE_CARLO
            )
            raise refuse(eqn, f"{what} has no infinite-width rule", fix)

    # -- materialisation: any x-dependent symbol as a node --

    def node(self, sym, eqn) -> int:
        if isinstance(sym, Act):
            return sym.node
        if isinstance(sym, Gained) and not isinstance(sym.inner, Stat):
            inner = self.act(sym.inner, eqn)
            return self.gain(eqn, inner, sym.param, inner.shape).node
        if id(sym) in self._made:
            return self._made[id(sym)][1]
        if isinstance(sym, (Affine, Chain)):
            finish = self._finish_affine if isinstance(sym, Affine) else self._finish_chain
            made = finish(sym, eqn)
            self._made[id(sym)] = (sym, made)
            return made
        raise unmapped(eqn, "a channel statistic used on its own (not to normalise)")

    def _finish_affine(self, a: Affine, eqn) -> int:
        shape = _canon(a.shape, _axes(a))
        info = dict(
            leaf=a.leaf,
            fan_in=a.fan_in,
            scale=a.scale,
            conv=a.conv,
            width=shape[-1],
            width_in=self.channels(a.node_in),
            biases=a.biases,
        )
        node = self.add(
            a.kind, (a.node_in,), shape, True, frozenset({("w", a.leaf)}), info, None, a.views
        )
        return self._with_source(node, a.source)

    def _with_source(self, node_id, source):
        self.nodes[node_id].source = source
        return node_id

    def _finish_chain(self, c: Chain, eqn) -> int:
        from ntk_core._derived import phi

        if c.uses_q:
            scale = phi.normaliser(c.f)
            if scale is None and c.pre is not None and phi.normaliser(c.pre.f) is not None:
                normalised = self.node(c.pre, eqn)  # the normalisation, then φ of it
                post = lambda u, q, post=c.post: post(u)  # noqa: E731
                after = Chain(normalised, c.shape, post, c.prims, False, c.source, axes=c.axes)
                return self._finish_chain(after, eqn)
            if scale is None:
                raise unmapped(eqn, "a function of normalised activations other than u·s(q)")
            self.gaussian(eqn, c.base, "a normalisation")
            made = self.on(
                Kind.Normalise, c.base, c.shape, None, axes=c.axes, scale=scale, prims=c.prims
            )
            return self._with_source(made.node, c.source)
        form = phi.identify(c.f, c.prims)
        if form.linear is not None:
            scaled = self.on(Kind.Scale, c.base, c.shape, None, axes=c.axes, factor=form.linear)
            return self._with_source(scaled.node, c.source)
        self.gaussian(eqn, c.base, f"a nonlinearity ({form.name})")
        made = self.on(
            Kind.Nonlinearity, c.base, c.shape, None, False, c.axes, form=form, prims=c.prims
        )
        return self._with_source(made.node, c.source)

    # -- the walk --

    def run(self, jaxpr, consts, syms):
        env = {}

        def read(v):
            if isinstance(v, jex.Literal):
                return Const(np.asarray(v.val))
            return env[v]

        for var, c in zip(jaxpr.constvars, consts, strict=True):
            env[var] = Const(np.asarray(c))
        for var, s in zip(jaxpr.invars, syms, strict=True):
            env[var] = s
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            for s in ins:
                if isinstance(s, Refused):
                    raise s.error
            _CURRENT[0] = (eqn, ins)
            outs = self.equation(eqn, ins)
            for var, s in zip(eqn.outvars, outs, strict=True):
                env[var] = s
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn, ins):
        name = eqn.primitive.name
        shapes = [tuple(v.aval.shape) for v in eqn.outvars]
        if name in CALLS and jaxpr_walk.call_body(eqn) is not None:
            body, consts = jaxpr_walk.call_body(eqn)
            n = len(body.invars)
            _OUTER.append(_source(eqn))
            try:
                return self.run(body, consts, ins[len(ins) - n :])
            finally:
                _OUTER.pop()
        if all(isinstance(s, Const) for s in ins):
            out = jaxpr_walk.bind(eqn, [s.value for s in ins])
            out = out if eqn.primitive.multiple_results else [out]
            return [Const(np.asarray(o)) for o in out]
        loop = LOOPS.get(name)
        if loop is not None:  # unrolled: each step's slice of a stacked leaf its own weight
            _OUTER.append(_source(eqn))
            try:
                return loop(self, eqn, ins)
            finally:
                _OUTER.pop()
        if not any(_x_dependent(s) for s in ins):
            return [self.param_op(eqn, ins, shapes)]
        if eqn.primitive.multiple_results:  # a split, a custom primitive, ...
            raise unmapped(eqn)
        return [self.x_op(eqn, ins, shapes[0])]

    # -- parameters --

    def param_op(self, eqn, ins, shapes):
        name = eqn.primitive.name
        shape = shapes[0]
        params = [s for s in ins if isinstance(s, Param)]
        leaves = frozenset().union(
            *[
                {s.leaf} if isinstance(s, Param) else s.leaves
                for s in ins
                if not isinstance(s, Const)
            ]
        )
        if len(params) == 1 and len([s for s in ins if not isinstance(s, Const)]) == 1:
            p = params[0]
            if name in LAYOUT:
                return Param(p.leaf, shape, p.scale, p.views + (name,))
            index = self._stack_index(eqn, p, ins)
            if index is not None:  # ws[i]: the i-th layer's own weight
                return Param(self.slice_leaf(p.leaf, index), shape, p.scale, (name,))
            if eqn.primitive is prims.neg_p:
                return Param(p.leaf, shape, -p.scale, p.views)
            if eqn.primitive in SCALINGS and len(ins) == 2:
                c = _scalar(ins[1] if ins[0] is p else ins[0], eqn)
                if eqn.primitive is prims.div_p and ins[0] is not p:
                    return Opaque(leaves, shape)
                return Param(p.leaf, shape, p.scale * _times(eqn, c), p.views)
        via = next((s.via for s in ins if isinstance(s, Opaque) and s.via), name)
        return Opaque(leaves, shape, via)

    def _whole(self, p: Param) -> bool:
        """Whether ``p`` is its leaf as stored (possibly cast or scaled): sliceable."""
        return p.shape == self.leaf_shapes[p.leaf] and set(p.views) <= NO_OPS

    def _stack_index(self, eqn, p: Param, ins):
        """i where ``eqn`` takes entry i of ``p``'s leading axis (``slice`` or a
        ``dynamic_slice`` at constant indices, every other axis whole), else None."""
        shape, out = p.shape, tuple(eqn.outvars[0].aval.shape)
        if not self._whole(p) or not shape or out != (1, *shape[1:]):
            return None
        if eqn.primitive is prims.slice_p:
            strides = eqn.params["strides"]
            starts = tuple(eqn.params["start_indices"])
            ok = (strides is None or all(t == 1 for t in strides)) and not any(starts[1:])
            return int(starts[0]) if ok else None
        if eqn.primitive is prims.dynamic_slice_p and ins[0] is p:
            starts = ins[1:]
            if not all(isinstance(c, Const) for c in starts):
                return None
            first, *rest = (int(np.asarray(c.value)) for c in starts)
            # jax clamps a start to the array: the entry it reads
            return min(max(first, 0), shape[0] - 1) if not any(rest) else None
        return None

    def _step_input(self, eqn, s, i, what):
        """Step ``i``'s symbol of a scan's stacked input ``s`` (entry i of axis 0)."""
        if isinstance(s, Const):
            return Const(np.asarray(s.value)[i])
        if isinstance(s, Param) and self._whole(s):
            return Param(self.slice_leaf(s.leaf, i), s.shape[1:], s.scale, ())
        if isinstance(s, (Param, Opaque)):
            leaves = frozenset({s.leaf}) if isinstance(s, Param) else s.leaves
            return Opaque(leaves, s.shape[1:], s.via if isinstance(s, Opaque) else "")
        raise unmapped(eqn, f"a loop over {what} (each step a slice of the activations)")

    def scan(self, eqn, ins):
        """``lax.scan`` with its static length, unrolled: the body walked once per step,
        a stacked parameter's slice i step i's own leaf; the stacked outputs (ys) kept
        where they are constants or parameters, refused where used if activations."""
        p = eqn.params
        body, consts = p["jaxpr"].jaxpr, list(p["jaxpr"].consts)
        nc, ncarry, length = p["num_consts"], p["num_carry"], int(p["length"])
        fixed, carry, xs = ins[:nc], list(ins[nc : nc + ncarry]), ins[nc + ncarry :]
        steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
        per_step = []
        for i in steps:
            step_xs = [self._step_input(eqn, s, i, "stacked inputs") for s in xs]
            outs = self.run(body, consts, [*fixed, *carry, *step_xs])
            carry, ys = list(outs[:ncarry]), outs[ncarry:]
            per_step.append((i, ys))
        per_step.sort(key=lambda t: t[0])
        stacked = []
        for j, var in enumerate(eqn.outvars[ncarry:]):
            col = [ys[j] for _, ys in per_step]
            stacked.append(self._stacked(eqn, col, tuple(var.aval.shape)))
        return carry + stacked

    def _stacked(self, eqn, col, shape):
        if all(isinstance(s, Const) for s in col):
            return Const(np.stack([np.asarray(s.value) for s in col]))
        if not any(_x_dependent(s) for s in col):
            leaves = frozenset().union(
                *[
                    {s.leaf} if isinstance(s, Param) else s.leaves
                    for s in col
                    if not isinstance(s, Const)
                ]
            )
            return Opaque(leaves, shape)
        return Refused(unmapped(eqn, "a loop's stacked per-step activations (its ys)"))

    def while_loop(self, eqn, ins):
        """``lax.while_loop`` (``fori_loop`` with traced bounds) whose condition depends on
        constants only: its trip count is static, the body is walked that many times."""
        p = eqn.params
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, carry = ins[:cn], ins[cn : cn + bn], list(ins[cn + bn :])
        needed = _needed(cond.jaxpr)
        for step in range(MAX_STEPS + 1):
            args = [*cond_consts, *carry]
            if not all(isinstance(args[j], Const) for j in needed):
                what = "a while loop whose trip count depends on the parameters or x"
                raise unmapped(eqn, f"{what} (it cannot be unrolled)")
            values = [
                np.asarray(a.value)
                if isinstance(a, Const)
                else np.zeros(v.aval.shape, v.aval.dtype)
                for a, v in zip(args, cond.jaxpr.invars, strict=True)
            ]
            if not bool(jex.jaxpr_as_fun(cond)(*values)[0]):
                return carry
            if step == MAX_STEPS:
                raise unmapped(eqn, f"a while loop of more than {MAX_STEPS} steps")
            carry = self.run(body.jaxpr, list(body.consts), [*body_consts, *carry])
        raise AssertionError("unreachable")

    def cond(self, eqn, ins):
        """``lax.cond`` / ``switch`` on a constant index: the branch it takes."""
        index, *operands = ins
        if not isinstance(index, Const):
            raise unmapped(eqn, "a cond whose branch depends on the parameters or x")
        branches = eqn.params["branches"]
        k = min(max(int(np.asarray(index.value)), 0), len(branches) - 1)
        return self.run(branches[k].jaxpr, list(branches[k].consts), operands)

    # -- activations: each rule returns the result's symbol, or None where it does not fit --

    def x_op(self, eqn, ins, shape):
        name = eqn.primitive.name
        if any(isinstance(s, Flipped) for s in ins):
            back = eqn.primitive is prims.transpose_p and tuple(eqn.params["permutation"]) == (1, 0)
            out = ins[0].affine if back else None  # W @ xᵀ transposed back to (N, C_out)
        elif any(isinstance(s, Gained) for s in ins):
            out = self.gained(eqn, ins, shape)
        elif name in ELEMENTWISE:
            out = self.elementwise(eqn, ins, shape)
        else:
            rule = X_RULES.get(eqn.primitive)
            out = rule(self, eqn, ins, shape) if rule is not None else None
        if out is None:
            raise unmapped(eqn)
        return out

    def gained(self, eqn, ins, shape):
        """An operation on a value times a gain: products carry the gain outwards (γ·s)·u
        = γ·(s·u); anything else applies it first (a Gain layer)."""
        name = eqn.primitive.name
        gd = next(s for s in ins if isinstance(s, Gained))
        if name in LAYOUT and isinstance(gd.inner, Stat):
            return gd
        others = [s for s in ins if s is not gd]
        mul = eqn.primitive is prims.mul_p
        if mul and len(ins) == 2 and not isinstance(others[0], (Param, Opaque, Gained)):
            inner = self.x_op(eqn, [gd.inner if s is gd else s for s in ins], shape)
            return Gained(inner, gd.param)
        if isinstance(gd.inner, Stat):
            return None  # a statistic times a gain used other than to scale activations
        done = [
            self.gain(eqn, s.inner, s.param, s.inner.shape) if isinstance(s, Gained) else s
            for s in ins
        ]
        return self.x_op(eqn, done, shape)

    def _weight(self, eqn, p, role_what):
        if isinstance(p, Param):
            return p
        if isinstance(p, Opaque) and p.via == "stop_gradient":
            names = ", ".join(repr(self.names[i]) for i in sorted(p.leaves))
            what = f"the {role_what} is stop_gradient of {names}: a weight held fixed"
            fix = (
                "drop stop_gradient (the derived NTK differentiates every weight; "
                "for the NNGP alone it does not matter), or " + MONTE_CARLO
            )
            raise refuse(eqn, f"{what}, whose NTK term this derivation does not drop", fix)
        if isinstance(p, Opaque):
            got = f"computed from the parameters {sorted(self.names[i] for i in p.leaves)}"
            fix = "make it one parameter leaf (possibly reshaped, transposed or scaled)"
            raise refuse(eqn, f"the {role_what} is {got}, not one leaf", f"{fix}, or {MONTE_CARLO}")
        raise unmapped(eqn, f"a {role_what} that is not a parameter")

    def affine(self, eqn, kind, x, w: Param, shape, fan_in, conv=None, axes=None) -> Affine:
        """The activations ``x`` times the weight leaf ``w``: a Dense or Conv layer not yet
        finished (a constant scaling and biases may still join it); its output an array of
        ``shape`` whose axes hold ``axes`` of the layer's node."""
        node_in = self.node(x, eqn)
        self.use(w.leaf, "weight", fan_in, eqn)
        return Affine(
            node_in, shape, kind, w.leaf, fan_in, w.scale, conv, (), _source(eqn), w.views, axes
        )

    def dot(self, eqn, ins, shape):
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        x, w = ins
        # W (C_out, C_in) @ x (N, C_in)ᵀ: vmap's form of a per-sample W @ x
        flipped = (
            _x_dependent(w)
            and isinstance(x, (Param, Opaque))
            and len(shape) == 2
            and (not lb and not rb and tuple(lc) == (1,) and tuple(rc) == (1,))
            and len(eqn.invars[1].aval.shape) == 2
        )
        if flipped:
            x, w = w, x
        elif not _x_dependent(x) or _x_dependent(w):
            return None  # x @ W, as nn.Dense, with the activations on the left
        if isinstance(x, Stat):
            return None
        w = self._weight(eqn, w, "matrix product's weight")
        axes = _axes(x)
        if flipped:
            if axes != (0, 1):
                return None  # (N, C_in) as its node holds it
            return Flipped(self.affine(eqn, Kind.Dense, x, w, (shape[1], shape[0]), w.shape[1]))
        if lb or rb or len(lc) != 1 or tuple(rc) != (0,) or len(w.shape) != 2:
            return None  # only x (N, ..., C_in) @ W (C_in, C_out)
        (c,) = lc
        if axes[c] is None or axes[c] != sum(a is not None for a in axes) - 1:
            others = [i for i, a in enumerate(axes) if a not in (None, 0) and i != c]
            return self._reorder(x, axes.index(0) if 0 in axes else 0, c, others)
        out_axes = (*(a for i, a in enumerate(axes) if i != c), axes[c])
        return self.affine(eqn, Kind.Dense, x, w, shape, w.shape[0], axes=out_axes)

    def conv(self, eqn, ins, shape):
        """A convolution of any dimension numbers (NHWC, equinox's NCHW, ...): the specs
        say which array axes hold the samples, channels and positions, ``x``'s axes which
        of its node's they are; the filter's layout does not matter (i.i.d. entries)."""
        x, w = ins
        if not _x_dependent(x) or _x_dependent(w) or isinstance(x, Stat):
            return None
        w = self._weight(eqn, w, "convolution's filter")
        p = eqn.params
        n = len(shape)
        dn = p["dimension_numbers"]
        lhs, rhs, out = tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)
        dilated = any(d != 1 for d in (*p["lhs_dilation"], *p["rhs_dilation"]))
        grouped = p["feature_group_count"] != 1 or p["batch_group_count"] != 1
        if dilated or grouped:
            return None  # neither dilated nor grouped
        axes = _axes(x)
        labels = [axes[i] for i in lhs]  # the node's axes of N, C, positions in spec order
        spatial = labels[2:]
        if None in labels or labels[:2] != [0, n - 1] or sorted(spatial) != [*range(1, n - 1)]:
            return self._reorder(x, lhs[0], lhs[1], lhs[2:])  # None where it cannot be
        order = [a - 1 for a in spatial]  # spec position k holds the node's position order[k]
        in_shape = tuple(eqn.invars[0].aval.shape)
        k_of = {c: k for k, c in enumerate(order)}  # the node's position c at spec position k
        window = tuple(w.shape[rhs[2 + k_of[c]]] for c in range(n - 2))
        strides = tuple(p["window_strides"][k_of[c]] for c in range(n - 2))
        sizes = tuple(in_shape[lhs[2 + k_of[c]]] for c in range(n - 2))
        pads = tuple(p["padding"][k_of[c]] for c in range(n - 2))
        padding = _padding(eqn, sizes, window, strides, pads)
        conv = dict(filter_shape=window, strides=strides, padding=padding)
        out_axes = [0] * n
        out_axes[out[0]], out_axes[out[1]] = 0, n - 1
        for k, c in enumerate(order):
            out_axes[out[2 + k]] = c + 1
        fan_in = w.shape[rhs[1]] * math.prod(window)
        return self.affine(eqn, Kind.Conv, x, w, shape, fan_in, conv, tuple(out_axes))

    def reduce_sum(self, eqn, ins, shape):
        axes = tuple(sorted(eqn.params["axes"]))
        ndim = len(eqn.invars[0].aval.shape)
        if 0 in axes:  # the samples' axis: samples mixed, as batch statistics do
            what = (
                f"a sum over the samples' axis (axes {axes} of "
                f"{shape_text(eqn.invars[0].aval.shape, True)}): "
                "batch statistics (BatchNorm in training mode) make each sample's output "
                "depend on the others"
            )
            fix = (
                "use BatchNorm in eval mode (Flax: use_running_average=True, e.g. "
                "apply_kwargs={'train': False}; Haiku: is_training=False), or " + MONTE_CARLO
            )
            raise refuse(eqn, what, fix)
        x = ins[0]
        if isinstance(x, Stat):
            return self.channel_mean(eqn, x, shape) if axes == (ndim - 1,) else None
        labels = _axes(x)
        r = sum(a is not None for a in labels)
        summed = {labels[i] for i in axes} - {None}  # a unit axis summed: itself
        if summed == {r - 1}:
            return self.channel_mean(eqn, x, shape)
        if summed != set(range(1, r - 1)):
            return None  # some positions' axes, or positions and channels together
        kept = [a for i, a in enumerate(labels) if i not in axes]
        out = tuple(None if a is None else (0 if a == 0 else 1) for a in kept)
        return self.on(Kind.GlobalSumPool, self.node(x, eqn), shape, eqn, axes=out)

    def channel_mean(self, eqn, x, shape):
        """A sum over the channels: C·E[f(u, q)] at infinite width (a Stat)."""
        if isinstance(x, Stat):
            return None  # a channel sum of a channel statistic
        chain = self.as_chain(x, eqn)
        self.gaussian(eqn, chain.base, "a statistic over the channels")
        xs, ws = self._gh
        f = chain.f

        def g(q):
            r = jnp.sqrt(2 * jnp.maximum(q, 0))
            return sum(float(w) * f(r * float(xi), q) for xi, w in zip(xs, ws, strict=True))

        return Stat(chain.base, _memo(g), float(self.channels(chain.base)))

    def sum_pool(self, eqn, ins, shape):
        p = eqn.params
        dims, strides = tuple(p["window_dimensions"]), tuple(p["window_strides"])
        pads = tuple(tuple(q) for q in p["padding"])
        dilated = any(d != 1 for d in (*p["base_dilation"], *p["window_dilation"]))
        x = ins[0]
        if isinstance(x, Stat) or dilated:
            return None
        labels = _axes(x)
        r = sum(a is not None for a in labels)
        at = {a: i for i, a in enumerate(labels) if a is not None}  # node axis -> array axis
        ends = [i for i, a in enumerate(labels) if a in (None, 0, r - 1)]
        if any((dims[i], strides[i], *pads[i]) != (1, 1, 0, 0) for i in ends):
            return None  # a window over the samples, the channels or a unit axis
        in_shape = tuple(eqn.invars[0].aval.shape)
        pos = [at[c] for c in range(1, r - 1)]  # the array axes of the positions, in order
        window, steps = tuple(dims[i] for i in pos), tuple(strides[i] for i in pos)
        padding = _padding(eqn, [in_shape[i] for i in pos], window, steps, [pads[i] for i in pos])
        info = dict(window_shape=window, strides=steps, padding=padding)
        return self.on(Kind.SumPool, self.node(x, eqn), shape, eqn, axes=x.axes, **info)

    def concat(self, eqn, ins, shape):
        if not all(_x_dependent(s) and not isinstance(s, Stat) for s in ins):
            return None
        axes = {_axes(getattr(s, "inner", s)) for s in ins}
        if len(axes) != 1:
            return None  # branches laid out differently
        (axes,) = axes
        if eqn.params["dimension"] != _channel(axes):
            return None  # only activations, along the channels
        nodes = [self.node(s, eqn) for s in ins]
        self._independent(eqn, nodes, "concatenation")
        top = frozenset().union(*[self.nodes[n].top for n in nodes])
        made = self.add(Kind.FanInConcat, nodes, _canon(shape, axes), False, top, {}, eqn)
        return Act(made, shape, axes)

    def layout(self, eqn, ins, shape):
        """A transpose, or axes of size 1 inserted or dropped: the same values, each array
        axis still holding one axis of the node (``axes``); else Flatten (N, ..., C) ->
        (N, S·C), whose kernel does not depend on the order of the merged axes."""
        (x,) = ins
        in_shape = tuple(eqn.invars[0].aval.shape)
        if isinstance(x, Stat):
            return x  # a per-sample, per-position number: its layout does not matter
        axes, prim = _axes(x), eqn.primitive
        if prim is prims.transpose_p:
            new = tuple(axes[i] for i in eqn.params["permutation"])
        elif prim is prims.broadcast_in_dim_p:
            dims = tuple(eqn.params["broadcast_dimensions"])
            new = [None] * len(shape)
            for i, d in enumerate(dims):
                new[d] = axes[i]
            grown = any(shape[d] != in_shape[i] for i, d in enumerate(dims))
            if grown or any(shape[j] != 1 for j in set(range(len(shape))) - set(dims)):
                return None  # copies of the activations along an axis
            new = tuple(new)
        elif prim is prims.squeeze_p:
            gone = {d % len(in_shape) for d in eqn.params["dimensions"]}
            if any(axes[d] is not None for d in gone):
                new = None  # a position or channel axis of size 1 dropped
            else:
                new = tuple(a for i, a in enumerate(axes) if i not in gone)
        else:
            new = _units(in_shape, shape, axes)
        if new is not None:
            if isinstance(x, (Act, Affine, Chain)):
                return dataclasses.replace(x, shape=shape, axes=new)
            return None
        flatten = len(shape) == 2 and len(in_shape) > 2 and shape[0] == in_shape[0]
        if prim is prims.reshape_p and flatten and axes[0] == 0:
            return self.on(Kind.Flatten, self.node(x, eqn), shape, eqn, gaussian=False)
        return None  # a reshape other than Flatten (N, *S, C) -> (N, S·C)

    def as_chain(self, s, eqn) -> Chain:
        if isinstance(s, Chain):
            return s
        a = self.act(s, eqn)
        return Chain(a.node, a.shape, lambda u, q: u, (), False, _source(eqn), axes=a.axes)

    def _independent(self, eqn, nodes, what):
        seen = set()
        for n in nodes:
            top = self.nodes[n].top
            shared = seen & top
            if shared:
                names = sorted(
                    "the input x" if t == "x" else repr(self.names[t[1]]) for t in shared
                )
                what = f"a {what} of branches that share {', '.join(names)}"
                raise refuse(eqn, f"{what}: they are not independent Gaussians")
            seen |= top

    def elementwise(self, eqn, ins, shape):
        prim, sub = eqn.primitive, eqn.primitive is prims.sub_p
        xs = [s for s in ins if _x_dependent(s)]
        if prim in SUMS and len(ins) == 2:
            x, other = (ins[0], ins[1]) if _x_dependent(ins[0]) else (ins[1], ins[0])
            if isinstance(other, (Param, Opaque)):
                signs = (-1.0 if sub and x is ins[1] else 1.0, -1.0 if sub and x is ins[0] else 1.0)
                return self.bias(eqn, x, other, *signs, shape)
        params = any(isinstance(s, (Param, Opaque)) for s in ins)
        if prim is prims.mul_p and len(ins) == 2 and params:
            x = ins[0] if _x_dependent(ins[0]) else ins[1]
            g = ins[1] if x is ins[0] else ins[0]
            if isinstance(x, Stat):
                return Gained(x, self._weight(eqn, g, "gain"))
            return self.gain(eqn, x, g, shape)
        if params:
            return None  # a parameter other than a bias (add) or a gain (mul)
        if isinstance(xs[0], Stat) and all(isinstance(s, (Stat, Const)) for s in ins):
            return self.stat_op(eqn, ins)
        # several activations: one pre-activation's chain, or a sum of independent branches
        bases = {s.base if isinstance(s, (Stat, Chain)) else self.node(s, eqn) for s in xs}
        if len(bases) > 1 and prim in SUMS and len(xs) == 2:
            if any(isinstance(s, Stat) for s in xs):
                return None
            acts = [self.act(s, eqn) for s in xs]  # −b: the same covariance as b
            nodes = [a.node for a in acts]
            self._independent(eqn, nodes, "sum")
            gaussian = all(self.nodes[n].gaussian for n in nodes)
            if len({self.nodes[n].shape for n in nodes}) > 1 or acts[0].axes != acts[1].axes:
                return None  # branches of different shapes, or laid out differently
            if acts[0].shape != shape:
                return None  # a branch broadcast along an axis
            top = frozenset().union(*[self.nodes[n].top for n in nodes])
            canon = _canon(shape, _axes(acts[0]))
            made = self.add(Kind.FanInSum, nodes, canon, gaussian, top, {}, eqn)
            return Act(made, shape, acts[0].axes)
        return self.chain_op(eqn, ins, shape)

    def stat_op(self, eqn, ins):
        stats = [s for s in ins if isinstance(s, Stat)]
        if len({s.base for s in stats}) > 1:
            return None  # statistics of two different layers combined
        if eqn.primitive in SCALINGS and len(stats) == 1 and len(ins) == 2:
            s = stats[0]
            other = ins[1] if ins[0] is s else ins[0]
            if not (eqn.primitive is prims.div_p and ins[0] is not s):
                c = _scalar(other, eqn)
                return dataclasses.replace(s, factor=s.factor * _times(eqn, c))
        gs = [self._stat_value(s, eqn) if isinstance(s, Stat) else s for s in ins]

        consts = [None if callable(v) else _scalar(v, eqn) for v in gs]

        def g(q, gs=gs):
            vals = [v(q) if callable(v) else c for v, c in zip(gs, consts, strict=True)]
            return _bind(eqn, vals)

        return Stat(stats[0].base, _memo(g), 1.0)

    def _stat_value(self, s: Stat, eqn):
        if abs(s.factor - 1.0) > 1e-9:
            raise unmapped(eqn, f"a channel sum not divided by the channels (factor {s.factor:g})")
        return s.g

    def chain_op(self, eqn, ins, shape):
        if eqn.primitive in CASTS:
            dtype = eqn.params.get("new_dtype")
            if isinstance(ins[0], Chain) and (dtype is None or jnp.issubdtype(dtype, jnp.floating)):
                return ins[0]  # a cast: the chain runs in the kernel's dtype
        parts, base, used, uses_q = [], None, {eqn.primitive.name}, False  # parts: (u, q) -> ·
        acts = [s for s in ins if _x_dependent(s) and not isinstance(s, Stat)]
        if len({_axes(s) for s in acts}) > 1:
            return None  # one node's values in two orders (u + uᵀ): positions mixed
        if any(s.shape != shape for s in acts):
            return None  # the activations broadcast along an axis
        axes = _axes(acts[0]) if acts else None
        for s in ins:
            if isinstance(s, Const):
                value = _scalar(s, eqn) if np.asarray(s.value).ndim else s.value
                parts.append(lambda u, q, value=value: value)
                continue
            if isinstance(s, Stat):
                g = self._stat_value(s, eqn)
                parts.append(lambda u, q, g=g: g(q))
                uses_q, b = True, s.base
            else:
                c = self.as_chain(s, eqn)
                parts.append(c.f)
                used |= set(c.prims)
                uses_q, b = uses_q or c.uses_q, c.base
            if base is not None and b != base:
                return None  # a product (or other combination) of two layers' activations
            base = b
        source = next((s.source for s in ins if isinstance(s, Chain)), _source(eqn))
        pre = post = None
        chains = [s for s in ins if not isinstance(s, Const)]
        if uses_q and len(chains) == 1 and isinstance(chains[0], Chain):
            # one normalised value through constants-only operations: remember where the
            # normalisation ended, in case this becomes a nonlinearity of its own
            inner = chains[0]
            pre = inner if inner.pre is None else inner.pre
            before = (lambda v: v) if inner.pre is None else inner.post

            pairs = tuple(zip(ins, parts, strict=True))

            def post(v, pairs=pairs, before=before):
                return _bind(eqn, [before(v) if s is inner else part(v, v) for s, part in pairs])

        def f(u, q, parts=tuple(parts)):
            return _bind(eqn, [part(u, q) for part in parts])

        return Chain(base, shape, f, tuple(sorted(used)), uses_q, source, pre, post, axes)

    def per_channel(self, eqn, p, role, x) -> Param:
        """``p`` as one parameter leaf of one entry per channel (a bias, a gain), along the
        channel axis of the activations ``x``, used once."""
        p = self._weight(eqn, p, role)
        leaf_shape = self.leaf_shapes[p.leaf]
        axes = _axes(x)
        c = _channel(axes)
        width = x.shape[c]
        view = (1,) * (len(axes) - len(p.shape)) + tuple(p.shape)
        # entries along the channel axis (broadcast along others, as jnp.broadcast_to does)
        along = len(view) == len(axes) and view[c] == width
        along = along and all(n in (1, x.shape[i]) for i, n in enumerate(view))
        if math.prod(leaf_shape) != width or not along:
            what = f"the {role} {self.names[p.leaf]!r} of shape {leaf_shape} meets activations"
            fix = f"give the {role} one entry per channel ({width}), along the channel axis"
            raise refuse(eqn, f"{what} of {width} channels", f"{fix}, or {MONTE_CARLO}")
        self.use(p.leaf, role, 1, eqn)
        return p

    def bias(self, eqn, x, p, x_sign, p_sign, shape):
        if isinstance(x, Stat) or getattr(x, "shape", None) != shape:
            return None  # a bias of a statistic, or activations broadcast by the bias
        p = self.per_channel(eqn, p, "bias", x)
        if isinstance(x, Affine) and x_sign == 1.0:
            return dataclasses.replace(x, biases=x.biases + ((p.leaf, p.scale * p_sign),))
        node, axes = self.node(x, eqn), _axes(x)
        if x_sign != 1.0:
            node = self.on(Kind.Scale, node, shape, eqn, axes=axes, factor=x_sign).node
        return self.on(Kind.Bias, node, shape, eqn, axes=axes, biases=((p.leaf, p.scale * p_sign),))

    def gain(self, eqn, x, p, shape):
        if isinstance(x, Stat) or getattr(x, "shape", None) != shape:
            return None  # activations broadcast by the gain
        p = self.per_channel(eqn, p, "gain", x)
        node = self.node(x, eqn)
        return self.on(Kind.Gain, node, shape, eqn, axes=_axes(x), leaf=p.leaf, scale=p.scale)


#: The rules of the operations on activations other than elementwise ones, by primitive.
X_RULES = {
    prims.dot_general_p: Walker.dot,
    prims.conv_general_dilated_p: Walker.conv,
    prims.reduce_sum_p: Walker.reduce_sum,
    prims.reduce_window_sum_p: Walker.sum_pool,
    prims.concatenate_p: Walker.concat,
    prims.transpose_p: Walker.layout,
    prims.reshape_p: Walker.layout,
    prims.broadcast_in_dim_p: Walker.layout,
    prims.squeeze_p: Walker.layout,
}


#: Loops, unrolled (scan, while with a static trip count, cond on a constant index).
LOOPS = {"scan": Walker.scan, "while": Walker.while_loop, "cond": Walker.cond}
#: A while loop's most steps unrolled (a bound, not a limit of the maths).
MAX_STEPS = 10_000
#: Views of a parameter leaf that keep it as stored (a stacked leaf may be sliced).
NO_OPS = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})


def _needed(jaxpr) -> list[int]:
    """The invars (indices) the first output of ``jaxpr`` depends on."""
    live = {jaxpr.outvars[0]} if not isinstance(jaxpr.outvars[0], jex.Literal) else set()
    for e in reversed(jaxpr.eqns):
        if any(v in live for v in e.outvars):
            live |= {v for v in e.invars if not isinstance(v, jex.Literal)}
    return [j for j, v in enumerate(jaxpr.invars) if v in live]


def _memo(g):
    """``g`` computed once per q array: a variance's quadrature calls the mean's at each of
    its nodes with the same q (without this, nested statistics cost deg² passes)."""
    seen: dict = {}

    def once(q):
        hit = seen.get(id(q))
        if hit is not None and hit[0] is q:
            return hit[1]
        if len(seen) >= 8:
            seen.clear()
        value = g(q)
        seen[id(q)] = (q, value)
        return value

    return once


def _bind(eqn, vals):
    """The elementwise primitive of ``eqn`` on ``vals`` (functions' values and constants),
    constants cast to the values' float dtype and everything broadcast together: the chain
    runs at the kernel's (or the float64 check's) dtype and shapes, not the trace's."""
    floats = [
        v
        for v in vals
        if not isinstance(v, (int, float, bool, np.generic, np.ndarray))
        and jnp.issubdtype(jnp.result_type(v), jnp.floating)
    ]
    if not floats:  # numpy values (the float64 check): the widest float among them
        floats = [v for v in vals if isinstance(v, np.ndarray) and v.dtype.kind == "f"]
        floats.sort(key=lambda v: v.dtype.itemsize, reverse=True)
    dtype = jnp.result_type(floats[0]) if floats else None
    cast = []
    for v in vals:
        a = jnp.asarray(v)
        if dtype is not None and jnp.issubdtype(a.dtype, jnp.floating):
            a = a.astype(dtype)
        cast.append(a)
    return jaxpr_walk.bind(eqn, list(jnp.broadcast_arrays(*cast)))


def _units(in_shape, shape, axes):
    """``axes`` after a reshape from ``in_shape`` to ``shape`` that only inserts or drops
    axes of size 1 (the others kept in order; a dropped one must be an inserted one), else
    None."""
    new, i = [], 0
    for size in shape:
        while i < len(in_shape) and in_shape[i] == 1 and axes[i] is None and size != 1:
            i += 1  # an inserted unit axis dropped
        if i < len(in_shape) and in_shape[i] == size:
            new.append(axes[i])
            i += 1
        elif size == 1:
            new.append(None)  # a unit axis inserted
        else:
            return None
    rest = axes[i:]
    return tuple(new) if all(a is None for a in rest) else None


def _padding(eqn, sizes, window, strides, pads) -> str:
    from ntk_core._infinite import windows

    pads = tuple(tuple(int(v) for v in q) for q in pads)
    if all(q == (0, 0) for q in pads):
        return "VALID"
    same = tuple(
        windows.pads(s, w, t, "SAME") for s, w, t in zip(sizes, window, strides, strict=True)
    )
    if pads == same:
        return "SAME"
    raise unmapped(eqn, f"padding {pads} (neither VALID nor SAME)")


def derive(apply_fn, params, x_struct, names) -> Graph:
    """The graph of ``apply_fn(params, x)`` for inputs of ``x_struct``'s shape and dtype."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    leaf_shapes = [tuple(np.shape(v)) for v in leaves]
    try:
        closed = jax.make_jaxpr(apply_fn)(params, x_struct)
    except Exception as e:  # noqa: BLE001 - the user's model failed: say on what input
        raise traced_failure(caller(), x_struct.shape, e) from e
    x_shape = tuple(x_struct.shape)
    try:
        walker, outs = _walk(closed, names, leaf_shapes, x_shape, None)
    except _Relayout as again:  # the first layer reads x channels-first: x as it reads it
        walker, outs = _walk(closed, names, leaf_shapes, x_shape, again.axes)
    if len(outs) != 1 or not _x_dependent(outs[0]):
        got = f"{len(outs)} arrays" if len(outs) != 1 else "an output that does not depend on x"
        raise refuse(
            None, f"apply_fn returns {got}", "return one array (N, ..., O) computed from x"
        )
    producer = next(
        (e for e in reversed(closed.jaxpr.eqns) if closed.jaxpr.outvars[0] in e.outvars), None
    )
    out = walker.act(outs[0], producer)
    labels = [a for a in _axes(out) if a not in (None, 0, len(walker.nodes[out.node].shape) - 1)]
    if labels != sorted(labels):  # the kernel's positions are the node's, in order
        raise unmapped(producer, "an output whose positions are transposed")
    inp = walker.nodes[0].info
    perm = getattr(inp, "perm", None)
    return Graph(walker.nodes, out.node, walker.roles, walker.names, walker.parents, perm)


def _walk(closed, names, leaf_shapes, x_shape, input_axes):
    """One walk of ``closed`` with the input's array axes holding ``input_axes`` of its
    node (None: channels last, and a first layer reading it otherwise walks again)."""
    walker = Walker([n or "<params>" for n in names], leaf_shapes, relayout=input_axes is None)
    info, canon = {}, x_shape
    if input_axes is not None:
        canon = _canon(x_shape, input_axes)
        info["perm"] = tuple(input_axes.index(j) for j in range(len(input_axes)))
    inp = walker.add(Kind.Input, (), canon, True, frozenset({"x"}), info)
    syms = [Param(i, s) for i, s in enumerate(leaf_shapes)] + [Act(inp, x_shape, input_axes)]
    return walker, walker.run(closed.jaxpr, closed.consts, syms)
