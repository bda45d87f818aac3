"""ntk_core.KernelTracker: the metrics it records equal ntk_core.metrics applied to
independently computed kernels, untracked steps do nothing, kernels and metrics are
saved, and bad arguments get the documented errors."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
from ntk_core import metrics

N, D, H, O = 8, 3, 16, 2  # noqa: E741 - O outputs, as in the docs
X = jax.random.normal(jax.random.PRNGKey(0), (N, D))
Y = np.eye(O)[np.arange(N) % O]  # one-hot (N, O)
TARGETS = jnp.sin(X[:, :O] * 2.0)


def apply_fn(params, x):
    return jnp.tanh(x @ params["w"]) @ params["v"]


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    return {"w": jax.random.normal(k1, (D, H)), "v": jax.random.normal(k2, (H, O)) / 4}


@jax.jit
def _sgd(params):
    grads = jax.grad(lambda p: jnp.mean((apply_fn(p, X) - TARGETS) ** 2))(params)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)


def _flat(k):
    """(N, N) or (N, N, O, O) -> float64 (N·O, N·O), rows ordered (sample, output)."""
    k = np.asarray(k, np.float64)
    if k.ndim == 2:
        return k
    n, _, o, _ = k.shape
    return k.transpose(0, 2, 1, 3).reshape(n * o, n * o)


@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])
def test_records_equal_metrics_of_independent_kernels(trace_axes):
    tracker = ntk_core.KernelTracker(
        ntk_core.ntk_fn(apply_fn, trace_axes=trace_axes), X, Y, every=3, top_k=4, keep_kernels=True
    )
    params, at_steps = _params(), {}
    for step in range(10):
        record = tracker.update(step, params)
        assert (record is None) == (step % 3 != 0)
        if record is not None:
            at_steps[step] = params
        params = _sgd(params)
    assert list(at_steps) == [0, 3, 6, 9]
    history = tracker.history
    np.testing.assert_array_equal(history["step"], [0, 3, 6, 9])
    assert history["step"].dtype == np.int64
    assert history["top_eigenvalues"].shape == (4, 4)
    k0 = ntk_core.empirical_ntk(apply_fn, at_steps[0], X, trace_axes=trace_axes)
    for i, (step, p) in enumerate(at_steps.items()):
        k = ntk_core.empirical_ntk(apply_fn, p, X, trace_axes=trace_axes)  # independent
        np.testing.assert_allclose(tracker.kernels[i], k, rtol=1e-6, atol=1e-7)
        record = tracker.records[i]
        assert record.step == step
        assert record.kernel_distance == pytest.approx(metrics.kernel_distance(k0, k), abs=1e-6)
        assert record.alignment == pytest.approx(metrics.kernel_alignment(k, Y), rel=1e-6)
        assert record.centered_alignment == pytest.approx(
            metrics.centered_kernel_alignment(k, Y), rel=1e-6
        )
        assert record.effective_rank == pytest.approx(metrics.effective_rank(k), rel=1e-6)
        eig = np.linalg.eigvalsh(_flat(k))[::-1]
        np.testing.assert_allclose(record.top_eigenvalues, eig[:4], rtol=1e-5)
        assert record.trace == pytest.approx(np.trace(_flat(k)), rel=1e-6)
        for field in ("kernel_distance", "alignment", "effective_rank", "trace"):
            assert history[field][i] == getattr(record, field)
    assert history["kernel_distance"][0] == 0.0
    assert np.all(history["kernel_distance"][1:] > 1e-4)  # the kernel moved
    np.testing.assert_array_equal(tracker.initial_kernel, tracker.kernels[0])


def test_untracked_steps_do_not_call_the_kernel_function():
    calls = []
    kernel = ntk_core.ntk_fn(apply_fn)

    def counting(params, x):
        calls.append(1)
        return kernel(params, x)

    tracker = ntk_core.KernelTracker(counting, X, every=4)
    params = _params()
    for step in range(13):
        result = tracker.update(step, params)
        assert len(calls) == step // 4 + 1
        assert (result is None) == (step % 4 != 0)
        assert tracker.is_due(step) == (step % 4 == 0)
    assert len(tracker.records) == 4
    assert np.isnan(tracker.history["alignment"]).all()  # no labels
    assert np.isnan(tracker.history["centered_alignment"]).all()


def test_probe_pytrees_and_kernel_keyword_arguments():
    """A dict probe set; keyword arguments of update reach the kernel function."""
    kernel = ntk_core.ntk_fn(lambda p, x: apply_fn(p, x["a"] * x["b"]))
    seen = []

    def with_scale(params, x, *, scale):
        seen.append(scale)
        return kernel(params, x) * scale

    x = {"a": X, "b": jnp.ones((N, 1))}
    tracker = ntk_core.KernelTracker(with_scale, x, Y[:, 0], every=1, top_k=2)
    tracker.update(0, _params(), scale=1.0)
    tracker.update(1, _params(), scale=2.0)
    assert seen == [1.0, 2.0]
    assert tracker.records[1].kernel_distance == pytest.approx(0.0, abs=1e-7)  # a scale
    assert tracker.records[1].trace == pytest.approx(2 * tracker.records[0].trace, rel=1e-6)


def test_saving_kernels_and_metrics(tmp_path):
    out = tmp_path / "run"
    tracker = ntk_core.KernelTracker(
        ntk_core.ntk_fn(apply_fn), X, Y, every=2, top_k=3, keep_kernels=True, out=out
    )
    params = _params()
    for step in range(7):
        tracker.update(step, params)
        params = _sgd(params)
    names = [f"kernel_step_{s:08d}.npy" for s in (0, 2, 4, 6)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, "metrics.json"])
    for name, kept in zip(names, tracker.kernels, strict=True):
        np.testing.assert_array_equal(np.load(out / name), kept)
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["kernel_files"] == names
    assert saved["every"] == 2 and saved["top_k"] == 3 and saved["n_probe"] == N
    assert saved["kernel_shape"] == [N, N] and saved["kernel_dtype"] == "float32"
    for field, values in tracker.history.items():
        np.testing.assert_array_equal(np.asarray(saved["history"][field]), values)
    assert saved["history"]["kernel_distance"][0] == 0.0


def test_metrics_json_writes_null_without_labels(tmp_path):
    tracker = ntk_core.KernelTracker(ntk_core.ntk_fn(apply_fn), X, every=1, out=tmp_path)
    tracker.update(0, _params())
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["has_labels"] is False
    assert saved["history"]["alignment"] == [None]
    assert saved["kernel_files"] == ["kernel_step_00000000.npy"]


def test_out_holding_an_earlier_run_is_refused_unless_overwrite(tmp_path):
    first = ntk_core.KernelTracker(ntk_core.ntk_fn(apply_fn), X, every=1, out=tmp_path)
    first.update(0, _params())
    first.update(1, jax.tree.map(lambda v: 1.5 * v, _params()))
    kept = np.load(tmp_path / "kernel_step_00000001.npy")
    (tmp_path / "notes.txt").write_text("the user's own file")
    with pytest.raises(ValueError, match=r"^KernelTracker: out=.* holds an earlier run's files"):
        ntk_core.KernelTracker(ntk_core.ntk_fn(apply_fn), X, every=1, out=tmp_path)
    np.testing.assert_array_equal(np.load(tmp_path / "kernel_step_00000001.npy"), kept)
    failing = ntk_core.KernelTracker(
        ntk_core.ntk_fn(apply_fn), X, every=1, top_k=10**6, out=tmp_path, overwrite=True
    )
    with pytest.raises(ValueError, match="top_k"):  # a first step that fails writes nothing
        failing.update(0, _params())
    np.testing.assert_array_equal(np.load(tmp_path / "kernel_step_00000001.npy"), kept)
    second = ntk_core.KernelTracker(
        ntk_core.ntk_fn(apply_fn), X, every=1, out=tmp_path, overwrite=True
    )
    second.update(0, jax.tree.map(lambda v: 2.0 * v, _params()))  # run 1's step 1: gone
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "kernel_step_00000000.npy",
        "metrics.json",
        "notes.txt",
    ]
    np.testing.assert_array_equal(
        np.load(tmp_path / "kernel_step_00000000.npy"), second.initial_kernel
    )


def test_out_expands_the_home_folder_and_overwrite_is_checked_without_out(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    tracker = ntk_core.KernelTracker(ntk_core.ntk_fn(apply_fn), X, every=1, out="~/runs")
    assert tracker.out == str(tmp_path / "runs") and (tmp_path / "runs").is_dir()
    with pytest.raises(TypeError, match="^KernelTracker: overwrite must be True or False"):
        ntk_core.KernelTracker(ntk_core.ntk_fn(apply_fn), X, every=1, overwrite="yes")


def test_history_before_any_step_is_empty():
    history = ntk_core.KernelTracker(ntk_core.ntk_fn(apply_fn), X, every=5, top_k=2).history
    assert history["step"].shape == (0,)
    assert history["top_eigenvalues"].shape == (0, 2)
    assert list(history) == list(ntk_core.KernelRecord._fields)


KERNEL = ntk_core.ntk_fn(apply_fn)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(every=0), ValueError, r"^KernelTracker: every must be a positive int, got 0\. Fix:"),
        (dict(every=True), TypeError, r"^KernelTracker: every must be a positive int, got True"),
        (dict(every=1, top_k=0), ValueError, r"^KernelTracker: top_k must be a positive int"),
        (dict(every=1, top_k=2.0), TypeError, r"^KernelTracker: top_k must be a positive int"),
        (dict(every=1, keep_kernels=1), TypeError, r"^KernelTracker: keep_kernels must be True"),
        (dict(every=1, y=np.ones((N + 1, O))), ValueError, r"^KernelTracker: y has shape \(9, 2\), not \(8,\)"),
        (dict(every=1, y=np.ones((N, O, 1))), ValueError, r"^KernelTracker: y has shape \(8, 2, 1\)"),
        (dict(every=1, y=np.array(["a"] * N)), TypeError, r"^KernelTracker: y must be real numbers"),
        (dict(every=1, y=np.full(N, np.nan)), ValueError, r"^KernelTracker: y contains NaN"),
        (dict(every=1, x_probe={}), ValueError, r"^KernelTracker: x_probe must hold arrays of one size N >= 1 on axis 0, got shapes \[\]"),
        (dict(every=1, x_probe=jnp.ones((0, D))), ValueError, r"^KernelTracker: x_probe must hold arrays .* got shapes \[\(0, 3\)\]"),
        (dict(every=1, x_probe={"a": X, "b": X[:3]}), ValueError, r"^KernelTracker: x_probe must hold arrays of one size .*\[\(8, 3\), \(3, 3\)\]"),
        (dict(every=1, kernel_fn="ntk"), TypeError, r"^KernelTracker: kernel_fn must be a callable"),
        (dict(every=1, y=np.arange(N) % 4), ValueError, r"^KernelTracker: y is a vector of 4 distinct integers \(class ids\?\).*one-hot"),
    ],
)  # fmt: skip
def test_constructor_errors(kwargs, error, match):
    arguments = dict(kernel_fn=KERNEL, x_probe=X) | kwargs
    with pytest.raises(error, match=match) as info:
        ntk_core.KernelTracker(**arguments)
    assert "Fix:" in str(info.value)


def test_update_errors():
    params = _params()
    tracker = ntk_core.KernelTracker(KERNEL, X, every=2)
    for step in (1.0, "3", np.array(2)):
        with pytest.raises(
            TypeError, match=r"^KernelTracker.update: step must be a non-negative int.*Fix:"
        ):
            tracker.update(step, params)
    with pytest.raises(TypeError, match=r"^KernelTracker.update: step is a jax.Array"):
        tracker.update(jnp.array(3), params)
    with pytest.raises(
        ValueError, match=r"^KernelTracker.update: step must be a non-negative int, got -2.*Fix:"
    ):
        tracker.update(-2, params)
    tracker.update(np.int64(4), params)  # numpy integers are fine
    with pytest.raises(ValueError, match=r"^KernelTracker.update: step 2 is not after .* 4.*Fix:"):
        tracker.update(2, params)
    full = ntk_core.ntk_fn(apply_fn, trace_axes=())  # (N, N, O, O): y must be (N, O)
    with pytest.raises(
        ValueError,
        match=r"^KernelTracker.update: y has shape \(8,\); the kernel \(8, 8, 2, 2\) needs \(N, O\) = \(8, 2\).*Fix:",
    ):
        ntk_core.KernelTracker(full, X, Y[:, 0], every=1).update(0, params)
    top_k = r"^KernelTracker.update: top_k must be an int in \[1, 8\], got 9: the kernel has "
    with pytest.raises(ValueError, match=top_k + r"N·O = 8·1 eigenvalues .*Fix: pass top_k <= 8"):
        ntk_core.KernelTracker(KERNEL, X, every=1, top_k=9).update(0, params)
    # top_k > N is no mistake where O > 1: the same top_k on the full kernel (N·O = 16) runs
    top = ntk_core.KernelTracker(full, X, every=1, top_k=9).update(0, params).top_eigenvalues
    expected = np.linalg.eigvalsh(_flat(full(params, X)))[::-1]  # numpy on the kernel itself
    np.testing.assert_allclose(top, expected[:9], rtol=1e-5)
    with pytest.raises(
        ValueError, match=r"^KernelTracker.update: the kernel function returned shape \(8, 2\)"
    ):
        ntk_core.KernelTracker(apply_fn, X, every=1).update(0, params)
    with pytest.raises(
        TypeError, match=r"^KernelTracker.update: the kernel function returned dict"
    ):
        ntk_core.KernelTracker(lambda p, x: {"k": KERNEL(p, x)}, X, every=1).update(0, params)
    tracker = ntk_core.KernelTracker(lambda p, x: KERNEL(p, x).at[0, 1].add(1.0), X, every=1)
    with pytest.raises(ValueError, match=r"^KernelTracker.update: kernel is not symmetric"):
        tracker.update(0, params)
    assert tracker.records == [] and tracker.initial_kernel is None


@pytest.mark.parametrize("m", [None, 20])
def test_other_parameters_than_the_last_step_are_noted_by_update(m):
    # The kernel function fails on parameters of another structure or shape than the last
    # tracked step's: its error stays (type and message), with a note naming update and
    # both; a failure on parameters shaped as before gets no note.
    kernel_fn = ntk_core.ntk_fn(apply_fn, trace_axes=() if m else (-1,))
    key = jax.random.PRNGKey(0) if m else None
    tracker = ntk_core.KernelTracker(kernel_fn, X, every=1, m=m, key=key)
    params = _params()
    tracker.update(0, params)
    wrong = {"w": params["w"][:2], "v": params["v"]}  # (2, H): does not fit x (N, 3)
    with pytest.raises(ValueError, match="^ntk_fn: ") as info:
        tracker.update(1, wrong)
    note = r"^KernelTracker.update: params_like at step 1 is .*\(2, 16\).* where step 0's was .*\(3, 16\)"
    assert len(info.value.__notes__) == 1 and re.match(note, info.value.__notes__[0])
    nan = jax.tree.map(lambda a: a * jnp.nan, params)
    with pytest.raises(ntk_core.NonFiniteError) as info:
        tracker.update(2, nan)
    assert not getattr(info.value, "__notes__", None)
    assert tracker.update(3, params).step == 3  # the same parameters still track
