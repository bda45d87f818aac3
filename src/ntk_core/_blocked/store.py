"""Out-of-core kernels (``out=``): tiles written with ``os.pwrite`` into a ``.npy`` made at its
final shape (then renamed into place), beside ``<path>.manifest.json`` (``fingerprint`` of the
call, ``done`` tiles ``[r0, c0, crc32]``, ``complete``). Tiles are ``fsync``ed before the
manifest lists them, so ``resume=True`` after a kill recomputes only the tiles unlisted or
changed (CRC-32), bit for bit."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
import zlib

import jax
import numpy as np
from jax._src import distributed
from numpy.lib.format import open_memmap

from ntk_core._blocked.sink import Sink as Sink
from ntk_core._errors import bad, one_line
from ntk_core._kernel.layout import leaf_layouts, swap_perm
from ntk_core._units import human_bytes

#: The manifest's format; seconds between two commits of written tiles (:meth:`NpyStore.commit`).
MANIFEST_VERSION, COMMIT_SECONDS = 1, 1.0
#: Fingerprint entries whose values a refusal shows (the others are digests).
SHOWN = ("shape", "dtype", "tile grid", "n_samples", "sample")
VERSION, FP, DONE, COMPLETE = "version", "fingerprint", "done", "complete"  # the manifest's keys
READ = dict(mmap_mode="r")
_GRAM = "x2=None (the Gram matrix of x1)"
_NPY = "the .npy"  # what a damaged file was read as (a Monte Carlo run: "the running sum")
Stage = enum.Enum("Stage", "CHECKED CREATED WRITTEN COMPLETE")  # the barriers, in order


def manifest_path(path: str) -> str:
    return path + ".manifest.json"


def _digest_tree(tree) -> str:
    """SHA-256 of a pytree's structure and its leaves' shapes, dtypes and bytes."""
    leaves, treedef = jax.tree.flatten(tree)
    h = hashlib.sha256(str(treedef).encode())
    for leaf in leaves:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            h.update(repr(leaf).encode())
            continue
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{a.shape}{a.dtype}".encode() + a.tobytes())
    return h.hexdigest()


def inputs(x1, x2) -> dict:
    return {"x1": _digest_tree(x1), "x2": _GRAM if x2 is None else _digest_tree(x2)}


def described(options: dict, shape, dtype, grid) -> dict:
    d = {"options": {k: repr(v) for k, v in sorted(options.items())}, "shape": list(shape)}
    return d | {"dtype": str(np.dtype(dtype)), "tile grid": list(grid)}


def differences(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints, in words for a refusal."""
    names = []
    for key in (k for k in new if old.get(k) != new[k]):
        if isinstance(old.get(key), dict) and isinstance(new[key], dict):  # the options
            o, n = old[key], new[key]
            changed = sorted(k for k in set(o) | set(n) if o.get(k) != n.get(k))
            pairs = [f"{k}: {o.get(k, 'unset')} -> {n.get(k, 'unset')}" for k in changed]
            names.append(f"{key} ({', '.join(pairs)})")
        else:
            names.append(f"{key} ({old.get(key)} -> {new[key]})" if key in SHOWN else key)
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
    with contextlib.suppress(OSError):  # the rename itself durable (POSIX: sync the folder)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_manifest(path: str) -> dict | None:
    data = _read_json(manifest_path(path))
    return data if isinstance(data, dict) and data.get(VERSION) == MANIFEST_VERSION else None


def _listed(data, path=None) -> dict:
    """The well-formed ``[r0, c0, crc32]`` entries of a manifest, and with ``path`` of every
    process's own list beside it: ``{(r0, c0): crc32}``."""
    done = (data if isinstance(data, dict) else {}).get(DONE)
    ok = [t for t in done if isinstance(t, list) and len(t) == 3] if isinstance(done, list) else []
    listed = {(t[0], t[1]): t[2] for t in ok if all(type(v) is int for v in t)}
    for other in _process_manifests(path) if path else ():
        listed |= _listed(_read_json(other))
    return listed


