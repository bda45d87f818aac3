"""How often a kernel call traces the user's model (issue 17: the first call is the
common case). With vmap_axes=0 the model is traced once on one sample, and validation,
the analysis, the cost model and every implementation's features replay that jaxpr
(ntk_core._kernel.model.per_sample_trace / replay); the independence proof traces it on a
batch of three and on one (N only a size). A call with a new N of the same per-sample signature, or a repeat,
traces nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compiles
import ntk_core
import reference


def _counted():
    traces = [0]

    def apply_fn(p, x):
        traces[0] += 1
        return jnp.tanh(x @ p["w"]) @ p["v"]

    return apply_fn, traces


PARAMS = {
    "w": jax.random.normal(jax.random.PRNGKey(0), (6, 16)),
    "v": jax.random.normal(jax.random.PRNGKey(1), (16, 3)),
}


@pytest.mark.parametrize(
    "kind, implementation",
    [("ntk", i) for i in ("jacobian", "structured", "ntvp", "auto")]
    + [("ntk_per_leaf", i) for i in ("jacobian", "structured", "auto")]  # no ntvp per leaf
    + [("nngp", None)],  # one forward pass: no implementation to choose
)
def test_a_first_call_traces_the_model_three_times_and_a_new_n_not_at_all(implementation, kind):
    """Issue 17: at most 3 traces of the model on a first call (the per-sample jaxpr
    that validation, the analysis, the cost model and every implementation's features
    replay, and the independence proof's batches of three and of one: 2 before a model
    reading N got a silently wrong kernel), none on a call with a new N (its per-sample
    signature is known), none on a repeat."""
    apply_fn, traces = _counted()
    build = {
        "ntk": ntk_core.ntk_fn,
        "nngp": ntk_core.nngp_fn,
        "ntk_per_leaf": ntk_core.ntk_per_leaf_fn,
    }
    options = {} if kind == "nngp" else {"implementation": implementation}
    kernel = build[kind](apply_fn, **options)
    kernel(PARAMS, jnp.ones((5, 6)))
    first = traces[0]
    kernel(PARAMS, jnp.ones((9, 6)))
    new_n = traces[0] - first
    kernel(PARAMS, jnp.ones((9, 6)) * 2.0)
    kernel(PARAMS, jnp.ones((4, 6)), jnp.ones((9, 6)))  # test-train
    assert traces[0] - first - new_n == 0  # same per-sample signature: nothing traced
    assert first <= 3 and new_n == 0, (first, new_n)


def test_a_new_n_keeps_the_checks_of_the_first_call():
    """The per-sample analysis is reused, not skipped: a model whose samples interact
    is refused at every N, and the kernel at the new N equals a fresh computation."""
    kernel = ntk_core.ntk_fn(lambda w, x: (x @ w) - (x @ w).mean(0))
    for n in (4, 7):
        with pytest.raises(ValueError, match="depends on the other samples"):
            kernel(jnp.ones((3, 2)), jnp.arange(3.0 * n).reshape(n, 3))
    apply_fn, _ = _counted()
    kernel = ntk_core.ntk_fn(apply_fn, trace_axes=())
    kernel(PARAMS, jnp.ones((5, 6)))
    x = jax.random.normal(jax.random.PRNGKey(2), (8, 6))
    fresh = ntk_core.ntk_fn(lambda p, x: apply_fn(p, x), trace_axes=())(PARAMS, x)
    assert jnp.array_equal(kernel(PARAMS, x), fresh)


_SEEN = compiles.counter()


@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])
@pytest.mark.parametrize("implementation", ["jacobian", "structured", "ntvp", "auto"])
def test_programs_compiled_per_call(implementation, trace_axes):
    """Issue 17: a first call compiles at most two XLA programs (the features, one tile
    holding the whole triangle loop and the all-finite flag; the Gram matrix's (K + Kᵀ)/2
    of a small kernel on CPU is numpy's, :data:`tiles.HOST_MIRROR_BYTES`; the independence
    probe's forward pass is not compiled: its jaxpr proves the rows separate), a new N at
    most two (features and tile of the new shape) and a repeat none.
    Before: 10 programs on the first call (eager input checks, probe slicing, analysis
    ops, a separate symmetrisation) and 28 unrolled block products in the tile."""

    def apply_fn(p, x):
        return jnp.tanh(x @ p["w"]) @ p["v"]

    kernel = ntk_core.ntk_fn(apply_fn, implementation=implementation, trace_axes=trace_axes)
    counts = []
    x9 = jnp.ones((9, 6))
    for x1, x2 in ((jnp.ones((5, 6)), None), (x9, None), (x9 * 2.0, None), (x9[:3], x9)):
        before = len(_SEEN)
        jax.block_until_ready(kernel(PARAMS, x1, x2))
        counts.append(len(_SEEN) - before)
    assert 1 <= counts[0] <= 2 and counts[1] <= 2 and counts[2] == 0, counts
    assert counts[3] <= 2, counts  # test-train: the new x1's features and the tile


def _conv(p, x):
    y = jax.lax.conv_general_dilated(
        x, p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jnp.tanh(y).mean((1, 2)) @ p["v"]


CONV_PARAMS = {
    "k": jax.random.normal(jax.random.PRNGKey(3), (3, 3, 2, 4)),
    "v": jax.random.normal(jax.random.PRNGKey(4), (4, 3)),
}


def _lowered(phases, p, x) -> list[str]:
    """The lowered text of the features and the Gram tile of ``phases`` on ``x``."""
    if phases.features is None:
        tile = jax.jit(lambda p, x: phases.tile(p, None, None, None, x, None, True))
        return [tile.lower(p, x).as_text()]
    fx = phases.features(p, x, None)
    tile = jax.jit(lambda p, f: phases.tile(p, f, None, None, None, None, True))
    return [jax.jit(phases.features).lower(p, x, None).as_text(), tile.lower(p, fx).as_text()]


# precision="default" is asked for on purpose here: its PrecisionWarning is expected
@pytest.mark.filterwarnings("ignore::ntk_core._jax.environment.PrecisionWarning")
@pytest.mark.parametrize("precision", ["highest", "default"])
@pytest.mark.parametrize("vmap_axes", [0, None])
@pytest.mark.parametrize("implementation", ["jacobian", "structured", "ntvp", "nngp"])
def test_every_program_runs_the_matmuls_at_the_requested_precision(
    implementation, vmap_axes, precision
):
    """The phases replay one per-sample jaxpr traced outside them: JAX writes the
    default matmul precision into each dot and convolution when it traces them, so a
    jaxpr traced without precision="highest" would lower at the backend's default (TF32
    on recent NVIDIA GPUs; CPU ignores it, hence this check of the lowered programs).
    Every dot_general and convolution of the features and tile programs carries the
    requested precision."""
    import re

    for f, p, x in (
        (_counted()[0], PARAMS, jnp.ones((5, 6))),
        (_conv, CONV_PARAMS, jnp.ones((5, 6, 6, 2))),
    ):
        if implementation == "nngp":
            kernel = ntk_core.nngp_fn(f, vmap_axes=vmap_axes, precision=precision)
        else:
            kernel = ntk_core.ntk_fn(
                f, implementation=implementation, vmap_axes=vmap_axes, precision=precision
            )
        engine = kernel._engine
        texts = _lowered(engine.implementation(engine.prepare(p, x, None)[1]), p, x)
        found = [
            m
            for text in texts
            for m in re.findall(
                r"(?:dot_general|convolution)[^\n]*precision = \[(\w+), (\w+)\]", text
            )
        ]
        assert found, texts  # the programs were read
        assert set(found) == {(precision.upper(),) * 2}, set(found)


@pytest.mark.parametrize("order", [("auto", "structured"), ("structured", "auto")])
def test_auto_shares_the_programs_of_the_implementation_it_chose(order):
    """Issue 48: ``"auto"`` that chose ``"structured"`` and an explicit ``"structured"``
    (either first) compile one set of programs for a signature; options that change the
    program (the kernel's layout) still compile their own. The kernel equals the
    float64 reference."""

    def apply_fn(p, x):  # its own function: no program compiled by another test
        return jnp.tanh(x @ p["w"]) @ p["v"]

    x = jax.random.normal(jax.random.PRNGKey(5), (5, 6))
    counts, kernels = [], []
    for implementation in order:
        kernel = ntk_core.ntk_fn(apply_fn, implementation=implementation)
        assert kernel.implementation_for(PARAMS, x) == "structured"
        before = len(_SEEN)
        kernels.append(np.asarray(jax.block_until_ready(kernel(PARAMS, x))))
        counts.append(len(_SEEN) - before)
    assert counts[0] >= 1 and counts[1] == 0, counts
    (expected,) = reference.ntk(apply_fn, PARAMS, x, None)
    reference.assert_close(kernels[0], expected)
    assert np.array_equal(kernels[0], kernels[1])
    for options in ({"trace_axes": ()}, {"diagonal_axes": (0,)}):
        before = len(_SEEN)
        jax.block_until_ready(
            ntk_core.ntk_fn(apply_fn, implementation=order[1], **options)(PARAMS, x)
        )
        assert len(_SEEN) - before >= 1, options
