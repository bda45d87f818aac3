"""Environment guard: refuse backends that cannot give exact kernels, warn about precision.

Three things can make an empirical kernel silently inexact without any error from JAX:

* an old CUDA toolchain (CUDA 10 gave blocked and one-block Gram matrices that differed
  by 1e-1 per entry, case C1): refused with :class:`UnsupportedBackendError`;
* matmul precision below ``"highest"`` (TF32 passes on NVIDIA Ampere and newer, bf16
  passes on TPUs): :class:`PrecisionWarning`;
* a model that computes in bfloat16 or float16 (half-precision parameters, or a cast
  down to them such as a Flax layer with ``dtype=jnp.bfloat16``): autodiff rounds every
  product of the Jacobian there, so the kernel differs from the float32 model's by about
  1e-2 relative in bfloat16 and 1e-3 in float16 (:data:`HALF_PRECISION_ERROR`):
  :class:`PrecisionWarning`.

float64 inputs with ``jax_enable_x64`` off follow JAX's own convention and raise
nothing here: NumPy float64 arrays in params, x1 or x2 are implicit float64 (NumPy's
default), which JAX turns into float32 without a warning, so the kernel is float32 as
JAX computes it. An explicit float64 request inside the model (``x.astype(jnp.float64)``,
``jnp.zeros(n, dtype=jnp.float64)``) gets JAX's own ``UserWarning`` ("Explicitly
requested dtype float64 ... will be truncated to dtype float32"); the kernel API itself
has no dtype argument through which a float64 kernel could be requested.

The backend's version string (``device.client.platform_version``) is written by XLA as
``"cuda <CUDART_VERSION>"`` (CUDA runtime version as 1000 * major + 10 * minor, e.g.
``"cuda 12030"`` for 12.3), ``"rocm <TF_ROCM_VERSION>"`` (10000 * major + 100 * minor +
patch) or ``"<unknown>"``; clients loaded as PJRT plugins (the ``jax[cuda12]`` and TPU
wheels) prefix ``"PJRT C API\\n"``, and TPU strings read like ``"PJRT C API\\nTFRT TPU
v5 lite\\nBuilt on ..."``. :func:`parse_platform_version` and :func:`refusal` are pure, so
every branch is tested on a CPU with injected strings; :func:`check_backend` applies them
to the running backend once per process.
"""

from __future__ import annotations

import functools
import re
import sys
import threading
import warnings
from typing import NamedTuple

import jax
import numpy as np

from ntk_core._errors import bad
from ntk_core._jax.jaxpr_walk import equations, is_literal, sub_jaxprs

#: The oldest CUDA runtime the library accepts.
MIN_CUDA = (11, 0)

#: The fix printed with every CUDA refusal.
CUDA_FIX = 'python -m pip install -U "jax[cuda12]", or run with JAX_PLATFORMS=cpu'


class PrecisionWarning(UserWarning):
    """The kernel is computed at a lower precision than the call asked for or implies."""


class BackendWarning(UserWarning):
    """The accelerator backend's version could not be determined, so it was not checked."""


class UnsupportedBackendError(RuntimeError):
    """The accelerator backend (e.g. CUDA older than 11) cannot give exact kernels."""


class BackendVersion(NamedTuple):
    """A parsed ``platform_version`` string.

    Attributes:
      kind: ``"cuda"``, ``"rocm"``, ``"tpu"``, ``"cpu"`` or ``"unknown"``.
      version: ``(major, minor)`` for CUDA, ``(major, minor, patch)`` for ROCm, else
        ``None`` (also when the number could not be read).
      raw: the string as the backend reported it.
    """

    kind: str
    version: tuple[int, ...] | None
    raw: str

    @property
    def text(self) -> str:
        """E.g. ``"CUDA 12.3"``, ``"ROCm 6.2.0"``, ``"TPU"`` or the raw string."""
        if self.version is None:
            return {"tpu": "TPU", "cpu": "CPU"}.get(self.kind, repr(self.raw))
        name = {"cuda": "CUDA", "rocm": "ROCm"}[self.kind]
        return f"{name} {'.'.join(map(str, self.version))}"


_CUDA = re.compile(r"\bcuda\s+(\d+)\b", re.IGNORECASE)
_ROCM = re.compile(r"\brocm\s+(\d+)\b", re.IGNORECASE)


