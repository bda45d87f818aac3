"""ntk_core.ntk_sketch_fn / empirical_ntk_sketch (the sketched eNTK of issue 27) against
the float64 Jacobian contraction of tests/reference.py: unbiased over seeds, error falling
like 1/sqrt(k), the exact variance formula of the docstring, reproducibility, blocks, and
the features feeding predict.low_rank_inference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import core_zoo
import ntk_core
import reference
from ntk_core._functional import sketch as _sketch
from ntk_core._kernel.model import from_apply_fn, one_sample

KEYS = jax.random.split(jax.random.PRNGKey(0), 8)
PARAMS = {
    "w": jax.random.normal(KEYS[0], (4, 6)) / 2,
    "b": jax.random.normal(KEYS[1], (6,)) / 5,
    "s": jax.random.normal(KEYS[2], (6,)),
    "v": jax.random.normal(KEYS[3], (6, 3)) / 2,
    "c": jax.random.normal(KEYS[4], (3,)) / 5,
}
X = jax.random.normal(KEYS[5], (4, 4))


def fallback_mlp(p, x):
    """Dense 4-6 (bias fused), tanh, a scale sin(s) no rule covers (fallback), Dense 6-3."""
    h = jnp.tanh(x @ p["w"] + p["b"])
    return (h * jnp.sin(p["s"])) @ p["v"] + p["c"]


def _zoo(name: str, n: int = 5):
    entry = core_zoo.ZOO[name]
    return core_zoo.apply_fn(entry), entry.params, core_zoo.inputs(entry, n, 3)


def _estimates(f, params, x, k: int, seeds, trace_axes=(-1,)) -> np.ndarray:
    """Θ̂(x, x) per seed, float64 ``(S, ...)``, one compiled function for all seeds."""
    out = []
    for seed in seeds:
        key = jax.random.PRNGKey(seed)
        kernel = ntk_core.empirical_ntk_sketch(f, params, x, k=k, key=key, trace_axes=trace_axes)
        out.append(np.asarray(kernel.kernel, np.float64))
    return np.array(out)


CASES = [  # (model, trace_axes): dense, convolution, embedding + attention, fallback leaf
    ("mlp", (-1,)),
    ("mlp", ()),
    ("cnn10", (-1,)),
    ("tokens", (-1,)),
    ("fallback_mlp", ()),
]


def _case(name: str):
    if name == "fallback_mlp":
        return fallback_mlp, PARAMS, X
    f, params, (x1, _) = _zoo(name)
    return f, params, x1


@pytest.mark.parametrize("name, trace_axes", CASES)
def test_mean_over_seeds_is_the_exact_kernel(name, trace_axes):
    """Unbiased: with S = 24 seeds at k = 1024, the mean's relative Frobenius error is
    within 2x the single estimates' RMS error over √S (no floor), the mean over entries
    of ((mean − Θ) / se)² (≈ 1 when unbiased; Student's t with 23 degrees of freedom,
    entries correlated) stays below 3, and no entry is 6 standard errors off. (Measured
    on tokens: S = 64 at k = 4096 gives 0.0037 against 0.0036 expected, z² 1.04.)"""
    f, params, x = _case(name)
    exact = reference.ntk(f, params, x, None, trace_axes=trace_axes)[0]
    s = 24
    est = _estimates(f, params, x, 1024, range(s), trace_axes)
    norm = np.linalg.norm(exact)
    single = np.sqrt(np.mean([(np.linalg.norm(e - exact) / norm) ** 2 for e in est]))
    assert np.linalg.norm(est.mean(axis=0) - exact) / norm < 2 * single / np.sqrt(s)
    se = est.std(axis=0, ddof=1) / np.sqrt(s)
    z = (est.mean(axis=0) - exact) / np.maximum(se, 1e-6 * np.abs(exact).max())
    assert (z**2).mean() < 3.0, (z**2).mean()
    assert np.abs(z).max() < 6.0, np.abs(z).max()


def test_error_falls_like_one_over_sqrt_k():
    """Relative Frobenius error, mean over 4 seeds: k = 256 vs 4096 (16x) falls ~4x."""
    f, params, (x, _) = _zoo("cnn10", 6)
    exact = reference.ntk(f, params, x, None)[0]

    def error(k):
        est = _estimates(f, params, x, k, range(4))
        return np.mean([np.linalg.norm(e - exact) / np.linalg.norm(exact) for e in est])

    small, large = error(256), error(4096)
    assert 2.5 < small / large < 6.5, (small, large)
    assert large < 0.03


def _tensor_sketch_variance(m, n, k: int) -> float:
    """Exact Var ⟨TS(M), TS(N)⟩ of one TensorSketch of R x M matrices (fully random h, s):
    the index quadruples whose signs pair up, by pattern of rows (A: p, q share a row, as
    p', q'; B: p, p' share one, q, q' another; C: p, q' and q, p'; E: one row) and of
    columns, times the probability that both pairs collide (1/k, or 2/k² or 1/k² for k
    even or odd when rows are B and columns C or the reverse), less the mean's square."""
    rows = {"A": "iijj", "B": "ijij", "C": "ijji", "E": "iiii"}
    cols = {"A": "uuvv", "B": "uvuv", "C": "uvvu", "E": "uuuu"}

    def total(r, c):
        spec = ",".join(rows[r][t] + cols[c][t] for t in range(4)) + "->"
        return np.einsum(spec, m, n, m, n)

    def exact(r, c):  # the sum over quadruples with exactly these patterns
        e = total("E", "E")
        if r == "E" or c == "E":
            return total(r, c) - e
        return total(r, c) - total(r, "E") - total("E", c) + e

    first = ("AB", "AC", "EB", "EC", "BA", "CA", "BE", "CE", "BB", "CC")
    second = (1 if k % 2 else 2) / k**2
    return sum(exact(*p) for p in first) / k + second * (exact("B", "C") + exact("C", "B"))


