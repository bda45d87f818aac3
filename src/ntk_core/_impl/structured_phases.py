"""``"structured"``: the phases of :mod:`ntk_core._structured.analysis` (with
``vmap_axes=None``, the Jacobian contraction computes it)."""

from __future__ import annotations

import functools

import jax

from ntk_core._impl import jacobian as _jacobian
from ntk_core._impl.base import PRECISION, Impl, StructureHooks, finish, jit_tuned
from ntk_core._impl.cost import Call
from ntk_core._impl.jacobian_phases import merge_limits
from ntk_core._jax import caches as _caches
from ntk_core._jax.batches import map_in_batches
from ntk_core._jax.signatures import signature
from ntk_core._structured import analysis as _structured


def features(apply3, config, chunks: dict):
    """Jitted ``features(params, x_block, aux)`` in chunks (sizes cached in ``chunks``)."""
    feat = _structured_features(apply3, config.precision, config.fuse_bias)
    feat = functools.partial(feat, modes=config.structure.modes, merge_limits=merge_limits(config))
    return functools.partial(_structured_in_chunks, apply3, feat, config, chunks)


@_caches.lru_cache(maxsize=64)
def _structured_features(apply3, precision, fuse_bias):
    def features(params, x, aux, *, modes, merge_limits, chunk):
        def one_chunk(xb):  # ``chunk`` samples at a time in an XLA loop
            args = (apply3, params, xb, aux, fuse_bias, modes, merge_limits)
            return _structured.features(*args, precision=precision)

        with jax.default_matmul_precision(precision):
            return map_in_batches(one_chunk, x, chunk)

    return jit_tuned(features, static_argnames=("modes", "merge_limits", "chunk"))


def _structured_in_chunks(apply3, features, config, chunks: dict, params, x, aux):
    key = (config, signature(x))
    chunk = chunks.get(key)
    if chunk is None:
        args = (apply3, params, x, aux, config.fuse_bias, config.structure.modes)
        chunk = chunks[key] = _structured.chunk_size(*args, precision=config.precision)
    return features(params, x, aux, chunk=chunk)


def contract(f1, f2, *, config):
    with jax.default_matmul_precision(config.precision):
        args = (config.layouts, config.structure, config.analysis, f1, f1 if f2 is None else f2)
        per_leaf = _structured.contract(*args, PRECISION[config.precision])
    return finish(per_leaf, config)


def pair_terms(config) -> int:
    """Kernel-sized temporaries: 2 per use pair of a Gram group, 1 per Jacobian."""
    s = config.structure
    pairs = zip(s.groups, s.modes, strict=True)
    terms = (1 if mode != _structured.GRAM else 2 * len(g) ** 2 for g, mode in pairs)
    return len(s.fallback) + sum(terms)


def structured_estimate(call: Call) -> tuple[float, float, float]:
    """``"structured"``: n·(F + O·(G_a + G_e + G_w·P_fb/P)) + the per-sample work of
    each leaf's form + pairs·(2·O'·P_fb + Σ leaf pair costs). Memory: the features, the
    kernel, passes in flight, and the largest late group's Jacobians (one call where the
    backend's rates take them)."""
    analysis, leaf_sizes, pc = call.analysis, call.leaf_sizes, call.pc
    o_pair, out_total, n_jac, itemsize = call.o_pair, call.out_total, call.n_jac, call.itemsize
    p_fallback = sum(leaf_sizes[i] for i in analysis.fallback)
    share = p_fallback / max(call.n_params, 1)
    per_pair = 2.0 * o_pair * p_fallback
    per_sample = out_total * p_fallback  # values stored per sample
    per_sample_flops = explicit_flops = 0.0  # beyond the reverse pass; explicit Jacobians' part
    widths = [leaf_sizes[i] for i in analysis.fallback]  # Jacobian-type features
    gram_terms = 0
    modes = _structured.choose_modes(analysis, o_pair, out_total)
    if call.late and call.rates.late_jacobians:
        modes = _structured.late_modes(analysis, modes, out_total)
    late_bytes = 0  # one late group's Jacobians of every sample, alive in the contraction
    for group, mode in zip(analysis.groups, modes, strict=True):
        gram, explicit = _structured.pair_costs(analysis, group, o_pair, out_total)
        for u in group:
            use = analysis.uses[u]
            a, c, k = use.a_size, analysis.input_size(u), use.w_free_size
            per_sample_flops += use.rule.input_flops(a, c)  # e.g. convolution patches
            if mode != _structured.GRAM:
                per_sample_flops += 2.0 * out_total * a * c * k
                explicit_flops += 2.0 * out_total * a * c * k
        if mode != _structured.GRAM:
            width = analysis.input_size(group[0]) * analysis.uses[group[0]].w_free_size
            if mode == _structured.LATE:
                per_sample += _structured.late_values(analysis, group, out_total)
                late_bytes = max(late_bytes, n_jac * out_total * width * itemsize)
            else:
                per_sample += out_total * width
            per_pair += explicit
            widths.append(width)
        else:
            for u in group:
                use = analysis.uses[u]
                c = use.rule.input_values(analysis.input_size(u))
                per_sample += use.a_size * (c + out_total * use.w_free_size)
            per_pair += gram
            gram_terms += len(group) ** 2
    reverse_structured = pc.grad_activations + pc.grad_elementwise + share * call.grad_w
    structured_bytes = n_jac * per_sample * itemsize
    structured_pairs = call.contracted(structured_bytes)
    structured_flops = (
        n_jac * (call.forward + out_total * reverse_structured + per_sample_flops)
        + structured_pairs * per_pair
    )
    chunk = _structured.feature_chunk(n_jac, out_total, call.values, per_sample, itemsize)
    memory = float(structured_bytes + call.kernel_bytes + chunk * call.passes_bytes + late_bytes)
    slow = n_jac * out_total * share * pc.grad_weights_conv
    einsums = _jacobian.einsum_count(widths, call.merge_limit) + gram_terms
    explicit_slow = call.rates.explicit_jacobian_slowdown - 1.0
    channel = n_jac * (call.fwd_x + out_total * call.act_x) + n_jac * explicit_slow * explicit_flops
    seconds = call.seconds(
        structured_flops, slow, 2 * structured_bytes, einsums, structured_pairs, channel
    )
    return structured_flops, memory, seconds


STRUCTURED = Impl(
    name="structured",
    title="structured derivatives",
    features=features,
    contract=contract,
    separates_leaves=True,
    whole_batch_as="jacobian",
    estimate=structured_estimate,
    analysis=StructureHooks(
        _structured.analysis_for,
        _structured.choose_modes,
        _structured.method_labels,
        _structured.late_modes,
    ),
    pair_terms=pair_terms,
)
