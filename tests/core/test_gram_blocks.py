"""Gram terms of convolutions contracted over blocks of x1's samples, so that their
N1·N2·O²·A-sized intermediates stay within ``rules._base.GRAM_TERM_BYTES`` (issue 28:
a ResNet-18 at N = 64 held 3 GB in one tile). Blocked or not, the kernel is the float64
Jacobian contraction's. So are products summed in chunks of the contracted axis (a
TPU's float32 products lose accuracy over long sums)."""

from __future__ import annotations

import pytest

import core_zoo
import ntk_core
import reference
from ntk_core._impl import jacobian as _jacobian
from ntk_core._structured import analysis as _structured
from ntk_core._structured.rules import _base


def _gram_form_for_convolutions(monkeypatch):
    """Convolutions contract in Gram form (small models' convolutions would not)."""
    costs = _structured.pair_costs

    def pair_costs(analysis, group, *args):
        gram, explicit = costs(analysis, group, *args)
        return (0.0, 1.0) if analysis.uses[group[0]].kind == "conv" else (gram, explicit)

    monkeypatch.setattr(_structured, "pair_costs", pair_costs)


@pytest.mark.parametrize("name", ["cnn10", "batchnorm_eval"])
@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])
def test_gram_terms_in_blocks_match_the_reference(name, trace_axes, monkeypatch):
    blocks = []
    whole = _base.map_in_batches

    def counted(fn, args, most):
        blocks.append(most)
        return whole(fn, args, most)

    monkeypatch.setattr(_base, "GRAM_TERM_BYTES", 64)  # every term in blocks of one sample
    monkeypatch.setattr(_base, "map_in_batches", counted)
    _gram_form_for_convolutions(monkeypatch)
    entry = core_zoo.ZOO[name]

    def apply(p, x):  # a function of its own: no compiled program of another test reused
        return entry.forward(p, entry.state, x)

    x1, x2 = core_zoo.inputs(entry, 5, 3)
    plan = ntk_core.plan(
        apply, entry.params, x1, trace_axes=trace_axes, implementation="structured"
    )
    assert "structured (1 convolution)" in [leaf.method for leaf in plan.leaves]
    kernel = ntk_core.ntk_fn(apply, trace_axes=trace_axes, implementation="structured")
    for a, b in ((x1, None), (x1, x2)):
        expected = reference.ntk(apply, entry.params, a, a if b is None else b, trace_axes)[0]
        reference.assert_close(kernel(entry.params, a, b), expected)
    assert blocks and max(blocks) == 1, blocks


def test_small_gram_terms_stay_whole(monkeypatch):
    """Below the limit a term is one einsum: no loop is added to small models' tiles."""
    blocks = []
    monkeypatch.setattr(_base, "map_in_batches", lambda *args: blocks.append(args))
    _gram_form_for_convolutions(monkeypatch)
    entry = core_zoo.ZOO["cnn10"]

    def apply(p, x):
        return entry.forward(p, entry.state, x)

    x1, _ = core_zoo.inputs(entry, 5, 3)
    k = ntk_core.empirical_ntk(apply, entry.params, x1, implementation="structured")
    reference.assert_close(k, reference.ntk(apply, entry.params, x1, x1)[0])
    assert blocks == []


CHUNK_CASES = {
    "jacobian-full": ("jacobian", "lenet", dict(trace_axes=())),
    "structured-full": ("structured", "lenet", dict(trace_axes=())),
    "jacobian-diag_out": ("jacobian", "tokens", dict(trace_axes=(), diagonal_axes=(-1,))),
    "structured-diag_batch": ("structured", "tokens", dict(diagonal_axes=(0,))),
    "nngp-traced": ("nngp", "tokens", dict(trace_axes=(-1,))),
}


@pytest.mark.parametrize("case", list(CHUNK_CASES))
def test_long_products_in_chunks_match_the_reference(case, monkeypatch, request):
    """With the CPU among ``CHUNKED_PLATFORMS`` and chunks of 2 values, every Gram
    product longer than 2 is a scan over zero-padded chunks (the path a TPU takes for
    products longer than 16 384), 2-D products and einsums with shared output axes
    (diagonal layouts) alike; the kernels still equal the float64 reference."""
    from ntk_core._jax.caches import clear_caches

    decided = []
    chunked = _jacobian.chunked
    monkeypatch.setattr(_jacobian, "CHUNKED_PLATFORMS", ("cpu",))
    monkeypatch.setattr(_jacobian, "CHUNK", 2)
    monkeypatch.setattr(
        _jacobian, "chunked", lambda size: decided.append(chunked(size)) or decided[-1]
    )
    clear_caches()
    request.addfinalizer(clear_caches)
    implementation, name, axes = CHUNK_CASES[case]
    entry = core_zoo.ZOO[name]

    def apply(p, x):
        return entry.forward(p, entry.state, x)

    x1, x2 = core_zoo.inputs(entry, 3, 3)
    for b in (None, x2):
        other = x1 if b is None else b
        if implementation == "nngp":
            k = ntk_core.empirical_nngp(apply, entry.params, x1, b, **axes)
            expected = reference.nngp(apply, entry.params, x1, other, **axes)[0]
        else:
            k = ntk_core.empirical_ntk(
                apply, entry.params, x1, b, implementation=implementation, **axes
            )
            expected = reference.ntk(apply, entry.params, x1, other, **axes)[0]
        reference.assert_close(k, expected)
    assert any(decided), "no product was summed in chunks"