def test_variance_is_the_docstring_formula():
    """Var Θ̂_ij = (Θ_ii Θ_jj + Θ_ij²)/k + Σ_ℓ D_ℓ (docstring): the exact formula against
    the variance over 300 seeds at k = 16 and k = 17 (both parities), every entry within
    25 % and the sum within 8 %; the Gaussian formula alone is off by up to 50 % here."""
    o = 3
    jac = jax.vmap(lambda xi: jax.jacrev(lambda q: fallback_mlp(q, xi[None])[0])(PARAMS))(X)
    jac = jax.tree.map(lambda a: np.asarray(a, np.float64) / np.sqrt(o), jac)

    def matrices(i):  # per leaf as sketched: dense (C + bias, O·K); fallback (O, P)
        w = np.concatenate(
            [jac["w"][i].transpose(1, 0, 2).reshape(4, -1), jac["b"][i].reshape(1, -1)]
        )
        v = np.concatenate(
            [jac["v"][i].transpose(1, 0, 2).reshape(6, -1), jac["c"][i].reshape(1, -1)]
        )
        return [w, v, jac["s"][i]]

    mats = [matrices(i) for i in range(X.shape[0])]
    theta = reference.ntk(fallback_mlp, PARAMS, X, None)[0]
    diag = np.diag(theta)
    for k in (16, 17):
        gauss = (diag[:, None] * diag[None, :] + theta**2) / k
        predicted = gauss.copy()
        for i, j in np.ndindex(theta.shape):
            for a, b in zip(mats[i], mats[j], strict=True):
                plain = ((a**2).sum() * (b**2).sum() + (a * b).sum() ** 2) / k
                predicted[i, j] += _tensor_sketch_variance(a, b, k) - plain
        measured = _estimates(fallback_mlp, PARAMS, X, k, range(1000, 1300)).var(axis=0, ddof=1)
        assert np.abs(measured / predicted - 1).max() < 0.25, measured / predicted
        assert abs(measured.sum() / predicted.sum() - 1) < 0.08
        assert np.abs(predicted / gauss - 1).max() > 0.3  # the corrections matter here


