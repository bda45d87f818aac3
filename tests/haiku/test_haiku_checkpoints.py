"""Kernels from saved checkpoints of a Haiku training loop: an
``hk.transform_with_state`` model with BatchNorm, trained in training mode, its params
and state saved with orbax and restored; the kernel in evaluation mode equals the
in-memory one, bit for bit, and the float64 reference."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ntk_haiku
import reference

ocp = pytest.importorskip("orbax.checkpoint")


def forward(x, is_training):
    h = hk.Linear(8)(x)
    h = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(h, is_training)
    return hk.Linear(2)(jax.nn.relu(h))


def _training_run(steps_between: int = 3, checkpoints: int = 2):
    """(net, x, [(params, state), ...]) at each checkpoint of a short adam run."""
    net = hk.transform_with_state(forward)
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 3))
    y = jax.random.normal(jax.random.PRNGKey(1), (6, 2))
    params, state = net.init(jax.random.PRNGKey(2), x, is_training=True)
    optimizer = optax.adam(0.05)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, state, opt_state):
        def loss(p):
            out, new_state = net.apply(p, state, None, x, is_training=True)
            return jnp.mean((out - y) ** 2), new_state

        grads, state = jax.grad(loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), state, opt_state

    saved = []
    for _ in range(checkpoints):
        for _ in range(steps_between):
            params, state, opt_state = step(params, state, opt_state)
        saved.append((params, state))
    return net, x, saved


def test_orbax_params_and_state_round_trip_gives_the_same_kernels(tmp_path):
    net, x, saved = _training_run()
    paths = [tmp_path / f"checkpoint_{i}" for i in range(len(saved))]
    with ocp.StandardCheckpointer() as checkpointer:
        for path, (params, state) in zip(paths, saved, strict=True):
            checkpointer.save(path, {"params": params, "state": state})
        checkpointer.wait_until_finished()
        params, state = saved[0]
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "state": state})
        restored = [checkpointer.restore(path, abstract) for path in paths]
    kw = dict(apply_kwargs={"is_training": False}, trace_axes=())
    kernels = []
    for (params, state), back in zip(saved, restored, strict=True):
        k = ntk_haiku.kernel(net, back["params"], x, state=back["state"], **kw)
        np.testing.assert_array_equal(
            np.asarray(k), np.asarray(ntk_haiku.kernel(net, params, x, state=state, **kw))
        )
        kernels.append(np.asarray(k))
    assert not np.allclose(kernels[0], kernels[1])  # params and statistics moved
    back = restored[1]

    def f(p, x):
        return net.apply(p, back["state"], None, x, is_training=False)[0]

    reference.assert_close(kernels[1], reference.ntk(f, back["params"], x, None, trace_axes=())[0])
    # The running statistics are used: the training-mode statistics give another kernel.
    initial = net.init(jax.random.PRNGKey(2), x, is_training=True)[1]
    other = ntk_haiku.kernel(net, back["params"], x, state=initial, **kw)
    assert not np.allclose(np.asarray(other), kernels[1])
