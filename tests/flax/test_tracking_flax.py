"""ntk_core.KernelTracker in Flax training loops: a linen TrainState updated by optax
(compiled once for the run: a trace counter and XLA's compile events) and an nnx module
updated in place by nnx.Optimizer (tracked with kernel_fn(model) called with None)."""

from __future__ import annotations

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import ntk_core
import ntk_flax
from ntk_core import metrics

X = jax.random.normal(jax.random.PRNGKey(0), (6, 4))  # the probe set and the batch
LABELS = np.arange(6) % 3
Y = np.eye(3)[LABELS]  # one-hot (N, O)

TRACES = []


class Counting(nn.Module):
    @nn.compact
    def __call__(self, x):
        TRACES.append(1)  # runs only while JAX traces (init, the train step, the kernel)
        return nn.Dense(3)(jnp.tanh(nn.Dense(8)(x)))


#: jax.monitoring's event for each XLA compilation (jax._src.dispatch.BACKEND_COMPILE_EVENT).
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def compilations():
    """The list of XLA compilations, one entry each, while the test runs."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
    if unregister is not None:
        unregister(listener)


def test_linen_train_state_is_compiled_once_for_the_run(compilations):
    model = Counting()
    variables = model.init(jax.random.PRNGKey(1), X)
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=optax.sgd(0.2, momentum=0.9)
    )

    @jax.jit
    def train_step(state):
        def loss(p):
            logits = state.apply_fn({"params": p}, X)
            return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean()

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    calls = []
    kernel = ntk_flax.kernel_fn(model)

    def counted(state, x):
        calls.append(1)
        return kernel(state, x)

    tracker = ntk_core.KernelTracker(counted, X, Y, every=3, keep_kernels=True)
    states, traces, compiled = [], {}, {}
    for step in range(19):  # tracked: 0, 3, ..., 18 (7 steps); 12 untracked
        n_traces, n_compiled, n_calls = len(TRACES), len(compilations), len(calls)
        record = tracker.update(step, state)
        if record is None:  # nothing traced, compiled or called
            assert (len(TRACES), len(compilations), len(calls)) == (n_traces, n_compiled, n_calls)
        else:
            states.append(state)
            traces[len(states)], compiled[len(states)] = len(TRACES), len(compilations)
        state = train_step(state)
    assert len(states) == 7 and len(calls) == 7
    # The model is traced a bounded number of times: none after the second tracked step.
    assert traces[2] == traces[6] == traces[7] == len(TRACES)
    if compilations:  # the listener works on this jax: nothing compiled after step 2 either
        assert compiled[2] == compiled[7] == len(compilations)
    # Each kernel is the kernel of that step's params, computed independently.
    for i, s in enumerate(states):
        k = ntk_core.empirical_ntk(lambda p, x: model.apply({"params": p}, x), s.params, X)
        np.testing.assert_allclose(tracker.kernels[i], k, rtol=1e-5, atol=1e-6)
        assert tracker.records[i].centered_alignment == pytest.approx(
            metrics.centered_kernel_alignment(k, Y), rel=1e-5
        )
    assert tracker.history["kernel_distance"][-1] > 1e-3  # training moved the kernel


class Net(nnx.Module):
    def __init__(self, rngs):
        self.dense_0 = nnx.Linear(4, 8, rngs=rngs)
        self.dense_1 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.dense_1(jnp.tanh(self.dense_0(x)))


_UPDATE_TAKES_MODEL = "model" in inspect.signature(nnx.Optimizer.update).parameters


@nnx.jit
def _nnx_step(model, optimizer):
    def loss(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(X), LABELS).mean()

    grads = nnx.grad(loss)(model)
    if _UPDATE_TAKES_MODEL:  # flax >= 0.11
        optimizer.update(model, grads)
    else:
        optimizer.update(grads)


def test_nnx_module_updated_in_place_by_the_optimizer():
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    tracker = ntk_core.KernelTracker(
        ntk_flax.kernel_fn(model, trace_axes=()), X, Y, every=2, top_k=3, keep_kernels=True
    )
    for step in range(7):
        record = tracker.update(step, None)  # the module's parameters as they are now
        if record is not None:
            graphdef, params = nnx.split(model, nnx.Param)
            k = ntk_core.empirical_ntk(
                lambda p, x, g=graphdef: nnx.merge(g, p)(x), params, X, trace_axes=()
            )
            assert k.shape == (6, 6, 3, 3)
            np.testing.assert_allclose(tracker.kernels[-1], k, rtol=1e-5, atol=1e-6)
            assert record.alignment == pytest.approx(metrics.kernel_alignment(k, Y), rel=1e-5)
        _nnx_step(model, optimizer)
    kernels = tracker.kernels
    assert len(kernels) == 4
    for a, b in zip(kernels, kernels[1:], strict=False):
        assert not np.allclose(a, b)  # the updates reached the tracker
    assert np.all(tracker.history["kernel_distance"][1:] > 1e-4)


def test_matrix_free_tracking_of_a_flax_kernel_fn():
    """m= on ntk_flax.kernel_fn(model, trace_axes=(), wrt=...): the model's fixed parts and
    subset as the kernel sees them; at m >= M = N·O the records equal the exact tracker's."""
    model = Counting()
    variables = model.init(jax.random.PRNGKey(1), X)
    kernel = ntk_flax.kernel_fn(model, trace_axes=(), wrt="Dense_0")
    exact = ntk_core.KernelTracker(kernel, X, Y, every=1, keep_kernels=True)
    m = X.shape[0] * 3
    estimated = ntk_core.KernelTracker(kernel, X, Y, every=1, m=m, key=jax.random.PRNGKey(0))
    for tracker in (exact, estimated):
        tracker.update(0, variables)
    e, r = exact.records[0], estimated.records[0]
    flat = np.asarray(exact.kernels[0], np.float64)
    assert r.trace == pytest.approx(e.trace, rel=2e-6)
    assert r.frobenius_sq == pytest.approx(float(np.sum(flat**2)), rel=1e-5)
    assert r.effective_rank == pytest.approx(e.effective_rank, rel=1e-4)
    assert r.alignment == pytest.approx(e.alignment, rel=1e-5)
    whole = ntk_core.KernelTracker(ntk_flax.kernel_fn(model, trace_axes=()), X, every=1, m=m,
                                   key=jax.random.PRNGKey(0))  # fmt: skip
    assert whole.update(0, variables).trace > 1.01 * r.trace  # the subset's, not the whole's
