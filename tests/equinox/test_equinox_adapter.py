"""ntk_equinox against the float64 reference and against ntk_flax with transplanted
weights; non-array and integer fields held fixed; its errors; no retrace for new
weights; and that it reaches ntk_core through public names only."""

from __future__ import annotations

import ast
import doctest
import functools
import importlib
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compiles
import frameworks
import reference

frameworks.skip_module_unless("equinox")

import equinox as eqx  # noqa: E402

import ntk_core  # noqa: E402
import ntk_equinox  # noqa: E402

IMPLEMENTATIONS = ("jacobian", "structured", "ntvp", "auto")
AXES = {"traced": (-1,), "full": ()}


class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    linear: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(2, 3, 3, padding=1, key=k1)
        self.linear = eqx.nn.Linear(3 * 5 * 5, 2, key=k2)

    def __call__(self, x):  # one sample (C, H, W)
        return self.linear(jnp.tanh(self.conv(x)).reshape(-1))


MODELS = {
    "mlp": (lambda key: eqx.nn.MLP(4, 3, 8, 2, activation=jnp.tanh, key=key), (4,)),
    "cnn": (CNN, (2, 5, 5)),
}


@functools.cache
def _setup(name):
    make, shape = MODELS[name]
    model = make(jax.random.PRNGKey(0))
    x1 = jax.random.normal(jax.random.PRNGKey(1), (5, *shape))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (3, *shape))
    return model, x1, x2


@functools.cache
def _reference(name, kind, axes, given):
    """The float64 reference kernel of model ``name`` (once for every implementation)."""
    model, x1, x2 = _setup(name)
    f, params = _apply(model)
    fn = reference.ntk if kind == "ntk" else reference.nngp
    return fn(f, params, x1, x2 if given else None, trace_axes=AXES[axes])[0]


def _apply(model):
    """(f, params): the model as a batched function of its floating-point leaves."""
    params, rest = eqx.partition(model, eqx.is_inexact_array)
    return (lambda p, x: jax.vmap(eqx.combine(p, rest))(x)), params


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(MODELS))
def test_kernel_matches_the_float64_reference(name, implementation):
    model, x1, x2 = _setup(name)
    for axes, trace_axes in AXES.items():
        for given in (False, True):
            k = ntk_equinox.kernel(
                model,
                x1,
                x2 if given else None,
                trace_axes=trace_axes,
                implementation=implementation,
            )
            reference.assert_close(k, _reference(name, "ntk", axes, given))


@pytest.mark.parametrize("given", [False, True])
def test_kernel_per_leaf_and_nngp_fn_match_the_float64_reference(given):
    """Per leaf: each leaf's share of the NTK (the others held), a tree shaped like the
    model's parameters; NNGP built once: the outputs' products."""
    model, x1, x2 = _setup("cnn")
    x2 = x2 if given else None
    f, params = _apply(model)
    per_leaf = ntk_equinox.kernel_per_leaf(model, x1, x2, trace_axes=())
    assert jax.tree.structure(per_leaf) == jax.tree.structure(params)
    scale = np.abs(_reference("cnn", "ntk", "full", given)).max()
    for i, got in enumerate(jax.tree.leaves(per_leaf)):
        g, leaf = reference.leaf_alone(f, params, i)
        reference.assert_close(got, reference.ntk(g, leaf, x1, x2, trace_axes=())[0], scale=scale)
    again = ntk_equinox.kernel_per_leaf_fn(model, trace_axes=())(model, x1, x2)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(per_leaf), strict=True):
        np.testing.assert_array_equal(a, b)
    nngp = ntk_equinox.nngp_fn(model, trace_axes=())(model, x1, x2)
    reference.assert_close(nngp, _reference("cnn", "nngp", "full", given))


@pytest.mark.parametrize("name", list(MODELS))
def test_nngp_matches_the_outputs_products(name):
    model, x1, x2 = _setup(name)
    for axes, trace_axes in AXES.items():
        for given in (False, True):
            k = ntk_equinox.nngp(model, x1, x2 if given else None, trace_axes=trace_axes)
            reference.assert_close(k, _reference(name, "nngp", axes, given))


