"""Monte Carlo NNGP and NTK: averages of empirical kernels over random initialisations."""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._api import _make
from ntk_core._blocked import progress as _progress
from ntk_core._blocked.tiles import non_finite
from ntk_core._errors import NonFiniteError, bad, check_int, must, one_line
from ntk_core._impl.base import EXACT_CPU_OPTIONS, jit_tuned
from ntk_core._kernel.arguments import _checked_arguments, misspelt, required_positional
from ntk_core._kernel.caller import Caller
from ntk_core._kernel.checks import all_finite, check_finite_input, check_values
from ntk_core._kernel.options import DEFAULTS, _flags, make_options
from ntk_core._monte_carlo.files import KINDS, MonteCarloFiles, kind_options
from ntk_core._predict.inference import Kernels
from ntk_core._predict.linalg import check_key

_KERNEL_OPTIONS = list(inspect.signature(make_options).parameters)[1:]  # after fn_name
_INPUTS = ("x1", "x2")


def check_inputs(fn_name: str, x1, x2, models: str = "model") -> None:
    """Refuses x1, x2 without a batch axis or looking like parameters (``models``: the
    arguments before x1)."""
    check_values(fn_name, dict(zip(_INPUTS, (x1, x2), strict=True)))
    for name, x in zip(_INPUTS, (x1, x2), strict=True):
        leaves = jax.tree.leaves(x)
        if x is not None and (not leaves or any(np.ndim(leaf) == 0 for leaf in leaves)):
            what = f"{name} must be arrays with a batch axis 0, got {type(x).__name__}"
            raise bad(TypeError, fn_name, what, f"pass np.asarray({name}), shape (N, ...)")
    nested = isinstance(x1, Mapping) and all(isinstance(v, Mapping) for v in x1.values())
    mismatched = x2 is not None and jax.tree.structure(x2) != jax.tree.structure(x1)
    # a container (dict, list of layers) where x2 is one array: the parameters, most likely
    box = Mapping | list | tuple
    containers = isinstance(x1, box) and not isinstance(x2, box)
    if (nested and "params" in x1) or (mismatched and (nested or containers)):
        if isinstance(x1, Mapping):
            what = f"a dict of {sorted(map(str, x1))[:4]}"
        else:
            what = f"a {type(x1).__name__} of length {len(x1)} where x2 is one array"
        fix = f"call {fn_name}({models}, x1, x2=None, *, key=key, n_samples=S): no parameters"
        raise bad(TypeError, fn_name, f"x1 is {what}, which looks like a model's parameters", fix)


def check_init_kwargs(fn_name: str, init_kwargs) -> dict | None:
    """``init_kwargs`` as a dict (None stays None); anything but a mapping is refused."""
    if init_kwargs is None or isinstance(init_kwargs, Mapping):
        return None if init_kwargs is None else dict(init_kwargs)
    got = type(init_kwargs).__name__
    raise must(TypeError, fn_name, "init_kwargs", "a dict", got, eg="{'is_training': True}")


def check_samples(caller: Caller, key, n_samples, batch_size_samples, options=None, own=()) -> None:
    """Validates the sampling arguments and ``options`` (``own``: the caller's other keywords,
    for suggestions); no ``batch_size`` with samples vmapped together."""
    fn_name, options = caller.name, options or {}
    for name, v in (("n_samples", n_samples), ("batch_size_samples", batch_size_samples)):
        check_int(fn_name, name, v, f"pass e.g. {name}=4", type_error=ValueError)
    check_key(fn_name, key)
    if unknown := sorted(set(options) - set(_KERNEL_OPTIONS)):
        close = {u: misspelt(u, _KERNEL_OPTIONS + list(own)) for u in unknown}
        guess = "".join(f" (did you mean {c!r} for {u!r}?)" for u, c in close.items() if c)
        what = f"unknown option(s) {', '.join(map(repr, unknown))}{guess}"
        fix = f"use {', '.join(own)} or the options of ntk_fn"
        fix += "; model arguments go in apply_kwargs" if "apply_kwargs" in own else ""
        raise bad(TypeError, fn_name, what, fix)
    if (batch_size := options.get("batch_size")) is not None and batch_size_samples > 1:
        make_options(fn_name, batch_size=batch_size)  # an invalid value first
        what = f"batch_size cannot run inside batch_size_samples={batch_size_samples!r}"
        raise bad(ValueError, fn_name, what, "pass batch_size_samples=1 with batch_size")


