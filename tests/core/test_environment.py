"""The environment guard: CUDA version parsing and refusal, precision warnings."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
from ntk_core._jax import environment as _environment
from ntk_core._jax.environment import parse_platform_version, refusal, unverified

TPU = "PJRT C API\nTFRT TPU v5 lite\nBuilt on Jan 22 2025 12:00:00 (1737547200) cl/718000000"

# (platform_version, device platform, kind, version, refused)
VERSIONS = [
    ("cuda 10020", "gpu", "cuda", (10, 2), True),
    ("cuda 9020", "gpu", "cuda", (9, 2), True),
    ("cuda 11000", "gpu", "cuda", (11, 0), False),
    ("cuda 11040", "gpu", "cuda", (11, 4), False),
    ("cuda 12030", "gpu", "cuda", (12, 3), False),
    ("PJRT C API\ncuda 12080", "gpu", "cuda", (12, 8), False),
    ("PJRT C API\ncuda 10010", "gpu", "cuda", (10, 1), True),
    ("rocm 60200", "gpu", "rocm", (6, 2, 0), False),
    ("rocm 50700", "gpu", "rocm", (5, 7, 0), False),
    (TPU, "tpu", "tpu", None, False),
    ("cpu", "cpu", "cpu", None, False),
    ("<unknown>", "gpu", "unknown", None, False),
    ("cuda (version not reported)", "gpu", "cuda", None, False),
]


@pytest.mark.parametrize("raw, platform, kind, version, refused", VERSIONS)
def test_parse_and_decide(raw, platform, kind, version, refused):
    info = parse_platform_version(raw, platform)
    assert (info.kind, info.version, info.raw) == (kind, version, raw)
    message = refusal(info, "empirical_ntk")
    assert (message is not None) == refused
    if refused:
        found = f"CUDA {version[0]}.{version[1]}"
        assert message.startswith(f"empirical_ntk: the GPU backend runs {found} ")
        assert repr(raw) in message and "CUDA 11 or newer is required" in message
        assert 'Fix: python -m pip install -U "jax[cuda12]"' in message
    # A GPU whose version cannot be read is not refused, but said to be unverified.
    assert (unverified(info, platform) is not None) == (platform == "gpu" and version is None)


def test_tpu_and_rocm_texts():
    assert parse_platform_version(TPU).text == "TPU"
    assert parse_platform_version("rocm 60200").text == "ROCm 6.2.0"
    assert parse_platform_version("cuda 11040").text == "CUDA 11.4"


def test_the_running_cpu_backend_is_accepted():
    assert _environment.check_backend("empirical_ntk").kind == "cpu"


@pytest.fixture
def fresh_warnings():
    """Warnings fire once per process per cause: forget earlier ones for this test."""
    _environment._WARNED.clear()
    yield
    _environment._WARNED.clear()


def test_engine_refuses_cuda_10_before_computing(monkeypatch, fresh_warnings):
    """The engine asks the guard first; a CUDA 10 backend (injected) is refused."""
    monkeypatch.setattr(
        _environment, "_backend_info", lambda: (parse_platform_version("cuda 10020"), "gpu")
    )
    with pytest.raises(
        ntk_core.UnsupportedBackendError,
        match=r"^empirical_ntk: the GPU backend runs CUDA 10.2 .* Fix: python -m pip",
    ):
        ntk_core.empirical_ntk(lambda w, x: jnp.sin(x @ w), jnp.ones((3, 2)), jnp.ones((4, 3)))
    monkeypatch.setattr(
        _environment, "_backend_info", lambda: (parse_platform_version("<unknown>"), "gpu")
    )
    with pytest.warns(ntk_core.BackendWarning, match=r"^empirical_ntk: the GPU backend .*"):
        ntk_core.empirical_ntk(lambda w, x: jnp.cos(x @ w), jnp.ones((3, 2)), jnp.ones((4, 3)))


def _precision_warnings(record):
    return [w for w in record if issubclass(w.category, ntk_core.PrecisionWarning)]


def test_implicit_float64_without_x64_is_silent_and_float32(fresh_warnings):
    """NumPy float64 params and inputs with x64 off are implicit float64: JAX turns them
    into float32 without a warning, and so does the library (no PrecisionWarning, no
    warning at all); the kernel is the float32 kernel of the inputs cast to float32."""

    def f(w, x):
        return jnp.tanh(x @ w)

    w64 = np.linspace(-1.0, 1.0, 6).reshape(3, 2)  # float64
    x64, y64 = np.linspace(-2.0, 2.0, 12).reshape(4, 3), np.linspace(0.0, 1.0, 9).reshape(3, 3)
    assert w64.dtype == x64.dtype == y64.dtype == np.float64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k = ntk_core.empirical_ntk(f, w64, x64)
        k12 = ntk_core.empirical_ntk(f, w64, x64, y64)
        g = ntk_core.empirical_nngp(f, w64, x64)
    assert k.dtype == k12.dtype == g.dtype == jnp.float32  # what JAX computes
    w32, x32, y32 = (a.astype(np.float32) for a in (w64, x64, y64))
    np.testing.assert_array_equal(k, ntk_core.empirical_ntk(f, w32, x32))
    np.testing.assert_array_equal(k12, ntk_core.empirical_ntk(f, w32, x32, y32))
    np.testing.assert_array_equal(g, ntk_core.empirical_nngp(f, w32, x32))


def test_explicit_float64_in_the_model_gets_jaxs_own_warning(fresh_warnings):
    """An explicit float64 request inside the model is JAX's to report (its UserWarning
    "Explicitly requested dtype float64 ... truncated"); the library adds no warning of
    its own, and the kernel is float32."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        k = ntk_core.empirical_ntk(
            lambda w, x: jnp.tanh(x.astype(jnp.float64) @ w), jnp.ones((3, 2)), jnp.ones((4, 3))
        )
    assert k.dtype == jnp.float32
    assert not _precision_warnings(rec)
    assert any("Explicitly requested dtype float64" in str(w.message) for w in rec)


