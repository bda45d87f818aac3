"""The NNGP's phases (:data:`NNGP`): the model's outputs, then their dot products."""

from __future__ import annotations

import functools

import jax

from ntk_core._impl import jacobian as _jacobian
from ntk_core._impl.base import PRECISION, Impl
from ntk_core._kernel.model import replay


def _nngp_outputs(params, x, aux, *, apply3, config):
    """The model's outputs on one block (per sample with ``vmap_axes=0``)."""
    with jax.default_matmul_precision(config.precision):
        if config.vmap_axes is None:
            return config.out_tree.flatten_up_to(apply3(params, x, aux))
        single = replay(apply3, config.precision)
        out = jax.vmap(single, in_axes=(None, 0, None))(params, x, aux)
        return config.out_tree.flatten_up_to(out)


_OUTPUTS = jax.jit(_nngp_outputs, static_argnames=("apply3", "config"))


def features(apply3, config, chunks):
    return functools.partial(_OUTPUTS, apply3=apply3, config=config)


def contract(out1, out2, *, config):
    """The outputs' products per output leaf, traced axes averaged."""
    out2 = out1 if out2 is None else out2
    kernels = []
    for layout, a, b in zip(config.layouts, out1, out2, strict=True):
        lhs, rhs, out = layout.specs()
        k = _jacobian.pair_einsum(lhs, rhs, out, a, b, PRECISION[config.precision])
        kernels.append(k / layout.trace_size(a.shape))
    return jax.tree.unflatten(config.out_tree, kernels)


NNGP = Impl(
    name="nngp",
    title="NNGP",
    features=features,
    contract=contract,
    separates_leaves=False,
    whole_batch_as="nngp",
)
