"""Monte Carlo NNGP and NTK of Haiku models (initialised with ``transformed.init``)."""

from __future__ import annotations

import haiku as hk
import jax

from ntk_core.adapters import check_monte_carlo, checked_arguments, checked_init, monte_carlo_mean
from ntk_core.predict import Kernels

from ._kernel import caller, check_transformed, make

#: :func:`monte_carlo_kernels` as its messages name it.
_CALLER = caller("monte_carlo_kernels", monte_carlo=True)
_OWN = ("key", "n_samples", "batch_size_samples", "rng", "apply_kwargs", "init_kwargs")


@checked_arguments("ntk_haiku.monte_carlo_kernels")
def monte_carlo_kernels(
    transformed,
    x1,
    x2=None,
    *,
    key,
    n_samples: int,
    batch_size_samples: int = 1,
    rng=None,
    apply_kwargs=None,
    init_kwargs=None,
    progress: bool | None = None,
    **options,
) -> Kernels:
    """Monte Carlo NNGP and NTK of a Haiku model over random initialisations.

    The average over S = ``n_samples`` initialisations ``transformed.init(k_s, x1[:1])``,
    k_s = ``jax.random.split(key, S)[s]``, of the empirical NNGP and NTK of
    :func:`ntk_haiku.nngp` and :func:`ntk_haiku.kernel`. An ``hk.TransformedWithState``
    initialises on all of x1, ``transformed.init(k_s, x1)``, and each initialisation's
    state is held fixed: state built from data, such as ``hk.BatchNorm``'s moving
    averages after an ``is_training=True`` init, then holds x1's statistics (from one
    sample its variance would be 0, and evaluation would divide by √eps). See
    :func:`ntk_core.monte_carlo_kernels` for the maths.

    Args:
      transformed: ``hk.Transformed`` or ``hk.TransformedWithState``.
      x1: array or pytree of arrays, batch axis 0 of size N1.
      x2: ``None`` (x2 is x1) or like x1 with N2 samples.
      key: one PRNG key.
      n_samples: S >= 1.
      batch_size_samples: samples computed together (vmapped over their keys), default 1.
      rng: a PRNG key for models that need one at apply time (the same for every
        sample), as in :func:`ntk_haiku.kernel`.
      apply_kwargs: keyword arguments of the forward function (also given to ``init``
        unless ``init_kwargs`` is given).
      init_kwargs: keyword arguments for ``transformed.init`` instead of
        ``apply_kwargs``, e.g. ``{"is_training": True}`` for ``hk.BatchNorm``, which
        initialises only in training mode, with ``apply_kwargs={"is_training": False}``.
      progress, **options: as :func:`ntk_core.monte_carlo_kernels` (the kernel options
        of :func:`ntk_core.ntk_fn`, ``batch_size`` only with ``batch_size_samples=1``;
        ``out="mc.npy"``, ``resume``, ``overwrite``: the means on disk, resumable).

    Returns:
      ``ntk_core.predict.Kernels(nngp, ntk)``, each ``(N1, N2)`` for ``(N, O)`` outputs
      by default; with ``out``, read-only memory maps of the files.

    Raises:
      TypeError, ValueError: as :func:`ntk_haiku.kernel_fn` and
        :func:`ntk_core.monte_carlo_kernels`.

    Cost: S calls of ``transformed.init``, :func:`ntk_haiku.kernel` and
    :func:`ntk_haiku.nngp` (one compilation each).

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import ntk_haiku
      >>> net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x)))
      >>> x = jnp.ones((4, 2))                                            # (N1, 2)
      >>> k = ntk_haiku.monte_carlo_kernels(net, x, key=jax.random.PRNGKey(0), n_samples=4)
      >>> k.ntk.shape
      (4, 4)

    References:
      Novak et al., "Bayesian Deep Convolutional Networks with Many Channels are
      Gaussian Processes", ICLR 2019.
    """
    fn = _CALLER.name
    check_transformed(fn, transformed)
    init_kwargs = check_monte_carlo(
        _CALLER, x1, x2, key, n_samples, batch_size_samples, options, _OWN, init_kwargs
    )
    with_state = isinstance(transformed, hk.TransformedWithState)
    x_init = x1 if with_state else jax.tree.map(lambda a: a[:1], x1)  # state from all of x1
    init_kwargs = dict(apply_kwargs or {}) if init_kwargs is None else init_kwargs

    init = checked_init(
        fn,
        jax.jit(lambda k: transformed.init(k, x_init, **init_kwargs)),
        "transformed.init(key, x1)" if with_state else "transformed.init(key, x1[:1])",
        "the forward function, traced under jax.jit",
        "check that x1 has the per-sample shape the model expects (batch axis first); a "
        "model that initialises only in training mode (hk.BatchNorm) needs "
        "init_kwargs={'is_training': True} with apply_kwargs={'is_training': False}",
    )

    def kernels(kind, kind_options):  # of one initialisation, init(k); errors name fn
        built = make(_CALLER, kind, transformed, kind_options, apply_kwargs)

        def of(out, x1, x2):
            params, state = out if with_state else (out, None)
            return built(params, x1, x2, state=state, rng=rng)

        return of

    mean = monte_carlo_mean
    return mean(fn, init, kernels, x1, x2, key, n_samples, batch_size_samples, progress, options)
