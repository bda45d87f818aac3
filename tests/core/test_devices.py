"""Issue 19: the blocked engine spreads its tiles over several devices (``devices=``,
default all local devices). Run in a subprocess with four CPU devices
(``--xla_force_host_platform_device_count=4``, set after ``import ntk_core``, which
must not start JAX's backend); every kernel equals the one-device
kernel bit for bit, for every implementation and axes setting, x2 given or not, with
the features of every block in memory or in bands (a tight memory_budget), and written
to a file; the features really ran on all four devices."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import pytest

import ntk_core

_CHILD = textwrap.dedent(
    """
    import os, sys
    import ntk_core  # starts no JAX backend: XLA_FLAGS set after importing it still apply
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np

    assert len(jax.devices()) == 4, jax.devices()
    f = lambda p, x: jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
    P = {"w": jax.random.normal(jax.random.PRNGKey(0), (5, 16)),
         "b": jax.random.normal(jax.random.PRNGKey(4), (16,)),
         "v": jax.random.normal(jax.random.PRNGKey(1), (16, 3))}
    X1 = jax.random.normal(jax.random.PRNGKey(2), (37, 5))
    X2 = jax.random.normal(jax.random.PRNGKey(3), (23, 5))
    one = dict(devices=jax.devices()[:1], batch_size=8, progress=False)
    many = dict(batch_size=8, progress=False)  # default: every local device
    checked = 0
    # every implementation with every axes setting; x2 and the band budget take turns
    # (each value of each meets each implementation), not their full product
    for i, (implementation, axes) in enumerate(
        (impl, axes)
        for impl in ("jacobian", "structured", "ntvp", "nngp")
        for axes in ({}, {"trace_axes": ()}, {"diagonal_axes": (0,)})
    ):
        x2 = X2 if i % 2 and not axes.get("diagonal_axes") else None
        budget = (None, 3000)[i // 2 % 2]  # 3000 bytes: features in bands
        if implementation == "nngp":
            build = lambda **kw: ntk_core.nngp_fn(f, memory_budget=budget, **axes, **kw)
        else:
            build = lambda **kw: ntk_core.ntk_fn(
                f, implementation=implementation, memory_budget=budget, **axes, **kw)
        a, b = build(**one)(P, X1, x2), build(**many)(P, X1, x2)
        assert np.array_equal(a, b), (implementation, axes, x2 is None, budget)
        checked += 1
    seen = set()
    kernel = ntk_core.ntk_fn(f, implementation="structured", **many)
    engine = kernel._engine
    original = engine.implementation

    def recorded(config):
        found = original(config)
        def features(p, x, aux):
            if not isinstance(x, jax.core.Tracer):  # not tiling()'s eval_shape
                seen.update(d.id for d in x.devices())
            return found.features(p, x, aux)
        import dataclasses
        return dataclasses.replace(found, features=features)

    engine.implementation = recorded
    kernel(P, X1, X2)
    assert seen == {0, 1, 2, 3}, seen
    path = os.path.join(sys.argv[1], "k.npy")
    written = ntk_core.ntk_fn(f, out=path, **many)(P, X1)
    assert np.array_equal(written, ntk_core.ntk_fn(f, **one)(P, X1))
    kept = ntk_core.ntk_fn(f, batch_size=8, store_on_device=True, devices=jax.devices()[2:3])
    kept = kept(P, X1)
    assert kept.devices() == {jax.devices()[2]}, kept.devices()  # where it was asked
    assert np.array_equal(kept, ntk_core.ntk_fn(f, **one)(P, X1))
    # params and x1 committed to different devices: tiles place them; one call names both
    p3, x2 = jax.device_put(P, jax.devices()[3]), jax.device_put(X1, jax.devices()[2])
    assert np.array_equal(ntk_core.ntk_fn(f, **one)(p3, x2), ntk_core.ntk_fn(f, **one)(P, X1))
    try:
        ntk_core.empirical_ntk(f, p3, x2)
    except ValueError as e:
        assert str(e).startswith("empirical_ntk: the arrays are on different devices: params "
                                 "on device(s) [3], x1 on device(s) [2]. Fix:"), e
    else:
        raise AssertionError("no error for arrays on two devices")
    # wrt="w": b and v are held fixed, v on device 1
    held = {k: jax.device_put(a, jax.devices()[1 if k == "v" else 3]) for k, a in P.items()}
    try:
        ntk_core.empirical_ntk(f, held, jax.device_put(X1, jax.devices()[3]), wrt="w")
    except ValueError as e:
        assert "params on device(s) [3], the model's fixed state on device(s) [1]" in str(e), e
    else:
        raise AssertionError("no error for held parameters on another device")
    print("checked", checked)
    """
)


def test_tiles_on_four_devices_equal_one_device(tmp_path):
    env = dict(os.environ)
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "checked 12" in run.stdout


def test_devices_option_is_checked():
    with pytest.raises(
        TypeError,
        match=r"^ntk_fn: devices must be None or a non-empty list of jax devices, got \['gpu:0'\]",
    ):
        ntk_core.ntk_fn(lambda w, x: x @ w, batch_size=4, devices=["gpu:0"])
    device = jax.devices()[0]
    with pytest.raises(ValueError, match=r"^ntk_fn: devices lists a device twice"):
        ntk_core.ntk_fn(lambda w, x: x @ w, batch_size=4, devices=[device, device])
    with pytest.raises(
        ValueError,
        match=r"^ntk_fn: devices= spreads the blocked engine's tiles, but batch_size is None",
    ):
        ntk_core.ntk_fn(lambda w, x: x @ w, devices=[device])