@frameworks.requires("flax")
def test_the_same_mlp_in_flax_gives_the_same_kernels():
    """eqx.nn.Linear holds weight (out, in); flax.linen.Dense holds kernel (in, out)."""
    import flax.linen as nn

    import ntk_flax

    class FlaxMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (8, 8):
                x = jnp.tanh(nn.Dense(width)(x))
            return nn.Dense(3)(x)

    model, x1, x2 = _setup("mlp")
    params = {
        f"Dense_{i}": {"kernel": layer.weight.T, "bias": layer.bias}
        for i, layer in enumerate(model.layers)
    }
    variables = {"params": params}
    np.testing.assert_allclose(FlaxMLP().apply(variables, x1), jax.vmap(model)(x1), rtol=1e-5)
    for trace_axes in AXES.values():
        for second in (None, x2):
            kw = dict(trace_axes=trace_axes)
            expected = np.asarray(ntk_flax.kernel(FlaxMLP(), variables, x1, second, **kw))
            reference.assert_close(ntk_equinox.kernel(model, x1, second, **kw), expected)
            expected = np.asarray(ntk_flax.nngp(FlaxMLP(), variables, x1, second, **kw))
            reference.assert_close(ntk_equinox.nngp(model, x1, second, **kw), expected)


class Picky(eqx.Module):
    """Fields that are not differentiated: a function, a Python int and float, and an
    integer array (which input features the first layer reads)."""

    first: eqx.nn.Linear
    last: eqx.nn.Linear
    index: jax.Array
    power: int
    scale: float
    activation: Callable

    def __init__(self, index, power=2):
        k1, k2 = jax.random.split(jax.random.PRNGKey(3))
        self.first = eqx.nn.Linear(len(index), 6, key=k1)
        self.last = eqx.nn.Linear(6, 2, key=k2)
        self.index, self.power, self.scale, self.activation = index, power, 0.5, jnp.tanh

    def __call__(self, x):
        h = self.activation(self.first(x[self.index]))
        return self.last(self.scale * h**self.power)


def test_non_array_and_integer_fields_are_held_fixed():
    x = jax.random.normal(jax.random.PRNGKey(4), (4, 5))
    leaves = [leaf.path for leaf in ntk_equinox.plan(Picky(jnp.array([0, 2, 4])), x).leaves]
    assert len(leaves) == 4 and not any("index" in str(p) for p in leaves), leaves
    # A new integer array or int of the same shapes is a new model, not a stale program.
    for model in (
        Picky(jnp.array([0, 2, 4])),
        Picky(jnp.array([1, 3, 3])),
        Picky(jnp.array([4, 4, 1]), 3),
    ):
        f, params = _apply(model)
        assert [v.dtype for v in jax.tree.leaves(params)] == [jnp.float32] * 4
        reference.assert_close(
            ntk_equinox.kernel(model, x, trace_axes=()), reference.ntk(f, params, x, None, ())[0]
        )


class NoCall(eqx.Module):
    weight: jax.Array


class NoFloat(eqx.Module):
    index: jax.Array
    scale: float = 1.0

    def __call__(self, x):
        return x[self.index] * self.scale


class WholeBatch(eqx.Module):  # written for x of shape (N, 4): fails on one sample
    linear: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.linear)(x)


class Flagged(eqx.Module):  # an array field read by a Python `if` (fails under filter_jit too)
    weight: jax.Array
    use_tanh: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.weight) if self.use_tanh else x @ self.weight


