"""``ntk doctor``: versions, devices, precision settings and a self-test of this environment.

The self-test is the list of :class:`Check` built by :func:`default_checks`.
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
from ntk_core._errors import must
from ntk_core._jax import environment as _environment
from ntk_core._kernel.options import IMPLEMENTATIONS
from ntk_core._version import __version__

#: Distributions whose versions the report lists (``None`` when not installed).
PACKAGES = tuple(
    """jax jaxlib flax dm-haiku equinox optax numpy jax-cuda12-plugin jax-cuda12-pjrt
    jax-cuda13-plugin jax-cuda13-pjrt jax-rocm-plugin libtpu nvidia-cuda-runtime-cu12
    nvidia-cudnn-cu12 nvidia-cuda-runtime nvidia-cudnn-cu13""".split()
)
#: Environment variables that change JAX's device memory, device or precision.
ENV_VARS = tuple(
    """XLA_PYTHON_CLIENT_PREALLOCATE XLA_PYTHON_CLIENT_MEM_FRACTION XLA_PYTHON_CLIENT_ALLOCATOR
    TF_GPU_ALLOCATOR XLA_FLAGS JAX_PLATFORMS CUDA_VISIBLE_DEVICES JAX_ENABLE_X64
    JAX_DEFAULT_MATMUL_PRECISION""".split()
)
#: Largest max|K_a − K_b| / max|K_a| accepted between two ways of computing one kernel.
TOLERANCE = dict(float32=1e-4, float64=1e-10)
#: Self-test networks: ``"lenet"`` (case C1, ``ntk doctor``), ``"small"`` (fast tests).
MODELS = ("lenet", "small")
_IMPLS = IMPLEMENTATIONS[1:]  # every registered one ("auto" first); the first is the reference
_FIX = "report this with the output of `ntk doctor --json`."
#: ``device.memory_stats()`` entries reported (the first two in the text).
_MEMORY_KEYS = ("bytes_in_use", "bytes_limit", "peak_bytes_in_use", "bytes_reserved")


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One check's outcome: ``status`` is ``"pass"``, ``"fail"``, ``"skip"`` or ``"error"``
    (the check raised); ``detail`` what was measured; ``fix`` what to do when it did not pass."""

    name: str
    status: str
    detail: str
    fix: str = ""
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Check:
    """A named self-test; ``run()`` returns a :class:`CheckResult` (name, seconds filled in)."""

    name: str
    run: Callable[[], CheckResult]


@dataclasses.dataclass(frozen=True)
class DoctorReport:
    """What :func:`doctor` found; JSON-serialisable with :meth:`to_dict`.

    Fields: versions (``python``, ``system``, ``ntk_jax``, ``packages``: name -> version or
    ``None``); the backend (``backend``, its raw ``platform_version``, ``accelerator`` such
    as ``"CUDA 12.3"``, ``cuda``, ``cudnn``); ``devices`` (dicts of ``id``, ``platform``,
    ``kind``, ``memory``: ``device.memory_stats()`` bytes, ``None`` on the CPU); ``x64``,
    ``default_matmul_precision``; ``env`` (the set :data:`ENV_VARS`); ``notes`` (what
    distorts kernels or memory readings); ``checks`` (the self-test results, in order).
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
        return dict(dataclasses.asdict(self), ok=self.ok)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        lines = [f"ntk-jax {self.ntk_jax} on Python {self.python} ({self.system})\n\nPackages:"]
        for name, version in self.packages.items():
            if version is not None or name in PACKAGES[:6]:
                lines.append(f"  {name:26s} {version or 'not installed'}")
        lines.append(f"\nBackend: {self.backend} ({self.accelerator}; {self.platform_version!r})")
        lines.append(f"  CUDA: {self.cuda or '-'}   cuDNN: {self.cudnn or '-'}")
        for d in self.devices:
            mem, m = "no memory statistics", d["memory"]
            if m:
                used, limit = (m.get(k, 0) / 2**30 for k in _MEMORY_KEYS[:2])
                mem = f"{used:.2f} GiB in use of {limit:.2f} GiB"
            lines.append(f"  device {d['id']}: {d['kind']} ({d['platform']}), {mem}")
        lines.append(f"\nx64 (float64 kernels): {'on' if self.x64 else 'off'}")
        matmul = self.default_matmul_precision or "not set"
        lines.append(f"jax_default_matmul_precision: {matmul} (kernels use their precision=)")
        lines += [f"  {key}={value}" for key, value in self.env.items()]
        lines += ["\nNotes:"] + [f"  - {n}" for n in self.notes] if self.notes else []
        lines += ["\nSelf-test:"] + ([] if self.checks else ["  (skipped)"])
        for c in self.checks:
            lines.append(f"  [{c.status.upper():5s}] {c.name}: {c.detail} ({c.seconds:.1f} s)")
            lines += [f"          Fix: {c.fix}"] if c.fix else []
        return "\n".join([*lines, "", "OK" if self.ok else "FAILED: see the checks above"])


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _installed(name: str) -> bool:
    """Importable (not a bare namespace folder such as ``tests/flax``), checked unimported."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


