"""ntk_flax against the float64 reference, and its documented errors."""

from __future__ import annotations

import inspect
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import compiles
import ntk_core
import ntk_flax
import reference
import zoo


def _ref(entry, x1, x2, kind="ntk", **axes):
    fn = reference.ntk if kind == "ntk" else reference.nngp
    return fn(zoo.apply_fn(entry), entry.variables["params"], x1, x2, **axes)


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_kernel_and_nngp_match_reference(name):
    entry = zoo.ZOO[name]
    x1, _ = zoo.inputs(entry)  # x2 given is covered by tests/core for every model
    kw = dict(apply_kwargs=entry.apply_kwargs)
    k = ntk_flax.kernel(entry.model, entry.variables, x1, **kw, trace_axes=())
    for a, e in zip(jax.tree.leaves(k), _ref(entry, x1, None, trace_axes=()), strict=True):
        reference.assert_close(a, e)
    g = ntk_flax.nngp(entry.model, entry.variables, x1, **kw)
    for a, e in zip(jax.tree.leaves(g), _ref(entry, x1, None, "nngp"), strict=True):
        reference.assert_close(a, e)


CALLS = []


class Counting(nn.Module):
    @nn.compact
    def __call__(self, x):
        CALLS.append(1)  # runs only while JAX traces
        return nn.Dense(2)(jnp.tanh(nn.Dense(4)(x)))

    def features(self, x):
        return jnp.tanh(self(x))


def test_kernel_fn_reused_across_training_steps_without_recompiling():
    model = Counting()
    x = jax.random.normal(jax.random.PRNGKey(0), (5, 3))
    variables = model.init(jax.random.PRNGKey(1), x)
    kernel = ntk_flax.kernel_fn(model, trace_axes=())
    first = kernel(variables, x)
    n = len(CALLS)
    for step in range(3):  # new parameters each "training step"
        variables = jax.tree.map(lambda p, s=step: p * 0.9 + 0.01 * s, variables)
        later = kernel(variables, x)
    assert len(CALLS) == n
    assert not np.allclose(first, later)


def test_method_and_only_params_differentiated():
    model = Counting()
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 3))
    variables = model.init(jax.random.PRNGKey(1), x)

    def f(p, x):
        return model.apply({"params": p}, x, method=Counting.features)

    expected = reference.ntk(f, variables["params"], x, None, trace_axes=())[0]
    k = ntk_flax.kernel(model, variables, x, method="features", trace_axes=())
    reference.assert_close(k, expected)


def test_batchnorm_eval_holds_batch_stats_fixed():
    entry = zoo.ZOO["batchnorm_eval"]
    x1, x2 = zoo.inputs(entry)
    k = ntk_flax.kernel(entry.model, entry.variables, x1, x2, apply_kwargs={"train": False})
    reference.assert_close(k, _ref(entry, x1, x2)[0])


def test_batchnorm_training_refused_with_vmap_axes_0_and_exact_with_none():
    entry = zoo.ZOO["batchnorm_eval"]
    x = entry.make_x(jax.random.PRNGKey(3), 4)
    with pytest.raises(
        ValueError, match=r"ntk_flax.kernel: the model updates its variables .* pass vmap_axes=None"
    ):
        ntk_flax.kernel(entry.model, entry.variables, x, apply_kwargs={"train": True})
    rest = {"batch_stats": entry.variables["batch_stats"]}

    def batch_fn(p, x):
        out, _ = entry.model.apply({"params": p, **rest}, x, train=True, mutable=["batch_stats"])
        return out

    expected = reference.ntk(batch_fn, entry.variables["params"], x, None, trace_axes=())[0]
    k = ntk_flax.kernel(
        entry.model, entry.variables, x, apply_kwargs={"train": True}, vmap_axes=None, trace_axes=()
    )
    reference.assert_close(k, expected)


