"""The sketched eNTK of Haiku models: the core's :func:`ntk_core.ntk_sketch_fn` features
through ``ntk_core.adapters.sketch``, on the kernel function :func:`ntk_haiku.kernel` would
use (so ``wrt=`` takes Haiku module names)."""

from __future__ import annotations

from collections.abc import Callable

from ntk_core.adapters import sketch
from ntk_haiku._kernel import _kernel_of, public


@public
def ntk_sketch_fn(transformed, *, k, key, apply_kwargs=None, **options) -> Callable:
    """:func:`ntk_sketch`'s features built once: ``features(params, x, *, state=None,
    rng=None)`` returns Φ ``(N, k)`` (``(N, O, k)`` with ``trace_axes=()``), Φ(x1) Φ(x2)ᵀ ≈
    Θ(x1, x2).

    Args: ``transformed``, ``apply_kwargs``, ``inputs`` as :func:`kernel_fn`; ``k``
    the sketch size; ``key`` a JAX PRNG key (the same key, the same map); ``**options``:
    ``trace_axes``, ``batch_size`` (blocks of samples, numpy features), ``precision``,
    ``wrt`` (Haiku module names).
    Returns: the features function; its ``.estimate(params, x1, x2=None, *,
    state=None, rng=None)`` is :func:`ntk_sketch`'s result.
    Raises: as :func:`kernel_fn`; TypeError for other kernel options; the core's for
    ``k``, ``key`` and a float16 model. Definition, variance, Cost and References: see
    :func:`ntk_core.ntk_sketch_fn`.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.ones((4, 2))
      >>> features = ntk_haiku.ntk_sketch_fn(net, k=256, key=jax.random.PRNGKey(1))
      >>> features(net.init(jax.random.PRNGKey(0), x), x).shape
      (4, 256)
    """
    return sketch(_kernel_of(ntk_sketch_fn, transformed, apply_kwargs, options), k=k, key=key)


@public
def ntk_sketch(
    transformed, params, x1, x2=None, *, k, key, state=None, rng=None, apply_kwargs=None,
    **options,
):  # fmt: skip
    """The sketched eNTK Θ̂(x1, x2) = Φ(x1) Φ(x2)ᵀ of a Haiku model, unbiased (E Θ̂ = Θ of
    :func:`kernel` with the same options), with the features it is the product of.

    Args: as :func:`kernel` and :func:`ntk_sketch_fn`.
    Returns: an ``NTKSketch(kernel, features1, features2)``: ``(N1, N2)`` and ``(N1, k)``,
    ``(N2, k)`` by default; ``(N1, N2, O, O)``, ``(N1, O, k)`` with ``trace_axes=()``.
    Raises: as :func:`ntk_sketch_fn`. Definition, variance, Cost and References: see
    :func:`ntk_core.ntk_sketch_fn`.
    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp, ntk_haiku
      >>> net, x = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x))), jnp.eye(2)
      >>> s = ntk_haiku.ntk_sketch(net, net.init(jax.random.PRNGKey(0), x), x, k=256,
      ...                          key=jax.random.PRNGKey(1))
      >>> s.features1.shape, bool(jnp.allclose(s.kernel, x @ x.T + 1, atol=0.3))  # ≈ Θ
      ((2, 256), True)
    """
    features = sketch(_kernel_of(ntk_sketch, transformed, apply_kwargs, options), k=k, key=key)
    return features.estimate(params, x1, x2, state=state, rng=rng)
