"""Monte Carlo NNGP and NTK: averages of empirical kernels over random initialisations."""

from __future__ import annotations

import difflib
import functools
import inspect
import operator
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._api import _make
from ntk_core._blocked import progress as _progress
from ntk_core._errors import NonFiniteError, bad, one_line
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._kernel.caller import Caller
from ntk_core._kernel.checks import all_finite, check_finite_input
from ntk_core._kernel.options import DEFAULTS, make_options
from ntk_core._monte_carlo.files import MonteCarloFiles, kind_options
from ntk_core._predict.inference import Kernels


def progress_bar(fn_name: str, progress, total: int, desc: str):
    """A tqdm bar of ``total`` samples (advance with ``.update(k)``), or None;
    :func:`ntk_core._blocked.progress.show_progress` decides whether it is shown (``None``: only
    when stderr is a terminal, outside CI and not with ``TERM=dumb``)."""
    if progress is not None and not isinstance(progress, bool):
        what = f"progress must be None, True or False, got {progress!r}"
        raise bad(TypeError, fn_name, what, "pass progress=True")
    return _progress.progress_bar(desc, progress, total)


_KERNEL_OPTIONS = [n for n in inspect.signature(make_options).parameters if n != "fn_name"]


def check_inputs(fn_name: str, x1, x2, models: str = "model") -> None:
    """x1 and x2 must be arrays (or pytrees of them) with a batch axis, not Python lists
    or parameters (the adapters' Monte Carlo functions slice ``x1[:1]`` for init);
    ``models``: the function's arguments before x1, for the fix."""
    for name, x in (("x1", x1), ("x2", x2)):
        if x is None:
            continue
        leaves = jax.tree.leaves(x)
        if not leaves or any(np.ndim(leaf) == 0 for leaf in leaves):
            what = f"{name} must be arrays with a batch axis 0, got {type(x).__name__}"
            raise bad(TypeError, fn_name, what, f"pass np.asarray({name}), shape (N, ...)")
    nested = isinstance(x1, Mapping) and all(isinstance(v, Mapping) for v in x1.values())
    flax_variables = nested and "params" in x1
    mismatched = x2 is not None and jax.tree.structure(x2) != jax.tree.structure(x1)
    # a container (dict, list of layers) where x2 is one array: the parameters, most likely
    container_vs_array = isinstance(x1, Mapping | list | tuple) and not isinstance(
        x2, Mapping | list | tuple
    )
    if flax_variables or (mismatched and (nested or container_vs_array)):
        what = (
            f"a dict of {sorted(map(str, x1))[:4]}"
            if isinstance(x1, Mapping)
            else f"a {type(x1).__name__} of {len(x1)} "
            f"{'entry' if len(x1) == 1 else 'entries'} where x2 is one array"
        )
        what = f"x1 is {what}, which looks like a model's parameters"
        fix = f"call {fn_name}({models}, x1, x2=None, *, key=key, n_samples=S): no parameters"
        raise bad(TypeError, fn_name, what, fix)


def check_init_kwargs(fn_name: str, init_kwargs) -> dict | None:
    """``init_kwargs`` as a dict (None stays None); anything but a mapping is refused."""
    if init_kwargs is None:
        return None
    if not isinstance(init_kwargs, Mapping):
        what = f"init_kwargs must be a dict, got {type(init_kwargs).__name__}"
        raise bad(TypeError, fn_name, what, "pass e.g. init_kwargs={'is_training': True}")
    return dict(init_kwargs)


