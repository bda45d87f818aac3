"""ntk_flax with flax.nnx modules: against the float64 reference and the same network in
flax.linen (weights copied over), in training loops, per leaf, and its errors."""

from __future__ import annotations

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ntk_flax
import reference

# flax >= 0.12 deprecates Variable.value in favour of variable[...]; the oldest flax this
# project supports (0.10) reads and writes values through .value.
pytestmark = pytest.mark.filterwarnings(
    "ignore:'.value' (access|setter) is now deprecated:DeprecationWarning"
)

TRACES = []


class Net(nnx.Module):
    def __init__(self, rngs):
        self.dense_0 = nnx.Linear(3, 5, rngs=rngs)
        self.norm = nnx.BatchNorm(5, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.dense_1 = nnx.Linear(5, 2, rngs=rngs)

    def __call__(self, x):
        TRACES.append(1)  # runs only while JAX traces
        return self.dense_1(self.drop(jnp.tanh(self.norm(self.dense_0(x)))))


class LinenTwin(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(5, name="dense_0")(x)
        h = nn.BatchNorm(use_running_average=True, name="norm")(h)
        return nn.Dense(2, name="dense_1")(jnp.tanh(h))


X1 = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
X2 = jax.random.normal(jax.random.PRNGKey(2), (3, 3))


def _net():
    """An nnx Net in evaluation mode with non-trivial BatchNorm statistics."""
    model = Net(nnx.Rngs(0))
    model.norm.mean.value = jnp.linspace(-0.5, 0.5, 5)
    model.norm.var.value = jnp.linspace(0.5, 2.0, 5)
    model.eval()
    return model


def _pure(model):
    """The reference's apply_fn: the module as a function of its nnx.Param state."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # fresh variables in each trace: nnx.RNN advances its RNG count when called
    return (lambda p, x: nnx.merge(graphdef, p, jax.tree.map(lambda a: a, rest))(x)), params


@pytest.mark.parametrize("implementation", ["structured", "jacobian"])
def test_kernel_and_nngp_match_reference_and_the_linen_twin(implementation):
    model = _net()
    k = ntk_flax.kernel(model, None, X1, X2, trace_axes=(), implementation=implementation)
    f, params = _pure(model)
    expected = reference.ntk(f, params, X1, X2, trace_axes=())[0]
    reference.assert_close(k, expected)
    reference.assert_close(ntk_flax.nngp(model, None, X1, X2), reference.nngp(f, params, X1, X2)[0])
    # The same network in flax.linen, with the nnx weights and statistics copied over.
    variables = {
        "params": {
            "dense_0": {"kernel": model.dense_0.kernel.value, "bias": model.dense_0.bias.value},
            "norm": {"scale": model.norm.scale.value, "bias": model.norm.bias.value},
            "dense_1": {"kernel": model.dense_1.kernel.value, "bias": model.dense_1.bias.value},
        },
        "batch_stats": {"norm": {"mean": model.norm.mean.value, "var": model.norm.var.value}},
    }
    linen = ntk_flax.kernel(LinenTwin(), variables, X1, X2, trace_axes=())
    reference.assert_close(k, np.asarray(linen, np.float64))


def test_training_mode_refused_with_the_eval_fix():
    model = _net()
    model.train()  # BatchNorm with batch statistics: samples interact
    with pytest.raises(ValueError, match=r"^ntk_flax.kernel: .*Fix: model\.eval\(\)"):
        ntk_flax.kernel(model, None, X1)


def test_kernel_fn_follows_the_module_and_given_variables_without_recompiling():
    model = _net()
    kernel = ntk_flax.kernel_fn(model)
    first = kernel(None, X1)
    n = len(TRACES)
    model.dense_0.kernel.value = model.dense_0.kernel.value * 1.5  # an in-place update
    updated = kernel(None, X1)
    state = jax.tree.map(lambda v: 0.5 * v, nnx.state(model, nnx.Param))
    given = kernel(state, X1)
    assert len(TRACES) == n  # same shapes, same mode: no retrace
    f, params = _pure(model)
    reference.assert_close(updated, reference.ntk(f, params, X1, None)[0])
    reference.assert_close(given, reference.ntk(f, state, X1, None)[0])
    assert not np.allclose(first, updated)


def test_per_leaf_kernels_and_plan():
    model = _net()
    per_leaf = ntk_flax.kernel_per_leaf(model, None, X1, X2, trace_axes=())
    f, params = _pure(model)
    assert jax.tree.structure(per_leaf) == jax.tree.structure(params)
    expected_total = reference.ntk(f, params, X1, X2, trace_axes=())[0]
    scale = np.abs(expected_total).max()
    for i, got in enumerate(jax.tree.leaves(per_leaf)):
        g, leaf = reference.leaf_alone(f, params, i)
        reference.assert_close(got, reference.ntk(g, leaf, X1, X2, trace_axes=())[0], scale=scale)
    plan = ntk_flax.plan(model, None, X1, implementation="structured")
    methods = {leaf.path: leaf.method for leaf in plan.leaves}
    assert methods["['dense_0']['kernel'].value"] == "structured (1 matrix product)"
    assert methods["['norm']['scale'].value"].startswith("structured (elementwise scale")
    assert len(methods) == len(jax.tree.leaves(params))  # Params only, no statistics


class Small(nnx.Module):
    """An nnx MLP for the Monte Carlo kernels (Dropout: built in evaluation mode)."""

    def __init__(self, rngs):
        self.dense_0 = nnx.Linear(3, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.dense_1 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.dense_1(self.drop(jnp.tanh(self.dense_0(x))))


def _small(rngs):
    model = Small(rngs)
    model.eval()
    return model


def test_monte_carlo_kernels_average_the_reference_over_fresh_modules():
    """The average over S = 3 modules built with nnx.Rngs(k_s), k_s = split(key, 3)[s],
    of the float64 reference NTK and NNGP of each, one sample at a time and in batches
    of 2 (vmapped, the last one partial)."""
    key = jax.random.PRNGKey(7)
    ntks, nngps = [], []
    for k in jax.random.split(key, 3):
        f, params = _pure(_small(nnx.Rngs(k)))
        ntks.append(reference.ntk(f, params, X1, X2, trace_axes=())[0])
        nngps.append(reference.nngp(f, params, X1, X2, trace_axes=())[0])
    assert not np.allclose(ntks[0], ntks[1])  # the initialisations differ
    for batch_size_samples in (1, 2):
        got = ntk_flax.monte_carlo_kernels(
            _small,
            X1,
            X2,
            key=key,
            n_samples=3,
            batch_size_samples=batch_size_samples,
            trace_axes=(),
        )
        reference.assert_close(got.ntk, np.mean(ntks, axis=0))
        reference.assert_close(got.nngp, np.mean(nngps, axis=0))


class RandomFeatures(nnx.Module):
    """Fixed random features (an nnx.Variable drawn from rngs, not a Param) and a
    trained read-out: each initialisation has its own features."""

    def __init__(self, rngs):
        self.proj = nnx.Variable(jax.random.normal(rngs.params(), (3, 16)))
        self.read = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.read(jnp.cos(x @ self.proj.value))


def test_monte_carlo_kernels_use_each_initialisations_other_state():
    """Non-Param state drawn at initialisation (random features) belongs to its
    sample: the result is the mean of the separately built modules' kernels."""
    key = jax.random.PRNGKey(5)
    got = ntk_flax.monte_carlo_kernels(
        RandomFeatures, X1, key=key, n_samples=3, batch_size_samples=2
    )
    ntks, nngps = [], []
    for k in jax.random.split(key, 3):
        f, params = _pure(RandomFeatures(nnx.Rngs(k)))
        ntks.append(reference.ntk(f, params, X1, None)[0])
        nngps.append(reference.nngp(f, params, X1, None)[0])
    reference.assert_close(got.ntk, np.mean(ntks, axis=0))
    reference.assert_close(got.nngp, np.mean(nngps, axis=0))


def test_dropout_in_training_mode_refused():
    """Train-mode Dropout would draw a mask per sample from the module's RNG state."""
    model = Small(nnx.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"^ntk_flax.nngp: the nnx module changes its own state when called \(RngCount at "
        r"drop/\S*count\)\. Fix: model.eval\(\), or pass apply_kwargs=\{'deterministic': True\}",
    ):
        ntk_flax.nngp(model, None, X1)
    with pytest.raises(
        ValueError,
        match=r"^ntk_flax.monte_carlo_kernels: the nnx module changes its own state when called"
        r".*Fix: call .eval\(\) on the module where it is built",
    ):
        ntk_flax.monte_carlo_kernels(Small, X1, key=jax.random.PRNGKey(0), n_samples=2)
    model.eval()
    f, params = _pure(model)
    reference.assert_close(ntk_flax.nngp(model, None, X1), reference.nngp(f, params, X1, None)[0])


class Switched(nnx.Module):
    """Dropout switched by the call's own argument, and a call counter."""

    def __init__(self, rngs, count=False):
        self.dense = nnx.Linear(3, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.calls = Calls(jnp.zeros(())) if count else None

    def __call__(self, x, deterministic=False):
        if self.calls is not None:
            self.calls.value = self.calls.value + 1
        return self.drop(self.dense(x), deterministic=deterministic)


class Calls(nnx.Variable):
    pass


@pytest.mark.parametrize("vmap_axes", [0, None])
def test_state_writes_decide_refusal_not_the_mode(vmap_axes):
    """A module in its default (training) mode whose call is made deterministic by
    apply_kwargs is a fixed function (kernel equals the reference); the same module with
    deterministic=False, or one that counts its calls, is refused."""
    model = Switched(nnx.Rngs(0))
    options = dict(vmap_axes=vmap_axes, apply_kwargs={"deterministic": True})
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    expected = reference.ntk(
        lambda p, x: nnx.merge(graphdef, p, rest)(x, deterministic=True), params, X1, None
    )[0]
    reference.assert_close(ntk_flax.kernel(model, None, X1, **options), expected)
    with pytest.raises(ValueError, match=r"changes its own state when called \(RngCount"):
        ntk_flax.kernel(model, None, X1, vmap_axes=vmap_axes, apply_kwargs={"deterministic": False})
    with pytest.raises(ValueError, match=r"changes its own state when called \(Calls at calls\)"):
        ntk_flax.kernel(Switched(nnx.Rngs(0), count=True), None, X1, **options)


def test_randomness_forced_by_the_call_in_evaluation_mode_gets_the_argument_fix():
    """Switched passes deterministic=False to its Dropout unless told otherwise, so
    model.eval() cannot help: the fix is the call's own switch, not eval()."""
    model = Switched(nnx.Rngs(0))
    model.eval()
    with pytest.raises(
        ValueError,
        match=r"^ntk_flax.kernel: .*\(RngCount at drop/\S*count\)\. Fix: its layers are in "
        r"evaluation mode, so let __call__ take the switch and pass "
        r"apply_kwargs=\{'deterministic': True\}",
    ):
        ntk_flax.kernel(model, None, X1)


class ExternalRngs(nnx.Module):
    """Dropout that draws from an nnx.Rngs given to the call."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(3, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return self.drop(self.dense(x), rngs=rngs)


def test_external_rngs_in_apply_kwargs():
    """Drawing from an outside nnx.Rngs is refused with its own fix (it was a wrapped
    TraceContextError); in evaluation mode the Rngs is unused and the kernel is exact."""
    model = ExternalRngs(nnx.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"^ntk_flax.kernel: the call writes the state of \['rngs'\] given in "
        r"apply_kwargs.*Fix: make the call deterministic",
    ):
        ntk_flax.kernel(model, None, X1, apply_kwargs={"rngs": nnx.Rngs(1)})
    model.eval()
    f, params = _pure(model)
    got = ntk_flax.kernel(model, None, X1, apply_kwargs={"rngs": nnx.Rngs(1)})
    reference.assert_close(got, reference.ntk(f, params, X1, None)[0])


class Recurrent(nnx.Module):
    """nnx.RNN over an LSTM cell: it splits an RNG key for its zero initial carry, so
    each call advances its RNG count without the output depending on the draw."""

    def __init__(self, rngs):
        self.rnn = nnx.RNN(nnx.LSTMCell(3, 6, rngs=rngs), rngs=rngs)
        self.out = nnx.Linear(6, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.rnn(x)[:, -1])


class Scanned(nnx.Module):
    """A layer applied three times through nnx.scan (a transformation of its own)."""

    def __init__(self, rngs):
        self.cell = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, None), out_axes=nnx.Carry, length=3)
        def step(h, cell):
            return jnp.tanh(cell(h))

        return step(x, self.cell)


XS = jax.random.normal(jax.random.PRNGKey(7), (4, 5, 3))  # 4 sequences of 5 steps


# flax 0.10's nnx.scan returns the parameters it carries as new values, which the
# state-write check cannot tell from writes: such models are refused there.
FLAX_VERSION = tuple(int(v) for v in flax.__version__.split(".")[:2])


@pytest.mark.skipif(FLAX_VERSION < (0, 12), reason="nnx.scan passes variables through")
@pytest.mark.parametrize("model_class, x", [(Recurrent, XS), (Scanned, X1)], ids=["rnn", "scan"])
def test_models_with_their_own_transformations(model_class, x):
    """An RNN's unused RNG draw is no state change; every implementation equals the
    reference, NTK-vector products included: they replay the model's one per-sample
    jaxpr (ntk_core._kernel.model.replay), in which nnx.scan is already traced, instead of
    nesting the model's own transformations inside theirs (which failed, so "ntvp" was
    refused for these models before)."""
    model = model_class(nnx.Rngs(0))
    f, params = _pure(model)
    expected = reference.ntk(f, params, x, None)[0]
    for implementation in ("auto", "structured", "jacobian", "ntvp"):
        kernel = ntk_flax.kernel(model, None, x, implementation=implementation)
        reference.assert_close(kernel, expected)


def test_dropout_without_rngs_gets_the_mode_fix():
    """A training-mode Dropout with no RNG stream (Flax: 'no `rngs` argument was
    provided') is told to switch the mode, not to check its variables."""
    with pytest.raises(
        ValueError,
        match=r"^ntk_flax.kernel: applying the model to x1 failed: ValueError: .*no `rngs` "
        r"argument was provided.*Fix: .*model.eval\(\)",
    ):
        ntk_flax.kernel(ExternalRngs(nnx.Rngs(0)), None, X1)


class Sown(nnx.Module):
    """A pure call that sows an intermediate and reads a Python-number constant."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(3, 5, rngs=rngs)
        self.out = nnx.Linear(5, 2, rngs=rngs)
        self.scale = nnx.Variable(3)  # a plain int, not an array

    def __call__(self, x):
        h = jnp.tanh(self.dense(x))
        self.sow(nnx.Intermediate, "h", h)
        return self.out(h) * self.scale.value


class WritesParam(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        self.dense.kernel.value = self.dense.kernel.value * 0.5
        return self.dense(x)


@pytest.mark.filterwarnings(
    "ignore:Using 'Module.sow\\(\\)' outside:DeprecationWarning"
)  # flax 0.12
def test_outputs_and_constants_accepted_parameter_writes_refused():
    """sow (an output of the call) and a Python-number Variable leave the function
    fixed: the kernel equals the reference; a call that writes its own Param does not."""
    model = Sown(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    expected = reference.ntk(lambda p, x: nnx.merge(graphdef, p, rest)(x), params, X1, None)[0]
    reference.assert_close(ntk_flax.kernel(model, None, X1), expected)
    with pytest.raises(ValueError, match=r"\(Param at dense/kernel\)\. Fix: keep state writes out"):
        ntk_flax.kernel(WritesParam(nnx.Rngs(0)), None, X1)


def test_variables_of_other_shapes_refused():
    model = _net()
    wider = jax.tree.map(lambda a: jnp.concatenate([a, a], -1), nnx.state(model, nnx.Param))
    with pytest.raises(ValueError, match=r"^ntk_flax.kernel: variables do not have the shapes"):
        ntk_flax.kernel(model, wider, X1)


ERRORS = [
    (
        "variables of another structure",
        lambda: ntk_flax.kernel(_net(), {"w": jnp.ones(3)}, X1),
        ValueError,
        r"^ntk_flax.kernel: variables do not have the structure of the module's nnx.Param",
    ),
    (
        "rngs for an nnx module",
        lambda: ntk_flax.kernel(_net(), None, X1, rngs={"dropout": jax.random.PRNGKey(0)}),
        TypeError,
        r"^ntk_flax.kernel: rngs was given, but an nnx module carries its own nnx.Rngs",
    ),
    (
        "a method it does not have",
        lambda: ntk_flax.kernel_fn(_net(), method="features"),
        TypeError,
        r"^ntk_flax.kernel_fn: method must name a method of the nnx module Net, got 'features'",
    ),
    (
        "Monte Carlo of a built module",
        lambda: ntk_flax.monte_carlo_kernels(_net(), X1, key=jax.random.PRNGKey(0), n_samples=2),
        TypeError,
        r"^ntk_flax.monte_carlo_kernels: model must be a linen module or a function building an "
        r"nnx module, got the nnx module Net\. Fix: pass the function that builds it",
    ),
    (
        "Monte Carlo builder without an rngs argument",
        lambda: ntk_flax.monte_carlo_kernels(
            lambda: _small(nnx.Rngs(0)), X1, key=jax.random.PRNGKey(0), n_samples=2
        ),
        TypeError,
        r"^ntk_flax.monte_carlo_kernels: model\(nnx.Rngs\(key\)\) failed with TypeError",
    ),
    (
        "Monte Carlo builder returning None",
        lambda: ntk_flax.monte_carlo_kernels(
            lambda rngs: _small(rngs).eval(), X1, key=jax.random.PRNGKey(0), n_samples=2
        ),
        TypeError,
        r"^ntk_flax.monte_carlo_kernels: model\(nnx.Rngs\(key\)\) returned NoneType, not an "
        r"nnx module",
    ),
    (
        "Monte Carlo builder ignoring its rngs",
        lambda: ntk_flax.monte_carlo_kernels(
            lambda rngs: _small(nnx.Rngs(0)), X1, key=jax.random.PRNGKey(0), n_samples=2
        ),
        ValueError,
        r"^ntk_flax.monte_carlo_kernels: model\(nnx.Rngs\(k\)\) built the same module for two "
        r"different keys.*Fix: build with the rngs it is given",
    ),
    (
        "Monte Carlo without its key",
        lambda: ntk_flax.monte_carlo_kernels(_small, X1, n_samples=2),
        TypeError,
        r"^ntk_flax.monte_carlo_kernels: missing a required argument: 'key'.*Fix: pass key=\.\.\. "
        r"by keyword",
    ),
    (
        "inputs of the wrong shape",
        lambda: ntk_flax.kernel(_net(), None, jnp.ones((4, 5))),
        ValueError,
        r"^ntk_flax.kernel: applying the model to x1 failed",
    ),
]


@pytest.mark.parametrize("call, exc, pattern", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_error(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_monte_carlo_kernels_to_files_equal_the_in_memory_average(tmp_path):
    """Issue 19: out= with an nnx builder: each sample's random features are part of
    its running sum; both files equal the in-memory average bit for bit and the
    float64 reference within tolerance, and a resume with another key is refused."""
    key = jax.random.PRNGKey(5)
    kw = dict(key=key, n_samples=3, batch_size=4)
    in_memory = ntk_flax.monte_carlo_kernels(RandomFeatures, X1, **kw)
    path = str(tmp_path / "mc.npy")
    got = ntk_flax.monte_carlo_kernels(RandomFeatures, X1, out=path, **kw)
    assert isinstance(got.ntk, np.memmap)
    assert got.ntk.tobytes() == np.asarray(in_memory.ntk).tobytes()
    assert got.nngp.tobytes() == np.asarray(in_memory.nngp).tobytes()
    modules = [_pure(RandomFeatures(nnx.Rngs(k))) for k in jax.random.split(key, 3)]
    reference.assert_close(got.ntk, np.mean([reference.ntk(*m, X1, None)[0] for m in modules], 0))
    with pytest.raises(ValueError, match=r"^ntk_flax.monte_carlo_kernels: out=.* exists"):
        ntk_flax.monte_carlo_kernels(RandomFeatures, X1, out=path, **{**kw, "key": key + 1})


def test_variable_classes():
    from ntk_flax import _nnx

    found = _nnx._variables(nnx.state(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.Param))
    assert [kind for _, kind in found] == [nnx.Param, nnx.Param]
