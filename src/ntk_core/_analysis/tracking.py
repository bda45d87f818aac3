"""Tracking the empirical NTK through training: :class:`KernelTracker`.

Every ``every`` steps of the user's training loop, the kernel of a fixed probe set at
the current parameters, and its metrics against the first tracked kernel and the
labels (:mod:`ntk_core.metrics`). Framework-agnostic: the tracker only calls the kernel
function it is given (``ntk_core.ntk_fn``, ``ntk_flax.kernel_fn``,
``ntk_haiku.kernel_fn``), which compiles once per input signature, so the whole run
compiles once. Host work (metrics, eigenvalues) runs in float64 numpy. No matplotlib
here: pictures are drawn by the examples and ``ntk track`` (``ntk_cli.track``).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._analysis import metrics as _metrics
from ntk_core._analysis.host_kernel import HostKernel
from ntk_core._predict.linalg import bad, check_finite, check_int

_NAME = "KernelTracker"
_UPDATE = f"{_NAME}.update"
_KERNEL_FN_FIX = (
    "pass a kernel function kernel(params, x) such as ntk_core.ntk_fn(apply_fn), "
    "ntk_flax.kernel_fn(model) or ntk_haiku.kernel_fn(transformed)"
)

#: File of the metrics in ``out`` (rewritten, atomically, after each tracked step).
METRICS_FILE = "metrics.json"


def kernel_file(step: int) -> str:
    """Name of the ``.npy`` file of the kernel of ``step`` in ``out``."""
    return f"kernel_step_{step:08d}.npy"


class KernelRecord(NamedTuple):
    """The metrics of the probe kernel at one tracked step (see :class:`KernelTracker`).

    ``step``: the training step (int). ``kernel_distance``: to the first tracked
    kernel, :func:`ntk_core.metrics.kernel_distance` (0 at the first). ``alignment``,
    ``centered_alignment``: :func:`ntk_core.metrics.kernel_alignment` and
    :func:`ntk_core.metrics.centered_kernel_alignment` with the labels ``y`` (NaN
    without labels). ``effective_rank``: :func:`ntk_core.metrics.effective_rank` of
    the whole spectrum. ``trace``: tr K of the flat ``(N·O, N·O)`` kernel (the sum of
    its eigenvalues). ``top_eigenvalues``: float64 ``(top_k,)``, largest first.
    ``seconds``: wall time of this step's kernel and metrics. Floats are Python floats.
    """

    step: int
    kernel_distance: float
    alignment: float
    centered_alignment: float
    effective_rank: float
    trace: float
    top_eigenvalues: np.ndarray
    seconds: float


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


#: The fix of a malformed probe set.
_PROBE_FIX = "pass one array (N, ...) or a pytree of arrays with N on axis 0, e.g. x_train[:256]"


def _probe_inputs(x_probe) -> tuple[Any, int]:
    """``x_probe`` as device arrays (one transfer, reused at every tracked step) and N."""
    leaves = jax.tree.leaves(x_probe)
    if not leaves:
        raise bad(ValueError, _NAME, f"x_probe has no arrays (got {x_probe!r})", _PROBE_FIX)
    for leaf in leaves:
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            what = "x_probe must be an array or a pytree of arrays, got a leaf of type "
            what += type(leaf).__name__
            raise bad(TypeError, _NAME, what, _PROBE_FIX)
        if len(leaf.shape) == 0:
            what = "x_probe has a scalar leaf (shape ()), so no batch axis"
            raise bad(ValueError, _NAME, what, _PROBE_FIX)
    sizes = [leaf.shape[0] for leaf in leaves]
    if len(set(sizes)) > 1:
        what = f"the leaves of x_probe have different sizes on the batch axis 0: {sizes}"
        raise bad(ValueError, _NAME, what, _PROBE_FIX)
    if sizes[0] == 0:
        raise bad(ValueError, _NAME, "x_probe has no samples (N = 0)", _PROBE_FIX)
    return jax.tree.map(jnp.asarray, x_probe), int(sizes[0])


def _labels(y, n: int) -> np.ndarray | None:
    if y is None:
        return None
    arr = np.asarray(y)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        what = f"y must be numbers (floating or integer), got dtype {arr.dtype}"
        raise bad(TypeError, _NAME, what, "encode the labels as numbers, e.g. one-hot")
    if arr.ndim not in (1, 2) or arr.shape[0] != n:
        what = f"y has shape {arr.shape}; expected (N,) or (N, O) for the N = {n} probe samples"
        fix = f"pass the labels of the probe samples, e.g. y_train[:{n}]"
        raise bad(ValueError, _NAME, what, fix)
    check_finite(_NAME, "y", arr, "pass finite labels", cls=ValueError)
    classes = len(np.unique(arr)) if arr.ndim == 1 and np.issubdtype(arr.dtype, np.integer) else 0
    if classes > 2:
        what = (
            f"y is a vector of {classes} distinct integers (class ids?), meaningless as one target"
        )
        fix = "pass one-hot labels np.eye(n_classes)[y], or y.astype(float) for numeric targets"
        raise bad(ValueError, _NAME, what, fix)
    return arr.astype(np.float64)


def _json_value(value):
    """JSON-ready: numpy to lists, NaN (no labels) to null."""
    if isinstance(value, np.ndarray):
        return [_json_value(v) for v in value.tolist()]
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _atomic_write(path: str, write) -> None:
    """``write(file object)`` into a temporary file beside ``path``, then renames it."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.splitext(path)[1])
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class KernelTracker:
    """The empirical NTK of a fixed probe set, tracked every ``every`` training steps.

    At each step ``s`` with ``s % every == 0`` (the step is *due*),
    :meth:`update` computes K_s = ``kernel_fn(params_like, x_probe)``, the ``(N, N)``
    (or ``(N, N, O, O)``) Gram matrix of the N probe samples at the current
    parameters, copies it to the host and records a :class:`KernelRecord`:

        kernel_distance      d(K_0, K_s)    = metrics.kernel_distance(K_0, K_s)
        alignment            A(K_s, Y)      = metrics.kernel_alignment(K_s, y)
        centered_alignment   A_c(K_s, Y)    = metrics.centered_kernel_alignment(K_s, y)
        effective_rank       erank(K_s)     = metrics.effective_rank(eigenvalues=λ)
        trace                tr K_s         = Σ_i λ_i
        top_eigenvalues      λ_1 >= ... >= λ_top_k

    with K_0 the first tracked kernel and λ all eigenvalues of the flat ``(N·O, N·O)``
    kernel by ``numpy.linalg.eigvalsh`` in float64 (the formulas are in
    :mod:`ntk_core.metrics`). At other steps :meth:`update` returns at once: an integer
    modulo, no device work, no synchronisation, so the training step is not slowed.

    The tracker calls the kernel function it is given and nothing else on the device:
    a kernel function compiles once per input signature, so the probe set (kept on
    the device) and parameters of fixed shapes compile once for the whole run. Any
    kernel function of ``(params_like, x)`` works:

    * ``ntk_core.ntk_fn(apply_fn)``: ``update(step, params)``;
    * ``ntk_flax.kernel_fn(model)``: ``update(step, state)`` with a ``TrainState``,
      a variables dict or bare params;
    * ``ntk_flax.kernel_fn(nnx_module)``: ``update(step, None)`` reads the module's
      ``nnx.Param`` state as ``nnx.Optimizer`` left it;
    * ``ntk_haiku.kernel_fn(transformed)``: ``update(step, params)``, and
      ``update(step, params, state=state)`` for ``hk.transform_with_state`` (keyword
      arguments of :meth:`update` go to the kernel function).

    Args:
      kernel_fn: ``kernel_fn(params_like, x, **kwargs)`` returning the kernel of x with
        itself, ``(N, N)`` (``trace_axes=(-1,)``, the default) or ``(N, N, O, O)``
        (``trace_axes=()``); one array (not a pytree of kernels).
      x_probe: the N probe inputs: an array ``(N, ...)`` or a pytree of arrays with
        batch axis 0 of size N. Fixed for the run; copied to the device once.
      y: optional labels of the probe samples, ``(N,)`` or ``(N, O)`` (e.g. one-hot
        ``(N, O)``); with an ``(N, N, O, O)`` kernel, ``(N, O)``. Without labels the
        alignments are NaN.
      every: track the steps ``s`` with ``s % every == 0`` (keyword-only, a positive
        int).
      top_k: how many of the largest eigenvalues to record (positive int, at most
        N·O; default 5).
      keep_kernels: keep each kernel in memory, in :attr:`kernels` (float32 ``(N, N)``
        per step: 4·N² bytes each). The first kernel is kept in any case.
      out: optional folder (created if missing): each kernel is saved as
        ``kernel_step_{step:08d}.npy`` (``np.save``; ``np.load`` gives it back) and the
        metrics as ``metrics.json`` (:meth:`to_dict`), rewritten after each tracked
        step; files are written to a temporary name and renamed, never left half
        written.

    Attributes:
      records: list of :class:`KernelRecord`, one per tracked step, in order.
      history: dict of numpy arrays, one per field of :class:`KernelRecord` over the T
        tracked steps: ``"step"`` int64 ``(T,)``, ``"top_eigenvalues"`` float64
        ``(T, top_k)``, the others float64 ``(T,)``.
      kernels: list of the kernels (numpy, as the kernel function returned them), one
        per record when ``keep_kernels``; else empty.
      initial_kernel: the first tracked kernel K_0 (numpy), or None before it.

    Returns:
      :meth:`update` returns the step's :class:`KernelRecord` when due, else ``None``.

    Raises:
      TypeError: ``kernel_fn`` not callable; ``every`` or ``top_k`` not an int;
        ``x_probe`` not an array or pytree of arrays; non-numeric ``y``; in
        :meth:`update`, a step that is not an int (a ``jax.Array`` such as
        ``state.step`` would synchronise every step), a kernel function returning
        something other than one array.
      ValueError: ``every`` or ``top_k`` below 1; ``x_probe`` without a batch axis,
        with leaves of different sizes or no samples; ``y`` not of length N or with
        NaN; in :meth:`update`, a due step not after the last tracked one, a kernel
        that is not the ``(N, N)`` or ``(N, N, O, O)`` kernel of the probe set, not
        symmetric or not finite, ``y`` not ``(N, O)`` for an ``(N, N, O, O)`` kernel,
        ``top_k`` above N·O; and the kernel function's own errors.

    Cost: per tracked step, one call of the kernel function on the N probe samples
    (its cost, e.g. N·O reverse passes and N²·O'·P multiply-adds for ``"jacobian"``),
    a device-to-host copy of the kernel, one float64 eigendecomposition of the
    ``(M, M)`` matrix, M = N·O (4/3·M³ flops, 8·M² bytes) and a few passes over it for
    the metrics; with ``out``, writing 4·M² bytes. Untracked steps: one integer
    modulo. Compilation: the kernel function's, once per input signature.

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
      >>> bool(tracker.history["kernel_distance"][2] > 0)
      True

    References:
      Fort, Dziugaite, Paul, Kharaghani, Roy, Ganguli, "Deep learning versus kernel
      learning: an empirical study of loss landscape geometry and the time evolution of
      the Neural Tangent Kernel", NeurIPS 2020 (kernel distance over training);
      Baratin, George, Laurent, Hjelm, Lajoie, Vincent, Lacoste-Julien, "Implicit
      Regularization via Neural Feature Alignment", AISTATS 2021 (alignment of the
      tangent kernel with the labels over training).
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
    ):
        if not callable(kernel_fn):
            got = type(kernel_fn).__name__
            what = f"kernel_fn must be a callable kernel(params_like, x), got {got}"
            raise bad(TypeError, _NAME, what, _KERNEL_FN_FIX)
        self.every = check_int(_NAME, "every", every, "pass every=k for steps 0, k, 2k, ...")
        self.top_k = check_int(_NAME, "top_k", top_k, "pass e.g. top_k=5 (largest eigenvalues)")
        if not isinstance(keep_kernels, (bool, np.bool_)):
            what = f"keep_kernels must be True or False, got {keep_kernels!r}"
            raise bad(TypeError, _NAME, what, "pass keep_kernels=True to keep every kernel")
        self._kernel_fn = kernel_fn
        self._x, self.n_probe = _probe_inputs(x_probe)
        self._y = _labels(y, self.n_probe)
        self.keep_kernels = bool(keep_kernels)
        self.out = None if out is None else os.fspath(out)
        if self.out is not None:
            os.makedirs(self.out, exist_ok=True)  # fail now, not after training
        self.records: list[KernelRecord] = []
        self.kernels: list[np.ndarray] = []
        self.initial_kernel: np.ndarray | None = None
        self._files: list[str] = []
        self._shape: tuple[int, ...] | None = None
        self._dtype: str | None = None

    def is_due(self, step: int) -> bool:
        """Whether :meth:`update` computes the kernel at ``step`` (``step % every == 0``)."""
        return step % self.every == 0

    def update(self, step: int, params_like, **kernel_kwargs) -> KernelRecord | None:
        """Records the probe kernel's metrics at ``step`` if due; see :class:`KernelTracker`.

        ``params_like`` and ``kernel_kwargs`` go to ``kernel_fn(params_like, x_probe,
        **kernel_kwargs)``; at steps that are not due nothing is computed and ``None``
        is returned. ``step`` must be a Python (or numpy) int, e.g. the loop counter.
        """
        if not _is_int(step) or step < 0:
            self._bad_step(step)
        if step % self.every:
            return None
        return self._track(int(step), params_like, kernel_kwargs)

    def _bad_step(self, step) -> None:
        fix = "pass the Python loop counter (for step in range(n): ...)"
        if isinstance(step, jax.Array):  # deciding whether it is due would sync every step
            what = (
                f"step is a jax.Array (shape {step.shape}, dtype {step.dtype}), e.g. state.step; "
            )
            what += "deciding whether it is due would wait for the device at every step"
            raise bad(TypeError, _UPDATE, what, fix)
        if _is_int(step):  # negative
            raise bad(ValueError, _UPDATE, f"step must be >= 0, got {step}", fix)
        what = f"step must be an int, got {step!r} ({type(step).__name__})"
        raise bad(TypeError, _UPDATE, what, fix)

    def _track(self, step: int, params_like, kernel_kwargs) -> KernelRecord:
        if self.records and step <= self.records[-1].step:
            what = f"step {step} is not after the last tracked step {self.records[-1].step}"
            fix = "pass the training step, not a counter that restarts"
            raise bad(ValueError, _UPDATE, what, fix)
        t0 = time.perf_counter()
        k = self._kernel_fn(params_like, self._x, **kernel_kwargs)
        kernel = self._host(k)
        if kernel.ndim < 2 or kernel.shape[:2] != (self.n_probe, self.n_probe):
            what = f"the kernel function returned shape {kernel.shape}; expected the kernel of the "
            what += f"N = {self.n_probe} probe samples, (N, N) or (N, N, O, O)"
            fix = _KERNEL_FN_FIX + ", not the model's apply function, and no diagonal_axes"
            raise bad(ValueError, _UPDATE, what, fix)
        flat = HostKernel(_UPDATE, "the kernel", kernel)
        flat.check_symmetric()
        if self.initial_kernel is None:
            self._check_first(flat)
            self.initial_kernel = kernel
        dense = flat.dense()
        eigenvalues = np.linalg.eigvalsh(dense)  # ascending, float64
        if self._y is None:
            alignment = centered = math.nan
        else:
            alignment = _metrics.kernel_alignment(kernel, self._y)
            centered = _metrics.centered_kernel_alignment(kernel, self._y)
        record = KernelRecord(
            step=step,
            kernel_distance=_metrics.kernel_distance(self.initial_kernel, kernel),
            alignment=alignment,
            centered_alignment=centered,
            effective_rank=_metrics.effective_rank(eigenvalues=eigenvalues),
            trace=float(np.trace(dense)),
            top_eigenvalues=eigenvalues[::-1][: self.top_k].copy(),
            seconds=time.perf_counter() - t0,
        )
        self.records.append(record)
        if self.keep_kernels:
            self.kernels.append(kernel)
        if self.out is not None:
            self._save(step, kernel)
        return record

    def _host(self, k) -> np.ndarray:
        if not hasattr(k, "shape") or not hasattr(k, "dtype"):
            what = f"the kernel function returned {type(k).__name__}; expected one array"
            fix = (
                "for pytree outputs, a kernel of one, ntk_fn(lambda p, x: apply_fn(p, x)['logits'])"
            )
            raise bad(TypeError, _UPDATE, what, fix)
        return np.asarray(k)

    def _check_first(self, flat: HostKernel) -> None:
        """Checks of the first kernel: the probe set's size, labels and top_k."""
        kernel = flat.arr
        expected = (self.n_probe, flat.o)
        if self._y is not None and flat.out_shape and self._y.shape != expected:
            what = f"the kernel has shape {kernel.shape} (outputs not traced), so y must have "
            what += f"shape (N, O) = {expected}"
            fix = "pass one-hot labels, or a kernel function with the default trace_axes=(-1,)"
            raise bad(ValueError, _UPDATE, f"{what}, got {self._y.shape}", fix)
        fix = f"pass top_k <= M = N·O = {flat.m} (kernel {kernel.shape}), or more probe samples"
        check_int(_UPDATE, "top_k", self.top_k, fix, high=flat.m)
        self._shape, self._dtype = tuple(kernel.shape), str(kernel.dtype)

    @property
    def history(self) -> dict[str, np.ndarray]:
        """The records as numpy arrays over the T tracked steps (see Attributes)."""
        fields = KernelRecord._fields
        if not self.records:
            empty = {f: np.zeros(0, np.float64) for f in fields}
            empty["step"] = np.zeros(0, np.int64)
            empty["top_eigenvalues"] = np.zeros((0, self.top_k), np.float64)
            return empty
        columns = dict(zip(fields, zip(*self.records, strict=True), strict=True))
        out = {f: np.asarray(columns[f], np.float64) for f in fields if f != "top_eigenvalues"}
        out["step"] = np.asarray(columns["step"], np.int64)
        out["top_eigenvalues"] = np.stack(columns["top_eigenvalues"])
        return {f: out[f] for f in fields}

    def to_dict(self) -> dict:
        """What ``metrics.json`` holds: the settings and :attr:`history` as lists
        (NaN alignments, without labels, as ``null``)."""
        return {
            "every": self.every,
            "top_k": self.top_k,
            "n_probe": self.n_probe,
            "kernel_shape": None if self._shape is None else list(self._shape),
            "kernel_dtype": self._dtype,
            "has_labels": self._y is not None,
            "history": {k: _json_value(v) for k, v in self.history.items()},
            "kernel_files": list(self._files) if self.out is not None else None,
        }

    def _save(self, step: int, kernel: np.ndarray) -> None:
        name = kernel_file(step)
        _atomic_write(os.path.join(self.out, name), lambda fh: np.save(fh, kernel))
        self._files.append(name)
        text = json.dumps(self.to_dict(), indent=1).encode()
        _atomic_write(os.path.join(self.out, METRICS_FILE), lambda fh: fh.write(text))