def check_samples(caller: Caller, key, n_samples, batch_size_samples, options=None, own=()) -> None:
    """Validates the sampling arguments (numpy integers count as ints) and ``options``
    (unknown names are refused, naming the kernel options and ``own``, the function's
    other keyword arguments); refuses the blocked engine's ``batch_size`` when samples
    are vmapped together."""
    fn_name = caller.name
    for name, v in (("n_samples", n_samples), ("batch_size_samples", batch_size_samples)):
        try:
            ok = not isinstance(v, bool) and operator.index(v) >= 1
        except TypeError:
            ok = False
        if not ok:
            what = f"{name} must be a positive int, got {v!r}"
            raise bad(ValueError, fn_name, what, f"pass e.g. {name}=4")
    if not isinstance(key, jax.Array) or not (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or key.shape == (2,)
    ):
        shape = f" of shape {key.shape}" if isinstance(key, jax.Array) else ""
        what = f"key must be one PRNG key, got {type(key).__name__}{shape}"
        raise bad(TypeError, fn_name, what, "pass key=jax.random.PRNGKey(seed)")
    unknown = sorted(set(options or {}) - set(_KERNEL_OPTIONS))
    if unknown:
        names = _KERNEL_OPTIONS + list(own)
        close = {u: difflib.get_close_matches(u, names, 1) for u in unknown}
        guess = "".join(f" Did you mean {c[0]!r} for {u!r}?" for u, c in close.items() if c)
        what = f"unknown option(s) {', '.join(map(repr, unknown))}.{guess}"
        fix = f"use {', '.join(own)} or the options of ntk_fn; model arguments go in apply_kwargs"
        raise bad(TypeError, fn_name, what, fix)
    if (options or {}).get("batch_size") is not None and operator.index(batch_size_samples) > 1:
        make_options(fn_name, batch_size=options["batch_size"])  # an invalid value first
        what = f"batch_size cannot run inside batch_size_samples={batch_size_samples!r}"
        raise bad(ValueError, fn_name, what, "pass batch_size_samples=1 with batch_size")


def average(
    fn_name: str,
    sample: Callable,
    key,
    n_samples: int,
    batch_size_samples: int,
    progress,
    x1=None,
    x2=None,
    files=None,
) -> Kernels:
    """Mean over ``keys = jax.random.split(key, n_samples)`` of ``sample(keys[i])``,
    which returns ``(nngp, ntk)`` pytrees; sums in float32 or wider (half-precision
    kernels lose digits and overflow in a running sum), then divides and returns the
    kernels' dtype. With ``batch_size_samples`` b > 1, ``sample`` is vmapped over b keys
    at a time, where the kernel functions cannot check their inputs and results: ``x1``
    and ``x2`` are checked for NaN/Inf first, and the mean afterwards. With ``files``
    (``out=``), the kernel functions write into them and the sum is kept on disk
    (:func:`average_into`)."""
    # the callers ran check_samples (with their options) before building anything
    n_samples, batch_size_samples = operator.index(n_samples), operator.index(batch_size_samples)
    if files is not None:
        return average_into(files, fn_name, sample, key, n_samples, progress)
    for name, x in (("x1", x1), ("x2", x2)):
        if x is not None:
            check_finite_input(fn_name, name, x)
    keys = jax.random.split(key, n_samples)

    def wide(a):
        return a.astype(jnp.promote_types(a.dtype, jnp.float32))

    dtypes = {}

    def summed(ks):  # jitted; records the kernels' dtypes while it traces
        out = jax.vmap(sample)(ks)
        dtypes["kernels"] = jax.tree.map(lambda a: a.dtype, out)
        return jax.tree.map(lambda a: wide(a).sum(0), out)

    batched = jax.jit(summed)  # one compilation per batch size
    bar = progress_bar(fn_name, progress, n_samples, fn_name)
    total = None
    for start in range(0, n_samples, batch_size_samples):
        stop = min(n_samples, start + batch_size_samples)
        where = (
            f"initialisation {start}"
            if stop == start + 1
            else f"initialisations {start}..{stop - 1}"
        ) + f" (keys jax.random.split(key, {n_samples})[{start}:{stop}])"
        if batch_size_samples == 1:
            try:
                k = sample(keys[start])
            except ValueError as e:
                if not isinstance(e, NonFiniteError):
                    raise
                inner = str(e).removeprefix(f"{fn_name}: ")
                raise NonFiniteError(f"{fn_name}: in {where}: {inner}") from e
            dtypes["kernels"] = jax.tree.map(lambda a: a.dtype, k)
            k = jax.tree.map(wide, k)
        else:
            k = batched(keys[start:stop])
        _check_finite_sum(fn_name, k, where)
        total = k if total is None else jax.tree.map(_add, total, k)
        if bar is not None:
            bar.update(stop - start)
    if bar is not None:
        bar.close()
    mean = jax.tree.map(lambda s, d: (s / n_samples).astype(d), total, dtypes["kernels"])
    _check_finite_sum(fn_name, mean, "the mean, cast back to the kernels' dtype")
    nngp, ntk = mean
    return Kernels(nngp=nngp, ntk=ntk)