def test_batchnorm_mutable_and_missing_batch_stats_get_fixes_that_work():
    """apply_kwargs['mutable'] and variables without 'batch_stats' are refused with their
    own fixes, and each fix the message gives runs (eval mode, train mode with
    vmap_axes=None, the whole variables dict)."""
    entry = zoo.ZOO["batchnorm_eval"]
    x = entry.make_x(jax.random.PRNGKey(3), 4)
    model, variables = entry.model, entry.variables
    with pytest.raises(TypeError) as info:
        ntk_flax.kernel(model, variables, x, apply_kwargs={"mutable": ["batch_stats"]})
    message = str(info.value)
    assert message.startswith(
        "ntk_flax.kernel: apply_kwargs holds 'mutable', an argument of model.apply"
    )
    assert "apply_kwargs={'train': False}" in message
    assert message.endswith("See docs/errors.md#flax-apply-kwargs.")  # there: training mode
    eval_k = ntk_flax.kernel(model, variables, x, apply_kwargs={"train": False})
    reference.assert_close(eval_k, _ref(entry, x, None)[0])
    train_k = ntk_flax.kernel(model, variables, x, apply_kwargs={"train": True}, vmap_axes=None)
    assert train_k.shape == eval_k.shape and np.all(np.isfinite(train_k))

    with pytest.raises(ValueError) as info:
        ntk_flax.kernel(model, {"params": variables["params"]}, x, apply_kwargs={"train": False})
    message = str(info.value)
    assert message.startswith(
        "ntk_flax.kernel: variables (holding ['params']) lacks the collection(s) "
        "['batch_stats'], which the model reads. Fix: pass the whole dict model.init(key, x) "
        "returns, or add them: {'params': ..., 'batch_stats': ...}"
    ), message
    fixed = {"params": variables["params"], "batch_stats": variables["batch_stats"]}
    reference.assert_close(ntk_flax.kernel(model, fixed, x, apply_kwargs={"train": False}), eval_k)


def test_wrong_input_shape_names_the_layer_and_the_shape_the_model_was_made_for():
    """The shape the variables were made for is found by initialising the model
    abstractly (no text of Flax's error is read): wrong channels name it, and inputs of
    that shape work; a wrong image size (seen only after a flatten) names the layer."""
    entry = zoo.ZOO["cnn10"]  # initialised for (N, 8, 8, 1)
    with pytest.raises(ValueError) as info:
        ntk_flax.kernel(entry.model, entry.variables, jnp.ones((2, 8, 8, 3)))
    assert re.match(
        r"ntk_flax.kernel: applying the model to x1 failed: x1 has per-sample shape "
        r"\(8, 8, 3\), but variables were made by model.init for inputs of per-sample shape "
        r"\(8, 8, 1\) \(parameter \['Conv_0'\]\['kernel'\] has shape \(3, 3, 1, \d+\)\)\. "
        r"Fix: pass inputs of shape \(N, 8, 8, 1\)",
        str(info.value),
    ), str(info.value)
    assert ntk_flax.kernel(entry.model, entry.variables, jnp.ones((2, 8, 8, 1))).shape == (2, 2)
    with pytest.raises(ValueError) as info:
        ntk_flax.kernel(entry.model, entry.variables, jnp.ones((2, 6, 6, 1)))
    assert re.match(
        r"ntk_flax.kernel: applying the model to x1 failed: variables do not fit x1's "
        r"per-sample shape \(6, 6, 1\) \(parameter \['Dense_\d+'\]\['kernel'\] has shape "
        r"\(\d+, \d+\), init on x1 makes \(\d+, \d+\)\)\. Fix: pass matching inputs",
        str(info.value),
    ), str(info.value)


class Dropout(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = False):
        return nn.Dense(2)(nn.Dropout(0.5, deterministic=deterministic)(nn.Dense(8)(x)))


