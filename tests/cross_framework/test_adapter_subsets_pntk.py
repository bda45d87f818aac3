"""Issue 27's kernels in the adapters. ``wrt=`` with each framework's parameter names:
the same MLP in Flax linen, nnx, Haiku and equinox (weights transplanted from Flax) gives
the same head-only and biases-only kernels, equal to a float64 Jacobian contraction of the
plain JAX model with respect to those leaves alone. The pseudo-NTK (``pntk``): every
adapter equals (1/O) Σ_ab of the float64 full NTK. The matrix-free statistics (``ntk_trace``,
``ntk_frobenius_sq``, ``ntk_effective_rank``, ``ntk_kernel_alignment``): exact at m >= M
against the float64 kernel's trace, ‖Θ‖²_F, effective rank and alignment (whole and head
only), and an estimate at m < M within its standard errors; Monte Carlo kernels with
``wrt=``: the mean of the subset kernels of the same initialisations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import frameworks
import reference

frameworks.skip_module_unless("flax", "haiku", "equinox")

import equinox as eqx  # noqa: E402
import flax.linen as nn  # noqa: E402
import haiku as hk  # noqa: E402
from flax import nnx  # noqa: E402

import ntk_core  # noqa: E402
import ntk_equinox  # noqa: E402
import ntk_flax  # noqa: E402
import ntk_haiku  # noqa: E402

X = jax.random.normal(jax.random.PRNGKey(0), (5, 4))


class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(8)(x))  # created in forward order: Dense_0, Dense_1 (the head)
        return nn.Dense(3)(h)


class Nnx(nnx.Module):
    def __init__(self, p):
        def linear(name, a, b):  # the Flax layer's weights (initialisers that return them)
            w, bias = p[name]["kernel"], p[name]["bias"]
            rngs = nnx.Rngs(0)
            return nnx.Linear(a, b, kernel_init=lambda *_: w, bias_init=lambda *_: bias, rngs=rngs)

        self.hidden, self.head = linear("Dense_0", 4, 8), linear("Dense_1", 8, 3)

    def __call__(self, x):
        return self.head(jnp.tanh(self.hidden(x)))


def _plain(p, x):
    h = jnp.tanh(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    return h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


def _haiku(x):
    return hk.nets.MLP([8, 3], activation=jnp.tanh)(x)


def _equinox(p):
    mlp = eqx.nn.MLP(4, 3, 8, 1, activation=jnp.tanh, key=jax.random.PRNGKey(1))
    for i, name in enumerate(("Dense_0", "Dense_1")):
        at = lambda m, i=i: (m.layers[i].weight, m.layers[i].bias)  # noqa: E731
        mlp = eqx.tree_at(at, mlp, (p[name]["kernel"].T, p[name]["bias"]))
    return mlp


@pytest.mark.parametrize("subset", ["head", "biases"])
def test_every_adapter_gives_the_subsets_kernel_in_its_own_names(subset):
    variables = Linen().init(jax.random.PRNGKey(2), X)
    p = variables["params"]
    net = hk.without_apply_rng(hk.transform(_haiku))
    hp = ntk_haiku.params_from_flax(p, net.init(jax.random.PRNGKey(3), X))
    if subset == "head":
        flax_wrt, nnx_wrt, haiku_wrt, eqx_wrt = "Dense_1", "head", "mlp/~/linear_1", "layers/1"
        chosen = ["Dense_1/bias", "Dense_1/kernel"]
    else:
        flax_wrt = haiku_wrt = lambda path: path[-1] in ("bias", "b")  # noqa: E731
        nnx_wrt = lambda path: "bias" in path  # noqa: E731 (nnx paths end in "value")
        eqx_wrt = lambda path: path[-1] == "bias"  # noqa: E731
        chosen = ["Dense_0/bias", "Dense_1/bias"]

    def of_subset(sub, x):
        full = {k: dict(v) for k, v in p.items()}
        for name, leaf in zip(chosen, sub, strict=True):
            module, entry = name.split("/")
            full[module][entry] = leaf
        return _plain(full, x)

    sub = [p[n.split("/")[0]][n.split("/")[1]] for n in chosen]
    (expected,) = reference.ntk(of_subset, sub, X, None, trace_axes=())
    kernels = {
        "linen": ntk_flax.kernel(Linen(), variables, X, trace_axes=(), wrt=flax_wrt),
        "nnx": ntk_flax.kernel(Nnx(p), None, X, trace_axes=(), wrt=nnx_wrt),
        "haiku": ntk_haiku.kernel(net, hp, X, trace_axes=(), wrt=haiku_wrt),
        "equinox": ntk_equinox.kernel(_equinox(p), X, trace_axes=(), wrt=eqx_wrt),
    }
    whole = np.asarray(ntk_flax.kernel(Linen(), variables, X, trace_axes=()), np.float64)
    assert np.abs(whole - expected).max() > 1e-2 * np.abs(whole).max()  # a real subset
    for k in kernels.values():
        reference.assert_close(k, expected)


def test_every_adapter_gives_the_pseudo_ntk():
    variables = Linen().init(jax.random.PRNGKey(2), X)
    p = variables["params"]
    net = hk.without_apply_rng(hk.transform(_haiku))
    hp = ntk_haiku.params_from_flax(p, net.init(jax.random.PRNGKey(3), X))
    (full,) = reference.ntk(_plain, p, X, None, trace_axes=())  # (N, N, O, O)
    expected = full.sum(axis=(2, 3)) / full.shape[2]
    kernels = [
        ntk_flax.pntk(Linen(), variables, X),
        ntk_flax.pntk_fn(Nnx(p))(None, X),
        ntk_haiku.pntk(net, hp, X),
        ntk_haiku.pntk_fn(net)(hp, X),
        ntk_equinox.pntk(_equinox(p), X),
        ntk_equinox.pntk_fn(_equinox(p))(_equinox(p), X),
    ]
    for k in kernels:
        reference.assert_close(k, expected)
    with pytest.raises(TypeError, match="ntk_haiku.pntk: the pseudo-NTK takes no trace_axes"):
        ntk_haiku.pntk(net, hp, X, trace_axes=())


def _models(p, variables):
    """``(name, statistic(name, x, *args, **kwargs))`` per adapter, wrt= in its own names."""
    net = hk.without_apply_rng(hk.transform(_haiku))
    hp = ntk_haiku.params_from_flax(p, net.init(jax.random.PRNGKey(3), X))
    head = dict(linen="Dense_1", nnx="head", haiku="mlp/~/linear_1", equinox="layers/1")
    calls = dict(
        linen=lambda f, x, *a, **k: getattr(ntk_flax, f)(Linen(), variables, x, *a, **k),
        nnx=lambda f, x, *a, **k: getattr(ntk_flax, f)(Nnx(p), None, x, *a, **k),
        haiku=lambda f, x, *a, **k: getattr(ntk_haiku, f)(net, hp, x, *a, **k),
        equinox=lambda f, x, *a, **k: getattr(ntk_equinox, f)(_equinox(p), x, *a, **k),
    )
    return [(name, call, head[name]) for name, call in calls.items()]


def _exact(flat: np.ndarray, v: np.ndarray) -> dict:
    lam = np.abs(np.linalg.eigvalsh(flat))
    q = lam[lam > 0] / lam.sum()
    return dict(
        ntk_trace=np.trace(flat),
        ntk_frobenius_sq=np.sum(flat**2),
        ntk_effective_rank=np.exp(-np.sum(q * np.log(q))),
        ntk_kernel_alignment=v @ flat @ v / (np.linalg.norm(flat) * (v @ v)),
    )


@pytest.mark.parametrize("subset", ["all", "head"])
def test_every_adapter_gives_the_exact_statistics_with_m_covering_the_kernel(subset):
    variables = Linen().init(jax.random.PRNGKey(2), X)
    p = variables["params"]
    y = jax.random.normal(jax.random.PRNGKey(4), (X.shape[0], 3))
    if subset == "all":
        (full,) = reference.ntk(_plain, p, X, None, trace_axes=())  # (N, N, O, O) float64
    else:

        def of_head(head, x):
            return _plain({**p, "Dense_1": head}, x)

        (full,) = reference.ntk(of_head, p["Dense_1"], X, None, trace_axes=())
    m = full.shape[0] * full.shape[2]
    flat = full.transpose(0, 2, 1, 3).reshape(m, m)
    expected = _exact(flat, np.asarray(y, np.float64).reshape(-1))
    key = jax.random.PRNGKey(5)
    for name, call, head in _models(p, variables):
        wrt = dict(wrt=head) if subset == "head" else {}
        got = dict(
            ntk_trace=call("ntk_trace", X, **wrt),
            ntk_frobenius_sq=call("ntk_frobenius_sq", X, key=key, m=m, **wrt),
            ntk_effective_rank=call("ntk_effective_rank", X, key=key, m=m, **wrt),
            ntk_kernel_alignment=call("ntk_kernel_alignment", X, y, key=key, m=m + 1, **wrt),
        )
        for statistic, value in got.items():
            value = value if isinstance(value, float) else value.estimate
            assert value == pytest.approx(expected[statistic], rel=2e-5), (name, statistic)
        assert got["ntk_frobenius_sq"].standard_error == 0.0


def test_every_adapter_estimates_within_standard_errors():
    """At m < M: the same key gives each adapter the core's estimate on the plain model (the
    same random probes), within 6 standard errors of the float64 truth."""
    x = jax.random.normal(jax.random.PRNGKey(6), (24, 4))  # M = 72 > m = 30
    variables = Linen().init(jax.random.PRNGKey(2), x)
    p = variables["params"]
    (full,) = reference.ntk(_plain, p, x, None, trace_axes=())
    flat = full.transpose(0, 2, 1, 3).reshape(72, 72)
    truth, key = float(np.sum(flat**2)), jax.random.PRNGKey(7)
    core = ntk_core.spectrum.ntk_frobenius_sq(_plain, p, x, key=key, m=30)
    assert 0 < core.standard_error and abs(core.estimate - truth) <= 6 * core.standard_error
    for name, call, _ in _models(p, variables):
        r = call("ntk_frobenius_sq", x, key=key, m=30)
        assert r.products == 30, name
        assert r.estimate == pytest.approx(core.estimate, rel=1e-4), name
        assert r.standard_error == pytest.approx(core.standard_error, rel=1e-3), name


def test_adapters_refuse_kernel_options_the_statistics_do_not_take():
    variables = Linen().init(jax.random.PRNGKey(2), X)
    with pytest.raises(TypeError, match=r"ntk_flax.ntk_trace: trace_axes=\(\) is a kernel option"):
        ntk_flax.ntk_trace(Linen(), variables, X, trace_axes=())
    key = jax.random.PRNGKey(0)
    with pytest.raises(TypeError, match="ntk_equinox.ntk_frobenius_sq: implementation='jacobian'"):
        ntk_equinox.ntk_frobenius_sq(
            _equinox(variables["params"]), X, key=key, implementation="jacobian"
        )
    with pytest.raises(ValueError, match="ntk_haiku.ntk_trace: wrt names 'mlp/~/linear_7'"):
        net = hk.without_apply_rng(hk.transform(_haiku))
        ntk_haiku.ntk_trace(net, net.init(key, X), X, wrt="mlp/~/linear_7")


def test_adapter_monte_carlo_kernels_of_a_subset():
    """Flax and Haiku Monte Carlo NTKs with wrt=: the mean of the subset kernels of the
    same initialisations (``model.init(k_s, x1[:1])``, ``transformed.init(k_s, x1[:1])``)."""
    key, n = jax.random.PRNGKey(8), 2
    keys = jax.random.split(key, n)
    net = hk.without_apply_rng(hk.transform(_haiku))
    cases = [
        (ntk_flax, Linen(), "Dense_1", lambda k: Linen().init(k, X[:1])),
        (ntk_haiku, net, "mlp/~/linear_1", lambda k: net.init(k, X[:1])),
    ]
    for adapter, model, head, init in cases:
        mc = adapter.monte_carlo_kernels(model, X, key=key, n_samples=n, wrt=head, progress=False)
        each = [np.asarray(adapter.kernel(model, init(k), X, wrt=head), np.float64) for k in keys]
        expected = np.mean(each, axis=0)
        np.testing.assert_allclose(mc.ntk, expected, rtol=0, atol=1e-6 * np.abs(expected).max())
        whole = adapter.monte_carlo_kernels(model, X, key=key, n_samples=n, progress=False)
        assert np.abs(np.asarray(whole.ntk) - expected).max() > 1e-2 * np.abs(expected).max()
        nngp = np.asarray(whole.nngp, np.float64)  # the whole model's, as without wrt
        np.testing.assert_allclose(mc.nngp, nngp, rtol=0, atol=1e-6 * np.abs(nngp).max())


def _plain_nnx(q, x):
    """``_plain`` with the nnx module's names (its state's leaves: head, then hidden)."""
    return _plain({"Dense_0": q["hidden"], "Dense_1": q["head"]}, x)


def _plain_equinox(q, x):
    """``eqx.nn.MLP`` written out on ``eqx.partition``'s params: per sample, ``W @ x + b``."""

    def one(xi):
        h = jnp.tanh(q.layers[0].weight @ xi + q.layers[0].bias)
        return q.layers[1].weight @ h + q.layers[1].bias

    return jax.vmap(one)(x)


