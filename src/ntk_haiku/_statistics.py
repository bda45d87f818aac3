"""Matrix-free statistics of Θ(x, x) of Haiku models: the core's :mod:`ntk_core.spectrum`
ones through ``ntk_core.adapters.matrix_free``, on the kernel function
:func:`ntk_haiku.kernel` would use (so ``wrt=`` takes Haiku module names)."""

from __future__ import annotations

from ntk_core.adapters import Caller, cached, matrix_free
from ntk_haiku._kernel import _PACKAGE, make, public

_ORDER = "(transformed, params, x)"


def _statistic(fn, transformed, params, x, state, rng, apply_kwargs, options, **arguments):
    """``fn``'s statistic of the model's Θ(x, x), its kernel function cached per model, options."""
    name = fn.__name__
    caller = Caller(f"{_PACKAGE}.{name}", _ORDER, "the model", package=_PACKAGE)

    def build():
        return make(caller, "ntk", transformed, options, apply_kwargs)

    kernel = cached((name, transformed, apply_kwargs, options), build)
    return matrix_free(name, kernel, params, x, dict(state=state, rng=rng), **arguments)


@public
def ntk_trace(transformed, params, x, *, state=None, rng=None, apply_kwargs=None, **options):
    """tr Θ(x, x) = Σ_i Σ_a ‖∂f_a(x_i)/∂θ‖² of a Haiku model, exact, O(N), a Python float.

    Args: ``transformed``, ``params``, ``state``, ``rng``, ``apply_kwargs``, ``inputs`` as
    :func:`ntk_haiku.kernel` (``x``: N samples on axis 0); ``**options``: ``wrt`` (the
    trace of the subset's kernel), ``batch_size``, ``implementation``, ``precision``.
    Returns: a float (float64 sum). Raises: as :func:`ntk_haiku.kernel_fn`; TypeError for
    other kernel options. Cost: see :func:`ntk_core.spectrum.ntk_trace`.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.eye(2)
      >>> ntk_haiku.ntk_trace(net, net.init(jax.random.PRNGKey(0), x), x)  # (‖x_i‖² + 1)·O
      12.0

    References: Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018.
    """
    return _statistic(ntk_trace, transformed, params, x, state, rng, apply_kwargs, options)


@public
def ntk_frobenius_sq(
    transformed, params, x, *, key, m=None, state=None, rng=None, apply_kwargs=None, **options
):
    """‖Θ‖²_F of Θ(x, x) of a Haiku model by Hutch++ on NTK-vector products, unbiased, with
    its standard error (:func:`ntk_core.spectrum.ntk_frobenius_sq`: definition, variance).

    Args: as :func:`ntk_trace`; ``key`` a JAX PRNG key; ``m`` products (default 60);
    ``**options``: ``wrt``, ``batch_size`` (VJPs in batches), ``precision``.
    Returns: an ``Estimate(estimate, standard_error, products)``. Raises: as
    :func:`ntk_trace`, and the core's for ``key`` and ``m``. Cost: m NTK-vector products.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.eye(2)
      >>> r = ntk_haiku.ntk_frobenius_sq(net, net.init(jax.random.PRNGKey(0), x), x,
      ...                                key=jax.random.PRNGKey(1))  # M = 6 <= m: exact
      >>> round(r.estimate, 3), r.standard_error                   # Θ = (x xᵀ + 1) ⊗ I_3
      (30.0, 0.0)

    References: Meyer, Musco, Musco, Woodruff, "Hutch++", SOSA 2021.
    """
    args = (transformed, params, x, state, rng, apply_kwargs, options)
    return _statistic(ntk_frobenius_sq, *args, key=key, m=m)


@public
def ntk_effective_rank(
    transformed, params, x, *, key, m=None, steps=None, state=None, rng=None, apply_kwargs=None,
    **options,
):  # fmt: skip
    """The effective rank exp(H) of Θ(x, x) of a Haiku model, estimated by stochastic Lanczos
    quadrature with its standard error (:func:`ntk_core.spectrum.ntk_effective_rank`).

    Args: as :func:`ntk_frobenius_sq`; ``m`` products (default 400), ``steps`` Lanczos steps
    (default 15). Returns: an ``Estimate``. Raises: as :func:`ntk_frobenius_sq`. Cost: m
    products and the exact trace. Example:
    ``ntk_haiku.ntk_effective_rank(net, params, x, key=key).estimate``.
    References: Ubaru, Chen, Saad, SIAM J. Matrix Anal. Appl. 2017; Roy, Vetterli 2007.
    """
    args = (transformed, params, x, state, rng, apply_kwargs, options)
    return _statistic(ntk_effective_rank, *args, key=key, m=m, steps=steps)


@public
def ntk_kernel_alignment(
    transformed, params, x, y, *, key, m=None, state=None, rng=None, apply_kwargs=None, **options
):
    """Kernel-target alignment ⟨y, Θ y⟩ / (‖Θ‖_F ‖y‖²) of Θ(x, x) of a Haiku model,
    estimated with its standard error (:func:`ntk_core.spectrum.ntk_kernel_alignment`).

    Args: as :func:`ntk_frobenius_sq`; ``y`` targets shaped like the outputs ``(N, O)``;
    ``m`` products (default 60). Returns: an ``Estimate``. Raises: as
    :func:`ntk_frobenius_sq`; y of the wrong shape. Cost: m products. Example:
    ``ntk_haiku.ntk_kernel_alignment(net, params, x, y, key=key).estimate``.
    References: Cristianini et al., NIPS 2001; Meyer et al., SOSA 2021.
    """
    args = (transformed, params, x, state, rng, apply_kwargs, options)
    return _statistic(ntk_kernel_alignment, *args, key=key, m=m, y=y)
