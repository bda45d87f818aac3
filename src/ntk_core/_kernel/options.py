"""The keyword options shared by every kernel entry point (referred to by every public
docstring); :class:`KernelOptions` holds their defaults, :func:`make_options` validates them.

trace_axes:
    Output axes (int or ints, negative from the end; not the batch axis 0) summed over
    and divided by their size (an average, as neural-tangents), absent from the result.
    Default ``(-1,)``.
diagonal_axes:
    Output axes of which only the diagonal is computed, once in the result; the batch
    axis 0 gives K(x1_i, x2_i) at O(N) cost (N1 == N2). Disjoint from ``trace_axes``.
    Default ``()``.
vmap_axes:
    ``0`` (default): independent samples, per-sample derivatives by ``jax.vmap`` over axis
    0 of every input leaf (the model sees batches of one). ``None``: the model sees the
    whole batch; required when samples interact (BatchNorm in training mode).
implementation:
    ``"auto"`` (default: the cheapest by the cost model), ``"jacobian"`` (Jacobian
    contraction), ``"ntvp"`` (NTK-vector products) or ``"structured"`` (Gram identities
    for matrix products, convolutions, embeddings and their biases, Jacobians for the
    other leaves; the Jacobian contraction with ``vmap_axes=None``). :data:`IMPLEMENTATIONS`.
precision:
    ``"highest"`` (default), ``"high"`` or ``"default"``: the precision of every matmul,
    the model's included; below ``"highest"`` GPUs and TPUs may use TF32 or bf16.
wrt:
    NTK only. The parameter leaves the kernel is taken with respect to, the others held
    fixed (:mod:`ntk_core._kernel.subset`); cost scales with the subset's size. ``None``
    (default): all. A path name or a list of them: leaves whose path, its keys joined by
    ``/``, is a name or starts with ``name/`` (``"Dense_1"``, ``"Dense_1/bias"``, Haiku's
    ``"mlp/~/linear_1"``), each name selecting at least one leaf. A predicate ``wrt(path)
    -> bool`` on the path as a tuple of keys (dict keys, attribute names, indices), e.g.
    ``lambda path: path[-1] == "bias"``. Per-leaf kernels hold None at the held leaves.
batch_size:
    ``None`` (default): one call, a ``jax.Array`` on the device. An int B: B x B tiles by
    the blocked engine (:mod:`ntk_core._blocked.tiles`), any N1, N2 (the last tile ragged),
    features once per block, with ``x2=None`` only tiles on and above the diagonal
    (exactly symmetric); equal to the unbatched result to 1e-5·max|K| in float32.
    ``"auto"``: the largest B whose working memory fits ``memory_budget``, at most
    ``max(N1, N2)``. With ``vmap_axes=None`` each block is its own batch.
store_on_device:
    Batched only. ``False`` (default): assembled in host memory (``numpy.ndarray``);
    ``True``: on the device (``jax.Array``).
progress:
    Batched only. A tqdm bar over tiles on stderr. ``None`` (default): when stderr is a
    terminal, ``CI`` is unset or false-ish (``""``, ``0``, ``false``, ``no``, ``off``) and
    ``TERM`` is not ``dumb``; ``True`` / ``False``: always / never.
memory_budget:
    Bytes of device memory for the blocked engine's features, tiles and (with
    ``store_on_device``) output: sizes ``batch_size="auto"`` and the blocks kept. With
    ``vmap_axes=None`` it also bounds the reverse passes of the Jacobian contraction (as
    many output cotangents at a time as fit; a batch whose forward and one reverse pass
    exceed it is refused). ``None`` (default): half the allocator's ``bytes_limit`` where
    reported (GPUs), else :data:`DEFAULT_MEMORY_BUDGET` (1 GiB). Refused without a
    ``batch_size`` where ``vmap_axes=0`` (it would change nothing).
out:
    With a ``batch_size``. A path ending in ``.npy``: the Gram matrix written tile by tile
    into that file (host memory holds tiles in flight), with ``<path>.manifest.json``
    beside it; returned read-only memory-mapped, as :mod:`ntk_core.predict` takes. A
    finished file of the same call is returned as is (:mod:`ntk_core._blocked.store`).
resume:
    With ``out``. ``True``: finish an interrupted run's file (only missing tiles; equal bit
    for bit to an uninterrupted run); differing inputs or options are refused.
overwrite:
    With ``out``. ``True``: replace an existing file; ``False`` (default) refuses one that
    is not the finished result of the same call.
devices:
    Batched only. ``None`` (default): all local devices (one with ``store_on_device``), or
    a list of ``jax.Device``; row block i runs on device i mod D; results equal one
    device's.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Sequence

from ntk_core._blocked.sink import Sink
from ntk_core._errors import bad, must
from ntk_core._impl.registry import AUTO, REGISTRY
from ntk_core._kernel.kind import NTK_ONLY
from ntk_core._kernel.layout import Axes, axis_twice

#: Valid values of ``implementation``: ``"auto"`` and the registry's names.
IMPLEMENTATIONS = (AUTO, *REGISTRY)
#: ``batch_size="auto"``: the blocked engine sizes its tiles from ``memory_budget``.
AUTO_BATCH_SIZE = "auto"
#: neural-tangents' ``NtkImplementation`` values and their names here (refused with the
#: name to use, so that ported code says what it computes).
_NT_NAMES = ("AUTO", "JACOBIAN_CONTRACTION", "NTK_VECTOR_PRODUCTS", "STRUCTURED_DERIVATIVES")
NT_IMPLEMENTATIONS = dict(enumerate(zip(_NT_NAMES, IMPLEMENTATIONS, strict=True)))
#: Valid values of ``precision``, the default first.
PRECISIONS = ("highest", "high", "default")
#: Bytes the blocked engine may use when the device reports no memory limit (CPU).
DEFAULT_MEMORY_BUDGET = 2**30


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Validated, hashable options of one kernel function; the one place of the defaults."""

    trace_axes: Axes = (-1,)
    diagonal_axes: Axes = ()
    vmap_axes: int | None = 0
    implementation: str = AUTO
    precision: str = PRECISIONS[0]
    wrt: object = None  # None, a predicate on key paths, or path names (_kernel/subset.py)
    batch_size: int | str | None = None
    store_on_device: bool = False
    progress: bool | None = None
    memory_budget: int | None = None
    out: str | None = None  # or a _blocked.sink.Sink (Monte Carlo kernels, internal)
    resume: bool = False
    overwrite: bool = False
    devices: tuple | None = None


