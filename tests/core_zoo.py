"""The model zoo of the core tests: small networks in plain JAX (no Flax, no Haiku).

Each entry is a pure ``forward(params, state, x)`` (``state``: what is held fixed and
not differentiated, BatchNorm's running statistics), its parameters and state
initialised here with numpy's generator (nothing to compile), and its inputs ``make_x(key, n)``;
``apply_fn(entry)`` is the plain ``apply_fn(params, x)`` the core takes.

The entries are the Flax zoo of ``tests/zoo.py`` (used by ``tests/flax``) written out
by hand, one for one: the same architectures, the same parameter trees (Flax's module
and leaf names, so Flax weights transplant), and the same lax primitives Flax emits, so
that the structured-derivative rules meet the same uses of every weight:

- ``mlp``: Dense 5→8, ReLU, Dense 8→3 (``dot_general`` plus bias).
- ``lenet``: ``ntk_flax.LeNet()`` (neural-tangents' case C1): twice Conv 5×5 SAME, ReLU,
  2×2 average pool (``conv_general_dilated``, ``reduce_window``), then Dense 120, 84, 1.
- ``cnn10``: Conv 3×3 (4 channels), ReLU, average pool, Dense 10.
- ``tokens``: integer tokens, Embed(11, 8) (a ``gather``), a 2-head self-attention
  block (query, key, value and output DenseGenerals: 3-D ``dot_general``), residual,
  LayerNorm (elementwise scale and shift), GELU, Dense 3 per token: outputs (N, 5, 3).
- ``batchnorm_eval``: Conv 3×3, BatchNorm in evaluation mode (fixed running statistics:
  an elementwise scale and shift), ReLU, spatial mean, Dense 4.
- ``tied``: one Dense 5→5 applied twice (weight tying), Dense 5→2.
- ``dict_input``: a dict input ``{"image", "mask"}``, Conv 2×2, concatenation, and a
  tuple output (logits 2, a second head 3).

``tests/flax/test_zoo_equivalence.py`` checks the correspondence: with the Flax zoo's
weights each entry gives the Flax model's outputs, the same plan (the method of every
parameter leaf) and the same kernels. The values here differ from Flax's
initialisation on purpose: biases and normalisation shifts are nonzero and scales are
not 1, so that no term of a kernel vanishes or drops out by accident.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# -- layers, as Flax computes them ------------------------------------------------------


def dense(p, x, n_axes=1):
    """``flax.linen.Dense`` (``n_axes=1``) and ``DenseGeneral``: one ``dot_general``
    contracting the last ``n_axes`` axes of ``x`` with the first of ``p["kernel"]``,
    then the bias reshaped to broadcast over the other axes."""
    contract = tuple(range(x.ndim - n_axes, x.ndim))
    y = lax.dot_general(x, p["kernel"], ((contract, tuple(range(n_axes))), ((), ())))
    return y + jnp.reshape(p["bias"], (1,) * (x.ndim - n_axes) + p["bias"].shape)


def conv(p, x):
    """``flax.linen.Conv(features, window)``: NHWC / HWIO, stride 1, SAME, bias."""
    y = lax.conv_general_dilated(
        x,
        p["kernel"],
        (1, 1),
        "SAME",
        lhs_dilation=(1, 1),
        rhs_dilation=(1, 1),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    return y + p["bias"].reshape((1,) * (y.ndim - 1) + p["bias"].shape)


def avg_pool(x):
    """``flax.linen.avg_pool(x, (2, 2), strides=(2, 2))``."""
    window = (1, 2, 2, 1)
    return lax.reduce_window(x, 0.0, lax.add, window, window, "VALID") / 4.0


def embed(p, tokens):
    """``flax.linen.Embed``: a gather of table rows."""
    return jnp.take(p["embedding"], tokens, axis=0)


def self_attention(p, h):
    """``flax.linen.MultiHeadDotProductAttention(num_heads, qkv_features)(h, h)``:
    query, key and value DenseGeneral maps ``(..., D) → (..., H, D/H)``, scaled
    dot-product softmax attention, and the output DenseGeneral ``(..., H, D/H) → (...,
    D)``."""
    q, k, v = (dense(p[name], h) for name in ("query", "key", "value"))
    q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    weights = jax.nn.softmax(jnp.einsum("...qhd,...khd->...hqk", q, k))
    return dense(p["out"], jnp.einsum("...hqk,...khd->...qhd", weights, v), n_axes=2)


def _normalise(p, x, mean, var, epsilon):
    """Flax's ``_normalize`` over the last axis: ``(x - mean) · (rsqrt(var + ε) · scale)
    + bias``; the scale meets the (input-dependent) factor before the input."""
    shape = (1,) * (x.ndim - 1) + (x.shape[-1],)
    mul = lax.rsqrt(var + epsilon) * p["scale"].reshape(shape)
    return (x - mean) * mul + p["bias"].reshape(shape)


def layer_norm(p, x, epsilon=1e-6):
    """``flax.linen.LayerNorm()``: statistics of each position over its features (Flax's
    fast variance E[x²] − E[x]²), then a learnt scale and shift."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(jnp.square(x), axis=-1, keepdims=True) - jnp.square(mean))
    return _normalise(p, x, mean, var, epsilon)