def _sketches(p, variables):
    """Per adapter: ``(name, ntk_sketch(x1, x2, **kw), ntk_sketch_fn(**kw) -> features(x), the
    hand-written apply_fn and its params, the head in the adapter's and the core's names)``."""
    net = hk.without_apply_rng(hk.transform(_haiku))
    hp = ntk_haiku.params_from_flax(p, net.init(jax.random.PRNGKey(3), X))
    mlp, module = _equinox(p), Nnx(p)  # one object each: the kernel functions are cached
    q_eqx = eqx.partition(mlp, eqx.is_inexact_array)[0]
    q_nnx = {"hidden": p["Dense_0"], "head": p["Dense_1"]}
    return [
        ("linen", lambda *x, **k: ntk_flax.ntk_sketch(Linen(), variables, *x, **k),
         lambda **k: lambda x: ntk_flax.ntk_sketch_fn(Linen(), **k)(variables, x),
         _plain, p, "Dense_1", "Dense_1"),
        ("nnx", lambda *x, **k: ntk_flax.ntk_sketch(module, None, *x, **k),
         lambda **k: lambda x: ntk_flax.ntk_sketch_fn(module, **k)(None, x),
         _plain_nnx, q_nnx, "head", "head"),
        ("haiku", lambda *x, **k: ntk_haiku.ntk_sketch(net, hp, *x, **k),
         lambda **k: lambda x: ntk_haiku.ntk_sketch_fn(net, **k)(hp, x),
         _plain, p, "mlp/~/linear_1", "Dense_1"),
        ("equinox", lambda *x, **k: ntk_equinox.ntk_sketch(mlp, *x, **k),
         lambda **k: lambda x: ntk_equinox.ntk_sketch_fn(mlp, **k)(mlp, x),
         _plain_equinox, q_eqx, "layers/1", "layers/1"),
    ]  # fmt: skip


