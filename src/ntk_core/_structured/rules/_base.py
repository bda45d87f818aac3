"""What every structured rule shares: the :class:`Rule` interface, the :class:`Use`
record a rule makes of a weight use, the parameter views the analysis follows, and
the Gram identity of products and convolutions.

Notation (as in :mod:`ntk_core._structured.analysis`): a use ``y = op(x, view(W))`` has
output positions ``a`` (A of them), input coordinates ``c`` (C) and output units ``k``
(K); its per-sample Jacobian for output entry ``o`` is

    ∂f_o/∂W[c, k] = Σ_a x[a, c] g_o[a, k],      g_o[a, k] = ∂f_o/∂y[a, k].
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._impl import jacobian as _jacobian
from ntk_core._jax.batches import map_in_batches as map_in_batches
from ntk_core._jax.jaxpr_walk import bind


class View(NamedTuple):
    """A parameter leaf seen through reshapes, transposes, broadcasts, widening casts
    and constant scalings: what the analysis knows of a variable that is one."""

    leaf: int
    #: The steps, hashable: ``(primitive, sorted params)``, ``("scale_by", c)``.
    chain: tuple
    #: The equations that move entries (replayed on entry indices by :func:`view_index`).
    eqns: tuple


class Probe(NamedTuple):
    """Where the features' interpreter puts a use's zero probe δ and what it records."""

    record: int  # the operand recorded (the layer input; the tokens of a lookup)
    delta: Any
    #: None: δ is added to the equation's output; else to this (parameter) operand.
    operand: int | None = None


@dataclasses.dataclass(frozen=True)
class Use:
    """One structured use of a parameter leaf, made by ``rule``.

    ``kind`` names the operation within the rule's family (``"dot"``, ``"conv"``,
    ``"gather"``, ``"scale"``, ``"shift"``). ``y_perm`` orders the axes of the probed
    array ``y`` (the output; the parameter operand for an elementwise use) as
    (position axes..., unit axes...), so that ``y.transpose(y_perm).reshape(A, K)`` is
    the use's output matrix. ``info`` is the rule's own typed record of the equation
    (its axes, its geometry, its lookup mode).
    """

    rule: Rule
    kind: str
    path: tuple[int, ...]  # indices of the equation through inlined sub-jaxprs
    leaf: int
    x_side: int  # operand index of the recorded input (tokens for a gather)
    key: tuple  # uses of one leaf with equal keys pair up coordinate by coordinate
    y_shape: tuple[int, ...]
    y_dtype: str
    y_perm: tuple[int, ...]
    a_size: int  # A: output positions
    w_free_size: int  # K: output units
    x_contract_size: int  # C: input coordinates (V for a gather)
    info: Any = None
    # A constant scalar the leaf was multiplied by before this use (W / 8, -W, c * W:
    # NTK parametrisation): the use's Jacobian is this times the unscaled one's.
    factor: float = 1.0

    @property
    def x_info(self):
        """The rule's record of the equation (:attr:`info`)."""
        return self.info

    @property
    def name(self) -> str:
        """What ``plan()`` calls this kind of use, e.g. ``"matrix product"``."""
        return self.rule.kind_names[self.kind]


class Subscripts(NamedTuple):
    """Einsum letters of one output leaf's pairwise term (:meth:`Rule.gram_term`)."""

    left: str  # the left cotangents' leading axes: N1, then the output axes
    right: str  # the right cotangents': N2 (the same letter on the batch diagonal), ...
    out: str  # the kernel's
    a: str  # the left use's positions
    b: str  # the right use's positions
    c: str  # input coordinates
    k: str  # units


