"""Sums over sliding windows of covariances, one spatial dimension at a time.

A convolution shares one filter offset δ between both positions of a pair, so its kernel
sums along diagonals: Σ'(h, h') = Σ_δ Σ(s·h + δ, s·h' + δ); a pool draws the two offsets
independently: Σ'(h, h') = Σ_δ Σ_δ' Σ(s·h + δ, s·h' + δ'). Both act on each spatial
dimension's pair of axes separately, so an S-dimensional window is S one-dimensional
passes, each a sum of k strided slices (no (HW)² x (HW)² operator is ever formed).
"""

from __future__ import annotations

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


def shared_offsets(x, axes, size, window, stride, padding):
    """Σ_δ x[..., s·h + δ, ..., s·h' + δ, ...] over the axes ``axes`` (one position each,
    the same offset δ in all: a convolution's pair of axes, or the single axis of the
    spatial diagonal)."""
    n = out_size(size, window, stride, padding)
    p = _padded(x, axes, size, window, stride, padding)
    return sum(_strided(p, axes, d, n, stride) for d in range(window))


def independent_offsets(x, axes, size, window, stride, padding):
    """Σ_δ Σ_δ' ...: a pool's window on each axis of ``axes`` separately."""
    for a in axes:
        x = shared_offsets(x, (a,), size, window, stride, padding)
    return x


def window_counts(size, window, stride, padding):
    """How many of each window's positions are inside the input (SAME edges), (n_out,)."""
    return shared_offsets(jnp.ones((size,)), (0,), size, window, stride, padding)
