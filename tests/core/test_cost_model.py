"""The cost model's terms (``_cost.estimate``, issue 17 item 7) against closed forms
counted by hand from the shapes of small models, and against what the computation
itself does (the structured features' chunk size, the kernel's bytes)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

import ntk_core
import reference
from ntk_core import _units
from ntk_core._impl import cost as _cost
from ntk_core._jax.jaxpr_walk import values_written
from ntk_core._structured import analysis as _structured


def _mlp(p, x):
    return jnp.tanh(x @ p["w"] + p["b"]) @ p["v"] + p["c"]


def _mlp_params():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "w": jax.random.normal(k[0], (4, 8)),
        "b": jnp.zeros(8),
        "v": jax.random.normal(k[1], (8, 3)),
        "c": jnp.zeros(3),
    }
    return params, jax.random.normal(k[2], (20, 4))


def _conv(p, x):
    """Conv 1 -> 4, 3x3 SAME on 6x6x1 (A = 36 positions, C = 9, K = 4), mean, Dense 4 -> 2."""
    y = jax.lax.conv_general_dilated(
        x, p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jnp.tanh(y).mean(axis=(1, 2)) @ p["w"]


def _conv_params(n=3):
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    params = {"k": jax.random.normal(k[0], (3, 3, 1, 4)), "w": jax.random.normal(k[1], (4, 2))}
    return params, jax.random.normal(k[2], (n, 6, 6, 1))


#: Kernel gradient FLOPs of the convolution per sample and output cotangent:
#: 2 · (36 positions · 4 channels) · (3·3·1 window).
CONV_GRAD_FLOPS = 2 * 36 * 4 * 9


def _with_rates(monkeypatch, **changes):
    monkeypatch.setitem(_cost.RATES, "cpu", dataclasses.replace(_cost.RATES["cpu"], **changes))


def _estimates(apply, params, x, **options):
    plan = ntk_core.ntk_fn(apply, **options).plan(params, x)
    return {e.implementation: e for e in plan.estimates}


def test_feature_chunk_is_the_structured_chunk_size(monkeypatch):
    """The passes in flight of "structured" are one chunk's: the chunk is the one
    ``_structured.chunk_size`` gives the features phase, here 7 of 20 samples."""
    params, x = _mlp_params()
    x_one = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    analysis, closed = _structured.analysis_for(
        lambda p, v, a: _mlp(p, v), params, x_one, None, precision="highest"
    )
    out = 3
    # Gram-form features per sample: each layer's input (with the fused bias's 1) and
    # its O cotangents of K outputs: (4 + 1 + 3·8) + (8 + 1 + 3·3).
    features = (4 + 1 + out * 8) + (8 + 1 + out * 3)
    assert features == sum(
        use.a_size * (analysis.input_size(u) + out * use.w_free_size)
        for u, use in enumerate(analysis.uses)
    )
    values = values_written(closed.jaxpr)
    per_sample_bytes = 4 * ((out + 2) * values + features)
    monkeypatch.setattr(_structured, "FEATURE_CHUNK_BYTES", 7 * per_sample_bytes + 3)
    modes = ("gram",) * len(analysis.groups)
    reference = _structured.chunk_size(
        lambda p, v, a: _mlp(p, v), params, x, None, True, modes, precision="highest"
    )
    assert reference == 7  # 20 samples: 3 chunks of 7 (the last overlapping)
    assert _structured.feature_chunk(20, out, values, features, 4) == reference
    assert _structured.feature_chunk(5, out, values, features, 4) == 5  # all of a small batch


def test_kernel_bytes_count_kernel_values_not_traced_products():
    """With ``trace_axes=(-1,)`` a pair of samples has one kernel value but O' = O
    products; given ``kernel_sizes``, each estimate's memory holds the kernel's real
    bytes (twice: the Gram matrix and its symmetrised copy)."""
    params, x = _mlp_params()
    n, out = x.shape[0], 3
    kernel = ntk_core.ntk_fn(_mlp, trace_axes=(-1,))(params, x)
    assert kernel.shape == (n, n)
    x_one = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    apply3 = lambda p, v, a: _mlp(p, v)  # noqa: E731
    analysis, closed = _structured.analysis_for(apply3, params, x_one, None, precision="highest")

    def run(kernel_sizes):
        return _cost.estimate(
            closed,
            params,
            x_one,
            n1=n,
            n2=n,
            pairs=n * n,
            out_sizes=[out],
            pair_sizes=[out],
            symmetric=True,
            analysis=analysis,
            kernel_sizes=kernel_sizes,
        )

    for old, new in zip(run(None), run([1]), strict=True):
        assert old.memory_bytes - new.memory_bytes == 2 * (out - 1) * kernel.nbytes
        assert old.seconds == new.seconds  # the work is O' per pair either way


def test_whole_batch_ntvp_memory_closed_form():
    """``f(x) = x @ W`` (N = 4, 3 -> 2) with ``vmap_axes=None``: NTK-vector products hold
    the parameter cotangents of the O basis vectors (O·P), the columns (N·O·O), the
    forward residuals of the batch (its one product: N·O values), one cotangent's
    transient (half of those, and a gradient of the P parameters), and the kernel and
    its symmetrised copy ((N·O)² values each); the JVP over x1 runs after the reverse
    pass in the loop's body, not beside it."""
    w = jax.random.normal(jax.random.PRNGKey(2), (3, 2))
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 3))
    n, out, p = 4, 2, 6
    found = _estimates(lambda w, x: x @ w, w, x, trace_axes=(), vmap_axes=None)
    residual = n * out
    cotangent = residual // 2 + p
    kernel = 2 * (n * out) ** 2
    expected = 4 * (out * p + n * out * out + residual + cotangent + kernel)
    assert found["ntvp"].memory_bytes == expected


