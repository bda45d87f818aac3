"""Infinite-width NNGP and NTK kernels of networks written with neural-tangents' ``stax``
names, arguments and layout: ``from neural_tangents import stax`` becomes ``from
ntk_core import stax``.

Each layer is a triple ``(init_fn, apply_fn, kernel_fn)``: ``init_fn(key, input_shape) ->
(output_shape, params)`` and ``apply_fn(params, x, mask_constant=None)`` are the finite
network (its empirical kernels: :func:`ntk_core.empirical_ntk`; Monte Carlo:
:func:`ntk_core.monte_carlo_kernels`), ``kernel_fn(x1, x2=None, get=None, **options)``
its kernels as every hidden width grows
without bound. See ``docs/infinite-width.md`` for the definitions, shapes, costs and
sources of each layer.
"""

from ntk_core._infinite.attention import GlobalSelfAttention as GlobalSelfAttention
from ntk_core._infinite.layer import FanInConcat as FanInConcat
from ntk_core._infinite.layer import FanInSum as FanInSum
from ntk_core._infinite.layer import FanOut as FanOut
from ntk_core._infinite.layer import Identity as Identity
from ntk_core._infinite.layer import Layer as Layer
from ntk_core._infinite.layer import parallel as parallel
from ntk_core._infinite.layer import repeat as repeat
from ntk_core._infinite.layer import serial as serial
from ntk_core._infinite.layers import ABRelu as ABRelu
from ntk_core._infinite.layers import Abs as Abs
from ntk_core._infinite.layers import AvgPool as AvgPool
from ntk_core._infinite.layers import Conv as Conv
from ntk_core._infinite.layers import Cos as Cos
from ntk_core._infinite.layers import Dense as Dense
from ntk_core._infinite.layers import Dropout as Dropout
from ntk_core._infinite.layers import Elementwise as Elementwise
from ntk_core._infinite.layers import ElementwiseNumerical as ElementwiseNumerical
from ntk_core._infinite.layers import Erf as Erf
from ntk_core._infinite.layers import Exp as Exp
from ntk_core._infinite.layers import Flatten as Flatten
from ntk_core._infinite.layers import Gelu as Gelu
from ntk_core._infinite.layers import GlobalAvgPool as GlobalAvgPool
from ntk_core._infinite.layers import GlobalSumPool as GlobalSumPool
from ntk_core._infinite.layers import LayerNorm as LayerNorm
from ntk_core._infinite.layers import LeakyRelu as LeakyRelu
from ntk_core._infinite.layers import Rbf as Rbf
from ntk_core._infinite.layers import Relu as Relu
from ntk_core._infinite.layers import Sigmoid_like as Sigmoid_like
from ntk_core._infinite.layers import Sign as Sign
from ntk_core._infinite.layers import Sin as Sin
from ntk_core._infinite.layers import SumPool as SumPool

__all__ = (
    "ABRelu", "Abs", "AvgPool", "Conv", "Cos", "Dense", "Dropout", "Elementwise",
    "ElementwiseNumerical", "Erf", "Exp", "FanInConcat", "FanInSum", "FanOut", "Flatten",
    "Gelu", "GlobalAvgPool", "GlobalSelfAttention", "GlobalSumPool", "Identity", "Layer",
    "LayerNorm", "LeakyRelu",
    "Rbf", "Relu", "Sigmoid_like", "Sign", "Sin", "SumPool", "parallel", "repeat", "serial",
)  # fmt: skip