def average(fn_name, sample, key, n_samples, batch_size_samples, progress, x1, x2, files):
    """Mean of ``sample(k)`` (an ``(nngp, ntk)`` pair) over ``jax.random.split(key, n_samples)``,
    summed in float32 or wider, in the kernels' dtype. Vmapped over b > 1 keys the kernel
    functions cannot check, so x1, x2 and the mean are checked for NaN/Inf here. With
    ``files`` (``out=``) the kernel functions add each sample's tiles to the sums on disk."""
    n_samples, batch_size_samples = operator.index(n_samples), operator.index(batch_size_samples)
    for name, x in zip(_INPUTS, (x1, x2), strict=True) if files is None else ():
        if x is not None:
            check_finite_input(fn_name, name, x)
    keys = jax.random.split(key, n_samples)
    _flags(fn_name, none_ok=True, progress=progress)
    if (bar := _progress.progress_bar(fn_name, progress, n_samples)) is None:
        bar = _progress.NO_BAR
    if files is not None:
        first = min(files.first, n_samples - 1)  # the finished means: checked, then returned
        if first:
            bar.update(first)
        for s in range(first, n_samples):
            files.sample = s  # the next kernel calls' sample
            nngp, ntk = sample(keys[s])
            bar.update(1)
        bar.close()
        files.finish()
        return Kernels(nngp=nngp, ntk=ntk)
    dtypes = {}

    def wide(a):
        return a.astype(jnp.promote_types(a.dtype, jnp.float32))

    def summed(ks):  # jitted; records the kernels' dtypes while it traces
        out = jax.vmap(sample)(ks)
        dtypes[0] = jax.tree.map(lambda a: a.dtype, out)
        return jax.tree.map(lambda a: wide(a).sum(0), out)

    batched = jit_tuned(summed, EXACT_CPU_OPTIONS)  # one compilation per batch size
    total = None
    for start in range(0, n_samples, batch_size_samples):
        stop = min(n_samples, start + batch_size_samples)
        which = f" {start}" if stop == start + 1 else f"s {start}..{stop - 1}"
        where = f"initialisation{which} (keys jax.random.split(key, {n_samples})[{start}:{stop}])"
        if batch_size_samples == 1:
            try:
                k = sample(keys[start])
            except NonFiniteError as e:
                inner = str(e).removeprefix(f"{fn_name}: ")
                raise NonFiniteError(f"{fn_name}: in {where}: {inner}") from e
            dtypes[0] = jax.tree.map(lambda a: a.dtype, k)
            k = jax.tree.map(wide, k)
        else:
            k = batched(keys[start:stop])
        _check_finite_sum(fn_name, k, where)
        total = k if total is None else jax.tree.map(_add, total, k)
        bar.update(stop - start)
    bar.close()
    mean = jax.tree.map(lambda s, d: (s / n_samples).astype(d), total, dtypes[0])
    _check_finite_sum(fn_name, mean, "the mean, cast back to the kernels' dtype")
    return Kernels(*mean)


def _add(total, k):
    """total + k; a host (numpy) total (``batch_size``) stays on the host, summed in place."""
    if isinstance(total, np.ndarray) and isinstance(k, np.ndarray):
        return np.add(total, k, out=total)
    return jnp.add(total, k)


def _check_finite_sum(fn_name: str, kernels, where: str) -> None:
    """NonFiniteError if the (NNGP, NTK) sums of ``where`` hold NaN/Inf (not under jax.jit)."""
    for name, kernel in zip(KINDS, kernels, strict=True):
        if any(all_finite(a) is False for a in jax.tree.leaves(kernel)):
            what = f"the {name.upper()} came out non-finite (NaN or Inf) in {where}"
            raise non_finite(fn_name, what)


_SIGNATURES = "init_fn(key) -> params, apply_fn(params, x)"
#: The parameters come from init_fn: neural-tangents' (x1, x2, params) does not apply.
_MONTE_CARLO_KERNELS = Caller(
    "monte_carlo_kernels", "(init_fn, apply_fn, x1, x2)", monte_carlo=True
)