def test_dropout_needs_rng_or_deterministic():
    model = Dropout()
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 4))
    variables = model.init(jax.random.PRNGKey(1), x, deterministic=True)
    with pytest.raises(
        ValueError,
        match=r"ntk_flax.kernel: the model needs a random key .* rngs=\{'dropout': key\}",
    ):
        ntk_flax.kernel(model, variables, x)
    k = ntk_flax.kernel(model, variables, x, rngs={"dropout": jax.random.PRNGKey(2)})
    assert k.shape == (3, 3) and np.isfinite(np.asarray(k)).all()

    def f(p, x):
        return model.apply({"params": p}, x, deterministic=True)

    k = ntk_flax.kernel(model, variables, x, apply_kwargs={"deterministic": True})
    reference.assert_close(k, reference.ntk(f, variables["params"], x, None)[0])


class BatchCentred(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(3)(x)
        return h - h.mean(axis=0, keepdims=True)


def test_interacting_samples_refused_with_vmap_axes_0():
    model = BatchCentred()
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 2))
    variables = model.init(jax.random.PRNGKey(1), x)
    with pytest.raises(
        ValueError,
        match=r"ntk_flax.kernel: the model.s output for one sample depends on the other samples.* or pass vmap_axes=None",
    ):
        ntk_flax.kernel(model, variables, x)
    assert ntk_flax.kernel(model, variables, x, vmap_axes=None).shape == (4, 4)


class CentredDropout(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dropout(0.5, deterministic=False)(nn.Dense(6)(x))
        return h - h.mean(axis=0, keepdims=True)


def test_interacting_samples_refused_even_with_dropout_rng():
    """Same-shape probes: the dropout mask is the same in both, so only coupling shows."""
    model = CentredDropout()
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 2))
    variables = model.init(jax.random.PRNGKey(1), x)
    with pytest.raises(ValueError, match=r"depends on the other samples"):
        ntk_flax.kernel(model, variables, x, rngs={"dropout": jax.random.PRNGKey(2)})


MODEL = nn.Dense(2)
X = jnp.ones((3, 4))
VARIABLES = MODEL.init(jax.random.PRNGKey(0), X)

ERRORS = [
    (
        "another model's params",
        lambda: ntk_flax.kernel(MODEL, {"Dense_0": VARIABLES["params"]}, X),
        ValueError,
        r"^ntk_flax.kernel: variables looks like the parameters of another model: top-level "
        r"names \['Dense_0'\], where model.init makes \['bias', 'kernel'\] for this one\. Fix: "
        r"pass the model they belong to, or this model's model.init\(key, x\)",
    ),
    (
        "variables not a dict",
        lambda: ntk_flax.kernel(MODEL, [1, 2], X),
        TypeError,
        r"variables must be the dict returned by model.init",
    ),
    (
        "not a linen module",
        lambda: ntk_flax.kernel(lambda x: x, VARIABLES, X),
        TypeError,
        r"model must be a flax.linen.Module",
    ),
    (
        "unknown option",
        lambda: ntk_flax.kernel(MODEL, VARIABLES, X, train=False),
        TypeError,
        r"unknown option\(s\) 'train'.* apply_kwargs=",
    ),
    (
        "nngp implementation",
        lambda: ntk_flax.nngp(MODEL, VARIABLES, X, implementation="ntvp"),
        TypeError,
        r"ntk_flax.nngp: unknown option\(s\) 'implementation'",
    ),
    (
        "bad implementation",
        lambda: ntk_flax.kernel(MODEL, VARIABLES, X, implementation="fast"),
        ValueError,
        r"implementation must be one of",
    ),
    (
        "wrong input shape",
        lambda: ntk_flax.kernel(MODEL, VARIABLES, jnp.ones((3, 5))),
        ValueError,
        r"^ntk_flax.kernel: applying the model to x1 failed: x1 has per-sample shape \(5,\), "
        r"but variables were made by model.init for inputs of per-sample shape \(4,\).*"
        r"Fix: pass inputs of shape \(N, 4\)",
    ),
    (
        "apply_kwargs with rngs",
        lambda: ntk_flax.kernel_fn(MODEL, apply_kwargs={"rngs": {}}),
        TypeError,
        r"^ntk_flax.kernel_fn: apply_kwargs holds 'rngs', an argument of model.apply .*Fix: "
        r"drop it and pass rngs=\{'dropout': key\} to the kernel call",
    ),
    (
        "apply_kwargs with method",
        lambda: ntk_flax.kernel(MODEL, VARIABLES, X, apply_kwargs={"method": "__call__"}),
        TypeError,
        r"^ntk_flax.kernel: apply_kwargs holds 'method'.*Fix: drop it and pass method= to "
        r"ntk_flax.kernel itself",
    ),
    (
        "empty input",
        lambda: ntk_flax.kernel(MODEL, VARIABLES, jnp.ones((0, 4))),
        ValueError,
        r"ntk_flax.kernel: x1 is empty",
    ),
    (
        "plan with another model's params",
        lambda: ntk_flax.plan(MODEL, {"w": X}, X),
        ValueError,
        r"^ntk_flax.plan: variables looks like the parameters of another model: .*\['w'\]",
    ),
    (
        "plan with an unknown option",
        lambda: ntk_flax.plan(MODEL, VARIABLES, X, train=False),
        TypeError,
        r"^ntk_flax.plan: unknown option\(s\) 'train'",
    ),
]


