""":class:`KernelTracker`: the empirical NTK of a fixed probe set and its metrics
(:mod:`ntk_core.metrics`), every ``every`` steps of a training loop; host work in float64.
With ``m=`` the kernel is never formed: matrix-free estimates with standard errors
(:mod:`ntk_core._analysis.matrix_free`), for probe sets whose kernel does not fit."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._analysis import matrix_free as _matrix_free
from ntk_core._analysis import metrics as _metrics
from ntk_core._analysis.host_kernel import HostKernel
from ntk_core._errors import bad, check_bool, check_int, must
from ntk_core._kernel.arguments import required_positional
from ntk_core._kernel.checks import check_finite_input
from ntk_core._kernel.validate import describe
from ntk_core._predict.linalg import check_key, real_array

_NAME = "KernelTracker"
_METRICS, _KERNEL_FORMAT = "metrics.json", "kernel_step_{:08d}.npy"  # the files of ``out``
_KERNEL_FILE = re.compile(r"kernel_step_-?\d+\.npy")
_UPDATE = f"{_NAME}.update"
_KERNEL_FN_FIX = "pass a kernel function such as ntk_core.ntk_fn(f) or ntk_flax.kernel_fn(model)"
_STEP_FIX = "pass the Python loop counter (for step in range(n): ...)"


class KernelRecord(NamedTuple):
    """One tracked step's metrics (see :class:`KernelTracker`): floats (NaN alignments without
    labels), ``step`` int, ``top_eigenvalues`` float64 ``(top_k,)``, ``seconds`` wall time."""

    step: int
    kernel_distance: float
    alignment: float
    centered_alignment: float
    effective_rank: float
    trace: float
    top_eigenvalues: np.ndarray
    seconds: float


class EstimateRecord(NamedTuple):
    """One tracked step's matrix-free statistics (:class:`KernelTracker` with ``m=``) of the
    flat ``(N·O, N·O)`` kernel: ``trace`` exact; ``frobenius_sq`` (‖Θ‖²_F), ``effective_rank``
    and ``alignment`` (NaN without labels) estimates, each with its ``*_se`` standard error
    (0.0 where exact); ``products`` NTK-vector products; ``seconds`` wall time."""

    step: int
    trace: float
    frobenius_sq: float
    frobenius_sq_se: float
    effective_rank: float
    effective_rank_se: float
    alignment: float
    alignment_se: float
    products: int
    seconds: float


_PROBE_FIX = "pass one array (N, ...) or a pytree of arrays with N on axis 0, e.g. x_train[:256]"
_Y_FIX = "pass the probe samples' labels: floats (N,) or one-hot (N, O)"


def _layout(tree):
    """``tree`` with each leaf's shape in place of the leaf: compared between steps, and
    described in messages (nothing of the parameters kept)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.float32), tree)


def _probe_inputs(x_probe) -> tuple[Any, int]:
    """``x_probe`` on the device (one transfer) and N."""
    leaves = jax.tree.leaves(x_probe)
    for leaf in leaves:
        if not isinstance(leaf, (np.ndarray, np.generic, jax.Array)):
            got = type(leaf).__name__
            what = f"x_probe must be an array or a pytree of arrays, got a leaf of type {got}"
            raise bad(TypeError, _NAME, what, _PROBE_FIX)
    sizes = [leaf.shape[0] if leaf.shape else 0 for leaf in leaves]
    if len(set(sizes)) != 1 or sizes[0] == 0:
        shapes = [leaf.shape for leaf in leaves]
        what = f"x_probe must hold arrays of one size N >= 1 on axis 0, got shapes {shapes}"
        raise bad(ValueError, _NAME, what, _PROBE_FIX)
    return jax.tree.map(jnp.asarray, x_probe), int(sizes[0])


def _labels(y, n: int) -> np.ndarray | None:
    if y is None:
        return None
    arr = real_array(_NAME, "y", y)
    if arr.ndim not in (1, 2) or arr.shape[0] != n:
        raise bad(ValueError, _NAME, f"y has shape {arr.shape}, not ({n},) or ({n}, O)", _Y_FIX)
    classes = len(np.unique(arr)) if arr.ndim == 1 and np.issubdtype(arr.dtype, np.integer) else 0
    if classes > 2:
        what = f"y is a vector of {classes} distinct integers (class ids?), not one target"
        raise bad(ValueError, _NAME, what, _Y_FIX)
    return arr.astype(np.float64)