def test_whole_batch_ntvp_conv_gradients_in_the_loop(monkeypatch):
    """With ``vmap_axes=None`` the N·O cotangents' reverse passes over the batch run in
    the column loop, each taking the convolution's kernel gradient (N samples of
    CONV_GRAD_FLOPS) ``conv_weight_grad_loop_slowdown`` times slower; the JVPs' tangent
    convolutions are not grouped (``conv_weight_grad_slowdown`` does not apply)."""
    params, x = _conv_params()
    n, out = x.shape[0], 2
    options = dict(trace_axes=(), vmap_axes=None)
    rate = _cost.RATES["cpu"].flops_per_s
    _with_rates(monkeypatch, conv_weight_grad_loop_slowdown=1.0)
    base = _estimates(_conv, params, x, **options)["ntvp"].seconds
    _with_rates(monkeypatch, conv_weight_grad_loop_slowdown=51.0)
    slow = _estimates(_conv, params, x, **options)["ntvp"].seconds
    assert slow - base == pytest.approx(50.0 * n * out * n * CONV_GRAD_FLOPS / rate, rel=1e-9)
    _with_rates(monkeypatch, conv_weight_grad_loop_slowdown=1.0, conv_weight_grad_slowdown=41.0)
    assert _estimates(_conv, params, x, **options)["ntvp"].seconds == pytest.approx(base)


def test_per_sample_ntvp_conv_gradients_are_grouped(monkeypatch):
    """Per sample (``vmap_axes=0``): N2 reverse passes and N1·N2 JVPs per output, each
    with one sample's kernel gradient as a grouped convolution; the loop slowdown of
    the whole batch does not apply."""
    params, x = _conv_params()
    n, out = x.shape[0], 2
    rate = _cost.RATES["cpu"].flops_per_s
    _with_rates(monkeypatch, conv_weight_grad_slowdown=1.0)
    base = _estimates(_conv, params, x, trace_axes=())["ntvp"].seconds
    _with_rates(monkeypatch, conv_weight_grad_slowdown=41.0, conv_weight_grad_loop_slowdown=1e6)
    slow = _estimates(_conv, params, x, trace_axes=())["ntvp"].seconds
    expected = 40.0 * (n + n * n) * out * CONV_GRAD_FLOPS / rate
    assert slow - base == pytest.approx(expected, rel=1e-9)