@pytest.mark.parametrize("call, exc, pattern", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_error(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_batch_size_gives_the_one_call_kernel():
    entry = zoo.ZOO["cnn10"]
    x1, x2 = zoo.inputs(entry, 13, 6)
    for kind, fn in (("ntk", ntk_flax.kernel), ("nngp", ntk_flax.nngp)):
        for x in (x2, None):
            one_call = np.asarray(fn(entry.model, entry.variables, x1, x, trace_axes=()))
            batched = fn(entry.model, entry.variables, x1, x, trace_axes=(), batch_size=4)
            assert isinstance(batched, np.ndarray) and batched.shape == one_call.shape
            assert np.abs(batched - one_call).max() <= 1e-5 * np.abs(one_call).max(), kind
            reference.assert_close(batched, _ref(entry, x1, x, kind, trace_axes=())[0])
    on_device = ntk_flax.kernel_fn(entry.model, batch_size=4, store_on_device=True)
    assert isinstance(on_device(entry.variables, x1), jax.Array)


@pytest.mark.parametrize("name", ["mlp", "batchnorm_eval", "tied"])
def test_kernel_per_leaf_matches_each_leafs_reference_and_sums_to_kernel(name):
    entry = zoo.ZOO[name]
    x1, x2 = zoo.inputs(entry)
    kw = dict(apply_kwargs=entry.apply_kwargs, trace_axes=())
    per_leaf = ntk_flax.kernel_per_leaf(entry.model, entry.variables, x1, x2, **kw)
    params = entry.variables["params"]
    assert jax.tree.structure(per_leaf) == jax.tree.structure(params)  # no batch_stats
    expected_total = _ref(entry, x1, x2, trace_axes=())[0]
    scale = np.abs(expected_total).max()  # a leaf's share can be 0 (a bias before softmax)
    for i, got in enumerate(jax.tree.leaves(per_leaf)):
        f, leaf = reference.leaf_alone(zoo.apply_fn(entry), params, i)
        expected = reference.ntk(f, leaf, x1, x2, trace_axes=())[0]
        reference.assert_close(got, expected, scale=scale)
    total = np.asarray(ntk_flax.kernel(entry.model, entry.variables, x1, x2, **kw), np.float64)
    reference.assert_close(total, expected_total)
    reference.assert_close(sum(np.asarray(k, np.float64) for k in jax.tree.leaves(per_leaf)), total)


def test_kernel_per_leaf_fn_reused_without_recompiling():
    model = Counting()
    x = jax.random.normal(jax.random.PRNGKey(0), (5, 3))
    variables = model.init(jax.random.PRNGKey(1), x)
    kernel = ntk_flax.kernel_per_leaf_fn(model, implementation="structured")
    first = kernel(variables, x)
    n = len(CALLS)
    variables = jax.tree.map(lambda p: p * 0.5, variables)
    later = kernel(variables, x)
    assert len(CALLS) == n
    assert not np.allclose(first["Dense_0"]["kernel"], later["Dense_0"]["kernel"])


class HalfPrecisionHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(6)(x))
        return nn.Dense(2, dtype=jnp.bfloat16)(h)


@pytest.mark.filterwarnings("ignore:.*computes in half precision:UserWarning")  # bf16 model
def test_plan_lists_the_params_leaves_with_their_methods():
    entry = zoo.ZOO["batchnorm_eval"]
    x1, _ = zoo.inputs(entry)
    kw = dict(apply_kwargs=entry.apply_kwargs)
    plan = ntk_flax.plan(entry.model, entry.variables, x1, **kw)
    params = entry.variables["params"]
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert [leaf.path for leaf in plan.leaves] == paths  # params only, not batch_stats
    assert [leaf.size for leaf in plan.leaves] == [v.size for v in jax.tree.leaves(params)]
    assert plan.implementation == "structured"
    methods = {leaf.path: leaf.method for leaf in plan.leaves}
    assert methods["['BatchNorm_0']['scale']"].startswith("structured (elementwise scale")
    assert methods["['Conv_0']['kernel']"].startswith("structured (1 convolution")
    kernel = ntk_flax.kernel_fn(entry.model, **kw)
    assert kernel.plan(entry.variables, x1).leaves == plan.leaves
    assert kernel.implementation_for(entry.variables, x1) == plan.implementation
    # A bfloat16 layer: the plan names the fallback and its reason, per Flax path.
    model = HalfPrecisionHead()
    x = jnp.ones((4, 3))
    variables = model.init(jax.random.PRNGKey(0), x)
    methods = {
        leaf.path: leaf.method
        for leaf in ntk_flax.plan(model, variables, x, implementation="structured").leaves
    }
    assert methods["['Dense_0']['kernel']"] == "structured (1 matrix product)"
    assert methods["['Dense_1']['kernel']"].startswith(
        "jacobian (fallback: cast to a lower precision (float32 -> bfloat16"
    )
    source, start = inspect.getsourcelines(HalfPrecisionHead)
    line = start + next(i for i, text in enumerate(source) if "bfloat16" in text)
    where = rf"; at test_flax_adapter.py:{line}, in (HalfPrecisionHead\.)?__call__\)$"
    assert re.search(where, methods["['Dense_1']['kernel']"])  # the user's line, not Flax's


def test_apply_kwargs_checked_even_after_a_cached_call():
    """The one-call entry points cache their kernel function per arguments; a falsy
    non-dict apply_kwargs must not reuse the entry of apply_kwargs=None."""
    ntk_flax.plan(MODEL, VARIABLES, X)
    ntk_flax.kernel(MODEL, VARIABLES, X)
    for bad in (False, 0, "", []):
        with pytest.raises(TypeError, match=r"^ntk_flax.plan: apply_kwargs must be a dict"):
            ntk_flax.plan(MODEL, VARIABLES, X, apply_kwargs=bad)
        with pytest.raises(TypeError, match=r"^ntk_flax.kernel: apply_kwargs must be a dict"):
            ntk_flax.kernel(MODEL, VARIABLES, X, apply_kwargs=bad)


def test_per_leaf_kernel_function_has_a_plan_without_ntvp():
    model = Counting()
    x = jax.random.normal(jax.random.PRNGKey(0), (5, 3))
    variables = model.init(jax.random.PRNGKey(1), x)
    kernel = ntk_flax.kernel_per_leaf_fn(model, trace_axes=())
    plan = kernel.plan(variables, x)
    assert {e.implementation for e in plan.estimates} == {"jacobian", "structured"}
    assert [leaf.path for leaf in plan.leaves] == [
        "['Dense_0']['bias']",
        "['Dense_0']['kernel']",
        "['Dense_1']['bias']",
        "['Dense_1']['kernel']",
    ]
    assert plan.implementation == kernel.implementation_for(variables, x)


def test_out_of_core_kernel_equals_the_in_memory_one(tmp_path):
    """Issue 19: out= reaches the blocked engine through the adapter (the model's
    batch statistics held fixed are part of the fingerprint); the file equals the
    in-memory tiles bit for bit, and a resume with other batch statistics is refused."""
    entry = zoo.ZOO["batchnorm_eval"]
    x1, x2 = zoo.inputs(entry, 13, 6)
    kw = dict(apply_kwargs=entry.apply_kwargs, trace_axes=(), batch_size=4)
    in_memory = ntk_flax.kernel(entry.model, entry.variables, x1, x2, **kw)
    path = str(tmp_path / "k.npy")
    written = ntk_flax.kernel(entry.model, entry.variables, x1, x2, out=path, **kw)
    assert isinstance(written, np.memmap) and np.array_equal(written, in_memory)
    reference.assert_close(written, _ref(entry, x1, x2, "ntk", trace_axes=())[0])
    other = jax.tree.map(lambda v: v, dict(entry.variables))
    other["batch_stats"] = jax.tree.map(lambda v: v + 1.0, other["batch_stats"])
    manifest = path + ".manifest.json"
    text = open(manifest).read().replace('"complete": true', '"complete": false')
    open(manifest, "w").write(text)
    with pytest.raises(
        ValueError,
        match=r"^ntk_flax.kernel: resume=True, but .* was started "
        r"by a different call: model state \(aux\) differ",
    ):
        ntk_flax.kernel(entry.model, other, x1, x2, out=path, resume=True, **kw)


def test_monte_carlo_kernels_to_files_equal_the_in_memory_average(tmp_path):
    """Issue 19: out= on the linen Monte Carlo kernels: both files equal the in-memory
    average bit for bit (x2 given, trace_axes=()), and the mean of separate kernels."""
    model = nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(2)])
    x1 = jax.random.normal(jax.random.PRNGKey(1), (11, 3))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (5, 3))
    kw = dict(key=jax.random.PRNGKey(3), n_samples=2, trace_axes=(), batch_size=4)
    in_memory = ntk_flax.monte_carlo_kernels(model, x1, x2, **kw)
    got = ntk_flax.monte_carlo_kernels(model, x1, x2, out=str(tmp_path / "mc.npy"), **kw)
    assert isinstance(got.ntk, np.memmap) and got.ntk.shape == (11, 5, 2, 2)
    assert got.ntk.tobytes() == np.asarray(in_memory.ntk).tobytes()
    assert got.nngp.tobytes() == np.asarray(in_memory.nngp).tobytes()
    variables = [model.init(k, x1[:1]) for k in jax.random.split(kw["key"], 2)]
    ntk = np.mean([ntk_flax.kernel(model, v, x1, x2, trace_axes=()) for v in variables], 0)
    np.testing.assert_allclose(np.asarray(got.ntk), ntk, atol=1e-6 * np.abs(ntk).max())


