"""Linearized and Taylor-expanded Haiku models (``hk.Transformed``,
``hk.TransformedWithState``).

Builds the pure apply the kernels use (``_kernel._model_apply``) with ``state`` and
``rng`` held fixed, and hands it to ``ntk_core``'s expansion
(:func:`ntk_core.adapters.expansion`); no maths here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ntk_core.adapters import check_apply_kwargs, check_degree, expansion
from ntk_haiku._kernel import _model_apply, check_state_and_rng, check_transformed


def _expanded(fn_name: str, degree: int, transformed, params0, state, rng, apply_kwargs):
    check_transformed(fn_name, transformed)
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, "{'is_training': False}")
    apply3, with_state, takes_rng = _model_apply(transformed, apply_kwargs)
    call = f"{fn_name}(transformed, params, state=state)"
    check_state_and_rng(fn_name, with_state, takes_rng, state, rng, call)
    if not isinstance(params0, Mapping):
        message = (
            f"{fn_name}: params0 must be the dict returned by transformed.init, got "
            f"{type(params0).__name__}. Fix: pass params0 = transformed.init(key, x)."
        )
        raise TypeError(message)

    def apply(params, x):
        return apply3(params, x, (state, rng))

    return expansion(fn_name, apply, params0, degree)


def linearize(transformed, params0, *, state=None, rng=None, apply_kwargs=None) -> Callable:
    """The linearisation of a Haiku model in its parameters around ``params0``.

    f_lin(θ, x) = f(θ0, x) + J(θ0, x)·(θ − θ0), θ0 = ``params0``; see
    :func:`ntk_core.linearize` (one ``jax.jvp`` per call, no Jacobian). ``state`` (of an
    ``hk.TransformedWithState``, e.g. BatchNorm statistics) and ``rng`` are held fixed at
    the values given here, and the state the model returns is discarded, as the kernels
    do. ``f_lin`` is pure: use it inside ``jax.jit`` and ``jax.grad`` (to train the
    linearised model).

    Args:
      transformed: ``hk.Transformed`` (with or without apply rng) or
        ``hk.TransformedWithState``.
      params0: the params returned by ``transformed.init``: the expansion point.
      state: the state of an ``hk.TransformedWithState`` (required there).
      rng: a PRNG key for models that need one, the same at every call.
      apply_kwargs: extra keyword arguments of the forward function, e.g.
        ``{"is_training": False}``.

    Returns:
      ``f_lin(params, x)`` with ``params`` structured like ``params0``: the model's
      outputs, e.g. ``(N1, O)`` for a batch x of N1 samples, in the model's dtypes.

    Raises:
      TypeError: not a transformed function; ``params0`` or ``state`` not a mapping; at
        call time, a parameter of another dtype than in ``params0``.
      ValueError: a missing or unexpected ``state``; ``rng`` for a transform that takes
        none; at call time, ``params`` of another structure or leaf shape than
        ``params0``.

    Cost: as :func:`ntk_core.linearize`: one JVP (about 2–3 forward passes) per call,
    memory of a forward pass (no N1·O·P Jacobian).

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import ntk_haiku
      >>> net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([8, 1])(x)))
      >>> x = jnp.ones((4, 2))                           # N1 = 4 samples
      >>> params0 = net.init(jax.random.PRNGKey(0), x)
      >>> f_lin = ntk_haiku.linearize(net, params0)
      >>> f_lin(params0, x).shape                        # (N1, O)
      (4, 1)
      >>> bool(jnp.allclose(f_lin(params0, x), net.apply(params0, x)))
      True

    References:
      Lee et al., "Wide Neural Networks of Any Depth Evolve as Linear Models Under
      Gradient Descent", NeurIPS 2019.
    """
    return _expanded("ntk_haiku.linearize", 1, transformed, params0, state, rng, apply_kwargs)


def taylor_expand(
    transformed, params0, degree: int, *, state=None, rng=None, apply_kwargs=None
) -> Callable:
    """The degree-``degree`` Taylor polynomial of a Haiku model in its parameters.

    f_taylor(θ, x) = Σ_{k=0..degree} (1/k!) D^k f(θ0, x)[θ − θ0, ..., θ − θ0] by nested
    ``jax.jvp`` (see :func:`ntk_core.taylor_expand`); ``state`` and ``rng`` held fixed as
    in :func:`linearize`. ``degree=1`` is :func:`linearize`.

    Args:
      transformed, params0, state, rng, apply_kwargs: as in :func:`linearize`.
      degree: a non-negative int.

    Returns:
      ``f_taylor(params, x)``: the model's outputs, e.g. ``(N1, O)`` for N1 samples.

    Raises:
      TypeError: as :func:`linearize`, and ``degree`` not an int.
      ValueError: as :func:`linearize`, and a negative ``degree``.

    Cost: as :func:`ntk_core.taylor_expand`: ``degree`` nested JVPs per call (under
    ``jax.jit`` about 4 forward passes at degree 2 and 6 at degree 3; outside it up to
    2^degree), memory independent of N1·O·P.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import ntk_haiku
      >>> net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x)))
      >>> x = jnp.ones((4, 2))
      >>> p0 = net.init(jax.random.PRNGKey(0), x)
      >>> p1 = jax.tree.map(lambda p: p + 1.0, p0)
      >>> f0 = ntk_haiku.taylor_expand(net, p0, 0)      # degree 0: f(params0, x)
      >>> bool(jnp.allclose(f0(p1, x), net.apply(p0, x)))
      True

    References:
      Lee et al., "Wide Neural Networks of Any Depth Evolve as Linear Models Under
      Gradient Descent", NeurIPS 2019.
    """
    degree = check_degree("ntk_haiku.taylor_expand", degree)
    return _expanded(
        "ntk_haiku.taylor_expand", degree, transformed, params0, state, rng, apply_kwargs
    )