X = jnp.ones((4, 4))
MLP = _setup("mlp")[0]
BAD = [
    (  # arrays are traced, as eqx.filter_jit does; not told "written for a whole batch"
        lambda: ntk_equinox.kernel(Flagged(jnp.ones((4, 2)), jnp.array(True)), X),
        ValueError,
        r"^ntk_equinox.kernel: .*TracerBoolConversionError: .*use_tanh.*Fix: branch with jnp.where",
    ),
    (
        lambda: ntk_equinox.kernel(lambda x: x, X),
        TypeError,
        r"^ntk_equinox.kernel: model must be an equinox.Module.*got function",
    ),
    (lambda: ntk_equinox.kernel(X, MLP), TypeError, r"got ArrayImpl. Fix: pass the module first"),
    (lambda: ntk_equinox.kernel(NoCall(X), X), TypeError, r"got NoCall \(no __call__\)"),
    (
        lambda: ntk_equinox.nngp(NoFloat(jnp.arange(2)), X),
        ValueError,
        r"^ntk_equinox.nngp: the model NoFloat has no floating-point array leaves",
    ),
    (lambda: ntk_equinox.plan("mlp", X), TypeError, r"^ntk_equinox.plan: model must be"),
    (  # BatchNorm is called as layer(x, state): the model is not a function of x alone
        lambda: ntk_equinox.kernel(
            eqx.nn.Sequential([MLP, eqx.nn.BatchNorm(3, "batch", mode="batch")]), X
        ),
        ValueError,
        r"^ntk_equinox.kernel: the model holds the stateful layer BatchNorm",
    ),
    (
        lambda: ntk_equinox.kernel(MLP, X, implementation="fast"),
        ValueError,
        r"^ntk_equinox.kernel: .*implementation must be one of",
    ),
    (
        lambda: ntk_equinox.kernel(MLP, X, trace_axis=()),
        TypeError,
        r"^ntk_equinox.kernel: .*write trace_axes= \(not trace_axis=\)",
    ),
    (
        lambda: ntk_equinox.nngp(MLP, X, implementation="jacobian"),
        TypeError,
        r"^ntk_equinox.nngp: unknown option\(s\) 'implementation'",
    ),
    (
        lambda: ntk_equinox.kernel(MLP, jnp.ones((4, 5))),
        ValueError,
        r"^ntk_equinox.kernel: .*calling the model on x1",
    ),
    (
        lambda: ntk_equinox.kernel(WholeBatch(eqx.nn.Linear(4, 2, key=jax.random.PRNGKey(0))), X),
        ValueError,
        r"^ntk_equinox.kernel: the model fails on each sample x1\[i\] .* but runs on x1",
    ),
    (  # one sample without its batch axis
        lambda: ntk_equinox.kernel(MLP, X[0]),
        ValueError,
        r"^ntk_equinox.kernel: the model fails on each sample .* Fix: x1 one sample: pass x1\[None\]",
    ),
    (
        lambda: ntk_equinox.kernel(MLP, X.at[1, 0].set(jnp.nan)),
        ValueError,
        r"^ntk_equinox.kernel: .*NaN",
    ),
    (
        lambda: ntk_equinox.kernel_fn(MLP, batch_size=-1),
        ValueError,
        r"^ntk_equinox.kernel_fn: .*batch_size",
    ),
    (
        lambda: ntk_equinox.kernel_fn(MLP)(CNN(jax.random.PRNGKey(0)), X),
        ValueError,
        r"^ntk_equinox.kernel_fn\(...\)\(model, x1, x2\): .*differ from those",
    ),
    (
        lambda: ntk_equinox.linearize(MLP)(CNN(jax.random.PRNGKey(0)), X),
        ValueError,
        r"^ntk_equinox.linearize: the model's structure or fixed fields differ from model0's",
    ),
    (
        lambda: ntk_equinox.monte_carlo_kernels(MLP, X, key=jax.random.PRNGKey(0), n_samples=2),
        TypeError,
        r"^ntk_equinox.monte_carlo_kernels: make_model must build the module from a key, got MLP",
    ),
    (
        lambda: ntk_equinox.monte_carlo_kernels(
            lambda k: (MLP, k), X, key=jax.random.PRNGKey(0), n_samples=2
        ),
        TypeError,
        r"^ntk_equinox.monte_carlo_kernels: make_model\(key\) returned tuple, not an eqx.Module",
    ),
    (
        lambda: ntk_equinox.linearize(MLP)(MLP, jnp.ones((4, 5))),
        ValueError,
        r"^ntk_equinox.linearize: calling the model on its inputs failed with TypeError: .* Fix: x holds",
    ),
    (
        lambda: ntk_equinox.taylor_expand(MLP, 1.5),
        TypeError,
        r"^ntk_equinox.taylor_expand: degree must be",
    ),
]


@pytest.mark.parametrize("call, error, message", BAD)
def test_bad_input_is_refused_with_its_fix(call, error, message):
    with pytest.raises(error, match=message) as info:
        call()
    assert "Fix:" in str(info.value)


TRACES: list[int] = []


class Counting(eqx.Module):
    hidden: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.hidden, self.out = eqx.nn.Linear(4, 6, key=k1), eqx.nn.Linear(6, 2, key=k2)

    def __call__(self, x):
        TRACES.append(1)  # runs only while JAX traces
        return self.out(jnp.tanh(self.hidden(x)))


COMPILES = compiles.counter()


