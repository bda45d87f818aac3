"""KernelTracker with m= (matrix-free): at every tracked step of a short training run the
records agree with the exact tracker's on the same steps: the trace equal (both exact),
‖Θ‖²_F, the effective rank and the alignment within 6 of their own standard errors (fixed
keys; the band and its reason as tests/core/test_matrix_free.py), and equal to them at
m >= M = N·O; wrt= of the kernel function is honoured; bad arguments get their errors."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core

N, D, H, O = 40, 4, 12, 2  # noqa: E741 - O outputs; M = N·O = 80
M = N * O
X = jax.random.normal(jax.random.PRNGKey(0), (N, D))
Y = np.eye(O)[np.arange(N) % O] - 0.5
TARGETS = jnp.sin(X[:, :O] * 2.0)


def apply_fn(params, x):
    return jnp.tanh(x @ params["w"] + params["b"]) @ params["v"]


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    w, v = jax.random.normal(k1, (D, H)), jax.random.normal(k2, (H, O)) / 4
    return {"w": w, "b": jnp.zeros(H), "v": v}


@jax.jit
def _sgd(params):
    grads = jax.grad(lambda p: jnp.mean((apply_fn(p, X) - TARGETS) ** 2))(params)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)


def _run(*trackers, steps=5):
    params = _params()
    for step in range(steps):
        for tracker in trackers:
            tracker.update(step, params)
        params = _sgd(params)


def _frobenius(kernels):
    return np.array([np.sum(np.asarray(k, np.float64) ** 2) for k in kernels])


@pytest.mark.parametrize("wrt", [None, "w"], ids=["all", "subset"])
def test_estimates_agree_with_the_exact_tracker_within_standard_errors(wrt):
    kernel = ntk_core.ntk_fn(apply_fn, trace_axes=(), wrt=wrt)
    exact = ntk_core.KernelTracker(kernel, X, Y, every=2, keep_kernels=True)
    key = jax.random.PRNGKey(2)
    estimated = ntk_core.KernelTracker(kernel, X, Y, every=2, m=60, steps=3, key=key)
    _run(exact, estimated)
    e, r = exact.history, estimated.history
    assert list(r["step"]) == list(e["step"]) == [0, 2, 4]
    np.testing.assert_allclose(r["trace"], e["trace"], rtol=2e-6)
    pairs = [
        (r["frobenius_sq"], r["frobenius_sq_se"], _frobenius(exact.kernels)),
        (r["effective_rank"], r["effective_rank_se"], e["effective_rank"]),
        (r["alignment"], r["alignment_se"], e["alignment"]),
    ]
    for estimate, se, truth in pairs:
        assert np.all(se > 0)
        assert np.all(np.abs(estimate - truth) <= 6 * se), (estimate, se, truth)
    assert list(r["products"]) == [60 + 8 * 7 + 1] * 3  # F: m; rank: k = 60 // 7 = 8
    assert r["products"].dtype == np.int64
    again = ntk_core.KernelTracker(kernel, X, Y, every=2, m=60, steps=3, key=key)
    _run(again)
    assert again.records == [
        rec._replace(seconds=a.seconds)
        for rec, a in zip(estimated.records, again.records, strict=True)
    ]


def test_m_covering_the_kernel_gives_the_exact_records():
    kernel = ntk_core.ntk_fn(apply_fn, trace_axes=())
    exact = ntk_core.KernelTracker(kernel, X, Y, every=3, keep_kernels=True)
    estimated = ntk_core.KernelTracker(kernel, X, Y, every=3, m=M, key=jax.random.PRNGKey(0))
    _run(exact, estimated)
    e, r = exact.history, estimated.history
    np.testing.assert_allclose(r["frobenius_sq"], _frobenius(exact.kernels), rtol=1e-5)
    np.testing.assert_allclose(r["effective_rank"], e["effective_rank"], rtol=1e-4)
    np.testing.assert_allclose(r["alignment"], e["alignment"], rtol=1e-5)
    assert np.all(r["frobenius_sq_se"] == 0) and np.all(r["alignment_se"] == 0)


def test_without_labels_and_to_disk(tmp_path):
    kernel = ntk_core.ntk_fn(apply_fn, trace_axes=())
    tracker = ntk_core.KernelTracker(
        kernel, X, every=1, m=40, steps=2, key=jax.random.PRNGKey(0), out=tmp_path
    )
    _run(tracker, steps=2)
    record = tracker.records[-1]
    assert isinstance(record, ntk_core.EstimateRecord)
    assert math.isnan(record.alignment) and math.isnan(record.alignment_se)
    assert record.products == 40 + 8 * 5  # no alignment product; k = 40 // 5 = 8
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert (saved["m"], saved["steps"], saved["kernel_files"]) == (40, 2, [])
    assert saved["history"]["alignment"] == [None, None]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


KERNEL = ntk_core.ntk_fn(apply_fn, trace_axes=())
KEY = jax.random.PRNGKey(0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(m=2, key=KEY), ValueError, r"^KernelTracker: m must be an int >= 40, got 2"),
        (dict(m=60), TypeError, r"^KernelTracker: key must be one JAX PRNG key, got NoneType"),
        (dict(key=KEY), ValueError, r"^KernelTracker: key is given but m is None"),
        (dict(m=60, key=KEY, keep_kernels=True), ValueError, r"^KernelTracker: keep_kernels=True with m=60"),
        (dict(m=60, key=KEY, steps=0), ValueError, r"^KernelTracker: steps must be a positive int"),
    ],
)  # fmt: skip
def test_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        ntk_core.KernelTracker(KERNEL, X, every=1, **kwargs)
    assert "Fix:" in str(info.value)


def test_m_below_the_minimum_is_refused_as_soon_as_o_is_known():
    """steps = 15: the effective rank takes min(8·(1 + 2·15), N·O) = min(248, 80) = 80
    products here (N = 40, O = 2). Without y the constructor knows N alone: m = 30, below
    O = 1's 40, is refused there with the m that fits any O, and m = 60 at the first update,
    before any product, once the outputs give O; with y (N, O) the constructor refuses it."""
    cap = 8 * (1 + 2 * 15)
    head = r"^KernelTracker: m must be an int >= 40, got 30: the effective rank with steps=15 "
    head += rf"takes .* = min\({cap}, 40·O\) .* known only at the first update\. "
    with pytest.raises(ValueError, match=rf"{head}Fix: pass m >= {cap} \(enough for any O\)"):
        ntk_core.KernelTracker(KERNEL, X, every=1, m=30, key=KEY)
    tracker = ntk_core.KernelTracker(KERNEL, X, every=1, m=60, key=KEY)
    late = rf"^KernelTracker.update: m must be an int >= {M}, got 60: .* = min\({cap}, 40·{O}\)"
    with pytest.raises(
        ValueError, match=rf"{late} .*could check m >= 40 only\. Fix: pass m >= {M}"
    ):
        tracker.update(0, _params())
    assert tracker.records == []
    early = rf"^KernelTracker: m must be an int >= {M}, got 60: .* = min\({cap}, 40·{O}\) "
    with pytest.raises(ValueError, match=rf"{early}NTK-vector products\. Fix: pass m >= {M}"):
        ntk_core.KernelTracker(KERNEL, X, Y, every=1, m=60, key=KEY)


@pytest.mark.parametrize(
    "kernel_fn, error, match",
    [
        (ntk_core.ntk_fn(apply_fn), ValueError, r"^KernelTracker.update: matrix-free tracking needs the full kernel, got trace_axes=\(-1,\)"),
        (ntk_core.nngp_fn(apply_fn, trace_axes=()), TypeError, r"^KernelTracker.update: matrix-free tracking reads the model from an NTK kernel function, got KernelFunction of kind 'nngp'"),
        (lambda p, x: x @ x.T, TypeError, r"^KernelTracker.update: matrix-free tracking .* got function"),
    ],
)  # fmt: skip
def test_update_errors(kernel_fn, error, match):
    tracker = ntk_core.KernelTracker(kernel_fn, X, every=1, m=60, key=KEY)
    with pytest.raises(error, match=match):
        tracker.update(0, _params())