def average_into(files, fn_name: str, sample: Callable, key, n_samples: int, progress) -> Kernels:
    """:func:`average` with ``out=``: sample s's kernel functions add their tiles to
    the running sums in ``files`` (:mod:`ntk_core._monte_carlo.files`), one sample
    after another from the first not yet summed; the last writes the means, returned
    as read-only memory maps. Each tile is checked for NaN/Inf by the blocked engine."""
    keys = jax.random.split(key, n_samples)
    first = min(files.first, n_samples - 1)  # the finished means: checked, then returned
    bar = progress_bar(fn_name, progress, n_samples, fn_name)
    if bar is not None and first:
        bar.update(first)
    for s in range(first, n_samples):
        files.begin(s)
        nngp, ntk = sample(keys[s])
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    files.finish()
    return Kernels(nngp=nngp, ntk=ntk)


def _add(total, k):
    """total + k; a host (numpy) total stays on the host, summed in place: with
    ``batch_size`` each sample's kernel is a host array, which may not fit the device."""
    if isinstance(total, np.ndarray) and isinstance(k, np.ndarray):
        return np.add(total, k, out=total)
    return jnp.add(total, k)


def _check_finite_sum(fn_name: str, kernels, where: str) -> None:
    """Raises a :class:`NonFiniteError` when the (NNGP, NTK) sums of
    ``where`` hold NaN or Inf; under an outer jax.jit (abstract values) nothing is
    checked."""
    for name, kernel in zip(("NNGP", "NTK"), kernels, strict=True):
        for a in jax.tree.leaves(kernel):
            if all_finite(a) is False:
                what = f"the {name} came out non-finite (NaN or Inf) in {where}"
                fix = "check the model on that initialisation, or compute in float64"
                raise bad(NonFiniteError, fn_name, what, fix, see="non-finite-kernel")