def batch_norm_eval(p, stats, x, epsilon=1e-5):
    """``flax.linen.BatchNorm(use_running_average=True)``: the running statistics
    ``stats`` (``{"mean", "var"}``, per feature) are fixed, so the layer is an affine
    map of each sample with a learnt scale and shift."""
    shape = (1,) * (x.ndim - 1) + (x.shape[-1],)
    return _normalise(p, x, stats["mean"].reshape(shape), stats["var"].reshape(shape), epsilon)


def batch_norm_train(p, x, epsilon=1e-5):
    """``flax.linen.BatchNorm(use_running_average=False)``: statistics of the batch
    (over every axis but the features), so the samples are coupled."""
    axes = tuple(range(x.ndim - 1))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(jnp.square(x), axis=axes, keepdims=True) - jnp.square(mean))
    return _normalise(p, x, mean, var, epsilon)


# -- the networks -----------------------------------------------------------------------


def mlp(p, state, x):
    del state
    return dense(p["Dense_1"], jax.nn.relu(dense(p["Dense_0"], x)))


def lenet(p, state, x):
    del state
    for i in range(2):
        x = avg_pool(jax.nn.relu(conv(p[f"Conv_{i}"], x)))
    x = x.reshape((x.shape[0], -1))
    for i in range(2):
        x = jax.nn.relu(dense(p[f"Dense_{i}"], x))
    return dense(p["Dense_2"], x)


def cnn10(p, state, x):
    del state
    x = avg_pool(jax.nn.relu(conv(p["Conv_0"], x)))
    return dense(p["Dense_0"], x.reshape((x.shape[0], -1)))


def tokens(p, state, t):
    del state
    h = embed(p["Embed_0"], t)
    h = h + self_attention(p["MultiHeadDotProductAttention_0"], h)
    h = layer_norm(p["LayerNorm_0"], h)
    return dense(p["Dense_0"], jax.nn.gelu(h))


def batchnorm_eval(p, state, x):
    x = batch_norm_eval(p["BatchNorm_0"], state["BatchNorm_0"], conv(p["Conv_0"], x))
    return dense(p["Dense_0"], jnp.mean(jax.nn.relu(x), axis=(1, 2)))


def tied(p, state, x):
    del state
    shared = p["Dense_0"]
    return dense(p["Dense_1"], dense(shared, jnp.tanh(dense(shared, x))))


def dict_input(p, state, x):
    del state
    h = jax.nn.relu(conv(p["Conv_0"], x["image"]))
    h = jnp.concatenate([h.reshape((h.shape[0], -1)), x["mask"]], axis=-1)
    return dense(p["Dense_0"], h), dense(p["Dense_1"], jnp.tanh(h))


# -- initialisation ---------------------------------------------------------------------


