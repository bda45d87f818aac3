"""The Flax model zoo of ``tests/flax``: one registry of small ``flax.linen`` models.

Each entry gives a ``flax.linen`` module, its variables, inputs ``make_x(key, n)``, and
extra apply keyword arguments; ``apply_fn(entry)`` turns it into a plain
``apply_fn(params, x)`` (the ``params`` collection differentiated, other collections
closed over). The core tests use ``core_zoo.py``, the same networks in plain JAX (they
run without Flax); ``tests/flax/test_zoo_equivalence.py`` checks the two correspond.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

import ntk_flax


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8)(x))
        return nn.Dense(3)(x)


class CNN10(nn.Module):
    """A small CNN with 10 logits."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(10)(x)


class TokenModel(nn.Module):
    """Integer tokens → embedding → one self-attention block with LayerNorm → per-token
    logits ``(N, L, 3)`` (two output axes besides the batch)."""

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(11, 8)(tokens)
        h = h + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(h, h)
        h = nn.LayerNorm()(h)
        return nn.Dense(3)(nn.gelu(h))


class BatchNormCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        x = jnp.mean(nn.relu(x), axis=(1, 2))
        return nn.Dense(4)(x)


class TiedDense(nn.Module):
    """One Dense layer applied twice (weight tying)."""

    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(5)
        x = shared(jnp.tanh(shared(x)))
        return nn.Dense(2)(x)


class DictInput(nn.Module):
    """Dict input ``{"image", "mask"}`` and a pytree (tuple) output."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Conv(3, (2, 2))(x["image"]))
        h = jnp.concatenate([h.reshape((h.shape[0], -1)), x["mask"]], axis=-1)
        logits = nn.Dense(2)(h)
        return logits, nn.Dense(3)(jnp.tanh(h))


@dataclasses.dataclass
class Entry:
    name: str
    model: nn.Module
    make_x: Callable
    apply_kwargs: dict = dataclasses.field(default_factory=dict)
    variables: dict = None


def _images(shape):
    return lambda key, n: jax.random.normal(key, (n, *shape))


def _dict_inputs(key, n):
    k1, k2 = jax.random.split(key)
    return {
        "image": jax.random.normal(k1, (n, 4, 4, 1)),
        "mask": jax.random.normal(k2, (n, 3)),
    }


def _tokens(key, n):
    return jax.random.randint(key, (n, 5), 0, 11)


def _build() -> dict[str, Entry]:
    entries = [
        Entry("mlp", MLP(), _images((5,))),
        Entry("lenet", ntk_flax.LeNet(), _images((32, 32, 3))),
        Entry("cnn10", CNN10(), _images((8, 8, 1))),
        Entry("tokens", TokenModel(), _tokens),
        Entry("batchnorm_eval", BatchNormCNN(), _images((6, 6, 2)), {"train": False}),
        Entry("tied", TiedDense(), _images((5,))),
        Entry("dict_input", DictInput(), _dict_inputs),
    ]
    for i, entry in enumerate(entries):
        key = jax.random.PRNGKey(100 + i)
        x = entry.make_x(jax.random.PRNGKey(7), 4)
        init = jax.jit(functools.partial(entry.model.init, **entry.apply_kwargs))
        entry.variables = init(key, x)
        if "batch_stats" in entry.variables:
            # Non-trivial running statistics from one training-mode pass.
            _, updates = entry.model.apply(
                entry.variables, 3.0 * x + 1.0, train=True, mutable=["batch_stats"]
            )
            entry.variables = {**entry.variables, **updates}
    return {e.name: e for e in entries}


ZOO = _build()


@functools.cache
def _apply_fn(name: str):
    entry = ZOO[name]

    rest = {k: v for k, v in entry.variables.items() if k != "params"}

    def f(params, x):
        return entry.model.apply({"params": params, **rest}, x, **entry.apply_kwargs)

    return f


def apply_fn(entry: Entry):
    """Plain ``apply_fn(params, x)`` of a zoo entry (other collections closed over); the
    same function object for every call, as a user's training loop would have."""
    return _apply_fn(entry.name)


def inputs(entry: Entry, n1: int = 3, n2: int = 2):
    return entry.make_x(jax.random.PRNGKey(1), n1), entry.make_x(jax.random.PRNGKey(2), n2)
