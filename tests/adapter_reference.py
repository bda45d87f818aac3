"""neural-tangents 0.6.5's kernels of the adapters' held-out models (issue 50), recorded by
``benchmarks/dump_nt_adapter_references.py`` into ``tests/data/nt_adapter_reference.npz``,
and the one comparison the Flax, Haiku and equinox tests make against them."""

from __future__ import annotations

import math
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from ntk_core import stax

REF = np.load(pathlib.Path(__file__).parent / "data" / "nt_adapter_reference.npz")


def assert_neural_tangents(name: str, kernel_fn) -> None:
    """The kernels of x = [x1; x2] in one call hold (x1, x1) and (x1, x2): both against
    neural-tangents' recorded ones, to 1e-6 relative to the largest entry."""
    x1, x2 = REF[f"{name}/x1"], REF[f"{name}/x2"]
    k = kernel_fn(jnp.asarray(np.concatenate([x1, x2])), None, ("nngp", "ntk"))
    n = len(x1)
    for tag, rows in (("x1x1", slice(0, n)), ("x1x2", slice(n, None))):
        for get in ("nngp", "ntk"):
            theirs = REF[f"{name}/{tag}/{get}"]
            ours = np.asarray(getattr(k, get))[:n, rows]
            err = np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))
            assert err < 1e-6, (name, tag, get, err)


def resnet_block_twin(w_std: float):
    """The stax kernel_fn of the adapters' 1-D WideResNet-block twin (Conv 3 SAME, a residual
    [Relu, Conv, Relu, Conv] branch, LayerNorm, Relu, AvgPool 2, global mean, Dense 1), every
    weight standard-parameterised with ``w_std`` (the framework's default), zero biases."""

    def conv():
        return stax.Conv(
            4, (3,), padding="SAME", W_std=w_std, b_std=0.0, parameterization="standard"
        )

    return stax.serial(
        conv(),
        stax.FanOut(2),
        stax.parallel(stax.Identity(), stax.serial(stax.Relu(), conv(), stax.Relu(), conv())),
        stax.FanInSum(),
        stax.LayerNorm(eps=1e-3),
        stax.Relu(),
        stax.AvgPool((2,), (2,)),
        stax.GlobalAvgPool(),
        stax.Dense(1, w_std, 0.0, parameterization="standard"),
    )[2]


def assert_draws_match_priors(priors, leaf_values) -> None:
    """Each prior read from an initialiser against that initialiser's own draw:
    fan_in·mean(W²) (a weight) or mean(b²) to the prior's variance, within 6 standard
    errors of a mean of ``size / 2`` effectively independent squares. ``leaf_values``:
    path -> the drawn array."""
    for path, prior in priors.items():
        values = np.asarray(leaf_values(path), np.float64)
        fan_in = math.prod(values.shape[:-1]) if prior.kind == "weight" else 1
        estimate = fan_in * np.mean(values**2)
        assert estimate == pytest.approx(
            prior.std**2, rel=6 / math.sqrt(values.size / 2), abs=1e-12
        ), path