class _Draws:
    """Standard normal (and uniform) float32 draws of one seed (numpy arrays)."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def __call__(self, shape):
        return self.rng.standard_normal(shape, np.float32)

    def uniform(self, shape, low, high):
        return self.rng.uniform(low, high, shape).astype(np.float32)


def _dense_init(keys, inputs, features):
    """DenseGeneral parameters from input axes ``inputs`` to output axes ``features``."""
    kernel = keys((*inputs, *features)) / math.sqrt(math.prod(inputs))
    return {"kernel": kernel, "bias": 0.1 * keys(features)}


def _conv_init(keys, window, c_in, c_out):
    fan_in = math.prod(window) * c_in
    kernel = keys((*window, c_in, c_out)) / math.sqrt(fan_in)
    return {"kernel": kernel, "bias": 0.1 * keys((c_out,))}


def _norm_init(keys, features):
    return {"scale": 1.0 + 0.2 * keys((features,)), "bias": 0.1 * keys((features,))}


def _init(name, seed):
    """``(params, state)`` of zoo entry ``name``, trees as Flax's ``model.init`` makes."""
    keys = _Draws(seed)
    if name == "mlp":
        return {
            "Dense_0": _dense_init(keys, (5,), (8,)),
            "Dense_1": _dense_init(keys, (8,), (3,)),
        }, {}
    if name == "lenet":  # (N, 32, 32, 3) -> two pools -> 8 x 8 x 16
        params = {
            "Conv_0": _conv_init(keys, (5, 5), 3, 6),
            "Conv_1": _conv_init(keys, (5, 5), 6, 16),
        }
        for i, (a, b) in enumerate([(8 * 8 * 16, 120), (120, 84), (84, 1)]):
            params[f"Dense_{i}"] = _dense_init(keys, (a,), (b,))
        return params, {}
    if name == "cnn10":  # (N, 8, 8, 1) -> pool -> 4 x 4 x 4
        return {
            "Conv_0": _conv_init(keys, (3, 3), 1, 4),
            "Dense_0": _dense_init(keys, (64,), (10,)),
        }, {}
    if name == "tokens":
        attention = {n: _dense_init(keys, (8,), (2, 4)) for n in ("query", "key", "value")}
        attention["out"] = _dense_init(keys, (2, 4), (8,))
        params = {
            "Embed_0": {"embedding": keys((11, 8))},
            "MultiHeadDotProductAttention_0": attention,
            "LayerNorm_0": _norm_init(keys, 8),
            "Dense_0": _dense_init(keys, (8,), (3,)),
        }
        return params, {}
    if name == "batchnorm_eval":
        params = {
            "Conv_0": _conv_init(keys, (3, 3), 2, 4),
            "BatchNorm_0": _norm_init(keys, 4),
            "Dense_0": _dense_init(keys, (4,), (4,)),
        }
        stats = {  # non-trivial running statistics
            "mean": 0.5 * keys((4,)),
            "var": keys.uniform((4,), 0.5, 2.0),
        }
        return params, {"BatchNorm_0": stats}
    if name == "tied":
        return {
            "Dense_0": _dense_init(keys, (5,), (5,)),
            "Dense_1": _dense_init(keys, (5,), (2,)),
        }, {}
    if name == "dict_input":  # conv output 4 x 4 x 3 = 48, plus the 3 mask values
        params = {
            "Conv_0": _conv_init(keys, (2, 2), 1, 3),
            "Dense_0": _dense_init(keys, (51,), (2,)),
            "Dense_1": _dense_init(keys, (51,), (3,)),
        }
        return params, {}
    raise KeyError(name)


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


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    forward: Callable  # forward(params, state, x)
    make_x: Callable  # make_x(key, n): n samples
    params: Any = None
    state: Any = None


def _build() -> dict[str, Entry]:
    entries = [
        ("mlp", mlp, _images((5,))),
        ("lenet", lenet, _images((32, 32, 3))),
        ("cnn10", cnn10, _images((8, 8, 1))),
        ("tokens", tokens, _tokens),
        ("batchnorm_eval", batchnorm_eval, _images((6, 6, 2))),
        ("tied", tied, _images((5,))),
        ("dict_input", dict_input, _dict_inputs),
    ]
    zoo = {}
    for i, (name, forward, make_x) in enumerate(entries):
        params, state = jax.tree.map(jnp.asarray, _init(name, 100 + i))
        zoo[name] = Entry(name, forward, make_x, params, state)
    return zoo


ZOO = _build()


@functools.cache
def _apply_fn(name: str):
    entry = ZOO[name]

    def f(params, x):
        return entry.forward(params, entry.state, x)

    return f


def apply_fn(entry: Entry):
    """Plain ``apply_fn(params, x)`` of a zoo entry (its state closed over); the same
    function object for every call, as a user's training loop would have."""
    return _apply_fn(entry.name)


def inputs(entry: Entry, n1: int = 3, n2: int = 2):
    return entry.make_x(jax.random.PRNGKey(1), n1), entry.make_x(jax.random.PRNGKey(2), n2)
