"""ntk_core.KernelTracker in Haiku training loops: params updated by optax, tracked with
ntk_haiku.kernel_fn; an hk.transform_with_state model's state passed through update."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ntk_core
import ntk_haiku
from ntk_core import metrics

X = jax.random.normal(jax.random.PRNGKey(0), (6, 3))
TARGETS = jax.random.normal(jax.random.PRNGKey(1), (6, 2))


def test_haiku_params_updated_by_optax():
    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([8, 2])(x)))
    params = net.init(jax.random.PRNGKey(2), X)
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: jnp.mean((net.apply(p, X) - TARGETS) ** 2))(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    tracker = ntk_core.KernelTracker(ntk_haiku.kernel_fn(net), X, TARGETS, every=2, top_k=3)
    at_steps = []
    for i in range(9):
        if tracker.update(i, params) is not None:
            at_steps.append(params)
        params, opt_state = step(params, opt_state)
    assert list(tracker.history["step"]) == [0, 2, 4, 6, 8]
    k0 = ntk_core.empirical_ntk(net.apply, at_steps[0], X)
    for record, p in zip(tracker.records, at_steps, strict=True):
        k = ntk_core.empirical_ntk(net.apply, p, X)  # independent of the adapter
        assert record.kernel_distance == pytest.approx(metrics.kernel_distance(k0, k), abs=1e-6)
        assert record.alignment == pytest.approx(metrics.kernel_alignment(k, TARGETS), rel=1e-5)
        eig = np.linalg.eigvalsh(np.asarray(k, np.float64))[::-1][:3]
        np.testing.assert_allclose(record.top_eigenvalues, eig, rtol=1e-5)
    assert tracker.records[-1].kernel_distance > 1e-4


def forward(x, is_training):
    h = hk.Linear(8)(x)
    h = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(h, is_training)
    return hk.Linear(2)(jax.nn.relu(h))


def test_haiku_state_reaches_the_kernel_function():
    net = hk.transform_with_state(forward)
    params, state = net.init(jax.random.PRNGKey(2), X, is_training=True)
    optimizer = optax.adam(0.05)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, state, opt_state):
        def loss(p):
            out, new_state = net.apply(p, state, None, X, is_training=True)
            return jnp.mean((out - TARGETS) ** 2), new_state

        grads, state = jax.grad(loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), state, opt_state

    kernel = ntk_haiku.kernel_fn(net, apply_kwargs={"is_training": False})
    tracker = ntk_core.KernelTracker(kernel, X, every=3, keep_kernels=True)
    for i in range(7):
        record = tracker.update(i, params, state=state)  # keyword arguments go to kernel
        if record is not None:
            expected = ntk_haiku.kernel(
                net, params, X, state=state, apply_kwargs={"is_training": False}
            )
            np.testing.assert_array_equal(tracker.kernels[-1], expected)
        params, state, opt_state = step(params, state, opt_state)
    assert len(tracker.kernels) == 3
    assert not np.allclose(tracker.kernels[0], tracker.kernels[-1])
