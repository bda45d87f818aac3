"""vmap_axes=None (issue 17, item 7): the whole batch is differentiated at once, and its
reverse passes must stay within memory_budget. jax.jacrev pulls all N·O output
cotangents back through the whole batch at once (16 GB for a 64-filter convolution on
64 MNIST-sized inputs); the engine pulls back as many as fit, or refuses before
anything runs, and plan() counts the N-fold reverse work and that memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
import reference
from ntk_core._impl import cost as _cost
from ntk_core._impl import jacobian as _jacobian
from ntk_core._jax.jaxpr_walk import values_written


def _apply(p, x):
    """A batch-coupled model (the batch mean is subtracted): only vmap_axes=None is
    right for it, so the reference's whole-batch Jacobian is the truth."""
    h = jnp.tanh(x @ p["w"] + p["b"])
    h = h - 0.5 * h.mean(axis=0)
    return {"logits": h @ p["v"], "energy": (h**2).sum(-1, keepdims=True)}


def _data(dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    params = {
        "w": jax.random.normal(keys[0], (5, 7), dtype) / 2,
        "b": jax.random.normal(keys[1], (7,), dtype) / 4,
        "v": jax.random.normal(keys[2], (7, 3), dtype) / 2,
    }
    return params, jax.random.normal(keys[3], (9, 5), dtype)


@pytest.mark.parametrize("chunk", [1, 5, 13, 36, 1000])
def test_whole_batch_jacobian_in_chunks_equals_jacrev(chunk):
    params, x = _data()
    expected = jax.jacrev(lambda p: _apply(p, x))(params)
    got = jax.jit(lambda p: _jacobian.whole_batch_jacobian(lambda q: _apply(q, x), p, chunk))(
        params
    )
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        reference.assert_close(a, np.asarray(b, np.float64))


@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])
@pytest.mark.parametrize("under_jit", [False, True], ids=["python_loop", "xla_loop"])
def test_kernel_within_a_small_budget_equals_the_reference(trace_axes, under_jit):
    """A budget that fits a few cotangents at a time: the chunked kernel (chunks looped
    from Python, or inside the program under an outer jax.jit) equals the float64
    whole-batch reference, and the configuration really chunks."""
    params, x = _data()
    budget = 30_000
    kernel = ntk_core.ntk_fn(
        _apply,
        trace_axes=trace_axes,
        vmap_axes=None,
        implementation="jacobian",
        memory_budget=budget,
    )
    values = values_written(jax.make_jaxpr(_apply)(params, x).jaxpr)
    n_params = 5 * 7 + 7 + 7 * 3
    assert values * 4 + 9 * 4 * (values // 2 + n_params) * 4 > budget  # all at once: too big
    plan = kernel.plan(params, x)
    (jac,) = [e for e in plan.estimates if e.implementation == "jacobian"]
    assert jac.memory_bytes <= budget
    chunks = -(-plan.whole_batch.cotangents // plan.whole_batch.chunk)
    assert plan.whole_batch.cotangents == 9 * 4 and chunks > 1
    assert f"({chunks} chunks;" in str(plan)
    k = jax.jit(lambda p, a: kernel(p, a))(params, x) if under_jit else kernel(params, x)
    expected = reference.ntk(_apply, params, x, None, trace_axes)  # leaves: energy, logits
    for name, e in zip(("energy", "logits"), expected, strict=True):
        reference.assert_close(np.asarray(k[name]), e)


def test_chunk_size_follows_the_budget():
    closed = jax.make_jaxpr(_apply)(*_data())
    values = values_written(closed.jaxpr)
    per = (values // 2 + 63) * 4
    small = _cost.whole_batch(closed.jaxpr, 63, 36, 4, values * 4 + 3 * per, 0)
    assert small.chunk == 3 and small.peak_bytes <= values * 4 + 3 * per
    assert _cost.whole_batch(closed.jaxpr, 63, 36, 4, 10**9, 0).chunk == 36
    assert _cost.whole_batch(closed.jaxpr, 63, 36, 4, 1, 0).chunk == 1


def test_a_batch_beyond_the_budget_is_refused_before_running():
    calls = []

    def apply_fn(p, x):
        calls.append(1)
        return jnp.tanh(x @ p["w"]) @ p["v"]

    params, x = _data()
    kernel = ntk_core.ntk_fn(apply_fn, vmap_axes=None, memory_budget=1000)
    with pytest.raises(ValueError, match=r"vmap_axes=None differentiates 9 samples") as e:
        kernel(params, x)
    assert "memory_budget" in str(e.value) and "Fix: pass vmap_axes=0" in str(e.value)
    assert "> memory_budget 1000 bytes" in str(e.value)
    assert "memory_budget >= " in str(e.value)
    assert len(calls) == 1  # one abstract trace, nothing compiled or run


def test_plan_counts_the_whole_batch_reverse_work():
    """Each output cotangent's reverse pass runs over all N samples: with vmap_axes=None
    the Jacobian contraction's reverse work is N²·O passes' worth, not N·O."""
    params, _ = _data()
    flops = {}
    for vmap_axes in (0, None):
        kernel = ntk_core.ntk_fn(
            lambda p, x: jnp.tanh(x @ p["w"] + p["b"]) @ p["v"],
            vmap_axes=vmap_axes,
            implementation="jacobian",
        )
        for n in (50, 100):
            x = jnp.ones((n, 5))
            (e,) = [e for e in kernel.plan(params, x).estimates if e.implementation == "jacobian"]
            flops[vmap_axes, n] = e.flops
    # The contraction is the same; the reverse passes add N²·O·G instead of N·O·G. With
    # vmap_axes=None G is read from the whole batch's jaxpr (per sample), which lacks the
    # one-sample jaxpr's batch axis of one added and removed (8 values of ~500 per pass).
    extra = {n: flops[None, n] - flops[0, n] for n in (50, 100)}
    assert extra[50] > 0
    assert extra[100] / extra[50] == pytest.approx((100**2 - 100) / (50**2 - 50), rel=2e-3)


#: Models for a whole batch whose output rows are not samples (issue 48: neural-tangents'
#: structured-derivatives cases; three 3 x 3 parameters, inputs (3, 3)): auto traced them
#: on a batch of one for its cost model and failed (NotPerSample, a bare dot_general
#: TypeError), ntvp refused them; the whole-batch Jacobian is the truth.
WHOLE_BATCH_MODELS = {
    # A product over the batch axis: p @ x contracts x's samples.
    "product_over_the_batch": lambda p, x: [
        p[0] * p[1] * p[2] + (p[0] @ p[1].T) @ (p[2].T @ p[1]) @ x
    ],
    # An output of the parameters alone, through a squeezed batch axis of one.
    "no_input": lambda p, x: jnp.squeeze(jnp.expand_dims(p[0], 0)),
}


def _three_by_three():
    keys = jax.random.split(jax.random.PRNGKey(5), 5)
    params = [jax.random.normal(k, (3, 3)) / 2 for k in keys[:3]]
    return params, jax.random.normal(keys[3], (3, 3)), jax.random.normal(keys[4], (3, 3))


@pytest.mark.parametrize("implementation", ["auto", "jacobian", "structured", "ntvp"])
def test_outputs_without_sample_rows_equal_the_reference(implementation):
    """With vmap_axes=None every implementation gives the float64 whole-batch kernel of
    models whose rows are not samples (and the blocked engine, in one tile), and none
    evaluates the model on a batch of one."""
    params, x1, x2 = _three_by_three()
    for name, model in WHOLE_BATCH_MODELS.items():
        batches = set()

        def apply_fn(p, x, model=model, batches=batches):
            batches.add(x.shape[0])
            return model(p, x)

        kernel = ntk_core.ntk_fn(
            apply_fn, trace_axes=(), vmap_axes=None, implementation=implementation
        )
        got = jax.tree.leaves(kernel(params, x1, x2))
        expected = reference.ntk(model, params, x1, x2, trace_axes=())
        assert len(got) == len(expected), name
        for k, e in zip(got, expected, strict=True):
            reference.assert_close(np.asarray(k), e)
        assert batches == {3}, (name, batches)  # the batches given, never one sample
        if implementation == "auto":  # in tiles of the whole batch: the same kernel
            tiled = ntk_core.ntk_fn(model, trace_axes=(), vmap_axes=None, batch_size="auto")
            for k, e in zip(jax.tree.leaves(tiled(params, x1, x2)), expected, strict=True):
                reference.assert_close(np.asarray(k), e)
    assert kernel.implementation_for(params, x1, x2) in ("jacobian", "ntvp")


def _empty_kernel(out_shape, n2):
    """The kernel of an output of zero values per sample, trace_axes=(): (N1, N2, O, O)."""
    return np.zeros((out_shape[0], n2) + tuple(s for s in out_shape[1:] for _ in (0, 1)))


def _some(p, x):
    """The output of "empty_leaves" that has values: one empty leaf summed in, another
    multiplied by no values."""
    return jnp.tanh(x @ p["w"]) + p["e"].sum() + (x[:, :0] @ p["f"]).sum()


#: Zero-size parameters and outputs (issue 48: JAX's reshape(-1) raised a bare
#: ZeroDivisionError in "jacobian" and "structured"): (model, params, x).
ZERO_SIZE = {
    "identity_of_nothing": (
        lambda p, x: x,
        [jnp.ones((1, 1)), jnp.ones((0, 0)), jnp.ones((0, 1))],
        jnp.ones((2, 0)),
    ),
    "empty_leaves": (
        lambda p, x: {"none": jnp.tanh(x) @ p["z"], "some": _some(p, x)},
        {
            "w": jnp.ones((3, 2)) / 3,
            "e": jnp.ones((0, 4)),
            "f": jnp.ones((0, 2)),
            "z": jnp.ones((3, 0)),
        },
        jnp.linspace(-1.0, 1.0, 6).reshape(2, 3),
    ),
}


@pytest.mark.parametrize("vmap_axes", [0, None])
@pytest.mark.parametrize("case", sorted(ZERO_SIZE))
def test_zero_size_parameters_and_outputs(case, vmap_axes):
    """Every implementation gives the empty kernel of an output with no values, and
    the float64 reference of an output beside it, of parameters some of which are
    empty."""
    model, params, x = ZERO_SIZE[case]
    for implementation in ("jacobian", "structured", "ntvp"):  # "auto" picks one of them
        kernel = ntk_core.ntk_fn(
            model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation
        )
        for x2 in (None, x) if case == "identity_of_nothing" else (x,):  # issue's: both
            got = kernel(params, x, x2)
            empty = got["none"] if isinstance(got, dict) else got
            assert empty.shape == (2, 2, 0, 0), (implementation, empty.shape)
            if isinstance(got, dict):
                (expected,) = reference.ntk(_some, params, x, x2, trace_axes=())
                reference.assert_close(np.asarray(got["some"]), expected)
