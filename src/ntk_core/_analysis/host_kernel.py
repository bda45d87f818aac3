"""A square kernel on the host, read as its flat ``(M, M)`` matrix in row chunks.

Shared by :mod:`ntk_core.metrics` and :mod:`ntk_core.spectrum`. Kernels arrive in
ntk_core's layout, ``(N, N)`` (traced, or one output) or ``(N, N, O, O)`` (output axes
zipped; more output axes as ``(N, N, O1, O1, O2, O2, ...)``), as numpy arrays,
read-only memory maps (``np.load(path, mmap_mode="r")``) or jax arrays (copied to the
host once). The flat matrix has rows and columns ordered (sample, output entry), row
``i·O + a``, the order of ``v.reshape(-1)`` for ``v`` of shape ``(N, O)``. It is never
built whole except by :meth:`HostKernel.dense`: each chunk of sample rows is read,
converted to float64 and transposed on its own (about 64 MiB at a time).
"""

from __future__ import annotations

import math

import numpy as np

from ntk_core._predict.linalg import as_host_array, bad, check_finite, check_symmetric

#: float64 entries per row chunk (64 MiB).
CHUNK_ENTRIES = 1 << 23


def _flat(block: np.ndarray, m_out: int) -> np.ndarray:
    """``(b1, b2, O1, O1, ...)`` → float64 ``(b1·O, b2·O)``."""
    block = np.asarray(block, np.float64)
    if block.ndim == 2:
        return block
    k = (block.ndim - 2) // 2
    order = [0] + [2 + 2 * i for i in range(k)] + [1] + [3 + 2 * i for i in range(k)]
    b1, b2 = block.shape[:2]
    return np.transpose(block, order).reshape(b1 * m_out, b2 * m_out)


class HostKernel:
    """A validated square kernel; ``m`` = N·O rows of its flat form."""

    def __init__(self, fn_name: str, name: str, k):
        arr = as_host_array(fn_name, name, k)
        shape = tuple(arr.shape)
        square = arr.ndim >= 2 and shape[0] == shape[1] and shape[2::2] == shape[3::2]
        if not square or arr.ndim % 2 or shape[0] == 0:
            what = (
                f"{name} has shape {shape}; expected a square kernel (N, N) / (N, N, O, O), N >= 1"
            )
            raise bad(ValueError, fn_name, what, "pass the kernel of x with itself (x2=None)")
        self.fn_name, self.name, self.arr = fn_name, name, arr
        self.n = shape[0]
        self.out_shape = shape[2::2]
        self.o = math.prod(self.out_shape)
        self.m = self.n * self.o
        self.dtype = arr.dtype

    def chunks(self):
        """Yields ``(flat row slice, float64 block (b·O, M))`` over all rows, checking
        each block for NaN/Inf."""
        rows = max(1, CHUNK_ENTRIES // (self.m * self.o))
        for start in range(0, self.n, rows):
            s = slice(start, min(self.n, start + rows))
            block = self.arr[s]
            check_finite(self.fn_name, self.name, block, cls=ValueError, first=s.start)
            yield slice(s.start * self.o, s.stop * self.o), _flat(block, self.o)

    def check_symmetric(self) -> None:
        """Raises unless max |K - Kᵀ| <= 100·u·max |K| (u of the kernel's dtype); one
        pass over the rows and one over the columns, chunk by chunk."""
        kmax, asym = 0.0, 0.0
        for rows, block in self.chunks():
            s = slice(rows.start // self.o, rows.stop // self.o)
            columns = _flat(self.arr[:, s], self.o)
            kmax = max(kmax, float(np.abs(block).max()))
            asym = max(asym, float(np.abs(block - columns.T).max()))
        check_symmetric(self.fn_name, self.name, asym, kmax, self.dtype)

    def matvec(self, v: np.ndarray) -> np.ndarray:
        """``K v`` in float64 for ``v`` of shape ``(M,)`` or ``(M, R)``."""
        v = np.asarray(v, np.float64)
        out = np.empty(v.shape, np.float64)
        for rows, block in self.chunks():
            out[rows] = block @ v
        return out

    def dense(self) -> np.ndarray:
        """The flat float64 ``(M, M)`` matrix (M² memory)."""
        out = np.empty((self.m, self.m), np.float64)
        for rows, block in self.chunks():
            out[rows] = block
        return out


def eigenvalues_of(fn_name: str, kernel, eigenvalues) -> np.ndarray:
    """float64 eigenvalues from exactly one of ``kernel`` (all of them, dense) or
    ``eigenvalues`` (validated: 1-D, real, finite, non-empty)."""
    if (kernel is None) == (eigenvalues is None):
        got = "neither" if kernel is None else "both"
        what = f"pass exactly one of kernel (positional) and eigenvalues=..., got {got}"
        fix = f"{fn_name}(k) for a formed kernel, or {fn_name}(eigenvalues=w)"
        raise bad(TypeError, fn_name, what, fix)
    if kernel is not None:
        if np.ndim(kernel) == 1:
            what = f"kernel has shape {np.shape(kernel)}, one value per sample; expected (N, N)"
            fix = "pass eigenvalues=w if these are eigenvalues (a diagonal gives no spectrum)"
            raise bad(ValueError, fn_name, what, fix)
        k = HostKernel(fn_name, "kernel", kernel)
        k.check_symmetric()
        import scipy.linalg  # here, not at import: 0.3 s off `import ntk_core`

        return scipy.linalg.eigvalsh(k.dense(), overwrite_a=True, check_finite=False)
    w = np.asarray(eigenvalues)
    if w.ndim != 1 or w.size == 0 or not np.issubdtype(w.dtype, np.number) or np.iscomplexobj(w):
        got = f"dtype {w.dtype}" if w.ndim == 1 and w.size else f"shape {w.shape}"
        what = f"eigenvalues must be a non-empty 1-D array of real numbers, got {got}"
        fix = "pass e.g. numpy.linalg.eigvalsh(k) or kernel_eigsh(k).eigenvalues, or the kernel"
        raise bad(ValueError, fn_name, what, fix)
    w = w.astype(np.float64)
    check_finite(
        fn_name,
        "eigenvalues",
        w,
        "recompute them from a finite kernel",
        cls=ValueError,
        unit="index",
    )
    return w