@pytest.mark.parametrize("subset", ["all", "head"])
@pytest.mark.parametrize("name", ["linen", "nnx", "haiku", "equinox"])
def test_every_adapter_gives_the_cores_sketch_with_the_same_key(name, subset):
    """``ntk_sketch_fn`` of each adapter (``wrt=`` in its own names) equals the core's
    features of the hand-written apply_fn with the same key, bit for bit; the Haiku MLP
    with the Flax one's weights transplanted gives the Flax adapter's sketch."""
    variables = Linen().init(jax.random.PRNGKey(2), X)
    key, cases = jax.random.PRNGKey(9), {c[0]: c for c in _sketches(variables["params"], variables)}
    _, _, build, apply_fn, params, head, core_head = cases[name]
    wrt, core_wrt = (dict(wrt=head), dict(wrt=core_head)) if subset == "head" else ({}, {})
    expected = ntk_core.ntk_sketch_fn(apply_fn, k=64, key=key, **core_wrt)(params, X)
    got = np.asarray(build(k=64, key=key, **wrt)(X))
    np.testing.assert_array_equal(got, expected)
    if name == "haiku":
        flax_wrt = dict(wrt=cases["linen"][5]) if subset == "head" else {}
        np.testing.assert_array_equal(got, cases["linen"][2](k=64, key=key, **flax_wrt)(X))
    if subset == "head":  # a real subset: not the whole model's features
        whole = ntk_core.ntk_sketch_fn(apply_fn, k=64, key=key)(params, X)
        assert np.abs(got - np.asarray(whole)).max() > 1e-3