def monte_carlo_kernels(
    init_fn: Callable,
    apply_fn: Callable,
    x1,
    x2=None,
    *,
    key,
    n_samples: int,
    batch_size_samples: int = 1,
    progress: bool | None = None,
    trace_axes=DEFAULTS.trace_axes,
    diagonal_axes=DEFAULTS.diagonal_axes,
    vmap_axes=DEFAULTS.vmap_axes,
    implementation=DEFAULTS.implementation,
    precision=DEFAULTS.precision,
    wrt=DEFAULTS.wrt,
    batch_size=DEFAULTS.batch_size,
    store_on_device=DEFAULTS.store_on_device,
    memory_budget=DEFAULTS.memory_budget,
    out=DEFAULTS.out,
    resume=DEFAULTS.resume,
    overwrite=DEFAULTS.overwrite,
    devices=DEFAULTS.devices,
) -> Kernels:
    """Monte Carlo NNGP and NTK: empirical kernels averaged over random initialisations.

        K_MC(x1, x2) = (1/S) Σ_s f_s(x1) f_s(x2)ᵀ,   Θ_MC(x1, x2) = (1/S) Σ_s J_s(x1) J_s(x2)ᵀ,

    with f_s = ``apply_fn(init_fn(k_s), ·)``, k_s = ``jax.random.split(key, S)[s]``,
    S = ``n_samples``: the mean of S :func:`empirical_nngp` / :func:`empirical_ntk` calls
    with these keys and options, summed in float32 or wider. They approach the
    infinite-width kernels as the width grows; the Monte Carlo error shrinks as 1/√S.

    Args:
      init_fn: ``init_fn(key) -> params``, e.g. ``lambda k: model.init(k, x)["params"]``.
      apply_fn: ``apply_fn(params, x) -> outputs``, as in :func:`ntk_fn`.
      x1: pytree of arrays with batch axis 0 of size N1; x2: ``None`` (x1: exactly
        symmetric kernels) or like x1 with N2 samples.
      key, n_samples: one PRNG key; S >= 1.
      batch_size_samples: samples vmapped together (one compilation per batch size),
        default 1 (least memory).
      progress: tqdm bar over the samples: ``None`` only in a terminal outside CI,
        ``True`` always (needs tqdm), ``False`` never.
      trace_axes, diagonal_axes, vmap_axes, implementation, precision, wrt: see
        :mod:`ntk_core._kernel.options` (the NNGP ignores ``implementation`` and ``wrt``);
        ``wrt``: Θ_MC of a parameter subset, (1/S) Σ_s J_s,S(x1) J_s,S(x2)ᵀ, the mean of the
        S subset kernels ``empirical_ntk(..., wrt=wrt)`` (names and predicates read each
        initialisation's parameter paths).
      batch_size, store_on_device, memory_budget, devices: the blocked engine for each
        sample, as in :func:`ntk_fn` (only with ``batch_size_samples=1``; host arrays
        unless ``store_on_device=True``).
      out, resume, overwrite: with ``batch_size``, ``out="mc.npy"`` writes the means to
        ``mc.nngp.npy`` and ``mc.ntk.npy``, the running sum on disk (two files of each
        kernel's size per kind, three for half precision); ``resume=True`` finishes a
        killed run bit for bit.

    Returns ``Kernels(nngp, ntk)`` in the layout of :func:`empirical_ntk` (``(N1, N2)`` by
    default, ``(N1, N2, O, O)`` with ``trace_axes=()``), the outputs' dtype; with ``out``,
    read-only memory maps. Feed it to :func:`ntk_core.predict.gp_inference`.

    Raises:
      TypeError: ``init_fn`` or ``apply_fn`` not callable, ``key`` not one PRNG key,
        ``progress`` not a bool or None; and the errors of :func:`ntk_fn`.
      ValueError: ``n_samples`` or ``batch_size_samples`` not a positive int;
        ``batch_size`` with ``batch_size_samples`` > 1; ``init_fn(key)`` failing (it runs
        under ``jax.jit``); NaN/Inf in x1, x2 or the mean; with ``out``, existing files
        without ``resume``/``overwrite``, a resume of a different call (naming what
        differs), too little disk space; and the errors of :func:`ntk_fn`.
      ImportError: ``progress=True`` without tqdm.

    Cost: S initialisations, S times the cost of :func:`ntk_fn` plus a forward pass on x1
    and x2; memory of two kernels of each kind.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import ntk_core
      >>> init_fn = lambda k: jax.random.normal(k, (3, 2))
      >>> apply_fn = lambda w, x: jnp.tanh(x @ w)
      >>> x1 = jnp.ones((4, 3))                                   # (N1, 3)
      >>> k = ntk_core.monte_carlo_kernels(init_fn, apply_fn, x1,
      ...                                  key=jax.random.PRNGKey(0), n_samples=8)
      >>> k.nngp.shape, k.ntk.shape
      ((4, 4), (4, 4))

    References: Novak et al., "Bayesian Deep Convolutional Networks with Many Channels are
    Gaussian Processes", ICLR 2019; Lee et al., "Wide Neural Networks of Any Depth Evolve as
    Linear Models Under Gradient Descent", NeurIPS 2019.
    """
    fn = _MONTE_CARLO_KERNELS.name
    for name, f in (("init_fn", init_fn), ("apply_fn", apply_fn)):
        if not callable(f):
            raise must(TypeError, fn, name, "callable", type(f).__name__, _SIGNATURES)
    if _takes_shape(init_fn):
        if required_positional(apply_fn) == 1:  # apply_fn(params, x) and init_fn(key) swapped
            what = "init_fn takes 2 arguments and apply_fn 1: they look swapped"
            raise bad(TypeError, fn, what, f"pass them in the order ({_SIGNATURES})")
        raise bad(TypeError, fn, "init_fn takes (key, shape), not (key)", f"pass {_STAX_INIT}")
    blocked = dict(batch_size=batch_size, store_on_device=store_on_device)
    check_samples(_MONTE_CARLO_KERNELS, key, n_samples, batch_size_samples, blocked)
    check_inputs(fn, x1, x2, "init_fn, apply_fn")
    # the kernel options among the arguments (the outermost iterable runs in this scope)
    options = {k: v for k, v in locals().items() if k in _KERNEL_OPTIONS}
    options.update(progress=False)  # the bar is the samples'
    init = initialiser(fn, jax.jit(init_fn), "init_fn(key)", _SIGNATURES)

    def kernels(kind, kind_options):
        return _make(kind, _MONTE_CARLO_KERNELS, apply_fn, kind_options)

    args = (x1, x2, key, n_samples, batch_size_samples, progress, options)
    return sample_mean(fn, init, kernels, *args)