def parse_platform_version(raw: str, platform: str | None = None) -> BackendVersion:
    """Reads the backend kind and version from a ``platform_version`` string.

    Args:
      raw: e.g. ``"cuda 12030"``, ``"PJRT C API\\ncuda 12030"``, ``"rocm 60200"``,
        ``"PJRT C API\\nTFRT TPU v4\\nBuilt on ..."``, ``"cpu"``.
      platform: the device's platform name (``"gpu"``, ``"tpu"``, ``"cpu"``) when known;
        used only when the string itself names no kind.

    Returns:
      A :class:`BackendVersion`; ``version`` is ``None`` when no number could be read.

    Example:
      >>> from ntk_core._jax.environment import parse_platform_version, refusal
      >>> parse_platform_version("PJRT C API\\ncuda 12030").text
      'CUDA 12.3'
      >>> parse_platform_version("rocm 60200").version
      (6, 2, 0)
      >>> print(refusal(parse_platform_version("cuda 10020"))[:44])
      ntk_core: the GPU backend runs CUDA 10.2 (pl
    """
    text = str(raw)
    m = _CUDA.search(text)
    if m:
        n = int(m.group(1))
        return BackendVersion("cuda", (n // 1000, (n % 1000) // 10), text)
    if re.search(r"\bcuda\b", text, re.IGNORECASE):
        return BackendVersion("cuda", None, text)
    m = _ROCM.search(text)
    if m:
        n = int(m.group(1))
        return BackendVersion("rocm", (n // 10000, (n % 10000) // 100, n % 100), text)
    if re.search(r"\brocm\b", text, re.IGNORECASE):
        return BackendVersion("rocm", None, text)
    if re.search(r"\btpu\b", text, re.IGNORECASE):
        return BackendVersion("tpu", None, text)
    if text.strip().lower() in ("cpu", "host"):
        return BackendVersion("cpu", None, text)
    kind = platform if platform in ("cpu", "tpu") else "unknown"
    return BackendVersion(kind, None, text)


def refusal(info: BackendVersion, fn_name: str = "ntk_core") -> str | None:
    """The error message refusing this backend, or ``None`` when it is accepted.

    CUDA older than :data:`MIN_CUDA` is refused; everything else (newer CUDA, ROCm, TPU,
    CPU, unreadable strings) is accepted here (see :func:`unverified`).
    """
    if info.kind == "cuda" and info.version is not None and info.version < MIN_CUDA:
        found = f"CUDA {info.version[0]}.{info.version[1]} (platform_version {info.raw!r})"
        what = f"the GPU backend runs {found}; CUDA {MIN_CUDA[0]} or newer is required"
        return str(bad(RuntimeError, fn_name, what, CUDA_FIX, see="environment-guard"))
    return None


def unverified(info: BackendVersion, platform: str) -> str | None:
    """The warning for a GPU whose CUDA/ROCm version could not be read, else ``None``."""
    if platform == "gpu" and info.version is None:
        what = f"the GPU backend reports platform_version {info.raw!r}, with no CUDA version"
        return f"{what}. Fix: run `ntk doctor` to check the kernels on this device."
    return None


@functools.cache
def _backend_info() -> tuple[BackendVersion, str]:
    device = jax.devices()[0]
    return parse_platform_version(device.client.platform_version, device.platform), (
        device.platform
    )


def check_backend(fn_name: str) -> BackendVersion:
    """Refuses the default backend when it is unsupported (read once per process).

    Raises:
      UnsupportedBackendError: a GPU backend with CUDA older than 11.
    """
    info, platform = _backend_info()
    message = refusal(info, fn_name)
    if message is not None:
        raise UnsupportedBackendError(message)
    note = unverified(info, platform)
    if note is not None:
        warn_once("backend version", f"{fn_name}: {note}", BackendWarning)
    return info


# -- warnings, once per process per cause ---------------------------------------------

_WARNED: set[str] = set()
_LOCK = threading.Lock()
_OWN = ("ntk_core", "ntk_flax", "ntk_haiku")


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points at the first frame outside this library."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.split(".")[0] not in _OWN:
            return level
        frame = frame.f_back
        level += 1
    return 2


def warn_once(cause: str, message: str, category=PrecisionWarning) -> None:
    """Warns about ``cause`` the first time only (per process), at the user's call."""
    with _LOCK:
        if cause in _WARNED:
            return
        _WARNED.add(cause)
    warnings.warn(message, category, stacklevel=_user_stacklevel())


def check_precision_option(fn_name: str, precision: str) -> None:
    """Warns (once per process) when the ``precision=`` option is below ``"highest"``."""
    if precision != "highest":
        warn_once(
            f"precision option {precision}",
            f"{fn_name}: precision={precision!r} lets GPUs and TPUs use TF32 or bf16 passes "
            f"(about 1e-3 relative error). Fix: keep precision='highest'.",
        )


_LOW_ALGORITHMS = ("TF32", "BF16", "F16", "F8")


def _low_precision(value) -> bool:
    """True for a ``precision`` parameter of a dot or conv that is below HIGHEST."""
    if value is None:
        return False
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if v is None:
            continue
        if isinstance(v, jax.lax.Precision):
            if v != jax.lax.Precision.HIGHEST:
                return True
        elif any(tag in getattr(v, "name", str(v)).upper() for tag in _LOW_ALGORITHMS):
            if not any(x in getattr(v, "name", str(v)).upper() for x in ("_X6", "_X9")):
                return True
    return False


def _low_precision_ops(jaxpr) -> list[str]:
    """Dots and convolutions with a precision below HIGHEST on an operand that varies
    with the jaxpr's inputs (params, x), sub-jaxprs included (all their inputs count as
    varying).

    An operand computed from constants alone is not counted: JAX itself gives DEFAULT
    precision to the one-hot filter of ``lax.conv_general_dilated_patches`` (Flax
    ``ConvLocal``) next to HIGHEST for the patches; its values are exact in any
    precision, and the derivatives flow through the other operand.
    """
    found = []
    varying = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        moves = [not is_literal(v) and v in varying for v in eqn.invars]
        if any(moves):
            varying.update(eqn.outvars)
        value = eqn.params.get("precision")
        if value is not None:
            per_operand = value if isinstance(value, tuple) else (value,) * len(moves)
            if any(_low_precision(p) and m for p, m in zip(per_operand, moves, strict=False)):
                found.append(f"{eqn.primitive.name}(precision={value})")
        for inner in sub_jaxprs(eqn):
            found += _low_precision_ops(inner)
    return found


#: Relative error of a half-precision model's kernel against the float32 model's exact
#: one (max |ΔK| / max |K|), by kernel and dtype: typical value and the range measured on
#: 10-64-64-3 MLPs (32 samples, 13 seeds each of ReLU and tanh, in two independent
#: trials; every implementation alike) by ``benchmarks/readme_figures.py --only half``
#: (2026-12-01): NTK bfloat16 2.7e-3 to 4.1e-2, float16 3.9e-4 to 9.6e-3; NNGP bfloat16
#: 3.2e-3 to 1.7e-2, float16 4.3e-4 to 2.2e-3 (ReLU units near zero that change sign
#: when rounded make the outliers).
HALF_PRECISION_ERROR = {
    ("NTK", "bfloat16"): "1e-2 (measured 3e-3 to 4e-2)",
    ("NTK", "float16"): "1e-3 (measured 4e-4 to 1e-2)",
    ("NNGP", "bfloat16"): "1e-2 (measured 3e-3 to 2e-2)",
    ("NNGP", "float16"): "1e-3 (measured 4e-4 to 2e-3)",
}
_HALF = ("bfloat16", "float16")


def _half_precision_casts(jaxpr) -> list[str]:
    """Casts of a wider float down to bfloat16 / float16, sub-jaxprs included."""
    found = []
    for eqn in equations(jaxpr):
        if eqn.primitive.name != "convert_element_type":
            continue
        src, dst = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.outvars[0].aval.dtype)
        floating = jax.numpy.issubdtype(src, jax.numpy.floating)
        if dst.name in _HALF and floating and src.itemsize > dst.itemsize:
            found.append(f"a cast {src.name} -> {dst.name}")
    return found


def _check_half_precision(fn_name: str, params, jaxpr, kernel: str = "NTK") -> None:
    """Warns (once per process and kernel and dtype) when the model computes in bfloat16
    or float16, with the figures of ``HALF_PRECISION_ERROR``."""
    found = [
        f"params{jax.tree_util.keystr(path)} {np.dtype(leaf.dtype).name}"
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if np.dtype(getattr(leaf, "dtype", np.float32)).name in _HALF
    ]
    if jaxpr is not None:
        found += sorted(set(_half_precision_casts(jaxpr)))
    if found:
        dtype = "bfloat16" if any("bfloat16" in f for f in found) else "float16"
        how = "autodiff rounds every product" if kernel == "NTK" else "every product of "
        how += "" if kernel == "NTK" else "the forward pass is rounded"
        error = HALF_PRECISION_ERROR[kernel, dtype]
        warn_once(
            f"half precision {kernel} {dtype}",
            f"{fn_name}: the model computes in half precision ({', '.join(found[:3])}), where "
            f"{how}, so the {kernel} differs by about {error} relative in {dtype}. Fix: "
            f"compute kernels with the model in float32.",
        )


def check_model_precision(
    fn_name: str, apply3, params, x1, aux, precision: str, kernel: str = "NTK", closed=None
) -> None:
    """Warns (once per process) when the model's own matmuls ask for lower precision.

    The kernel computation runs under ``jax.default_matmul_precision(precision)``, which
    overrides a lower global ``jax_default_matmul_precision``, but not a precision the
    model passes explicitly (``nn.Dense(precision=...)``, ``jnp.dot(...,
    precision="default")``). One abstract trace of the model finds those: ``closed``,
    the caller's jaxpr of ``apply3`` traced under ``jax.default_matmul_precision(precision)``
    (the engine's, so the model is not traced again), or one made here.
    """
    if closed is None:
        x_abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v), v.dtype), x1)
        try:
            with jax.default_matmul_precision(precision):
                closed = jax.make_jaxpr(apply3)(params, x_abstract, aux)
        except Exception:  # the engine reports model failures with context
            closed = None
    _check_half_precision(fn_name, params, None if closed is None else closed.jaxpr, kernel)
    if precision != "highest" or closed is None:
        return  # the option itself was warned about
    found = _low_precision_ops(closed.jaxpr)
    if found:
        warn_once(
            "model precision",
            f"{fn_name}: the model itself asks for matmul precision below 'highest' "
            f"({', '.join(sorted(set(found))[:3])}), which precision= cannot override. "
            f"Fix: pass precision='highest' to those layers.",
        )
