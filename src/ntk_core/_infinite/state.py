"""The kernel state a network's layers transform, one pair of input batches at a time.

For inputs x1 (N1, *S, C) and x2 (N2, *S, C) with S spatial axes, a layer's output
covariance is held as

- ``nngp``: Σ(x1_i, x2_j) per pair of positions, ``(N1, N2, H, H', W, W', ...)`` (the
  spatial axes of x1 and x2 zipped, neural-tangents' layout), or on the spatial diagonal
  only, ``(N1, N2, H, W, ...)``, when no later layer mixes positions (``diagonal``);
- ``ntk``: Θ, the same shape (None when only the NNGP is asked for);
- ``cov1``: each x1 sample with itself, ``(N1, H, H', ...)`` or ``(N1, H, ...)``; the
  variances q11 a nonlinearity needs; ``cov2`` the same for x2 (None: x2 is x1).

Covariances are per channel: every layer's channels are i.i.d. at infinite width, so the
channel axis is never held (Novak et al. 2019; Garriga-Alonso et al. 2019).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from ntk_core._errors import bad


@dataclasses.dataclass(frozen=True)
class Kern:
    """One layer's kernels of a pair of input batches (see the module docstring).

    ``spatial``: the spatial sizes; ``diagonal``: only the spatial diagonal is held;
    ``gaussian``: the layer's output is a Gaussian process (an affine layer came last, so
    a nonlinearity may follow); ``channels``: the finite network's width here (the NTK of
    the standard parameterisation and FanInConcat's weights use it); ``is_input``: no layer
    has run yet; ``reversed``: spatial axes in reverse order in the output, as
    neural-tangents lays them out after an odd number of convolutions; ``source``: the
    layer that made it (for messages). ``cov2 is None``: x2 is x1 (the same samples).
    ``offset``: None, or (a tile of a Gram matrix, :mod:`.kernel_fn`) an int scalar, maybe
    traced: pair (i, j) is one sample with itself where j − i == offset (cov2 is then the
    tile's columns' own covariances, bit for bit those of the same samples in cov1).
    """

    nngp: jnp.ndarray
    ntk: jnp.ndarray | None
    cov1: jnp.ndarray
    cov2: jnp.ndarray | None
    spatial: tuple[int, ...]
    diagonal: bool
    gaussian: bool
    channels: int
    is_input: bool = False
    reversed: bool = False
    source: str = "the input"  # the layer that made it, for messages
    masks: Masks | None = None  # masked positions (kernel_fn's mask_constant), or None
    offset: Any = None  # a Gram tile's shift between x1's and x2's samples, or None
    inputs: Any = None  # (x1, x2 or None) while is_input: fused_conv.network reads them

    def same_samples(self) -> bool:
        """Whether some pairs are one sample with itself (a Gram matrix or a tile of one)."""
        return self.cov2 is None or self.offset is not None

    def replace(self, **changes) -> Kern:
        return dataclasses.replace(self, **changes)

    def map(self, fn, ntk_fn=None) -> Kern:
        """``fn(array, n_batch)`` applied to every covariance (n_batch: its leading batch
        axes, 2 for nngp and ntk, 1 for cov1 and cov2); ``ntk_fn`` for the NTK if given."""
        ntk_fn = fn if ntk_fn is None else ntk_fn
        return self.replace(
            nngp=fn(self.nngp, 2),
            ntk=None if self.ntk is None else ntk_fn(self.ntk, 2),
            cov1=fn(self.cov1, 1),
            cov2=None if self.cov2 is None else fn(self.cov2, 1),
        )


class Masks:
    """Masked positions of x1 ``(N1, *S)`` and x2 ``(N2, *S)`` (None: x2 is x1), True where
    masked (neural-tangents' ``mask_constant``). Compared by shapes alone: a layer that
    keeps them keeps the same masks, so a repeated layer still scans (layer._scannable).
    ``per_channel``: after FanInConcat the channels of each branch keep that branch's
    masks; m1 and m2 are then the positions masked in every branch, which is what a Dense,
    Conv or attention layer (masked where all its input channels are) and Flatten need."""

    def __init__(self, m1, m2, per_channel=False):
        self.m1, self.m2, self.per_channel = m1, m2, per_channel

    def _key(self):
        return (self.m1.shape, None if self.m2 is None else self.m2.shape, self.per_channel)

    def __eq__(self, other):
        return isinstance(other, Masks) and self._key() == other._key()

    __hash__ = None

    def map(self, fn) -> Masks:
        """``fn`` of each side's masks: a layer that moves positions (its output's masks
        are the same on every channel)."""
        return Masks(fn(self.m1), None if self.m2 is None else fn(self.m2))


def joined_masks(masks, per_channel: bool) -> Masks | None:
    """FanInSum's and FanInConcat's masks: positions masked in every branch."""
    if masks[0] is None:
        return None

    def every(side):
        out = side[0]
        for m in side[1:]:
            out = out & m
        return out

    m2 = None if masks[0].m2 is None else every([m.m2 for m in masks])
    per_channel = per_channel or any(m.per_channel for m in masks)
    return Masks(every([m.m1 for m in masks]), m2, per_channel)


def _pairs(a, b, diagonal: bool):
    """a | b over pairs: a ``(N1, *S)``, b ``(N2, *S)`` (None: no batch pair, a is b) to the
    layout of nngp (``(N1, N2, H, H', ...)``) or of cov1 (``(N1, H, H', ...)``)."""
    s = a.ndim - 1
    if b is None:  # a sample with itself
        if diagonal:
            return a
        first = (slice(None),) + (slice(None), None) * s
        second = (slice(None),) + (None, slice(None)) * s
        return a[first] | a[second]
    if diagonal:
        return a[:, None] | b[None]
    first = (slice(None), None) + (slice(None), None) * s
    second = (None, slice(None)) + (None, slice(None)) * s
    return a[first] | b[second]


def remask(k: Kern) -> Kern:
    """Every covariance with a masked position on either side set to 0 (neural-tangents'
    ``Kernel.mask``): a masked position carries no signal through the network."""
    if k.masks is None:
        return k
    m1, m2 = k.masks.m1, k.masks.m2
    other = m1 if m2 is None else m2

    def zero(a, mask):
        return None if a is None else jnp.where(mask, jnp.zeros((), a.dtype), a)

    pair = _pairs(m1, other, k.diagonal)
    return k.replace(
        nngp=zero(k.nngp, pair),
        ntk=zero(k.ntk, pair),
        cov1=zero(k.cov1, _pairs(m1, None, k.diagonal)),
        cov2=None if k.cov2 is None else zero(k.cov2, _pairs(other, None, k.diagonal)),
    )


def refuse_channel_masks(k: Kern, name: str) -> None:
    """ValueError where channels with different masks (FanInConcat of branches) reach a
    layer that averages positions per channel (pools, LayerNorm), as neural-tangents:
    their kernel is not one covariance per position pair."""
    if k.masks is not None and k.masks.per_channel:
        what = f"with mask_constant, {name} after FanInConcat (each branch's channels keep "
        what += "their own masks)"
        fix = f"insert a Dense or Conv layer between FanInConcat and {name}"
        raise bad(ValueError, "kernel_fn", what, fix)


def masked_inputs(x, mask_constant):
    """(x with the entries equal to ``mask_constant`` set to 0, the masked positions
    ``(N, *S)``: all their channels equal ``mask_constant``); NaN matches NaN."""
    c = jnp.asarray(mask_constant, x.dtype)  # traced: one program for every constant
    hit = jnp.where(jnp.isnan(c), jnp.isnan(x), x == c)
    return jnp.where(hit, jnp.zeros((), x.dtype), x), jnp.all(hit, axis=-1)


def inputs_kernel(x1, x2, diagonal: bool, with_ntk: bool, mask_constant=None) -> Kern:
    """The input layer: Σ(x1_i, x2_j)[h, h'] = ⟨x1_i[h, :], x2_j[h', :]⟩ / C, Θ = 0.

    x1 ``(N1, *S, C)``, x2 ``(N2, *S, C)`` or None; ``diagonal``: keep h = h' only;
    ``mask_constant``: entries equal to it are 0, positions with all channels equal to it
    are masked (a scalar, NaN allowed, or None)."""
    masks = None
    if mask_constant is not None:
        x1, m1 = masked_inputs(x1, mask_constant)
        x2, m2 = (None, None) if x2 is None else masked_inputs(x2, mask_constant)
        masks = Masks(m1, m2)
    n_spatial = x1.ndim - 2
    channels = x1.shape[-1]

    def cross(a, b, batch_pair: bool):
        if diagonal:
            spec = "n...c,m...c->nm..." if batch_pair else "n...c,n...c->n..."
            return jnp.einsum(spec, a, b, precision="highest") / channels
        # zip the spatial axes: (n, [m,] h, h', w, w', ...)
        letters = "abcdefghijkl"[: 2 * n_spatial]
        sa, sb = letters[0::2], letters[1::2]
        out = "".join(p + q for p, q in zip(sa, sb, strict=True))
        spec = f"n{sa}z,m{sb}z->nm{out}" if batch_pair else f"n{sa}z,n{sb}z->n{out}"
        return jnp.einsum(spec, a, b, precision="highest") / channels

    other = x1 if x2 is None else x2
    nngp = cross(x1, other, True)
    cov1 = cross(x1, x1, False)
    return Kern(
        nngp=nngp,
        ntk=jnp.zeros_like(nngp) if with_ntk else None,
        cov1=cov1,
        cov2=None if x2 is None else cross(x2, x2, False),
        spatial=tuple(x1.shape[1:-1]),
        diagonal=diagonal,
        gaussian=True,
        channels=channels,
        is_input=True,
        masks=masks,
        inputs=(x1, x2),
    )


def variances(cov, diagonal: bool):
    """Each sample's variance per position, ``(N, H, W, ...)``, from its own covariance."""
    if diagonal:
        return cov
    v = cov
    for _ in range((cov.ndim - 1) // 2):  # each pair's diagonal goes last: (N, H, W, ...)
        v = jnp.diagonal(v, axis1=1, axis2=2)
    return v


def pair_variances(k: Kern, v1=None, v2=None):
    """(q11, q22) broadcastable against ``k.nngp`` (x1's variance at its positions, x2's
    at theirs) and the pairs (q11, q22) broadcastable against ``k.cov1`` and ``k.cov2``,
    from per-position variances ``v1`` (N1, H, W, ...) and ``v2`` (default: the kernel's)."""
    v1 = variances(k.cov1, k.diagonal) if v1 is None else v1
    if v2 is None:
        v2 = v1 if k.cov2 is None else variances(k.cov2, k.diagonal)
    s = len(k.spatial)
    if k.diagonal:
        return v1[:, None], v2[None], (v1, v1), (v2, v2)
    # full: x1's position on the first axis of each pair, x2's on the second
    first = (slice(None),) + (slice(None), None) * s
    second = (slice(None),) + (None, slice(None)) * s
    return v1[first][:, None], v2[second][None], (v1[first], v1[second]), (v2[first], v2[second])