def _json_value(value):
    """JSON-ready: numpy to lists, NaN to null."""
    value = value.tolist() if isinstance(value, np.ndarray) else value
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _out_folder(out, overwrite) -> tuple[str | None, list]:
    """``out`` (``~`` expanded) as a writable folder, and the earlier run's files there, which
    only ``overwrite`` allows (the first write removes them, so a failing first step keeps them)."""
    check_bool(_NAME, "overwrite", overwrite)
    if out is None:
        return None, []
    if not isinstance(out, (str, os.PathLike)):
        raise must(TypeError, _NAME, "out", "a folder path", type(out).__name__, eg="'runs/ntk'")
    path = os.path.expanduser(os.fspath(out))
    try:  # fail now, not after training
        os.makedirs(path, exist_ok=True)
        files = [f for f in os.listdir(path) if os.path.isfile(os.path.join(path, f))]
        earlier = [f for f in files if f == _METRICS or _KERNEL_FILE.fullmatch(f)]
        tempfile.TemporaryFile(dir=path).close()  # writable
    except OSError as e:
        what = f"out={path!r} cannot be used as a folder ({e.strerror or e})"
        raise bad(ValueError, _NAME, what, "pass a writable folder path") from e
    if earlier and not overwrite:
        what = f"out={path!r} holds an earlier run's files ({', '.join(sorted(earlier)[:2])}, ...)"
        raise bad(ValueError, _NAME, what, "pass another folder, or overwrite=True")
    return path, earlier