@pytest.mark.parametrize("build", ["kernel", "kernel_fn"])
def test_new_weights_of_the_same_model_neither_retrace_nor_recompile(build):
    """A training loop: each step's model (eqx.apply_updates, or a fresh init of the
    same architecture) gives new kernels from the programs of the first call."""
    x = jax.random.normal(jax.random.PRNGKey(5), (6, 4))
    model = Counting(jax.random.PRNGKey(6))
    kernel = ntk_equinox.kernel if build == "kernel" else ntk_equinox.kernel_fn(model)
    models = [Counting(jax.random.PRNGKey(7))]  # a fresh init of the same architecture
    for _ in range(3):  # made before counting: eager updates compile programs of their own
        grads = jax.tree.map(lambda p: 0.1 * p, eqx.filter(model, eqx.is_inexact_array))
        models.append(eqx.apply_updates(models[-1], grads))
    first = kernel(model, x)
    traces, compiles = len(TRACES), len(COMPILES)
    kernels = [kernel(m, x) for m in models]
    assert (len(TRACES), len(COMPILES)) == (traces, compiles)
    assert len(COMPILES) > 0 and traces > 0  # the counters see this model's compilations
    assert not any(np.allclose(first, k) for k in kernels)
    f, params = _apply(models[-1])
    reference.assert_close(kernels[-1], reference.ntk(f, params, x, None)[0])


@pytest.mark.parametrize("build", ["kernel", "kernel_fn"])
def test_models_from_a_jitted_step_with_integer_arrays_reuse_the_programs(build):
    """eqx.filter_jit returns new array objects for every array field, the integer index
    of Picky included: the same architecture, accepted (was refused by kernel_fn as other
    fixed leaves), without a retrace, and the kernels of each step's weights and index."""
    x = jax.random.normal(jax.random.PRNGKey(8), (6, 5))
    model = Picky(jnp.array([0, 2, 4]))

    @eqx.filter_jit
    def step(m):  # a gradient step, and an index moved as a data pipeline might
        grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(m)
        m = eqx.apply_updates(m, jax.tree.map(lambda g: -0.1 * g, grads))
        return eqx.tree_at(lambda m: m.index, m, (m.index + 1) % 5)

    models = [model]
    for _ in range(2):
        models.append(step(models[-1]))
    kernel = ntk_equinox.kernel if build == "kernel" else ntk_equinox.kernel_fn(model)
    kernel(model, x)
    traces, compiles = len(TRACES), len(COMPILES)
    kernels = [kernel(m, x) for m in models[1:]]
    assert (len(TRACES), len(COMPILES)) == (traces, compiles)
    for m, k in zip(models[1:], kernels, strict=True):
        assert m.index is not model.index
        f, params = _apply(m)
        reference.assert_close(k, reference.ntk(f, params, x, None)[0])


