"""Environment guard: refuse backends that cannot give exact kernels (CUDA < 11, case C1),
warn once about precision below ``"highest"`` and models computing in bfloat16 / float16.

docs/errors.md "Environment guard" describes the ``platform_version`` strings read here.
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
from jax.extend.core import primitives as prims

from ntk_core._errors import bad
from ntk_core._jax.jaxpr_walk import equations, is_literal, sub_jaxprs

_HIGHEST = "highest"  # the precision option that keeps kernels exact
#: The oldest CUDA runtime accepted, and the fix printed with every CUDA refusal.
MIN_CUDA = (11, 0)
CUDA_FIX = 'python -m pip install -U "jax[cuda12]", or run with JAX_PLATFORMS=cpu'


class PrecisionWarning(UserWarning):
    """The kernel is computed at a lower precision than the call asked for or implies."""


class BackendWarning(UserWarning):
    """The accelerator backend's version could not be determined, so it was not checked."""


class UnsupportedBackendError(RuntimeError):
    """The accelerator backend (e.g. CUDA older than 11) cannot give exact kernels."""


class BackendVersion(NamedTuple):
    """A parsed ``platform_version``: ``kind`` (cuda, rocm, tpu, cpu, unknown), ``version``
    ((major, minor) for CUDA, (major, minor, patch) for ROCm, else None) and ``raw``."""

    kind: str
    version: tuple[int, ...] | None
    raw: str

    @property
    def text(self) -> str:
        """E.g. ``"CUDA 12.3"``, ``"ROCm 6.2.0"``, ``"TPU"`` or the raw string."""
        if self.version is None:
            return self.kind.upper() if self.kind in ("tpu", "cpu") else repr(self.raw)
        return f"{_VERSIONED[self.kind][0]} {'.'.join(map(str, self.version))}"


