"""NTK spectra without forming the kernel: ARPACK top-k eigenpairs on NTK-vector products or
a stored kernel read in row chunks, condition number; and statistics of the spectrum from
the model, never forming the kernel: the exact trace at O(N) cost, ‖Θ‖²_F, effective rank
and kernel-target alignment as Hutch++ / Lanczos estimates with a standard error."""

from ntk_core._analysis.matrix_free import Estimate as Estimate
from ntk_core._analysis.matrix_free import ntk_effective_rank as ntk_effective_rank
from ntk_core._analysis.matrix_free import ntk_frobenius_sq as ntk_frobenius_sq
from ntk_core._analysis.matrix_free import ntk_kernel_alignment as ntk_kernel_alignment
from ntk_core._analysis.matrix_free import ntk_trace as ntk_trace
from ntk_core._analysis.metrics import effective_rank as effective_rank
from ntk_core._analysis.spectrum import SEED as SEED
from ntk_core._analysis.spectrum import WHICH as WHICH
from ntk_core._analysis.spectrum import Eigenpairs as Eigenpairs
from ntk_core._analysis.spectrum import NoConvergence as NoConvergence
from ntk_core._analysis.spectrum import condition_number as condition_number
from ntk_core._analysis.spectrum import kernel_eigsh as kernel_eigsh
from ntk_core._analysis.spectrum import kernel_operator as kernel_operator
from ntk_core._analysis.spectrum import ntk_eigsh as ntk_eigsh
from ntk_core._analysis.spectrum import ntk_operator as ntk_operator

__all__ = ("SEED", "WHICH", "Eigenpairs", "Estimate", "NoConvergence", "condition_number",
    "effective_rank", "kernel_eigsh", "kernel_operator", "ntk_effective_rank", "ntk_eigsh",
    "ntk_frobenius_sq", "ntk_kernel_alignment", "ntk_operator", "ntk_trace")  # fmt: skip