@pytest.mark.parametrize("name, subset", [("linen", "all"), ("nnx", "head"),
                                          ("haiku", "head"), ("equinox", "all")])  # fmt: skip
def test_adapter_sketch_mean_over_seeds_is_the_exact_kernel(name, subset):
    """Unbiased: at k = 16 (collisions in every layer), the mean of S = 32 seeds' Θ̂ is
    within 2x one estimate's RMS relative Frobenius error over √S of the float64 kernel
    (measured on linen: 0.087 against a bound of 0.20), the mean over entries of its
    z² below 3 and no |z| above 6 (as tests/core/test_sketch.py)."""
    variables = Linen().init(jax.random.PRNGKey(2), X)
    p = variables["params"]
    found = {c[0]: c for c in _sketches(p, variables)}[name]
    one_call, head = found[1], found[5]
    if subset == "all":
        (exact,) = reference.ntk(_plain, p, X, None)
        wrt = {}
    else:
        of_head = lambda h, x: _plain({**p, "Dense_1": h}, x)  # noqa: E731
        (exact,) = reference.ntk(of_head, p["Dense_1"], X, None)
        wrt = dict(wrt=head)
    s = 32
    est = np.array([
        np.asarray(one_call(X, k=16, key=jax.random.PRNGKey(seed), **wrt).kernel, np.float64)
        for seed in range(s)
    ])  # fmt: skip
    norm = np.linalg.norm(exact)
    single = np.sqrt(np.mean([(np.linalg.norm(e - exact) / norm) ** 2 for e in est]))
    assert single > 0.1  # a real sketch: the estimates differ from Θ
    assert np.linalg.norm(est.mean(axis=0) - exact) / norm < 2 * single / np.sqrt(s)
    z = (est.mean(axis=0) - exact) / (est.std(axis=0, ddof=1) / np.sqrt(s))
    assert (z**2).mean() < 3.0 and np.abs(z).max() < 6.0, z