def sample_mean(
    fn_name, init, kernels, x1, x2, key, n_samples, batch_size_samples, progress, options: dict
) -> Kernels:
    """The Monte Carlo kernels' mean over ``n_samples`` keys, checked: ``init(k)`` one
    initialisation (see :func:`initialiser`), ``kernels(kind, kind_options)`` a function
    ``(init(k), x1, x2)`` -> that initialisation's ``"ntk"`` or ``"nngp"``."""
    checked = make_options(fn_name, **options)  # as the kernel functions would check them
    args = (fn_name, checked, key, n_samples, x1, x2, init)
    files = None if checked.out is None else MonteCarloFiles(*args)
    nngp, ntk = (kernels(kind, kind_options(kind, options, files)) for kind in KINDS)

    def sample(k):
        state = init(k)
        return nngp(state, x1, x2), ntk(state, x1, x2)

    return average(fn_name, sample, key, n_samples, batch_size_samples, progress, x1, x2, files)


def initialiser(
    fn_name: str, init: Callable, call: str, expected: str, otherwise: str | None = None
) -> Callable:
    """``init`` whose failures raise ValueError naming ``call``, with ``otherwise`` or a fix
    saying it must be a pure JAX function of the key (``expected``) run under jit."""

    def checked(k):
        try:
            return init(k)
        except Exception as e:
            traced = (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError)
            fix = f"make {call} a pure JAX function of the key ({expected})"
            if isinstance(e, traced):
                fix += ", no float() or if on arrays: it runs under jax.jit"
            elif otherwise:
                fix = otherwise
            raise bad(ValueError, fn_name, f"{call} failed with {one_line(e)}", fix) from e

    return checked


def _takes_shape(init_fn) -> bool:
    """Whether ``init_fn`` takes two positional arguments (stax's ``(key, input_shape)``)."""
    return (required_positional(init_fn) or 0) >= 2


_STAX_INIT = "lambda k: init_fn(k, x1.shape)[1]"


def _nt_style_hint(fn):
    """Answers a TypeError of a neural-tangents-style call ``(init_fn, apply_fn, key,
    n_samples)`` with the equivalent call here."""
    checked = _checked_arguments(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return checked(*args, **kwargs)
        except TypeError as e:
            n = args[3] if len(args) >= 4 else None
            if not isinstance(n, int) or isinstance(n, bool):
                raise
            init = _STAX_INIT if _takes_shape(args[0]) else "init_fn"
            what = "the arguments look like neural-tangents' (init_fn, apply_fn, key, n_samples)"
            fix = f"{fn.__name__}({init}, apply_fn, x1, x2, key=key, n_samples={n!r})"
            raise bad(TypeError, fn.__name__, what, fix) from e

    return call


monte_carlo_kernels = _nt_style_hint(monte_carlo_kernels)
