"""A square kernel ``(N, N)`` / ``(N, N, O1, O1, ...)`` on the host, read as its flat
``(N·O, N·O)`` matrix (row ``i·O + a``) in float64 row chunks of about 64 MiB."""

from __future__ import annotations

import math

import numpy as np

from ntk_core._errors import bad
from ntk_core._predict.linalg import as_host_array, check_finite, check_symmetric, flat_pairs

#: float64 entries per row chunk (64 MiB).
CHUNK_ENTRIES = 1 << 23


class HostKernel:
    """A validated square kernel; ``m`` = N·O rows of its flat form."""

    def __init__(self, fn_name: str, k, name: str = "kernel"):
        arr = as_host_array(fn_name, name, k)
        shape = tuple(arr.shape)
        square = arr.ndim >= 2 and shape[0] == shape[1] and shape[2::2] == shape[3::2]
        if not square or arr.ndim % 2 or shape[0] == 0:
            what = f"{name} has shape {shape}; expected a square kernel (N, N) / (N, N, O, O)"
            raise bad(ValueError, fn_name, what, "pass the kernel of x (N >= 1) with itself")
        self.fn_name, self.name, self.arr, self.dtype = fn_name, name, arr, arr.dtype
        self.n, self.out_shape, self.o = shape[0], shape[2::2], math.prod(shape[2::2])
        self.m = self.n * self.o

    def chunks(self):
        """Yields ``(flat row slice, float64 block (b·O, M))``, checked for NaN/Inf."""
        rows = max(1, CHUNK_ENTRIES // (self.m * self.o))
        for start in range(0, self.n, rows):
            s = slice(start, min(self.n, start + rows))
            block = self.arr[s]
            check_finite(self.fn_name, self.name, block, first=s.start)
            flat_rows = slice(s.start * self.o, s.stop * self.o)
            yield flat_rows, flat_pairs(np.asarray(block, np.float64), self.o)

    def check_symmetric(self) -> None:
        """Raises unless max |K - Kᵀ| <= 100·u·max |K|, chunk by chunk."""
        kmax, asym = 0.0, 0.0
        for rows, block in self.chunks():
            s = slice(rows.start // self.o, rows.stop // self.o)
            columns = flat_pairs(np.asarray(self.arr[:, s], np.float64), self.o)
            kmax = max(kmax, float(np.abs(block).max()))
            asym = max(asym, float(np.abs(block - columns.T).max()))
        check_symmetric(self.fn_name, self.name, asym, kmax, self.dtype)

    def matvec(self, v: np.ndarray) -> np.ndarray:
        v = np.asarray(v, np.float64)
        out = np.empty(v.shape, np.float64)
        for rows, block in self.chunks():
            out[rows] = block @ v
        return out

    def dense(self) -> np.ndarray:
        out = np.empty((self.m, self.m), np.float64)
        for rows, block in self.chunks():
            out[rows] = block
        return out


def eigenvalues_of(fn_name: str, kernel, eigenvalues) -> np.ndarray:
    """float64 eigenvalues from exactly one of ``kernel`` (dense) or ``eigenvalues``."""
    if (kernel is None) == (eigenvalues is None):
        got = "neither" if kernel is None else "both"
        fix = f"pass exactly one: {fn_name}(k) or {fn_name}(eigenvalues=w)"
        raise bad(TypeError, fn_name, f"got {got} of kernel and eigenvalues", fix)
    if kernel is not None:
        if np.ndim(kernel) == 1:
            what = f"kernel has shape {np.shape(kernel)}, one value per sample; expected (N, N)"
            raise bad(ValueError, fn_name, what, "pass eigenvalues=w if these are eigenvalues")
        k = HostKernel(fn_name, kernel)
        k.check_symmetric()
        import scipy.linalg  # here, not at import: 0.3 s off `import ntk_core`

        return scipy.linalg.eigvalsh(k.dense(), overwrite_a=True, check_finite=False)
    w = np.asarray(eigenvalues)
    if w.ndim != 1 or w.size == 0 or not np.issubdtype(w.dtype, np.number) or np.iscomplexobj(w):
        got = f"dtype {w.dtype}" if w.ndim == 1 and w.size else f"shape {w.shape}"
        what = f"eigenvalues must be a non-empty 1-D array of real numbers, got {got}"
        raise bad(ValueError, fn_name, what, "pass e.g. numpy.linalg.eigvalsh(k), or the kernel")
    w = w.astype(np.float64)
    check_finite(fn_name, "eigenvalues", w, "recompute them", unit="index")
    return w
