"""Monte Carlo NNGP and NTK of ``flax.linen`` and ``flax.nnx`` models."""

from __future__ import annotations

from collections.abc import Callable
from inspect import signature

import flax.linen as nn
import jax
import jax.numpy as jnp

from ntk_core.adapters import (
    bad,
    cached,
    check_monte_carlo,
    checked_init,
    is_nnx_module,
    keyed,
    monte_carlo_mean,
)
from ntk_core.adapters import check_inputs_option as check_inputs
from ntk_core.adapters import spread_inputs as spread
from ntk_core.predict import Kernels

from . import _nnx
from ._kernel import caller, make, public

_BUILD = "lambda rngs: Model(..., rngs=rngs)"


@public
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
    inputs: str = "x",
    progress: bool | None = None,
    **options,
) -> Kernels:
    """Monte Carlo NNGP and NTK of a Flax model: their means over S = ``n_samples``
    initialisations (maths: :func:`ntk_core.monte_carlo_kernels`).

    Initialisation s is ``model.init(k_s, x1[:1])``, k_s = ``jax.random.split(key, S)[s]``,
    ``params`` differentiated and other collections held fixed, in the model's own
    parameterisation. For ``flax.nnx``, ``model`` builds the module from an ``nnx.Rngs``
    (under ``jax.jit``; call ``.eval()`` there for Dropout or BatchNorm).
    Args:
      model: a ``flax.linen.Module``, or ``model(rngs: nnx.Rngs) -> nnx.Module``.
      x1, x2, key, n_samples, batch_size_samples, progress, **options: as
        :func:`ntk_core.monte_carlo_kernels` (x1: N1 samples, x2: N2 or ``None``).
      method, apply_kwargs, inputs: as :func:`ntk_flax.kernel_fn`; linen's ``apply_kwargs`` also
        go to ``model.init`` unless ``init_kwargs`` (linen only) is given.
    Returns:
      ``ntk_core.predict.Kernels(nngp, ntk)``, each ``(N1, N2)`` for ``(N, O)`` outputs
      by default; with ``out``, read-only memory maps of the files.
    Raises:
      TypeError, ValueError: as :func:`ntk_flax.kernel_fn` and
        :func:`ntk_core.monte_carlo_kernels`; for nnx, a module instead of its builder, a
        builder that fails or builds a module without ``nnx.Param``.
    Cost: S calls of ``model.init`` (or the jitted builder), :func:`ntk_flax.kernel` and
    :func:`ntk_flax.nngp` (one compilation each).
    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, ntk_flax
      >>> x = jnp.ones((4, 2))
      >>> k = ntk_flax.monte_carlo_kernels(nn.Dense(3), x, key=jax.random.PRNGKey(0), n_samples=4)
      >>> k.ntk.shape, k.nngp.shape
      ((4, 4), (4, 4))

    References: Novak et al., ICLR 2019, as :func:`ntk_core.monte_carlo_kernels`.
    """
    fn = _CALLER.name
    if isinstance(model, type) and issubclass(model, nn.Module):
        what = f"model is the linen class {model.__name__}, not an instance"
        raise bad(TypeError, fn, what, f"pass {model.__name__}(...)")
    if not isinstance(model, nn.Module):
        if is_nnx_module(model) or not callable(model):
            what = "model must be a linen module or a function building an nnx module, got "
            got = ("the nnx module " if is_nnx_module(model) else "") + type(model).__name__
            raise bad(TypeError, fn, what + got, f"pass the function that builds it, {_BUILD}")
        if init_kwargs is not None:
            what = "init_kwargs was given for an nnx model"
            raise bad(TypeError, fn, what, "drop it and pass the arguments inside the builder")
    init_kwargs = check_monte_carlo(
        _CALLER, x1, x2, key, n_samples, batch_size_samples, options, _OWN, init_kwargs
    )  # before building
    spread(fn, check_inputs(fn, inputs), x1)  # a TypeError for an x1 of another kind
    args = (x1, x2, key, n_samples, batch_size_samples, progress, options)
    if not isinstance(model, nn.Module):
        return _nnx_monte_carlo(fn, model, method, apply_kwargs, inputs, args)
    x_init, kw = spread(fn, inputs, jax.tree.map(lambda a: a[:1], x1))
    init_kwargs = dict(apply_kwargs or {}) if init_kwargs is None else init_kwargs

    def initialise(k, x_init, kw):  # x an argument: one program for every call (issue 48)
        return model.init(k, *x_init, method=method, **kw, **init_kwargs)

    initialise = keyed(initialise, "linen init", model, method, init_kwargs)
    jitted = cached((fn, initialise), lambda: jax.jit(initialise))
    init = lambda k: jitted(k, x_init, kw)  # noqa: E731
    fix = "check x1's per-sample shape; init_kwargs={...} gives model.init other keyword arguments"
    init = checked_init(fn, init, "model.init(key, x1[:1])", "the module's __call__", fix)

    def kernels(kind, kind_options):  # errors name fn
        return make(_CALLER, kind, model, dict(kind_options, inputs=inputs), method, apply_kwargs)

    return monte_carlo_mean(fn, init, kernels, *args)


