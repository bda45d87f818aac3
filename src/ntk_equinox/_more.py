"""The entry points of :mod:`ntk_equinox` beyond :func:`~ntk_equinox.kernel` that
``ntk_flax`` and ``ntk_haiku`` have too: the NNGP built once, and kernels per leaf."""

from __future__ import annotations

from ntk_equinox._kernel import _kernel_fn
from ntk_equinox._statistics import public


@public
def nngp_fn(model, **options):
    """:func:`ntk_equinox.nngp` built once for models shaped like ``model``: ``kernel(model,
    x1, x2=None)`` with each step's model. Args: ``model`` an ``eqx.Module``; ``**options``
    :func:`ntk_core.nngp_fn`'s and ``inputs``. Returns: the kernel function, ``(N1, N2)`` by
    default. Raises: as :func:`ntk_equinox.kernel_fn`. Cost: a forward pass, N1·N2·O
    products. References: Lee et al., "Deep neural networks as Gaussian processes", 2018.
    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, ntk_equinox
      >>> lin = eqx.nn.Linear(2, 3, key=jax.random.PRNGKey(0))
      >>> ntk_equinox.nngp_fn(lin, trace_axes=())(lin, jnp.eye(2)).shape
      (2, 2, 3, 3)
    """
    return _kernel_fn(nngp_fn, model, options)


@public
def kernel_per_leaf_fn(model, **options):
    """:func:`kernel_per_leaf` built once for models shaped like ``model``: ``kernel(model,
    x1, x2=None)`` (x1: N1 samples). Args: as :func:`ntk_equinox.kernel_fn` (``implementation`` not
    ``"ntvp"``). Returns: the kernel function, whose results are :func:`kernel_per_leaf`'s.
    Raises: as :func:`ntk_equinox.kernel_fn`. Cost, References: :func:`ntk_core.ntk_fn`.
    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, ntk_equinox
      >>> lin = eqx.nn.Linear(2, 3, key=jax.random.PRNGKey(0))
      >>> ntk_equinox.kernel_per_leaf_fn(lin)(lin, jnp.eye(2)).weight.shape
      (2, 2)
    """
    return _kernel_fn(kernel_per_leaf_fn, model, options)


@public
def kernel_per_leaf(model, x1, x2=None, **options):
    """:func:`ntk_equinox.kernel` split by parameter leaf: Θ_l with Σ_l Θ_l = Θ. Args: as
    :func:`ntk_equinox.kernel` (x1: N1 samples, x2: N2 or None; ``implementation`` not
    ``"ntvp"``). Returns: a module-shaped tree of ``(N1, N2)`` kernels by default, None at
    the fields held fixed. Raises: as :func:`ntk_equinox.kernel`. Cost: as the NTK's.
    References: :func:`ntk_core.empirical_ntk_per_leaf`.
    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, ntk_equinox
      >>> lin, x = eqx.nn.Linear(2, 3, key=jax.random.PRNGKey(0)), jnp.eye(2)
      >>> k = ntk_equinox.kernel_per_leaf(lin, x)
      >>> bool(jnp.allclose(k.weight + k.bias, ntk_equinox.kernel(lin, x)))
      True
    """
    return _kernel_fn(kernel_per_leaf, model, options)(model, x1, x2)