def test_docstrings_and_public_seam():
    """Every public function documents shapes, errors, cost, example and source; the
    adapter imports no private name of ntk_core (ntk_core.adapters is the public seam)."""
    for name in ntk_equinox.__all__:
        doc = getattr(ntk_equinox, name).__doc__
        for part in ("N1", "Args:", "Returns:", "Raises:", "Cost", "Example", "Reference"):
            assert part in doc, (name, part)
    module = importlib.import_module("ntk_equinox._kernel")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
    source = pathlib.Path(module.__file__)
    tree = ast.parse(source.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            private = any(part.startswith("_") for part in (node.module or "").split("."))
            assert not (node.module or "").startswith("ntk_core") or not private, node.module
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "ntk_core":
                assert not node.attr.startswith("_"), node.attr
    assert len(source.read_text().splitlines()) <= 150


@pytest.mark.parametrize("degree", [1, 2])
@pytest.mark.parametrize("name", ["mlp", "picky"])
def test_linearize_and_taylor_expand_against_nested_jvps(name, degree):
    """f_lin / f_taylor at model0 are the model's outputs; at moved weights they are
    f + Df[δ] (+ ½ D²f[δ, δ]) by jax.jvp of the model itself; the integer field is held
    at model0's (another value: refused outside jit, model0's inside)."""
    if name == "mlp":
        model0, x = MODELS["mlp"][0](jax.random.PRNGKey(0)), jnp.ones((4, 4))
    else:
        model0, x = Picky(jnp.array([0, 2, 4])), jnp.ones((4, 5))
    x = x * jax.random.normal(jax.random.PRNGKey(4), x.shape)
    params0, rest = eqx.partition(model0, eqx.is_inexact_array)
    keys = iter(jax.random.split(jax.random.PRNGKey(5), 16))
    delta = jax.tree.map(lambda a: 0.3 * jax.random.normal(next(keys), a.shape), params0)
    moved = eqx.combine(jax.tree.map(jnp.add, params0, delta), rest)
    if degree == 1:
        expand = ntk_equinox.linearize(model0)
    else:
        expand = ntk_equinox.taylor_expand(model0, degree)

    def g(p):
        return jax.vmap(eqx.combine(p, rest))(x)

    y0, d1 = jax.jvp(g, (params0,), (delta,))
    _, d2 = jax.jvp(lambda p: jax.jvp(g, (p,), (delta,))[1], (params0,), (delta,))
    expected = y0 + d1 + (0.5 * d2 if degree == 2 else 0.0)
    reference.assert_close(expand(model0, x), np.asarray(y0, np.float64))
    reference.assert_close(expand(moved, x), np.asarray(expected, np.float64))
    assert float(jnp.abs(d2).max()) > 1e-2 * float(jnp.abs(d1).max())  # not a linear model
    if name == "picky":  # another integer field
        other = eqx.tree_at(lambda m: m.index, moved, jnp.array([1, 1, 1]))
        with pytest.raises(ValueError, match=r"model.index, of dtype int32, has no derivative"):
            expand(other, x)
        jitted = eqx.filter_jit(expand)(other, x)  # its value is not known there: model0's
        reference.assert_close(jitted, np.asarray(expected, np.float64))


def _make_mlp(key):
    return eqx.nn.MLP(4, 3, 16, 1, activation=jnp.tanh, key=key)


@pytest.mark.parametrize("batch_size_samples", [1, 2])
@pytest.mark.parametrize("given", [False, True])
def test_monte_carlo_kernels_are_the_mean_of_the_float64_references(given, batch_size_samples):
    """Θ_MC and K_MC equal the float64 means of each initialisation's reference NTK and
    NNGP (make_model(k_s), k_s = split(key, S)[s]), samples one by one or vmapped."""
    _, x1, x2 = _setup("mlp")
    x2 = x2 if given else None
    key, n = jax.random.PRNGKey(7), 4
    mc = ntk_equinox.monte_carlo_kernels(
        _make_mlp, x1, x2, key=key, n_samples=n, batch_size_samples=batch_size_samples
    )
    ntks, nngps = [], []
    for k in jax.random.split(key, n):
        f, params = _apply(_make_mlp(k))
        ntks.append(reference.ntk(f, params, x1, x2, (-1,))[0])
        nngps.append(reference.nngp(f, params, x1, x1 if x2 is None else x2, (-1,))[0])
    reference.assert_close(mc.ntk, np.mean(ntks, axis=0))
    reference.assert_close(mc.nngp, np.mean(nngps, axis=0))


def _linear(key):
    """One builder for every call (a new lambda would be a new function to compile)."""
    return eqx.nn.Linear(4, 3, key=key)


def test_functions_built_again_with_a_new_key_compile_nothing_new():
    """Issue 48: a seed loop. Each ntk_sketch_fn, kernel_fn and Monte Carlo average built
    again for a model of the same structure (a new key, the same shapes; the same
    make_model) runs the programs of the first one, with the results of the core's
    sketch for the same key and k and of the float64 reference."""
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    model = _linear(jax.random.PRNGKey(0))
    keys = jax.random.split(jax.random.PRNGKey(2), 2)

    def run(key):
        return (
            ntk_equinox.ntk_sketch_fn(model, k=16, key=key)(model, x),
            ntk_equinox.kernel_fn(model)(model, x),
            ntk_equinox.monte_carlo_kernels(_linear, x, key=key, n_samples=2).ntk,
        )

    jax.block_until_ready(run(keys[0]))
    before = len(COMPILES)
    phi, theta, mc = jax.block_until_ready(run(keys[1]))
    assert len(COMPILES) == before
    f, params = _apply(model)
    core = ntk_core.ntk_sketch_fn(f, k=16, key=keys[1])(params, x)
    np.testing.assert_allclose(phi, core, rtol=1e-5, atol=1e-6 * float(np.abs(core).max()))
    reference.assert_close(theta, reference.ntk(f, params, x, None)[0])
    fs, points = zip(*(_apply(_linear(k)) for k in jax.random.split(keys[1], 2)), strict=True)

    def both(ps, x):  # side by side, no parameter shared: its traced NTK is the mean
        return jnp.concatenate([g(p, x) for g, p in zip(fs, ps, strict=True)], axis=-1)

    reference.assert_close(mc, reference.ntk(both, list(points), x, None)[0])
