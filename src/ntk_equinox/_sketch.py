"""The sketched eNTK of Equinox models: the core's :func:`ntk_core.ntk_sketch_fn` features
through ``ntk_core.adapters.sketch``, on the kernel function :func:`ntk_equinox.kernel`
would use (``wrt=`` on the module's attribute paths)."""

from __future__ import annotations

from ntk_core.adapters import sketch
from ntk_equinox._kernel import _kernel_fn
from ntk_equinox._statistics import public


@public
def ntk_sketch_fn(model, *, k, key, **options):
    """:func:`ntk_sketch`'s features built once for models shaped like ``model``:
    ``features(model, x)`` -> Φ ``(N1, k)`` for N1 samples (``(N1, O, k)`` with
    ``trace_axes=()``), and ``features.estimate(model, x1, x2=None)``. Args: ``model``,
    ``inputs`` as :func:`ntk_equinox.kernel`; ``k``, ``key`` as
    :func:`ntk_core.ntk_sketch_fn`; options ``trace_axes``, ``batch_size``, ``precision``,
    ``wrt``. Returns: the features function.
    Raises: as :func:`ntk_equinox.kernel_fn`; TypeError for other kernel options; the
    core's for k, key, a float16 model. Cost, variance, References:
    :func:`ntk_core.ntk_sketch_fn`.
    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, ntk_equinox
      >>> lin = eqx.nn.Linear(2, 3, key=jax.random.PRNGKey(0))
      >>> ntk_equinox.ntk_sketch_fn(lin, k=64, key=jax.random.PRNGKey(1))(lin, jnp.eye(2)).shape
      (2, 64)
    """
    return sketch(_kernel_fn(ntk_sketch_fn, model, options), k=k, key=key)


@public
def ntk_sketch(model, x1, x2=None, *, k, key, **options):
    """The sketched eNTK Θ̂(x1, x2) = Φ(x1) Φ(x2)ᵀ of an ``eqx.Module``, unbiased. Args: as
    :func:`ntk_sketch_fn` (x1: N1 samples, x2: N2 or None). Returns: an ``NTKSketch(kernel,
    features1, features2)``, ``(N1, N2)``, ``(N1, k)``, ``(N2, k)`` by default. Raises: as
    :func:`ntk_sketch_fn`. Cost, variance, References: :func:`ntk_core.ntk_sketch_fn`.
    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, ntk_equinox
      >>> lin, x = eqx.nn.Linear(2, 3, key=jax.random.PRNGKey(0)), jnp.eye(2)
      >>> s = ntk_equinox.ntk_sketch(lin, x, k=256, key=jax.random.PRNGKey(1))
      >>> bool(jnp.allclose(s.kernel, x @ x.T + 1, atol=0.3))  # ≈ Θ
      True
    """
    return sketch(_kernel_fn(ntk_sketch, model, options), k=k, key=key).estimate(model, x1, x2)
