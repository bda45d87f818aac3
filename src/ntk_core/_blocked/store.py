"""Out-of-core kernels: the blocked engine's tiles written into a ``.npy`` file that
outlives the process (``out=``), and resumed after it is killed (``resume=True``).

The file is a standard ``.npy`` created at its final shape and dtype
(``numpy.lib.format.open_memmap``), so ``np.load(path, mmap_mode="r")`` reads it and
:mod:`ntk_core.predict` takes it. Host memory holds the tiles in flight, not N1 x N2.

Beside it, ``<path>.manifest.json`` says what the file is and how far it got:

* ``fingerprint``: SHA-256 digests of x1, x2, the parameters and the fixed model
  state (``aux``), and the options, dtype, shape and tile grid, in plain words, so that
  a resume with anything different is refused naming what differs;
* ``done``: the tiles written, each by its first row and column ``[r0, c0]`` (with
  x2=None a tile and its mirror are one entry);
* ``complete``: every tile written.

Crash safety: tiles are written into the file (``os.pwrite``) and, at most every
:data:`COMMIT_SECONDS`, synced to the disk (``fsync``) before the manifest lists them,
and the manifest is replaced atomically (written to a temporary file, flushed and
synced, then ``os.replace``d), so after a SIGKILL at any moment the manifest lists only
tiles whose bytes are on disk; a resumed call computes the others (at most the last
second's), with the same compiled programs on the same blocks, so the finished file
equals an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import time

import jax
import numpy as np
from numpy.lib.format import open_memmap

from ntk_core._blocked.sink import Sink as Sink
from ntk_core._errors import bad, one_line
from ntk_core._kernel.layout import leaf_layouts, swap_perm
from ntk_core._units import human_bytes

#: Version of the manifest's layout.
MANIFEST_VERSION = 1
#: Seconds between two commits of written tiles to the manifest (:meth:`NpyStore.commit`).
COMMIT_SECONDS = 1.0


def manifest_path(path: str) -> str:
    """Where the manifest of ``path`` lives: ``<path>.manifest.json``."""
    return path + ".manifest.json"


def _digest_tree(tree) -> str:
    """SHA-256 of a pytree's structure and its leaves' shapes, dtypes and bytes."""
    h = hashlib.sha256()
    leaves, treedef = jax.tree.flatten(tree)
    h.update(str(treedef).encode())
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)  # typed keys: their key data
            a = np.ascontiguousarray(np.asarray(leaf))
            h.update(f"{a.shape}{a.dtype}".encode())
            h.update(a.tobytes())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


def inputs(x1, x2) -> dict:
    """The digests of x1 and x2 in a fingerprint."""
    return {
        "x1": _digest_tree(x1),
        "x2": "x2=None (the Gram matrix of x1)" if x2 is None else _digest_tree(x2),
    }


def described(options: dict, shape, dtype, grid) -> dict:
    """The options, shape, dtype and tile grid in a fingerprint."""
    return {
        "options": {k: repr(v) for k, v in sorted(options.items())},
        "shape": list(shape),
        "dtype": str(np.dtype(dtype)),
        "tile grid": list(grid),
    }


def fingerprint(params, x1, x2, aux, options: dict, shape, dtype, grid) -> dict:
    """What a file holds, as a JSON-ready dict of plain values (see the module
    docstring): digests of the arrays, and the options, shape, dtype and tile grid."""
    return {
        **inputs(x1, x2),
        "params": _digest_tree(params),
        "model state (aux)": _digest_tree(aux),
        **described(options, shape, dtype, grid),
    }


#: Fingerprint entries whose values a refusal shows (the others are digests).
SHOWN = ("shape", "dtype", "tile grid", "n_samples", "sample")


def differences(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints, in words for a refusal."""
    names = []
    for key in new:
        if old.get(key) == new[key]:
            continue
        if key == "options" and isinstance(old.get(key), dict):
            changed = sorted(
                k for k in set(old[key]) | set(new[key]) if old[key].get(k) != new[key].get(k)
            )
            names.append(
                "options ("
                + ", ".join(
                    f"{k}: {old[key].get(k, 'unset')} -> {new[key].get(k, 'unset')}"
                    for k in changed
                )
                + ")"
            )
        elif key in SHOWN:
            names.append(f"{key} ({old.get(key)} -> {new[key]})")
        else:
            names.append(key)
    return names


