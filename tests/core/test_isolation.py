"""Tests that need their own process: the core without flax/haiku, and float64."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

BLOCK_FRAMEWORKS = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("flax", "haiku"):
            raise ImportError(f"{name} is blocked in this test")
        return None
sys.meta_path.insert(0, _Block())
"""


def _run(code: str, **env) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _run_x64(code: str) -> str:
    """``_run`` with x64 on and ``tests/`` importable (for ``reference``)."""
    tests = os.path.dirname(os.path.dirname(__file__))
    return _run(
        code,
        JAX_ENABLE_X64="1",
        PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    )


def test_core_imports_and_works_without_flax_and_haiku():
    out = _run(
        BLOCK_FRAMEWORKS
        + """
import jax.numpy as jnp
import ntk_core
k = ntk_core.empirical_ntk(lambda w, x: x @ w, jnp.ones((3, 2)), jnp.eye(3))
assert k.shape == (3, 3)
assert "flax" not in sys.modules and "haiku" not in sys.modules
try:
    import ntk_flax
except ImportError:
    print("adapter refused as expected")
print("ok")
"""
    )
    assert "ok" in out
    assert "adapter refused as expected" in out


FLOAT64 = """
import jax, numpy as np
import jax.numpy as jnp
import ntk_core
import reference
assert jax.config.jax_enable_x64
k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
params = {"w": jax.random.normal(k1, (6, 16), jnp.float64),
          "v": jax.random.normal(k2, (16, 3), jnp.float64)}
f = lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"]
x1 = jax.random.normal(k3, (5, 6), jnp.float64)
x2 = x1[:3] * 0.5
for axes in [dict(trace_axes=(-1,)), dict(trace_axes=()), dict(trace_axes=(), diagonal_axes=(-1,))]:
    expected = reference.ntk(f, params, x1, x2, **axes)[0]
    for impl in ["jacobian", "ntvp"]:
        k = ntk_core.empirical_ntk(f, params, x1, x2, implementation=impl, **axes)
        assert k.dtype == jnp.float64, k.dtype
        reference.assert_close(k, expected, dtype="float64")
    reference.assert_close(
        ntk_core.empirical_nngp(f, params, x1, x2, **axes), reference.nngp(f, params, x1, x2, **axes)[0],
        dtype="float64")
"""

#: Under x64, float32 parameters (Flax's default param_dtype) meeting float64 inputs are
#: widened before each product: the Gram form still applies (no leaf falls back), each
#: leaf's kernel keeps its parameters' dtype as its Jacobian would (so does every
#: implementation's kernel), and the kernel equals the float64 reference of those
#: float32 Jacobians, the Jacobian contraction and the NTK-vector products.
MIXED = """
import jax, numpy as np
import jax.numpy as jnp
import ntk_core
import reference
k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
params = {"w": jax.random.normal(k1, (6, 16), jnp.float32), "b": jnp.full((16,), 0.1, jnp.float32),
          "v": jax.random.normal(k2, (16, 3), jnp.float32)}
f = lambda p, x: jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
x1 = jax.random.normal(k3, (5, 6), jnp.float64)
x2 = x1[:3] * 0.5
plan = ntk_core.plan(f, params, x1, x2, trace_axes=(), implementation="structured")
assert not any("fallback" in leaf.method for leaf in plan.leaves), plan
expected = reference.ntk(f, params, x1, x2, trace_axes=())[0]
k = ntk_core.empirical_ntk(f, params, x1, x2, trace_axes=(), implementation="structured")
assert k.dtype == jnp.float32, k.dtype
reference.assert_close(k, expected)
for impl in ("jacobian", "ntvp"):  # the same dtype from every implementation
    kj = ntk_core.empirical_ntk(f, params, x1, x2, trace_axes=(), implementation=impl)
    assert kj.dtype == jnp.float32, (impl, kj.dtype)
    reference.assert_close(k, np.asarray(kj, np.float64))
per_leaf = ntk_core.empirical_ntk_per_leaf(f, params, x1, x2, trace_axes=())
assert {str(v.dtype) for v in jax.tree.leaves(per_leaf)} == {"float32"}
"""

#: The x64 checks share one process (one Python and JAX start-up): each runs in its own
#: namespace and prints its name and "ok", or its name and the traceback.
_X64_RUNNER = """
import sys, traceback
for name, code in CHECKS.items():
    try:
        exec(code, {"__name__": name})
        print(name, "ok", flush=True)
    except BaseException:
        print(name, "FAILED", traceback.format_exc(), flush=True)
"""


@pytest.fixture(scope="module")
def x64_output():
    checks = {"float64": FLOAT64, "mixed": MIXED}
    return _run_x64(f"CHECKS = {checks!r}\n" + _X64_RUNNER)


def _check_passed(output: str, name: str):
    lines = [line for line in output.splitlines() if line.startswith(f"{name} ")]
    assert lines == [f"{name} ok"], output


def test_float64_matches_reference_to_1e12(x64_output):
    _check_passed(x64_output, "float64")


def test_float32_parameters_with_float64_inputs_stay_structured(x64_output):
    """Under x64, float32 parameters (Flax's default param_dtype) meeting float64 inputs
    are widened before each product: the Gram form still applies (no leaf falls back),
    each leaf's kernel keeps its parameters' dtype as its Jacobian would (so does every
    implementation's kernel), and the kernel equals the float64 reference of those
    float32 Jacobians, the Jacobian contraction and the NTK-vector products."""
    _check_passed(x64_output, "mixed")
