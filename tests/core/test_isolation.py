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
    """``_run`` with x64 on and ``tests/`` (for ``reference``) and ``tests/core/`` (for
    ``test_spectrum``) importable."""
    core = os.path.dirname(__file__)
    return _run(
        code,
        JAX_ENABLE_X64="1",
        PYTHONPATH=os.pathsep.join([os.path.dirname(core), core, os.environ.get("PYTHONPATH", "")]),
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

#: The blocked engine (tiles of 8) in float64 equals one call to 1e-12 for three
#: implementations and layouts, x2 given or not, and the float64 reference (moved here
#: from test_blocked.py: its own process cost a Python and JAX start-up).
BLOCKED = """
import jax, numpy as np
import jax.numpy as jnp
import ntk_core, reference
assert jax.config.jax_enable_x64
k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
params = {"w": jax.random.normal(k1, (5, 8), jnp.float64),
          "v": jax.random.normal(k2, (8, 3), jnp.float64)}
f = lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"]
x1 = jax.random.normal(k3, (37, 5), jnp.float64)
x2 = jax.random.normal(k4, (23, 5), jnp.float64)
settings = [("jacobian", dict(trace_axes=())), ("structured", dict(trace_axes=(-1,))),
            ("ntvp", dict(trace_axes=(), diagonal_axes=(-1,)))]
for impl, axes in settings:
    for x in (x2, None):
        one = np.asarray(ntk_core.empirical_ntk(f, params, x1, x, implementation=impl, **axes))
        k = ntk_core.empirical_ntk(f, params, x1, x, implementation=impl, batch_size=8, **axes)
        assert k.dtype == np.float64 and k.shape == one.shape
        assert np.abs(k - one).max() <= 1e-12 * np.abs(one).max(), (impl, axes)
    reference.assert_close(k, reference.ntk(f, params, x1, None, **axes)[0], dtype="float64")
"""

#: float64: f_lin against f + J·δ with J from jax.jacrev, and degree 2 against
#: f + J·δ + ½ δᵀHδ with H from jax.hessian (forward-over-reverse: not nested JVPs), to
#: 1e-12 (moved here from test_linearize.py: its own process cost a Python and JAX
#: start-up).
LINEARIZE = """
import jax, jax.numpy as jnp, numpy as np
from jax.flatten_util import ravel_pytree
import ntk_core
f = lambda p, x: jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
k = jax.random.split(jax.random.PRNGKey(0), 9)
p0 = {"w1": jax.random.normal(k[0], (3, 8)), "b1": jax.random.normal(k[1], (8,)),
      "w2": jax.random.normal(k[2], (8, 2)), "b2": jax.random.normal(k[3], (2,))}
p = jax.tree.map(lambda a, i: a + 0.3 * jax.random.normal(i, a.shape), p0,
                 dict(zip(sorted(p0), k[4:8])))
x = jax.random.normal(k[8], (5, 3))
flat0, unravel = ravel_pytree(p0)

@jax.jit
def references(p):
    d = ravel_pytree(p)[0] - flat0
    g = lambda v: f(unravel(v), x)
    lin = g(flat0) + jax.jacrev(g)(flat0) @ d  # J: (N, O, P)
    hessian = jax.hessian(g)(flat0)  # (N, O, P, P)
    return lin, lin + 0.5 * jnp.einsum("noij,i,j->no", hessian, d, d)

@jax.jit
def ours(p):
    return ntk_core.linearize(f, p0)(p, x), ntk_core.taylor_expand(f, p0, 2)(p, x)

(lin, quad), (got_lin, got_quad) = references(p), ours(p)
e1 = np.abs(got_lin - lin).max() / np.abs(lin).max()
e2 = np.abs(got_quad - quad).max() / np.abs(quad).max()
assert got_lin.dtype == got_quad.dtype == jnp.float64, (got_lin.dtype, got_quad.dtype)
assert e1 <= 1e-12 and e2 <= 1e-12, (e1, e2)
"""

#: float64 NTK-vector products (one call and in blocks of 8) to 1e-12, the top
#: eigenvalues to 1e-10 and the trace to 1e-12 against the NumPy float64 NTK of
#: test_spectrum.py (moved here from there: its own process cost a Python and JAX
#: start-up).
SPECTRUM = """
import numpy as np
import jax, jax.numpy as jnp
import ntk_core
from ntk_core import spectrum
from test_spectrum import mlp, numpy_ntk, _params, _inputs
params, x = _params(20, dtype=np.float64), _inputs(30, 21, dtype=np.float64)
theta = numpy_ntk(params, x)
v = np.random.default_rng(0).standard_normal((30, 3))
for b in (None, 8):
    out = ntk_core.ntk_vp_fn(mlp, params, x, batch_size=b)(v)
    assert out.dtype == jnp.float64
    ref = theta @ v.reshape(-1)
    assert np.abs(np.asarray(out).reshape(-1) - ref).max() <= 1e-12 * np.abs(ref).max()
top = spectrum.ntk_eigsh(mlp, params, x, k=6, tol=0)
w = np.linalg.eigvalsh(theta)[::-1][:6]
assert np.abs(top.eigenvalues - w).max() <= 1e-10 * w[0], (top.eigenvalues, w)
assert abs(spectrum.ntk_trace(mlp, params, x) - np.trace(theta)) <= 1e-12 * np.trace(theta)
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
    checks = {
        "float64": FLOAT64,
        "mixed": MIXED,
        "blocked": BLOCKED,
        "linearize": LINEARIZE,
        "spectrum": SPECTRUM,
    }
    return _run_x64(f"CHECKS = {checks!r}\n" + _X64_RUNNER)


def _check_passed(output: str, name: str):
    lines = [line for line in output.splitlines() if line.startswith(f"{name} ")]
    assert lines == [f"{name} ok"], output


def test_float64_matches_reference_to_1e12(x64_output):
    _check_passed(x64_output, "float64")


def test_float64_blocked_equals_one_call_to_1e12(x64_output):
    _check_passed(x64_output, "blocked")


def test_float64_linearize_against_jacrev_and_hessian(x64_output):
    _check_passed(x64_output, "linearize")


def test_float64_products_and_spectrum(x64_output):
    _check_passed(x64_output, "spectrum")


def test_float32_parameters_with_float64_inputs_stay_structured(x64_output):
    """Under x64, float32 parameters (Flax's default param_dtype) meeting float64 inputs
    are widened before each product: the Gram form still applies (no leaf falls back),
    each leaf's kernel keeps its parameters' dtype as its Jacobian would (so does every
    implementation's kernel), and the kernel equals the float64 reference of those
    float32 Jacobians, the Jacobian contraction and the NTK-vector products."""
    _check_passed(x64_output, "mixed")
