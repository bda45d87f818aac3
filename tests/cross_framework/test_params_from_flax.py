"""ntk_haiku.params_from_flax: each documented error, with its message (the docstring's
example runs in tests/core/test_docstrings.py)."""

from __future__ import annotations

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_haiku

X = jnp.ones((2, 7))
KEY = jax.random.PRNGKey(0)


class FlaxMLP(nn.Module):
    widths: tuple[int, ...] = (16, 16, 3)
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        for width in self.widths[:-1]:
            x = jnp.tanh(nn.Dense(width, use_bias=self.use_bias)(x))
        return nn.Dense(self.widths[-1], use_bias=self.use_bias)(x)


class FlaxWithBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.BatchNorm(use_running_average=True)(nn.Dense(16)(x)))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(x)


class FlaxNested(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(Block()(x))


class FlaxConvDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.Conv(4, (3,))(x[..., None]).reshape((x.shape[0], -1)))


class FlaxNamed(nn.Module):  # names that carry no order, two kernels of one shape
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(7, name="proj")(x))
        return nn.Dense(3, name="head")(jnp.tanh(nn.Dense(7, name="embed")(x)))


def _flax(model, x=X):
    return model.init(KEY, x)


def _haiku(fn, x=X, with_state=False):
    transform = hk.transform_with_state if with_state else hk.transform
    return transform(fn).init(KEY, x)


def _mlp(widths, **kwargs):
    return lambda x: hk.nets.MLP(widths, activation=jnp.tanh, **kwargs)(x)


MLP_PARAMS = _flax(FlaxMLP())["params"]

