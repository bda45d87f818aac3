"""Validation of the keyword options shared by every kernel entry point.

Shared argument descriptions (referred to by every public docstring):

trace_axes:
    Output axes to trace over: for each traced axis the kernel sums the products of
    the two outputs along it and divides by its size (an average, as
    neural-tangents does), and the axis is absent from the result. An int or a
    sequence of ints, negative values counted from the end of each output leaf.
    The batch axis 0 cannot be traced. Default ``(-1,)``.
diagonal_axes:
    Output axes on which only the diagonal is computed: the axis appears once in
    the result. May name the batch axis 0, which gives the per-sample diagonal
    K(x1_i, x2_i) at O(N) cost (x1 and x2 must then have the same N). Must not
    overlap ``trace_axes``. Default ``()``.
vmap_axes:
    ``0`` (default): samples are independent, so per-sample derivatives are computed
    with ``jax.vmap`` over axis 0 of every input leaf (the model is called on
    batches of one sample, batch axis kept). ``None``: the model is called on the
    whole batch; required for models whose samples interact (BatchNorm in
    training mode).
implementation:
    ``"auto"`` (default), ``"jacobian"`` (Jacobian contraction), ``"ntvp"``
    (NTK-vector products) or ``"structured"`` (structured derivatives: Gram identities
    for weights used in matrix products, convolutions and embedding lookups and their
    biases, explicit Jacobians for the other leaves; with
    ``vmap_axes=None`` it computes the Jacobian contraction). See
    :data:`IMPLEMENTATIONS`.
precision:
    ``"highest"`` (default), ``"high"`` or ``"default"``: the matmul precision used
    for every matmul of the kernel computation, the model's own included.
    Anything below ``"highest"`` lets GPUs and TPUs use TF32 or bf16 passes.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

#: Valid values of ``implementation``.
IMPLEMENTATIONS = ("auto", "jacobian", "ntvp", "structured")
#: Valid values of ``precision``.
PRECISIONS = ("highest", "high", "default")
#: Keyword options of the NTK entry points, and of the NNGP ones.
NTK_OPTION_NAMES = ("trace_axes", "diagonal_axes", "vmap_axes", "implementation", "precision")
NNGP_OPTION_NAMES = ("trace_axes", "diagonal_axes", "vmap_axes", "precision")

Axes = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Validated, hashable options of one kernel function."""

    trace_axes: Axes
    diagonal_axes: Axes
    vmap_axes: int | None
    implementation: str
    precision: str


def _axes(fn_name: str, name: str, value) -> Axes:
    if isinstance(value, bool):
        raise TypeError(
            f"{fn_name}: {name} must be an int or a sequence of ints, got the bool "
            f"{value!r}. Fix: pass e.g. {name}=(-1,) or {name}=()."
        )
    if isinstance(value, numbers.Integral):
        return (int(value),)
    if isinstance(value, Sequence) and not isinstance(value, str):
        out = []
        for v in value:
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(
                    f"{fn_name}: {name} must contain only ints, got {value!r}. "
                    f"Fix: pass axis indices such as {name}=(-1,)."
                )
            out.append(int(v))
        if len(set(out)) != len(out):
            raise ValueError(
                f"{fn_name}: {name}={tuple(value)!r} names the same axis twice. "
                f"Fix: list each axis once."
            )
        return tuple(out)
    raise TypeError(
        f"{fn_name}: {name} must be an int or a sequence of ints, got "
        f"{type(value).__name__} {value!r}. Fix: pass e.g. {name}=(-1,) or {name}=()."
    )


def make_options(
    fn_name: str,
    *,
    trace_axes=(-1,),
    diagonal_axes=(),
    vmap_axes=0,
    implementation="auto",
    precision="highest",
) -> KernelOptions:
    """Validates the shared options; raises TypeError/ValueError naming ``fn_name``."""
    trace = _axes(fn_name, "trace_axes", trace_axes)
    diag = _axes(fn_name, "diagonal_axes", diagonal_axes)
    if vmap_axes is not None and (isinstance(vmap_axes, bool) or vmap_axes != 0):
        raise ValueError(
            f"{fn_name}: vmap_axes must be 0 (samples along axis 0 are independent) or "
            f"None (samples interact, e.g. BatchNorm in training mode), got {vmap_axes!r}. "
            f"Fix: move the batch axis of your inputs to 0 and use vmap_axes=0, or pass "
            f"vmap_axes=None."
        )
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{fn_name}: implementation must be one of {', '.join(map(repr, IMPLEMENTATIONS))}, "
            f"got {implementation!r}."
        )
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(
            f"{fn_name}: precision must be one of {', '.join(map(repr, PRECISIONS))}, "
            f"got {precision!r}."
        )
    return KernelOptions(trace, diag, vmap_axes, implementation, precision)