def _memory(device) -> dict | None:
    try:
        stats = device.memory_stats()
    except Exception:  # not implemented on some backends
        return None
    return {k: int(stats[k]) for k in _MEMORY_KEYS if k in stats} if stats else None


def _notes(backend, info, env, x64, matmul) -> list[str]:
    notes = []
    if backend == "gpu":
        if env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() not in ("false", "0"):
            notes.append(
                "JAX preallocates 75% of GPU memory (or XLA_PYTHON_CLIENT_MEM_FRACTION): "
                "memory readings show the pool. To measure: XLA_PYTHON_CLIENT_PREALLOCATE=false."
            )
        if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
            notes.append("XLA_PYTHON_CLIENT_ALLOCATOR=platform: exact memory, slow kernels.")
        notes.append(_environment.refusal(info))
    if not x64:
        notes.append("x64 is off: float32 kernels (1e-6 relative); JAX_ENABLE_X64=1: float64.")
    if matmul not in (None, "highest", "float32"):
        notes.append(f"jax_default_matmul_precision={matmul!r} lowers your matmuls, not kernels'.")
    return [n for n in notes if n is not None]


def _compare(pairs: dict, dtype: str, what: str = "") -> CheckResult:
    """``pairs``: label -> (kernel, reference); passes within TOLERANCE."""
    tol = TOLERANCE.get(dtype, TOLERANCE["float32"])
    errors = {}  # max |ΔK| / max |K|
    for label, (k, ref) in pairs.items():
        k, ref = np.asarray(k, np.float64), np.asarray(ref, np.float64)
        errors[label] = float(np.abs(k - ref).max() / max(np.abs(ref).max(), 1e-30))
    worst = max(errors, key=errors.get)
    detail = ", ".join(f"{label} {e:.1e}" for label, e in errors.items())
    detail = f"{what}max |ΔK|/max|K|: {detail} (tolerance {tol:.0e})"
    if errors[worst] <= tol and all(np.isfinite(list(errors.values()))):
        return CheckResult("", "pass", detail)
    fix = f"update jax, jaxlib and CUDA, keep precision='highest': {_environment.CUDA_FIX}"
    return CheckResult("", "fail", f"{detail}; worst: {worst}", fix)


