"""What flows between the parts of one kernel call (docs/architecture.md):

    Spec ──validate──▶ Checked ──plan──▶ Config ──implementation──▶ Implementation
                                                                        │
                                          executor (one call, or tiles) ◀┘

* :class:`Spec`: one kernel function, fixed when it is built (the model, its options).
* :class:`Checked`: what validation (:mod:`ntk_core._kernel.validate`) learned of one call's
  inputs: sizes, the output tree and its layouts.
* :class:`Config`: what planning (:mod:`ntk_core._kernel.planner`) decided: the
  implementation, its per-leaf modes, the whole-batch chunks. Frozen and hashable:
  the static argument of every compiled phase.
* :class:`Implementation`: the two phases of that implementation
  (:mod:`ntk_core._impl.phases`), which the executors (:mod:`ntk_core._kernel.executor`,
  :mod:`ntk_core._blocked.tiles`) call and nothing else.

Each part receives what it reads as arguments; no part reaches into another's state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from ntk_core._kernel.caller import Caller
from ntk_core._kernel.layout import LeafLayout
from ntk_core._kernel.options import KernelOptions


def fuses_bias(kind: str) -> bool:
    """Whether structured derivatives fold biases into their product's Gram identity:
    always, except for per-leaf kernels (each leaf's kernel is needed apart)."""
    return kind != "ntk_per_leaf"


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """One kernel function as built: compared by identity.

    Attributes:
      fn_name: the public function's name, the first words of every message.
      kind: ``"ntk"``, ``"ntk_per_leaf"`` or ``"nngp"``.
      apply3: ``apply3(params, x, aux) -> outputs``, pure (:mod:`ntk_core._kernel.model`).
      options: the validated :class:`~ntk_core._kernel.options.KernelOptions`.
      check: ``check(params, x1, x2, aux)``, the adapter's own checks, run once per
        new input signature before tracing; or None.
      hint: how to put the model in evaluation mode (in the message raised when its
        samples interact under ``vmap_axes=0``).
      caller: the public function that built it, as the messages describe it (its
        argument order, what its model is called, neural-tangents' order where it
        applies); None: a core kernel function ``(params, x1, x2)`` named ``fn_name``.
    """

    fn_name: str
    kind: str
    apply3: Callable
    options: KernelOptions
    check: Callable | None = None
    hint: str = ""
    caller: Caller | None = None

    @property
    def fuse_bias(self) -> bool:
        return fuses_bias(self.kind)


@dataclasses.dataclass(frozen=True)
class Checked:
    """One call's inputs, validated (:func:`ntk_core._kernel.validate.validate`).

    Attributes:
      n1, n2: samples of x1 and x2 (n2 = n1 when x2 is None).
      symmetric: x2 is None (the Gram matrix of x1).
      out_tree: the tree structure of the model's outputs.
      layouts: one :class:`~ntk_core._kernel.layout.LeafLayout` per output leaf.
      shapes1: the output leaves on x1, ``(N1, O...)``, as shapes and dtypes.
      closed: the jaxpr of the model on x1's whole batch where validation traced it
        (always with ``vmap_axes=None``: the whole-batch memory model reads it); None
        for a known per-sample signature.
    """

    n1: int
    n2: int
    symmetric: bool
    out_tree: Any
    layouts: tuple[LeafLayout, ...]
    shapes1: tuple[jax.ShapeDtypeStruct, ...]
    closed: Any = None


@dataclasses.dataclass(frozen=True)
class Config:
    """Static configuration of one compiled call (:func:`ntk_core._kernel.planner.configure`)."""

    kind: str  # "ntk", "ntk_per_leaf" or "nngp"
    implementation: str  # "jacobian", "ntvp", "structured" or "nngp"
    vmap_axes: int | None
    precision: str
    out_tree: Any
    layouts: tuple[LeafLayout, ...]
    shapes1: tuple[jax.ShapeDtypeStruct, ...]
    symmetric: bool
    params_tree: Any = None
    structure: Any = ()  # "structured": the _structured.Structure of Analysis.leaves
    analysis: Any = None  # "structured": the _structured.Analysis
    n2: int = 0  # samples of x2 (of x1 when x2 is None)
    param_sizes: tuple[int, ...] = ()  # entries of each parameter leaf
    whole_batch: Any = None  # vmap_axes=None: the _cost.WholeBatch memory model

    @property
    def fuse_bias(self) -> bool:
        return fuses_bias(self.kind)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """The two phases of one implementation for one :class:`Config`.

    Attributes:
      name: ``"jacobian"``, ``"ntvp"``, ``"structured"`` or ``"nngp"``.
      features: ``features(params, x, aux)`` -> the per-sample features of a batch of
        samples (a pytree of arrays with batch axis 0); None for ``"ntvp"``, whose
        tiles start from the inputs.
      tile: ``tile(params, fa, fb, aux, xa, xb, same)`` -> ``(kernel, finite)``: the
        contraction of a row block's features ``fa`` with a column block's ``fb``
        (``"ntvp"``: of the inputs ``xa``, ``xb``), and its all-finite flag;
        ``same``: the Gram matrix of one block (``fb``, ``xb`` unused), exactly
        symmetric.
    """

    name: str
    features: Callable | None
    tile: Callable