class Rule(abc.ABC):
    """One primitive family whose weight uses have a structured Jacobian.

    A rule is a stateless object (one per module, listed in
    :data:`ntk_core._structured.rules.REGISTRY`) answering, for the uses it makes:

    * analysis: :meth:`match` (is this equation a use of the one parameter view among
      its operands?) and :meth:`miss_reason` (why not, for ``plan()``);
    * features (per sample): :meth:`probe` (where the zero probe δ goes),
      :meth:`evaluate` (how the interpreter runs the primitive),
      :meth:`input_features` (the recorded input in the Gram form's layout),
      :meth:`jacobian_input` and :meth:`jacobian` (the explicit per-sample Jacobian
      ``(N, *O, C, K)``);
    * contract (per pair): :meth:`gram_term` (the Gram identity of two uses) and
      :meth:`gram_input_width` (its cost);
    * labels: :attr:`kind_names` and :meth:`label` (``plan()``).
    """

    #: Primitive names whose equations :meth:`match` is asked about.
    primitives: frozenset[str] = frozenset()
    #: ``plan()`` name of each kind of use the rule makes, e.g. {"dot": "matrix product"}.
    kind_names: Mapping[str, str] = {}
    #: Whether a bias added to the use's output may join it as a constant input column.
    takes_bias: bool = False
    #: Whether the use has a Gram form; if not, it always takes the explicit Jacobian.
    has_gram_form: bool = True
    #: Whether :attr:`Use.factor` scales the recorded input (else the cotangents).
    scales_input: bool = False

    def __repr__(self) -> str:
        return f"<structured rule {type(self).__name__}>"

    # -- analysis ----------------------------------------------------------------------
    @abc.abstractmethod
    def match(self, eqn, ins: list, here: tuple, leaf_shapes: list) -> Use | None:
        """The use that ``eqn`` makes of its one parameter operand, or None.

        ``ins``: per operand, its :class:`View` or None (not a parameter; exactly one
        is a view); ``here``: the equation's path through inlined sub-jaxprs;
        ``leaf_shapes``: the shape of every parameter leaf.
        """

    @abc.abstractmethod
    def miss_reason(self, eqn, ins: list) -> str:
        """Why :meth:`match` returned None, e.g. ``"a matrix product batched over the
        parameter's axes"`` (``plan()`` shows it for the leaf that falls back)."""

    def bias_target(self, eqn, use: Use):
        """The variable this use adds its parameter to when it may be a bias fused with
        the product that computed that variable (:attr:`takes_bias`), or None."""
        return None

    # -- features ----------------------------------------------------------------------
    def probe(self, use: Use, delta) -> Probe:
        """Where δ goes: by default added to the output, recording the input."""
        return Probe(use.x_side, delta)

    def evaluate(self, eqn, invals):
        """The equation's value in the features' interpreter (by default, binding it)."""
        return bind(eqn, invals)

    @abc.abstractmethod
    def input_features(self, use: Use, x, bias_column: bool):
        """The recorded inputs ``x`` (``(N, *x)``) of the Gram form: ``(N, A, C)``, or
        another layout that :meth:`x_spec` names; a fused bias adds a constant input
        coordinate when ``bias_column``."""

    def jacobian_input(self, use: Use, x, bias_column: bool):
        """What :meth:`jacobian` reads of the recorded inputs, formed once per batch."""
        return self.input_features(use, x, bias_column)

    @abc.abstractmethod
    def jacobian(self, use: Use, xj, g, biased: bool):
        """Explicit per-sample Jacobian ``(N, *O, C, K)`` (``(N, *O, K)`` if C = 1) from
        :meth:`jacobian_input`'s ``xj`` and the cotangents ``g`` ``(N, *O, A, K)``."""

    # -- contract ----------------------------------------------------------------------
    def x_spec(self, n: str, a: str, c: str) -> str:
        """Einsum subscripts of :meth:`input_features`' output."""
        return f"{n}{a}{c}"

    def gram_input_width(self, c: int) -> int:
        """FLOPs (halved) per entry of the input Gram matrix: C, the dot product."""
        return c

    # -- cost (read by _cost.estimate) -------------------------------------------------
    def input_values(self, c: int) -> int:
        """Values of the recorded input stored per position as a feature: C."""
        return c

    def input_flops(self, a: int, c: int) -> float:
        """Per-sample FLOPs of forming the recorded input (A positions, C each): none
        for an operand recorded as it is."""
        return 0.0

    def bias_in_gram(self, use: Use) -> bool:
        """Whether a fused bias adds 1 to the input Gram matrix instead of a column."""
        return False

    def gram_term(self, u: Use, v: Use, x1, x2, g1, g2, s: Subscripts, precision, plus_one):
        """Σ_ab (Σ_c x1[a, c] x2[b, c]) (Σ_k g1[.., a, k] g2[.., b, k]) of two uses of
        one leaf (equal keys: the same rule), in the kernel's layout ``s.out``.

        ``x1``/``x2``: :meth:`input_features` of each side; ``g1``/``g2``: cotangents
        ``(N, *O, A, K)``; ``plus_one``: a fused bias in the Gram form
        (:meth:`bias_in_gram`).
        """
        x1_spec = u.rule.x_spec(s.left[0], s.a, s.c)
        x2_spec = v.rule.x_spec(s.right[0], s.b, s.c)
        g_specs = f"{s.left}{s.a}{s.k},{s.right}{s.b}{s.k}"
        if u.a_size == 1 and v.a_size == 1:
            # A fused bias's use is its leaf's only one (u == v).
            return single_position_term(
                x1_spec, x2_spec, g_specs, s.out, x1, x2, g1, g2, precision, plus_one
            )
        return jnp.einsum(
            f"{x1_spec},{x2_spec},{g_specs}->{s.out}",
            x1,
            x2,
            g1,
            g2,
            precision=precision,
            optimize="optimal",
        )

    # -- plan() --------------------------------------------------------------------------
    def label(self, uses: list[Use]) -> str:
        """``plan()`` label of one leaf's uses: ``"1 matrix product"``, ``"2
        convolutions"``."""
        n, name = len(uses), uses[0].name
        return f"{n} {name}{'s' if n > 1 else ''}"


