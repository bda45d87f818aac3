"""Validation of the keyword options shared by every kernel entry point.

Shared argument descriptions (referred to by every public docstring):

trace_axes:
    Output axes to trace over: for each traced axis the kernel sums the products of
    the two outputs along it and divides by its size (an average, as
    neural-tangents does), and the axis is absent from the result. An int or a
    sequence of ints, negative values counted from the end of each output leaf.
    The batch axis 0 cannot be traced. Default ``(-1,)``.
diagonal_axes:
    Output axes on which only the diagonal is computed: the axis appears once in
    the result. May name the batch axis 0, which gives the per-sample diagonal
    K(x1_i, x2_i) at O(N) cost (x1 and x2 must then have the same N). Must not
    overlap ``trace_axes``. Default ``()``.
vmap_axes:
    ``0`` (default): samples are independent, so per-sample derivatives are computed
    with ``jax.vmap`` over axis 0 of every input leaf (the model is called on
    batches of one sample, batch axis kept). ``None``: the model is called on the
    whole batch; required for models whose samples interact (BatchNorm in
    training mode).
implementation:
    ``"auto"`` (default), ``"jacobian"`` (Jacobian contraction), ``"ntvp"``
    (NTK-vector products) or ``"structured"`` (structured derivatives: Gram identities
    for weights used in matrix products, convolutions and embedding lookups and their
    biases, explicit Jacobians for the other leaves; with
    ``vmap_axes=None`` it computes the Jacobian contraction). See
    :data:`IMPLEMENTATIONS`.
precision:
    ``"highest"`` (default), ``"high"`` or ``"default"``: the matmul precision used
    for every matmul of the kernel computation, the model's own included.
    Anything below ``"highest"`` lets GPUs and TPUs use TF32 or bf16 passes.
batch_size:
    ``None`` (default): the kernel is computed in one call and returned on the device
    (a ``jax.Array``). A positive int B: the Gram matrix is computed in tiles of B x B
    samples (B samples on the batch diagonal) by the blocked engine
    (:mod:`ntk_core._blocked.tiles`): any N1, N2 and B work (the last tile is ragged),
    per-sample features are computed once per block of B samples and reused for every
    tile, and with ``x2=None`` only tiles on and above the diagonal are computed and
    mirrored, so the result is exactly symmetric. ``"auto"``: B is the largest size
    whose working memory fits ``memory_budget``, capped at ``max(N1, N2)`` (see
    :func:`ntk_core._blocked.tiles.auto_batch_size` for the rule). Batched results equal the
    unbatched ones to float round-off (1e-5 · max|K| in float32). With
    ``vmap_axes=None`` each block is differentiated as its own batch.
store_on_device:
    Only when batched. ``False`` (default): the result is assembled in host memory, a
    ``numpy.ndarray`` (the device holds only the blocks in use). ``True``: it is
    assembled on the device, a ``jax.Array``.
progress:
    Only when batched. A tqdm progress bar over tiles (tiles done, rate, time left) on
    stderr. ``None`` (default): shown only when stderr is a terminal
    (``sys.stderr.isatty()``), the environment variable ``CI`` is unset or false-ish
    (``""``, ``0``, ``false``, ``no``, ``off``; CI services set ``CI=true``) and ``TERM``
    is not ``dumb``; so never in pipes, log files or CI logs. ``True`` /
    ``False``: always / never (see :func:`ntk_core._blocked.progress.show_progress`).
memory_budget:
    Bytes of device memory the blocked engine may use for features, tiles and, with
    ``store_on_device=True``, the output: it sizes ``batch_size="auto"`` and decides
    how many blocks of features are kept for reuse. With ``vmap_axes=None`` (batched or
    not) it also bounds the whole-batch reverse passes of the Jacobian contraction:
    they run as many output cotangents at a time as fit, and a batch whose forward and
    one reverse pass alone exceed it is refused before anything runs. ``None`` (default):
    half of the device allocator's limit where JAX reports one
    (``device.memory_stats()["bytes_limit"]``, GPUs), else
    :data:`DEFAULT_MEMORY_BUDGET` (1 GiB).
out:
    Only with a ``batch_size``. ``None`` (default): the result is returned in memory.
    A path ending in ``.npy``: the Gram matrix is written tile by tile into that
    standard ``.npy`` file, created at its final shape (host memory holds the tiles in
    flight, not N1 x N2), with a manifest beside it (``<path>.manifest.json``: what the
    file holds, which tiles are done); the call returns the file read-only and
    memory-mapped (``np.load(path, mmap_mode="r")``), which :mod:`ntk_core.predict`
    takes. A finished file of the same call is returned without computing anything.
    See :mod:`ntk_core._blocked.store`.
resume:
    Only with ``out``. ``True``: an interrupted run's file (killed at any moment) is
    finished: only the tiles its manifest does not list are computed, and the file
    equals an uninterrupted run's bit for bit; inputs, parameters or options that
    differ from the interrupted run's are refused, naming what differs. Default
    ``False``.
overwrite:
    Only with ``out``. ``True``: an existing file is replaced. Default ``False``: an
    existing file that is not the finished result of the same call is refused.
devices:
    Only when batched. The devices that compute tiles: ``None`` (default) all local
    devices of the default backend (``jax.local_devices()``; one device with
    ``store_on_device=True``), or a list of ``jax.Device``. The tiles of row block i run
    on device i mod D, each device computing whole tiles (the features of a column
    block are computed once, on device j mod D, and copied to the others that need
    them); results equal the single-device ones.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Sequence

from ntk_core._blocked.sink import Sink
from ntk_core._errors import bad
from ntk_core._impl.registry import AUTO, REGISTRY
from ntk_core._kernel.layout import Axes

#: Valid values of ``implementation``: ``"auto"`` and the registry's names.
IMPLEMENTATIONS = (AUTO, *REGISTRY)
#: ``batch_size="auto"``: the blocked engine sizes its tiles from ``memory_budget``.
AUTO_BATCH_SIZE = "auto"
#: neural-tangents' ``NtkImplementation`` values and their names here (refused with the
#: name to use, so that ported code says what it computes).
NT_IMPLEMENTATIONS = {
    0: ("AUTO", "auto"),
    1: ("JACOBIAN_CONTRACTION", "jacobian"),
    2: ("NTK_VECTOR_PRODUCTS", "ntvp"),
    3: ("STRUCTURED_DERIVATIVES", "structured"),
}
#: Valid values of ``precision``.
PRECISIONS = ("highest", "high", "default")
#: Keyword options of the NTK entry points, and of the NNGP ones.
#: Options of the blocked engine, shared by every entry point.
BLOCK_OPTION_NAMES = (
    "batch_size",
    "store_on_device",
    "progress",
    "memory_budget",
    "out",
    "resume",
    "overwrite",
    "devices",
)
NTK_OPTION_NAMES = (
    "trace_axes",
    "diagonal_axes",
    "vmap_axes",
    "implementation",
    "precision",
) + BLOCK_OPTION_NAMES
NNGP_OPTION_NAMES = ("trace_axes", "diagonal_axes", "vmap_axes", "precision") + BLOCK_OPTION_NAMES
#: Bytes the blocked engine may use when the device reports no memory limit (CPU).
DEFAULT_MEMORY_BUDGET = 2**30


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Validated, hashable options of one kernel function, with their defaults: the one
    place the defaults are written (public signatures read them from :data:`DEFAULTS`).

    The first five say what is computed (the kernel options), the rest how (the blocked
    engine's execution options); :func:`make_options` validates both.
    """

    trace_axes: Axes = (-1,)
    diagonal_axes: Axes = ()
    vmap_axes: int | None = 0
    implementation: str = "auto"
    precision: str = "highest"
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


