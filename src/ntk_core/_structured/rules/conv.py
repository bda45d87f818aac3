"""Ungrouped convolutions ``y = conv_general_dilated(x, view(W))`` on the kernel: ``c`` =
(input channel, window offset), ``a`` the output positions, ``k`` the output channels;
the patches ``x[a, c]`` come from padding and strided slices. A fused bias is a row of ones.
The features evaluate a convolution with few output positions (and on a TPU one with few
input channels) as its patches times the kernel matrix (:data:`MATMUL_MAX_POSITIONS`,
:data:`TPU_MATMUL_MAX_CONTRACTION`), others with a canonical kernel transpose."""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import primitives as prims

from ntk_core._blocked.barrier import barrier
from ntk_core._jax.batches import map_in_batches
from ntk_core._jax.jaxpr_walk import bind
from ntk_core._structured.rules._base import Rule, broadcast_reason, broadcasts, scaled

#: Patch values formed at once for per-sample Jacobians (a few MiB: stays in cache).
PATCH_CHUNK_VALUES = 2**19


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    lhs_spec: tuple[int, ...]
    window: tuple[int, ...]  # the kernel's spatial sizes, in rhs_spec order
    strides: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    out_spatial: tuple[int, ...]


def patches(x, geometry: ConvGeometry):
    """Patches ``(C_in·W, A)`` of one sample's input: ``y[a, k] = Σ_c p[c, a] W'[c, k]``
    with ``W'`` the kernel as ``(C_in, *window, K)``."""
    g, spec = geometry, geometry.lhs_spec
    x = jnp.transpose(x, (spec[1], spec[0]) + tuple(spec[2:]))  # (C_in, B, *spatial)
    zero = jnp.zeros((), x.dtype)
    config = [(0, 0, 0), (0, 0, 0)] + [
        (lo, hi, d - 1) for (lo, hi), d in zip(g.padding, g.lhs_dilation, strict=True)
    ]
    x = lax.pad(x, zero, config)
    slices = []
    for offset in itertools.product(*(range(w) for w in g.window)):
        start = [0, 0] + [o * d for o, d in zip(offset, g.rhs_dilation, strict=True)]
        limit = list(x.shape[:2]) + [
            s + (n - 1) * st + 1
            for s, n, st in zip(start[2:], g.out_spatial, g.strides, strict=True)
        ]
        slices.append(lax.slice(x, start, limit, (1, 1) + tuple(g.strides)))
    p = jnp.stack(slices, axis=1)  # (C_in, W, B, *out_spatial)
    return p.reshape((p.shape[0] * p.shape[1], math.prod(p.shape[2:])))  # C_in may be 0


def _groups(eqn) -> tuple[int, int]:
    return eqn.params["feature_group_count"], eqn.params["batch_group_count"]


def _geometry(
    w_shape, y_shape, *, dimension_numbers, window_strides, padding, lhs_dilation, rhs_dilation, **_
):
    """``(ConvGeometry, rhs_spec, out_spec)`` of a convolution's parameters."""
    lhs_spec, rhs_spec, out_spec = (tuple(spec) for spec in dimension_numbers)
    window = tuple(w_shape[d] for d in rhs_spec[2:])
    out_spatial = tuple(y_shape[d] for d in out_spec[2:])
    pads = tuple(tuple(int(v) for v in pad) for pad in padding)
    dilations = (tuple(d or (1,) * len(window)) for d in (lhs_dilation, rhs_dilation))
    geometry = ConvGeometry(lhs_spec, window, tuple(window_strides), pads, *dilations, out_spatial)
    return geometry, rhs_spec, out_spec