def single_position_term(x1_spec, x2_spec, g_specs, out, x1, x2, g1, g2, precision, plus_one=False):
    """The Gram form of two uses with one output position each (a Dense layer): the
    input Gram matrix ``(N1, N2)`` times the cotangent Gram matrix, as an elementwise
    product. (One einsum of all four operands lowers that product to a batched product
    of 1 x 1 matrices, about 2.5x slower on XLA CPU.) The sample letter leads each
    input's subscripts, ``g_specs`` are the two cotangents'."""
    samples = x1_spec[0] if x1_spec[0] == x2_spec[0] else x1_spec[0] + x2_spec[0]
    # The size-1 position axes sum away.
    xx = _jacobian.pair_einsum(x1_spec, x2_spec, samples, x1, x2, precision)
    if plus_one:  # a fused bias (see Rule.bias_in_gram)
        xx = xx + 1
    gg = _jacobian.pair_einsum(*g_specs.split(","), out, g1, g2, precision)
    # ``samples`` is in ``out``'s order (the N1 axis comes first): expand to its rank.
    return gg * xx.reshape(tuple(xx.shape[samples.index(s)] if s in samples else 1 for s in out))


# -- parameter views -----------------------------------------------------------------------
def scaled(chain) -> tuple[tuple, float]:
    """The view chain without its constant scalings (they do not move entries, so
    uses that differ only by them pair up) and the product of their factors."""
    factor = 1.0
    for step in chain:
        if step[0] == "scale_by":
            factor *= step[1]
    return tuple(step for step in chain if step[0] != "scale_by"), factor


def broadcasts(chain) -> bool:
    """Whether the view broadcasts the leaf (its entries repeat)."""
    return any(step[0] == "broadcast_in_dim" for step in chain)


def broadcast_reason(eqn, ins) -> str | None:
    """The miss reason of a product, convolution or lookup of a broadcast view."""
    chain = next(o.chain for o in ins if o is not None)
    if broadcasts(chain):
        return f"broadcast before its {eqn.primitive.name}, so its entries repeat"
    return None


def view_index(eqns, leaf_shape):
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
        return np.asarray(bind(eqn, [idx]))
