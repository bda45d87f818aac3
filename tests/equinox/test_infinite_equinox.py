"""ntk_equinox.infinite_kernel_fn (issue 50): the priors of equinox's fixed uniform
initialiser against its own draws at a large width; the kernel of eqx.nn.MLP against
neural-tangents 0.6.5's recorded stax kernel (benchmarks/dump_nt_adapter_references.py)."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_equinox
from adapter_reference import assert_neural_tangents
from ntk_equinox._infinite import _priors


def test_priors_match_the_uniform_initialisers_draws():
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    model = eqx.nn.Sequential(
        [eqx.nn.Linear(256, 2048, key=keys[0]), eqx.nn.Conv1d(8, 64, 5, key=keys[1])]
    )
    params = eqx.partition(model, eqx.is_inexact_array)[0]
    priors = {p.path: p for p in _priors(model, params)}
    expected = {  # uniform in ±1/√fan_in: variance 1/(3·fan_in)
        "layers/0/weight": math.sqrt(1 / 3),
        "layers/0/bias": math.sqrt(1 / (3 * 256)),
        "layers/1/weight": math.sqrt(1 / 3),
        "layers/1/bias": math.sqrt(1 / (3 * 8 * 5)),
    }
    assert {p: q.std for p, q in priors.items()} == pytest.approx(expected, rel=1e-12)
    for index, fan_in in ((0, 256), (1, 8 * 5)):  # the initialiser's own draws agree
        layer = model.layers[index]
        for leaf, fan in (("weight", fan_in), ("bias", 1)):
            values = np.asarray(getattr(layer, leaf), np.float64)
            std = priors[f"layers/{index}/{leaf}"].std
            tol = 6 / math.sqrt(values.size / 2)
            assert fan * np.mean(values**2) == pytest.approx(std**2, rel=tol)


def test_held_out_neural_tangents_mlp():
    with jax.enable_x64(True):
        mlp = eqx.nn.MLP(
            5, 1, 64, 2, activation=jax.nn.relu, key=jax.random.PRNGKey(0), dtype=jnp.float64
        )
        assert_neural_tangents("equinox_mlp", ntk_equinox.infinite_kernel_fn(mlp))
