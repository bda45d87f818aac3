"""Monte Carlo kernels with ``out="mc.npy"``: the running sum over the samples kept on disk,
tile by tile (``sum_s = sum_{s-1} + k_s``, the last sample's tiles written as the mean in the
kernels' dtype, bit for bit the in-memory average), in two alternating buffers per kind, so
that a kill leaves the earlier sum whole and ``resume=True`` redoes at most the last second."""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import numpy as np

from ntk_core._blocked import store as _store
from ntk_core._blocked.tiles import non_finite
from ntk_core._errors import bad
from ntk_core._kernel.kind import NTK_ONLY

#: The Monte Carlo kernels, in the order of ``Kernels``.
KINDS = ("nngp", "ntk")
#: The fingerprint's entry of the sample a sum ends with.
_SAMPLE = "sample"


def kind_options(kind: str, options: dict, files: MonteCarloFiles | None) -> dict:
    """The kind's options: none of the NTK's own (``implementation``, ``wrt``: the NNGP takes
    no derivative) for the NNGP; ``out`` its :class:`RunningSum`."""
    options = {k: v for k, v in options.items() if not (kind == "nngp" and k in NTK_ONLY)}
    if files is not None:
        options.update(out=files.sums[kind], resume=False, overwrite=False)
    return options


class MonteCarloFiles:
    """The files of one Monte Carlo call, fingerprinted also by the key, sample 0's
    initialisation, ``n_samples`` and ``sample``. ValueError for existing files without
    ``resume``/``overwrite``, or a resume of another call (naming what differs)."""

    def __init__(self, fn, options, key, n_samples, x1, x2, init):
        self.fn, self.out, self.n_samples = fn, options.out, n_samples
        self.resume, self.overwrite = options.resume, options.overwrite
        self.process, self.barrier = _store.processes()
        stem = self.out[:-4]  # without .npy
        if not os.path.basename(stem):
            what = f"out={self.out!r} has no name before '.npy'"
            raise bad(ValueError, fn, what, "name it, e.g. out='mc.npy'")
        first_key, digest = jax.random.split(key, n_samples)[0], _store._digest_tree
        code = _store.model_digest(jax.make_jaxpr(init)(first_key))  # with its captured values
        sample0 = digest(init(first_key))
        self.common = {**_store.inputs(x1, x2), "key": digest(key), "n_samples": n_samples}
        self.common |= {"initialisation (its jaxpr)": code, "initialisation (sample 0)": sample0}
        self.sums = {kind: RunningSum(self, kind, f"{stem}.{kind}.npy") for kind in KINDS}
        paths = [p for rs in self.sums.values() for p in rs.buffers]
        for path in filter(os.path.isdir, paths):
            raise _store.folder_error(fn, f"out={self.out!r}: {path!r}")
        if self.overwrite:
            self._remove(paths)
        self.first = self.sample = min(rs.first() for rs in self.sums.values())

    def finish(self) -> None:  # every kind's mean is written
        self._remove([p for rs in self.sums.values() for p in rs.buffers[1:]])

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
    """One kind's ``out=``: the buffer of the current sample's tiles plus the earlier sum."""

    def __init__(self, files: MonteCarloFiles, kind: str, path: str):
        self.files, self.kind, self.path = files, kind, path
        #: every file this kind may use, the result first
        self.buffers = [path, f"{path[:-4]}.sum-a.npy", f"{path[:-4]}.sum-b.npy"]
        self.checked_space = False

    def buffer(self, sample: int, same_dtype: bool) -> str:
        """The file of sample ``sample``'s sum: the result for the last, before it alternately
        the result and sum-a in the kernel's dtype, else sum-a and sum-b (float32 sums)."""
        back = self.files.n_samples - 1 - sample
        if back == 0:
            return self.path
        return self.buffers[back % 2] if same_dtype else self.buffers[1 + (back + 1) % 2]

    def first(self) -> int:
        """The first sample not summed yet (``n_samples``: the mean is written), or refusal."""
        files, fn = self.files, self.files.fn
        found, other, unknown = [], None, None
        existing = [p for p in self.buffers if os.path.exists(p)]
        for path in existing:
            manifest = _store._read_manifest(path)
            fp = (manifest or {}).get(_store.FP, {})
            common = {k: fp.get(k) for k in files.common}
            if manifest is None:
                unknown = path
            elif common != files.common:
                other = (path, _store.differences(common, files.common))
            elif manifest.get(_store.COMPLETE):
                found.append(int(fp.get(_SAMPLE, -1)))
        first = max(found) + 1 if found else 0
        if not existing or first == files.n_samples:
            return first  # nothing yet; or the finished mean, checked when it is opened
        if not files.resume:
            raise _store.exists_error(fn, f"out={files.out!r}: {existing[0]!r}")
        if unknown is not None and other is None and not found:
            raise _store.resume_error(fn, unknown)
        if other is not None and not found:
            raise _store.resume_error(fn, *other)
        return first

    def fingerprint(self, layout: _store.FileLayout, sample: int, dtype) -> dict:
        described = _store.described(layout.described, layout.shape, dtype, layout.grid)
        return {**self.files.common, _SAMPLE: sample, **described}

    def open(self, fn, layout, x1, x2, params, aux) -> _store.NpyStore:
        files = self.files
        s, n, dtype = files.sample, files.n_samples, layout.dtype
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
            old, expected = manifest.get(_store.FP, {}), self.fingerprint(layout, s - 1, wide)
            if not manifest.get(_store.COMPLETE) or old != expected:
                raise _store.resume_error(fn, previous, _store.differences(old, expected))
            earlier_sum = _store.NpyReader(fn, previous, layout.shape, wide, "the running sum")
        last = s == n - 1
        into = dtype if last else wide
        manifest = _store._read_manifest(path) if os.path.exists(path) else None
        started = (manifest or {}).get(_store.FP) == self.fingerprint(layout, s, into)

        def add(tile, r0, r1, c0, c1):
            """The tile added to the earlier sum (in ``wide``); the mean, cast, for the last."""
            total = tile.astype(wide)
            if earlier_sum is not None:
                total = np.add(earlier_sum.read(r0, r1, c0, c1, layout.batch_diagonal), total)
            if last:
                total = (total / n).astype(dtype)
            if not np.isfinite(total).all():
                what = f"the {self.kind.upper()} came out non-finite in rows {r0}..{r1 - 1}"
                fix = "compute in float64, or pass overwrite=True if the file was changed"
                raise non_finite(fn, what, fix)
            return total

        return self._store(fn, layout, path, s, into, started, not started, add)

    def _store(self, fn, layout, path, sample, dtype, resume, overwrite, transform=None):
        fp = self.fingerprint(layout, sample, dtype)
        layout = dataclasses.replace(layout, dtype=np.dtype(dtype))
        process = (self.files.process, self.files.barrier)
        return _store.NpyStore(fn, path, layout, fp, resume, overwrite, *process, transform)

    def _check_space(self, fn, layout, same) -> None:
        """Free disk space for the buffers not yet created, before anything runs."""
        self.checked_space = True
        files, n = self.files, self.files.n_samples
        wide = np.promote_types(layout.dtype, np.float32)
        entries = int(np.prod(layout.shape, dtype=np.int64))
        needed = {}
        for s in range(files.first, n):
            path = self.buffer(s, same)
            size = entries * (layout.dtype if s == n - 1 else wide).itemsize
            needed[path] = max(needed.get(path, 0), size)
        missing = sum(v for p, v in needed.items() if not os.path.exists(p))
        folder = os.path.dirname(os.path.abspath(self.path))  # missing: NpyStore says so
        if os.path.isdir(folder) and missing > (free := shutil.disk_usage(folder).free):
            raise _store.no_space_error(fn, files.out, missing, free)
