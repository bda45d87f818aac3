"""How often a kernel call traces the user's model (issue 17: the first call is the
common case). With vmap_axes=0 the model is analysed per sample, so a call with a new N
of the same per-sample signature reuses that analysis: the Jacobian contraction then
traces the model once (its jitted features), and no implementation traces it as often
as on the first call. A repeated call traces nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import ntk_core


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


@pytest.mark.parametrize("implementation", ["jacobian", "structured", "ntvp", "auto"])
def test_a_new_n_traces_the_model_less_than_the_first_call(implementation):
    apply_fn, traces = _counted()
    kernel = ntk_core.ntk_fn(apply_fn, implementation=implementation)
    kernel(PARAMS, jnp.ones((5, 6)))
    first = traces[0]
    kernel(PARAMS, jnp.ones((9, 6)))
    new_n = traces[0] - first
    kernel(PARAMS, jnp.ones((9, 6)) * 2.0)
    assert traces[0] - first - new_n == 0  # same shapes: nothing traced
    assert new_n < first
    if implementation != "ntvp":  # ntvp's nested transformations trace it more
        # The batch's outputs and precision checks, the probe, and one per-sample jaxpr
        # that the analysis, the cost model and the chunk size share (jacobian: its
        # features); a new N: the features (jacobian) or nothing (structured).
        assert first == 3 and new_n <= 1, (first, new_n)


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


def _compiles():
    """A list that grows by one name per XLA compilation (JAX's monitoring events)."""
    seen: list[str] = []

    def listener(name, secs, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            seen.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    return seen


_SEEN = _compiles()


@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])
@pytest.mark.parametrize("implementation", ["jacobian", "structured", "ntvp", "auto"])
def test_programs_compiled_per_call(implementation, trace_axes):
    """Issue 17: a first call compiles at most three XLA programs (the independence
    probe's forward pass, the features, one tile holding the whole triangle loop, its
    symmetrisation and the all-finite flag), a new N at most two (features and tile of
    the new shape; the probe and the per-sample analysis are reused) and a repeat none.
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
    assert counts[0] <= 3 and counts[1] <= 2 and counts[2] == 0, counts
    assert counts[3] <= 2, counts  # test-train: the new x1's features and the tile
    assert counts[0] >= 2  # the counter sees this kernel's own programs
