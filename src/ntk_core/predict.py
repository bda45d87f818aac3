"""Predictions from kernels: GP inference, NTK ensembles, gradient-descent MSE dynamics.

``gp_inference`` and ``gradient_descent_mse`` follow neural-tangents 0.6's formulas,
regulariser and output layout; the linear algebra runs on the host (numpy/LAPACK) with
refined solves that never return a silent NaN.
"""

from ntk_core._predict.inference import DegenerateKernelWarning as DegenerateKernelWarning
from ntk_core._predict.inference import Gaussian as Gaussian
from ntk_core._predict.inference import GPInference as GPInference
from ntk_core._predict.inference import GradientDescentMSE as GradientDescentMSE
from ntk_core._predict.inference import Kernels as Kernels
from ntk_core._predict.inference import Outputs as Outputs
from ntk_core._predict.inference import gp_inference as gp_inference
from ntk_core._predict.inference import gradient_descent_mse as gradient_descent_mse

__all__ = (
    "DegenerateKernelWarning",
    "GPInference",
    "Gaussian",
    "GradientDescentMSE",
    "Kernels",
    "Outputs",
    "gp_inference",
    "gradient_descent_mse",
)
