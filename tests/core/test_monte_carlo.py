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


def test_progress_bar_when_asked(capsys):
    ntk_core.monte_carlo_kernels(
        init_fn, apply_fn, X1, key=jax.random.PRNGKey(0), n_samples=2, progress=True
    )
    assert "2/2" in capsys.readouterr().err


ERRORS = [
    (
        dict(n_samples=0),
        ValueError,
        r"^monte_carlo_kernels: n_samples must be a positive int, got 0",
    ),
    (dict(key=0), TypeError, r"^monte_carlo_kernels: key must be one PRNG key.*Fix"),
    (dict(progress="yes"), TypeError, r"^monte_carlo_kernels: progress must be None"),
    (dict(init_fn=3), TypeError, r"^monte_carlo_kernels: init_fn must be callable"),
]


@pytest.mark.parametrize("kwargs, error, pattern", ERRORS)
def test_errors(kwargs, error, pattern):
    args = dict(init_fn=init_fn, key=jax.random.PRNGKey(0), n_samples=2)
    args.update(kwargs)
    f = args.pop("init_fn")
    with pytest.raises(error, match=pattern):
        ntk_core.monte_carlo_kernels(f, apply_fn, X1, **args)
