"""``ntk doctor``: what this environment is, and whether it computes exact kernels.

:func:`doctor` gathers versions, devices and precision settings, then runs a list of
self-test checks on the default device, each a :class:`Check` whose function returns a
:class:`CheckResult`. The list is built by :func:`default_checks`; add a check by
appending one ``Check`` there.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._api import empirical_ntk
from ntk_core._errors import bad
from ntk_core._jax import environment as _environment
from ntk_core._version import __version__

#: Distributions whose versions the report lists (``None`` when not installed).
PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "dm-haiku",
    "optax",
    "numpy",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "jax-rocm-plugin",
    "libtpu",
    "nvidia-cuda-runtime-cu12",
    "nvidia-cudnn-cu12",
    "nvidia-cuda-runtime",
    "nvidia-cudnn-cu13",
)
#: Environment variables that change how much device memory JAX reserves or reports,
#: or which device and precision it uses.
ENV_VARS = (
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
    "TF_GPU_ALLOCATOR",
    "XLA_FLAGS",
    "JAX_PLATFORMS",
    "CUDA_VISIBLE_DEVICES",
    "JAX_ENABLE_X64",
    "JAX_DEFAULT_MATMUL_PRECISION",
)
#: Largest max|K_a − K_b| / max|K_a| accepted between two ways of computing one kernel.
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """The outcome of one self-test check.

    Attributes:
      name: what was checked.
      status: ``"pass"``, ``"fail"``, ``"skip"`` (not applicable here) or ``"error"``
        (the check itself raised).
      detail: what was measured, e.g. ``"max |ΔK|/max|K| = 3.1e-07 (tolerance 1e-04)"``.
      fix: what to do when it did not pass (empty otherwise).
      seconds: wall time of the check.
    """

    name: str
    status: str
    detail: str
    fix: str = ""
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Check:
    """A named self-test: ``run()`` returns a :class:`CheckResult` (its ``name`` and
    ``seconds`` are filled in by :func:`doctor`)."""

    name: str
    run: Callable[[], CheckResult]


@dataclasses.dataclass(frozen=True)
class DoctorReport:
    """What :func:`doctor` found; JSON-serialisable with :meth:`to_dict`.

    Attributes:
      python: Python version.
      system: operating system and machine.
      ntk_jax: this library's version.
      packages: distribution name -> version, ``None`` when not installed.
      backend: the default backend (``"cpu"``, ``"gpu"``, ``"tpu"``).
      platform_version: the backend's version string as reported.
      accelerator: parsed, e.g. ``"CUDA 12.3"``, ``"ROCm 6.2.0"``, ``"TPU"``, ``"CPU"``.
      cuda: CUDA runtime version ``"12.3"`` on CUDA backends, else ``None``.
      cudnn: cuDNN version from the installed ``nvidia-cudnn-cu*`` wheel, else ``None``.
      devices: one dict per device: ``id``, ``platform``, ``kind`` and ``memory``
        (``device.memory_stats()``: bytes in use, limit, peak; ``None`` on the CPU).
      x64: whether ``jax_enable_x64`` is on (float64 kernels possible).
      default_matmul_precision: ``jax_default_matmul_precision`` (``None``: JAX's
        default). Kernels override it with their ``precision=`` option.
      env: the variables of :data:`ENV_VARS` that are set.
      notes: what in this environment distorts kernels or memory readings.
      checks: the self-test results, in order.
    """

    python: str
    system: str
    ntk_jax: str
    packages: dict
    backend: str
    platform_version: str
    accelerator: str
    cuda: str | None
    cudnn: str | None
    devices: list
    x64: bool
    default_matmul_precision: str | None
    env: dict
    notes: list
    checks: list

    @property
    def ok(self) -> bool:
        """True when no check failed or errored (skipped checks do not count)."""
        return all(c.status in ("pass", "skip") for c in self.checks)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        lines = [
            f"ntk-jax {self.ntk_jax} on Python {self.python} ({self.system})",
            "",
            "Packages:",
        ]
        for name, version in self.packages.items():
            if version is not None or name in PACKAGES[:6]:
                lines.append(f"  {name:26s} {version or 'not installed'}")
        lines += [
            "",
            f"Backend: {self.backend} ({self.accelerator}; platform_version "
            f"{self.platform_version!r})",
            f"  CUDA: {self.cuda or '-'}   cuDNN: {self.cudnn or '-'}",
        ]
        for d in self.devices:
            memory = d["memory"]
            if memory:
                used = memory.get("bytes_in_use", 0) / 2**30
                limit = memory.get("bytes_limit", 0) / 2**30
                mem = f"{used:.2f} GiB in use of {limit:.2f} GiB"
            else:
                mem = "memory statistics not available"
            lines.append(f"  device {d['id']}: {d['kind']} ({d['platform']}), {mem}")
        lines += [
            "",
            f"x64 (float64 kernels): {'on' if self.x64 else 'off'}",
            f"jax_default_matmul_precision: {self.default_matmul_precision or 'not set'} "
            f"(kernels run at their precision= option, 'highest' by default)",
        ]
        for key, value in self.env.items():
            lines.append(f"  {key}={value}")
        if self.notes:
            lines += ["", "Notes:"] + [f"  - {n}" for n in self.notes]
        lines += ["", "Self-test:"]
        if not self.checks:
            lines.append("  (skipped)")
        for c in self.checks:
            lines.append(f"  [{c.status.upper():5s}] {c.name}: {c.detail} ({c.seconds:.1f} s)")
            if c.fix:
                lines.append(f"          Fix: {c.fix}")
        lines += ["", "OK" if self.ok else "FAILED: see the checks above"]
        return "\n".join(lines)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _installed(name: str) -> bool:
    """Whether the package ``name`` can be imported, checked without importing it. A bare
    directory of that name on ``sys.path`` (a namespace package: no origin), such as a
    project's ``tests/flax`` folder, is not the framework."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


