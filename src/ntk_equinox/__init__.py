"""ntk_equinox: empirical NTK and NNGP kernels of Equinox models via ``ntk_core``'s
public API."""

from ntk_equinox._kernel import kernel as kernel
from ntk_equinox._kernel import kernel_fn as kernel_fn
from ntk_equinox._kernel import nngp as nngp
from ntk_equinox._kernel import plan as plan
from ntk_equinox._kernel import pntk as pntk
from ntk_equinox._kernel import pntk_fn as pntk_fn

# fmt: off
__all__ = (
    "kernel", "kernel_fn", "nngp", "plan", "pntk", "pntk_fn",
)
# fmt: on
