"""The convolution's window sums (ntk_core._infinite.windows): every method of summing a
pair of axes (``windows.METHODS``, chosen per backend, timed on a TPU by
benchmarks/stax_windows_tpu.py) against a plain loop in float64 numpy, and a convolutional
network under the method the CPU does not use by default against neural-tangents'
float64 kernels (tests/core/test_stax.py runs every network under the default)."""

import itertools
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from ntk_core import stax
from ntk_core._infinite import windows

TESTS = os.path.dirname(os.path.dirname(__file__))


def _loop(x, size, window, stride, padding):
    """Σ_δ x[:, s·h + δ − p, s·h' + δ − p] by loops (zero outside, wrapped for CIRCULAR)."""
    before, _ = windows.pads(size, window, stride, padding)
    n = windows.out_size(size, window, stride, padding)
    out = np.zeros((x.shape[0], n, n) + x.shape[3:])
    for h, g, d in itertools.product(range(n), range(n), range(window)):
        i, j = stride * h + d - before, stride * g + d - before
        if padding == "CIRCULAR":
            i, j = i % size, j % size
        if 0 <= i < size and 0 <= j < size:
            out[:, h, g] += x[:, i, j]
    return out


@pytest.mark.parametrize("method", windows.METHODS)
def test_pair_sums_match_a_loop(method):
    rng = np.random.RandomState(0)
    cases = [(1, 3, 1, "SAME", ())]  # a window wider than the image
    cases += itertools.product([5], [2, 3], [1, 2], windows.PADDINGS, [(3,)])
    cases += itertools.product([5], [3], [1, 2], windows.PADDINGS, [()])  # the minor pair
    for size, window, stride, padding, trail in cases:
        x = rng.randn(2, size, size, *trail)
        want = _loop(x, size, window, stride, padding)
        got = windows.shared_offsets(
            x.astype(np.float32), (1, 2), size, window, stride, padding, method
        )
        assert got.shape == want.shape, (size, window, stride, padding, trail)
        err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
        assert err <= 1e-6, (size, window, stride, padding, trail, err)


def test_convolutional_network_matches_neural_tangents():
    """SAME and strided CIRCULAR convolutions and a global pool with the TPU's method
    ("slices"): float32 kernels within float32 rounding of neural-tangents' float64."""
    sys.path.insert(0, TESTS)
    import stax_nets

    ref = np.load(stax_nets.REFERENCE)
    nets = stax_nets.networks(stax, jnp)
    for name in ("cnn_gap",):
        net, shape = nets[name]
        x1, x2 = stax_nets.inputs(name, shape)
        with windows.using("slices" if windows.pair_method() == "flat" else "flat"):
            k = net[2](np.concatenate([x1, x2]).astype(np.float32), None)
        for kind in ("nngp", "ntk"):
            gram = np.asarray(getattr(k, kind), np.float64)
            for tag, block in (("x1x1", gram[:4, :4]), ("x1x2", gram[:4, 4:])):
                theirs = ref[f"{name}/{tag}/{kind}"]
                err = np.abs(block - theirs).max() / np.abs(theirs).max()
                assert err <= 1e-5, (name, tag, kind, err)


def test_using_refuses_an_unknown_method():
    before = windows.pair_method()
    with pytest.raises(ValueError, match="method must be one of"):
        with windows.using("fft"):
            pass
    assert windows.pair_method() == before
