"""Matrix-free statistics of Θ(x, x) of Equinox models: the core's :mod:`ntk_core.spectrum`
ones through ``ntk_core.adapters.matrix_free``, on the kernel function
:func:`ntk_equinox.kernel` would use (``wrt=`` on the module's attribute paths)."""

from __future__ import annotations

from ntk_core.adapters import checked_arguments, matrix_free
from ntk_equinox._kernel import _PACKAGE, _kernel_fn


def _statistic(fn, model, x, options: dict, **arguments):
    return matrix_free(fn.__name__, _kernel_fn(fn, model, options), model, x, **arguments)


def public(fn):
    """``checked_arguments`` naming ``ntk_equinox.<fn.__name__>``."""
    return checked_arguments(f"{_PACKAGE}.{fn.__name__}")(fn)


@public
def ntk_trace(model, x, **options):
    """tr Θ(x, x) = Σ_i Σ_a ‖∂f_a(x_i)/∂θ‖² of an ``eqx.Module``, exact, O(N), a float.

    Args: ``model``, ``inputs`` as :func:`ntk_equinox.kernel` (``x``: N1 samples on axis 0);
    ``**options``: ``wrt``, ``batch_size``, ``implementation``, ``precision``. Returns: a
    float. Raises: as :func:`ntk_equinox.kernel`; TypeError for other kernel options.
    Cost, References: :func:`ntk_core.spectrum.ntk_trace`.
    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, ntk_equinox
      >>> lin = eqx.nn.Linear(2, 3, key=jax.random.PRNGKey(0))
      >>> ntk_equinox.ntk_trace(lin, jnp.eye(2))                  # (‖x_i‖² + 1)·O
      12.0
    """
    return _statistic(ntk_trace, model, x, options)


@public
def ntk_frobenius_sq(model, x, *, key, m=None, **options):
    """‖Θ‖²_F of Θ(x, x) of an ``eqx.Module`` by Hutch++, unbiased, with its standard error
    (:func:`ntk_core.spectrum.ntk_frobenius_sq`). Args: as :func:`ntk_trace`; ``key`` a
    PRNG key, ``m`` products (default 60); options ``wrt``, ``batch_size``, ``precision``.
    Returns: an ``Estimate`` (Θ of x's N1 samples). Raises: as :func:`ntk_trace`, the core's
    for key and m.
    Cost: m products. Example: ``ntk_equinox.ntk_frobenius_sq(mlp, x, key=key)``.
    References: Meyer et al., "Hutch++", SOSA 2021."""
    return _statistic(ntk_frobenius_sq, model, x, options, key=key, m=m)


@public
def ntk_effective_rank(model, x, *, key, m=None, steps=None, **options):
    """The effective rank of Θ(x, x) of an ``eqx.Module`` by stochastic Lanczos quadrature
    (:func:`ntk_core.spectrum.ntk_effective_rank`). Args: as :func:`ntk_frobenius_sq`, ``m``
    default 400, ``steps`` 15. Returns: an ``Estimate`` (x: N1 samples). Raises: as
    :func:`ntk_trace`. Cost: m products and the trace. Example:
    ``ntk_equinox.ntk_effective_rank(mlp, x, key=key)``. References: Ubaru, Chen, Saad,
    SIAM J. Matrix Anal. Appl. 2017."""
    return _statistic(ntk_effective_rank, model, x, options, key=key, m=m, steps=steps)


@public
def ntk_kernel_alignment(model, x, y, *, key, m=None, **options):
    """Kernel-target alignment of Θ(x, x) of an ``eqx.Module``, estimated
    (:func:`ntk_core.spectrum.ntk_kernel_alignment`). Args: as :func:`ntk_frobenius_sq`, ``y``
    shaped like the outputs ``(N1, O)``. Returns: an ``Estimate``. Raises: as :func:`ntk_trace`; y's
    shape. Cost: m products. Example: ``ntk_equinox.ntk_kernel_alignment(mlp, x, y,
    key=key)``. References: Cristianini et al., NIPS 2001."""
    return _statistic(ntk_kernel_alignment, model, x, options, key=key, m=m, y=y)
