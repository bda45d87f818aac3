"""Layers that act on positions: pools, global pools, Flatten, LayerNorm, Dropout.

- AvgPool / SumPool: Σ'(h, h') = c·Σ_δ Σ_δ' Σ(s·h + δ, s·h' + δ') (c = 1/k² per dimension
  for the mean, 1 for the sum; with ``normalize_edges`` 1 over the in-image counts).
- GlobalAvgPool / GlobalSumPool: the mean / sum over every pair of positions.
- Flatten: the flattened vector's entries are the positions' channels, so a Dense
  layer after it sees the mean over positions of Σ(h, h): the spatial diagonal only.
- LayerNorm over the channels (and optionally positions): Σ(h, h') / √((ε + q̄1(h))(ε +
  q̄2(h'))), q̄ the variance averaged over the normalised positions; needs a Gaussian input.
- Dropout (train mode, keep rate r): a unit's own variance, and the kernel of a sample
  with itself, times 1/r; other pairs unchanged (neural-tangents' Dropout).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ntk_core._infinite import windows
from ntk_core._infinite.state import Kern, pair_variances, variances


def pool(k: Kern, layer, average: bool) -> Kern:
    """AvgPool (``average``) or SumPool on the full spatial covariance."""
    sizes = []
    for size, window, stride in zip(k.spatial, layer.window_shape, layer.strides, strict=True):
        sizes.append(windows.out_size(size, window, stride, layer.padding))

    def spread(a, n_batch):
        for d, size in enumerate(k.spatial):
            window, stride = layer.window_shape[d], layer.strides[d]
            axes = (n_batch + 2 * d, n_batch + 2 * d + 1)
            a = windows.independent_offsets(a, axes, size, window, stride, layer.padding)
            if average and layer.normalize_edges and layer.padding == "SAME":
                counts = windows.window_counts(size, window, stride, layer.padding)
                shape = [1] * a.ndim
                shape[axes[0]] = shape[axes[1]] = len(counts)
                a = a / (counts[:, None] * counts[None, :]).reshape(shape)
            elif average:
                a = a / window**2
        return a

    return k.map(spread).replace(spatial=tuple(sizes))


def global_pool(k: Kern, average: bool) -> Kern:
    reduce = jnp.mean if average else jnp.sum

    def over_positions(a, n_batch):
        return reduce(a, axis=tuple(range(n_batch, a.ndim))) if a.ndim > n_batch else a

    return k.map(over_positions).replace(spatial=(), reversed=False)


def flatten(k: Kern) -> Kern:
    def diagonal_mean(a, n_batch):
        if k.diagonal:
            return jnp.mean(a, axis=tuple(range(n_batch, a.ndim))) if a.ndim > n_batch else a
        v = a
        for _ in range((a.ndim - n_batch) // 2):
            v = jnp.diagonal(v, axis1=n_batch, axis2=n_batch + 1)
        return jnp.mean(v, axis=tuple(range(n_batch, v.ndim))) if v.ndim > n_batch else v

    width = k.channels
    for size in k.spatial:
        width *= size
    out = k.map(diagonal_mean)
    return out.replace(spatial=(), gaussian=False, channels=width, reversed=False)


def layer_norm(k: Kern, spatial_axes: tuple[int, ...], eps: float) -> Kern:
    """Normalised over the channels and the positions' axes ``spatial_axes`` (0-based
    among the spatial axes)."""

    def averaged(v, mask):
        if not spatial_axes:
            return v + eps
        axes = tuple(1 + a for a in spatial_axes)
        if mask is None:
            return jnp.broadcast_to(jnp.mean(v, axis=axes, keepdims=True), v.shape) + eps
        # masked (neural-tangents): the sum of eps + v over the positions (masked ones: eps,
        # their v is 0) over the count of unmasked ones
        seen = jnp.maximum(jnp.sum(~mask, axis=axes, keepdims=True), 1).astype(v.dtype)
        return jnp.broadcast_to(jnp.sum(v + eps, axis=axes, keepdims=True) / seen, v.shape)

    m1 = m2 = None
    if k.masks is not None:
        m1 = k.masks.m1
        m2 = m1 if k.masks.m2 is None else k.masks.m2
    v1 = averaged(variances(k.cov1, k.diagonal), m1)
    v2 = None if k.cov2 is None else averaged(variances(k.cov2, k.diagonal), m2)
    q11, q22, self1, self2 = pair_variances(k, v1, v2)
    scale = 1 / jnp.sqrt(q11 * q22)
    return k.replace(
        nngp=k.nngp * scale,
        ntk=None if k.ntk is None else k.ntk * scale,
        cov1=k.cov1 / jnp.sqrt(self1[0] * self1[1]),
        cov2=None if k.cov2 is None else k.cov2 / jnp.sqrt(self2[0] * self2[1]),
    )


def _position_diagonal(a, n_batch: int, diagonal: bool):
    """1 where the positions of a pair coincide (every entry on the spatial diagonal)."""
    if diagonal:
        return jnp.ones(a.shape[n_batch:], a.dtype)
    mask = jnp.ones((), a.dtype)
    for d in range((a.ndim - n_batch) // 2):
        size = a.shape[n_batch + 2 * d]
        mask = jnp.multiply.outer(mask, jnp.eye(size, dtype=a.dtype))
    return mask


def dropout(k: Kern, rate: float, same: bool) -> Kern:
    """Train-mode dropout with keep rate ``rate``; ``same``: the pair's batches are one
    (x2 is x1, or a tile of a Gram matrix: ``k.offset``), so the batch diagonal (shifted
    by the offset) is each sample with itself."""
    boost = 1 / rate - 1

    def own(a, n_batch):
        return a * (1 + boost * _position_diagonal(a, 1, k.diagonal)) if n_batch == 1 else a

    def pairs(a):
        if not same:
            return a
        n1, n2 = a.shape[:2]
        shift = 0 if k.offset is None else k.offset  # a Gram tile: column i + offset is row i
        eye = (
            lax.broadcasted_iota(jnp.int32, (n1, n2), 0) + shift
            == lax.broadcasted_iota(jnp.int32, (n1, n2), 1)
        ).astype(a.dtype)
        mask = jnp.multiply.outer(eye, _position_diagonal(a, 2, k.diagonal))
        return a * (1 + boost * mask)

    out = k.map(own)
    return out.replace(
        nngp=pairs(out.nngp), ntk=None if out.ntk is None else pairs(out.ntk), gaussian=False
    )