class ConvRule(Rule):
    """``conv_general_dilated`` on its kernel: patches ``(N, C, A)``."""

    primitives = frozenset({prims.conv_general_dilated_p})
    kind_names = {"conv": "convolution"}
    takes_bias = True
    scales_input = True

    def input_flops(self, a, c):
        return float(a * c)

    def match(self, eqn, ins, here, leaf_shapes):
        if ins[0] is not None or ins[1] is None or _groups(eqn) != (1, 1):
            return None  # only the kernel operand is a parameter, in an ungrouped convolution
        chain, factor = scaled(ins[1].chain)
        if broadcasts(chain):
            return None
        y = eqn.outvars[0]
        w_shape, y_shape = tuple(eqn.invars[1].aval.shape), tuple(y.aval.shape)
        geometry, rhs_spec, out_spec = _geometry(w_shape, y_shape, **eqn.params)
        y_perm = (out_spec[0],) + tuple(out_spec[2:]) + (out_spec[1],)
        sizes = (y_shape[out_spec[0]] * math.prod(geometry.out_spatial), w_shape[rhs_spec[0]])
        sizes += (w_shape[rhs_spec[1]] * math.prod(geometry.window),)
        key = (chain, rhs_spec, w_shape)
        return self.use(here, ins[1].leaf, 0, key, y, y_perm, sizes, geometry, factor)

    def miss_reason(self, eqn, ins):
        if broadcast_reason(eqn, ins) is not None:
            return super().miss_reason(eqn, ins)
        if ins[1] is None:
            return "the input operand of a convolution (not its kernel)"
        if (groups := _groups(eqn)) != (1, 1):
            return (
                f"the kernel of a grouped or depthwise convolution (feature_group_count="
                f"{groups[0]}, batch_group_count={groups[1]})"
            )
        return super().miss_reason(eqn, ins)

    def evaluate(self, eqn, invals):
        if _groups(eqn) != (1, 1):
            return bind(eqn, invals)
        if _as_matmul(eqn):
            return conv_as_matmul(eqn, *invals)
        return conv_with_canonical_transpose(eqn, *invals)

    def input_features(self, use, x, bias_column):
        x = jax.vmap(lambda v: patches(v, use.info))(x)
        if bias_column:
            x = jnp.concatenate([x, jnp.ones((x.shape[0], 1, x.shape[2]), x.dtype)], axis=1)
        return x

    def jacobian_input(self, use, x, bias_column):
        return x

    def jacobian(self, use, xj, g, biased):
        """``(N, *O, C, K)`` from inputs ``(N, *lhs)``: patches formed a few samples at a time."""
        lead = g.shape[:-2]
        g3 = g.reshape((g.shape[0], math.prod(lead[1:])) + g.shape[-2:])  # (N, O, A, K)

        def one(args):
            x_i, g_i = args
            pm = patches(x_i, use.info)  # (C, A)
            if biased:
                pm = jnp.concatenate([pm, jnp.ones((1, pm.shape[1]), pm.dtype)], axis=0)
            return jnp.moveaxis(jnp.einsum("ca,oak->cok", pm, g_i), 0, 1)  # dot's own order

        rows = max(1, PATCH_CHUNK_VALUES // max(1, use.a_size * use.x_contract_size))
        j = map_in_batches(jax.vmap(one), (xj, g3), rows)
        return j.reshape(lead + j.shape[-2:])

    def x_spec(self, n, a, c):
        return f"{n}{c}{a}"


#: Output positions per sample up to which the features compute a convolution as patches
#: times the kernel matrix: XLA CPU runs the vmapped convolutions (and their transposes) of
#: 1x1 and 2x2 feature maps at 6-12 GFLOP/s. ResNet-18 on 32x32, N = 64: features 3.4 s
#: -> 1.3 s (<= 4); <= 1: 2.7 s; <= 16: 1.8 s (a 4x4 map is faster as a convolution).
MATMUL_MAX_POSITIONS = 4

#: Contraction size (input channels x window) up to which a TPU's features compute a
#: convolution as patches times the kernel matrix, whatever its positions. XLA's TPU
#: compiler takes ~10 s for one float32 convolution with few channels at HIGHEST (LeNet's
#: 5x5, 3 -> 6: 10.9 s; as patches times a matrix 4.1 s), and for channel-rich ones the
#: convolution stays faster. Measured on a TPU v5e (benchmarks/README.md, 2026-12-07):
#: LeNet N = 500, every convolution as a matmul: first call 49.2 s -> 12.9 s, warm 30.0 ->
#: 32.2 ms; ResNet-18 224², every convolution as a matmul: 60.0 s -> 65.8 s, warm 123 ->
#: 246 ms, hence the bound (LeNet's 75 and 150; ResNet-18's 3x3 convolutions >= 576).
TPU_MATMUL_MAX_CONTRACTION = 256


def _as_matmul(eqn) -> bool:
    out_spec = eqn.params["dimension_numbers"].out_spec
    shape = eqn.outvars[0].aval.shape
    if math.prod(shape[d] for d in out_spec[2:]) <= MATMUL_MAX_POSITIONS:
        return True
    if jax.default_backend() != "tpu":
        return False
    rhs = eqn.invars[1].aval.shape
    rhs_spec = eqn.params["dimension_numbers"].rhs_spec
    contraction = rhs[rhs_spec[1]] * math.prod(rhs[d] for d in rhs_spec[2:])
    return contraction <= TPU_MATMUL_MAX_CONTRACTION


def conv_as_matmul(eqn, lhs, rhs):
    """``eqn``'s convolution as its patches times the kernel matrix, one ``dot_general``."""
    y_shape = tuple(eqn.outvars[0].aval.shape)
    geometry, rhs_spec, out_spec = _geometry(tuple(rhs.shape), y_shape, **eqn.params)
    p = patches(lhs, geometry)  # (C_in·W, B·A)
    w = jnp.transpose(rhs, (rhs_spec[1], *rhs_spec[2:], rhs_spec[0]))
    w = w.reshape((math.prod(w.shape[:-1]), w.shape[-1]))  # (C_in·W, K), C_in may be 0
    precision, out_type = eqn.params["precision"], eqn.params["preferred_element_type"]
    y = lax.dot_general(p, w, (((0,), (0,)), ((), ())), precision, out_type)  # (B·A, K)
    src = (out_spec[0], *out_spec[2:], out_spec[1])  # y's axes as the output's dimensions
    y = y.reshape(tuple(y_shape[d] for d in src))
    y = jnp.transpose(y, tuple(src.index(d) for d in range(len(src))))
    return y.astype(eqn.outvars[0].aval.dtype)


def conv_with_canonical_transpose(eqn, lhs, rhs):
    """``eqn``'s convolution, equal in every derivative, whose transpose reads the kernel
    materialised as (spatial..., in, out): inside a loop XLA CPU is ~5x slower without."""
    params = eqn.params
    dn = params["dimension_numbers"]
    n_sp = len(dn.rhs_spec) - 2
    spatial = tuple(range(n_sp))
    # Physical order (spatial..., O, I): the transpose rule swaps O and I.
    order = tuple(dn.rhs_spec[2:]) + (dn.rhs_spec[0], dn.rhs_spec[1])
    turned = dict(params, dimension_numbers=dn._replace(rhs_spec=(n_sp, n_sp + 1) + spatial))

    @jax.custom_jvp
    def conv(x, w):
        return bind(eqn, [x, w])

    def conv_jvp(primals, tangents):
        x, w = primals
        dx, dw = tangents
        y = bind(eqn, [x, w])
        t = None
        if not isinstance(dx, jax.custom_derivatives.SymbolicZero):
            # Reverse behind a barrier, so the transpose's reversal cancels it.
            flipped = barrier(jnp.flip(jnp.transpose(w, order), spatial))
            t = eqn.primitive.bind(dx, jnp.flip(flipped, spatial), **turned)
        if not isinstance(dw, jax.custom_derivatives.SymbolicZero):
            tw = bind(eqn, [x, dw])
            t = tw if t is None else t + tw
        if t is None:
            t = jnp.zeros_like(y)
        return y, t

    conv.defjvp(conv_jvp, symbolic_zeros=True)
    return conv(lhs, rhs)


CONV = ConvRule()
