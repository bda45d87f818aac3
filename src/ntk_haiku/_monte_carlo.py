"""Monte Carlo NNGP and NTK of Haiku models (initialised with ``transformed.init``)."""

from __future__ import annotations

from inspect import signature

import haiku as hk
import jax

from ntk_core.adapters import cached, check_monte_carlo, checked_init, keyed, monte_carlo_mean
from ntk_core.adapters import check_inputs_option as check_inputs
from ntk_core.adapters import spread_inputs as spread
from ntk_core.predict import Kernels

from ._kernel import caller, check_transformed, make, public


@public
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
    inputs: str = "x",
    progress: bool | None = None,
    **options,
) -> Kernels:
    """Monte Carlo NNGP and NTK of a Haiku model: their means over S = ``n_samples``
    initialisations ``transformed.init(k_s, x1[:1])``, k_s = ``jax.random.split(key, S)[s]``
    (maths: :func:`ntk_core.monte_carlo_kernels`). An ``hk.TransformedWithState``
    initialises on all of x1 and holds each initialisation's state fixed (BatchNorm's
    moving averages then hold x1's statistics, not one sample's zero variance).

    Args:
      transformed: ``hk.Transformed`` or ``hk.TransformedWithState``.
      x1, x2, key, n_samples, batch_size_samples, progress, **options: as
        :func:`ntk_core.monte_carlo_kernels` (x1: N1 samples, x2: N2 or ``None``).
      rng, apply_kwargs, inputs: as :func:`ntk_haiku.kernel`; ``apply_kwargs`` also go to
        ``init`` unless ``init_kwargs`` is given (e.g. ``{"is_training": True}`` for
        ``hk.BatchNorm``, which initialises only in training mode).
    Returns:
      ``ntk_core.predict.Kernels(nngp, ntk)``, each ``(N1, N2)`` for ``(N, O)`` outputs
      by default; with ``out``, read-only memory maps of the files.
    Raises:
      TypeError, ValueError: as :func:`ntk_haiku.kernel_fn` and
        :func:`ntk_core.monte_carlo_kernels`.
    Cost: S calls of ``transformed.init``, :func:`ntk_haiku.kernel` and
    :func:`ntk_haiku.nngp` (one compilation each).
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x)))
      >>> x, key = jnp.ones((4, 2)), jax.random.PRNGKey(0)
      >>> k = ntk_haiku.monte_carlo_kernels(net, x, key=key, n_samples=4)
      >>> k.ntk.shape
      (4, 4)

    References: Novak et al., ICLR 2019, as :func:`ntk_core.monte_carlo_kernels`.
    """
    fn = _CALLER.name
    check_transformed(fn, transformed)
    init_kwargs = check_monte_carlo(
        _CALLER, x1, x2, key, n_samples, batch_size_samples, options, _OWN, init_kwargs
    )
    with_state = isinstance(transformed, hk.TransformedWithState)
    x_init = x1 if with_state else jax.tree.map(lambda a: a[:1], x1)  # state from all of x1
    x_init, kw = spread(fn, check_inputs(fn, inputs), x_init)  # TypeError: x1 of another kind
    init_kwargs = dict(apply_kwargs or {}) if init_kwargs is None else init_kwargs

    def initialise(k, x_init, kw):  # x an argument: one program for every call (issue 48)
        return transformed.init(k, *x_init, **kw, **init_kwargs)

    initialise = keyed(initialise, "haiku init", transformed, init_kwargs)
    jitted = cached((fn, initialise), lambda: jax.jit(initialise))
    init = lambda k: jitted(k, x_init, kw)  # noqa: E731
    call = f"transformed.init(key, x1{'' if with_state else '[:1]'})"
    fix = "check x1's per-sample shape; hk.BatchNorm needs init_kwargs={'is_training': True}"
    init = checked_init(fn, init, call, "the forward function", fix)

    def kernels(kind, kind_options):  # of one initialisation, init(k); errors name fn
        built = make(_CALLER, kind, transformed, dict(kind_options, inputs=inputs), apply_kwargs)

        def of(out, x1, x2):
            params, state = out if with_state else (out, None)
            return built(params, x1, x2, state=state, rng=rng)

        return of

    args = (x1, x2, key, n_samples, batch_size_samples, progress, options)
    return monte_carlo_mean(fn, init, kernels, *args)


#: :func:`monte_carlo_kernels` as its messages name it, and its own keyword arguments.
_CALLER = caller(monte_carlo_kernels, monte_carlo=True)
_OWN = [n for n, p in signature(monte_carlo_kernels).parameters.items() if p.kind is p.KEYWORD_ONLY]
