"""The sketched eNTK of Flax models (linen and nnx): the core's
:func:`ntk_core.ntk_sketch_fn` features through ``ntk_core.adapters.sketch``, on the kernel
function :func:`ntk_flax.kernel` would use (so ``wrt=`` takes Flax paths and nnx names)."""

from __future__ import annotations

from collections.abc import Callable

from ntk_core.adapters import sketch
from ntk_flax._kernel import _kernel_of, public


@public
def ntk_sketch_fn(model, *, k, key, method=None, apply_kwargs=None, **options) -> Callable:
    """:func:`ntk_sketch`'s features built once: ``features(variables, x, *, rngs=None)``
    returns Φ ``(N, k)`` (``(N, O, k)`` with ``trace_axes=()``), Φ(x1) Φ(x2)ᵀ ≈ Θ(x1, x2).

    Args: ``model``, ``method``, ``apply_kwargs``, ``inputs`` as :func:`kernel_fn`; ``k``
    the sketch size; ``key`` a JAX PRNG key (the same key, the same map); ``**options``:
    ``trace_axes``, ``batch_size`` (blocks of samples, numpy features), ``precision``,
    ``wrt`` (Flax paths, nnx names).
    Returns: the features function; its ``.estimate(variables, x1, x2=None, *,
    rngs=None)`` is :func:`ntk_sketch`'s result.
    Raises: as :func:`kernel_fn`; TypeError for other kernel options; the core's for
    ``k``, ``key`` and a float16 model. Definition, variance, Cost and References: see
    :func:`ntk_core.ntk_sketch_fn`.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.ones((4, 2))
      >>> features = ntk_flax.ntk_sketch_fn(model, k=256, key=jax.random.PRNGKey(1))
      >>> features(model.init(jax.random.PRNGKey(0), x), x).shape
      (4, 256)
    """
    return sketch(_kernel_of(ntk_sketch_fn, model, method, apply_kwargs, options), k=k, key=key)


@public
def ntk_sketch(
    model, variables, x1, x2=None, *, k, key, method=None, apply_kwargs=None, rngs=None,
    **options,
):  # fmt: skip
    """The sketched eNTK Θ̂(x1, x2) = Φ(x1) Φ(x2)ᵀ of a Flax model, unbiased (E Θ̂ = Θ of
    :func:`kernel` with the same options), with the features it is the product of.

    Args: as :func:`kernel` and :func:`ntk_sketch_fn`.
    Returns: an ``NTKSketch(kernel, features1, features2)``: ``(N1, N2)`` and ``(N1, k)``,
    ``(N2, k)`` by default; ``(N1, N2, O, O)``, ``(N1, O, k)`` with ``trace_axes=()``.
    Raises: as :func:`ntk_sketch_fn`. Definition, variance, Cost and References: see
    :func:`ntk_core.ntk_sketch_fn`.
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> model, x = nn.Dense(3), jnp.eye(2)
      >>> s = ntk_flax.ntk_sketch(model, model.init(jax.random.PRNGKey(0), x), x, k=256,
      ...                         key=jax.random.PRNGKey(1))
      >>> s.features1.shape, bool(jnp.allclose(s.kernel, x @ x.T + 1, atol=0.3))  # ≈ Θ
      ((2, 256), True)
    """
    features = sketch(_kernel_of(ntk_sketch, model, method, apply_kwargs, options), k=k, key=key)
    return features.estimate(variables, x1, x2, rngs=rngs)