COMPILES = compiles.counter()


class Twin(nnx.Module):
    """The nnx twin of SEQUENTIAL below."""

    def __init__(self, rngs):
        self.hidden, self.out = nnx.Linear(4, 6, rngs=rngs), nnx.Linear(6, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def _pure(module):
    """The module as a function of its nnx.Param state, and that state."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    return (lambda p, x: nnx.merge(graphdef, p, rest)(x)), params


# A list of layers: a linen module no hash takes (so no one-call cache either).
SEQUENTIAL = nn.Sequential([nn.Dense(6), nn.tanh, nn.Dense(2)])


def _mean_ntk(f, points, x):
    """The float64 reference of the mean traced NTK over ``points`` (parameters of ``f``),
    from one Jacobian: the outputs of every point side by side share no parameter, so the
    kernel of g(θ_1..θ_S) = [f(θ_1), ..., f(θ_S)] is block diagonal and its trace over the
    S·O outputs is the mean of the S traced kernels."""

    def g(ps, x):
        return jnp.concatenate([f(p, x) for p in ps], axis=-1)

    return reference.ntk(g, list(points), x, None)[0]


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_functions_built_again_with_a_new_key_compile_nothing_new(flavour):
    """Issue 48: a seed loop. Each ntk_sketch_fn, kernel_fn, statistic and Monte Carlo
    average built again (a new key, the same shapes) runs the programs of the first one
    (before: one compile per new function, 1.5-1.8 s on a small CNN against 0.03 s for
    the core's), with the results of the core's sketch for the same key and k and of the
    float64 reference. Linen: a Sequential, which no hash takes (so the statistic's
    one-call cache missed too)."""
    x = jax.random.normal(jax.random.PRNGKey(0), (5, 4))
    keys = jax.random.split(jax.random.PRNGKey(2), 2)
    inits = jax.random.split(keys[1], 2)  # the second Monte Carlo average's
    if flavour == "linen":
        model = build = SEQUENTIAL  # a linen module is its own initialiser
        variables = model.init(jax.random.PRNGKey(1), x)
        f, params = (lambda p, x: model.apply({"params": p}, x)), variables["params"]
        points = [model.init(k, x[:1])["params"] for k in inits]
    else:
        model, build, variables = Twin(nnx.Rngs(1)), Twin, None
        f, params = _pure(model)
        points = [_pure(Twin(nnx.Rngs(k)))[1] for k in inits]

    def run(key):
        return (
            ntk_flax.ntk_sketch_fn(model, k=16, key=key)(variables, x),
            ntk_flax.kernel_fn(model)(variables, x),
            ntk_flax.monte_carlo_kernels(build, x, key=key, n_samples=2).ntk,
            # exact (N·O <= m); for a hashable model its one-call cache hit before
            ntk_flax.ntk_frobenius_sq(model, variables, x, key=key).estimate
            if flavour == "linen"
            else None,
        )

    jax.block_until_ready(run(keys[0]))
    before = len(COMPILES)
    phi, theta, mc, frobenius = jax.block_until_ready(run(keys[1]))
    assert len(COMPILES) == before
    core = ntk_core.ntk_sketch_fn(f, k=16, key=keys[1])(params, x)
    np.testing.assert_allclose(phi, core, rtol=1e-5, atol=1e-6 * float(np.abs(core).max()))
    full = reference.full_ntk(f, params, x, None)[0]  # (N, O, N, O)
    reference.assert_close(theta, reference.reduce_full(full, (-1,), ()))
    reference.assert_close(mc, _mean_ntk(f, points, x))
    if frobenius is not None:
        assert abs(frobenius - np.sum(full**2)) <= 1e-5 * np.sum(full**2)  # ‖Θ‖²_F, N·O square


def test_the_models_apply_is_equal_only_for_an_equal_model_and_arguments():
    """What issue 48's shared programs rest on: the adapter's apply3 (adapters.keyed) is
    equal for an equal model, method and apply_kwargs, a list of layers compared by value,
    and differs for another width, method, a flag of another type (True is not 1) or an
    array argument (equal only to itself, as a closure is)."""
    from ntk_flax._kernel import _model_apply

    def apply3(model, method=None, **apply_kwargs):
        return _model_apply(model, method, apply_kwargs, "x", "ntk_flax.kernel_fn")

    def seq(width):
        return nn.Sequential([nn.Dense(width), nn.tanh, nn.Dense(2)])

    same = apply3(seq(6))
    assert same == apply3(seq(6)) and hash(same) == hash(apply3(seq(6)))
    assert same != apply3(seq(7)) and same != apply3(seq(6), method="__call__")
    assert apply3(Counting(), train=True) == apply3(Counting(), train=True)
    assert apply3(Counting(), train=True) != apply3(Counting(), train=1)
    scale = jnp.ones(2)
    assert apply3(Counting(), scale=scale) != apply3(Counting(), scale=scale)
