"""Kernel distance, kernel-target alignment (plain, centred), effective rank: float64 on the
host from ``(N, N)`` / ``(N, N, O, O)`` kernels (numpy, jax or memmap), Python floats; and
matrix-free, from the model (``ntk_*``: Hutch++ / Lanczos estimates with a standard error,
never forming the kernel; the exact trace is ``ntk_core.spectrum.ntk_trace``)."""

from ntk_core._analysis.matrix_free import Estimate as Estimate
from ntk_core._analysis.matrix_free import ntk_effective_rank as ntk_effective_rank
from ntk_core._analysis.matrix_free import ntk_frobenius_sq as ntk_frobenius_sq
from ntk_core._analysis.matrix_free import ntk_kernel_alignment as ntk_kernel_alignment
from ntk_core._analysis.metrics import centered_kernel_alignment as centered_kernel_alignment
from ntk_core._analysis.metrics import effective_rank as effective_rank
from ntk_core._analysis.metrics import kernel_alignment as kernel_alignment
from ntk_core._analysis.metrics import kernel_distance as kernel_distance

__all__ = (
    "Estimate", "centered_kernel_alignment", "effective_rank", "kernel_alignment",
    "kernel_distance", "ntk_effective_rank", "ntk_frobenius_sq", "ntk_kernel_alignment",
)  # fmt: skip
