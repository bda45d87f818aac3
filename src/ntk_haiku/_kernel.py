"""Empirical NTK / NNGP of Haiku models (``hk.Transformed``, ``hk.TransformedWithState``).

The adapter turns a transformed function into a pure ``apply3(params, x, aux)`` with
``aux = (state, rng)`` held fixed (the state the model returns is discarded), then
hands it to ``ntk_core``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import haiku as hk
import jax

from ntk_core._adapter import BuildCache, check_apply_kwargs, freeze, kernel_function
from ntk_core._checks import missing_model_argument


def _model_apply(transformed, apply_kwargs):
    with_state = isinstance(transformed, hk.TransformedWithState)
    takes_rng = "rng" in inspect.signature(transformed.apply).parameters

    def apply3(params, x, aux):
        state, rng = aux
        args = [params]
        if with_state:
            args.append(state)
        if takes_rng:
            args.append(rng)
        out = transformed.apply(*args, x, **apply_kwargs)
        return out[0] if with_state else out

    return apply3, with_state, takes_rng


def _make(fn_name, kind, transformed, apply_kwargs, options):
    if not isinstance(transformed, (hk.Transformed, hk.TransformedWithState)):
        raise TypeError(
            f"{fn_name}: expected an hk.Transformed or hk.TransformedWithState (the result of "
            f"hk.transform / hk.transform_with_state), got {type(transformed).__name__}. "
            f"Fix: wrap your forward function with hk.transform(f)."
        )
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, "{'is_training': False}")
    apply3, with_state, takes_rng = _model_apply(transformed, apply_kwargs)

    def check(params, x1, x2, aux):
        try:
            jax.eval_shape(lambda p, x, a: apply3(p, x, a), params, x1, aux)
        except ValueError as e:
            if "PRNGKey" not in str(e):
                raise ValueError(
                    f"{fn_name}: applying the model to x1 failed: {e}. Fix: check that params "
                    f"come from this model's init and that x1 has the shape it expects, batch "
                    f"axis first (x1[None] for a single sample)."
                ) from e
            raise ValueError(
                f"{fn_name}: the model needs a random key (e.g. dropout) but rng=None. Fix: "
                f"pass rng=jax.random.PRNGKey(0) (the same key for every sample), or make the "
                f"model deterministic."
            ) from None
        except Exception as e:
            raise ValueError(
                f"{fn_name}: applying the model to x1 failed with {type(e).__name__}: {e}. "
                f"Fix: check that params come from this model's init and that x1 has the "
                f"shape it expects, batch axis first (x1[None] for a single sample)."
                f"{missing_model_argument(e)}"
            ) from e

    kernel = kernel_function(
        fn_name, kind, apply3, options, check, hint="apply_kwargs={'is_training': False}"
    )

    def call(params, x1, x2=None, *, state=None, rng=None):
        if with_state and state is None:
            raise ValueError(
                f"{fn_name}: this hk.TransformedWithState needs its state. Fix: pass "
                f"state=state, the second value returned by transformed.init(key, x)."
            )
        if not with_state and state is not None:
            raise ValueError(
                f"{fn_name}: state was given but the model is a plain hk.Transformed without "
                f"state. Fix: drop state=, or use hk.transform_with_state."
            )
        if rng is not None and not takes_rng:
            raise ValueError(
                f"{fn_name}: rng was given but the model was built with hk.without_apply_rng "
                f"and takes none. Fix: drop rng=."
            )
        if not isinstance(params, Mapping):
            raise TypeError(
                f"{fn_name}: params must be the dict returned by transformed.init, got "
                f"{type(params).__name__}. Fix: pass params = transformed.init(key, x); the "
                f"argument order is (transformed, params, x1, x2)."
            )
        return kernel(params, x1, x2, (state, rng))

    return call


def kernel_fn(transformed, *, apply_kwargs=None, **options) -> Callable:
    """Jitted empirical NTK of a Haiku model, reusable with new params and state.

    Returns ``kernel(params, x1, x2=None, *, state=None, rng=None)``. Only ``params`` is
    differentiated; ``state`` (required for ``hk.TransformedWithState``) and ``rng`` are
    held fixed, and the state the model returns is discarded.

    Args:
      transformed: ``hk.Transformed`` (with or without apply rng) or
        ``hk.TransformedWithState``.
      apply_kwargs: extra keyword arguments of the forward function, e.g.
        ``{"is_training": False}``.
      **options: ``trace_axes``, ``diagonal_axes``, ``vmap_axes``, ``implementation``,
        ``precision`` as in :func:`ntk_core.ntk_fn`, and the blocked engine's
        ``batch_size``, ``store_on_device``, ``progress``, ``memory_budget`` (a Gram
        matrix of any size in tiles; a host ``numpy.ndarray`` by default when batched).

    Returns:
      ``kernel(params, x1, x2=None, *, state=None, rng=None)`` in the layout of
      :func:`ntk_core.empirical_ntk`.

    Raises:
      TypeError: not a transformed function; an unknown option; params not a dict.
      ValueError: missing or unexpected state; rng given to a transform that takes none;
        a model needing an rng without one; a model whose samples interact (BatchNorm
        with ``is_training=True``) with ``vmap_axes=0``; the model failing on x1; and
        every error of :func:`ntk_core.ntk_fn`.

    Cost: as :func:`ntk_core.ntk_fn`, plus, once per input shape, two small forward
    passes that check per-sample independence.
    """
    return _make("ntk_haiku.kernel_fn", "ntk", transformed, apply_kwargs, options)


def nngp_fn(transformed, *, apply_kwargs=None, **options) -> Callable:
    """Jitted empirical NNGP of a Haiku model; see :func:`kernel_fn`.

    Options: ``trace_axes``, ``diagonal_axes``, ``vmap_axes``, ``precision``,
    ``batch_size``, ``store_on_device``, ``progress``, ``memory_budget``.
    """
    return _make("ntk_haiku.nngp_fn", "nngp", transformed, apply_kwargs, options)


def kernel(transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options):
    """Empirical NTK of a Haiku model between x1 and x2 (x1 if None).

    Θ(x1, x2)[i, j, a, b] = Σ_p ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p, in the layout of
    :func:`ntk_core.empirical_ntk` (``(N1, N2)`` for ``(N, O)`` outputs by default,
    traced axes averaged).

    Args:
      transformed: ``hk.Transformed`` or ``hk.TransformedWithState``.
      params: the params returned by ``transformed.init``.
      x1: array or pytree of arrays, batch axis 0 of size N1.
      x2: ``None`` (x2 is x1) or like x1 with N2 samples.
      state: the state of an ``hk.TransformedWithState`` (required there).
      rng: a PRNG key for models that need one, the same for every sample.
      apply_kwargs, **options: see :func:`kernel_fn`.

    Returns:
      The kernel, float32 by default.

    Raises:
      See :func:`kernel_fn`.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import ntk_haiku
      >>> net = hk.transform(lambda x: hk.Linear(3)(x))
      >>> x = jnp.ones((4, 2))
      >>> ntk_haiku.kernel(net, net.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)

    References:
      Novak, Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel",
      ICML 2022.
    """
    fn = _cached("ntk_haiku.kernel", "ntk", transformed, apply_kwargs, options)
    return fn(params, x1, x2, state=state, rng=rng)


def nngp(transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options):
    """Empirical NNGP kernel f(x1)·f(x2) of a Haiku model; see :func:`kernel`.

    Options: ``trace_axes``, ``diagonal_axes``, ``vmap_axes``, ``precision``,
    ``batch_size``, ``store_on_device``, ``progress``, ``memory_budget``.
    """
    fn = _cached("ntk_haiku.nngp", "nngp", transformed, apply_kwargs, options)
    return fn(params, x1, x2, state=state, rng=rng)


_CACHE = BuildCache()


def _cached(fn_name, kind, transformed, apply_kwargs, options):
    """Reuses the compiled kernel function of an equal earlier call."""
    key = (fn_name, transformed, freeze(apply_kwargs or {}), freeze(options))
    return _CACHE.get(key, lambda: _make(fn_name, kind, transformed, apply_kwargs, options))
