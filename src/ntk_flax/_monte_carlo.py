"""Monte Carlo NNGP and NTK of ``flax.linen`` models (initialised with ``model.init``)."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax

from ntk_core._monte_carlo import average
from ntk_core._predict import Kernels

from ._kernel import _make


def monte_carlo_kernels(
    model: nn.Module,
    x1,
    x2=None,
    *,
    key,
    n_samples: int,
    batch_size_samples: int = 1,
    method: str | Callable | None = None,
    apply_kwargs=None,
    progress: bool | None = None,
    **options,
) -> Kernels:
    """Monte Carlo NNGP and NTK of a ``flax.linen`` model over random initialisations.

    The average over S = ``n_samples`` initialisations ``model.init(k_s, x1[:1])``,
    k_s = ``jax.random.split(key, S)[s]``, of the empirical NNGP and NTK of
    :func:`ntk_flax.nngp` and :func:`ntk_flax.kernel` (only ``params`` differentiated;
    other collections of each initialisation held fixed). The parameterisation is the
    model's own: with ``nn.Dense(kernel_init=normal(σ_w / √fan_in))`` it is the
    standard parameterisation, whose kernels grow with the width unlike the NTK
    parameterisation's. See :func:`ntk_core.monte_carlo_kernels` for the maths.

    Args:
      model: a ``flax.linen.Module``.
      x1: array or pytree of arrays, batch axis 0 of size N1 (its first sample is the
        ``model.init`` input).
      x2: ``None`` (x2 is x1) or like x1 with N2 samples.
      key: one PRNG key.
      n_samples: S >= 1.
      batch_size_samples: samples computed together (vmapped over their keys), default 1.
      method, apply_kwargs: as :func:`ntk_flax.kernel_fn` (``apply_kwargs`` is also
        passed to ``model.init``).
      progress: tqdm bar over the samples (``None``: in a terminal only).
      **options: ``trace_axes``, ``diagonal_axes``, ``vmap_axes``, ``implementation``,
        ``precision`` as in :func:`ntk_core.ntk_fn` (the NNGP ignores
        ``implementation``).

    Returns:
      ``ntk_core.predict.Kernels(nngp, ntk)``, each ``(N1, N2)`` for ``(N, O)`` outputs
      by default (``(N1, N2, O, O)`` with ``trace_axes=()``).

    Raises:
      TypeError, ValueError: as :func:`ntk_flax.kernel_fn` and
        :func:`ntk_core.monte_carlo_kernels`.

    Cost: S calls of ``model.init`` and of :func:`ntk_flax.kernel` and
    :func:`ntk_flax.nngp` (one compilation each).

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import ntk_flax
      >>> x = jnp.ones((4, 2))                                            # (N1, 2)
      >>> k = ntk_flax.monte_carlo_kernels(nn.Dense(3), x, key=jax.random.PRNGKey(0),
      ...                                  n_samples=4)
      >>> k.ntk.shape, k.nngp.shape
      ((4, 4), (4, 4))

    References:
      Novak et al., "Bayesian Deep Convolutional Networks with Many Channels are
      Gaussian Processes", ICLR 2019.
    """
    fn = "ntk_flax.monte_carlo_kernels"
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{fn}: model must be a flax.linen.Module, got {type(model).__name__}. Fix: pass "
            f"the module instance; for init/apply functions use "
            f"ntk_core.monte_carlo_kernels."
        )
    nngp_options = {k: v for k, v in options.items() if k != "implementation"}
    ntk = _make(fn, "ntk", model, method, apply_kwargs, options)  # errors name fn
    nngp = _make(fn, "nngp", model, method, apply_kwargs, nngp_options)
    x_init = jax.tree.map(lambda a: a[:1], x1)
    init_kwargs = dict(apply_kwargs or {})

    init = jax.jit(lambda k: model.init(k, x_init, method=method, **init_kwargs))

    def sample(k):
        variables = init(k)
        return nngp(variables, x1, x2), ntk(variables, x1, x2)

    return average(fn, sample, key, n_samples, batch_size_samples, progress)