#: The backends with a version number: the name shown, and the number's digits
#: (CUDART_VERSION: 1000 major + 10 minor; TF_ROCM_VERSION: 10000 major + 100 minor + patch).
_VERSIONED = {
    "cuda": ("CUDA", lambda n: (n // 1000, (n % 1000) // 10)),
    "rocm": ("ROCm", lambda n: (n // 10000, (n % 10000) // 100, n % 100)),
}


def parse_platform_version(raw: str, platform: str | None = None) -> BackendVersion:
    """The backend kind and version of ``raw``; ``platform`` (the device's) is used only when
    the string names no kind.

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
    for kind, (_, digits) in _VERSIONED.items():
        if re.search(rf"\b{kind}\b", text, re.IGNORECASE):
            m = re.search(rf"\b{kind}\s+(\d+)\b", text, re.IGNORECASE)
            return BackendVersion(kind, digits(int(m.group(1))) if m else None, text)
    kind = platform if platform in ("cpu", "tpu") else "unknown"
    kind = "cpu" if text.strip().lower() in ("cpu", "host") else kind
    return BackendVersion("tpu" if re.search(r"\btpu\b", text, re.I) else kind, None, text)


def refusal(info: BackendVersion, fn_name: str = "ntk_core") -> str | None:
    """The message refusing CUDA older than :data:`MIN_CUDA`; ``None`` for any other backend."""
    if info.kind == "cuda" and info.version is not None and info.version < MIN_CUDA:
        found = f"{info.text} (platform_version {info.raw!r})"
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
    d = jax.devices()[0]
    return parse_platform_version(d.client.platform_version, d.platform), d.platform


def check_backend(fn_name: str) -> BackendVersion:
    """Raises UnsupportedBackendError for a GPU with CUDA older than 11 (read once)."""
    info, platform = _backend_info()
    if (message := refusal(info, fn_name)) is not None:
        raise UnsupportedBackendError(message)
    if (note := unverified(info, platform)) is not None:
        warn_once(check_backend, f"{fn_name}: {note}", BackendWarning)
    return info


_WARNED: set = set()  # the causes warned about
_LOCK = threading.Lock()
_OWN = ("ntk_core", "ntk_flax", "ntk_haiku", "ntk_equinox", "ntk_cli")


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside this library."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        if frame.f_globals.get("__name__", "").split(".")[0] not in _OWN:
            return level
        frame, level = frame.f_back, level + 1
    return 2


def warn_once(cause, message: str | Warning, category=PrecisionWarning) -> None:
    """Warns about ``cause`` (hashable: the check and the values it warns about) once per
    process, at the user's call (``message``: or a Warning)."""
    with _LOCK:
        if cause in _WARNED:
            return
        _WARNED.add(cause)
    warnings.warn(message, category, stacklevel=_user_stacklevel())


_LOW_ALGORITHMS = ("TF32", "BF16", "F16", "F8")


def _low_precision(value) -> bool:
    """A dot's or conv's ``precision`` parameter below HIGHEST."""
    for v in value if isinstance(value, tuple) else (value,):
        if isinstance(v, jax.lax.Precision) and v != jax.lax.Precision.HIGHEST:
            return True
        name = "" if v is None else getattr(v, "name", str(v)).upper()
        low = any(tag in name for tag in _LOW_ALGORITHMS)
        if not isinstance(v, jax.lax.Precision) and low and "_X6" not in name and "_X9" not in name:
            return True
    return False


def _low_precision_ops(jaxpr) -> list[str]:
    """Dots and convs below HIGHEST on an operand varying with the inputs, sub-jaxprs
    included; constant operands (the one-hot filter JAX gives DEFAULT precision in
    ``conv_general_dilated_patches``, Flax ``ConvLocal``) are exact in any precision."""
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


#: Typical max |ΔK| / max |K| of a half-precision model's kernel (NTK or NNGP) against the
#: float32 one, measured by ``benchmarks/readme_figures.py --only half`` (the ranges:
#: docs/errors.md, "Half-precision model").
HALF_PRECISION_ERROR = dict(bfloat16="1e-2", float16="1e-3")
_HALF = tuple(HALF_PRECISION_ERROR)
_HOW = ("every product of the forward pass is rounded", "autodiff rounds every product")
_HALF_FIX, _HALF_SEE = "compute kernels with the model in float32", "half-precision-model"


def _check_half_precision(fn_name: str, params, jaxpr, kernel: str) -> None:
    """Warns once per kernel and dtype when the model computes in bfloat16 or float16:
    half-precision parameters, or casts of a wider float down to them (sub-jaxprs included)."""
    found = [
        f"params{jax.tree_util.keystr(path)} {np.dtype(leaf.dtype).name}"
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if np.dtype(getattr(leaf, "dtype", np.float32)).name in _HALF
    ]
    casts = set()
    for eqn in equations(jaxpr) if jaxpr is not None else ():
        if eqn.primitive is prims.convert_element_type_p:
            src, dst = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.outvars[0].aval.dtype)
            floating = jax.numpy.issubdtype(src, jax.numpy.floating)
            if dst.name in _HALF and floating and src.itemsize > dst.itemsize:
                casts.add(f"a cast {src.name} -> {dst.name}")
    found += sorted(casts)
    if found:
        dtype = _HALF[0] if any(_HALF[0] in f for f in found) else _HALF[1]
        where = f"half precision ({', '.join(found[:3])}), where {_HOW[kernel == 'NTK']}"
        what = f"the model computes in {where}, so the {kernel} differs by about "
        what += f"{HALF_PRECISION_ERROR[dtype]} relative in {dtype}"
        message = bad(PrecisionWarning, fn_name, what, _HALF_FIX, _HALF_SEE)
        warn_once((_check_half_precision, kernel, dtype), message)


def check_model_precision(
    fn_name: str, apply3, params, x1, aux, precision: str, kernel: str = "NTK", closed=None
) -> None:
    """Warns once when ``precision`` is below ``"highest"``, when the model passes a lower
    precision explicitly (``nn.Dense(precision=)``), which ``jax.default_matmul_precision``
    cannot override, or when it computes in half precision. ``closed``: the engine's jaxpr
    of ``apply3`` under that precision (else traced here)."""
    if precision != _HIGHEST:
        what = f"precision={precision!r} lets GPUs and TPUs use TF32 or bf16 (1e-3..1e-2 relative)"
        fix = f"keep precision={_HIGHEST!r}"
        warn_once((check_model_precision, precision), bad(PrecisionWarning, fn_name, what, fix))
    if closed is None:
        x_abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v), v.dtype), x1)
        try:
            with jax.default_matmul_precision(precision):
                closed = jax.make_jaxpr(apply3)(params, x_abstract, aux)
        except Exception:  # the engine reports model failures with context
            closed = None
    _check_half_precision(fn_name, params, None if closed is None else closed.jaxpr, kernel)
    if precision != _HIGHEST or closed is None:
        return  # the option itself was warned about
    if found := ", ".join(sorted(set(_low_precision_ops(closed.jaxpr)))[:3]):
        what = f"the model itself asks for matmul precision below {_HIGHEST!r} ({found})"
        warning = bad(PrecisionWarning, fn_name, what, f"pass precision={_HIGHEST!r} to the layers")
        warn_once(check_model_precision, warning)
