"""Kernel comparisons: kernel distance, kernel-target alignment (plain and centred),
effective rank.

Each takes kernels in ntk_core's layout, ``(N, N)`` or ``(N, N, O, O)`` (numpy, jax
or read-only memory-mapped ``.npy``), computes in float64 on the host and returns a
Python float.
"""

from ntk_core._analysis.metrics import centered_kernel_alignment as centered_kernel_alignment
from ntk_core._analysis.metrics import effective_rank as effective_rank
from ntk_core._analysis.metrics import kernel_alignment as kernel_alignment
from ntk_core._analysis.metrics import kernel_distance as kernel_distance

__all__ = (
    "centered_kernel_alignment",
    "effective_rank",
    "kernel_alignment",
    "kernel_distance",
)
