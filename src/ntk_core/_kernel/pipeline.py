"""What flows between the parts of one kernel call (docs/architecture.md):
``Spec`` -validate-> ``Checked`` -plan-> ``Config`` -> ``Implementation``, which the
executors call. Each part receives what it reads as arguments."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from ntk_core._kernel.caller import Caller
from ntk_core._kernel.kind import Kind as Kind
from ntk_core._kernel.layout import LeafLayout
from ntk_core._kernel.options import KernelOptions


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """One kernel function as built, compared by identity."""

    fn_name: str  # the public function's name, starting every message
    kind: Kind
    apply3: Callable  # pure apply3(params, x, aux) -> outputs
    options: KernelOptions
    check: Callable | None = None  # the adapter's check(params, x1, x2, aux), per signature
    hint: str = ""  # how to put the model in evaluation mode (samples-interact message)
    caller: Caller | None = None  # the public function that built it; None: a core one

    @property
    def fuse_bias(self) -> bool:  # structured derivatives fold biases in (not per leaf)
        return self.kind is not Kind.NTK_PER_LEAF


@dataclasses.dataclass(frozen=True)
class Checked:
    """One call's validated inputs."""

    n1: int
    n2: int
    symmetric: bool  # x2 is None
    out_tree: Any
    layouts: tuple[LeafLayout, ...]  # per output leaf
    shapes1: tuple[jax.ShapeDtypeStruct, ...]  # the outputs on x1, (N1, O...)
    closed: Any = None  # the model's jaxpr on x1 where traced (always with vmap_axes=None)


@dataclasses.dataclass(frozen=True)
class Config:
    """Static configuration of one compiled call (``planner.configure``)."""

    kind: Kind
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
    in_tiles: bool = False  # "auto", batch_size=None: planned in tiles kept on the device

    @property
    def fuse_bias(self) -> bool:
        return self.kind is not Kind.NTK_PER_LEAF


@dataclasses.dataclass(frozen=True)
class Implementation:
    """The two phases of one implementation for one :class:`Config`: ``features(params, x,
    aux)``, per-sample features (batch axis 0; None for ``"ntvp"``, whose tiles start from
    the inputs), and ``tile(params, fa, fb, aux, xa, xb, same) -> (kernel, finite)``, the row
    block's features against the column block's (``same``: one block's Gram, symmetric)."""

    name: str  # "jacobian", "ntvp", "structured" or "nngp"
    features: Callable | None
    tile: Callable