def _plain_cnn(x, out_features, model):
    """``(apply, params, description)`` of the self-test CNN in plain JAX."""
    rng = np.random.default_rng(0)  # NumPy: no compilation per parameter shape
    lenet = model == MODELS[0]
    convs, denses = ((6, 16), (120, 84)) if lenet else ((2,), ())
    pool = 2 ** len(convs) if lenet else 1
    c_in = (x.shape[-1], *convs)
    sizes = ((x.shape[1] // pool) * (x.shape[2] // pool) * convs[-1], *denses, out_features)
    shapes = [((5, 5, a, b), 25 * a) for a, b in zip(c_in, convs, strict=False)]
    shapes += [((a, b), a) for a, b in zip(sizes[:-1], sizes[1:], strict=False)]
    params = []  # (b, w) per layer: the leaf order of the former {"conv0": {"b", "w"}, ...}
    for shape, fan_in in shapes:
        w = rng.standard_normal(shape).astype(np.float32) / np.sqrt(fan_in)
        params.append((0.1 * rng.standard_normal(shape[-1:]).astype(np.float32), w))
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    window, dims = (1, 2, 2, 1), ("NHWC", "HWIO", "NHWC")

    def apply(p, x):
        for b, w in p[: len(convs)]:
            x = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", None, None, dims)
            x = jax.nn.relu(x + b)
            if lenet:
                x = jax.lax.reduce_window(x, 0.0, jax.lax.add, window, window, "VALID") / 4.0
        x = x.reshape((x.shape[0], -1))
        for i, (b, w) in enumerate(p[len(convs) :]):
            x = x @ w + b
            x = jax.nn.relu(x) if i < len(denses) else x
        return x

    return apply, params, "plain-JAX LeNet" if lenet else "small plain-JAX CNN"


def _inputs(samples, image_size):
    x = np.random.default_rng(1).standard_normal((2 * samples - 1, image_size, image_size, 3))
    return jnp.asarray(x[:samples], jnp.float32), jnp.asarray(x[samples:], jnp.float32)


def _kernel_check(name, pairs, samples, image_size, model) -> Check:
    """A :class:`Check` comparing the kernels ``pairs(apply, params, x1, x2)`` returns."""

    def run() -> CheckResult:
        x1, x2 = _inputs(samples, image_size)
        apply, params, what = _plain_cnn(x1, 2, model)
        compared = pairs(apply, params, x1, x2)
        dtype = str(next(iter(compared.values()))[1].dtype)
        return _compare(compared, dtype, f"{what}, x {x1.shape} vs {x2.shape}, full kernel; ")

    return Check(name, run)


def implementations_check(samples: int = 4, image_size: int = 16, model: str = MODELS[0]) -> Check:
    """Jacobian contraction, NTK-vector products and structured derivatives agree."""

    def pairs(f, p, x1, x2):
        k = {i: empirical_ntk(f, p, x1, x2, trace_axes=(), implementation=i) for i in _IMPLS}
        return {f"{i} vs {_IMPLS[0]}": (k[i], k[_IMPLS[0]]) for i in _IMPLS[1:]}

    name = f"implementations agree ({', '.join(_IMPLS)})"
    return _kernel_check(name, pairs, samples, image_size, model)


def batched_check(samples: int = 4, image_size: int = 16, model: str = MODELS[0]) -> Check:
    """The Gram matrix computed in ragged tiles equals the one-call Gram (case C1)."""
    tile = max(1, samples - 1)  # a ragged last tile in both directions

    def pairs(f, p, x1, x2):
        out = {}
        for label, second in (("x2 given", x2), ("x2=None", None)):
            one = empirical_ntk(f, p, x1, second, trace_axes=())
            tiled = empirical_ntk(f, p, x1, second, trace_axes=(), batch_size=tile, progress=False)
            out[f"batch_size={tile} vs one call, {label}"] = (tiled, one)
        return out

    return _kernel_check("batched equals unbatched", pairs, samples, image_size, model)


def backend_check() -> Check:
    """The backend is supported (CUDA >= 11 on NVIDIA GPUs)."""

    def run() -> CheckResult:
        device = jax.devices()[0]
        info = _environment.parse_platform_version(device.client.platform_version, device.platform)
        if _environment.refusal(info) is not None:
            return CheckResult("", "fail", f"{info.text} found", _environment.CUDA_FIX)
        note = _environment.unverified(info, device.platform)
        return CheckResult("", "pass", info.text + (f"; {note}" if note else ""))

    return Check("backend supported", run)


def default_checks(samples: int = 4, image_size: int = 16, model: str = MODELS[0]) -> list[Check]:
    """The self-test of ``ntk doctor``, in order: ``samples`` = N1 (N2 = N1 - 1, at least 2),
    RGB inputs of ``image_size`` (a multiple of 4), ``model`` one of :data:`MODELS`."""
    if model not in MODELS:
        raise must(
            ValueError, "default_checks", "model", f"one of {MODELS}", repr(model), eg="'lenet'"
        )
    kernel_checks = (implementations_check, batched_check)
    return [backend_check(), *(check(samples, image_size, model) for check in kernel_checks)]


def _run(check: Check) -> CheckResult:
    start = time.perf_counter()
    try:
        result = check.run()
    except Exception as e:  # a crash is a failed check, with its reason
        result = CheckResult("", "error", f"{type(e).__name__}: {e}", _FIX)
    return dataclasses.replace(result, name=check.name, seconds=time.perf_counter() - start)


def doctor(checks: Sequence[Check] | None = None, *, self_test: bool = True) -> DoctorReport:
    """Versions, devices and precision settings of this environment, and a self-test.

    The self-test (:func:`default_checks`) computes the full NTK of a small LeNet with every
    implementation on the default device (``ntk doctor`` adds Flax vs Haiku): a healthy
    device agrees to max |ΔK| / max |K| ≤ 1e-4 in float32.

    Args:
      checks: the checks to run (default: :func:`default_checks`).
      self_test: ``False`` reports the environment only.

    Returns:
      A :class:`DoctorReport`: ``report.ok`` False when a check failed; ``str(report)`` the
      text of ``ntk doctor``, ``report.to_json()`` its ``--json``.

    Raises:
      Nothing for a broken environment: failures are in ``report.checks``.

    Cost: the full NTK (N1 = 4, N2 = 3, O = 2) of a LeNet on 16x16x3 inputs, three ways;
    compilation dominates (figure in docs/environment.md).

    Example:
      >>> import ntk_core
      >>> report = ntk_core.doctor(self_test=False)
      >>> report.backend in ("cpu", "gpu", "tpu"), report.ok
      (True, True)

    References:
      Case C1: CUDA 10 gave blocked and one-block Gram matrices 1e-1 apart.
    """
    device = jax.devices()[0]
    raw = str(device.client.platform_version)
    info = _environment.parse_platform_version(raw, device.platform)
    env = {k: os.environ[k] for k in ENV_VARS if k in os.environ}
    x64, matmul = bool(jax.config.jax_enable_x64), jax.config.jax_default_matmul_precision
    matmul = None if matmul is None else str(matmul)
    packages = {name: _version(name) for name in PACKAGES}
    if checks is None or not self_test:
        checks = default_checks() if checks is None and self_test else []
    return DoctorReport(
        python=platform.python_version(),
        system=f"{platform.system()} {platform.release()} {platform.machine()}",
        ntk_jax=__version__,
        packages=packages,
        backend=jax.default_backend(),
        platform_version=raw,
        accelerator=info.text,
        cuda=".".join(map(str, info.version)) if info.kind == "cuda" and info.version else None,
        cudnn=packages["nvidia-cudnn-cu12"] or packages["nvidia-cudnn-cu13"],
        devices=[
            dict(id=d.id, platform=d.platform, kind=d.device_kind, memory=_memory(d))
            for d in jax.devices()
        ],
        x64=x64,
        default_matmul_precision=matmul,
        env=env,
        notes=_notes(jax.default_backend(), info, env, x64, matmul),
        checks=[_run(c) for c in checks],
    )
