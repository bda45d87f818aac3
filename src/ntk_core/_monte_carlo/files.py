"""Monte Carlo kernels written to files (``out=``): a running sum over the samples on
disk, resumable after the process is killed.

``monte_carlo_kernels(..., batch_size=B, out="mc.npy")`` writes the NNGP's mean to
``mc.nngp.npy`` and the NTK's to ``mc.ntk.npy`` (standard ``.npy`` files, returned
read-only and memory-mapped). Sample s's kernel is computed tile by tile by the
blocked engine, and each tile is added to the sum of the samples before it on its way
to the disk, exactly as the in-memory average sums (in float32 or wider):

    sum_0 = k_0,   sum_s = sum_{s-1} + k_s,   mean = (sum_{S-2} + k_{S-1}) / S
    (the mean cast to the kernel's dtype, written by the last sample's tiles)

so the files equal the in-memory result bit for bit. Sample s reads the sum of the
samples before it from one file and writes its own into another (double buffering):
a kill at any moment leaves the earlier sum whole, and the resumed call redoes at most
the tiles of the last second of the sample it was in. The buffers of kind K
(``nngp``, ``ntk``), counted back from the last sample, which writes the mean:

* ``mc.K.npy``: the mean; also the sums of samples S-3, S-5, ... when the running sum
  has the kernel's dtype (float32 and float64 kernels), so that two files suffice;
* ``mc.K.sum-a.npy`` (samples S-2, S-4, ...) and, for half-precision kernels (summed
  in float32), ``mc.K.sum-b.npy`` (samples S-3, S-5, ...); removed once the mean is
  written.

Each buffer is an :class:`ntk_core._blocked.store.NpyStore` file with its manifest; its
fingerprint holds the digests of x1, x2, the key and the first sample's
initialisation, ``n_samples``, the sample whose sum it holds, and the options, model,
shape, dtype and tile grid, so a resume of a different call is refused naming what
differs.
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np

from ntk_core._blocked import store as _store
from ntk_core._errors import NonFiniteError, bad

#: The Monte Carlo kernels, in the order of ``Kernels``.
KINDS = ("nngp", "ntk")


def kind_options(kind: str, options: dict, files: MonteCarloFiles | None) -> dict:
    """The options of the kind's kernel functions: the NNGP's without
    ``implementation``; with ``files``, ``out`` the kind's :class:`RunningSum`."""
    options = {k: v for k, v in options.items() if not (kind == "nngp" and k == "implementation")}
    if files is not None:
        options.update(out=files.sums[kind], resume=False, overwrite=False)
    return options


class MonteCarloFiles:
    """The files of one Monte Carlo call with ``out=`` (see the module docstring).

    Args:
      fn: the public function's name, for messages.
      out: the path ending in ``.npy`` the user gave (``mc.npy``).
      resume, overwrite: the options.
      key, n_samples: the samples' key and number S.
      x1, x2: the inputs.
      init: the function of a key that initialises one sample (its digest for key
        ``jax.random.split(key, S)[0]`` identifies the initialisation).

    Raises:
      ValueError: files of the run that exist without ``resume`` or ``overwrite`` and
        are not its finished result; a resume of a different call (the message names
        what differs).
    """

    def __init__(self, fn, out, resume, overwrite, key, n_samples, x1, x2, init):
        self.fn, self.out, self.n_samples = fn, out, n_samples
        self.resume, self.overwrite = resume, overwrite
        self.process, self.barrier = _store.processes()
        stem = out[: -len(".npy")]
        if not os.path.basename(stem):
            what = f"out={out!r} has no name before '.npy'"
            raise bad(ValueError, fn, what, "name it, e.g. out='mc.npy'")
        first_key = jax.random.split(key, n_samples)[0]
        self.common = {
            **_store.inputs(x1, x2),
            "key": _store._digest_tree(key),
            # the initialisation's code and captured values, and what it gives sample 0
            "initialisation (its jaxpr)": _store.model_digest(jax.make_jaxpr(init)(first_key)),
            "initialisation (sample 0)": _store._digest_tree(init(first_key)),
            "n_samples": n_samples,
        }
        self.sums = {kind: RunningSum(self, kind, f"{stem}.{kind}.npy") for kind in KINDS}
        for path in (p for rs in self.sums.values() for p in rs.buffers):
            if os.path.isdir(path):
                what = f"out={out!r} writes {path!r}, which is a folder"
                raise bad(ValueError, fn, what, "give another path")
        if overwrite:
            self._remove([p for rs in self.sums.values() for p in rs.buffers])
        self.first = min(rs.first() for rs in self.sums.values())
        self.sample = self.first

    def begin(self, sample: int) -> None:
        """The next kernel calls are sample ``sample``'s."""
        self.sample = sample

    def finish(self) -> None:
        """Removes the running sums once every kind's mean is written."""
        self._remove([p for rs in self.sums.values() for p in rs.buffers if p != rs.path])

    def _remove(self, paths) -> None:
        if self.process[0] == 0:
            for path in paths:
                for name in (path, _store.manifest_path(path), *_store._process_manifests(path)):
                    if os.path.exists(name):
                        os.unlink(name)
                _store._remove_temporaries(path)
        if self.barrier is not None:
            self.barrier(f"ntk_core out= removed: {self.out}")


