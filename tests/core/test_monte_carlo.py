"""Monte Carlo kernels equal the mean of separate empirical kernels with the same keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core


def init_fn(key):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (3, 8)), "v": jax.random.normal(k2, (8, 2)) / jnp.sqrt(8.0)}


def apply_fn(params, x):
    return jnp.tanh(x @ params["w"]) @ params["v"]


X1 = jax.random.normal(jax.random.PRNGKey(1), (5, 3))
X2 = jax.random.normal(jax.random.PRNGKey(2), (4, 3))


@pytest.mark.parametrize(
    "x2, axes, batch",
    [(None, dict(), 1), (X2, dict(trace_axes=()), 2)],
    ids=["x2_none_traced_sequential", "x2_full_batches_of_2_ragged"],
)
def test_average_equals_mean_of_separate_empirical_kernels(x2, axes, batch):
    key, n = jax.random.PRNGKey(3), 3
    k = ntk_core.monte_carlo_kernels(
        init_fn,
        apply_fn,
        X1,
        x2,
        key=key,
        n_samples=n,
        batch_size_samples=batch,
        progress=False,
        **axes,
    )
    keys = jax.random.split(key, n)
    ntks = [
        np.asarray(ntk_core.empirical_ntk(apply_fn, init_fn(kk), X1, x2, **axes), np.float64)
        for kk in keys
    ]
    nngps = [
        np.asarray(ntk_core.empirical_nngp(apply_fn, init_fn(kk), X1, x2, **axes), np.float64)
        for kk in keys
    ]
    for got, separate in ((k.ntk, ntks), (k.nngp, nngps)):
        expected = np.mean(separate, axis=0)
        assert got.shape == expected.shape
        np.testing.assert_allclose(
            np.asarray(got), expected, rtol=0, atol=1e-6 * np.abs(expected).max()
        )
        # the samples differ: the average is not any single one of them
        assert np.abs(separate[0] - separate[1]).max() > 1e-3 * np.abs(expected).max()


@pytest.mark.parametrize(
    "wrt, batch",
    [("v", 1), (lambda path: path[0] == "w", 3)],
    ids=["name_sequential", "predicate_vmapped"],
)
def test_subset_ntk_is_the_mean_of_the_subset_kernels(wrt, batch):
    """wrt=: Θ_MC of the subset, the mean of the S exact subset kernels over the same
    initialisations; the NNGP is the whole model's (it takes no derivative)."""
    key, n = jax.random.PRNGKey(5), 3
    common = dict(key=key, n_samples=n, batch_size_samples=batch, progress=False, trace_axes=())
    k = ntk_core.monte_carlo_kernels(init_fn, apply_fn, X1, X2, wrt=wrt, **common)
    whole = ntk_core.monte_carlo_kernels(init_fn, apply_fn, X1, X2, **common)
    keys = jax.random.split(key, n)
    subsets = [
        ntk_core.empirical_ntk(apply_fn, init_fn(kk), X1, X2, trace_axes=(), wrt=wrt) for kk in keys
    ]
    expected = np.mean(np.asarray(subsets, np.float64), axis=0)
    np.testing.assert_allclose(k.ntk, expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    assert np.abs(np.asarray(whole.ntk) - expected).max() > 1e-2 * np.abs(expected).max()
    # the NNGP is the whole model's (the same up to the fusion of the vmapped program)
    nngp = np.asarray(whole.nngp, np.float64)
    np.testing.assert_allclose(k.nngp, nngp, rtol=0, atol=1e-6 * np.abs(nngp).max())


def test_blocked_engine_samples_are_summed_on_the_host():
    """With batch_size each sample's kernel is a host array (the point of the blocked
    engine: kernels larger than the device); the mean stays on the host too."""
    key, n = jax.random.PRNGKey(4), 3
    common = dict(key=key, n_samples=n, progress=False, trace_axes=())
    blocked = ntk_core.monte_carlo_kernels(init_fn, apply_fn, X1, X2, batch_size=2, **common)
    whole = ntk_core.monte_carlo_kernels(init_fn, apply_fn, X1, X2, **common)
    for got, expected in ((blocked.ntk, whole.ntk), (blocked.nngp, whole.nngp)):
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        expected = np.asarray(expected, np.float64)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6 * np.abs(expected).max())


def test_dict_inputs_of_other_keys_are_not_taken_for_parameters():
    """Parameters passed as x1 are named as such, but two dict inputs whose keys differ
    (a typo in x2) get the structure message."""
    xd1 = {"a": X1, "b": X1[:, :2]}
    xd2 = {"a": X2, "c": X2[:, :2]}
    with pytest.raises(ValueError, match=r"x1 and x2 differ per sample"):
        ntk_core.monte_carlo_kernels(
            init_fn, lambda p, x: apply_fn(p, x["a"]), xd1, xd2, key=jax.random.PRNGKey(0),
            n_samples=2,
        )  # fmt: skip
    params = init_fn(jax.random.PRNGKey(0))
    with pytest.raises(TypeError, match=r"x1 is a dict of \['v', 'w'\], which looks like"):
        ntk_core.monte_carlo_kernels(
            init_fn, apply_fn, params, X1, key=jax.random.PRNGKey(0), n_samples=2
        )