ERRORS = [
    (
        "fewer haiku modules",
        lambda: ntk_haiku.params_from_flax(MLP_PARAMS, _haiku(_mlp([16, 3]))),
        ValueError,
        r"^params_from_flax: got 3 Flax layers \(rank 2: \['Dense_0', 'Dense_1', 'Dense_2'\]\) "
        r"but 2 Haiku modules \(rank 2: \['mlp/~/linear_0', 'mlp/~/linear_1'\]\)\. Fix: "
        r"build the Haiku model",
    ),
    (
        "conv where haiku has a linear",
        lambda: ntk_haiku.params_from_flax(_flax(FlaxConvDense())["params"], _haiku(_mlp([4, 3]))),
        ValueError,
        r"^params_from_flax: got 2 Flax layers \(rank 2: \['Dense_0'\]; rank 3: \['Conv_0'\]\) "
        r"but 2 Haiku modules \(rank 2: \['mlp/~/linear_0', 'mlp/~/linear_1'\]\)",
    ),
    (
        "shape mismatch",
        lambda: ntk_haiku.params_from_flax(MLP_PARAMS, _haiku(_mlp([16, 8, 3]))),
        ValueError,
        r"^params_from_flax: Flax layer 'Dense_1', Haiku module 'mlp/~/linear_1' \(rank-2 pair "
        r"2/3\): kernel has shape \(16, 16\) but w has shape \(16, 8\)\. "
        r"Fix: give the Haiku modules",
    ),
    (
        "flax layer without bias",
        lambda: ntk_haiku.params_from_flax(
            _flax(FlaxMLP(use_bias=False))["params"], _haiku(_mlp([16, 16, 3]))
        ),
        ValueError,
        r"^params_from_flax: Flax layer 'Dense_0', Haiku module 'mlp/~/linear_0' .*: "
        r"'mlp/~/linear_0' has a bias and 'Dense_0' has none\. Fix: "
        r"match use_bias=",
    ),
    (
        "haiku module without bias",
        lambda: ntk_haiku.params_from_flax(MLP_PARAMS, _haiku(_mlp([16, 16, 3], with_bias=False))),
        ValueError,
        r"'Dense_0' has a bias and 'mlp/~/linear_0' has none",
    ),
    (
        "batchnorm params",
        lambda: ntk_haiku.params_from_flax(
            _flax(FlaxWithBatchNorm())["params"], _haiku(_mlp([16, 3]))
        ),
        ValueError,
        r"^params_from_flax: Flax layer 'BatchNorm_0' holds \['bias', 'scale'\], not "
        r"kernel and bias\. Fix: transplant their params by hand",
    ),
    (
        "batchnorm params, flax names kept",
        lambda: ntk_haiku.params_from_flax(_flax(FlaxWithBatchNorm())["params"]),
        ValueError,
        r"^params_from_flax: Flax layer 'BatchNorm_0' holds \['bias', 'scale'\]",
    ),
    (
        "variables dict instead of its params",
        lambda: ntk_haiku.params_from_flax(_flax(FlaxWithBatchNorm()), _haiku(_mlp([16, 3]))),
        ValueError,
        r"^params_from_flax: got a Flax variables dict \(collections \['batch_stats', "
        r"'params'\]\); expected its 'params' collection\. Fix: pass variables\['params'\]\.",
    ),
    (
        "variables dict, flax names kept",
        lambda: ntk_haiku.params_from_flax(_flax(FlaxMLP())),
        ValueError,
        r"^params_from_flax: got a Flax variables dict \(collections \['params'\]\)",
    ),
    (
        "nested flax modules",
        lambda: ntk_haiku.params_from_flax(_flax(FlaxNested())["params"], _haiku(_mlp([16, 3]))),
        ValueError,
        r"^params_from_flax: Flax module 'Block_0' holds submodules \['Dense_0'\]\. Fix:",
    ),
    (
        "a lone layer's params",
        lambda: ntk_haiku.params_from_flax(
            _flax(nn.Dense(3))["params"], _haiku(lambda x: hk.Linear(3)(x))
        ),
        ValueError,
        r"^params_from_flax: Flax layer 'kernel' holds a \w+, not a mapping\. .* "
        r"\{'Dense_0': variables\['params'\]\}",
    ),
    (
        "arguments swapped",
        lambda: ntk_haiku.params_from_flax(_haiku(_mlp([16, 16, 3])), MLP_PARAMS),
        ValueError,
        r"^params_from_flax: Flax layer 'mlp/~/linear_0' holds \['b', 'w'\], .* Fix: these "
        r"hold the other framework's names: swap the two arguments",
    ),
    (
        "flax params as the haiku params",
        lambda: ntk_haiku.params_from_flax(MLP_PARAMS, MLP_PARAMS),
        ValueError,
        r"^params_from_flax: Haiku module 'Dense_0' holds \['bias', 'kernel'\], not 'w' "
        r"and 'b' .* Fix: these hold the other framework's names",
    ),
    (
        "haiku layer norm",
        lambda: ntk_haiku.params_from_flax(
            MLP_PARAMS,
            _haiku(lambda x: hk.LayerNorm(-1, True, True)(_mlp([16, 16, 3])(x))),
        ),
        ValueError,
        r"^params_from_flax: Haiku module 'layer_norm' holds \['offset', 'scale'\], not "
        r"'w' and 'b' \(hk.Linear, hk.ConvND\)\. Fix: transplant their params by hand",
    ),
    (
        "haiku params and state",
        lambda: ntk_haiku.params_from_flax(MLP_PARAMS, _haiku(_mlp([16, 16, 3]), with_state=True)),
        TypeError,
        r"^params_from_flax: haiku_params must be the Haiku model's params dict, got "
        r"tuple\. Fix: pass params from transformed.init\(key, x\)",
    ),
    (  # jax.tree.map sorts keys: embed, head, proj; proj and embed could swap unseen
        "sorted names of equal shapes",
        lambda: ntk_haiku.params_from_flax(
            jax.tree.map(lambda v: v, _flax(FlaxNamed())["params"]), _haiku(_mlp([7, 7, 3]))
        ),
        ValueError,
        r"^params_from_flax: Flax layers \['embed', 'head', 'proj'\] are in sorted order with "
        r"equal kernel shapes \(7, 7\)",
    ),
    (
        "flax params not a mapping",
        lambda: ntk_haiku.params_from_flax(list(MLP_PARAMS.values())),
        TypeError,
        r"^params_from_flax: flax_params must be a Flax params collection, got list\. "
        r"Fix: pass variables\['params'\]",
    ),
]


