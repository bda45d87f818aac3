"""What every structured rule shares: the :class:`Rule` interface, the :class:`Use` record,
parameter views and the Gram term (notation: :mod:`ntk_core._structured.rules`)."""

from __future__ import annotations

import abc
import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import opt_einsum
from jax.extend.core import primitives as prims

from ntk_core._impl import jacobian as _jacobian
from ntk_core._jax.batches import map_in_batches
from ntk_core._jax.jaxpr_walk import bind


class View(NamedTuple):
    """A parameter leaf seen through reshapes, transposes, broadcasts, casts, scalings."""

    leaf: int
    chain: tuple  # hashable steps: (primitive, sorted params), Scale(c)
    eqns: tuple  # the equations that move entries (replayed by view_index)


class Scale(NamedTuple):  # a view step: the leaf times a constant scalar (W / 8, -W)
    factor: float


class Probe(NamedTuple):
    """Where the interpreter adds a use's zero probe δ and which operand it records."""

    record: int
    delta: Any
    operand: int | None = None  # None: δ is added to the output


@dataclasses.dataclass(frozen=True)
class Use:
    """One structured use of a parameter leaf, made by ``rule``; the probed array ``y``
    transposed by ``y_perm`` and reshaped is its ``(A, K)`` output matrix."""

    rule: Rule
    kind: str  # "dot", "conv", "gather", "scale", "shift"
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
    info: Any = None  # the rule's typed record of the equation
    factor: float = 1.0  # constant scalar applied to the leaf (W / 8, -W)

    @property
    def name(self) -> str:
        return self.rule.kind_names[self.kind]


#: Einsum letters of a pairwise term: each side's cotangent leading axes (sample first),
#: the kernel's, each side's positions, coordinates, units.
Subscripts = collections.namedtuple("Subscripts", "left right out a b c k")


class Rule(abc.ABC):
    """One primitive family whose weight uses have a structured Jacobian (stateless)."""

    primitives: frozenset = frozenset()  # jax.extend.core.primitives objects
    kind_names: Mapping[str, str] = {}  # plan() name per kind, {"dot": "matrix product"}
    takes_bias: bool = False  # a bias after the use may join it as an input column
    has_gram_form: bool = True  # else always the explicit Jacobian
    scales_input: bool = False  # Use.factor scales the recorded input (else cotangents)

    def __repr__(self) -> str:
        return f"<structured rule {type(self).__name__}>"

    @abc.abstractmethod
    def match(self, eqn, ins: list, here: tuple, leaf_shapes: list) -> Use | None:
        """The use ``eqn`` makes of its one parameter operand (``ins``: View or None)."""

    def miss_reason(self, eqn, ins: list) -> str:
        """Why :meth:`match` returned None (``plan()`` shows it)."""
        return broadcast_reason(eqn, ins) or f"a {eqn.primitive.name} that no rule covers"

    def use(self, here, leaf, x_side, key, y, y_perm, sizes, info, factor, kind=None) -> Use:
        """The :class:`Use` of probed ``y``; ``sizes``: (A, K, C); ``kind``: else the first."""
        shape, dtype, key = tuple(y.aval.shape), str(y.aval.dtype), (self, *key)
        kind = next(iter(self.kind_names)) if kind is None else kind
        return Use(self, kind, here, leaf, x_side, key, shape, dtype, y_perm, *sizes, info, factor)

    def bias_target(self, eqn, use: Use):
        """The variable a bias use adds to, which may fuse with its product, or None."""
        return None

    def probe(self, use: Use, delta) -> Probe:
        return Probe(use.x_side, delta)

    def evaluate(self, eqn, invals):
        return bind(eqn, invals)

    @abc.abstractmethod
    def input_features(self, use: Use, x, bias_column: bool):
        """Gram-form inputs from ``(N, *x)``: ``(N, A, C)`` or as :meth:`x_spec` names."""

    def jacobian_input(self, use: Use, x, bias_column: bool):
        return self.input_features(use, x, bias_column)

    @abc.abstractmethod
    def jacobian(self, use: Use, xj, g, biased: bool):
        """Per-sample Jacobian ``(N, *O, C, K)`` from ``xj`` and ``g`` ``(N, *O, A, K)``."""

    def x_spec(self, n: str, a: str, c: str) -> str:
        return f"{n}{a}{c}"

    def sketch_input(self, use: Use, x, hashes, signs, k: int):
        """CountSketch of each position's input ``(N, A, k)``: x[a, c]·s(c) added to bucket
        h(c), from the Gram-form inputs ``x`` (in :meth:`x_spec`'s order)."""
        x = jnp.einsum(f"{self.x_spec('n', 'a', 'c')}->nac", x)
        return count_sketch(x, hashes, signs, k)

    def gram_input_width(self, c: int) -> int:
        return c

    def input_values(self, c: int) -> int:  # stored per position (cost model)
        return c

    def input_flops(self, a: int, c: int) -> float:  # of forming the input (cost model)
        return 0.0

    def bias_in_gram(self, use: Use) -> bool:  # a fused bias adds 1, not a column
        return False

    def gram_term(self, u: Use, v: Use, x1, x2, g1, g2, s: Subscripts, precision, plus_one):
        """Σ_ab (Σ_c x1[a, c] x2[b, c]) (Σ_k g1[.., a, k] g2[.., b, k]) in layout ``s.out``."""
        x1_spec = u.rule.x_spec(s.left[0], s.a, s.c)
        x2_spec = v.rule.x_spec(s.right[0], s.b, s.c)
        g_specs = f"{s.left}{s.a}{s.k},{s.right}{s.b}{s.k}"
        if u.a_size == 1 and v.a_size == 1:  # two matrix products (one einsum: ~2.5x slower)
            samples = x1_spec[0] if x1_spec[0] == x2_spec[0] else x1_spec[0] + x2_spec[0]
            xx = _jacobian.pair_einsum(x1_spec, x2_spec, samples, x1, x2, precision) + plus_one
            gg = _jacobian.pair_einsum(*g_specs.split(","), s.out, g1, g2, precision)
            axes = tuple(xx.shape[samples.index(a)] if a in samples else 1 for a in s.out)
            return gg * xx.reshape(axes)
        spec = f"{x1_spec},{x2_spec},{g_specs}->{s.out}"

        def term(rows):
            return jnp.einsum(
                spec, rows[0], x2, rows[1], g2, precision=precision, optimize="optimal"
            )

        most = _rows_per_block(spec, s, (x1, x2, g1, g2))
        return term((x1, g1)) if most is None else map_in_batches(term, (x1, g1), most)

    def label(self, uses: list[Use]) -> str:
        n, name = len(uses), uses[0].name
        return f"{n} {name}{'s' if n > 1 else ''}"