def test_explicit_jacobian_products_at_their_rate(monkeypatch):
    """The convolution takes the explicit form (its Gram form would compare 36 x 36
    positions): per sample, patches (C = 9, A = 36) times O = 2 cotangents of K = 4
    channels, 2·O·A·C·K FLOPs, ``explicit_jacobian_slowdown`` times slower; the Dense
    layer's Gram form does not change."""
    params, x = _conv_params(n=5)
    n, out = x.shape[0], 2
    plan = ntk_core.ntk_fn(_conv, trace_axes=(), implementation="structured").plan(params, x)
    methods = {leaf.path: leaf.method for leaf in plan.leaves}
    assert "per-sample Jacobian" in methods["['k']"]
    assert "per-sample Jacobian" not in methods["['w']"]
    rate = _cost.RATES["cpu"].flops_per_s
    _with_rates(monkeypatch, explicit_jacobian_slowdown=1.0)
    base = _estimates(_conv, params, x, trace_axes=())
    _with_rates(monkeypatch, explicit_jacobian_slowdown=3.0)
    slow = _estimates(_conv, params, x, trace_axes=())
    expected = 2.0 * n * (2 * out * 36 * 9 * 4) / rate
    assert slow["structured"].seconds - base["structured"].seconds == pytest.approx(
        expected, rel=1e-9
    )
    for other in ("jacobian", "ntvp"):
        assert slow[other].seconds == base[other].seconds


def test_per_sample_jacobian_conv_gradients_slow_down_with_their_cotangents(monkeypatch):
    """``"jacobian"`` vmaps the kernel gradient over the N samples and O cotangents; its
    slowdown is ``conv_vmap_grad_slowdown`` plus the cotangents' bytes (N·O·36·4 values
    of 4 bytes) per ``conv_vmap_grad_bytes``, at most ``conv_vmap_grad_max_slowdown``; the
    whole batch's (``vmap_axes=None``) and the NTK-vector products' grouped gradients keep
    ``conv_weight_grad_slowdown``."""
    params, x = _conv_params()
    n, out = x.shape[0], 2
    rate = _cost.RATES["cpu"].flops_per_s
    cotangent_bytes = n * out * 36 * 4 * 4
    slow_flops = n * out * CONV_GRAD_FLOPS

    def seconds(**options):
        found = _estimates(_conv, params, x, trace_axes=(), **options)
        return {name: e.seconds for name, e in found.items()}

    plain = dict(conv_vmap_grad_slowdown=1.0, conv_vmap_grad_bytes=math.inf)
    _with_rates(monkeypatch, **plain, conv_vmap_grad_max_slowdown=math.inf)
    base, whole = seconds(), seconds(vmap_axes=None)
    _with_rates(monkeypatch, conv_vmap_grad_slowdown=5.0, conv_vmap_grad_bytes=1000.0)
    slow = seconds()
    base_jacobian = base.pop("jacobian")
    expected = (4.0 + cotangent_bytes / 1000.0) * slow_flops / rate
    assert slow.pop("jacobian") - base_jacobian == pytest.approx(expected, rel=1e-9)
    assert slow == base  # ntvp and structured
    assert seconds(vmap_axes=None) == whole
    _with_rates(monkeypatch, conv_vmap_grad_max_slowdown=3.0)
    capped = seconds().pop("jacobian") - base_jacobian
    assert capped == pytest.approx(2.0 * slow_flops / rate, rel=1e-9)
    # Issue 51: the 36 kernel values (3x3x1x4) per sample and cotangent cost
    # conv_jacobian_value_flops each times their shortfall, 1 - 2·36 / 128 (2·H'·W' FLOPs
    # a value); the other implementations do not write per-sample Jacobians.
    _with_rates(monkeypatch, conv_jacobian_value_flops=0.0)
    without = seconds()
    _with_rates(monkeypatch, conv_jacobian_value_flops=1000.0)
    written = seconds()
    uncovered = 36 * (1.0 - 2 * 36 / _cost.CONV_VALUE_COVER_FLOPS)
    extra = written.pop("jacobian") - without.pop("jacobian")
    assert extra == pytest.approx(1000.0 * n * out * uncovered / rate, rel=1e-9)
    assert written == without


