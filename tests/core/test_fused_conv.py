"""The TPU's fused convolutions (ntk_core._infinite.fused_conv: a whole CNN-GAP from its
inputs, or repeated [ReLU, Conv] steps, each pair's kernels held in VMEM) run by Pallas'
interpreter on the CPU, against neural-tangents' float64 kernels of the same network. On
the chip the same kernel is timed and checked against the host's float64 kernel by
benchmarks/stax_windows_tpu.py (benchmarks/README.md)."""

import contextlib
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from ntk_core import stax
from ntk_core._infinite import fused_conv

TESTS = os.path.dirname(os.path.dirname(__file__))


@pytest.mark.parametrize("whole", [True, False], ids=["network", "repeated"])
@pytest.mark.parametrize("tag", ["x1x1", "x1x2"])
def test_fused_convolutions_match_neural_tangents(tag, whole, monkeypatch):
    """A Gram matrix (its pairs i <= j, each sample with itself at ρ = 1) and a cross
    kernel (each input's own covariances as extra pairs), float32 within its rounding of
    neural-tangents' float64. The network is Conv, [Relu, Conv] x 3 whose standard fan-in
    changes after the first step, LeakyRelu, GlobalAvgPool, Dense: as one kernel from the
    inputs, or (``repeated``) its three repeats as one kernel between XLA's layers. The
    Gram matrix again as a cross kernel of x1 with a copy of it: its equal pairs at ρ = 1
    too (they were 1e-4 off before, the NTK's (π − θ)/2π at ρ an ulp below 1)."""
    sys.path.insert(0, TESTS)
    import stax_nets

    ran = []
    for name in ("run", "_run_network"):
        fn = getattr(fused_conv, name)
        spy = lambda p, n, *a, fn=fn, name=name: ran.append((name, n)) or fn(p, n, *a)  # noqa: E731
        monkeypatch.setattr(fused_conv, name, spy)
    ref = np.load(stax_nets.REFERENCE)
    net, shape = stax_nets.networks(stax, jnp)["cnn_repeat_gap"]
    x1, x2 = (x.astype(np.float32) for x in stax_nets.inputs("cnn_repeat_gap", shape))
    mode = contextlib.nullcontext() if whole else fused_conv.layers_only()
    with fused_conv.interpreted(), mode:
        k = net[2](x1, None if tag == "x1x1" else x2, ("nngp", "ntk"))
        copy = net[2](x1, x1.copy(), ("nngp", "ntk")) if tag == "x1x1" else k
    assert ran == [("_run_network", 3) if whole else ("run", 3)] * (2 if tag == "x1x1" else 1)
    for kind, ours, again in zip(("nngp", "ntk"), k, copy, strict=True):
        theirs = ref[f"cnn_repeat_gap/{tag}/{kind}"]
        for out in (ours, again):
            err = np.abs(np.asarray(out, np.float64) - theirs).max() / np.abs(theirs).max()
            assert err <= 2e-6, (tag, kind, err)