def _write_json_atomically(path: str, data: dict) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # the rename itself durable (POSIX: sync the folder)
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _read_manifest(path: str) -> dict | None:
    try:
        with open(manifest_path(path)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("version") == MANIFEST_VERSION else None


class NpyStore:
    """The result of a blocked call written tile by tile into ``path`` (see the module
    docstring). The blocked engine asks :meth:`is_done` before computing a tile,
    :meth:`put` s each computed tile, and returns :meth:`result`.

    Args:
      fn: the public function's name, for messages.
      path: the ``.npy`` file.
      shape, dtype: the kernel's.
      perms: the axis permutation of the mirror tile (x2=None).
      batch_diagonal: a kernel of the per-sample diagonal ``(N, ...)``.
      fingerprint: :func:`fingerprint` of the call.
      resume, overwrite: the options.
      process: (index, count) of this process among the run's processes.
      barrier: ``barrier(name)`` waits for every process (None: one process).
      transform: ``transform(tile, r0, r1, c0, c1) -> array`` applied to each computed
        tile (cut to its rows and columns) before it is written, e.g. a running sum
        (:mod:`ntk_core._monte_carlo.files`); None: the tile as computed.

    Raises:
      ValueError: an existing file without ``resume`` or ``overwrite``; a resume whose
        file or manifest is missing or describes another computation (the message
        names what differs); a folder that does not exist or cannot be written; too
        little free disk space (the message says how much is needed).
    """

    def __init__(
        self,
        fn,
        path,
        shape,
        dtype,
        perms,
        batch_diagonal,
        fingerprint,
        resume,
        overwrite,
        process=(0, 1),
        barrier=None,
        transform=None,
    ):
        self.fn, self.path = fn, path
        self.transform = transform
        self.perms, self.batch_diagonal = perms, batch_diagonal
        self.process, self.barrier = process, barrier
        self.manifest = {
            "version": MANIFEST_VERSION,
            "fingerprint": fingerprint,
            "done": [],
            "complete": False,
        }
        self.done: set[tuple[int, int]] = set()
        self.mine: list = []  # this process's tiles done in this run (several processes)
        self.pending: list = []  # tiles written since the last commit
        self.committed = time.monotonic()
        self.fd = None  # the file, open for writing (os.pwrite)
        self.shape, self.itemsize = tuple(shape), np.dtype(dtype).itemsize
        # Every process makes the same checks on the same file (so all refuse alike),
        # then the first creates the file, then all open it.
        old = _read_manifest(path) if os.path.exists(path) else None
        self.finished = bool(
            old is not None and old.get("fingerprint") == fingerprint and old.get("complete")
        )
        if self.finished:  # the same computation, finished: nothing to do
            return
        create = not (os.path.exists(path) and resume)
        if create:
            self._check_new(shape, dtype, overwrite)
        else:
            self._check_resume(old, fingerprint, shape, dtype)
        self._sync("checked")
        first = process[0] == 0
        if create and first:
            try:  # the new file first: an old file that cannot be replaced stays known
                created = open_memmap(path, mode="w+", dtype=dtype, shape=tuple(shape))
                created.flush()  # the header; the data stays a hole until written
                del created
            except OSError as e:
                raise self._os_error("create", e) from e
            for stale in (manifest_path(path), *_process_manifests(path)):
                if os.path.exists(stale):
                    os.unlink(stale)  # the old file's: no longer true
            self._write(manifest_path(path), self.manifest)
        if first:  # no process writes a manifest between these two barriers
            _remove_temporaries(path)
        self._sync("created")
        try:
            self.offset = np.load(path, mmap_mode="r").offset  # the header's length
            self.fd = os.open(path, os.O_RDWR)
        except (OSError, ValueError) as e:
            raise self._os_error("open", e) from e
        if not create:
            self.done = {tuple(t) for t in old.get("done", [])}
            for other in _process_manifests(path):  # the processes of earlier runs
                found = _read_json(other)
                self.done |= {tuple(t) for t in (found or {}).get("done", [])}
            self.manifest["done"] = sorted(list(t) for t in self.done)

    def __del__(self):  # a call that failed midway: its file descriptor closed
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)

    def _sync(self, name: str) -> None:
        if self.barrier is None:
            return
        try:
            self.barrier(f"ntk_core out= {name}: {self.path}")
        except Exception as e:  # a process of the run stopped (killed, failed)
            what = f"a process of this run stopped at '{name}' ({one_line(e)[:200]})"
            fix = "start every process again with resume=True"
            raise bad(ValueError, self.fn, what, fix) from e

    def _os_error(self, doing: str, error: Exception) -> ValueError:
        what = f"could not {doing} out={self.path!r}: {one_line(error)}"
        return bad(
            ValueError, self.fn, what, "make the file and its folder writable, or give another path"
        )

    def _write(self, path: str, data: dict) -> None:
        try:
            _write_json_atomically(path, data)
        except OSError as e:
            raise self._os_error(f"write the manifest {path!r} of", e) from e

    def _check_new(self, shape, dtype, overwrite) -> None:
        fn, path = self.fn, self.path
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        folder = os.path.dirname(os.path.abspath(path))
        where = f"out={path!r}"
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            what = f"{where}: the folder {folder!r} does not exist or cannot be written"
            raise bad(ValueError, fn, what, "create it (os.makedirs), or give another path")
        if os.path.isdir(path):
            what = f"{where} is a folder, not a file"
            raise bad(ValueError, fn, what, "give a file path ending in .npy")
        if os.path.exists(path) and not overwrite:
            raise exists_error(fn, where)
        free = shutil.disk_usage(folder).free
        if os.path.exists(path):
            free += os.path.getsize(path)  # replaced
        if nbytes > free:
            raise no_space_error(fn, where, nbytes, free)

    def _check_resume(self, old, fingerprint, shape, dtype) -> None:
        fn, path = self.fn, self.path
        if old is None:
            raise resume_error(fn, f"{manifest_path(path)!r} is missing or unreadable")
        differs = differences(old.get("fingerprint", {}), fingerprint)
        if differs:
            raise resume_error(fn, f"{path!r} was started by a different call", differs)
        try:
            header = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise self._damaged(e) from e
        if header.shape != tuple(shape) or header.dtype != np.dtype(dtype):
            got = f"{header.shape} {header.dtype}, not {tuple(shape)} {np.dtype(dtype)}"
            raise self._damaged(ValueError(got))
        del header

    def _damaged(self, error: Exception) -> ValueError:
        return damaged(self.fn, self.path, one_line(error))

    def share(self, tiles: list) -> set:
        """This process's share of ``tiles`` (each ``(r0, c0)``, in the same order in
        every process): of those not done, every P-th from the process index, P
        processes (all of them with one process)."""
        index, count = self.process
        remaining = [t for t in tiles if not self.is_done(*t)]
        return set(remaining[index::count])

    def is_done(self, r0: int, c0: int) -> bool:
        return self.finished or (r0, c0) in self.done

    def put(self, tile, r0, r1, c0, c1, mirror: bool) -> None:
        """Writes one tile (and its mirror) into the file; :meth:`commit` lists it.

        Written row by row with ``os.pwrite``, not through a memory map: the pages of
        a map written by the process count as its resident memory until the system
        evicts them (a 30 000 x 30 000 kernel written through a map read 4.3 GB of peak
        RSS), the page cache's do not."""
        (leaf,) = jax.tree.leaves(tile)
        a = np.asarray(leaf)
        rows = r1 - r0
        a = a[:rows] if self.batch_diagonal else a[:rows, : c1 - c0]
        if self.transform is not None:
            a = self.transform(a, r0, r1, c0, c1)
        if self.batch_diagonal:
            self._rows(np.ascontiguousarray(a), r0, 0)
        else:
            self._rows(a, r0, c0)
            if mirror:
                self._rows(np.transpose(a, self.perms[0]), c0, r0)
        self.done.add((r0, c0))
        self.pending.append([r0, c0])
        if time.monotonic() - self.committed >= COMMIT_SECONDS:
            self.commit()

    def _rows(self, block, r0: int, c0: int) -> None:
        """``block`` (rows x columns x ...) written at row ``r0``, column ``c0``."""
        c1 = c0 + (0 if self.batch_diagonal else block.shape[1])
        runs = _runs(self.shape, self.itemsize, self.batch_diagonal, r0, r0 + len(block), c0, c1)
        if self.batch_diagonal:  # (N, ...): consecutive rows are one run of bytes
            ((start, _),) = runs
            os.pwrite(self.fd, np.ascontiguousarray(block).tobytes(), self.offset + start)
            return
        for (start, _), row in zip(runs, block, strict=True):
            os.pwrite(self.fd, np.ascontiguousarray(row).tobytes(), self.offset + start)

    def commit(self) -> None:
        """Syncs the tiles written since the last commit to the disk (``fsync``), then
        lists them in the manifest (replaced atomically). At most every
        :data:`COMMIT_SECONDS`: syncing and rewriting the manifest after each tile cost
        26 ms per tile at 1830 tiles (the manifest grows with the tiles). A kill loses
        at most the tiles of the last second, which a resume computes again."""
        self.committed = time.monotonic()
        if not self.pending:
            return
        os.fsync(self.fd)  # the bytes are in the file before the manifest says so
        if self.process[1] == 1:
            self.manifest["done"] += self.pending
            self._write(manifest_path(self.path), self.manifest)
        else:  # each process lists its own tiles, in its own file
            self.mine += self.pending
            own = {"version": MANIFEST_VERSION, "done": self.mine}
            self._write(_process_manifest(self.path, self.process), own)
        self.pending = []

    def result(self):
        """The finished file, read-only and memory-mapped (``np.load(path,
        mmap_mode="r")``); the manifest marked complete (by the first process, once
        every process has written its share)."""
        if not self.finished:
            self.commit()
            os.close(self.fd)
            self.fd = None
            self._sync("written")
            if self.process[0] == 0:
                done = {tuple(t) for t in self.manifest["done"]} | self.done
                others = _process_manifests(self.path)
                for other in others:
                    done |= {tuple(t) for t in (_read_json(other) or {}).get("done", [])}
                self.manifest["done"] = sorted(list(t) for t in done)
                self.manifest["complete"] = True
                self._write(manifest_path(self.path), self.manifest)
                for other in others:
                    os.unlink(other)
            self._sync("complete")
        try:
            return np.load(self.path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise self._damaged(e) from e


def _runs(shape, itemsize: int, batch_diagonal: bool, r0: int, r1: int, c0: int, c1: int):
    """The byte runs ``(start, length)`` (from the end of the header) that rows
    ``r0:r1``, columns ``c0:c1`` of a C-ordered array of ``shape`` occupy; one run for
    a kernel of the per-sample diagonal ``(N, ...)`` (rows only)."""
    entry = int(np.prod(shape[1 if batch_diagonal else 2 :], dtype=np.int64)) * itemsize
    if batch_diagonal:
        return [(r0 * entry, (r1 - r0) * entry)]
    row_bytes = shape[1] * entry
    return [(r * row_bytes + c0 * entry, (c1 - c0) * entry) for r in range(r0, r1)]


def exists_error(fn: str, where: str) -> ValueError:
    """An out= file that exists and is not this call's finished result."""
    what = f"{where} exists, and is not the finished result of this call"
    return bad(
        ValueError, fn, what, "pass resume=True (same call), overwrite=True, or another path"
    )


def no_space_error(fn: str, where: str, needed: int, free: int) -> ValueError:
    what = f"{where} needs {human_bytes(needed)}, the disk has {human_bytes(free)} free"
    return bad(ValueError, fn, what, "free disk space, or write to another disk")


def resume_error(fn: str, why: str, differs=()) -> ValueError:
    """resume=True refused: ``why``, with what ``differs`` from the earlier call."""
    what = f"resume=True, but {why}" + (f": {'; '.join(differs)} differ" if differs else "")
    return bad(ValueError, fn, what, "resume the same call, or pass overwrite=True")


def damaged(fn: str, path: str, why: str, what: str = "the .npy") -> ValueError:
    """The ValueError for an out= file that is not what its manifest describes."""
    what = f"{path!r} cannot be read as {what} its manifest describes ({why})"
    return bad(ValueError, fn, what, "pass overwrite=True, or another path")


class NpyReader:
    """Regions of a ``.npy`` file read with ``os.pread`` (not through a memory map,
    whose pages would count as the process's memory); the header read once.

    Raises:
      ValueError: the file cannot be read as a ``.npy`` of ``shape`` and ``dtype``
        (damaged, cut short, changed), naming ``fn`` and the fix.
    """

    def __init__(self, fn: str, path: str, shape, dtype, what: str):
        self.path, self.fd = path, None
        try:
            header = np.load(path, mmap_mode="r")
            self.shape, self.dtype, self.offset = header.shape, header.dtype, header.offset
            del header
            why = None
            if self.shape != tuple(shape) or self.dtype != np.dtype(dtype):
                why = f"shape or dtype not {tuple(shape)} {np.dtype(dtype).name}"
            else:
                self.fd = os.open(path, os.O_RDONLY)
        except (OSError, ValueError) as e:
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            raise damaged(fn, path, why, what)

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)

    def read(self, r0: int, r1: int, c0: int, c1: int, batch_diagonal: bool):
        """Rows ``r0:r1`` and columns ``c0:c1`` (rows only for a kernel of the
        per-sample diagonal), a new array."""
        runs = _runs(self.shape, self.dtype.itemsize, batch_diagonal, r0, r1, c0, c1)
        tail = self.shape[1:] if batch_diagonal else (c1 - c0, *self.shape[2:])
        out = np.empty((r1 - r0, *tail), self.dtype)
        flat = out.reshape(-1).view(np.uint8)
        at = 0
        for start, length in runs:
            got = os.pread(self.fd, length, self.offset + start)
            if len(got) != length:
                raise OSError(f"{self.path!r} ends before byte {self.offset + start + length}")
            flat[at : at + length] = np.frombuffer(got, np.uint8)
            at += length
        return out


