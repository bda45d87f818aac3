"""kernel_fn(x1, x2, get, mask_constant=...) against neural-tangents 0.6.5's own kernels
of the masked networks of tests/stax_mask_nets.py (recorded in
tests/data/nt_stax_masks.npz by that file's dump command), in one call and in tiles; and
the finite apply_fn(params, x, mask_constant=c): each sample at its own length, Monte
Carlo kernels converging to the masked kernel_fn."""

import functools

import jax
import numpy as np
import pytest

import stax_mask_nets
from ntk_core import monte_carlo_kernels, stax

NETS = stax_mask_nets.networks(stax)


def _check(name, k, rows, cols, tag):
    ref = np.load(stax_mask_nets.REFERENCE)
    for kind in ("nngp", "ntk"):
        theirs = ref[f"{name}/{tag}/{kind}"]
        ours = np.asarray(getattr(k, kind))[rows, cols]
        assert ours.dtype == np.float64 and ours.shape == theirs.shape
        assert np.abs(ours - theirs).max() <= 1e-8 * np.abs(theirs).max(), (tag, kind)


@pytest.mark.parametrize("name", NETS, ids=NETS)
def test_masked_networks_match_neural_tangents_in_float64(name):
    """The Gram matrix of [x1; x2] (one program) holds neural-tangents' K(x1, x1) and
    K(x1, x2): NNGP and NTK within 1e-8 relative (measured 6e-16)."""
    net, shape, constant = NETS[name]
    x1, x2 = stax_mask_nets.inputs(name, shape, constant)
    with jax.enable_x64(True):
        k = net[2](np.concatenate([x1, x2]), None, mask_constant=constant)
    _check(name, k, slice(0, 4), slice(0, 4), "x1x1")
    _check(name, k, slice(0, 4), slice(4, None), "x1x2")


def test_masks_in_tiles_and_that_they_matter():
    """Tiles of 2 samples (x2 given, so no Gram mirroring) equal neural-tangents' K(x1,
    x2); the same inputs with the padding zeroed but no mask give another kernel (the
    global average runs over the unmasked positions only)."""
    name = "conv1d_gap"
    net, shape, constant = NETS[name]
    x1, x2 = stax_mask_nets.inputs(name, shape, constant)
    with jax.enable_x64(True):
        tiles = net[2](x1, x2, ("nngp", "ntk"), mask_constant=constant, batch_size=2)
        _check(name, tiles, slice(None), slice(None), "x1x2")
        zeroed = np.where(x1 == constant, 0.0, x1), np.where(x2 == constant, 0.0, x2)
        plain = np.asarray(net[2](*zeroed, "ntk", batch_size=2))
    theirs = np.load(stax_mask_nets.REFERENCE)[f"{name}/x1x2/ntk"]
    assert np.abs(plain - theirs).max() > 1e-2 * np.abs(theirs).max()


def test_masked_apply_fn_is_each_sample_at_its_own_length():
    """apply_fn(params, x, mask_constant=c) on padded sequences equals apply_fn on each
    sequence cut to its length (a SAME window reads the masked positions as its zero
    padding; attention and the mean skip them): Conv, Relu, FanOut, parallel, Dense,
    Identity, FanInConcat, LayerNorm, softmax attention, GlobalAvgPool; float32, 1e-5."""
    init_fn, apply_fn, _ = stax.serial(
        stax.Conv(8, (2,), padding="SAME", b_std=0.2),
        stax.Relu(),
        stax.FanOut(2),
        stax.parallel(stax.Dense(8, b_std=0.3), stax.Identity()),
        stax.FanInConcat(),
        stax.LayerNorm(),
        stax.GlobalSelfAttention(8, 4, 4, 2, W_key_std=1.5, b_std=0.1),
        stax.GlobalAvgPool(),
        stax.Dense(3, b_std=0.1),
    )
    x = np.random.RandomState(6).randn(2, 5, 2).astype(np.float32)
    x[0, 2:] = np.nan  # lengths 2 and 5
    _, params = init_fn(jax.random.PRNGKey(0), x.shape)
    padded = jax.jit(functools.partial(apply_fn, mask_constant=np.nan))(params, x)
    alone = [jax.jit(apply_fn)(params, x[i : i + 1, :n]) for i, n in enumerate((2, 5))]
    padded, alone = np.asarray(padded), np.concatenate(alone)
    assert padded.shape == (2, 3) and np.isfinite(padded).all()
    assert np.abs(padded - alone).max() <= 1e-5 * np.abs(alone).max(), (padded, alone)


def _masked_attention_net(width):
    return stax.serial(
        stax.Dense(width, b_std=0.1),
        stax.GlobalSelfAttention(width, width, width // 2, 2, W_key_std=1.5),
        stax.Relu(),
        stax.GlobalAvgPool(),
        stax.Dense(64),  # outputs averaged: the NNGP's error falls with samples x outputs
    )


def test_masked_apply_fn_monte_carlo_converges():
    """apply_fn(params, x, mask_constant=c) (softmax attention over the unmasked keys, a
    mean over the unmasked positions): Monte Carlo NNGP and NTK of the finite network
    approach the masked kernel_fn, within 0.1 at 128 channels (measured 0.050 and 0.051)
    and closer than at 16 (0.27, 0.26); the kernel of the padding read as zeros is 0.56
    away, so an apply_fn that ignored the masks would fail."""
    x = np.random.RandomState(5).randn(3, 5, 2).astype(np.float32)
    x[0, 3:] = x[1, 2:] = -1.0  # lengths 3, 2 and 5
    errors = {}
    for width in (16, 128):
        init_fn, apply_fn, kernel_fn = _masked_attention_net(width)
        exact = kernel_fn(x, None, mask_constant=-1.0)
        mc = monte_carlo_kernels(
            lambda key, init_fn=init_fn: init_fn(key, x.shape)[1],
            functools.partial(apply_fn, mask_constant=-1.0),
            x,
            key=jax.random.PRNGKey(3),
            n_samples=8,
        )
        errors[width] = [_distance(getattr(mc, k), getattr(exact, k)) for k in ("nngp", "ntk")]
    assert max(errors[128]) < 0.1 and errors[128][1] < errors[16][1] / 2, errors
    zeroed = kernel_fn(np.where(x == -1.0, 0.0, x), None)
    gaps = [_distance(getattr(zeroed, k), getattr(exact, k)) for k in ("nngp", "ntk")]
    assert min(gaps) > 3 * max(errors[128]), (gaps, errors)


def _distance(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)
