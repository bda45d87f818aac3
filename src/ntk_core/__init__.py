"""ntk_core: empirical Neural Tangent Kernels and NNGP kernels of any JAX function.

Framework-agnostic: takes any pure ``apply_fn(params, x)`` over pytrees. Imports only
jax and numpy (never flax or haiku). Adapter authors: see :mod:`ntk_core.adapters`.
"""

from ntk_core import metrics as metrics
from ntk_core import predict as predict
from ntk_core._analysis.tracking import EstimateRecord as EstimateRecord
from ntk_core._analysis.tracking import KernelRecord as KernelRecord
from ntk_core._analysis.tracking import KernelTracker as KernelTracker
from ntk_core._api import empirical_nngp as empirical_nngp
from ntk_core._api import empirical_ntk as empirical_ntk
from ntk_core._api import empirical_ntk_per_leaf as empirical_ntk_per_leaf
from ntk_core._api import nngp_fn as nngp_fn
from ntk_core._api import ntk_fn as ntk_fn
from ntk_core._api import ntk_per_leaf_fn as ntk_per_leaf_fn
from ntk_core._api import plan as plan
from ntk_core._derived.api import infinite_kernel_fn as infinite_kernel_fn
from ntk_core._doctor import DoctorReport as DoctorReport
from ntk_core._doctor import doctor as doctor
from ntk_core._errors import NonFiniteError as NonFiniteError
from ntk_core._functional.linearize import linearize as linearize
from ntk_core._functional.linearize import taylor_expand as taylor_expand
from ntk_core._functional.ntk_vp import ntk_vp_fn as ntk_vp_fn
from ntk_core._functional.pntk import empirical_pntk as empirical_pntk
from ntk_core._functional.pntk import pntk_fn as pntk_fn
from ntk_core._functional.sketch import NTKSketch as NTKSketch
from ntk_core._functional.sketch import empirical_ntk_sketch as empirical_ntk_sketch
from ntk_core._functional.sketch import ntk_sketch_fn as ntk_sketch_fn
from ntk_core._jax.caches import clear_caches as clear_caches
from ntk_core._jax.environment import BackendWarning as BackendWarning
from ntk_core._jax.environment import PrecisionWarning as PrecisionWarning
from ntk_core._jax.environment import UnsupportedBackendError as UnsupportedBackendError
from ntk_core._kernel.function import KernelFunction as KernelFunction
from ntk_core._kernel.options import IMPLEMENTATIONS as IMPLEMENTATIONS
from ntk_core._kernel.options import PRECISIONS as PRECISIONS
from ntk_core._monte_carlo.kernels import monte_carlo_kernels as monte_carlo_kernels
from ntk_core._version import __version__ as __version__

__all__ = (
    "IMPLEMENTATIONS", "PRECISIONS", "BackendWarning", "DoctorReport", "EstimateRecord",
    "KernelFunction", "KernelRecord", "KernelTracker", "NTKSketch", "NonFiniteError",
    "PrecisionWarning",
    "UnsupportedBackendError", "__version__", "clear_caches", "doctor", "empirical_nngp",
    "empirical_ntk", "empirical_ntk_per_leaf", "empirical_ntk_sketch", "empirical_pntk",
    "infinite_kernel_fn", "linearize", "metrics", "monte_carlo_kernels", "nngp_fn", "ntk_fn",
    "ntk_per_leaf_fn", "ntk_sketch_fn", "ntk_vp_fn", "plan", "pntk_fn", "predict", "spectrum",
    "taylor_expand",
)  # fmt: skip


def __getattr__(name: str):
    """``ntk_core.spectrum`` is imported when first used (PEP 562): scipy is slow to import."""
    if name == "spectrum":
        import importlib

        return importlib.import_module("ntk_core.spectrum")
    raise AttributeError(f"module 'ntk_core' has no attribute {name!r}")