class RunningSum(_store.Sink):
    """The ``out=`` of one kind's kernel functions: opens, for the current sample, the
    buffer that its tiles (added to the previous sample's sum) are written into."""

    def __init__(self, files: MonteCarloFiles, kind: str, path: str):
        self.files, self.kind, self.path = files, kind, path
        stem = path[:-4]
        #: every file this kind may use, the result first
        self.buffers = [path, f"{stem}.sum-a.npy", f"{stem}.sum-b.npy"]
        self.checked_space = False

    def buffer(self, sample: int, same_dtype: bool) -> str:
        """The file that sample ``sample``'s sum (the mean, for the last) goes to."""
        back = self.files.n_samples - 1 - sample  # 0 for the last sample
        if back == 0:
            return self.path
        if same_dtype:
            return self.buffers[back % 2]  # the result file and sum-a, alternately
        return self.buffers[1 + (back + 1) % 2]  # sum-a and sum-b, alternately

    def first(self) -> int:
        """The first sample not yet summed into a finished buffer (``n_samples``: the
        mean is written); refuses existing files that this call may not use."""
        files, fn = self.files, self.files.fn
        found, other, unknown = [], None, None
        existing = [p for p in self.buffers if os.path.exists(p)]
        for path in existing:
            manifest = _store._read_manifest(path)
            fp = (manifest or {}).get("fingerprint", {})
            common = {k: fp.get(k) for k in files.common}
            if manifest is None:
                unknown = path
            elif common != files.common:
                other = (path, _store.differences(common, files.common))
            elif manifest.get("complete"):
                found.append(int(fp.get("sample", -1)))
        first = max(found) + 1 if found else 0
        if not existing or first == files.n_samples:
            return first  # nothing yet; or the finished mean, checked when it is opened
        if not files.resume:
            raise _store.exists_error(fn, f"out={files.out!r}: {existing[0]!r}")
        if unknown is not None and other is None and not found:
            why = f"{_store.manifest_path(unknown)!r} is missing or unreadable"
            raise _store.resume_error(fn, why)
        if other is not None and not found:
            path, differs = other
            raise _store.resume_error(fn, f"{path!r} was started by a different call", differs)
        return first

    def fingerprint(self, layout: _store.FileLayout, sample: int, dtype) -> dict:
        return {
            **self.files.common,
            "sample": sample,
            **_store.described(layout.described, layout.shape, dtype, layout.grid),
        }

    def open(self, fn, layout, x1, x2, params, aux) -> _store.NpyStore:
        files = self.files
        s, n = files.sample, files.n_samples
        dtype = layout.dtype
        wide = np.promote_types(dtype, np.float32)
        same = wide == dtype
        path = self.buffer(s, same)
        if files.first == n:  # the finished mean: returned if it is this call's
            return self._store(fn, layout, path, s, dtype, files.resume, False)
        if not self.checked_space:
            self._check_space(fn, layout, same)
        earlier_sum = None  # the sum of the samples before s, read tile by tile
        if s > 0:
            previous = self.buffer(s - 1, same)
            manifest = _store._read_manifest(previous) or {}
            expected = self.fingerprint(layout, s - 1, wide)
            if not manifest.get("complete") or manifest.get("fingerprint") != expected:
                differs = _store.differences(manifest.get("fingerprint", {}), expected)
                why = (
                    f"the sum of samples 0..{s - 1} in {previous!r} was started by a different call"
                )
                raise _store.resume_error(fn, why, differs)
            earlier_sum = _store.NpyReader(fn, previous, layout.shape, wide, "the running sum")
        last = s == n - 1
        into = dtype if last else wide
        manifest = _store._read_manifest(path) if os.path.exists(path) else None
        started = manifest is not None and manifest.get("fingerprint") == self.fingerprint(
            layout, s, into
        )

        def add(tile, r0, r1, c0, c1):
            """The tile added to the sum of the samples before (in ``wide``); divided
            by S and cast for the last sample (as the in-memory average)."""
            total = tile.astype(wide)
            if earlier_sum is not None:
                earlier = earlier_sum.read(r0, r1, c0, c1, layout.batch_diagonal)
                total = np.add(earlier, total)
            if last:
                total = (total / n).astype(dtype)
            if not np.isfinite(total).all():
                what = f"the {self.kind.upper()} came out non-finite in rows {r0}..{r1 - 1}"
                fix = "compute in float64, or pass overwrite=True if the file was changed"
                raise bad(NonFiniteError, fn, what, fix, see="non-finite-kernel")
            return total

        return self._store(fn, layout, path, s, into, started, not started, add)

    def _store(self, fn, layout, path, sample, dtype, resume, overwrite, transform=None):
        return _store.NpyStore(
            fn,
            path,
            layout.shape,
            dtype,
            layout.perms,
            layout.batch_diagonal,
            self.fingerprint(layout, sample, dtype),
            resume,
            overwrite,
            self.files.process,
            self.files.barrier,
            transform,
        )

    def _check_space(self, fn, layout, same) -> None:
        """Free disk space for the buffers not yet created, before anything runs."""
        self.checked_space = True
        files = self.files
        wide = np.promote_types(layout.dtype, np.float32)
        entries = int(np.prod(layout.shape, dtype=np.int64))
        needed = {}
        for s in range(files.first, files.n_samples):
            path = self.buffer(s, same)
            size = entries * (layout.dtype if s == files.n_samples - 1 else wide).itemsize
            needed[path] = max(needed.get(path, 0), size)
        missing = sum(v for p, v in needed.items() if not os.path.exists(p))
        folder = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(folder):
            return  # NpyStore says so
        free = shutil.disk_usage(folder).free
        if missing > free:
            raise _store.no_space_error(fn, f"out={files.out!r}", missing, free)
