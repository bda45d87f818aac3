"""Models of several per-sample arrays (issue 28): ``inputs="args"`` passes x1 / x2 as the
model's positional arguments (a tuple), ``inputs="kwargs"`` as its keyword arguments (a
dict). A BERT-like linen module (token and type embeddings, one masked self-attention
layer, a pooled head) and a two-input model ``f(x, mask)`` in nnx, Haiku and equinox:
each kernel against the float64 Jacobian contraction of ``tests/reference.py``, and the
same kernel for both conventions."""

from __future__ import annotations

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import frameworks
import ntk_flax
import ntk_haiku
import reference

VOCAB, T, WIDTH, OUT = 30, 8, 16, 3


class TinyBert(nn.Module):
    """input_ids, attention_mask, token_type_ids (N, T) -> logits (N, OUT)."""

    @nn.compact
    def __call__(self, input_ids, attention_mask, token_type_ids):
        h = nn.Embed(VOCAB, WIDTH)(input_ids) + nn.Embed(2, WIDTH)(token_type_ids)
        h = nn.LayerNorm()(h)
        mask = nn.make_attention_mask(attention_mask, attention_mask)
        h = h + nn.MultiHeadDotProductAttention(num_heads=2)(h, h, mask=mask)
        pooled = jnp.tanh(nn.Dense(WIDTH)(h[:, 0]))  # the first token's state
        return nn.Dense(OUT)(pooled)


def _tokens(key, n):
    """A dict of n samples: random ids, a padding mask (>= 3 tokens kept), token types."""
    k1, k2, k3 = jax.random.split(key, 3)
    kept = jax.random.randint(k2, (n, 1), 3, T + 1)
    return {
        "input_ids": jax.random.randint(k1, (n, T), 0, VOCAB),
        "attention_mask": (jnp.arange(T)[None] < kept).astype(jnp.int32),
        "token_type_ids": (jax.random.uniform(k3, (n, T)) < 0.5).astype(jnp.int32),
    }


def _args(x: dict) -> tuple:
    return x["input_ids"], x["attention_mask"], x["token_type_ids"]


BERT = TinyBert()
X1, X2 = _tokens(jax.random.PRNGKey(1), 5), _tokens(jax.random.PRNGKey(2), 3)
VARIABLES = BERT.init(jax.random.PRNGKey(0), *_args(X1))


def _bert(params, x):  # the whole batch, x a tuple, for the reference
    return BERT.apply({"params": params}, *x)


#: The reference NTK (N1 + N2, N1 + N2, OUT, OUT) of X1 and X2 together: one Jacobian.
BOTH = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), X1, X2)
FULL = reference.ntk(_bert, VARIABLES["params"], _args(BOTH), None, trace_axes=())[0]
N1 = len(X1["input_ids"])


def test_masks_and_types_change_the_outputs():  # the tests below would miss a dropped input
    out = BERT.apply(VARIABLES, *_args(X1))
    for name in ("attention_mask", "token_type_ids"):
        other = dict(X1, **{name: 1 - X1[name].at[:, 0].set(0)})
        assert not np.allclose(BERT.apply(VARIABLES, *_args(other)), out)