#: Bytes of a Gram term's largest intermediate (N1·N2·O²·A-sized for convolutions)
#: above which it runs over blocks of x1's samples: N = 64 of a ResNet-18 held 3 GB.
GRAM_TERM_BYTES = 2**27
_KEEP_ORDER = frozenset({prims.reshape_p, prims.squeeze_p, prims.copy_p})  # views in C order


def _rows_per_block(spec: str, s: Subscripts, operands) -> int | None:
    """x1's samples per block that keep the einsum's largest intermediate within
    :data:`GRAM_TERM_BYTES` (``None``: in one piece, or x1's samples are not the output's
    leading axis, as on the per-sample diagonal)."""
    if s.out[0] != s.left[0] or s.left[0] in s.right:
        return None
    shapes = [v.shape for v in operands]
    _, info = opt_einsum.contract_path(spec, *shapes, shapes=True, optimize="optimal")
    itemsize = jnp.result_type(*operands).itemsize
    n1 = shapes[0][0]
    total = int(info.largest_intermediate) * itemsize
    return None if total <= GRAM_TERM_BYTES else max(1, n1 * GRAM_TERM_BYTES // total)


def count_sketch(v, hashes, signs, k: int):
    """CountSketch of the last axis of ``v`` ``(..., D)`` into ``(..., k)``: entry d times
    ``signs[d]`` added to bucket ``hashes[d]`` (scattered as rows: ~5x faster on XLA CPU)."""
    rows = jnp.moveaxis(v * signs.astype(v.dtype), -1, 0)
    out = jnp.zeros((k,) + rows.shape[1:], v.dtype).at[hashes].add(rows)
    return jnp.moveaxis(out, 0, -1)


def scaled(chain) -> tuple[tuple, float]:
    """The view chain without its constant scalings, and the product of their factors."""
    factor = math.prod((step.factor for step in chain if isinstance(step, Scale)), start=1.0)
    return tuple(step for step in chain if not isinstance(step, Scale)), factor


def broadcasts(chain) -> bool:
    return any(step[0] is prims.broadcast_in_dim_p for step in chain)


def broadcast_reason(eqn, ins) -> str | None:
    chain = next(o.chain for o in ins if o is not None)
    if broadcasts(chain):
        return f"broadcast before its {eqn.primitive.name}, so its entries repeat"
    return None


def view_index(eqns, leaf_shape):
    """The leaf's entry indices ``arange(P)`` through the view equations, in numpy."""
    idx = np.arange(math.prod(leaf_shape), dtype=np.int32).reshape(leaf_shape)
    for eqn in eqns:
        idx = _numpy_view(eqn, idx)
    return idx


def _numpy_view(eqn, idx: np.ndarray) -> np.ndarray:
    """One view equation on numpy indices (numpy: binding compiles a program each); a
    squeeze, a copy and a reshape in C order keep the entries' order."""
    primitive, params, shape = eqn.primitive, eqn.params, tuple(eqn.outvars[0].aval.shape)
    reordered = primitive is prims.reshape_p and params.get("dimensions") is not None
    if primitive in _KEEP_ORDER and not reordered:
        return idx.reshape(shape)
    if primitive is prims.transpose_p:
        return np.transpose(idx, params["permutation"])
    if primitive is prims.broadcast_in_dim_p:
        placed = [1] * len(shape)
        for axis, dim in enumerate(params["broadcast_dimensions"]):
            placed[dim] = idx.shape[axis]
        return np.broadcast_to(idx.reshape(placed), shape)
    with jax.ensure_compile_time_eval():  # concrete even inside a jit trace
        return np.asarray(bind(eqn, [idx]))