def _got(value) -> str:
    return f"{type(value).__name__} {value!r}"


def _one_of(fn_name: str, name: str, value, allowed, fix: str) -> None:
    if not isinstance(value, str) or value not in allowed:
        what = f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}"
        raise bad(ValueError, fn_name, what, fix)


def _flag(fn_name: str, name: str, value, allowed="True or False") -> None:
    if not isinstance(value, bool) and not (value is None and "None" in allowed):
        what = f"{name} must be {allowed}, got {_got(value)}"
        raise bad(TypeError, fn_name, what, f"pass {name}=True")


def _axes(fn_name: str, name: str, value) -> Axes:
    fix = f"pass e.g. {name}=(-1,) or {name}=()"
    if isinstance(value, bool):
        what = f"{name} must be an int or a sequence of ints, got the bool {value!r}"
        raise bad(TypeError, fn_name, what, fix)
    if isinstance(value, numbers.Integral):
        return (int(value),)
    if not isinstance(value, Sequence) or isinstance(value, str):
        what = f"{name} must be an int or a sequence of ints, got {_got(value)}"
        raise bad(TypeError, fn_name, what, fix)
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in value):
        raise bad(TypeError, fn_name, f"{name} must contain only ints, got {value!r}", fix)
    out = tuple(int(v) for v in value)
    if len(set(out)) != len(out):
        what = f"{name}={out!r} names the same axis twice"
        raise bad(ValueError, fn_name, what, "list each axis once")
    return out


