"""Matrix-free statistics of Θ(x, x) of Flax models (linen and nnx): the core's
:mod:`ntk_core.spectrum` ones through ``ntk_core.adapters.matrix_free``, on the kernel
function :func:`ntk_flax.kernel` would use (so ``wrt=`` takes Flax paths and nnx names)."""

from __future__ import annotations

from ntk_core.adapters import Caller, cached, matrix_free
from ntk_flax._kernel import _PACKAGE, make, public

_ORDER = "(model, variables, x)"


def _statistic(fn, model, variables, x, method, apply_kwargs, rngs, options, **arguments):
    """``fn``'s statistic of the model's Θ(x, x), its kernel function cached per model, options."""
    name = fn.__name__
    caller = Caller(f"{_PACKAGE}.{name}", _ORDER, "the model", package=_PACKAGE)

    def build():
        return make(caller, "ntk", model, options, method, apply_kwargs)

    kernel = cached((name, model, method, apply_kwargs, options), build)
    return matrix_free(name, kernel, variables, x, dict(rngs=rngs), **arguments)


@public
def ntk_trace(model, variables, x, *, method=None, apply_kwargs=None, rngs=None, **options):
    """tr Θ(x, x) = Σ_i Σ_a ‖∂f_a(x_i)/∂θ‖² of a Flax model, exact, O(N), a Python float.

    Args: ``model``, ``variables``, ``method``, ``apply_kwargs``, ``rngs``, ``inputs`` as
    :func:`ntk_flax.kernel` (``x``: N samples on axis 0); ``**options``: ``wrt`` (the
    trace of the subset's kernel), ``batch_size``, ``implementation``, ``precision``.
    Returns: a float (float64 sum). Raises: as :func:`ntk_flax.kernel_fn`; TypeError for
    other kernel options. Cost: see :func:`ntk_core.spectrum.ntk_trace`.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.eye(2)
      >>> ntk_flax.ntk_trace(model, model.init(jax.random.PRNGKey(0), x), x)  # (‖x_i‖² + 1)·O
      12.0

    References: Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018.
    """
    return _statistic(ntk_trace, model, variables, x, method, apply_kwargs, rngs, options)


@public
def ntk_frobenius_sq(
    model, variables, x, *, key, m=None, method=None, apply_kwargs=None, rngs=None, **options
):
    """‖Θ‖²_F of Θ(x, x) of a Flax model by Hutch++ on NTK-vector products, unbiased, with
    its standard error (:func:`ntk_core.spectrum.ntk_frobenius_sq`: definition, variance).

    Args: as :func:`ntk_trace`; ``key`` a JAX PRNG key; ``m`` products (default 60);
    ``**options``: ``wrt``, ``batch_size`` (VJPs in batches), ``precision``.
    Returns: an ``Estimate(estimate, standard_error, products)``. Raises: as
    :func:`ntk_trace`, and the core's for ``key`` and ``m``. Cost: m NTK-vector products.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.eye(2)                       # M = 6 <= m: exact
      >>> r = ntk_flax.ntk_frobenius_sq(model, model.init(jax.random.PRNGKey(0), x), x,
      ...                               key=jax.random.PRNGKey(1))
      >>> round(r.estimate, 3), r.standard_error                   # Θ = (x xᵀ + 1) ⊗ I_3
      (30.0, 0.0)

    References: Meyer, Musco, Musco, Woodruff, "Hutch++", SOSA 2021.
    """
    args = (model, variables, x, method, apply_kwargs, rngs, options)
    return _statistic(ntk_frobenius_sq, *args, key=key, m=m)


@public
def ntk_effective_rank(
    model, variables, x, *, key, m=None, steps=None, method=None, apply_kwargs=None, rngs=None,
    **options,
):  # fmt: skip
    """The effective rank exp(H) of Θ(x, x) of a Flax model, estimated by stochastic Lanczos
    quadrature with its standard error (:func:`ntk_core.spectrum.ntk_effective_rank`).

    Args: as :func:`ntk_frobenius_sq`; ``m`` products (default 400), ``steps`` Lanczos steps
    (default 15). Returns: an ``Estimate``. Raises: as :func:`ntk_frobenius_sq`. Cost: m
    products and the exact trace. Example:
    ``ntk_flax.ntk_effective_rank(model, variables, x, key=key).estimate``.
    References: Ubaru, Chen, Saad, SIAM J. Matrix Anal. Appl. 2017; Roy, Vetterli 2007.
    """
    args = (model, variables, x, method, apply_kwargs, rngs, options)
    return _statistic(ntk_effective_rank, *args, key=key, m=m, steps=steps)


@public
def ntk_kernel_alignment(
    model, variables, x, y, *, key, m=None, method=None, apply_kwargs=None, rngs=None, **options
):
    """Kernel-target alignment ⟨y, Θ y⟩ / (‖Θ‖_F ‖y‖²) of Θ(x, x) of a Flax model, estimated
    with its standard error (:func:`ntk_core.spectrum.ntk_kernel_alignment`).

    Args: as :func:`ntk_frobenius_sq`; ``y`` targets shaped like the outputs ``(N, O)``;
    ``m`` products (default 60). Returns: an ``Estimate``. Raises: as
    :func:`ntk_frobenius_sq`; y of the wrong shape. Cost: m products. Example:
    ``ntk_flax.ntk_kernel_alignment(model, variables, x, y, key=key).estimate``.
    References: Cristianini et al., NIPS 2001; Meyer et al., SOSA 2021.
    """
    args = (model, variables, x, method, apply_kwargs, rngs, options)
    return _statistic(ntk_kernel_alignment, *args, key=key, m=m, y=y)
