"""Sums over sliding windows of covariances, one spatial dimension at a time.

A convolution shares one filter offset δ between both positions of a pair, so its kernel
sums along diagonals: Σ'(h, h') = Σ_δ Σ(s·h + δ, s·h' + δ); a pool draws the two offsets
independently: Σ'(h, h') = Σ_δ Σ_δ' Σ(s·h + δ, s·h' + δ'). Both act on each spatial
dimension's pair of axes separately, so an S-dimensional window is S one-dimensional
passes, each a sum of k strided slices (no (HW)² x (HW)² operator is ever formed).

A convolution's pair of adjacent axes is summed one of two ways (the same sums in another
order): ``"slices"`` as above, or ``"flat"``: the pair padded and merged into one axis of
(X + p)² positions, on which the shared offset δ is a shift by δ·(X + p + 1), k contiguous
slices. Measured (benchmarks/README.md, 2026-12-07): on the CPU ``"flat"`` is 1.4-2x
faster warm (21-layer CNN with GlobalAvgPool, WideResNet); on a TPU v5e it is 1.9x slower
than ``"slices"`` (and a ``reduce_window``, a diagonal-filter convolution and stacking the
NNGP with the NTK were slower still), so the TPU keeps ``"slices"``; GPUs (not measured)
take the CPU's.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

PADDINGS = ("VALID", "SAME", "CIRCULAR")


def pads(size: int, window: int, stride: int, padding: str) -> tuple[int, int]:
    """(before, after) of XLA's SAME (and CIRCULAR, wrapped); (0, 0) for VALID."""
    if padding == "VALID":
        return 0, 0
    total = max((-(-size // stride) - 1) * stride + window - size, 0)
    return total // 2, total - total // 2


def out_size(size: int, window: int, stride: int, padding: str) -> int:
    before, after = pads(size, window, stride, padding)
    return (size + before + after - window) // stride + 1


def _padded(x, axes, size, window, stride, padding):
    before, after = pads(size, window, stride, padding)
    widths = [(0, 0)] * x.ndim
    for a in axes:
        widths[a] = (before, after)
    if before == after == 0:
        return x
    return jnp.pad(x, widths, mode="wrap" if padding == "CIRCULAR" else "constant")


def _strided(x, axes, start, n, stride):
    index = [slice(None)] * x.ndim
    for a in axes:
        index[a] = slice(start, start + stride * (n - 1) + 1, stride)
    return x[tuple(index)]


METHODS = ("slices", "flat")
_forced: list[str] = []


def pair_method() -> str:
    """The method a convolution's pair of axes is summed with, read when a network is
    traced (a kernel function compiled before keeps its program): see the module's text."""
    if _forced:
        return _forced[-1]
    return "slices" if jax.default_backend() == "tpu" else "flat"


@contextlib.contextmanager
def using(method: str):
    """Trace convolutions with ``method`` inside the block (tests and benchmarks)."""
    if method not in METHODS:
        raise ValueError(f"windows.using: method must be one of {METHODS}, got {method!r}")
    _forced.append(method)
    try:
        yield
    finally:
        _forced.pop()


def shared_offsets(x, axes, size, window, stride, padding, method="slices"):
    """Σ_δ x[..., s·h + δ, ..., s·h' + δ, ...] over the axes ``axes`` (one position each,
    the same offset δ in all: a convolution's pair of axes, or the single axis of the
    spatial diagonal); ``method`` (:data:`METHODS`) for a pair of adjacent axes."""
    n = out_size(size, window, stride, padding)
    if len(axes) == 2 and axes[1] == axes[0] + 1 and method != "slices":
        return _pair_sum(x, axes[0], size, window, stride, padding, n)
    p = _padded(x, axes, size, window, stride, padding)
    return sum(_strided(p, axes, d, n, stride) for d in range(window))


def _pair_sum(x, axis, size, window, stride, padding, n):
    """Σ_δ x[..., s·h + δ, s·h' + δ, ...] on the adjacent axes (axis, axis + 1), "flat"."""
    before, after = pads(size, window, stride, padding)
    lead, trail = x.shape[:axis], x.shape[axis + 2 :]
    # the pair padded to (X + p)², merged: position (h, h') at h·(X + p) + h', so the
    # shared offset δ is a shift by δ·(X + p + 1), and no shift reaches a wrong row
    width = size + before + after
    x = _padded(x, (axis, axis + 1), size, window, stride, padding)
    flat = x.reshape((*lead, width * width, *trail))
    step = width + 1
    tail = [(0, 0)] * flat.ndim
    tail[axis] = (0, (window - 1) * step)
    padded = jnp.pad(flat, tail)
    index = [slice(None)] * flat.ndim
    parts = []
    for d in range(window):
        index[axis] = slice(d * step, d * step + width * width)
        parts.append(padded[tuple(index)])
    grid = sum(parts).reshape((*lead, width, width, *trail))
    return _strided(grid, (axis, axis + 1), 0, n, stride)


def independent_offsets(x, axes, size, window, stride, padding):
    """Σ_δ Σ_δ' ...: a pool's window on each axis of ``axes`` separately."""
    for a in axes:
        x = shared_offsets(x, (a,), size, window, stride, padding)
    return x


def window_counts(size, window, stride, padding):
    """How many of each window's positions are inside the input (SAME edges), (n_out,)."""
    return shared_offsets(jnp.ones((size,)), (0,), size, window, stride, padding)