def _wide(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


def _never_2x_slower(chosen, plan) -> None:
    """The rule of issue 51: ``"auto"``'s choice is not estimated >= 2x slower than any
    candidate, in one call (where it fits) or in tiles."""
    alternatives = [e for e in plan.estimates if e.memory_bytes <= _cost.JACOBIAN_MEMORY_BUDGET]
    alternatives += [e.tiled for e in plan.estimates if e.tiled is not None]
    assert alternatives and all(chosen.seconds < 2.0 * e.seconds for e in alternatives)


def test_auto_weighs_tiles(monkeypatch):
    """Issue 51's ViT in small: NTK-vector products fit in one call, the features of
    "structured" and "jacobian" only in tiles (the one-call budget set between their
    peaks), and "structured" in tiles is estimated >= 2x faster than NTK-vector products
    in one call. ``"auto"`` with ``batch_size=None`` weighs the tiled forms and takes the
    cheapest (the old rule, one call only, took ntvp), computes it in tiles kept on the
    device (a ``jax.Array``) and plan() says so; inside a JAX transformation, where tiles
    cannot run, it takes ntvp in one call and warns of the tiles; with
    ``batch_size="auto"`` it takes the fastest in tiles. Every choice passes the rule
    (:func:`_never_2x_slower`); the kernels equal the float64 reference."""
    k = jax.random.split(jax.random.PRNGKey(4), 3)
    params = {"w": jax.random.normal(k[0], (6, 64)) / 3, "v": jax.random.normal(k[1], (64, 4)) / 8}
    x = jax.random.normal(k[2], (48, 6))
    (expected,) = reference.ntk(_wide, params, x, None, trace_axes=())
    one_call = ntk_core.ntk_fn(_wide, trace_axes=())
    found = {e.implementation: e for e in one_call.plan(params, x).estimates}
    ntvp, structured = found["ntvp"], found["structured"]
    assert ntvp.memory_bytes < structured.memory_bytes < found["jacobian"].memory_bytes
    monkeypatch.setattr(_cost, "JACOBIAN_MEMORY_BUDGET", ntvp.memory_bytes)
    one_call = ntk_core.ntk_fn(_wide, trace_axes=())
    plan = one_call.plan(params, x)
    assert _cost.choose(plan.estimates) == "ntvp"  # one call only: what auto took before
    assert structured.tiled.seconds * 2.0 <= ntvp.seconds  # the case of the rule
    assert plan.implementation == "structured" and plan.in_tiles == structured.tiled
    assert plan.in_tiles.batch > 0 and plan.tiling.b1 == plan.in_tiles.batch
    _never_2x_slower(plan.in_tiles, plan)
    said = str(plan)
    assert "structured in tiles of" in said and "kept on the device" in said
    assert f"ntvp in one call ~{ntvp.seconds:.3g} s" in said  # what auto weighed
    kernel = one_call(params, x)
    assert isinstance(kernel, jax.Array)
    reference.assert_close(kernel, expected)
    traced = ntk_core.ntk_fn(_wide, trace_axes=())
    with pytest.warns(UserWarning, match="outside jax.jit"):
        shape = jax.eval_shape(lambda v: traced(params, v), x)  # traced: ntvp, one call
    assert shape.shape == expected.shape
    tiles = ntk_core.ntk_fn(_wide, trace_axes=(), batch_size="auto", memory_budget=2**22)
    plan = tiles.plan(params, x)
    by_name = {e.implementation: e.tiled or e for e in plan.estimates}
    assert plan.implementation != "ntvp" and by_name[plan.implementation].batch > 0
    chosen = by_name[plan.implementation].seconds
    assert all(chosen < 2.0 * e.seconds for e in by_name.values())
    reference.assert_close(tiles(params, x), expected)


def test_one_call_limit_is_half_an_accelerators_memory(monkeypatch):
    """``"auto"`` computes a call in one call up to half a GPU's or TPU's memory (the
    issue's ViT: structured, 4.8 GB, in one call on a 15.75 GiB TPU v5e: 0.27 s warm,
    against 2.1 s for the Jacobians in tiles under the CPU's 4 GiB), never below
    :data:`_cost.JACOBIAN_MEMORY_BUDGET`, which a CPU keeps. plan() names the limit and
    takes the one call that fits it."""
    from ntk_core._kernel import planner

    class Chip:
        platform = "tpu"

    cpu = planner.one_call_limit((jnp.ones(3),))
    assert cpu == _cost.JACOBIAN_MEMORY_BUDGET
    monkeypatch.setattr(planner, "_devices", lambda tree: [Chip()])
    for have, limit in [(int(15.75 * 2**30), int(15.75 * 2**30) // 2), (2**32, cpu), (None, cpu)]:
        monkeypatch.setattr(planner._memory, "capacity", lambda devices, have=have: have)
        assert planner.one_call_limit(None) == limit
    monkeypatch.undo()
    k = jax.random.split(jax.random.PRNGKey(4), 3)
    params = {"w": jax.random.normal(k[0], (6, 64)) / 3, "v": jax.random.normal(k[1], (64, 4)) / 8}
    x = jax.random.normal(k[2], (48, 6))
    found = {
        e.implementation: e for e in ntk_core.ntk_fn(_wide, trace_axes=()).plan(params, x).estimates
    }
    ntvp, structured = found["ntvp"], found["structured"]
    monkeypatch.setattr(_cost, "JACOBIAN_MEMORY_BUDGET", ntvp.memory_bytes)  # a small "CPU"
    on_cpu = ntk_core.ntk_fn(_wide, trace_axes=()).plan(params, x)
    assert on_cpu.in_tiles is not None or on_cpu.implementation != "structured"
    monkeypatch.setattr(planner, "one_call_limit", lambda tree: int(structured.memory_bytes))
    on_chip = ntk_core.ntk_fn(_wide, trace_axes=()).plan(params, x)
    assert on_chip.implementation == "structured" and on_chip.in_tiles is None
    lines = {line.split()[0]: line for line in str(on_chip).splitlines() if line.startswith("  ")}
    limit = _units.human_bytes(int(structured.memory_bytes))
    assert f"(over {limit} in one call)" in lines["jacobian"] and "over" not in lines["structured"]


def test_small_samples_take_larger_feature_chunks_on_an_accelerator(monkeypatch):
    """On a GPU or TPU a features chunk of samples with small intermediates may hold
    ACCELERATOR_FEATURE_CHUNK_BYTES (the MLP 784-1000-1 at N = 10 000: one chunk, not 4;
    20.8 against 24.5 ms on a TPU v5e); larger samples (ResNet-18's) and every CPU keep
    FEATURE_CHUNK_BYTES. Checked against the formula, Bytes // (itemsize·((O + 2)·V + F))."""
    from ntk_core._structured import analysis

    def chunk(values):  # N = 10 000, one output, float32, 1 000 feature values
        return analysis.feature_chunk(10_000, 1, values, 1_000, 4)

    small, large = 3_000, 2**25  # 47 KB and 400 MB of intermediates a sample
    cpu = chunk(small), chunk(large)
    assert cpu == (-(-10_000 // -(-10_000 // (2**28 // (4 * (3 * small + 1_000))))), 1)
    monkeypatch.setattr(analysis.jax, "default_backend", lambda: "tpu")
    assert chunk(small) == min(10_000, 2**30 // (4 * (3 * small + 1_000))) == 10_000 > cpu[0]
    assert chunk(large) == 1
    monkeypatch.setattr(analysis, "SMALL_SAMPLE_BYTES", 4 * (3 * large + 1_000))
    assert chunk(large) == 2**30 // (4 * (3 * large + 1_000)) == 2  # the threshold decides