class NpyStore:
    """A blocked call's result written tile by tile into ``path`` (``process``: (index, count);
    ``barrier(name)`` waits for all, None with one; ``transform(tile, r0, r1, c0, c1)`` maps
    each tile before it is written). ValueError for an existing file without ``resume`` or
    ``overwrite``, a resume of a missing or different file, a bad folder, too little space."""

    fd = None  # the file, open while tiles are written

    def __init__(
        self, fn, path, layout, fingerprint, resume, overwrite, process, barrier, transform=None
    ):
        self.fn, self.path, self.transform = fn, path, transform
        self.process, self.barrier = process, barrier
        self.perms, self.batch_diagonal = layout.perms, layout.batch_diagonal
        self.unit = "block" if layout.batch_diagonal else "tile"  # blocks of rows (messages)
        shape, dtype = layout.shape, layout.dtype
        self.manifest = {VERSION: MANIFEST_VERSION, FP: fingerprint, DONE: [], COMPLETE: False}
        self.done: dict[tuple[int, int], int] = {}  # tile -> CRC-32 of its bytes
        # this process's tiles done in this run (several processes); written since the commit
        self.mine, self.pending, self.committed = [], [], time.monotonic()
        self.shape, self.itemsize = tuple(shape), np.dtype(dtype).itemsize
        self.tiles = _tiles(self.shape, layout)
        # Every process makes the same checks (so all refuse alike), then the first
        # creates the file, then all open it.
        old = _read_manifest(path) if os.path.exists(path) else None
        self.finished = bool(old and old.get(FP) == fingerprint and old.get(COMPLETE))
        self.finished &= set(_listed(old)) == set(self.tiles)  # a complete list
        if self.finished:
            return
        create = not (os.path.exists(path) and resume)
        if create:
            self._check_new(shape, dtype, overwrite)
        else:
            self._check_resume(old, fingerprint, shape, dtype)
        self._sync(Stage.CHECKED)
        first = process[0] == 0
        if first:  # no process writes a manifest between these two barriers
            if create:
                self._create(dtype, shape)
            self._write(manifest_path(path), self.manifest)  # resumed: the tiles verified
            for stale in _process_manifests(path):
                os.unlink(stale)
            _remove_temporaries(path)
        self._sync(Stage.CREATED)
        try:
            self.offset = np.load(path, **READ).offset  # the header's length
            self.fd = os.open(path, os.O_RDWR)
        except (OSError, ValueError) as e:
            raise self._os_error("open", e) from e

    def _create(self, dtype, shape) -> None:  # renamed into place: an old file's maps keep it
        folder, name = os.path.split(os.path.abspath(self.path))
        tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}.npy")  # the umask's mode
        try:  # the header; the data stays a hole until written
            open_memmap(tmp, mode="w+", dtype=dtype, shape=tuple(shape)).flush()
            for stale in (manifest_path(self.path), *_process_manifests(self.path)):
                if os.path.exists(stale):  # none for the new file
                    os.unlink(stale)
            os.replace(tmp, self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise self._os_error("create", e) from e

    def close(self):  # also when a call failed midway
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    __del__ = close

    def _sync(self, stage: Stage) -> None:
        if self.barrier is None:
            return
        try:
            self.barrier(f"ntk_core out= {stage.name.lower()}: {self.path}")
        except Exception as e:  # a process of the run stopped (killed, failed)
            what = f"a process of this run stopped at '{stage.name.lower()}' ({one_line(e)[:200]})"
            raise bad(ValueError, self.fn, what, "start every process with resume=True") from e

    def _os_error(self, doing: str, error: Exception) -> ValueError:
        what = f"could not {doing} out={self.path!r}: {one_line(error)}"
        fix = "make the file and its folder writable, or give another path"
        return bad(ValueError, self.fn, what, fix)

    def _write(self, path: str, data: dict) -> None:
        try:
            _write_json_atomically(path, data)
        except OSError as e:
            raise self._os_error(f"write the manifest {path!r} of", e) from e

    def _check_new(self, shape, dtype, overwrite) -> None:
        fn, path, where = self.fn, self.path, f"out={self.path!r}"
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        folder = up = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(up):
            up = os.path.dirname(up)
        if not os.path.isdir(up):
            what = f"{where}: {up!r} is a file, where a folder is expected"
            raise bad(ValueError, fn, what, "give a path whose parents are all folders")
        if up != folder or not os.access(folder, os.W_OK):
            what = f"{where}: the folder {folder!r} does not exist or cannot be written"
            raise bad(ValueError, fn, what, "create it (os.makedirs), or give another path")
        if os.path.isdir(path):
            raise folder_error(fn, where)
        if os.path.exists(path) and not overwrite:
            raise exists_error(fn, where)
        try:  # os.access says yes to root on a file system that takes no files (/proc)
            os.close((probe := tempfile.mkstemp(prefix=".ntk-probe-", dir=folder))[0])
            os.unlink(probe[1])
        except OSError as e:
            what = f"{where}: the file cannot be created, {folder!r} is not writable ({e.strerror})"
            raise bad(ValueError, fn, what, "give a path on a writable file system") from e
        replaced = os.path.getsize(path) if os.path.exists(path) else 0
        if nbytes > (free := shutil.disk_usage(folder).free + replaced):
            raise no_space_error(fn, path, nbytes, free)

    def _check_resume(self, old, fingerprint, shape, dtype) -> None:
        if old is None:
            raise resume_error(self.fn, self.path)
        differs = differences(old[FP] if isinstance(old.get(FP), dict) else {}, fingerprint)
        if differs:
            raise resume_error(self.fn, self.path, differs)
        with contextlib.closing(NpyReader(self.fn, self.path, shape, dtype)) as reader:
            self._verify(reader, old)

    def _verify(self, reader, old) -> None:
        """Keeps the listed tiles whose bytes match their CRC-32 (reads the file once)."""
        changed, args = [], (self.shape, self.itemsize, self.batch_diagonal)
        listed = _listed(old, self.path)
        for tile, crc in sorted((t, c) for t, c in listed.items() if t in self.tiles):
            (r0, c0), (r1, c1, mirror) = tile, self.tiles[tile]  # the mirror's bytes after
            runs = _runs(*args, r0, r1, c0, c1) + (_runs(*args, c0, c1, r0, r1) if mirror else [])
            read = (os.pread(reader.fd, n, reader.offset + at) for at, n in runs)
            if functools.reduce(lambda c, data: zlib.crc32(data, c), read, 0) == crc:
                self.done[tile] = crc
            else:
                changed.append(list(tile))
        self.manifest[DONE] = [[*t, c] for t, c in sorted(self.done.items())]
        odd = len(old[DONE]) if isinstance(old.get(DONE), list) else 0
        odd -= len(self.done) + len(changed)  # (in the main list: not a tile of this file)
        if changed or odd > 0:
            shown = ", ".join(map(str, changed[:8])) + " ..." * (len(changed) > 8)
            what = f"{len(changed)} {self.unit}s changed since written (CRC-32): {shown}; "
            what += f"{odd} entries of 'done' are no {self.unit} [r0, c0, crc32]; recomputing them"
            warnings.warn(f"{self.fn}: out={self.path!r}: {what}", stacklevel=3)

    def share(self) -> set:
        """This process's share of the tiles: every P-th of those not done, from its index."""
        todo = [] if self.finished else [t for t in self.tiles if t not in self.done]
        return set(todo[self.process[0] :: self.process[1]])

    def put(self, tile, r0, r1, c0, c1, mirror: bool) -> None:
        """Writes one tile (and its mirror) with ``os.pwrite`` (a memory map's pages count as
        resident memory); :meth:`commit` lists it."""
        (a,) = map(np.asarray, jax.tree.leaves(tile))
        a = a[: r1 - r0] if self.batch_diagonal else a[: r1 - r0, : c1 - c0]
        if self.transform is not None:
            a = self.transform(a, r0, r1, c0, c1)
        crc = self._rows(a, r0, c0)
        if mirror and not self.batch_diagonal:
            crc = self._rows(np.transpose(a, self.perms[0]), c0, r0, crc)
        self.done[r0, c0] = crc
        self.pending.append([r0, c0, crc])
        if time.monotonic() - self.committed >= COMMIT_SECONDS:
            self.commit()

    def _rows(self, block, r0: int, c0: int, crc: int = 0) -> int:
        """Writes ``block`` (rows x columns x ...) at (r0, c0); ``crc`` continued over it."""
        c1 = c0 + (0 if self.batch_diagonal else block.shape[1])
        runs = _runs(self.shape, self.itemsize, self.batch_diagonal, r0, r0 + len(block), c0, c1)
        rows = block[None] if self.batch_diagonal else block  # a batch diagonal: one run
        for (start, _), row in zip(runs, rows, strict=True):
            data = np.ascontiguousarray(row).tobytes()
            os.pwrite(self.fd, data, self.offset + start)
            crc = zlib.crc32(data, crc)
        return crc

    def commit(self) -> None:
        """``fsync``s the tiles written since the last commit, then lists them in the
        manifest; at most every :data:`COMMIT_SECONDS` (the manifest grows with the tiles)."""
        self.committed = time.monotonic()
        if not self.pending:
            return
        os.fsync(self.fd)  # the bytes are in the file before the manifest says so
        if self.process[1] == 1:
            self.manifest[DONE] += self.pending
            self._write(manifest_path(self.path), self.manifest)
        else:  # each process lists its own tiles, in its own file
            self.mine += self.pending
            own = {VERSION: MANIFEST_VERSION, DONE: self.mine}
            self._write(f"{self.path}.manifest.p{self.process[0]}of{self.process[1]}.json", own)
        self.pending = []

    def result(self):
        """The finished file, memory-mapped read-only; the manifest marked complete (by
        the first process, once every process has written its share)."""
        if not self.finished:
            self.commit()
            self.close()
            self._sync(Stage.WRITTEN)
            if self.process[0] == 0:
                others = _process_manifests(self.path)  # this run's (stale ones went first)
                done = _listed(self.manifest, self.path) | self.done
                self.manifest[DONE] = [[*t, c] for t, c in sorted(done.items())]
                self.manifest[COMPLETE] = True
                self._write(manifest_path(self.path), self.manifest)
                for other in others:
                    os.unlink(other)
            self._sync(Stage.COMPLETE)
        try:
            return np.load(self.path, **READ)
        except (OSError, ValueError) as e:
            raise damaged(self.fn, self.path, one_line(e)) from e


def _runs(shape, itemsize: int, batch_diagonal: bool, r0: int, r1: int, c0: int, c1: int):
    """The byte runs ``(start, length)`` after the header of rows ``r0:r1``, columns
    ``c0:c1`` of a C-ordered ``shape``; one run for rows of a batch diagonal ``(N, ...)``."""
    entry = int(np.prod(shape[1 if batch_diagonal else 2 :], dtype=np.int64)) * itemsize
    if batch_diagonal:
        return [(r0 * entry, (r1 - r0) * entry)]
    return [(r * shape[1] * entry + c0 * entry, (c1 - c0) * entry) for r in range(r0, r1)]


def exists_error(fn: str, where: str) -> ValueError:
    what = f"{where} exists, and is not the finished result of this call"
    return bad(
        ValueError, fn, what, "pass resume=True (same call), overwrite=True, or another path"
    )


def folder_error(fn: str, where: str) -> ValueError:
    return bad(ValueError, fn, f"{where} is a folder, not a file", "give a .npy file path")


def no_space_error(fn: str, out: str, needed: int, free: int) -> ValueError:
    what = f"out={out!r} needs {human_bytes(needed)}, the disk has {human_bytes(free)} free"
    return bad(ValueError, fn, what, "free disk space, or write to another disk")


def resume_error(fn: str, path: str, differs=None) -> ValueError:
    """resume=True refused: ``path``'s manifest missing or unreadable (``differs`` None), or
    written by another call (``differs``: what differs from it)."""
    if differs is None:  # not a file this library started, or its manifest was lost
        what = f"resume=True, but {manifest_path(path)!r} is missing or unreadable"
        return bad(ValueError, fn, what, "pass overwrite=True to replace it, or another path")
    what = f"resume=True, but {path!r} was started by a different call"
    what += f": {'; '.join(differs)} differ" if differs else ""
    return bad(ValueError, fn, what, "resume the same call, or pass overwrite=True")


def damaged(fn: str, path: str, why: str, what: str = _NPY) -> ValueError:
    what = f"{path!r} cannot be read as {what} its manifest describes ({why})"
    return bad(ValueError, fn, what, "pass overwrite=True, or another path")


class NpyReader:
    """Regions of a ``.npy`` of ``shape`` and ``dtype`` read with ``os.pread`` (not a memory
    map, whose pages count as the process's); ValueError if the file is not one."""

    fd = None

    def __init__(self, fn: str, path: str, shape, dtype, what: str = _NPY):
        self.path, expected = path, (tuple(shape), np.dtype(dtype))
        try:
            header = np.load(path, **READ)  # its memory map closes with this call
            self.shape, self.dtype, self.offset = header.shape, header.dtype, header.offset
            self.fd = os.open(path, os.O_RDONLY) if (self.shape, self.dtype) == expected else None
        except (OSError, ValueError) as e:
            raise damaged(fn, path, one_line(e), what) from None
        if self.fd is None:
            why = f"{self.shape} {self.dtype}, not {expected[0]} {expected[1]}"
            raise damaged(fn, path, why, what)

    close = __del__ = NpyStore.close

    def read(self, r0: int, r1: int, c0: int, c1: int, batch_diagonal: bool):
        """Rows ``r0:r1``, columns ``c0:c1`` (rows only on a batch diagonal), a new array."""
        runs = _runs(self.shape, self.dtype.itemsize, batch_diagonal, r0, r1, c0, c1)
        tail = self.shape[1:] if batch_diagonal else (c1 - c0, *self.shape[2:])
        data = bytearray().join(os.pread(self.fd, n, self.offset + at) for at, n in runs)
        if len(data) != sum(n for _, n in runs):
            raise OSError(f"{self.path!r} ends before its rows {r0}..{r1 - 1}")
        return np.frombuffer(data, self.dtype).reshape(r1 - r0, *tail)


def _process_manifests(path: str) -> list[str]:  # each process's own list, of any run
    folder, name = os.path.split(os.path.abspath(path))
    pattern = re.escape(name) + r"\.manifest\.p.*\.json"
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if re.fullmatch(pattern, n))