def test_same_key_same_features_and_separate_calls_combine():
    f, params, (x1, x2) = _zoo("tokens")
    key = jax.random.PRNGKey(3)
    features = ntk_core.ntk_sketch_fn(f, k=128, key=key)
    phi1, phi2 = features(params, x1), features(params, x2)
    assert phi1.shape == (5, 5, 128)  # tokens: outputs (N, 5 positions, 3), last traced
    again = ntk_core.ntk_sketch_fn(f, k=128, key=key)
    np.testing.assert_array_equal(phi1, again(params=params, x=x1))  # by name too
    as_int = ntk_core.ntk_sketch_fn(f, k=128, key=key, trace_axes=-1)  # an int as ntk_fn's
    np.testing.assert_array_equal(phi1, as_int(params, x1))
    other = ntk_core.ntk_sketch_fn(f, k=128, key=jax.random.PRNGKey(4))(params, x1)
    assert np.abs(np.asarray(other) - np.asarray(phi1)).max() > 1e-3 * np.abs(phi1).max()
    one_call = ntk_core.empirical_ntk_sketch(f, params, x1, x2, k=128, key=key)
    np.testing.assert_array_equal(one_call.features1, phi1)
    np.testing.assert_array_equal(one_call.features2, phi2)
    expected = np.einsum("iaz,jbz->ijab", phi1, phi2)  # Θ̂[i, j, a, b] in ntk_fn's layout
    np.testing.assert_allclose(one_call.kernel, expected, rtol=1e-5, atol=1e-6)


def test_batches_give_the_same_features():
    f, params, (x, _) = _zoo("cnn10", 7)
    key = jax.random.PRNGKey(5)
    whole = np.asarray(ntk_core.ntk_sketch_fn(f, k=64, key=key, trace_axes=())(params, x))
    blocked = ntk_core.ntk_sketch_fn(f, k=64, key=key, trace_axes=(), batch_size=3)(params, x)
    assert isinstance(blocked, np.ndarray) and blocked.shape == (7, 10, 64)
    np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-6 * np.abs(whole).max())
    for size in (7, 50, "auto"):  # one block: host numpy too, as documented
        one = ntk_core.ntk_sketch_fn(f, k=64, key=key, trace_axes=(), batch_size=size)
        one = one(params, x)
        assert isinstance(one, np.ndarray), (size, type(one))
        np.testing.assert_array_equal(one, whole)


@pytest.mark.parametrize("name", ["cnn10", "tokens", "fallback_mlp"])
def test_fourier_and_explicit_forms_are_the_same_map(name):
    """Each structured leaf sketched through FFTs of its inputs and cotangents equals the
    TensorSketch of its explicit per-sample Jacobian, to rounding."""
    f, params, x = _case(name)
    apply3 = from_apply_fn(f)
    analysis, closed = _sketch._structured.analysis_for(
        apply3, params, one_sample(x), None, precision="highest"
    )
    n_groups = len(analysis.groups)
    gram = tuple(
        _sketch.TENSOR if analysis.uses[g[0]].rule.has_gram_form else _sketch.EXPLICIT
        for g in analysis.groups
    )
    key, trace = jax.random.PRNGKey(6), (len(closed.out_avals[0].shape) - 1,)
    forms = []
    for modes in (gram, (_sketch.EXPLICIT,) * n_groups):
        plan = _sketch.Plan(512, trace, modes, x.shape[0])
        forms.append(np.asarray(_sketch._block_fn(apply3, plan, "highest")(params, None, x, key)))
    assert _sketch.TENSOR in gram
    np.testing.assert_allclose(forms[0], forms[1], atol=1e-5 * np.abs(forms[1]).max())


def test_features_feed_low_rank_inference():
    """Kernel regression on sketch features (k = 1024, N = 40) against the exact
    kernel's: within 5 % of max |mean| (measured 0.9 %; 0.4 % at k = 2048)."""
    f, params, (x, x_test) = _zoo("mlp", 40)
    y = jnp.sin(x[:, 0])
    key = jax.random.PRNGKey(7)
    features = ntk_core.ntk_sketch_fn(f, k=1024, key=key)
    posterior = ntk_core.predict.low_rank_inference(features(params, x), y, diag_reg=1e-2)
    mean = posterior.posterior(features(params, x_test)).mean
    k_train = reference.ntk(f, params, x, None)[0]
    k_test = reference.ntk(f, params, x_test, x)[0]
    lam = 1e-2 * np.trace(k_train) / x.shape[0]
    exact = k_test @ np.linalg.solve(k_train + lam * np.eye(x.shape[0]), np.asarray(y))
    assert np.abs(np.asarray(mean) - exact).max() < 0.05 * np.abs(exact).max()