def _memory(device) -> dict | None:
    try:
        stats = device.memory_stats()
    except Exception:  # not implemented on some backends
        return None
    if not stats:
        return None
    keys = ("bytes_in_use", "bytes_limit", "peak_bytes_in_use", "bytes_reserved")
    return {k: int(stats[k]) for k in keys if k in stats}


def _notes(backend, info, env, x64, matmul) -> list[str]:
    notes = []
    if backend == "gpu":
        if env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() not in ("false", "0"):
            notes.append(
                "JAX preallocates 75% of GPU memory (or XLA_PYTHON_CLIENT_MEM_FRACTION) at "
                "start-up, so nvidia-smi and memory_stats show the pool, not what a kernel "
                "uses. To measure memory: XLA_PYTHON_CLIENT_PREALLOCATE=false."
            )
        if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
            notes.append(
                "XLA_PYTHON_CLIENT_ALLOCATOR=platform frees memory eagerly: exact "
                "readings, slow kernels."
            )
        message = _environment.refusal(info, "ntk_core")
        if message is not None:
            notes.append(message)
    if not x64:
        notes.append(
            "x64 is off: kernels are float32 (round-off about 1e-6 relative). For float64 "
            'kernels: jax.config.update("jax_enable_x64", True) or JAX_ENABLE_X64=1.'
        )
    if matmul not in (None, "highest", "float32"):
        notes.append(
            f"jax_default_matmul_precision={matmul!r} lowers your own matmuls; kernels of "
            f"this library still run at their precision= option ('highest' by default)."
        )
    return notes


# -- self-test checks -----------------------------------------------------------------


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _compare(pairs: dict, dtype: str) -> CheckResult:
    """``pairs``: label -> (kernel, reference kernel); passes within TOLERANCE."""
    tol = TOLERANCE.get(dtype, TOLERANCE["float32"])
    errors = {label: _relative(k, ref) for label, (k, ref) in pairs.items()}
    worst = max(errors, key=errors.get)
    detail = ", ".join(f"{label} {e:.1e}" for label, e in errors.items())
    detail = f"max |ΔK|/max|K|: {detail} (tolerance {tol:.0e})"
    if errors[worst] <= tol and all(np.isfinite(list(errors.values()))):
        return CheckResult("", "pass", detail)
    return CheckResult(
        "",
        "fail",
        detail + f"; worst: {worst}",
        "the same kernel computed two ways differs beyond float round-off on this device: "
        'update jax/jaxlib and the CUDA wheels (pip install -U "jax[cuda12]"), make sure '
        "nothing lowers matmul precision (precision='highest', no precision= in the model), "
        "and compare with JAX_PLATFORMS=cpu.",
    )


#: Self-test architectures: ``"lenet"`` (case C1, used by ``ntk doctor``) and
#: ``"small"`` (one convolution and one dense layer, for fast tests of the checks).
MODELS = ("lenet", "small")


