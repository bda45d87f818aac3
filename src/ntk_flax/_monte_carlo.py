"""Monte Carlo NNGP and NTK of ``flax.linen`` models (initialised with ``model.init``)
and of ``flax.nnx`` models (built by a function of ``nnx.Rngs``)."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from ntk_core.adapters import (
    check_monte_carlo,
    checked_arguments,
    checked_init,
    is_nnx_module,
    monte_carlo_mean,
)
from ntk_core.predict import Kernels

from . import _nnx
from ._kernel import caller, make

#: :func:`monte_carlo_kernels` as its messages name it.
_CALLER = caller("monte_carlo_kernels", monte_carlo=True)
_OWN = ("key", "n_samples", "batch_size_samples", "method", "apply_kwargs", "init_kwargs")


@checked_arguments("ntk_flax.monte_carlo_kernels")
def monte_carlo_kernels(
    model: nn.Module | Callable,
    x1,
    x2=None,
    *,
    key,
    n_samples: int,
    batch_size_samples: int = 1,
    method: str | Callable | None = None,
    apply_kwargs=None,
    init_kwargs=None,
    progress: bool | None = None,
    **options,
) -> Kernels:
    """Monte Carlo NNGP and NTK of a Flax model over random initialisations.

    The average over S = ``n_samples`` initialisations ``model.init(k_s, x1[:1])``,
    k_s = ``jax.random.split(key, S)[s]``, of the empirical NNGP and NTK of
    :func:`ntk_flax.nngp` and :func:`ntk_flax.kernel` (only ``params`` differentiated;
    other collections of each initialisation held fixed). The parameterisation is the
    model's own: with ``nn.Dense(kernel_init=normal(σ_w / √fan_in))`` it is the
    standard parameterisation, whose kernels grow with the width unlike the NTK
    parameterisation's. See :func:`ntk_core.monte_carlo_kernels` for the maths.

    ``flax.nnx`` models initialise when they are built, so for them ``model`` is the
    function that builds one from an ``nnx.Rngs``, e.g. ``lambda rngs: MLP(rngs=rngs)``:
    initialisation s is the module ``model(nnx.Rngs(k_s))`` (built under ``jax.jit``),
    whose ``nnx.Param`` state is differentiated and whose other state (BatchNorm
    statistics, fixed random features, RNG state) is held fixed. Modules with Dropout or
    BatchNorm must be built in evaluation mode (call ``.eval()`` on the module in that
    function before returning it).

    Args:
      model: a ``flax.linen.Module``, or for ``flax.nnx`` a function
        ``model(rngs: nnx.Rngs) -> nnx.Module``.
      x1: array or pytree of arrays, batch axis 0 of size N1 (its first sample is the
        ``model.init`` input).
      x2: ``None`` (x2 is x1) or like x1 with N2 samples.
      key: one PRNG key.
      n_samples: S >= 1.
      batch_size_samples: samples computed together (vmapped over their keys), default 1.
      method, apply_kwargs: as :func:`ntk_flax.kernel_fn` (for linen, ``apply_kwargs``
        is also passed to ``model.init`` unless ``init_kwargs`` is given; for nnx,
        ``method`` is a method's name).
      init_kwargs: linen only: keyword arguments for ``model.init`` instead of
        ``apply_kwargs`` (e.g. ``{"train": True}`` with ``apply_kwargs={"train":
        False}``).
      progress, **options: as :func:`ntk_core.monte_carlo_kernels` (the kernel options
        of :func:`ntk_core.ntk_fn`, ``batch_size`` only with ``batch_size_samples=1``;
        ``out="mc.npy"``, ``resume``, ``overwrite``: the means on disk, resumable).

    Returns:
      ``ntk_core.predict.Kernels(nngp, ntk)``, each ``(N1, N2)`` for ``(N, O)`` outputs
      by default (``(N1, N2, O, O)`` with ``trace_axes=()``); with ``out``, read-only
      memory maps of the files.

    Raises:
      TypeError, ValueError: as :func:`ntk_flax.kernel_fn` and
        :func:`ntk_core.monte_carlo_kernels`; for nnx, an initialised module instead of
        the function building it, a builder that fails (also under ``jax.jit``) or
        builds a module without ``nnx.Param`` or in training mode; ``batch_size`` with
        ``batch_size_samples`` > 1; a non-finite mean.

    Cost: S calls of ``model.init`` (or of the nnx builder, jitted) and of
    :func:`ntk_flax.kernel` and :func:`ntk_flax.nngp` (one compilation each).

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
    fn = _CALLER.name
    if isinstance(model, type) and issubclass(model, nn.Module):
        message = (
            f"{fn}: model is the linen class {model.__name__}, not an instance. Fix: pass "
            f"{model.__name__}(...)."
        )
        raise TypeError(message)
    if not isinstance(model, nn.Module):
        name = type(model).__name__
        if is_nnx_module(model) or not callable(model):
            message = (
                f"{fn}: model must be a linen module or a function building an nnx module, got "
                f"{'the nnx module ' if is_nnx_module(model) else ''}{name}. Fix: pass the "
                f"function that builds it from an nnx.Rngs, e.g. lambda rngs: "
                f"{name if is_nnx_module(model) else 'Model'}(..., rngs=rngs)."
            )
            raise TypeError(message)
        if init_kwargs is not None:
            message = (
                f"{fn}: init_kwargs was given for an nnx model. Fix: drop it and pass the "
                f"arguments inside the builder."
            )
            raise TypeError(message)
    init_kwargs = check_monte_carlo(
        _CALLER, x1, x2, key, n_samples, batch_size_samples, options, _OWN, init_kwargs
    )  # before building
    if not isinstance(model, nn.Module):
        return _nnx_monte_carlo(
            fn, model, x1, x2, key, n_samples, batch_size_samples, method, apply_kwargs,
            progress, options,
        )  # fmt: skip
    x_init = jax.tree.map(lambda a: a[:1], x1)
    init_kwargs = dict(apply_kwargs or {}) if init_kwargs is None else init_kwargs
    init = checked_init(
        fn,
        jax.jit(lambda k: model.init(k, x_init, method=method, **init_kwargs)),
        "model.init(key, x1[:1])",
        "the module's __call__, traced under jax.jit",
        "check that x1 has the per-sample shape the model expects (batch axis first); "
        "init_kwargs={...} gives model.init other keyword arguments than apply_kwargs",
    )

    def kernels(kind, kind_options):  # errors name fn
        return make(_CALLER, kind, model, kind_options, method, apply_kwargs)

    mean = monte_carlo_mean
    return mean(fn, init, kernels, x1, x2, key, n_samples, batch_size_samples, progress, options)


def _comparable(leaf):
    """Typed PRNG keys compare by their key data."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(leaf)
    return leaf


def _nnx_monte_carlo(
    fn,
    build,
    x1,
    x2,
    key,
    n_samples,
    batch_size_samples,
    method,
    apply_kwargs,
    progress,
    options,
) -> Kernels:
    """Monte Carlo kernels of the nnx modules ``build(nnx.Rngs(k_s))``: each sample's
    state is built under jit; its ``nnx.Param`` state is differentiated and its other
    state held fixed, through the graph definition of one template module."""
    from flax import nnx

    try:
        template = build(nnx.Rngs(key))
    except Exception as e:
        message = (
            f"{fn}: model(nnx.Rngs(key)) failed with {type(e).__name__}: "
            f"{str(e).strip().splitlines()[0].rstrip('.')}. Fix: pass a function of one "
            f"nnx.Rngs that returns the module, e.g. lambda rngs: Model(..., rngs=rngs)."
        )
        raise (TypeError if isinstance(e, TypeError) else ValueError)(message) from e
    if not is_nnx_module(template):
        message = (
            f"{fn}: model(nnx.Rngs(key)) returned {type(template).__name__}, not an nnx "
            f"module. Fix: return the module from the function."
        )
        raise TypeError(message)
    if not jax.tree.leaves(nnx.state(template, nnx.Param)):
        message = (
            f"{fn}: the module model(nnx.Rngs(key)) builds, {type(template).__name__}, has "
            f"no nnx.Param variables. Fix: build it with its trainable layers."
        )
        raise ValueError(message)
    # Each sample's whole state: its parameters, and its other state (statistics,
    # buffers drawn from rngs, RNG state) as that initialisation made them.
    state_of = checked_init(
        fn,
        jax.jit(lambda k: nnx.split(build(nnx.Rngs(k)), nnx.Param, ...)[1:]),
        "model(nnx.Rngs(key))",
        "the function building the module, traced under jax.jit",
    )
    if n_samples >= 2:  # a builder that ignores its rngs makes every sample the same
        keys = jax.random.split(key, 2)
        first, second = (map(_comparable, jax.tree.leaves(state_of(k))) for k in keys)
        if all(bool(jnp.array_equal(a, b)) for a, b in zip(first, second, strict=True)):
            message = (
                f"{fn}: model(nnx.Rngs(k)) built the same module for two different keys. "
                f"Fix: build with the rngs it is given, lambda rngs: Model(..., rngs=rngs)."
            )
            raise ValueError(message)

    def kernels(kind, kind_options):  # of one initialisation's (params, rest)
        return _nnx.make(_CALLER, kind, template, method, apply_kwargs, kind_options)

    mean = monte_carlo_mean
    return mean(
        fn, state_of, kernels, x1, x2, key, n_samples, batch_size_samples, progress, options
    )
