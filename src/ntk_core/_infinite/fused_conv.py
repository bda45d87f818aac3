"""Convolutional networks with all pairs of positions on a TPU, many layers in one Pallas
kernel per pair of samples: a whole CNN-GAP from its inputs (:func:`network`: Conv,
[ReLU-family, Conv] x n, ReLU-family, GlobalAvgPool or GlobalSumPool; Novak et al. 2019,
Arora et al. 2019), or a repeated [ReLU-family, Conv] block between other layers
(:func:`plan`, :func:`run`). Convs 2-D, SAME, stride 1.

The maths is :mod:`.closed_forms`' ``ab_relu`` and :mod:`.affine`'s ``conv``, unchanged.
Per step, with S the convolution's window sum along each spatial pair's diagonal
(Σ(h + δ, h' + δ), zero outside the image for SAME):

    Σ̃ = Σ'(Σ),  Θ̃ = Σ̇(Σ)·Θ,  then  Σ ← α·S(Σ̃) + β,  Θ ← γ·S(Σ̃) + α·S(Θ̃) + δ

(α = σw²/|k|, β = σb²; γ = α, δ = β in the NTK parameterisation, γ = fan-in/|k|, δ = 1
with a bias in the standard one). What changes is where the values live. With all pairs
of positions a pair of 32 x 32 images holds 32⁴ = 1M values per kernel, and XLA runs each
window sum as its own passes over the chip's memory, in (..., W, W') tiles padded 4x
(11.3 ms per NTK entry for neural-tangents' 21-layer CNN with a GlobalAvgPool readout on
a TPU v5e, benchmarks/README.md). Here a pair's NNGP and NTK stay in the TPU's VMEM (4 MiB
each) through all the steps; a whole network reads each sample's pixels and writes two
numbers per pair (0.33 ms per entry).

A pair's array is laid out (H, H', W·W'): H a major axis (a shift is another slab), H' the
sublanes (a shift is a rotation), W·W' the lanes, where the offset δ shared by both W
positions is a rotation by δ·(W + 1). Positions whose partner falls outside the image are
masked, so no rotation wraps a wrong value in. A Gram matrix (x2 = None) runs the pairs
i <= j only: pair (j, i) is pair (i, j) with each spatial pair's two axes swapped.

Each sample's variance per position and step (what the closed form needs of x1 and x2) is
computed beforehand on the spatial diagonal, where the recursion involves no other
positions. A sample with itself at one position has ρ = 1 exactly, as in
:mod:`.layers`' nonlinearities. Anything the kernel does not handle (another backend,
masks, strides, VALID padding, float64, a Gram tile, arrays too large for VMEM) takes the
layers' XLA path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ntk_core._infinite import closed_forms, windows

# the layers whose closed form is ab_relu(a, b): their rule's key -> (a, b)
_AB = {
    "Relu": lambda key: (0.0, 1.0),
    "ABRelu": lambda key: (key[1], key[2]),
    "LeakyRelu": lambda key: (key[1], 1.0),
    "Abs": lambda key: (-1.0, 1.0),
}
# switches for tests and benchmarks, read when a network is traced: a kernel function
# already compiled for a shape keeps its program whatever the switches say later
_interpreted: list[bool] = []
_off: list[bool] = []
_layers_only: list[bool] = []


@contextlib.contextmanager
def interpreted():
    """Inside the block, run the kernel in Pallas' interpreter on any backend (tests)."""
    _interpreted.append(True)
    try:
        yield
    finally:
        _interpreted.pop()


@contextlib.contextmanager
def layers_only():
    """Inside the block, no whole network in one kernel: repeated blocks alone (tests)."""
    _layers_only.append(True)
    try:
        yield
    finally:
        _layers_only.pop()