def _plain_cnn(x, out_features, model):
    """The self-test CNN in plain JAX (used when Flax is not installed, and for "small")."""
    rng = np.random.default_rng(0)  # NumPy: no compilation per parameter shape

    def normal(shape):
        return rng.standard_normal(shape).astype(np.float32)

    convs, denses = ((6, 16), (120, 84)) if model == "lenet" else ((2,), ())
    params = {}
    c_in = x.shape[-1]
    for i, c in enumerate(convs):
        params[f"conv{i}"] = {
            "w": normal((5, 5, c_in, c)) / np.sqrt(25 * c_in),
            "b": 0.1 * normal((c,)),
        }
        c_in = c
    pool = 2 ** len(convs) if model == "lenet" else 1
    sizes = ((x.shape[1] // pool) * (x.shape[2] // pool) * c_in, *denses, out_features)
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"dense{i}"] = {
            "w": normal((a, b)) / np.sqrt(a),
            "b": 0.1 * normal((b,)),
        }

    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)

    def apply(p, x):
        for i in range(len(convs)):
            x = jax.lax.conv_general_dilated(
                x, p[f"conv{i}"]["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            x = jax.nn.relu(x + p[f"conv{i}"]["b"])
            if model == "lenet":
                window = (1, 2, 2, 1)
                x = jax.lax.reduce_window(x, 0.0, jax.lax.add, window, window, "VALID") / 4.0
        x = x.reshape((x.shape[0], -1))
        for i in range(len(sizes) - 1):
            x = x @ p[f"dense{i}"]["w"] + p[f"dense{i}"]["b"]
            x = jax.nn.relu(x) if i < len(sizes) - 2 else x
        return x

    what = "plain-JAX LeNet" if model == "lenet" else "small plain-JAX CNN"
    return apply, params, what


def _network(x, out_features, model):
    """``(apply_fn, params, description)`` of the self-test network (plain JAX)."""
    return _plain_cnn(x, out_features, model)


def _inputs(samples, image_size):
    rng = np.random.default_rng(1)
    shape = (image_size, image_size, 3)
    x1 = rng.standard_normal((samples, *shape)).astype(np.float32)
    return jnp.asarray(x1), jnp.asarray(rng.standard_normal((samples - 1, *shape)), jnp.float32)


def implementations_check(samples: int = 4, image_size: int = 16, model: str = "lenet") -> Check:
    """Jacobian contraction, NTK-vector products and structured derivatives agree."""

    def run() -> CheckResult:
        x1, x2 = _inputs(samples, image_size)
        apply, params, what = _network(x1, 2, model)
        kernels = {
            impl: empirical_ntk(apply, params, x1, x2, trace_axes=(), implementation=impl)
            for impl in ("jacobian", "ntvp", "structured")
        }
        ref = kernels["jacobian"]
        result = _compare(
            {
                "ntvp vs jacobian": (kernels["ntvp"], ref),
                "structured vs jacobian": (kernels["structured"], ref),
            },
            str(ref.dtype),
        )
        detail = f"{what}, x {tuple(x1.shape)} vs {tuple(x2.shape)}, full kernel; "
        return dataclasses.replace(result, detail=detail + result.detail)

    return Check("implementations agree (jacobian, ntvp, structured)", run)


def batched_check(samples: int = 4, image_size: int = 16, model: str = "lenet") -> Check:
    """The Gram matrix computed in ragged tiles equals the one-call Gram (case C1)."""

    def run() -> CheckResult:
        x1, x2 = _inputs(samples, image_size)
        apply, params, what = _network(x1, 2, model)
        tile = max(1, samples - 1)  # a ragged last tile in both directions
        pairs = {}
        for label, second in (("x2 given", x2), ("x2=None", None)):
            one = empirical_ntk(apply, params, x1, second, trace_axes=())
            tiled = empirical_ntk(
                apply, params, x1, second, trace_axes=(), batch_size=tile, progress=False
            )
            pairs[f"batch_size={tile} vs one call, {label}"] = (tiled, one)
        result = _compare(pairs, str(one.dtype))
        detail = f"{what}, x {tuple(x1.shape)} vs {tuple(x2.shape)}, full kernel; "
        return dataclasses.replace(result, detail=detail + result.detail)

    return Check("batched equals unbatched", run)


def backend_check() -> Check:
    """The backend is supported (CUDA >= 11 on NVIDIA GPUs)."""

    def run() -> CheckResult:
        device = jax.devices()[0]
        info = _environment.parse_platform_version(device.client.platform_version, device.platform)
        message = _environment.refusal(info, "ntk doctor")
        if message is not None:
            return CheckResult("", "fail", f"{info.text} found", _environment.CUDA_FIX)
        note = _environment.unverified(info, device.platform)
        return CheckResult("", "pass", f"{info.text}" + (f"; {note}" if note else ""))

    return Check("backend supported", run)


def default_checks(samples: int = 4, image_size: int = 16, model: str = "lenet") -> list[Check]:
    """The self-test of ``ntk doctor``, in order; sizes kept small (seconds on a CPU).

    Args:
      samples: N1 of the test inputs (N2 = samples - 1), at least 2.
      image_size: height and width of the RGB inputs, a multiple of 4.
      model: one of :data:`MODELS`.
    """
    if model not in MODELS:
        what = f"model must be one of {MODELS}, got {model!r}"
        raise bad(ValueError, "default_checks", what, f"pass model={MODELS[0]!r}")
    return [
        backend_check(),
        implementations_check(samples, image_size, model),
        batched_check(samples, image_size, model),
    ]


def _run(check: Check) -> CheckResult:
    start = time.perf_counter()
    try:
        result = check.run()
    except Exception as e:  # a crash is a failed check, with its reason
        result = CheckResult(
            "",
            "error",
            f"{type(e).__name__}: {e}",
            "report this with the output of `ntk doctor --json`.",
        )
    return dataclasses.replace(result, name=check.name, seconds=time.perf_counter() - start)


def doctor(checks: Sequence[Check] | None = None, *, self_test: bool = True) -> DoctorReport:
    """Versions, devices and precision settings of this environment, and a self-test.

    The self-test (:func:`default_checks`, a few seconds) computes the full NTK of a
    small LeNet with every implementation on the default device and compares them
    (``ntk doctor`` also compares Flax with Haiku): on a healthy device they agree to
    float round-off, max |ΔK| / max |K| ≤ 1e-4 in float32.

    Args:
      checks: the self-test checks to run (default: :func:`default_checks`).
      self_test: ``False`` reports the environment only.

    Returns:
      A :class:`DoctorReport`; ``report.ok`` is False when a check failed, ``str(report)``
      is the human-readable text of ``ntk doctor``, ``report.to_json()`` its ``--json``.

    Raises:
      Nothing for a broken environment: failures are reported in ``report.checks``.

    Cost: the full NTK (N1 = 4, N2 = 3, O = 2) of a LeNet on 16x16x3 inputs with three
    implementations, and with Flax and Haiku: a few dozen small compilations, which
    dominate (the whole ``ntk doctor`` command: see the figure in docs/environment.md,
    written by ``benchmarks/readme_figures.py``); the kernels themselves take milliseconds.

    Example:
      >>> import ntk_core
      >>> report = ntk_core.doctor(self_test=False)
      >>> report.backend in ("cpu", "gpu", "tpu"), report.ok
      (True, True)

    References:
      The users' case C1: CUDA 10 toolchains gave blocked and one-block Gram matrices
      1e-1 apart, which this self-test catches.
    """
    device = jax.devices()[0]
    raw = str(device.client.platform_version)
    info = _environment.parse_platform_version(raw, device.platform)
    env = {k: os.environ[k] for k in ENV_VARS if k in os.environ}
    x64 = bool(jax.config.jax_enable_x64)
    matmul = jax.config.jax_default_matmul_precision
    matmul = None if matmul is None else str(matmul)
    packages = {name: _version(name) for name in PACKAGES}
    cudnn = next(
        (packages[n] for n in ("nvidia-cudnn-cu12", "nvidia-cudnn-cu13") if packages[n]), None
    )
    devices = [
        {"id": d.id, "platform": d.platform, "kind": d.device_kind, "memory": _memory(d)}
        for d in jax.devices()
    ]
    if checks is None:
        checks = default_checks() if self_test else []
    elif not self_test:
        checks = []
    results = [_run(c) for c in checks]
    return DoctorReport(
        python=platform.python_version(),
        system=f"{platform.system()} {platform.release()} {platform.machine()}",
        ntk_jax=__version__,
        packages=packages,
        backend=jax.default_backend(),
        platform_version=raw,
        accelerator=info.text,
        cuda=".".join(map(str, info.version)) if info.kind == "cuda" and info.version else None,
        cudnn=cudnn,
        devices=devices,
        x64=x64,
        default_matmul_precision=matmul,
        env=env,
        notes=_notes(jax.default_backend(), info, env, x64, matmul),
        checks=results,
    )