def test_precision_option_warns_once_per_value(fresh_warnings):
    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    with pytest.warns(ntk_core.PrecisionWarning, match=r"^ntk_fn: precision='high'") as rec:
        ntk_core.ntk_fn(lambda w, x: x @ w, precision="high")(w, x)
    assert rec[0].filename == __file__
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        ntk_core.ntk_fn(lambda w, x: 2 * x @ w, precision="high")(w, x)
        ntk_core.ntk_fn(lambda w, x: 3 * x @ w)(w, x)  # the default, "highest"
    assert not _precision_warnings(again)
    with pytest.warns(ntk_core.PrecisionWarning, match=r"precision='default'"):
        ntk_core.ntk_fn(lambda w, x: 4 * x @ w, precision="default")(w, x)


HIGHEST, DEFAULT = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT


def test_flax_conv_local_does_not_warn(fresh_warnings):
    """ConvLocal extracts patches with lax.conv_general_dilated_patches, which gives its
    constant one-hot filter DEFAULT precision: exact, so no warning."""
    nn = pytest.importorskip("flax.linen")
    import ntk_flax

    class Local(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.ConvLocal(2, (3, 3))(x)
            return nn.Dense(2)(h.reshape(h.shape[0], -1))

    x = jax.random.normal(jax.random.PRNGKey(1), (3, 6, 6, 1))
    model = Local()
    variables = model.init(jax.random.PRNGKey(0), x)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ntk_flax.kernel(model, variables, x)
    assert not _precision_warnings(rec)


def _inner_jit(w, x):
    return jax.jit(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.DEFAULT))(x, w)


def _conv(w, x):
    return jax.lax.conv_general_dilated(
        x[:, None, :, None], w[None, None], (1, 1), "SAME", precision="bfloat16"
    ).reshape((x.shape[0], -1))


@pytest.mark.parametrize(
    "model, warns",
    [
        (lambda w, x: jnp.dot(x, w, precision="default"), True),
        (lambda w, x: jnp.dot(x, w, precision=jax.lax.Precision.HIGH), True),
        (_inner_jit, True),  # found inside a nested jaxpr
        (_conv, True),
        (lambda w, x: jnp.dot(x, w, precision="highest"), False),
        (lambda w, x: x @ w, False),
        (lambda w, x: jnp.dot(x, w, precision=(HIGHEST, DEFAULT)), True),  # w varies
        (lambda w, x: jnp.dot(x @ w, jnp.eye(2), precision=(HIGHEST, DEFAULT)), False),
    ],
    ids=[
        "dot-default",
        "dot-high",
        "nested-jit",
        "conv-bf16",
        "dot-highest",
        "no-precision",
        "default-on-params",
        "default-on-constant",
    ],
)
def test_model_precision_below_highest_warns(model, warns, fresh_warnings):
    w, x = jnp.ones((3, 2)), jnp.arange(12.0).reshape(4, 3)
    if warns:
        with pytest.warns(ntk_core.PrecisionWarning, match=r"the model itself asks") as rec:
            ntk_core.empirical_ntk(model, w, x, trace_axes=())
        assert rec[0].filename == __file__
    else:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            ntk_core.empirical_ntk(model, w, x, trace_axes=())
        assert not _precision_warnings(rec)


def _bf16_inside_jit(w, x):
    return jax.jit(lambda a, b: a.astype(jnp.bfloat16) @ b.astype(jnp.bfloat16))(x, w)


