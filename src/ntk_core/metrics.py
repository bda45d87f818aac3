"""Kernel distance, kernel-target alignment (plain, centred), effective rank: float64 on the
host from ``(N, N)`` / ``(N, N, O, O)`` kernels (numpy, jax or memmap), Python floats. Their
estimates from the model without forming the kernel: ``ntk_core.spectrum.ntk_*``."""

from ntk_core._analysis.metrics import centered_kernel_alignment as centered_kernel_alignment
from ntk_core._analysis.metrics import effective_rank as effective_rank
from ntk_core._analysis.metrics import kernel_alignment as kernel_alignment
from ntk_core._analysis.metrics import kernel_distance as kernel_distance

__all__ = ("centered_kernel_alignment", "effective_rank", "kernel_alignment", "kernel_distance")
