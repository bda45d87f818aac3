"""Infinite-width NNGP and NTK kernels (the closed forms neural-tangents' ``stax`` computes).

The maths, one module per idea: ``state`` (the kernel state carried through a network:
Σ, Θ and each input's own covariance), ``closed_forms`` (E[φ(u)φ(v)] and E[φ'(u)φ'(v)]
of each nonlinearity, and Gauss–Hermite quadrature for any other), ``affine`` (Dense,
Conv), ``windows`` (sliding-window sums), ``spatial`` (pools, Flatten, LayerNorm,
Dropout), ``attention`` (GlobalSelfAttention), ``layer`` (the layer triple and its
combinators), ``layers`` (the public layers), ``kernel_fn`` (the public kernel function:
checks, jit per shape, the blocked engine). The public face is :mod:`ntk_core.stax`.
"""

from ntk_core._infinite import kernel_fn as _kernel_fn  # noqa: E402, F401 (registers the call)