#: Every option at its default value; public signatures take their defaults from here.
DEFAULTS = KernelOptions()
#: The NTK and NNGP entry points' keyword options.
NTK_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(KernelOptions))
NNGP_OPTION_NAMES = tuple(n for n in NTK_OPTION_NAMES if n not in NTK_ONLY)


def _got(value) -> str:
    return f"{type(value).__name__} {value!r}"


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _one_of(fn_name: str, allowed, **given) -> None:
    """Refuses a value of ``given`` (one ``name=value``) not among the strings ``allowed``."""
    ((name, value),) = given.items()
    if not isinstance(value, str) or value not in allowed:
        expect = f"one of {', '.join(map(repr, allowed))}"
        raise must(ValueError, fn_name, name, expect, repr(value), eg=repr(allowed[0]))


def _flags(fn_name: str, none_ok=False, **given) -> None:
    """Refuses a non-bool value of ``given`` (``name=value``), None allowed if ``none_ok``."""
    for name, value in given.items():
        if not isinstance(value, bool) and not (value is None and none_ok):
            expect = "None, True or False" if none_ok else "True or False"
            raise must(TypeError, fn_name, name, expect, _got(value), eg=True)


def _axes(fn_name: str, **given) -> list[Axes]:
    """Each of ``given`` (``name=axes``) as a tuple of distinct ints."""
    found = []
    for name, value in given.items():
        is_seq = isinstance(value, Sequence) and not isinstance(value, str)
        if not (_is_int(value) or is_seq and all(map(_is_int, value))):
            raise must(TypeError, fn_name, name, "an int or a sequence of ints", _got(value), eg=())
        out = (int(value),) if _is_int(value) else tuple(int(v) for v in value)
        if len(set(out)) != len(out):
            raise axis_twice(fn_name, name, out)
        found.append(out)
    return found