def _atomic_write(folder: str, name: str, write) -> None:
    """``write(file)`` into a temporary file in ``folder``, then renames it ``name``."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.splitext(name)[1])
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class KernelTracker:
    """The empirical NTK of a fixed probe set, tracked every ``every`` training steps.

    At a due step (``step % every == 0``) :meth:`update` computes K_s = ``kernel_fn(
    params_like, x_probe)`` and records a :class:`KernelRecord`: ``kernel_distance(K_0,
    K_s)`` (K_0 the first tracked), ``kernel_alignment`` and ``centered_kernel_alignment``
    with y, ``effective_rank``, the trace and the ``top_k`` largest eigenvalues of the flat
    ``(N·O, N·O)`` kernel (float64, :mod:`ntk_core.metrics`). Other steps cost a modulo.

    Args:
      kernel_fn: ``(params_like, x, **kwargs) ->`` one kernel ``(N, N)`` / ``(N, N, O, O)``
        (``ntk_core.ntk_fn``, ``ntk_flax.kernel_fn``, ``ntk_haiku.kernel_fn``, ...).
      x_probe: N probe inputs, an array ``(N, ...)`` or a pytree with batch axis 0.
      y: optional labels ``(N,)`` or ``(N, O)`` (``(N, O)`` for ``(N, N, O, O)`` kernels).
      every: positive int. top_k: eigenvalues recorded (<= N·O; checked at the first update,
        as O is known only from the first kernel: top_k <= N always fits).
      keep_kernels: keep every kernel in :attr:`kernels` (K_0 is kept anyway).
      out: optional folder for ``kernel_step_{step:08d}.npy`` and ``metrics.json``
        (:meth:`to_dict`), written atomically at each tracked step; made if missing.
      overwrite: let ``out`` hold an earlier run's files (removed at the first write); without
        it such a folder is refused, so no run's results are lost or mixed.
      m: ``None`` (default): the exact kernel, as above. An int (see ``steps``): matrix-free, the
        kernel never formed (probe sets whose N·O x N·O kernel does not fit): each tracked
        step records an :class:`EstimateRecord`, the exact trace (O(N)), ‖Θ‖²_F by Hutch++
        and the effective rank by stochastic Lanczos quadrature with ``m`` NTK-vector
        products each, and the alignment with y from one more product, each with its
        standard error (:mod:`ntk_core.spectrum`'s ``ntk_*``; exact at m >= N·O). Needs
        ``kernel_fn`` an NTK kernel function built with ``trace_axes=()`` (``ntk_core.ntk_fn``,
        an adapter's ``kernel_fn``: its model, fixed parts, ``wrt``, ``precision``, int
        ``batch_size`` are used); ``out`` then writes ``metrics.json`` only.
      key: with ``m``, one JAX PRNG key; step s uses ``jax.random.fold_in(key, s)``.
      steps: with ``m``, Lanczos steps per vector: m >= min(8·(1 + 2·steps), N·O) (and >= 4).
        O, the outputs per sample, is known before the first update only from y; without y
        the constructor checks O = 1's minimum and update the rest (m >= 8·(1 + 2·steps) fits
        any O).

    Attributes: records, history (arrays per field over T steps; ``step`` int64,
    ``top_eigenvalues`` ``(T, top_k)``), kernels, initial_kernel (K_0 or None); with ``m``
    the :class:`EstimateRecord` fields (no kernels, no distance or eigenvalues).

    Raises TypeError: ``kernel_fn`` not a callable of (params_like, x) (e.g. ``empirical_ntk``),
    ``every``/``top_k`` not int, bad ``x_probe``, ``y`` or ``out``; in :meth:`update`, a non-int
    step (a ``jax.Array`` would sync; swapped arguments), a non-array kernel. ValueError:
    ``every``/``top_k`` < 1, bad shapes, ``out`` not a writable folder or holding an earlier
    run's files; in :meth:`update`, a step not after the last, a kernel not of the probe set,
    not symmetric or finite, ``top_k`` > N·O, ``m`` below the minimum for the model's O.
    NonFiniteError: NaN or Inf in ``x_probe``.

    Cost: per tracked step a kernel call, a host copy, an M³ eigendecomposition (M = N·O);
    with ``m``: 2·m + 1 NTK-vector products (each about 4 forward passes over the N probe
    samples) and the kernel's diagonal, memory O(M·m).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import ntk_core
      >>> apply_fn = lambda w, x: jnp.tanh(x @ w)                  # (N, 3) -> (N, 2)
      >>> x = jax.random.normal(jax.random.PRNGKey(0), (6, 3))      # N = 6 probe samples
      >>> y = jnp.eye(2)[jnp.array([0, 1, 0, 1, 0, 1])]             # (N, O) one-hot
      >>> tracker = ntk_core.KernelTracker(ntk_core.ntk_fn(apply_fn), x, y, every=2, top_k=3)
      >>> w = jnp.ones((3, 2))
      >>> for step in range(5):                                     # a training loop
      ...     w = w + 0.3 * jax.random.normal(jax.random.PRNGKey(step), w.shape)
      ...     record = tracker.update(step, w)                      # None unless step % 2 == 0
      >>> print(tracker.history["step"], tracker.history["top_eigenvalues"].shape)
      [0 2 4] (3, 3)
      >>> float(tracker.history["kernel_distance"][0])             # K_0 against itself
      0.0

    References: Fort et al., "Deep learning versus kernel learning", NeurIPS 2020; Baratin
    et al., "Implicit Regularization via Neural Feature Alignment", AISTATS 2021.
    """

    def __init__(
        self,
        kernel_fn: Callable,
        x_probe,
        y=None,
        *,
        every: int,
        top_k: int = 5,
        keep_kernels: bool = False,
        out: str | os.PathLike | None = None,
        overwrite: bool = False,
        m: int | None = None,
        key=None,
        steps: int = 15,
    ):
        if not callable(kernel_fn) or (required_positional(kernel_fn) or 0) > 2:
            got = getattr(kernel_fn, "__name__", type(kernel_fn).__name__)
            what = f"kernel_fn must be a callable kernel(params_like, x), got {got}"
            raise bad(TypeError, _NAME, what, _KERNEL_FN_FIX)
        self.every = check_int(_NAME, "every", every, "pass every=k for steps 0, k, 2k, ...")
        self.top_k = check_int(_NAME, "top_k", top_k, "pass e.g. top_k=5 (largest eigenvalues)")
        self.keep_kernels = check_bool(_NAME, "keep_kernels", keep_kernels)
        self._kernel_fn = kernel_fn
        self._x, self.n_probe = _probe_inputs(x_probe)
        check_finite_input(_NAME, "x_probe", self._x)
        self._y = _labels(y, self.n_probe)
        rows = None if self._y is None else self._y.size  # N·O where y gives O
        options = _matrix_free_options(m, key, steps, self.keep_kernels, self.n_probe, rows)
        self.m, self.steps, self._key = options
        self.out, self._earlier = _out_folder(out, overwrite)
        self.records: list[KernelRecord] = []
        self.kernels: list[np.ndarray] = []  # with keep_kernels
        self.initial_kernel: np.ndarray | None = None
        self._files, self._shape, self._dtype = [], None, None  # set by _track
        self._params = None  # the last tracked params_like's shapes (_layout)

    def is_due(self, step: int) -> bool:
        """Whether :meth:`update` computes the kernel at ``step``."""
        return step % self.every == 0

    def update(self, step: int, params_like, **kernel_kwargs) -> KernelRecord | None:
        """The step's :class:`KernelRecord` (:class:`EstimateRecord` with ``m``) when due,
        else None.

        ``kernel_fn(params_like, x_probe, **kernel_kwargs)``; ``step`` a Python or numpy int.
        """
        if isinstance(params_like, int) and not isinstance(step, int):
            what = f"params_like is the int {params_like} and step a {type(step).__name__}: "
            what += "the arguments look swapped"
            raise bad(TypeError, _UPDATE, what, "call update(step, params_like)")
        if isinstance(step, jax.Array):  # deciding whether it is due would sync every step
            what = f"step is a jax.Array ({step.dtype}): reading it would wait for the device"
            raise bad(TypeError, _UPDATE, what, _STEP_FIX)
        step = check_int(_UPDATE, "step", step, _STEP_FIX, low=0)
        if step % self.every:
            return None
        if self.records and step <= (last := self.records[-1].step):
            what = f"step {step} is not after the last tracked step {last}"
            raise bad(ValueError, _UPDATE, what, _STEP_FIX)
        due = self._track if self.m is None else self._estimate
        try:
            record = due(step, params_like, kernel_kwargs)
        except (TypeError, ValueError) as e:  # other parameters than the last step's?
            last, now = self._params, _layout(params_like)
            if last is not None and jax.tree.flatten(last) != jax.tree.flatten(now):
                note = f"{_UPDATE}: params_like at step {step} is {describe(params_like)}, "
                note += f"where step {self.records[-1].step}'s was {describe(last)}"
                getattr(e, "add_note", id)(note)  # the kernel function's error stays
            raise
        self._params = _layout(params_like)
        return record

    def _estimate(self, step: int, params_like, kernel_kwargs) -> EstimateRecord:
        t0, key = time.perf_counter(), jax.random.fold_in(self._key, step)
        args = (self._x, kernel_kwargs, self._y, key, self.m, self.steps)
        r = _matrix_free.tracked(_UPDATE, self._kernel_fn, params_like, *args)
        a = r.alignment or _matrix_free.Estimate(math.nan, math.nan, 0)
        products = r.frobenius_sq.products + r.effective_rank.products + (a.products > 0)
        record = EstimateRecord(
            step, r.trace, *r.frobenius_sq[:2], *r.effective_rank[:2], *a[:2], int(products),
            time.perf_counter() - t0,
        )  # fmt: skip
        self.records.append(record)
        if self.out is not None:
            self._save(step, None)
        return record

    def _track(self, step: int, params_like, kernel_kwargs) -> KernelRecord:
        t0 = time.perf_counter()
        k = self._kernel_fn(params_like, self._x, **kernel_kwargs)
        if not isinstance(k, (np.ndarray, jax.Array)):
            what = f"the kernel function returned {type(k).__name__}; expected one array"
            raise bad(TypeError, _UPDATE, what, "for pytree outputs, track the kernel of one leaf")
        kernel = np.asarray(k)
        n = self.n_probe
        if kernel.ndim < 2 or kernel.shape[:2] != (n, n):
            what = f"the kernel function returned shape {kernel.shape}; expected ({n}, {n}, ...)"
            raise bad(ValueError, _UPDATE, what, _KERNEL_FN_FIX)
        flat = HostKernel(_UPDATE, kernel)
        flat.check_symmetric()
        if self.initial_kernel is None:
            y, want = self._y, (self.n_probe, flat.o)
            if y is not None and flat.out_shape and y.shape != want:
                what = f"y has shape {y.shape}; the kernel {kernel.shape} needs (N, O) = {want}"
                raise bad(ValueError, _UPDATE, what, "pass one-hot labels, or trace_axes=(-1,)")
            if self.top_k > flat.m:  # O is known from this first kernel on, not before
                what = f"top_k must be an int in [1, {flat.m}], got {self.top_k}: the kernel has "
                what += f"N·O = {n}·{flat.o} eigenvalues (O, the outputs per sample, is known "
                what += "only from the first kernel: the constructor could not check it)"
                fix = f"pass top_k <= {flat.m}, or more probe samples"
                raise bad(ValueError, _UPDATE, what, fix)
            self._shape, self._dtype = tuple(kernel.shape), str(kernel.dtype)
            self.initial_kernel = kernel
        dense = flat.dense()
        w = np.linalg.eigvalsh(dense)  # ascending, float64
        alignment = centered = math.nan
        if self._y is not None:
            alignment = _metrics.kernel_alignment(kernel, self._y)
            centered = _metrics.centered_kernel_alignment(kernel, self._y)
        distance = _metrics.kernel_distance(self.initial_kernel, kernel)
        rank, top = _metrics.effective_rank(eigenvalues=w), w[::-1][: self.top_k].copy()
        trace, seconds = float(np.trace(dense)), time.perf_counter() - t0
        record = KernelRecord(step, distance, alignment, centered, rank, trace, top, seconds)
        self.records.append(record)
        if self.keep_kernels:
            self.kernels.append(kernel)
        if self.out is not None:
            self._save(step, kernel)
        return record

    @property
    def history(self) -> dict[str, np.ndarray]:
        """The records as numpy arrays over the T tracked steps (see Attributes)."""
        kind = KernelRecord if self.m is None else EstimateRecord
        cols = zip(*self.records, strict=True) if self.records else [()] * len(kind._fields)
        r = kind(*(np.asarray(c, np.float64) for c in cols))
        r = r._replace(step=r.step.astype(np.int64))
        if self.m is not None:
            return r._replace(products=r.products.astype(np.int64))._asdict()
        top = r.top_eigenvalues if self.records else np.zeros((0, self.top_k), np.float64)
        return r._replace(top_eigenvalues=top)._asdict()

    def to_dict(self) -> dict:
        """What ``metrics.json`` holds: the settings and :attr:`history` as lists."""
        out = dict(every=self.every, top_k=self.top_k, n_probe=self.n_probe)
        if self.m is not None:  # matrix-free: no kernel, no kernel files
            out.update(m=self.m, steps=self.steps)
        out.update(kernel_shape=None if self._shape is None else list(self._shape))
        out.update(kernel_dtype=self._dtype, has_labels=self._y is not None)
        out.update(history={k: _json_value(v) for k, v in self.history.items()})
        out.update(kernel_files=list(self._files) if self.out is not None else None)
        return out

    def _save(self, step: int, kernel: np.ndarray | None) -> None:
        for name in self._earlier:  # overwrite=True: the earlier run's files go first
            if os.path.isfile(path := os.path.join(self.out, name)):
                os.remove(path)
        self._earlier = []
        if kernel is not None:
            name = _KERNEL_FORMAT.format(step)
            _atomic_write(self.out, name, lambda fh: np.save(fh, kernel))
            self._files.append(name)
        text = json.dumps(self.to_dict(), indent=1).encode()
        _atomic_write(self.out, _METRICS, lambda fh: fh.write(text))


def _matrix_free_options(m, key, steps, keep_kernels: bool, n: int, rows) -> tuple:
    """``(m, steps, key)`` checked (``n`` probe samples, ``rows`` = N·O where y gives O, else
    None): all None-like for the exact kernel."""
    if m is None:
        if key is not None:
            raise bad(ValueError, _NAME, "key is given but m is None", "pass e.g. m=400, or no key")
        return None, None, None
    steps = _matrix_free.check_steps(_NAME, steps)
    m = _matrix_free.check_tracked_m(_NAME, m, steps, n, rows)  # update checks it again
    key = check_key(_NAME, key)
    if keep_kernels:
        what = f"keep_kernels=True with m={m}: matrix-free tracking forms no kernel"
        raise bad(ValueError, _NAME, what, "drop keep_kernels=True, or pass m=None")
    return m, steps, key
