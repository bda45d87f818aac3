"""Late Jacobians (``_structured.analysis.LATE``): in one call on a GPU or TPU, an
explicit group whose inputs and cotangents hold fewer values than its Jacobian keeps
those, and the contraction forms its Jacobians one group after another. A CPU keeps them
in the features (``Rates.late_jacobians``); here the CPU's rates are given the GPU's
choice, so the same programs run. Checked against the naive float64 Jacobian
contraction, and by XLA's memory analysis of the contraction: one group's Jacobians alive
at a time, not every group's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
import reference
from ntk_core._impl import cost as _cost
from ntk_core._impl import structured_phases
from ntk_core._structured import analysis as _structured

TOKENS, WIDTH, LAYERS, OUTPUTS = 2, 24, 8, 3


def token_mlp(params, x):
    """(N, TOKENS, WIDTH) -> (N, OUTPUTS): Dense layers on every token (explicit groups
    whose 2 tokens hold fewer values than their 24-wide Jacobians), mean, Dense head."""
    h = x
    for w, b in params["layers"]:
        h = jnp.tanh(h @ w + b)
    return h.mean(axis=-2) @ params["head"]


def _setup(n=5, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * LAYERS + 2)
    layers = [
        (
            jax.random.normal(keys[2 * i], (WIDTH, WIDTH), jnp.float64) / WIDTH**0.5,
            0.1 * jax.random.normal(keys[2 * i + 1], (WIDTH,), jnp.float64),
        )
        for i in range(LAYERS)
    ]
    head = jax.random.normal(keys[-2], (WIDTH, OUTPUTS), jnp.float64) / WIDTH**0.5
    x = jax.random.normal(keys[-1], (n, TOKENS, WIDTH), jnp.float64)
    return {"layers": layers, "head": head}, x


def _config(kernel_fn, params, x1, x2=None):
    return kernel_fn._engine.prepare(params, x1, x2)[1]


@pytest.fixture(autouse=True)
def _x64_and_late(monkeypatch):
    late = dataclasses.replace(_cost.RATES["cpu"], late_jacobians=True)
    monkeypatch.setitem(_cost.RATES, "cpu", late)
    with jax.enable_x64(True):
        yield


def test_a_cpu_keeps_them_in_the_features(monkeypatch):
    """Its rates say so (a CNN's kernel was 13 % slower with them late on the CI CPU)."""
    monkeypatch.undo()
    assert not _cost.RATES["cpu"].late_jacobians and _cost.RATES["tpu"].late_jacobians
    params, x = _setup()
    with jax.enable_x64(True):
        kernel_fn = ntk_core.ntk_fn(token_mlp, trace_axes=(), implementation="structured")
        modes = _config(kernel_fn, params, x).structure.modes
    assert _structured.LATE not in modes and modes.count(_structured.EXPLICIT) == LAYERS


@pytest.mark.parametrize("trace_axes", [(), (-1,)])
@pytest.mark.parametrize("given_x2", [False, True])
def test_late_groups_match_the_reference(trace_axes, given_x2):
    params, x = _setup(n=7)
    x1, x2 = (x[:4], x[4:]) if given_x2 else (x, None)
    kernel_fn = ntk_core.ntk_fn(token_mlp, trace_axes=trace_axes, implementation="structured")
    modes = _config(kernel_fn, params, x1, x2).structure.modes
    assert modes.count(_structured.LATE) == LAYERS  # every token layer
    got = np.asarray(kernel_fn(params, x1, x2))
    want = reference.ntk(token_mlp, params, x1, x1 if x2 is None else x2, trace_axes)[0]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_per_leaf_kernels_of_late_groups():
    params, x = _setup(n=4)
    per_leaf = ntk_core.empirical_ntk_per_leaf(
        token_mlp, params, x, None, trace_axes=(), implementation="structured"
    )
    paths = jax.tree_util.tree_leaves_with_path(params)
    kernels = jax.tree.leaves(per_leaf)
    assert len(kernels) == len(paths)
    for index in (0, 1, 2, len(paths) - 1):  # the head, the first layer's w and b, the last w
        path, got = paths[index], kernels[index]
        alone = reference.leaf_alone(token_mlp, params, index)
        want = reference.ntk(alone[0], alone[1], x, x, ())[0]
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=str(path[0]))


def test_tiles_form_them_in_the_features():
    """A blocked call forms explicit Jacobians once per block (the features), not per tile."""
    params, x = _setup()
    kernel_fn = ntk_core.ntk_fn(token_mlp, trace_axes=(), implementation="structured", batch_size=2)
    modes = _config(kernel_fn, params, x).structure.modes
    assert _structured.LATE not in modes and _structured.EXPLICIT in modes
    want = reference.ntk(token_mlp, params, x, x, ())[0]
    np.testing.assert_allclose(np.asarray(kernel_fn(params, x)), want, rtol=1e-10, atol=1e-12)


def test_one_groups_jacobians_alive_at_a_time():
    """XLA's memory analysis of the contraction: its temporaries hold one group's
    Jacobians and their transposed copy, and each leaf's kernel (summed at the end), not
    every group's Jacobians. Without the data dependence between groups XLA's CPU
    compiler kept them all: 8.6 MB here, against 4.3 MB with it."""
    params, x = _setup(n=64)
    kernel_fn = ntk_core.ntk_fn(token_mlp, trace_axes=(), implementation="structured")
    config = _config(kernel_fn, params, x)
    impl = kernel_fn._engine.implementation(config)
    feats = jax.eval_shape(lambda p, xs: impl.features(p, xs, None), params, x)
    tile = jax.jit(lambda f: structured_phases.contract(f, None, config=config))
    temp = tile.lower(feats).compile().memory_analysis().temp_size_in_bytes
    one_group = 64 * OUTPUTS * (WIDTH + 1) * WIDTH * 8  # (N, O, C·K) float64, bias fused
    kernel = (64 * OUTPUTS) ** 2 * 8
    assert temp < 2.5 * one_group + (LAYERS + 2) * kernel, (temp, one_group, kernel)


def test_auto_sent_to_tiles_forms_them_in_the_features(monkeypatch):
    """An ``"auto"`` call planned in one call (late groups) that the memory guard sends to
    tiles kept on the device runs the tiles with those groups explicit again."""
    from ntk_core._blocked import tiles as _tiles
    from ntk_core._kernel import planner

    params, x = _setup(n=16)
    kernel_fn = ntk_core.ntk_fn(token_mlp)  # traced over the outputs: auto takes structured
    assert _structured.LATE in _config(kernel_fn, params, x).structure.modes

    def too_big(*args, **kwargs):
        raise planner.TilesInstead

    seen, compute = [], _tiles.compute
    monkeypatch.setattr(planner, "check_fits", too_big)
    monkeypatch.setattr(
        _tiles, "compute", lambda impl, config, *a: seen.append(config) or compute(impl, config, *a)
    )
    got = np.asarray(kernel_fn(params, x))
    assert seen and all(_structured.LATE not in c.structure.modes for c in seen)
    want = reference.ntk(token_mlp, params, x, x)[0]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