@contextlib.contextmanager
def off():
    """Inside the block, trace repeated blocks as a scan (benchmarks compare the two)."""
    _off.append(True)
    try:
        yield
    finally:
        _off.pop()


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one call computes. ``ab``: the repeated nonlinearity's (a, b); the Conv's
    filter, offsets before each position (SAME) and per-step coefficients α, β, (γ, δ) of
    the first step and of the others. In a whole network (:func:`network`): ``lead``, the
    first Conv's (α, β, γ, δ), applied to the inputs' kernel computed in the kernel;
    ``final``, the last nonlinearity's (a, b); ``pool``, the factor of the sum over all
    pairs of positions (1/(H·W)² for a GlobalAvgPool, 1 for a GlobalSumPool)."""

    ab: tuple[float, float]
    window: tuple[int, int]
    before: tuple[int, int]
    alpha: float
    beta: float
    first: tuple[float, float]
    rest: tuple[float, float]
    channels: int
    vmem_limit: int
    lead: tuple | None = None
    final: tuple[float, float] | None = None
    pool: float | None = None


def _conv(key, kern):
    """(window, before, α, β, (γ, δ) of the first step, (γ, δ) after, out channels) of a
    Conv key the kernel runs (2-D, SAME, stride 1) on ``kern``'s positions, else None
    (also for a state that is not one 2-D Kern: the layers' own checks then raise)."""
    if key is None or key[0] != "Conv" or isinstance(kern, tuple):
        return None
    _, out_chan, window, strides, padding, w_std, b_std, parameterization, s = key
    if len(window) != 2 or len(kern.spatial) != 2 or set(strides) != {1} or padding != "SAME":
        return None
    k = window[0] * window[1]
    alpha, beta = w_std**2 / k, (0.0 if b_std is None else b_std**2)
    if parameterization == "ntk":
        first = rest = (alpha, beta)
    else:
        bias = 0.0 if b_std is None else 1.0
        first = (kern.channels / s[0], bias)  # fan-in / |k|
        rest = (out_chan * s[1] / s[0], bias)
    sizes = zip(kern.spatial, window, strict=True)
    before = tuple(windows.pads(hw, f, 1, "SAME")[0] for hw, f in sizes)
    return tuple(window), before, alpha, beta, first, rest, out_chan * s[1]


def _enabled() -> bool:
    """Whether anything may run fused: on a TPU (or interpreted), not switched off."""
    return not _off and (bool(_interpreted) or jax.default_backend() == "tpu")


def _state_ok(kern, need: int) -> int | None:
    """The VMEM limit for a call needing ``need`` bytes on ``kern``'s positions, or None
    where the kernel does not run: the spatial diagonal, masks, a Gram tile, not 2-D, not
    float32, not whole tiles, or too large for VMEM."""
    if (
        isinstance(kern, tuple)  # branches
        or kern.diagonal
        or kern.masks is not None
        or kern.offset is not None
        or len(kern.spatial) != 2
        or kern.nngp.dtype != jnp.float32
    ):
        return None
    h, w = kern.spatial
    if (h % 8 or (w * w) % 128) and not _interpreted:  # whole sublane and lane tiles
        return None
    capacity = 64 << 20 if _interpreted else _vmem_capacity()
    if need > 0.8 * capacity:
        return None
    return int(min(need + (8 << 20), 0.9 * capacity))


def _need(kern, window, n: int, in_out: int, state: int) -> int:
    """VMEM bytes: ``in_out`` double-buffered pair arrays, ``state`` single ones, the
    padded scratches, both samples' √variances of n steps (double-buffered), the masks."""
    h, w = kern.spatial
    slab = 4 * h * w * w
    arrays = 2 if kern.ntk is not None else 1
    need = (2 * in_out + state) * h * slab + arrays * (h + window[0] - 1) * slab
    return need + 4 * n * slab + 2 * (window[0] + window[1] + 1) * slab + 6 * slab


def plan(keys, n: int, kern) -> Plan | None:
    """A :class:`Plan` when ``keys`` (the rules' keys of a block repeated ``n`` times) are
    [ab_relu family, Conv(2-D, SAME, stride 1)] and ``kern`` is a Gaussian state this
    kernel handles; else None."""
    if not _enabled() or n < 1 or len(keys) != 2 or keys[0] is None or keys[0][0] not in _AB:
        return None
    conv = _conv(keys[1], kern)
    if conv is None or not kern.gaussian:
        return None
    arrays = 2 if kern.ntk is not None else 1
    limit = _state_ok(kern, _need(kern, conv[0], n, 2 * arrays, 0))
    if limit is None:
        return None
    return Plan(_AB[keys[0][0]](keys[0]), *conv[:-1], conv[-1], limit)


def _atoms(rule):
    """The keys of the layers ``rule`` chains (a repeat's block n times), or None."""
    if rule.repeats is not None:
        parts, n = rule.repeats
        inner = [_atoms(r) for r in parts]
        return None if None in inner else [a for part in inner for a in part] * n
    if rule.key is None:
        return None
    if rule.key[0] == "serial":
        inner = [_atoms(r) for r in rule.parts]
        return None if None in inner else [a for part in inner for a in part]
    return [rule.key]


def network(rules, kern):
    """(the state after them, how many of ``rules`` that is) when ``rules`` start with
    Conv, [nonlinearity, Conv] x n (one block repeated), nonlinearity, GlobalAvgPool or
    GlobalSumPool on the inputs' kernel (the CNN-GAP of Novak et al. 2019 and Arora et
    al. 2019): the whole chain in one kernel per pair of samples, from x; else None."""
    if not _enabled() or _layers_only or isinstance(kern, tuple) or not kern.is_input:
        return None
    if kern.inputs is None:
        return None
    keys, ends = [], []
    for rule in rules:
        atoms = _atoms(rule)
        if atoms is None:
            break
        keys += atoms
        ends.append(len(keys))
    lead = _conv(keys[0], kern) if keys else None
    if lead is None:
        return None
    i, block = 1, None
    while i + 1 < len(keys) and keys[i][0] in _AB and keys[i + 1][0] == "Conv":
        if block not in (None, (keys[i], keys[i + 1])):
            break
        block, i = (keys[i], keys[i + 1]), i + 2
    n = (i - 1) // 2
    if i + 1 >= len(keys) or keys[i][0] not in _AB or i + 2 not in ends:
        return None
    if keys[i + 1][0] not in ("GlobalAvgPool", "GlobalSumPool"):
        return None
    inner = kern.replace(channels=lead[-1], gaussian=True)
    conv = _conv(block[1], inner) if block else lead
    if conv is None or conv[:2] != lead[:2]:  # one filter shape: one set of masks
        return None
    limit = _state_ok(kern, _need(kern, lead[0], n + 1, 0, 2 if kern.ntk is not None else 1))
    if limit is None:
        return None
    h, w = kern.spatial
    ab = _AB[block[0][0]](block[0]) if block else (0.0, 1.0)
    p = Plan(
        ab, *conv[:-1], conv[-1], limit, lead=(lead[2], lead[3], *lead[4]),
        final=_AB[keys[i][0]](keys[i]),
        pool=1 / (h * h * w * w) if keys[i + 1][0] == "GlobalAvgPool" else 1.0,
    )  # fmt: skip
    return _run_network(p, n, kern), ends.index(i + 2) + 1


def _vmem_capacity() -> int:
    """This TPU's VMEM bytes; 0 (nothing runs fused) where this JAX's Pallas lacks what
    the kernel uses (jax >= 0.4.35 is allowed; written and measured with 0.10.2)."""
    try:
        from jax.experimental.pallas import tpu as pltpu
    except ImportError:
        return 0
    if not all(hasattr(pltpu, a) for a in ("CompilerParams", "PrefetchScalarGridSpec", "roll")):
        return 0
    try:
        return int(pltpu.get_tpu_info().vmem_capacity_bytes)
    except Exception:  # noqa: BLE001 - an unknown chip: the smallest VMEM of a current TPU
        return 16 << 20


def _pairs(n1: int, n2: int | None):
    """(i, j, same) per pair the kernel runs: a Gram matrix's pairs i <= j; else every
    (i, N1 + j), then each sample of x1 and of x2 with itself (their own covariances).
    ``same``: 1 for a sample with itself; :func:`_same` adds pairs of equal inputs."""
    if n2 is None:
        i, j = np.triu_indices(n1)
        return i, j, (i == j).astype(np.int32)
    i = np.concatenate([np.repeat(np.arange(n1), n2), np.arange(n1), n1 + np.arange(n2)])
    j = np.concatenate([n1 + np.tile(np.arange(n2), n1), np.arange(n1), n1 + np.arange(n2)])
    return i, j, (np.arange(len(i)) >= n1 * n2).astype(np.int32)


def _gram_index(i, j, n1: int):
    """(N1, N1): each entry's row among the pairs i <= j; (j, i) reads pair (i, j)."""
    upper = np.zeros((n1, n1), np.int64)
    upper[i, j] = np.arange(len(i))
    return np.maximum(upper, upper.T)


def _same(same, equal):
    """The pairs whose positions meet themselves at ρ = 1 exactly: a sample with itself,
    and pairs of bit-for-bit equal inputs (``equal``, traced: x2 = x1 passed again, a
    sample repeated in a Gram matrix). XLA's layers get ρ = 1 for those because both
    sides are the same operations on the same bits; here each side's variances come from
    the diagonal recursion, so ρ would be an ulp or two off 1 and the NTK's derivative
    term (π − θ)/2π, with its square-root singularity there, 1e-4 off (measured)."""
    return jnp.maximum(jnp.asarray(same, jnp.int32), equal.astype(jnp.int32))


def _equal(a, b):
    """Per leading index, whether ``a`` and ``b`` hold the same bits (NaN: not)."""
    return jnp.all(a == b, axis=tuple(range(1, a.ndim)))


def run(p: Plan, n: int, kern, name: str):
    """``kern`` (a :class:`.state.Kern`) after ``n`` steps of the block ``p`` describes."""
    h, w = kern.spatial
    gram = kern.cov2 is None
    n1, n2 = kern.nngp.shape[:2]
    own = jnp.concatenate([_variances(kern.cov1)] + ([] if gram else [_variances(kern.cov2)]))
    scales = _scales(p, n, own, kern.spatial)  # (samples, n, H, W·W) x 2
    flat = (h, h, w * w)
    i, j, same = _pairs(n1, None if gram else n2)
    # a pair of equal inputs: its positions with themselves hold both sides' variances
    meets = _variances(kern.nngp.reshape(n1 * n2, *kern.nngp.shape[2:]))  # (N1·N2, H, W)
    pair = np.where(np.arange(len(i)) < n1 * n2, i * n2 + j - (0 if gram else n1), 0)
    same = _same(same, _equal(meets[pair], own[i]) & _equal(own[i], own[j]))
    if gram:
        src = i * n1 + j
        ntk_src = src
        states = kern.nngp.reshape(n1 * n1, *flat)
    else:
        src = np.arange(len(i))
        ntk_src = np.where(src < n1 * n2, src, 0)  # the own covariances have no NTK
        states = jnp.concatenate(
            [kern.nngp.reshape(n1 * n2, *flat), kern.cov1.reshape(n1, *flat),
             kern.cov2.reshape(n2, *flat)]
        )  # fmt: skip
    ntk = None if kern.ntk is None else kern.ntk.reshape(n1 * n2, *flat)
    index = [jnp.asarray(v, jnp.int32) for v in (src, ntk_src, i, j)] + [same]
    sources = [states] + ([] if ntk is None else [ntk])
    nngp, ntk = _call(p, n, kern.spatial, index, sources, scales, kern.ntk is not None)
    shape = (h, h, w, w)
    if gram:
        upper = _gram_index(i, j, n1)
        below = jnp.asarray(np.tril(np.ones((n1, n1), bool), -1))[:, :, None, None, None, None]

        def full(a):
            a = jnp.take(a, jnp.asarray(upper.ravel()), axis=0).reshape(n1, n1, *shape)
            return jnp.where(below, jnp.transpose(a, (0, 1, 3, 2, 5, 4)), a)

        cov1 = jnp.take(nngp, jnp.asarray(upper[np.arange(n1), np.arange(n1)]), axis=0)
        out = dict(nngp=full(nngp), ntk=None if ntk is None else full(ntk))
        out.update(cov1=cov1.reshape(n1, *shape), cov2=None)
    else:
        out = dict(
            nngp=nngp[: n1 * n2].reshape(n1, n2, *shape),
            ntk=None if ntk is None else ntk[: n1 * n2].reshape(n1, n2, *shape),
            cov1=nngp[n1 * n2 : n1 * n2 + n1].reshape(n1, *shape),
            cov2=nngp[n1 * n2 + n1 :].reshape(n2, *shape),
        )
    flips = n % 2 == 1  # each convolution flips neural-tangents' output axis order
    return kern.replace(
        **out, gaussian=True, channels=p.channels, is_input=False,
        reversed=kern.reversed != flips, source=name,
    )  # fmt: skip


def _run_network(p: Plan, n: int, kern):
    """The state after the pool of :func:`network`'s chain, from the inputs x."""
    x1, x2 = kern.inputs
    h, w = kern.spatial
    n1 = x1.shape[0]
    x = x1 if x2 is None else jnp.concatenate([x1, x2])
    c = x.shape[-1]
    v = jnp.mean(x * x, axis=-1)  # each sample's variance per position: (samples, H, W)
    v = p.lead[0] * _window_sum(v, p, kern.spatial) + p.lead[1]
    scales = _scales(p, n + 1, v, kern.spatial)  # before each nonlinearity, the last's too
    # x1's channel c at (h, w) along the lanes (w, w') and x2's at (h', w'), / C once
    xt = jnp.moveaxis(x, -1, 1)  # (samples, C, H, W)
    inputs = (jnp.repeat(xt, w, axis=-1) / c, jnp.tile(xt, (1, 1, 1, w)))
    i, j, same = _pairs(n1, None if x2 is None else x2.shape[0])
    same = _same(same, _equal(x[i], x[j]))
    index = [jnp.asarray(v, jnp.int32) for v in (i, j, i, j)] + [same]
    nngp, ntk = _call(p, n, kern.spatial, index, inputs, scales, kern.ntk is not None)
    nngp, ntk = nngp[:, 0, 0], (None if ntk is None else ntk[:, 0, 0])
    if x2 is None:
        upper = jnp.asarray(_gram_index(i, j, n1))
        out = dict(nngp=nngp[upper], ntk=None if ntk is None else ntk[upper])
        out.update(cov1=nngp[jnp.diagonal(upper)], cov2=None)
    else:
        m = n1 * x2.shape[0]
        out = dict(
            nngp=nngp[:m].reshape(n1, -1), ntk=None if ntk is None else ntk[:m].reshape(n1, -1),
            cov1=nngp[m : m + n1], cov2=nngp[m + n1 :],
        )  # fmt: skip
    return kern.replace(
        **out, spatial=(), reversed=False, gaussian=False, channels=p.channels,
        is_input=False, inputs=None, source="GlobalAvgPool()" if p.pool < 1 else "GlobalSumPool()",
    )  # fmt: skip


def _variances(cov):
    """Each sample's variance per position (N, H, W) from its (N, H, H', W, W') covariance."""
    return jnp.diagonal(jnp.diagonal(cov, axis1=1, axis2=2), axis1=1, axis2=2)


def _window_sum(v, p: Plan, spatial):
    """The Conv's window sum on each sample's own positions (samples, H, W)."""
    for axis, (size, window) in enumerate(zip(spatial, p.window, strict=True)):
        v = windows.shared_offsets(v, (axis + 1,), size, window, 1, "SAME")
    return v


def _scales(p: Plan, n: int, v, spatial):
    """Each sample's √variance per step before its nonlinearity, laid out for the kernel:
    (samples, n, H, W·W) indexed by (h, w) (x1's side) and by (h', w') (x2's side)."""
    forms = closed_forms.ab_relu(*p.ab)
    steps = []
    for _ in range(n):
        steps.append(v)
        v = p.alpha * _window_sum(forms(v, v, v)[0], p, spatial) + p.beta
    s = jnp.sqrt(jnp.stack(steps, 1))  # (samples, n, H, W)
    w = spatial[1]
    return jnp.repeat(s, w, axis=-1), jnp.tile(s, (1, 1, 1, w))


def _masks(p: Plan, spatial):
    """Float masks: for each H offset, rows whose partner h' + d is inside (H, W·W); for
    each W offset, lanes whose w + e and w' + e are both inside; lanes with w = w'."""
    h, w = spatial
    hh = np.arange(h)[:, None] + np.zeros((1, w * w), int)
    rows = [((hh + d >= 0) & (hh + d < h)) for d in _offsets(p, 0)]
    ww, ww2 = np.divmod(np.arange(w * w), w)
    lanes = [
        np.broadcast_to((ww + e >= 0) & (ww + e < w) & (ww2 + e >= 0) & (ww2 + e < w), (h, w * w))
        for e in _offsets(p, 1)
    ]
    diagonal = np.broadcast_to(ww == ww2, (h, w * w))
    return [jnp.asarray(np.asarray(m, np.float32)) for m in (rows, lanes, diagonal)]


def _offsets(p: Plan, d: int):
    return [k - p.before[d] for k in range(p.window[d])]


def _call(p: Plan, n: int, spatial, index, sources, scales, has_ntk: bool):
    """The Pallas call: per pair, the state from ``sources`` (each pair's NNGP and NTK
    blocks, or in a whole network each sample's channels laid out by :func:`_run_network`),
    ``n`` steps, and (a network) the last nonlinearity summed over positions."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    h, w = spatial
    ww = w * w
    pairs = index[0].shape[0]
    arrays = 2 if has_ntk else 1
    whole_net = p.lead is not None
    rows, lanes, diagonal = _masks(p, spatial)
    kernel = functools.partial(_kernel, p=p, n=n, h=h, w=w, has_ntk=has_ntk)

    def by(ref, block):  # one sample's or pair's block, chosen by the prefetched ``ref``
        return pl.BlockSpec((None, *block), lambda q, *refs: (refs[ref][q],) + (0,) * len(block))

    def whole(a):
        return pl.BlockSpec(a.shape, lambda q, *refs, r=a.ndim: (0,) * r)

    if whole_net:  # each sample's channels, x1's side and x2's
        c = sources[0].shape[1]
        in_specs = [by(0, (c, h, ww)), by(1, (c, h, ww))]
        out_block = pl.BlockSpec((None, 8, 128), lambda q, *refs: (q, 0, 0))
        out_shape = jax.ShapeDtypeStruct((pairs, 8, 128), jnp.float32)
        state = [pltpu.VMEM((h, h, ww), jnp.float32)] * arrays
    else:
        in_specs = [by(0, (h, h, ww))] + ([by(1, (h, h, ww))] if has_ntk else [])
        out_block = pl.BlockSpec((None, h, h, ww), lambda q, *refs: (q, 0, 0, 0))
        out_shape = jax.ShapeDtypeStruct((pairs, h, h, ww), jnp.float32)
        state = []
    steps = scales[0].shape[1]
    in_specs += [by(2, (steps, h, ww)), by(3, (steps, h, ww))]
    in_specs += [whole(rows), whole(lanes), whole(diagonal)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(index),
        grid=(pairs,),
        in_specs=in_specs,
        out_specs=[out_block] * arrays,
        scratch_shapes=state
        + [pltpu.VMEM((h + p.window[0] - 1, h, ww), jnp.float32)] * arrays
        + [pltpu.VMEM((h, ww), jnp.float32)] * (arrays + 2),
    )
    call = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[out_shape] * arrays,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=p.vmem_limit
        ),
        interpret=bool(_interpreted),
    )
    out = call(*index, *sources, *scales, rows, lanes, diagonal)
    return out[0], (out[1] if has_ntk else None)


def _kernel(*refs, p: Plan, n: int, h: int, w: int, has_ntk: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    arrays = 2 if has_ntk else 1
    whole_net = p.lead is not None
    same_ref = refs[4]
    refs = list(refs[5:])
    sources = [refs.pop(0) for _ in range(2 if whole_net else arrays)]
    s1_ref, s2_ref, rows_ref, lanes_ref, diag_ref = (refs.pop(0) for _ in range(5))
    outs = [refs.pop(0) for _ in range(arrays)]
    states = [refs.pop(0) for _ in range(arrays)] if whole_net else outs
    nngp_ref, ntk_ref = states[0], (states[1] if has_ntk else None)
    t_refs = [refs.pop(0) for _ in range(arrays)]
    u_refs = [refs.pop(0) for _ in range(arrays)]
    r2_ref, own_ref = refs
    ww = w * w
    pad = p.before[0]  # t_refs hold slab s at s + pad, zero slabs around: no mask for h + δ
    # rows of H' per piece: a piece's temporaries fit in the vector registers (whole slabs,
    # and the window sums without the scratch u, measured the same: 93 ms, 2026-12-07)
    chunk = min(8, h)
    # 1 where a sample meets itself at one position, else -1 (ρ >= -1 already)
    own_ref[...] = 2 * diag_ref[...] * jnp.where(same_ref[pl.program_id(0)] == 1, 1.0, 0.0) - 1
    for t_ref in t_refs:
        for s in [*range(pad), *range(pad + h, h + p.window[0] - 1)]:
            t_ref[s] = jnp.zeros((h, ww), jnp.float32)
    rows = lax.broadcasted_iota(jnp.int32, (h, ww), 0)

    def row(ref, a):  # row a of a (H, W·W) block, (1, W·W)
        return jnp.sum(jnp.where(rows == a, ref, 0), axis=0, keepdims=True)

    def load(a, c):  # slab by slab: one statement over 4 MiB would unroll 1 024 vregs
        if whole_net:  # the inputs' kernel Σ_c x1[h, w, c]·x2[h', w', c] / C
            x1, x2 = sources
            k0 = None
            for ch in range(x1.shape[0]):
                term = row(x1[ch], a) * x2[ch]
                k0 = term if k0 is None else k0 + term
            t_refs[0][a + pad] = k0
            if has_ntk:
                t_refs[1][a + pad] = jnp.zeros((h, ww), jnp.float32)
        else:
            for state, source in zip(states, sources, strict=True):
                state[a] = source[a]
        return c

    lax.fori_loop(0, h, load, 0)

    def nonlinearity(layer, ab, into):
        """Σ̃ and Θ̃ of step ``layer``'s state: into the scratch, or summed (a readout)."""
        a_, b_ = ab
        both, spread = a_ * b_, (b_ - a_) ** 2
        s2 = s2_ref[layer]  # (H', W·W): x2's √variance at (h', w')
        r2_ref[...] = jnp.where(s2 > 0, 1 / jnp.where(s2 > 0, s2, 1), 0)

        def one(a, sums):
            s1 = row(s1_ref[layer], a)  # x1's √variance at (a, w), the same for every h'
            r1 = jnp.where(s1 > 0, 1 / jnp.where(s1 > 0, s1, 1), 0)
            sums = list(sums)
            for start in range(0, h, chunk):
                part = pl.ds(start, min(chunk, h - start))
                q12 = nngp_ref[a, part]
                scale = r1 * r2_ref[part]
                rho = jnp.clip(q12 * scale, -1, 1)
                # a sample with itself at one position: ρ = 1 exactly; where a variance
                # is 0, ρ = 0 (closed_forms' convention, an all-zero sample's too)
                piece = lax.broadcasted_iota(jnp.int32, rho.shape, 0)
                rho = jnp.maximum(rho, jnp.where(piece == a - start, own_ref[part], -1.0))
                rho = jnp.where(scale > 0, rho, 0.0)
                theta = closed_forms.arccos(rho)
                sin = jnp.sqrt(jnp.maximum(1 - rho * rho, 0))
                angle = math.pi - theta
                t = (s1 * s2_ref[layer, part]) * (sin + angle * rho) * (spread / (2 * math.pi))
                out = [t + both * q12 if both else t]
                if has_ntk:
                    dot = angle * ((a_ * a_ + b_ * b_) / (2 * math.pi))
                    dot = dot + theta * (both / math.pi) if both else dot
                    out.append(dot * ntk_ref[a, part])
                for k, value in enumerate(out):
                    if into is None:
                        t_refs[k][a + pad, part] = value
                    else:
                        sums[k] = sums[k] + jnp.sum(value, axis=0, keepdims=True)
            return tuple(sums)

        start = tuple(jnp.zeros((1, ww), jnp.float32) for _ in range(arrays))
        return lax.fori_loop(0, h, one, start)

    def over_h(t_ref, a, lanes):  # Σ_δ t[h + δ, h' + δ] on the lanes ``lanes``
        acc = None
        for k, d in enumerate(_offsets(p, 0)):
            x = t_ref[a + k, :, lanes]  # slab h + δ (zero outside)
            if d:  # x[h' + δ]: rotate the sublanes up by δ, mask what wrapped
                x = pltpu.roll(x, (-d) % h, 0) * rows_ref[k, :, lanes]
            acc = x if acc is None else acc + x
        return acc

    def over_w(x, part):  # Σ_ε x[w + ε, w' + ε]: lanes rotated by ε·(W + 1)
        total = None
        for k, e in enumerate(_offsets(p, 1)):
            y = pltpu.roll(x, (-e * (w + 1)) % ww, 1) * lanes_ref[k, part] if e else x
            total = y if total is None else total + y
        return total

    def window_step(alpha, beta, gamma, delta):
        def write(a, part, sums):
            nngp_ref[a, part] = alpha * sums[0] + beta
            if has_ntk:
                ntk_ref[a, part] = gamma * sums[0] + alpha * sums[1] + delta

        def window_sum(a, c):  # along H on lane pieces, then along W on row pieces
            for t_ref, u_ref in zip(t_refs, u_refs, strict=True):
                for start in range(0, ww, 512):
                    lanes = pl.ds(start, min(512, ww - start))
                    u_ref[:, lanes] = over_h(t_ref, a, lanes)
            for start in range(0, h, 8):
                part = pl.ds(start, min(8, h - start))
                write(a, part, [over_w(u_ref[part], part) for u_ref in u_refs])
            return c

        lax.fori_loop(0, h, window_sum, 0)

    if whole_net:
        window_step(*p.lead)

    def step(layer, carry):
        nonlinearity(layer, p.ab, None)
        gamma = jnp.where(layer == 0, p.first[0], p.rest[0])
        delta = jnp.where(layer == 0, p.first[1], p.rest[1])
        window_step(p.alpha, p.beta, gamma, delta)
        return carry

    lax.fori_loop(0, n, step, 0)
    if whole_net:  # the last nonlinearity, pooled over every pair of positions
        sums = nonlinearity(n, p.final, True)
        for out, total in zip(outs, sums, strict=True):
            out[...] = jnp.broadcast_to(p.pool * jnp.sum(total, axis=1, keepdims=True), (8, 128))