def make_options(
    fn_name: str,
    *,
    trace_axes=DEFAULTS.trace_axes,
    diagonal_axes=DEFAULTS.diagonal_axes,
    vmap_axes=DEFAULTS.vmap_axes,
    implementation=DEFAULTS.implementation,
    precision=DEFAULTS.precision,
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
    trace = _axes(fn_name, "trace_axes", trace_axes)
    diag = _axes(fn_name, "diagonal_axes", diagonal_axes)
    if vmap_axes is not None and (isinstance(vmap_axes, bool) or vmap_axes != 0):
        what = f"vmap_axes must be 0 (independent samples) or None, got {vmap_axes!r}"
        raise bad(ValueError, fn_name, what, "move the batch axis to 0, or pass vmap_axes=None")
    if not isinstance(implementation, (str, bool)) and implementation in NT_IMPLEMENTATIONS:
        nt, name = NT_IMPLEMENTATIONS[implementation]
        what = f"implementation={implementation!r} is neural-tangents' NtkImplementation.{nt}"
        raise bad(ValueError, fn_name, what, f"pass implementation={name!r}")
    _one_of(
        fn_name, "implementation", implementation, IMPLEMENTATIONS, "pass implementation='auto'"
    )
    _one_of(fn_name, "precision", precision, PRECISIONS, "keep precision='highest'")
    _block_options(fn_name, batch_size, store_on_device, progress, memory_budget)
    if isinstance(batch_size, numbers.Integral):
        batch_size = int(batch_size)
    if memory_budget is not None:
        memory_budget = int(memory_budget)
    out = _out_options(fn_name, out, resume, overwrite, batch_size, store_on_device)
    devices = _devices_option(fn_name, devices, store_on_device, batch_size)
    return KernelOptions(
        trace,
        diag,
        vmap_axes,
        implementation,
        precision,
        batch_size,
        store_on_device,
        progress,
        memory_budget,
        out,
        resume,
        overwrite,
        devices,
    )


def _devices_option(fn_name, devices, store_on_device, batch_size) -> tuple | None:
    """Validates ``devices`` (see the module docstring); returns a tuple or None."""
    if devices is None:
        return None
    if batch_size is None:
        what = "devices= spreads the blocked engine's tiles, but batch_size is None"
        raise bad(ValueError, fn_name, what, "pass a batch_size (e.g. 'auto'), or drop devices=")
    import jax  # the options module itself needs no JAX

    given = tuple(devices) if isinstance(devices, (list, tuple)) else None
    if not given or not all(isinstance(d, jax.Device) for d in given):
        what = f"devices must be None or a non-empty list of jax devices, got {devices!r}"
        raise bad(TypeError, fn_name, what, "pass e.g. devices=jax.local_devices()[:2]")
    if len(set(given)) != len(given):
        what = f"devices lists a device twice ({list(given)!r})"
        raise bad(ValueError, fn_name, what, "list each once")
    if store_on_device and len(given) > 1:
        what = f"store_on_device=True assembles on one device, but devices= names {len(given)}"
        raise bad(ValueError, fn_name, what, "drop store_on_device=True, or pass one device")
    return given


def _out_options(fn_name, out, resume, overwrite, batch_size, store_on_device) -> str | None:
    """Validates ``out``, ``resume`` and ``overwrite`` (see the module docstring);
    returns the path as a string."""
    _flag(fn_name, "resume", resume)
    _flag(fn_name, "overwrite", overwrite)
    if out is None:
        if resume or overwrite:
            given = "resume=True" if resume else "overwrite=True"
            what = f"{given} applies to the file of out=, but out is None"
            raise bad(ValueError, fn_name, what, f"pass out='kernel.npy', or drop {given}")
        return None
    if isinstance(out, Sink):  # the Monte Carlo kernels' running sums (internal)
        return out
    if not isinstance(out, (str, os.PathLike)) or not os.fspath(out).endswith(".npy"):
        what = f"out must be a path ending in '.npy', got {out!r}"
        raise bad(ValueError, fn_name, what, "pass e.g. out='kernel.npy'")
    given = f"out={os.fspath(out)!r}"
    if batch_size is None:
        what = f"{given} writes tiles to a file, but batch_size is None"
        raise bad(ValueError, fn_name, what, "pass a batch_size, e.g. batch_size='auto'")
    if store_on_device:
        what = f"{given} writes to the host, which store_on_device=True contradicts"
        raise bad(ValueError, fn_name, what, "drop store_on_device=True")
    if resume and overwrite:
        what = f"resume=True and overwrite=True were both given for {given}"
        raise bad(ValueError, fn_name, what, "pass one of them")
    return os.fspath(out)


def _block_options(fn_name, batch_size, store_on_device, progress, memory_budget) -> None:
    """Validates the options of the blocked engine (see the module docstring)."""
    expect, fix = "batch_size must be None, a positive int or 'auto'", "pass e.g. batch_size=256"
    if isinstance(batch_size, str):
        if batch_size != AUTO_BATCH_SIZE:
            raise bad(ValueError, fn_name, f"{expect}, got the string {batch_size!r}", fix)
    elif batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
            raise bad(TypeError, fn_name, f"{expect}, got {_got(batch_size)}", fix)
        if batch_size <= 0:
            what = f"batch_size must be a positive number of samples per tile, got {batch_size!r}"
            raise bad(ValueError, fn_name, what, fix)
    _flag(fn_name, "store_on_device", store_on_device)
    _flag(fn_name, "progress", progress, "None, True or False")
    if memory_budget is None:
        return
    fix = "pass e.g. memory_budget=2 * 2**30 (2 GiB)"
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Integral):
        what = "memory_budget must be None or a positive int number of bytes, got "
        what += _got(memory_budget)
        raise bad(TypeError, fn_name, what, fix)
    if memory_budget <= 0:
        what = f"memory_budget must be a positive int number of bytes, got {memory_budget!r}"
        raise bad(ValueError, fn_name, what, fix)