def _comparable(leaf):
    """Typed PRNG keys compare by their key data."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(leaf)
    return leaf


def _nnx_monte_carlo(fn, build, method, apply_kwargs, inputs, args) -> Kernels:
    """The kernels of ``build(nnx.Rngs(k_s))`` (under jit), through one template's graph."""
    key, n_samples = args[2:4]
    from flax import nnx

    try:
        template = build(nnx.Rngs(key))
    except Exception as e:
        what = f"model(nnx.Rngs(key)) failed with {type(e).__name__}: "
        what += str(e).strip().splitlines()[0].rstrip(".")
        fix = f"pass a function of one nnx.Rngs that returns the module, e.g. {_BUILD}"
        raise bad(TypeError if isinstance(e, TypeError) else ValueError, fn, what, fix) from e
    got = type(template).__name__
    if not is_nnx_module(template):
        what = f"model(nnx.Rngs(key)) returned {got}, not an nnx module"
        raise bad(TypeError, fn, what, "return the module from the function")
    if not jax.tree.leaves(nnx.state(template, nnx.Param)):
        what = f"the module model(nnx.Rngs(key)) builds, {got}, has no nnx.Param variables"
        raise bad(ValueError, fn, what, "build it with its trainable layers")

    def states(k):
        # Each sample's whole state: its parameters, and its other state (statistics,
        # buffers drawn from rngs, RNG state) as that initialisation made them.
        return nnx.split(build(nnx.Rngs(k)), nnx.Param, ...)[1:]

    states = keyed(states, "nnx init", build)  # one program for every call (issue 48)
    split = cached((fn, states), lambda: jax.jit(states))
    state_of = checked_init(fn, split, "model(nnx.Rngs(key))", "the function building the module")
    if n_samples >= 2:  # a builder that ignores its rngs makes every sample the same
        keys = jax.random.split(key, 2)
        first, second = (map(_comparable, jax.tree.leaves(state_of(k))) for k in keys)
        if all(bool(jnp.array_equal(a, b)) for a, b in zip(first, second, strict=True)):
            what = "model(nnx.Rngs(k)) built the same module for two different keys"
            raise bad(ValueError, fn, what, f"build with the rngs it is given, {_BUILD}")

    def kernels(kind, kind_options):  # of one initialisation's (params, rest)
        return _nnx.make(_CALLER, kind, template, method, apply_kwargs, kind_options, inputs)

    return monte_carlo_mean(fn, state_of, kernels, *args)


#: :func:`monte_carlo_kernels` as its messages name it, and its own keyword arguments.
_CALLER = caller(monte_carlo_kernels, monte_carlo=True)
_OWN = [n for n, p in signature(monte_carlo_kernels).parameters.items() if p.kind is p.KEYWORD_ONLY]