def make_options(
    fn_name: str,
    *,
    trace_axes=DEFAULTS.trace_axes,
    diagonal_axes=DEFAULTS.diagonal_axes,
    vmap_axes=DEFAULTS.vmap_axes,
    implementation=DEFAULTS.implementation,
    precision=DEFAULTS.precision,
    wrt=DEFAULTS.wrt,
    batch_size=DEFAULTS.batch_size,
    store_on_device=DEFAULTS.store_on_device,
    progress=DEFAULTS.progress,
    memory_budget=DEFAULTS.memory_budget,
    out=DEFAULTS.out,
    resume=DEFAULTS.resume,
    overwrite=DEFAULTS.overwrite,
    devices=DEFAULTS.devices,
) -> KernelOptions:
    """Validates the shared options; raises TypeError/ValueError naming ``fn_name``."""
    trace, diag = _axes(fn_name, trace_axes=trace_axes, diagonal_axes=diagonal_axes)
    if vmap_axes is not None and (isinstance(vmap_axes, bool) or vmap_axes != 0):
        raise must(ValueError, fn_name, "vmap_axes", "0 or None", repr(vmap_axes), _move(vmap_axes))
    if not isinstance(implementation, (str, bool)) and implementation in NT_IMPLEMENTATIONS:
        nt, name = NT_IMPLEMENTATIONS[implementation]
        what = f"implementation={implementation!r} is neural-tangents' NtkImplementation.{nt}"
        raise bad(ValueError, fn_name, what, f"pass implementation={name!r}")
    _one_of(fn_name, IMPLEMENTATIONS, implementation=implementation)
    _one_of(fn_name, PRECISIONS, precision=precision)
    _block_options(fn_name, batch_size, memory_budget)
    if memory_budget is not None and batch_size is None and vmap_axes is not None:
        what = f"memory_budget={memory_budget} sizes the blocked engine's tiles"
        raise _needs_batch_size(fn_name, what, "'auto'")
    _flags(fn_name, store_on_device=store_on_device, resume=resume, overwrite=overwrite)
    _flags(fn_name, True, progress=progress)
    batch_size = int(batch_size) if _is_int(batch_size) else batch_size
    memory_budget = None if memory_budget is None else int(memory_budget)
    out = _out_options(fn_name, out, resume, overwrite, batch_size, store_on_device)
    if devices is not None:
        devices = _devices_option(fn_name, devices, store_on_device, batch_size)
    kernel = (trace, diag, vmap_axes, implementation, precision, _wrt(fn_name, wrt))
    block = (batch_size, store_on_device, progress, memory_budget, out, resume, overwrite)
    return KernelOptions(*kernel, *block, devices)


def _move(vmap_axes) -> str:
    """The fix for neural-tangents' ``vmap_axes``: an int b (inputs' and outputs' batch axis),
    or ``(in_axes, out_axes, kwargs_axes)``; the recipe moves both batch axes to 0."""
    b = c = vmap_axes
    if isinstance(vmap_axes, tuple) and len(vmap_axes) == 3:
        b, c = vmap_axes[:2]
    b, c = (b if _is_int(b) else "b", c if _is_int(c) else "c")
    return (
        f"move the batch axes first: f0 = lambda p, x: jnp.moveaxis(f(p, jnp.moveaxis(x, 0, {b})), "
        f"{c}, 0) on x0 = jnp.moveaxis(x, {b}, 0) with vmap_axes=0, or pass vmap_axes=None"
    )


def refuse_options(fn_name: str, options: KernelOptions, taken: tuple, why: str) -> None:
    """TypeError for an option of ``options`` away from its default that ``fn_name`` (an
    entry point reading a kernel function's model, not its kernel) does not take."""
    for name in NTK_OPTION_NAMES:
        value = getattr(options, name)
        if name not in taken and value != getattr(DEFAULTS, name):
            what = f"{name}={value!r} is a kernel option that {fn_name} does not take"
            fix = f"drop it: {why}; options: " + ", ".join(f"{t}=" for t in taken)
            raise bad(TypeError, fn_name, what, fix)