def test_adapter_sketch_layout_blocks_and_x2():
    """``trace_axes=()``, ``batch_size`` and x2 through an adapter's ``ntk_sketch``: the
    core's ``NTKSketch`` of the hand-written model, bit for bit (numpy, blocks of 2)."""
    variables = Linen().init(jax.random.PRNGKey(2), X)
    options = dict(k=32, key=jax.random.PRNGKey(10), trace_axes=(), batch_size=2)
    s = ntk_flax.ntk_sketch(Linen(), variables, X, X[:3], **options)
    core = ntk_core.empirical_ntk_sketch(_plain, variables["params"], X, X[:3], **options)
    assert isinstance(s.features1, np.ndarray) and s.features1.shape == (5, 3, 32)
    assert s.kernel.shape == (5, 3, 3, 3)
    for got, expected in zip(s, core, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_adapter_sketch_features_of_new_weights_and_other_models():
    """A features function reused for new weights gives the core's features of them; an
    equinox model of another structure is refused."""
    key = jax.random.PRNGKey(10)
    features = ntk_haiku.ntk_sketch_fn(hk.without_apply_rng(hk.transform(_haiku)), k=32, key=key)
    other = Linen().init(jax.random.PRNGKey(11), X)["params"]
    net_params = ntk_haiku.params_from_flax(other, hk.transform(_haiku).init(key, X))
    np.testing.assert_array_equal(
        features(net_params, X), ntk_core.ntk_sketch_fn(_plain, k=32, key=key)(other, X)
    )
    eqx_features = ntk_equinox.ntk_sketch_fn(_equinox(other), k=32, key=key)
    wider = eqx.nn.MLP(4, 3, 16, 1, key=jax.random.PRNGKey(1))
    with pytest.raises(ValueError, match=r"^ntk_equinox.ntk_sketch_fn\(...\)\(model, x1, x2\): "):
        eqx_features(wider, X)
