"""``"structured"``, structured derivatives: layer inputs and cotangents
(:mod:`ntk_core._structured.analysis` and its rules), then Gram identities per group of
leaves (:data:`STRUCTURED`). With ``vmap_axes=None`` there is no per-sample structure:
the Jacobian contraction computes it."""

from __future__ import annotations

import functools

import jax

from ntk_core._impl.base import PRECISION, Impl, finish
from ntk_core._impl.jacobian_phases import merge_limits
from ntk_core._jax import caches as _caches
from ntk_core._jax.signatures import signature
from ntk_core._structured import analysis as _structured


def features(apply3, config, chunks: dict):
    """``features(params, x_block, aux)``, jitted, in chunks of samples whose size is
    cached in ``chunks``."""
    feat = _structured_features(apply3, config.precision, config.fuse_bias)
    feat = functools.partial(
        feat,
        out_tree=config.out_tree,
        modes=config.structure.modes,
        merge_limits=merge_limits(config),
    )
    return functools.partial(_structured_in_chunks, apply3, feat, config, chunks)


@_caches.lru_cache(maxsize=64)
def _structured_features(apply3, precision, fuse_bias):
    """The jitted first phase of ``"structured"``: layer inputs, cotangents, fallbacks,
    ``chunk`` samples at a time."""

    def features(params, x, aux, *, out_tree, modes, merge_limits, chunk):
        with jax.default_matmul_precision(precision):
            return _structured.features_in_chunks(
                apply3,
                params,
                x,
                aux,
                out_tree,
                fuse_bias,
                modes,
                merge_limits,
                chunk,
                precision=precision,
            )

    return jax.jit(features, static_argnames=("out_tree", "modes", "merge_limits", "chunk"))


def _structured_in_chunks(apply3, features, config, chunks: dict, params, x, aux):
    """``features(params, x, aux)`` computed :func:`_structured.chunk_size` samples
    at a time (:func:`_structured.features_in_chunks`); the chunk size is cached in
    ``chunks`` per configuration and input shapes."""
    key = (config, signature(x))
    chunk = chunks.get(key)
    if chunk is None:
        chunk = _structured.chunk_size(
            apply3,
            params,
            x,
            aux,
            config.out_tree,
            config.fuse_bias,
            config.structure.modes,
            precision=config.precision,
        )
        chunks[key] = chunk
    return features(params, x, aux, chunk=chunk)


def contract(f1, f2, *, config):
    """The Gram identities of each group of leaves, and the fallbacks' contraction."""
    with jax.default_matmul_precision(config.precision):
        per_leaf = _structured.contract(
            config.layouts,
            config.structure,
            config.analysis,
            f1,
            f1 if f2 is None else f2,
            PRECISION[config.precision],
        )
    return finish(per_leaf, config)


def pair_terms(config) -> int:
    """A Gram-form group holds an input and a cotangent Gram matrix per pair of its
    uses; a per-sample-Jacobian group ("explicit") one contraction, as a fallback."""
    structure = config.structure
    fallback, groups, modes = structure.fallback, structure.groups, structure.modes
    return len(fallback) + sum(
        1 if mode == "explicit" else 2 * len(g) ** 2 for g, mode in zip(groups, modes, strict=True)
    )


STRUCTURED = Impl(
    name="structured",
    title="structured derivatives",
    features=features,
    contract=contract,
    separates_leaves=True,
    whole_batch_as="jacobian",
    uses_analysis=True,
    pair_terms=pair_terms,
)