def _wrt(fn_name: str, wrt):
    """``wrt`` validated: None, a callable, or a tuple of path names (from a str or strs)."""
    if wrt is None or callable(wrt):
        return wrt
    names = (wrt,) if isinstance(wrt, str) else wrt
    if isinstance(names, Sequence) and all(isinstance(n, str) for n in names):
        if not names:
            raise bad(ValueError, fn_name, "wrt=[] selects no parameter", "pass wrt=None for all")
        return tuple(n.strip("/") for n in names)
    expect = "None, a predicate wrt(path) -> bool, or a path name or a list of them"
    raise must(TypeError, fn_name, "wrt", expect, repr(wrt), eg="['Dense_1']")


def _devices_option(fn_name, devices, store_on_device, batch_size) -> tuple:
    if batch_size is None:
        raise _needs_batch_size(fn_name, "devices= spreads the blocked engine's tiles", "'auto'")
    import jax  # the options module itself needs no JAX

    given = tuple(devices) if isinstance(devices, (list, tuple)) else None
    if not given or not all(isinstance(d, jax.Device) for d in given):
        expect = "None or a non-empty list of jax devices"
        raise must(TypeError, fn_name, "devices", expect, repr(devices), eg="jax.devices()")
    if len(set(given)) != len(given):
        raise bad(ValueError, fn_name, f"devices lists a device twice: {given}", "list each once")
    if store_on_device and len(given) > 1:
        what = f"store_on_device=True assembles on one device, but devices= names {len(given)}"
        raise bad(ValueError, fn_name, what, "drop store_on_device=True, or pass one device")
    return given


def _out_options(
    fn_name, out, resume, overwrite, batch_size, store_on_device, blocks="tiles", eg="'auto'"
) -> str | None:
    """Validates ``out``, ``resume`` and ``overwrite``; returns the path as a string
    (``blocks``: what is written, ``eg``: a batch_size, in the messages)."""
    if out is None:
        if resume or overwrite:
            given = "resume=True" if resume else "overwrite=True"
            what = f"{given} applies to the file of out=, but out is None"
            raise bad(ValueError, fn_name, what, f"pass out='kernel.npy', or drop {given}")
        return None
    if isinstance(out, Sink):  # the Monte Carlo kernels' running sums (internal)
        return out
    if not isinstance(out, (str, os.PathLike)) or not os.fspath(out).endswith(".npy"):
        raise must(ValueError, fn_name, "out", "a path ending in '.npy'", repr(out), eg="'k.npy'")
    path = os.fspath(out)
    if batch_size is None:
        raise _needs_batch_size(fn_name, f"out={path!r} writes {blocks} to a file", eg)
    if store_on_device:
        what = f"out={path!r} writes to the host, which store_on_device=True contradicts"
        raise bad(ValueError, fn_name, what, "drop store_on_device=True")
    if resume and overwrite:
        what = f"resume=True and overwrite=True for out={path!r}"
        fix = "pass one"
        raise bad(ValueError, fn_name, what, fix)
    return path


def _needs_batch_size(fn_name: str, what: str, eg) -> ValueError:
    """The ValueError for an option of the blocked engine (``what`` it does) without one
    (``eg``: a batch_size to suggest)."""
    return bad(
        ValueError, fn_name, f"{what}, but batch_size is None", f"pass a batch_size, e.g. {eg}"
    )


def _block_options(fn_name, batch_size, memory_budget) -> None:
    if not (batch_size is None or batch_size == AUTO_BATCH_SIZE or _is_int(batch_size)):
        text = isinstance(batch_size, str)
        got = f"the string {batch_size!r}" if text else _got(batch_size)
        expect = "None, a positive int or 'auto'"
        raise must(ValueError if text else TypeError, fn_name, "batch_size", expect, got, eg=256)
    if _is_int(batch_size) and batch_size <= 0:
        expect = "a positive number of samples per tile"
        raise must(ValueError, fn_name, "batch_size", expect, batch_size, eg=256)
    if not (memory_budget is None or _is_int(memory_budget) and memory_budget > 0):
        nonint = not _is_int(memory_budget)
        expect = "None or a positive int" if nonint else "a positive int"
        got, cls = (_got(memory_budget), TypeError) if nonint else (memory_budget, ValueError)
        raise must(cls, fn_name, "memory_budget", f"{expect} number of bytes", got, eg=2**31)
