"""Monte Carlo NNGP and NTK of Equinox models: each initialisation's arrays, under jit,
combined with one template's fixed fields, through :func:`ntk_core.adapters.monte_carlo_mean`."""

from __future__ import annotations

from collections.abc import Callable
from inspect import signature

import equinox as eqx

from ntk_core.adapters import adapter_caller, bad, check_monte_carlo, checked_init, monte_carlo_mean
from ntk_core.adapters import check_inputs_option as check_inputs
from ntk_core.predict import Kernels
from ntk_equinox._kernel import _PACKAGE, _kernel_fn, kernel, kernel_fn
from ntk_equinox._more import nngp_fn
from ntk_equinox._statistics import public

_BUILD = "lambda key: eqx.nn.MLP(..., key=key)"


@public
def monte_carlo_kernels(
    make_model: Callable,
    x1,
    x2=None,
    *,
    key,
    n_samples: int,
    batch_size_samples: int = 1,
    inputs: str = "x",
    progress: bool | None = None,
    **options,
) -> Kernels:
    """Monte Carlo NNGP and NTK of an Equinox model: their means over S = ``n_samples``
    initialisations ``make_model(k_s)``, k_s = ``jax.random.split(key, S)[s]`` (maths:
    :func:`ntk_core.monte_carlo_kernels`); each module's floating arrays differentiated,
    its other fields as :func:`ntk_equinox.kernel` holds them.

    Args: ``make_model(key) -> eqx.Module`` of one sample, a pure JAX function of the key
    (run under jit); x1, x2, key, n_samples, batch_size_samples, progress, ``**options``: as
    :func:`ntk_core.monte_carlo_kernels` (x1: N1 samples, x2: N2 or ``None``); ``inputs``
    as :func:`ntk_equinox.kernel`. Returns: ``ntk_core.predict.Kernels(nngp, ntk)``, each
    ``(N1, N2)`` for ``(O,)`` outputs by default; with ``out``, memory maps of the files.
    Raises: TypeError: ``make_model`` not a function, or it returns no ``eqx.Module``;
    ValueError: ``make_model`` fails; as :func:`ntk_equinox.kernel` and
    :func:`ntk_core.monte_carlo_kernels`. Cost: S + 1 calls of ``make_model`` under one
    compilation (``eqx.filter_jit``; the first gives the kernels' template), S NTKs and NNGPs.
    Example:
      >>> import equinox as eqx, jax, jax.numpy as jnp, ntk_equinox
      >>> make, x = lambda k: eqx.nn.MLP(2, 3, 16, 1, key=k), jnp.ones((4, 2))
      >>> k = ntk_equinox.monte_carlo_kernels(make, x, key=jax.random.PRNGKey(0), n_samples=2)
      >>> k.nngp.shape, k.ntk.shape
      ((4, 4), (4, 4))

    References: Novak et al., ICLR 2019, as :func:`ntk_core.monte_carlo_kernels`.
    """
    fn = _CALLER.name
    if isinstance(make_model, eqx.Module) or not callable(make_model):
        what = f"make_model must build the module from a key, got {type(make_model).__name__}"
        raise bad(TypeError, fn, what, f"pass the function that builds it, {_BUILD}")
    check_monte_carlo(_CALLER, x1, x2, key, n_samples, batch_size_samples, options, _OWN)
    inputs = check_inputs(fn, inputs)
    expected, fix = "an eqx.Module built from the key", f"write it as {_BUILD}"
    build = eqx.filter_jit(make_model)  # one compilation: the template and every sample
    template = checked_init(fn, build, "make_model(key)", expected, fix)(key)
    if not isinstance(template, eqx.Module):
        what = f"make_model(key) returned {type(template).__name__}, not an eqx.Module"
        raise bad(TypeError, fn, what, "return the module from the function")
    rest = eqx.filter(template, eqx.is_array, inverse=True)
    init = lambda k: eqx.filter(build(k), eqx.is_array)  # noqa: E731
    init = checked_init(fn, init, "make_model(key)", expected)

    def kernels(kind, kind_options):  # of one initialisation's arrays; errors name fn
        built = kernel_fn if kind == "ntk" else nngp_fn
        of = _kernel_fn(built, template, dict(kind_options, inputs=inputs), name=fn)
        return lambda arrays, x1, x2: of(eqx.combine(arrays, rest), x1, x2)

    args = (x1, x2, key, n_samples, batch_size_samples, progress, options)
    return monte_carlo_mean(fn, init, kernels, *args)


#: :func:`monte_carlo_kernels` as its messages name it, and its own keyword arguments.
_CALLER = adapter_caller(_PACKAGE, monte_carlo_kernels, kernel, monte_carlo=True)
_OWN = [n for n, p in signature(monte_carlo_kernels).parameters.items() if p.kind is p.KEYWORD_ONLY]