def _process_manifest(path: str, process) -> str:
    """Process ``index`` of ``count``'s own list of tiles done (several processes)."""
    index, count = process
    return f"{path}.manifest.p{index}of{count}.json"


def _process_manifests(path: str) -> list[str]:
    """Every process's own list beside ``path`` (of any earlier run)."""
    folder = os.path.dirname(os.path.abspath(path))
    prefix = os.path.basename(path) + ".manifest.p"
    return sorted(
        os.path.join(folder, name)
        for name in os.listdir(folder)
        if name.startswith(prefix) and name.endswith(".json")
    )


def _remove_temporaries(path: str) -> None:
    """Removes the temporary manifests of ``path`` that a killed process left (written
    by :func:`_write_json_atomically`, killed before their ``os.replace``)."""
    folder = os.path.dirname(os.path.abspath(path))
    prefix = f".{os.path.basename(manifest_path(path))[: -len('.json')]}"
    for name in os.listdir(folder):
        if name.startswith(prefix) and ".tmp-" in name:
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def model_digest(closed) -> str:
    """SHA-256 of the model's jaxpr as printed, without the memory addresses that the
    printout of some equations (custom derivatives) carries, and of the values of the
    constants it captured (arrays the function closes over, which the printout shows
    only as variables): the same model gives the same digest in another process, and a
    model whose captured array changed gives another."""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x", str(closed.jaxpr))
    consts = _digest_tree(list(closed.consts))
    return hashlib.sha256(text.encode() + consts.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class FileLayout:
    """What a blocked call's file holds: its ``shape`` and ``dtype``, ``perms`` (the
    axis permutation of a mirror tile, x2=None), ``batch_diagonal`` (a kernel of the
    per-sample diagonal ``(N, ...)``), ``described`` (the options and the model's
    digest, as the fingerprint names them) and the tile ``grid`` (rows, columns)."""

    shape: tuple
    dtype: np.dtype
    perms: list
    batch_diagonal: bool
    described: dict
    grid: tuple


def processes():
    """``((index, count), barrier)`` of this process among ``jax.distributed``'s (the
    barrier None with one process)."""
    count = jax.process_count()
    return (jax.process_index(), count), (_barrier() if count > 1 else None)


def for_call(spec, config, cut, model: str, params, x1, x2, aux) -> NpyStore:
    """The :class:`NpyStore` of a blocked call with ``out=`` (``spec``: the kernel
    function, ``config``: the plan, ``cut``: the tiling, ``model``:
    :func:`model_digest`): a path's, or the one a :class:`Sink` opens.

    Raises:
      ValueError: a kernel that is a pytree of several arrays (several outputs, or
        per-leaf kernels); and the errors of :class:`NpyStore`.
    """

    options = spec.options
    out = options.out
    if len(cut.pair_kernels) != 1:
        what = f"out={getattr(out, 'path', out)!r} writes one kernel array, but this kernel is "
        what += f"a pytree of {len(cut.pair_kernels)}"
        raise bad(ValueError, spec.fn_name, what, "compute one output at a time, or drop out=")
    (one,) = cut.pair_kernels
    n1 = int(np.shape(jax.tree.leaves(x1)[0])[0])
    n2 = n1 if x2 is None else int(np.shape(jax.tree.leaves(x2)[0])[0])
    batch_diagonal = config.layouts[0].batch_diagonal
    shape = (n1, *one.shape[1:]) if batch_diagonal else (n1, n2, *one.shape[2:])
    described = {
        "kind": spec.kind,
        "implementation": config.implementation,
        "trace_axes": options.trace_axes,
        "diagonal_axes": options.diagonal_axes,
        "vmap_axes": options.vmap_axes,
        "precision": options.precision,
        "model (its jaxpr)": model,
    }
    layout = FileLayout(
        shape,
        np.dtype(one.dtype),
        [swap_perm(layout) for layout in leaf_layouts(config)],
        batch_diagonal,
        described,
        (cut.b1, cut.b2),
    )
    if isinstance(out, Sink):
        return out.open(spec.fn_name, layout, x1, x2, params, aux)
    process, barrier = processes()
    return NpyStore(
        spec.fn_name,
        out,
        shape,
        layout.dtype,
        layout.perms,
        batch_diagonal,
        fingerprint(params, x1, x2, aux, described, shape, layout.dtype, layout.grid),
        options.resume,
        options.overwrite,
        process,
        barrier,
    )


def _barrier():
    """Every process waits for all (``jax.experimental.multihost_utils``)."""
    from jax.experimental import multihost_utils

    return multihost_utils.sync_global_devices