@pytest.mark.parametrize("call, exc, pattern", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_error(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_flax_names_kept_without_haiku_params():
    """The one-argument form renames the leaves only (the LeNet twins' transplant)."""
    params = ntk_haiku.params_from_flax(MLP_PARAMS)
    assert list(params) == ["Dense_0", "Dense_1", "Dense_2"]
    for layer in params:
        assert params[layer]["w"] is MLP_PARAMS[layer]["kernel"]
        assert params[layer]["b"] is MLP_PARAMS[layer]["bias"]


def test_shape_only_template_and_no_bias_layers():
    """A jax.eval_shape template is enough, and bias-free layers pair with bias-free
    modules."""
    flax_params = _flax(FlaxMLP(use_bias=False))["params"]
    net = hk.transform(_mlp([16, 16, 3], with_bias=False))
    template = jax.eval_shape(net.init, KEY, X)
    params = ntk_haiku.params_from_flax(flax_params, template)
    assert params == {
        f"mlp/~/linear_{i}": {"w": flax_params[f"Dense_{i}"]["kernel"]} for i in range(3)
    }
    out = net.apply(params, None, X)
    np.testing.assert_allclose(
        out, FlaxMLP(use_bias=False).apply({"params": flax_params}, X), rtol=1e-6
    )


def test_named_layers_in_creation_order_pair_and_sorted_ones_are_refused():
    """A transplant pairs custom-named layers in mapping order: as init returns them it is
    right (outputs equal); after jax.tree.map (sorted keys) 'embed' would have taken
    'proj''s place silently, since both are 7 x 7 (found by a helper): it is refused."""
    model, haiku = FlaxNamed(), hk.without_apply_rng(hk.transform(_mlp([7, 7, 3])))
    flax_params = _flax(model)["params"]
    params = ntk_haiku.params_from_flax(flax_params, haiku.init(KEY, X))
    x = jax.random.normal(KEY, (4, 7))
    np.testing.assert_allclose(
        haiku.apply(params, x), model.apply({"params": flax_params}, x), rtol=1e-6, atol=1e-6
    )
    with pytest.raises(ValueError, match="their creation order is unknown"):
        ntk_haiku.params_from_flax(jax.tree.map(lambda v: v, flax_params), haiku.init(KEY, X))


def test_trailing_numbers_order_layers_and_sorted_mixed_names_are_refused():
    """``fc1`` .. ``fc12`` pair by their numbers even after keys are sorted (fc10 < fc2 as
    strings); ``Dense_0, Dense_1, DenseOut`` sorted ('DenseOut' < 'Dense_0') with equal
    kernels was paired silently in the wrong order (found by the reviewing helper)."""
    flax = {f"fc{i}": {"kernel": np.full((4, 4), i, np.float32)} for i in range(1, 13)}
    flax = dict(sorted(flax.items()))  # as jax.tree.map leaves it
    names = ["linear"] + [f"linear_{i}" for i in range(1, 12)]
    haiku = {name: {"w": np.zeros((4, 4), np.float32)} for name in names}
    params = ntk_haiku.params_from_flax(flax, haiku)
    assert [int(params[name]["w"][0, 0]) for name in names] == list(range(1, 13))
    mixed = {name: {"kernel": np.ones((4, 4))} for name in ("Dense_0", "Dense_1", "DenseOut")}
    with pytest.raises(ValueError, match="their creation order is unknown"):
        ntk_haiku.params_from_flax(dict(sorted(mixed.items())), dict(list(haiku.items())[:3]))
    assert ntk_haiku.params_from_flax(mixed, dict(list(haiku.items())[:3]))  # creation order