def test_progress_bar_when_asked(capsys):
    ntk_core.monte_carlo_kernels(
        init_fn, apply_fn, X1, key=jax.random.PRNGKey(0), n_samples=2, progress=True
    )
    assert "2/2" in capsys.readouterr().err


def test_half_precision_kernels_are_averaged_in_float32():
    """A running bfloat16 sum of 128 kernels drops the late ones' low bits (8-bit
    mantissa); summed in float32 the mean is off only by one bfloat16 rounding.
    Reference: the float64 mean of the same bfloat16 kernels."""
    key, n = jax.random.PRNGKey(4), 128

    def init16(k):
        return jax.tree.map(lambda a: a.astype(jnp.bfloat16), init_fn(k))

    def apply16(params, x):
        return apply_fn(params, x.astype(jnp.bfloat16))

    with pytest.warns(ntk_core.PrecisionWarning, match="half precision"):
        got = ntk_core.monte_carlo_kernels(
            init16, apply16, X1, key=key, n_samples=n, progress=False
        )
    assert got.ntk.dtype == jnp.bfloat16  # the kernels' dtype is kept
    kernel = jax.jit(ntk_core.ntk_fn(apply16))
    separate = [np.asarray(kernel(init16(k), X1), np.float64) for k in jax.random.split(key, n)]
    expected = np.mean(separate, axis=0)
    error = np.abs(np.asarray(got.ntk, np.float64) - expected).max() / np.abs(expected).max()
    assert error < 8e-3, error  # one bfloat16 rounding of the mean: <= 2**-8 = 3.9e-3


def test_non_finite_inputs_refused_when_samples_are_vmapped():
    """With batch_size_samples > 1 the kernel functions run under vmap, where they cannot
    check their inputs: the Monte Carlo function checks them first."""
    x = X1.at[2, 1].set(jnp.nan)
    with pytest.raises(
        ValueError, match=r"^monte_carlo_kernels: x1 contains NaN values, first in sample 2"
    ):
        ntk_core.monte_carlo_kernels(
            init_fn, apply_fn, x, key=jax.random.PRNGKey(0), n_samples=4, batch_size_samples=2
        )


def test_non_finite_mean_refused():
    """A model that makes NaN for some initialisations (here log of a weight) gives a
    ValueError naming the first such initialisation (or its batch) instead of a silent
    NaN mean, vmapped or not."""

    def apply_log(params, x):
        return apply_fn(params, x) * jnp.log(params["v"][0, 0])

    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    first = next(s for s, k in enumerate(keys) if init_fn(k)["v"][0, 0] < 0)  # log(<0) = NaN
    for batch, where in (
        (1, f"in initialisation {first} "),
        (2, f"initialisations {first // 2 * 2}.."),
    ):
        with pytest.raises(
            ValueError,
            match=rf"^monte_carlo_kernels: .*{where}.*non-finite|^monte_carlo_kernels: .*non-finite.* {where}",
        ):
            ntk_core.monte_carlo_kernels(
                init_fn,
                apply_log,
                X1,
                key=jax.random.PRNGKey(0),
                n_samples=6,
                batch_size_samples=batch,
            )


ERRORS = [
    (
        dict(n_samples=0),
        ValueError,
        r"^monte_carlo_kernels: n_samples must be a positive int, got 0",
    ),
    (dict(key=0), TypeError, r"^monte_carlo_kernels: key must be one JAX PRNG key.*Fix"),
    (dict(progress="yes"), TypeError, r"^monte_carlo_kernels: progress must be None"),
    (dict(init_fn=3), TypeError, r"^monte_carlo_kernels: init_fn must be callable"),
    (
        dict(init_fn=lambda k: {"w": jnp.ones((3, 2)) * float(k[0])}),
        ValueError,
        r"^monte_carlo_kernels: init_fn\(key\) failed with ConcretizationTypeError: .*Fix: make "
        r"init_fn\(key\) a pure JAX function of the key .*it runs under jax.jit",
    ),
    (dict(n_samples=np.int64(0)), ValueError, r"^monte_carlo_kernels: n_samples must be"),
]


@pytest.mark.parametrize("kwargs, error, pattern", ERRORS)
def test_errors(kwargs, error, pattern):
    args = dict(init_fn=init_fn, key=jax.random.PRNGKey(0), n_samples=2)
    args.update(kwargs)
    f = args.pop("init_fn")
    with pytest.raises(error, match=pattern):
        ntk_core.monte_carlo_kernels(f, apply_fn, X1, **args)