def _remove_temporaries(path: str) -> None:
    """Removes the temporary files (manifests, a new file) a killed process left."""
    folder, name = os.path.split(os.path.abspath(path))
    for n in os.listdir(folder):
        if n.startswith(f".{name}.") and ".tmp-" in n:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, n))


def model_digest(closed) -> str:
    """SHA-256 of the printed jaxpr (addresses dropped: alike in every process) and of the
    constants it captured (the printout omits their values)."""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x", str(closed.jaxpr))
    consts = _digest_tree(list(closed.consts))
    return hashlib.sha256(text.encode() + consts.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class FileLayout:
    """A blocked call's file: ``perms`` of a mirror tile, ``batch_diagonal`` (a kernel
    ``(N, ...)``, or a feature matrix: its tiles are blocks of rows), ``described``
    (options and model digest) and the tile ``grid``."""

    shape: tuple
    dtype: np.dtype
    perms: list
    batch_diagonal: bool
    described: dict
    grid: tuple
    gram: bool = False  # x2=None: the tiles above the diagonal, each with its mirror


def _tiles(shape, layout: FileLayout) -> dict:
    """``{(r0, c0): (r1, c1, mirrored)}`` of every tile, as ``tiles.compute`` cuts them."""
    (b1, b2), n1, gram, diagonal = layout.grid, shape[0], layout.gram, layout.batch_diagonal
    n2, b2 = (n1, b1) if gram or diagonal else (shape[1], b2)
    pairs = [(r, c) for r in range(0, n1, b1) for c in range(r if gram else 0, n2, b2)]
    pairs = [(r, r) for r in range(0, n1, b1)] if diagonal else pairs
    return {(r, c): (min(r + b1, n1), min(c + b2, n2), gram and r != c) for r, c in pairs}


def processes():
    """``((index, count), barrier)`` among ``jax.distributed``'s processes (None: one)."""
    global _PEERS
    index, count, client = jax.process_index(), jax.process_count(), distributed.global_state.client
    if count == 1:
        return (index, count), None
    if client is None:  # not started by jax.distributed.initialize: no key-value store
        from jax.experimental import multihost_utils

        return (index, count), multihost_utils.sync_global_devices
    if _PEERS is None or _PEERS.client is not client:
        _PEERS = _Peers(client, index, count)
    return (index, count), _PEERS


#: Seconds a process of a multi-process run may send no heartbeat before it counts as dead.
PEER_SECONDS, _PEERS = 30.0, None
_ALIVE, _BARRIER = "ntk_core/alive/", "ntk_core/barrier/"  # key-value folders: + process index


class _Peers:
    """A barrier on ``jax.distributed``'s key-value store watching the others' heartbeats (a
    thread's counter, each second): RuntimeError naming one silent for :data:`PEER_SECONDS`."""

    def __init__(self, client, index: int, count: int):
        self.client, self.index, self.count, self.calls = client, index, count, 0
        threading.Thread(target=self._beat, daemon=True, name="ntk_core heartbeat").start()

    def _beat(self) -> None:
        beat, key = 0, _ALIVE + str(self.index)
        while distributed.global_state.client is self.client:  # until jax's shutdown
            with contextlib.suppress(Exception):
                self.client.key_value_set(key, str(beat := beat + 1), True)
            time.sleep(1.0)

    def _get(self, folder: str) -> dict:  # {the key's last part: value}
        return {k.rsplit("/", 1)[-1]: v for k, v in self.client.key_value_dir_get(folder)}

    def __call__(self, name: str) -> None:
        self.calls += 1  # every process calls the barriers in the same order
        at, seen = f"{_BARRIER}{self.calls}/", {}  # a peer's last beat, and when
        self.client.key_value_set(at + str(self.index), name)
        while len(here := self._get(at)) < self.count:
            now, beats = time.monotonic(), self._get(_ALIVE)
            for peer in sorted(set(map(str, range(self.count))) - set(here)):
                if seen.setdefault(peer, (beats.get(peer), now))[0] != beats.get(peer):
                    seen[peer] = (beats.get(peer), now)
                elif now - seen[peer][1] > PEER_SECONDS:
                    what = f"sent no heartbeat for {PEER_SECONDS:g} s: it stopped"
                    raise RuntimeError(f"process {peer} of {self.count} {what}")
            time.sleep(0.05)
        if len(set(here.values())) > 1:
            raise RuntimeError(f"the processes reached different barriers: {sorted(here.values())}")


def for_call(spec, config, cut, model: str, params, x1, x2, aux) -> NpyStore:
    """The :class:`NpyStore` of a blocked call with ``out=`` (a path or a :class:`Sink`;
    ``model``: :func:`model_digest`); ValueError for a kernel of several arrays."""
    options, fn, out = spec.options, spec.fn_name, spec.options.out
    if len(cut.pair_kernels) != 1:
        n, where = len(cut.pair_kernels), out.path if isinstance(out, Sink) else out
        what = f"out={where!r} writes one kernel array, but this kernel is a pytree of {n}"
        raise bad(ValueError, fn, what, "compute one output at a time, or drop out=")
    (one,) = cut.pair_kernels
    n1 = int(np.shape(jax.tree.leaves(x1)[0])[0])
    n2 = n1 if x2 is None else int(np.shape(jax.tree.leaves(x2)[0])[0])
    diagonal = config.layouts[0].batch_diagonal
    shape = (n1, *one.shape[1:]) if diagonal else (n1, n2, *one.shape[2:])
    named = dict(kind=spec.kind, implementation=config.implementation, precision=options.precision)
    named.update(trace_axes=options.trace_axes, diagonal_axes=options.diagonal_axes)
    named.update(vmap_axes=options.vmap_axes)
    named["model (its jaxpr)"] = model
    if options.wrt is not None:  # the subset by its paths: a predicate's repr is not stable
        paths = jax.tree_util.tree_leaves_with_path(params)
        named.update(wrt=[jax.tree_util.keystr(p) for p, _ in paths])
    perms = [swap_perm(layout) for layout in leaf_layouts(config)]
    grid = (cut.b1, cut.b2)
    layout = FileLayout(shape, np.dtype(one.dtype), perms, diagonal, named, grid, x2 is None)
    if isinstance(out, Sink):
        return out.open(fn, layout, x1, x2, params, aux)
    fp = {**inputs(x1, x2), "params": _digest_tree(params), "model state (aux)": _digest_tree(aux)}
    fp |= described(named, shape, layout.dtype, layout.grid)
    return NpyStore(fn, out, layout, fp, options.resume, options.overwrite, *processes())


def for_rows(fn, options, shape, dtype, block: int, named: dict, trees: dict) -> NpyStore:
    """The :class:`NpyStore` of a feature matrix ``(N, ...)`` written in blocks of ``block``
    rows (the tiles ``(r0, r0)`` of a batch diagonal) into ``options.out``; its
    fingerprint: the digests of ``trees`` (name: pytree, e.g. the inputs and the
    parameters) and :func:`described` ``named`` (what else fixes the result)."""
    layout = FileLayout(tuple(shape), np.dtype(dtype), [None], True, named, (block, block))
    fp = {name: _digest_tree(tree) for name, tree in trees.items()}
    fp |= described(named, shape, layout.dtype, layout.grid)
    return NpyStore(fn, options.out, layout, fp, options.resume, options.overwrite, *processes())
