"""ntk_haiku.monte_carlo_kernels equals the mean of separate ntk_haiku kernels."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_haiku


def test_haiku_average_equals_separate_kernels():
    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([8, 2], activation=jnp.tanh)(x)))
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 3))
    key, n = jax.random.PRNGKey(2), 3
    k = ntk_haiku.monte_carlo_kernels(
        net, x, key=key, n_samples=n, batch_size_samples=2, progress=False
    )
    params = [net.init(kk, x[:1]) for kk in jax.random.split(key, n)]
    ntk = np.mean([np.asarray(ntk_haiku.kernel(net, p, x), np.float64) for p in params], axis=0)
    nngp = np.mean([np.asarray(ntk_haiku.nngp(net, p, x), np.float64) for p in params], axis=0)
    np.testing.assert_allclose(np.asarray(k.ntk), ntk, atol=1e-6 * np.abs(ntk).max())
    np.testing.assert_allclose(np.asarray(k.nngp), nngp, atol=1e-6 * np.abs(nngp).max())


def test_batchnorm_initialised_in_training_mode_evaluated_in_eval_mode():
    """hk.BatchNorm initialises only with is_training=True: init_kwargs gives init its own
    arguments, and init runs on all of x1 so that the moving averages hold x1's
    statistics (a positive variance); the result is the mean of the separate eval-mode
    kernels with each initialisation's state."""

    def forward(x, is_training):
        h = hk.BatchNorm(True, True, 0.9)(hk.Linear(6)(x), is_training=is_training)
        return hk.Linear(2)(jnp.tanh(h))

    net = hk.without_apply_rng(hk.transform_with_state(forward))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
    key, n, evaluate = jax.random.PRNGKey(2), 2, {"is_training": False}
    k = ntk_haiku.monte_carlo_kernels(
        net, x, key=key, n_samples=n, apply_kwargs=evaluate, init_kwargs={"is_training": True}
    )
    inits = [net.init(kk, x, is_training=True) for kk in jax.random.split(key, n)]
    for _, state in inits:
        assert float(state["batch_norm/~/var_ema"]["average"].min()) > 1e-3
    ntk = np.mean(
        [ntk_haiku.kernel(net, p, x, state=s, apply_kwargs=evaluate) for p, s in inits], axis=0
    )
    np.testing.assert_allclose(np.asarray(k.ntk), ntk, atol=1e-6 * np.abs(ntk).max())


def test_monte_carlo_kernels_to_files_equal_the_in_memory_average(tmp_path):
    """Issue 19: out= with a stateful Haiku model (each initialisation's BatchNorm
    state held fixed): both files equal the in-memory average bit for bit and the mean
    of separate kernels; resumed with other init_kwargs (another initialisation) it is
    refused naming the initialisation."""

    def transformed(scale):
        def forward(x, is_training):
            linear = hk.Linear(6, w_init=hk.initializers.TruncatedNormal(scale))
            h = hk.BatchNorm(True, True, 0.9)(linear(x), is_training=is_training)
            return hk.Linear(2)(jnp.tanh(h))

        return hk.without_apply_rng(hk.transform_with_state(forward))

    net = transformed(1.0)
    x = jax.random.normal(jax.random.PRNGKey(1), (9, 3))
    kw = dict(
        key=jax.random.PRNGKey(2),
        n_samples=3,
        apply_kwargs={"is_training": False},
        init_kwargs={"is_training": True},
        batch_size=4,
    )
    in_memory = ntk_haiku.monte_carlo_kernels(net, x, **kw)
    path = str(tmp_path / "mc.npy")
    got = ntk_haiku.monte_carlo_kernels(net, x, out=path, **kw)
    assert isinstance(got.nngp, np.memmap)
    assert got.ntk.tobytes() == np.asarray(in_memory.ntk).tobytes()
    assert got.nngp.tobytes() == np.asarray(in_memory.nngp).tobytes()
    inits = [net.init(k, x, is_training=True) for k in jax.random.split(kw["key"], 3)]
    evaluate = {"is_training": False}
    ntk = np.mean(
        [ntk_haiku.kernel(net, p, x, state=s, apply_kwargs=evaluate) for p, s in inits], axis=0
    )
    np.testing.assert_allclose(np.asarray(got.ntk), ntk, atol=1e-6 * np.abs(ntk).max())
    manifest = path[:-4] + ".ntk.npy.manifest.json"
    text = open(manifest).read().replace('"complete": true', '"complete": false')
    open(manifest, "w").write(text)
    with pytest.raises(
        ValueError,
        match=r"^ntk_haiku.monte_carlo_kernels: resume=True, but .* different call: "
        r"initialisation \(its jaxpr\); initialisation \(sample 0\) differ",
    ):
        ntk_haiku.monte_carlo_kernels(transformed(2.0), x, out=path, resume=True, **kw)