#: :func:`monte_carlo_kernels` as its messages name it (ntk_core._kernel.caller): the
#: parameters come from init_fn, so neural-tangents' (x1, x2, params) does not apply.
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

    with f_s = ``apply_fn(init_fn(k_s), ·)`` and k_s = ``jax.random.split(key, S)[s]``,
    S = ``n_samples``. As the width grows they approach the infinite-width NNGP and NTK;
    with S samples the Monte Carlo error shrinks as 1/√S. Each average equals the mean
    of S separate :func:`empirical_nngp` / :func:`empirical_ntk` calls with the same
    keys and options. Samples run ``batch_size_samples`` at a time (vmapped), one
    compiled kernel function for all batches of that size (a ragged last batch compiles
    once more); memory is that of one batch's kernels and features plus the running sum.
    The running sum is kept in float32 or wider (a half-precision sum would drop the
    low bits of late samples), and the mean returned in the kernels' dtype.

    Args:
      init_fn: ``init_fn(key) -> params``, e.g. ``lambda k: model.init(k, x)["params"]``.
      apply_fn: ``apply_fn(params, x) -> outputs``, as in :func:`ntk_fn`.
      x1: pytree of arrays with batch axis 0 of size N1.
      x2: ``None`` (x2 is x1: exactly symmetric kernels) or like x1 with N2 samples.
      key: one PRNG key; sample s uses ``jax.random.split(key, n_samples)[s]``.
      n_samples: S >= 1.
      batch_size_samples: samples computed together (``jax.vmap`` over their keys),
        default 1 (one after another, least memory).
      progress: tqdm progress bar over the samples, on stderr: ``None`` (default)
        shows it only when stderr is a terminal, the environment variable ``CI`` is
        unset or false-ish (``""``, ``0``, ``false``, ``no``, ``off``) and ``TERM`` is
        not ``dumb`` (as ``progress`` in :mod:`ntk_core._kernel.options`); ``True`` always
        (needs tqdm), ``False`` never.
      trace_axes, diagonal_axes, vmap_axes, implementation, precision: see
        :mod:`ntk_core._kernel.options` (the NNGP ignores ``implementation``).
      batch_size, store_on_device, memory_budget, devices: the blocked engine for each
        sample's kernels, as in :func:`ntk_fn` (only with ``batch_size_samples=1``);
        with ``batch_size`` the kernels and their running sum are host numpy arrays
        unless ``store_on_device=True``.
      out, resume, overwrite: with a ``batch_size``, the means written to files:
        ``out="mc.npy"`` writes the NNGP's to ``mc.nngp.npy`` and the NTK's to
        ``mc.ntk.npy``, keeping the running sum on disk (host memory holds the tiles
        in flight), and an interrupted run (killed at any moment) is finished with
        ``resume=True`` from the sample it was in, bit for bit equal to an
        uninterrupted run; see :mod:`ntk_core._monte_carlo.files`. Disk: two files of
        each kernel's size per kind (three for half-precision kernels).

    Returns:
      ``Kernels(nngp, ntk)``, each in the layout of :func:`empirical_ntk` (``(N1, N2)``
      for ``(N, O)`` outputs by default; ``(N1, N2, O, O)`` with ``trace_axes=()``),
      dtype of the outputs. Feed it to :func:`ntk_core.predict.gp_inference`. With
      ``out``, each a read-only memory map of its file (``np.load(path,
      mmap_mode="r")``).

    Raises:
      TypeError: ``init_fn`` or ``apply_fn`` not callable, ``key`` not one PRNG key,
        ``progress`` not a bool or None; and the errors of :func:`ntk_fn`.
      ValueError: ``n_samples`` or ``batch_size_samples`` not a positive int;
        ``batch_size`` with ``batch_size_samples`` > 1; ``init_fn(key)`` failing (it
        runs under ``jax.jit``); NaN/Inf in x1 or x2; a non-finite mean (some
        initialisation gave a non-finite kernel); with ``out``, files of the run that
        exist without ``resume``/``overwrite``, a resume of a different call (naming
        what differs), too little disk space; and the errors of :func:`ntk_fn`.
      ImportError: ``progress=True`` without tqdm.

    Cost: S initialisations, and S times the cost of :func:`ntk_fn` plus one forward
    pass on x1 and x2 (see :mod:`ntk_core._impl.cost`); memory of two kernels of each kind.

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

    References:
      Novak et al., "Bayesian Deep Convolutional Networks with Many Channels are
      Gaussian Processes", ICLR 2019 (Monte Carlo kernels); Lee et al., "Wide Neural
      Networks of Any Depth Evolve as Linear Models Under Gradient Descent", NeurIPS 2019.
    """
    fn = _MONTE_CARLO_KERNELS.name
    for name, f in (("init_fn", init_fn), ("apply_fn", apply_fn)):
        if not callable(f):
            what = f"{name} must be callable, got {type(f).__name__}"
            raise bad(TypeError, fn, what, "pass init_fn(key) -> params, apply_fn(params, x)")
    if _takes_shape(init_fn):
        what = "init_fn takes (key, shape), like neural-tangents' stax; here init_fn(key)"
        raise bad(TypeError, fn, what, "pass lambda k: init_fn(k, x1.shape)[1]")
    blocked = dict(batch_size=batch_size, store_on_device=store_on_device)
    check_samples(_MONTE_CARLO_KERNELS, key, n_samples, batch_size_samples, blocked)
    check_inputs(fn, x1, x2, "init_fn, apply_fn")
    options = dict(
        implementation=implementation,
        trace_axes=trace_axes,
        diagonal_axes=diagonal_axes,
        vmap_axes=vmap_axes,
        precision=precision,
        memory_budget=memory_budget,
        progress=False,  # the samples have their own bar
        out=out,
        resume=resume,
        overwrite=overwrite,
        devices=devices,
        **blocked,
    )
    init = initialiser(fn, jax.jit(init_fn), "init_fn(key)", "init_fn(key) -> params")

    def kernels(kind, kind_options):
        return _make(kind, _MONTE_CARLO_KERNELS, apply_fn, kind_options)

    return sample_mean(
        fn, init, kernels, x1, x2, key, n_samples, batch_size_samples, progress, options
    )


def sample_mean(
    fn_name: str,
    init: Callable,
    kernels: Callable,
    x1,
    x2,
    key,
    n_samples: int,
    batch_size_samples: int,
    progress,
    options: dict,
) -> Kernels:
    """The Monte Carlo kernels' mean over ``n_samples`` keys (after their checks):
    ``init(k)`` makes one initialisation (wrap it with :func:`initialiser`),
    ``kernels(kind, kind_options)`` (``kind`` ``"ntk"`` or ``"nngp"``) returns
    ``f(init(k), x1, x2)`` -> that initialisation's kernel; ``options`` with ``out``
    keep the running sums on disk (resumable)."""
    files = files_for(fn_name, options, key, n_samples, x1, x2, init)
    ntk = kernels("ntk", kind_options("ntk", options, files))
    nngp = kernels("nngp", kind_options("nngp", options, files))

    def sample(k):
        state = init(k)
        return nngp(state, x1, x2), ntk(state, x1, x2)

    return average(fn_name, sample, key, n_samples, batch_size_samples, progress, x1, x2, files)


def files_for(fn_name: str, options: dict, key, n_samples, x1, x2, init):
    """The :class:`~ntk_core._monte_carlo.files.MonteCarloFiles` of a call whose kernel
    ``options`` have ``out``, or None; the options are checked first (as the kernel
    functions would: out without batch_size, resume without out, ...)."""
    checked = make_options(fn_name, **options)
    if checked.out is None:
        return None
    return MonteCarloFiles(
        fn_name, checked.out, checked.resume, checked.overwrite, key, n_samples, x1, x2, init
    )


def initialiser(
    fn_name: str, init: Callable, call: str, expected: str, otherwise: str = ""
) -> Callable:
    """``init`` whose failures become a ValueError naming ``call`` and the fix: for a
    traced value used as a Python value, that it runs under jit; else ``otherwise``
    (default: that it be a pure JAX function of the key, ``expected``)."""

    def checked(k):
        try:
            return init(k)
        except Exception as e:
            traced = isinstance(
                e, (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError)
            )
            fix = f"make {call} a pure JAX function of the key ({expected})"
            if traced:
                fix += ", no float() or if on arrays: it runs under jax.jit"
            elif otherwise:
                fix = otherwise
            raise bad(ValueError, fn_name, f"{call} failed with {one_line(e)}", fix) from e

    return checked


def _takes_shape(init_fn) -> bool:
    """Whether ``init_fn`` needs two positional arguments (neural-tangents' stax
    ``init_fn(key, input_shape)``) rather than a key alone."""
    try:
        parameters = inspect.signature(init_fn).parameters.values()
    except (TypeError, ValueError):  # builtins and other objects without a signature
        return False
    required = [
        p
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return len(required) >= 2


def _nt_style_hint(fn):
    """A neural-tangents-style call ``(init_fn, apply_fn, key, n_samples)`` is refused
    with the equivalent call here (checked only after a TypeError)."""
    checked = _checked_arguments(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return checked(*args, **kwargs)
        except TypeError as e:
            if len(args) >= 4 and isinstance(args[3], int) and not isinstance(args[3], bool):
                init = "lambda k: init_fn(k, x1.shape)[1]" if _takes_shape(args[0]) else "init_fn"
                what = (
                    "the arguments look like neural-tangents' (init_fn, apply_fn, key, n_samples)"
                )
                fix = (
                    f"monte_carlo_kernels({init}, apply_fn, x1, x2, key=key, n_samples={args[3]!r})"
                )
                raise bad(TypeError, "monte_carlo_kernels", what, fix) from e
            raise

    return call


monte_carlo_kernels = _nt_style_hint(monte_carlo_kernels)
