"""Output layout of kernels (neural-tangents 0.6) as einsum specifications: per output
axis, traced (contracted, divided by its size), diagonal (kept once) or free (kept twice,
x1's then x2's), in the output's axis order; see :func:`ntk_core.ntk_fn`."""

from __future__ import annotations

import dataclasses
import math
import string

import jax

from ntk_core._errors import bad
from ntk_core._kernel.kind import Kind

#: A tuple of output axes (trace_axes, diagonal_axes).
Axes = tuple[int, ...]

_LETTERS = string.ascii_letters


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Resolved axes of one output leaf: non-negative, sorted."""

    ndim: int
    trace: Axes
    diag: Axes

    def specs(self, n_contracted: int = 0) -> tuple[str, str, str]:
        """Einsum ``(lhs, rhs, out)`` for operands ``(N1, O..., *C)`` and ``(N2, O..., *C)``, the
        ``n_contracted`` trailing axes C summed."""
        letters = iter(_LETTERS)
        lhs, rhs, out = "", "", ""
        for a in range(self.ndim):
            if a in self.trace or a in self.diag:  # one letter, in the output if diagonal
                left = right = next(letters)
                out += left if a in self.diag else ""
            else:
                left, right = next(letters), next(letters)
                out += left + right
            lhs, rhs = lhs + left, rhs + right
        extra = "".join(next(letters) for _ in range(n_contracted))
        return lhs + extra, rhs + extra, out

    def trace_size(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape[a] for a in self.trace)

    def values_per_pair(self, shape: tuple[int, ...]) -> int:
        """Kernel values of one pair of samples for an output leaf of ``shape``: s² per
        kept output axis of size s, s per diagonal one, 1 per traced one."""
        size = 1
        for a in range(1, self.ndim):
            if a in self.diag:
                size *= shape[a]
            elif a not in self.trace:
                size *= shape[a] ** 2
        return size

    @property
    def batch_diagonal(self) -> bool:
        return 0 in self.diag


def axis_twice(fn_name: str, name: str, axes, where: str = "") -> ValueError:
    """The ValueError for ``name`` (``trace_axes``, ``diagonal_axes``) naming an axis twice."""
    what = f"{name}={tuple(axes)!r} names the same axis twice{where}"
    return bad(ValueError, fn_name, what, "list each axis once")


def resolve_layout(
    fn_name: str, trace_axes: Axes, diagonal_axes: Axes, shape, where: str, several=False
):
    """The axes normalised for one output leaf of ``shape`` (``where`` in messages; one of
    ``several``); ValueError for an axis out of range, named twice, traced and diagonal,
    the batch axis traced, or a traced axis of size 0."""
    ndim, shape = len(shape), tuple(shape)
    of = f"{where} of shape {shape}"
    found = []
    for name, axes in dict(trace_axes=trace_axes, diagonal_axes=diagonal_axes).items():
        for a in axes:
            if not -ndim <= a < ndim:
                what = f"{name} contains {a}, out of range for {of}"
                fix = f"pass axes in [{-ndim}, {ndim - 1}]"
                if name == "trace_axes":  # output axes only: 0 is the batch
                    fix = f"pass output axes in [1, {ndim - 1}] or [{1 - ndim}, -1]"
                    fix = fix if ndim > 1 else "pass trace_axes=() (the output has no other axis)"
                raise bad(ValueError, fn_name, what, fix)
        found.append(tuple(sorted({a % ndim for a in axes})))
        if len(found[-1]) != len(axes):
            raise axis_twice(fn_name, name, axes, f" for {of}")
    trace, diag = found
    both = sorted(set(trace) & set(diag))
    if both:
        what = f"axis {both[0]} of {of} is in both trace_axes and diagonal_axes"
        raise bad(ValueError, fn_name, what, "remove it from one of them")
    if 0 in trace:  # e.g. the default trace_axes=(-1,) of an output (N,)
        what = f"trace_axes={tuple(trace_axes)!r} traces the batch axis 0 of {of}"
        fix = "leave axis 0 out (e.g. trace_axes=() for an output (N,)), or use diagonal_axes=(0,)"
        if several:  # e.g. (logits, loss): extra outputs per sample
            fix += "; or make the model return its outputs alone"
        raise bad(ValueError, fn_name, what, fix)
    empty = [a for a in trace if shape[a] == 0]
    if empty:  # the mean over no values: NaN (0 / 0) in every implementation
        what = f"trace_axes={tuple(trace_axes)!r} averages axis {empty[0]} of {of}, which is empty"
        fix = "leave the empty axis out of trace_axes (e.g. trace_axes=())"
        raise bad(ValueError, fn_name, what, fix)
    return LeafLayout(ndim, trace, diag)


def swap_perm(layout) -> tuple[int, ...]:
    """Axis permutation of a kernel leaf that swaps the x1 and x2 axis of each pair."""
    perm: list[int] = []
    pos = 0
    for a in range(layout.ndim):
        if a in layout.trace:
            continue
        if a in layout.diag:
            perm.append(pos)
            pos += 1
        else:
            perm += [pos + 1, pos]
            pos += 2
    return tuple(perm)


def _output_ids(config):
    """The result's pytree with each kernel leaf's output leaf index in its place."""
    n_out = config.out_tree.num_leaves
    ids = jax.tree.unflatten(config.out_tree, list(range(n_out)))
    if config.kind is Kind.NTK_PER_LEAF:
        ids = jax.tree.unflatten(config.params_tree, [ids] * config.params_tree.num_leaves)
    return ids


def leaf_layouts(config) -> list:
    """The layout of each kernel leaf of a result, in ``jax.tree.leaves`` order."""
    return [config.layouts[i] for i in jax.tree.leaves(_output_ids(config))]


def pair_bytes(shapes1, layouts, n_leaves: int = 1) -> int:
    """Bytes of one pair of samples' kernel values: each output leaf's
    :meth:`LeafLayout.values_per_pair` in its dtype, times ``n_leaves`` per-leaf kernels."""
    pairs = zip(shapes1, layouts, strict=True)
    return n_leaves * sum(lay.values_per_pair(s.shape) * s.dtype.itemsize for s, lay in pairs)


def as_result(config, leaves: list):
    """The result's pytree (e.g. ``{"logits": K}``) of its kernel ``leaves``."""
    return jax.tree.unflatten(jax.tree.structure(_output_ids(config)), leaves)
