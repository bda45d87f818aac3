"""Kernels from saved checkpoints of a Flax training loop: a ``TrainState`` saved with
orbax (the ecosystem's checkpoint library) or numpy ``.npz`` files, restored, and given
to ``ntk_flax.kernel`` as it is; the kernel equals the in-memory state's, bit for bit.

Orbax: ``ocp.StandardCheckpointer``, whose ``save(path, pytree)`` is asynchronous
(``wait_until_finished`` before reading), and ``restore(path, target)`` into an abstract
target (``ocp.utils.to_shape_dtype_struct`` of a state of the same structure), which
gives back a ``TrainState``.
"""

from __future__ import annotations

import flax.linen as nn
import flax.serialization
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import ntk_flax
import reference

ocp = pytest.importorskip("orbax.checkpoint")


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(jnp.tanh(nn.Dense(16)(x)))


def _training_run(steps_between: int = 2, checkpoints: int = 3):
    """(model, x, states): an MLP trained with adam, its TrainState at each checkpoint."""
    model = MLP()
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 4))
    y = jax.random.normal(jax.random.PRNGKey(1), (6, 3))
    params = model.init(jax.random.PRNGKey(2), x)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(0.05))

    @jax.jit
    def step(state):
        def loss(p):
            return jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    states = []
    for _ in range(checkpoints):
        for _ in range(steps_between):
            state = step(state)
        states.append(state)
    return model, x, states


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _reference(model, params, x):
    return reference.ntk(lambda p, x: model.apply({"params": p}, x), params, x, None)[0]


def test_orbax_train_state_round_trip_gives_the_same_kernels(tmp_path):
    model, x, states = _training_run()
    paths = [tmp_path / f"step_{int(s.step)}" for s in states]
    with ocp.StandardCheckpointer() as checkpointer:
        for path, state in zip(paths, states, strict=True):
            checkpointer.save(path, state)
        checkpointer.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, states[0])
        restored = [checkpointer.restore(path, abstract) for path in paths]
    kernels = []
    for state, back in zip(states, restored, strict=True):
        assert isinstance(back, train_state.TrainState) and int(back.step) == int(state.step)
        k = ntk_flax.kernel(model, back, x)  # the restored TrainState itself
        _same(k, ntk_flax.kernel(model, state, x))
        _same(k, ntk_flax.kernel(model, back.params, x))
        kernels.append(np.asarray(k))
    assert not np.allclose(kernels[0], kernels[-1])  # the kernel moved with training
    reference.assert_close(kernels[1], _reference(model, restored[1].params, x))


def test_npz_round_trip_of_params_and_of_the_whole_state(tmp_path):
    """The numpy fallback: params as a flat ``{"Dense_0/kernel": array}`` file (read back
    as a bare params dict, no template needed); the whole TrainState with one entry per
    ``jax.tree_util`` key path, read back into the structure of a template state."""
    model, x, states = _training_run(checkpoints=2)
    for i, state in enumerate(states):
        flat = flax.traverse_util.flatten_dict(
            flax.serialization.to_state_dict(state.params), sep="/"
        )
        np.savez(tmp_path / f"params_{i}.npz", **flat)
        leaves = jax.tree_util.tree_leaves_with_path(state)
        np.savez(tmp_path / f"state_{i}.npz", **{jax.tree_util.keystr(p): v for p, v in leaves})
    template = states[0]
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    for i, state in enumerate(states):
        expected = ntk_flax.kernel(model, state, x)
        with np.load(tmp_path / f"params_{i}.npz") as saved:
            params = flax.traverse_util.unflatten_dict(dict(saved), sep="/")
        _same(ntk_flax.kernel(model, params, x), expected)
        with np.load(tmp_path / f"state_{i}.npz") as saved:
            leaves = [saved[jax.tree_util.keystr(p)] for p, _ in paths]
        back = jax.tree.unflatten(treedef, leaves)
        assert int(back.step) == int(state.step)
        _same(ntk_flax.kernel(model, back, x), expected)
    reference.assert_close(expected, _reference(model, states[-1].params, x))
