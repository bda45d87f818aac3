"""Predictions from kernels: GP inference, NTK ensembles, gradient-descent MSE dynamics
(neural-tangents 0.6's formulas; host linear algebra with refined solves, no silent NaN)."""

from ntk_core._predict.ensemble import GradientDescentMSEEnsemble as GradientDescentMSEEnsemble
from ntk_core._predict.ensemble import (
    gradient_descent_mse_ensemble as gradient_descent_mse_ensemble,
)
from ntk_core._predict.inference import DegenerateKernelWarning as DegenerateKernelWarning
from ntk_core._predict.inference import Gaussian as Gaussian
from ntk_core._predict.inference import GPInference as GPInference
from ntk_core._predict.inference import GradientDescentMSE as GradientDescentMSE
from ntk_core._predict.inference import Kernels as Kernels
from ntk_core._predict.inference import Outputs as Outputs
from ntk_core._predict.inference import gp_inference as gp_inference
from ntk_core._predict.inference import gradient_descent_mse as gradient_descent_mse
from ntk_core._predict.low_rank import LowRankInference as LowRankInference
from ntk_core._predict.low_rank import low_rank_inference as low_rank_inference

__all__ = ("DegenerateKernelWarning", "GPInference", "Gaussian", "GradientDescentMSE",
    "GradientDescentMSEEnsemble", "Kernels", "LowRankInference", "Outputs", "gp_inference",
    "gradient_descent_mse", "gradient_descent_mse_ensemble", "low_rank_inference")  # fmt: skip
