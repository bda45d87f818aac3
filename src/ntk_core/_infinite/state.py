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

import jax.numpy as jnp


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


def inputs_kernel(x1, x2, diagonal: bool, with_ntk: bool) -> Kern:
    """The input layer: Σ(x1_i, x2_j)[h, h'] = ⟨x1_i[h, :], x2_j[h', :]⟩ / C, Θ = 0.

    x1 ``(N1, *S, C)``, x2 ``(N2, *S, C)`` or None; ``diagonal``: keep h = h' only."""
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
