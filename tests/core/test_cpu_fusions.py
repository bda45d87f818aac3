"""Kernels against a reference computed op by op, on a model that XLA's CPU compiler
(jax 0.10.2) computed wrong in float32 inside one program, with no warning.

The model is the smallest part of a ViT that showed it: a patch-embedding convolution,
LayerNorm with its own scale and bias, a mean over the patches, a Dense head. With
YNNPACK's reduce fusions, a jitted ``jax.jacrev`` of it was 16 % off in the convolution
kernel's entries (3.5 % in the NTK), and NTK-vector products 0.7 % (the ViT's); the
same programs in float64, op by op (``jax.disable_jit``), or with those fusions off were
exact to 1e-7. ``_impl/base.CPU_OPTIONS`` turns them off for the library's programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import ntk_core
import reference


def _apply(params, x):
    h = lax.conv_general_dilated(
        x, params["embed"], (4, 4), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = h.reshape(h.shape[0], -1, h.shape[-1])
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    h = (h - mean) * lax.rsqrt(var + 1e-6) * params["scale"] + params["bias"]
    return jnp.mean(h, axis=1) @ params["head"]


def test_kernels_match_op_by_op_reference_where_cpu_fusions_were_wrong():
    rng = np.random.default_rng(0)
    params = {
        "embed": rng.standard_normal((4, 4, 3, 32)) / np.sqrt(48),
        "scale": np.ones(32),
        "bias": 0.1 * rng.standard_normal(32),
        "head": rng.standard_normal((32, 10)) / np.sqrt(32),
    }
    params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
    x = jnp.asarray(rng.standard_normal((4, 32, 32, 3)), jnp.float32)
    with jax.disable_jit():  # each primitive its own program: nothing fused
        (expected,) = reference.ntk(_apply, params, x, None, trace_axes=())
    for implementation, vmap_axes in (("ntvp", 0), ("jacobian", None), ("structured", 0)):
        fn = ntk_core.ntk_fn(
            _apply, trace_axes=(), implementation=implementation, vmap_axes=vmap_axes
        )
        reference.assert_close(fn(params, x, None), expected)