def test_bert_kernel_with_args_and_kwargs_equals_the_reference():
    expected = FULL[:N1, N1:]
    by_args = ntk_flax.kernel(BERT, VARIABLES, _args(X1), _args(X2), inputs="args", trace_axes=())
    by_kwargs = ntk_flax.kernel_fn(BERT, inputs="kwargs", trace_axes=())(VARIABLES, X1, X2)
    reference.assert_close(by_args, expected)
    reference.assert_close(by_kwargs, expected)
    np.testing.assert_allclose(by_kwargs, by_args, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def test_bert_nngp_plan_and_per_leaf_with_kwargs():
    expected = reference.nngp(_bert, VARIABLES["params"], _args(X1), None)[0]
    reference.assert_close(ntk_flax.nngp(BERT, VARIABLES, X1, inputs="kwargs"), expected)
    per_leaf = ntk_flax.kernel_per_leaf(BERT, VARIABLES, X1, inputs="kwargs")
    traced = np.trace(FULL[:N1, :N1], axis1=2, axis2=3) / OUT
    reference.assert_close(sum(jax.tree.leaves(per_leaf)), traced)
    plan = ntk_flax.plan(BERT, VARIABLES, _args(X1), inputs="args")
    n_params = sum(v.size for v in jax.tree.leaves(VARIABLES["params"]))
    assert sum(leaf.size for leaf in plan.leaves) == n_params


# -- a two-input model f(x, mask) in nnx, Haiku and equinox ----------------------------
X = jax.random.normal(jax.random.PRNGKey(3), (6, 4))
MASK = (jax.random.uniform(jax.random.PRNGKey(4), (6, 4)) < 0.6).astype(jnp.float32)


def _check(kernel, apply, params):
    """``kernel(x1, inputs)`` for both conventions against the reference of
    ``apply(params, (x, mask))`` (whole batch)."""
    expected = reference.ntk(apply, params, (X, MASK), None, trace_axes=())[0]
    by_args = kernel((X, MASK), "args")
    by_kwargs = kernel({"x": X, "mask": MASK}, "kwargs")
    reference.assert_close(by_args, expected)
    reference.assert_close(by_kwargs, expected)
    np.testing.assert_allclose(by_kwargs, by_args, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


class TwoInputs(nnx.Module):
    def __init__(self, rngs):
        self.a, self.b = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x, mask):
        return self.b(jnp.tanh(self.a(x * mask)) + mask.sum(-1, keepdims=True))


def test_nnx_two_inputs():
    module = TwoInputs(nnx.Rngs(0))
    graphdef, params = nnx.split(module, nnx.Param)

    def apply(p, x):
        return nnx.merge(graphdef, p)(*x)

    def kernel(x, inputs):
        return ntk_flax.kernel(module, None, x, inputs=inputs, trace_axes=())

    _check(kernel, apply, params)


def _haiku_forward(x, mask):
    return hk.Linear(3)(jnp.tanh(hk.Linear(8)(x * mask)) + mask.sum(-1, keepdims=True))


def test_haiku_two_inputs():
    net = hk.without_apply_rng(hk.transform(_haiku_forward))
    params = net.init(jax.random.PRNGKey(0), X, MASK)

    def kernel(x, inputs):
        return ntk_haiku.kernel(net, params, x, inputs=inputs, trace_axes=())

    _check(kernel, lambda p, x: net.apply(p, *x), params)


@frameworks.requires("equinox")
def test_equinox_two_inputs():
    import equinox as eqx

    import ntk_equinox

    class Two(eqx.Module):  # one sample: x (4,), mask (4,)
        a: eqx.nn.Linear
        b: eqx.nn.Linear

        def __call__(self, x, mask):
            return self.b(jnp.tanh(self.a(x * mask)) + mask.sum())

    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    model = Two(eqx.nn.Linear(4, 8, key=k1), eqx.nn.Linear(8, 3, key=k2))
    params, rest = eqx.partition(model, eqx.is_inexact_array)

    def apply(p, x):
        return jax.vmap(eqx.combine(p, rest))(*x)

    def kernel(x, inputs):
        return ntk_equinox.kernel(model, x, inputs=inputs, trace_axes=())

    _check(kernel, apply, params)


@pytest.mark.parametrize("package", ["ntk_flax", "ntk_haiku"])
def test_a_call_missing_its_mask_says_where_per_sample_arrays_go(package):
    if package == "ntk_flax":
        call = lambda: ntk_flax.kernel(BERT, VARIABLES, X1["input_ids"])  # noqa: E731
    else:
        net = hk.without_apply_rng(hk.transform(_haiku_forward))
        params = net.init(jax.random.PRNGKey(0), X, MASK)
        call = lambda: ntk_haiku.kernel(net, params, X)  # noqa: E731
    with pytest.raises(ValueError, match=r"missing .*Fix: pass per-sample arrays .*inputs='args'"):
        call()


def _models_of_two_arrays():
    """The same call ``f(x, mask)`` in each adapter: ``(name, kernel(x, inputs))``."""
    import equinox as eqx

    import ntk_equinox

    x, mask = jnp.ones((3, 4)), jnp.ones((3, 4))

    class Eqx(eqx.Module):
        w: jax.Array

        def __call__(self, x, mask):
            return jnp.tanh(self.w @ (x * mask))

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            return nn.Dense(2)(x * mask)

    class Nnx(nnx.Module):
        def __init__(self):
            self.dense = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

        def __call__(self, x, mask):
            return self.dense(x * mask)

    hk_net = hk.without_apply_rng(hk.transform(lambda x, mask: hk.Linear(2)(x * mask)))
    hk_params = hk_net.init(jax.random.PRNGKey(0), x[0], mask[0])
    variables = Linen().init(jax.random.PRNGKey(0), x, mask)
    eqx_model = Eqx(jnp.ones((2, 4)))
    return (x, mask), {
        "ntk_equinox": lambda x, **o: ntk_equinox.kernel(eqx_model, x, **o),
        "ntk_flax linen": lambda x, **o: ntk_flax.kernel(Linen(), variables, x, **o),
        "ntk_flax nnx": lambda x, **o: ntk_flax.kernel(Nnx(), None, x, **o),
        "ntk_haiku": lambda x, **o: ntk_haiku.kernel(hk_net, hk_params, x, **o),
    }


@frameworks.requires("equinox")
@pytest.mark.parametrize("name", ["ntk_equinox", "ntk_flax linen", "ntk_flax nnx", "ntk_haiku"])
def test_where_arguments_go_is_told_from_the_signature_not_the_error_text(name):
    # A call that does not fit the model's signature (one array missing, or a misnamed
    # keyword, whose Python error does not say "required") gets the inputs= fix; a failure
    # inside a model that the arguments fit gets the ordinary one.
    (x, mask), kernels = _models_of_two_arrays()
    kernel = kernels[name]
    hint = r"Fix: pass per-sample arrays in x1 with inputs='args' or 'kwargs'"
    with pytest.raises(ValueError, match=r"missing 1 required positional .*" + hint):
        kernel(x)
    with pytest.raises(ValueError, match=r"unexpected keyword .*'maks'.*" + hint):
        kernel({"x": x, "maks": mask}, inputs="kwargs")
    bad_mask = jnp.ones((3, 5))  # x * mask fails, the arguments fit
    with pytest.raises(ValueError, match="failed") as info:
        kernel((x, bad_mask), inputs="args")
    assert "inputs='args' or 'kwargs'" not in str(info.value)
    assert kernel((x, mask), inputs="args").shape == (3, 3)
