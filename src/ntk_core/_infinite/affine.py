"""Dense and Conv layers: Σ' = σw²·A(Σ) + σb², and the NTK of both parameterisations.

A(Σ) is the identity for Dense (each position with the same weights) and the mean over a
convolution's filter offsets for Conv (:mod:`.windows`). NTK parameterisation
(z = σw/√fan_in·W·x + σb·b, W, b ~ N(0, 1); Jacot et al. 2018):

    Θ' = Σ' + σw²·A(Θ)

standard parameterisation (W ~ N(0, σw²/fan_in), b ~ N(0, σb²); Sohl-Dickstein et al.
2020, arXiv 2001.07301), whose NTK grows with the finite network's widths, as the
empirical NTK of a Flax or Haiku model does (neural-tangents' semantics, fan_in = C/s₀
times the filter size):

    Θ' = fan_in·A(Σ) + σw²·A(Θ) + 1 (with a bias)
"""

from __future__ import annotations

import math

from ntk_core._infinite import windows
from ntk_core._infinite.state import Kern


def _affine(a, w2: float, b2: float | None):
    return w2 * a + (0.0 if b2 is None else b2)


def transform(k: Kern, spread, fan_in: float, out_channels: int, layer) -> Kern:
    """Kern after an affine layer whose spatial map is ``spread(array, n_batch)`` (A above);
    ``layer`` holds W_std, b_std, parameterization, s."""
    w2 = layer.W_std**2
    b2 = None if layer.b_std is None else layer.b_std**2
    spread_nngp = spread(k.nngp, 2)
    nngp = _affine(spread_nngp, w2, b2)
    ntk = None
    if k.ntk is not None:
        if layer.parameterization == "ntk":
            ntk = nngp + w2 * spread(k.ntk, 2)
        else:
            ntk = fan_in * spread_nngp + w2 * spread(k.ntk, 2) + (0.0 if b2 is None else 1.0)
    return k.replace(
        nngp=nngp,
        ntk=ntk,
        cov1=_affine(spread(k.cov1, 1), w2, b2),
        cov2=None if k.cov2 is None else _affine(spread(k.cov2, 1), w2, b2),
        gaussian=True,
        channels=out_channels,
        is_input=False,
    )


def dense(k: Kern, layer) -> Kern:
    fan_in = k.channels / layer.s[0]
    return transform(k, lambda a, _: a, fan_in, layer.out_dim * layer.s[1], layer)


def conv(k: Kern, layer) -> Kern:
    """Conv over ``layer.filter_shape`` with ``layer.strides`` and ``layer.padding``."""
    s = len(k.spatial)
    fan_in = k.channels / layer.s[0] * math.prod(layer.filter_shape)
    sizes = []
    for size, window, stride in zip(k.spatial, layer.filter_shape, layer.strides, strict=True):
        sizes.append(windows.out_size(size, window, stride, layer.padding))

    method = "slices" if k.diagonal else windows.pair_method()

    def spread(a, n_batch):
        for d in range(s):
            size, window, stride = k.spatial[d], layer.filter_shape[d], layer.strides[d]
            axes = (n_batch + d,) if k.diagonal else (n_batch + 2 * d, n_batch + 2 * d + 1)
            a = windows.shared_offsets(a, axes, size, window, stride, layer.padding, method)
            a = a / window
        return a

    out = transform(k, spread, fan_in, layer.out_chan * layer.s[1], layer)
    return out.replace(spatial=tuple(sizes), reversed=k.reversed if k.diagonal else not k.reversed)