def test_parameter_subset():
    """wrt=: the sketch of the subset's kernel (Dense 6-3 and its bias), unbiased against
    the float64 kernel of the subset; a name no parameter has is refused."""
    held = {name: PARAMS[name] for name in ("w", "b", "s")}

    def head(p, x):
        return fallback_mlp(p | held, x)

    subset = {name: PARAMS[name] for name in ("v", "c")}
    exact = reference.ntk(head, subset, X, None)[0]
    est = []
    for seed in range(24):
        key = jax.random.PRNGKey(seed)
        s = ntk_core.empirical_ntk_sketch(fallback_mlp, PARAMS, X, k=256, key=key, wrt=["v", "c"])
        est.append(np.asarray(s.kernel, np.float64))
    est = np.array(est)
    norm = np.linalg.norm(exact)
    single = np.sqrt(np.mean([(np.linalg.norm(e - exact) / norm) ** 2 for e in est]))
    assert np.linalg.norm(est.mean(axis=0) - exact) / norm < 2 * single / np.sqrt(24)
    with pytest.raises(ValueError, match="^ntk_sketch_fn: wrt names 'u', which no parameter"):
        ntk_core.ntk_sketch_fn(fallback_mlp, k=8, key=KEYS[0], wrt="u")(PARAMS, X)


def test_non_finite_features_are_refused_at_their_first_sample(tmp_path):
    """Φ of a model whose gradient is NaN from sample 3 on (sqrt of a negative) raises
    NonFiniteError naming sample 3, in one call, in blocks and written to a file; the
    finite samples alone give finite features."""
    w, x = jnp.ones((3, 2)), jnp.arange(1.0, 7.0)[:, None] * jnp.ones((6, 3))
    model = lambda w, x: jnp.sqrt(10.0 - x @ w)  # noqa: E731  x @ w = 3, 6, 9, 12, ...
    key = jax.random.PRNGKey(0)
    for options in ({}, {"batch_size": 2}, {"batch_size": 2, "out": str(tmp_path / "p.npy")}):
        sketch = ntk_core.ntk_sketch_fn(model, k=8, key=key, **options)
        with pytest.raises(ntk_core.NonFiniteError, match="Φ came out NaN or Inf at x sample 3"):
            sketch(w, x)
        if "out" not in options:
            assert np.isfinite(sketch(w, x[:3])).all()


def test_a_new_key_reuses_the_plan(monkeypatch):
    """Sketches averaged over seeds (one call per key) probe and plan the model once per
    input signature: the plan does not depend on the key. The estimates still differ."""
    probes, probe = [], _sketch._probe.samples_interact
    monkeypatch.setattr(
        _sketch._probe, "samples_interact", lambda *a, **k: probes.append(1) or probe(*a, **k)
    )

    def model(p, x):  # a model of its own: no plan cached by another test
        return fallback_mlp(p, x)

    a, b = _estimates(model, PARAMS, X, 16, range(2))
    assert len(probes) == 1 and np.abs(a - b).max() > 0
    _estimates(model, PARAMS, X[:3], 16, range(2))  # a new signature: planned again
    assert len(probes) == 2


def test_a_non_finite_x2_is_named_x2():
    """The one-call estimate names the argument that holds the NaN (it said "x")."""
    bad = X.at[3, 0].set(jnp.nan)
    match = r"^empirical_ntk_sketch: x2 contains NaN values, first in sample 3"
    with pytest.raises(ValueError, match=match):
        ntk_core.empirical_ntk_sketch(fallback_mlp, PARAMS, X, bad, k=16, key=jax.random.PRNGKey(0))