@pytest.mark.parametrize(
    "model, params_dtype, x_dtype, expected",
    [
        (
            lambda w, x: x @ w,
            "bfloat16",
            "bfloat16",
            r"\(params bfloat16\).* 1e-2 relative in bfloat16.* See docs/errors.md#half-precision-model",
        ),
        (
            lambda w, x: x @ w,
            "float16",
            "float16",
            r"\(params float16\).* 1e-3 relative in float16",
        ),
        (_bf16_inside_jit, "float32", "float32", r"\(a cast float32 -> bfloat16\).* 1e-2 "),
        (lambda w, x: x @ w, "float32", "bfloat16", None),  # widened: float32 products
        (lambda w, x: x @ w, "float32", "float32", None),
    ],
    ids=["bf16-params", "f16-params", "cast-inside-jit", "bf16-inputs-only", "float32"],
)
def test_half_precision_model_warns_once(model, params_dtype, x_dtype, expected, fresh_warnings):
    """Autodiff rounds the Jacobian's products in bfloat16/float16: the warning names
    where and the measured error of that dtype; half-precision inputs meeting float32
    params are promoted to float32 (no warning)."""
    w = jnp.ones((3, 2), params_dtype)
    x = jnp.arange(12.0).reshape(4, 3).astype(x_dtype)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ntk_core.empirical_ntk(model, w, x, trace_axes=())
        ntk_core.empirical_ntk(model, w, 2 * x, trace_axes=())  # once per process
    found = _precision_warnings(rec)
    if expected is None:
        assert not found
        return
    assert len(found) == 1 and found[0].filename == __file__
    message = str(found[0].message)
    assert message.startswith("empirical_ntk: the model computes in half precision (")
    assert re.search(expected, message), message
    assert "Fix: compute kernels with the model in float32" in message


def test_half_precision_nngp_warning_speaks_of_the_forward_pass(fresh_warnings):
    """The NNGP has no Jacobian: its warning names the forward pass, and the bfloat16
    NNGP really is off from the float32 one by the order the warning gives (1e-2)."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    w = jax.random.normal(k1, (10, 64)) / np.sqrt(10.0)
    x = jax.random.normal(k2, (16, 10))

    def model(w, x):
        return jnp.tanh(x @ w) @ jnp.ones((64, 2), w.dtype) / 8.0

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        half = ntk_core.empirical_nngp(model, w.astype(jnp.bfloat16), x.astype(jnp.bfloat16))
    found = _precision_warnings(rec)
    assert len(found) == 1, [str(f.message) for f in rec]
    message = str(found[0].message)
    assert message.startswith("empirical_nngp: the model computes in half precision (")
    assert "every product of the forward pass is rounded, so the NNGP differs" in message
    assert "Jacobian" not in message
    exact = np.asarray(ntk_core.empirical_nngp(model, w, x), np.float64)
    error = np.abs(np.asarray(half, np.float64) - exact).max() / np.abs(exact).max()
    assert 1e-4 < error < 5e-2, error


def test_lower_global_matmul_precision_is_overridden_so_no_warning(fresh_warnings):
    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with jax.default_matmul_precision("bfloat16"):
            ntk_core.empirical_ntk(lambda w, x: jnp.sinh(x @ w), w, x)
    assert not _precision_warnings(rec)


def test_warning_through_the_flax_adapter_points_at_the_user(fresh_warnings):
    nn = pytest.importorskip("flax.linen")
    import ntk_flax

    model = nn.Dense(2)
    x = np.ones((3, 4))  # float64: silent (implicit), see above
    variables = model.init(jax.random.PRNGKey(0), jnp.ones((3, 4)))
    with pytest.warns(ntk_core.PrecisionWarning, match=r"^ntk_flax.kernel: precision='high'") as r:
        ntk_flax.kernel(model, variables, x, precision="high")
    assert r[0].filename == __file__
    assert len(_precision_warnings(r)) == 1  # the precision option only, not float64


def test_categories():
    assert issubclass(ntk_core.PrecisionWarning, UserWarning)
    assert issubclass(ntk_core.BackendWarning, UserWarning)
    assert issubclass(ntk_core.UnsupportedBackendError, RuntimeError)


def test_float64_with_x64_on_gives_float64_kernel_without_warning():
    """Own process: x64 is a start-up setting."""
    code = textwrap.dedent(
        """
        import warnings
        warnings.simplefilter("error")
        import numpy as np, jax.numpy as jnp, ntk_core
        k = ntk_core.empirical_ntk(lambda w, x: jnp.tanh(x @ w), np.ones((3, 2)), np.ones((4, 3)))
        print(k.dtype)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_ENABLE_X64": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "float64"
