"""NTK spectra without forming the kernel: ARPACK top-k eigenpairs on NTK-vector products or
a stored kernel read in row chunks, the trace at O(N) cost, condition number."""

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
from ntk_core._analysis.spectrum import ntk_trace as ntk_trace

__all__ = ("SEED", "WHICH", "Eigenpairs", "NoConvergence", "condition_number", "effective_rank",
    "kernel_eigsh", "kernel_operator", "ntk_eigsh", "ntk_operator", "ntk_trace")  # fmt: skip
