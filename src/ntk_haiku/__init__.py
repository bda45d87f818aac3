"""ntk_haiku: empirical NTK and NNGP kernels of Haiku models via ``ntk_core``."""

from ntk_core.testing import params_from_flax as params_from_flax
from ntk_haiku._infinite import infinite_kernel_fn as infinite_kernel_fn
from ntk_haiku._kernel import kernel as kernel
from ntk_haiku._kernel import kernel_fn as kernel_fn
from ntk_haiku._kernel import kernel_per_leaf as kernel_per_leaf
from ntk_haiku._kernel import kernel_per_leaf_fn as kernel_per_leaf_fn
from ntk_haiku._kernel import nngp as nngp
from ntk_haiku._kernel import nngp_fn as nngp_fn
from ntk_haiku._kernel import plan as plan
from ntk_haiku._kernel import pntk as pntk
from ntk_haiku._kernel import pntk_fn as pntk_fn
from ntk_haiku._linearize import linearize as linearize
from ntk_haiku._linearize import taylor_expand as taylor_expand
from ntk_haiku._models import lenet as lenet
from ntk_haiku._monte_carlo import monte_carlo_kernels as monte_carlo_kernels
from ntk_haiku._sketch import ntk_sketch as ntk_sketch
from ntk_haiku._sketch import ntk_sketch_fn as ntk_sketch_fn
from ntk_haiku._statistics import ntk_effective_rank as ntk_effective_rank
from ntk_haiku._statistics import ntk_frobenius_sq as ntk_frobenius_sq
from ntk_haiku._statistics import ntk_kernel_alignment as ntk_kernel_alignment
from ntk_haiku._statistics import ntk_trace as ntk_trace

# fmt: off
__all__ = (
    "infinite_kernel_fn",
    "kernel", "kernel_fn", "kernel_per_leaf", "kernel_per_leaf_fn", "lenet", "linearize",
    "monte_carlo_kernels", "nngp", "nngp_fn", "ntk_effective_rank", "ntk_frobenius_sq",
    "ntk_kernel_alignment", "ntk_sketch", "ntk_sketch_fn", "ntk_trace", "params_from_flax", "plan",
    "pntk", "pntk_fn", "taylor_expand",
)
# fmt: on
