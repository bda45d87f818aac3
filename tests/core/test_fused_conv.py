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
def test_fused_convolutions_match_neural_tangents(whole, monkeypatch):
    """A Gram matrix (its pairs i <= j, each sample with itself at ρ = 1), float32 within
    its rounding of neural-tangents' float64. The network is Conv, [Relu, Conv] x 3 whose
    standard fan-in changes after the first step, LeakyRelu, GlobalAvgPool, Dense: as one
    kernel from the inputs, or (``repeated``) its three repeats as one kernel between
    XLA's layers.

    Then a cross kernel (each input's own covariances as extra pairs; N1 = 4, N2 = 3) of
    inputs, one an all-zero image, with three of them again, on a net whose first Conv's
    bias has std 0, against XLA's layers (checked against neural-tangents by test_stax):
    equal inputs take ρ = 1 at their own positions (they were 1e-4 off, the NTK's
    (π − θ)/2π at ρ an ulp below 1), but a variance 0 takes ρ = 0 as in closed_forms (the
    zero image's NTK with itself was 0.6 % off)."""
    sys.path.insert(0, TESTS)
    import stax_nets

    ran = []
    for name in ("run", "_run_network"):
        fn = getattr(fused_conv, name)
        spy = lambda p, n, *a, fn=fn, name=name: ran.append((name, n)) or fn(p, n, *a)  # noqa: E731
        monkeypatch.setattr(fused_conv, name, spy)
    ref = np.load(stax_nets.REFERENCE)
    net, shape = stax_nets.networks(stax, jnp)["cnn_repeat_gap"]
    x1 = stax_nets.inputs("cnn_repeat_gap", shape)[0].astype(np.float32)
    mode = contextlib.nullcontext if whole else fused_conv.layers_only
    with fused_conv.interpreted(), mode():
        k = net[2](x1, None, ("nngp", "ntk"))
    assert ran == [("_run_network", 3) if whole else ("run", 3)]
    for kind, ours in zip(("nngp", "ntk"), k, strict=True):
        theirs = ref[f"cnn_repeat_gap/x1x1/{kind}"]
        err = np.abs(np.asarray(ours, np.float64) - theirs).max() / np.abs(theirs).max()
        assert err <= 2e-6, (kind, err)

    def kernel_fn():  # a new one per path: a kernel function compiles once per shape
        conv = stax.Conv(3, (3, 2), padding="SAME", W_std=1.3, b_std=0.1)
        # a bias of std 0 in the standard parameterisation: variance 0, its NTK 1
        unbiased = stax.Conv(3, (3, 2), padding="SAME", b_std=0.0, parameterization="standard")
        return stax.serial(unbiased, stax.repeat(stax.serial(stax.Relu(), conv), 3),
                           stax.Relu(), stax.GlobalAvgPool(), stax.Dense(1))[2]  # fmt: skip

    x = np.concatenate([np.zeros_like(x1[:1]), x1[1:]])
    again = x[[2, 0, 1]].copy()
    xla = kernel_fn()(x, again, ("nngp", "ntk"))
    with fused_conv.interpreted(), mode():
        cross = kernel_fn()(x, again, ("nngp", "ntk"))
    assert len(ran) == 2
    for kind, ours, theirs in zip(("nngp", "ntk"), cross, xla, strict=True):
        theirs = np.asarray(theirs, np.float64)
        err = np.abs(np.asarray(ours, np.float64) - theirs).max() / np.abs(theirs).max()
        # float32 both: the paths round differently, up to 2.8e-6 apart here (the fused
        # 1.2e-6 from float64, XLA's 2e-7); without the two rules, 1.0e-4 and 1.1e-2
        assert err <= 5e-6, ("cross", kind, err)


def test_a_repeated_block_of_the_wrong_rank_gets_the_layers_own_message():
    """Choosing the fused path reads the layers' keys before the layers run: a 2-D Conv
    repeated on 1-D positions still gets Conv's message (it was a bare zip error)."""
    x = np.random.RandomState(0).randn(3, 5, 2).astype(np.float32)
    block = stax.serial(stax.Relu(), stax.Conv(2, (3, 3), padding="SAME"))
    net = stax.serial(stax.Conv(2, (3,), padding="SAME"), stax.repeat(block, 3))
    with pytest.raises(ValueError, match=r"Conv acts on 2 spatial axes, but its input has 1"):
        net[2](x, None, "ntk")
