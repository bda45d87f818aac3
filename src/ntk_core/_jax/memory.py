"""How many bytes a device can hold at once: what no call may need more of (a request
beyond it ends in an out-of-memory kill or, on XLA CPU, a hang instead of an error)."""

from __future__ import annotations

import functools
import os
import re
import sys
from typing import NamedTuple

import jax

from ntk_core._units import human_bytes


@functools.cache  # fixed for a device's life: not asked again on every kernel call
def bytes_limit(device) -> int | None:
    """The allocator's ``bytes_limit`` of ``device`` where JAX reports one (GPUs, TPUs)."""
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # backends without memory statistics
        return None
    return int(limit) if limit else None


#: Where a process's memory cgroup lives when /proc/self/mountinfo cannot be read: cgroup v2
#: (unified) and v1's memory controller at their usual mount points, each with the mounted
#: hierarchy's root "/".
_DEFAULT_MOUNTS = {"cgroup2": "/sys/fs/cgroup", "cgroup": "/sys/fs/cgroup/memory"}
#: The limit files of each version: memory, and swap (v2: swap alone; v1: memory + swap).
#: memory.high (v2) throttles rather than kills, but a process held there barely runs.
_LIMIT_FILES = {
    "cgroup2": (("memory.max", "memory.high"), ("memory.swap.max",), ()),
    "cgroup": (("memory.limit_in_bytes",), (), ("memory.memsw.limit_in_bytes",)),
}


class CgroupLimits(NamedTuple):
    """A process's memory cgroup limits in bytes, None where unlimited or unknown:
    ``memory`` (RAM), ``swap`` (v2: swap alone) and ``memory_and_swap`` (v1: together)."""

    memory: int | None = None
    swap: int | None = None
    memory_and_swap: int | None = None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return ""


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _unescape(field: str) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes are written as octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_mounts(root: str, kind: str) -> list[tuple[str, str]]:
    """``(hierarchy root, mount point)`` of each mount of ``kind`` ("cgroup2", or v1's
    "cgroup" with the memory controller) in ``root``/proc/self/mountinfo; the usual mount
    point where that file says nothing (unreadable, or no such mount)."""
    mounts = []
    for line in _read(_under(root, "proc/self/mountinfo")).splitlines():
        left, sep, right = line.partition(" - ")  # optional fields end at the lone "-"
        fields, fs = left.split(), right.split()
        if not sep or len(fields) < 5 or len(fs) < 3 or fs[0] != kind:
            continue
        if kind == "cgroup2" or "memory" in fs[2].split(","):
            mounts.append((_unescape(fields[3]), _unescape(fields[4])))
    return mounts or [("/", _DEFAULT_MOUNTS[kind])]


def _own_cgroups(root: str) -> list[tuple[str, str]]:
    """``(kind, path)`` of the process's memory cgroup from ``root``/proc/self/cgroup: v1's
    memory controller where one is listed (v1 and hybrid hosts), else the v2 ("0::") one;
    both mount points' own cgroups, path "/", where the file is missing."""
    v1 = v2 = None
    for line in _read(_under(root, "proc/self/cgroup")).splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            v1 = parts[2]
        elif parts[0] == "0" and not parts[1]:
            v2 = parts[2]
    if v1 is not None:
        return [("cgroup", v1)]
    if v2 is not None:
        return [("cgroup2", v2)]
    return [("cgroup2", "/"), ("cgroup", "/")]


def _folders(root: str, kind: str, path: str) -> list[str]:
    """The folders of the cgroup ``path`` and of its ancestors up to the mount point (higher
    ones are not visible there). ``path`` is relative to the hierarchy's root; a mount shows
    the hierarchy from its own root on (a container's cgroup, or a cgroup namespace's root,
    is mounted as its "/"). A path under no mount ("/../..": moved out of the namespace)
    reads the mount point's files alone."""
    parts = [part for part in path.strip().split("/") if part]
    mounts, best = _cgroup_mounts(root, kind), None
    for top, point in mounts:  # the mount whose root is the longest start of path
        top = [part for part in top.split("/") if part]
        longer = best is None or len(top) > len(best[0])
        if longer and ".." not in parts and parts[: len(top)] == top:
            best = (top, point)
    rel, point = (parts[len(best[0]) :], best[1]) if best else ([], mounts[0][1])
    return [_under(root, os.path.join(point, *rel[:i])) for i in range(len(rel), -1, -1)]


def _smallest(folders: list[str], names: tuple[str, ...]) -> int | None:
    """The smallest limit in the files ``names`` of ``folders``; None where every one is
    missing or unlimited ("max" in v2, a number near 2**63 in v1: larger than any RAM)."""
    values = [_read(os.path.join(d, name)).strip() for d in folders for name in names]
    limits = [int(v) for v in values if v.isdigit()]
    return min(limits) if limits else None


def _both(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def cgroup_limits(root: str = "/") -> CgroupLimits:
    """The memory limits of the cgroup this process is in (Linux; none elsewhere): the
    smallest along the path from its own cgroup up to the mount point, since every ancestor's
    limit applies too, read from ``/proc/self/cgroup`` and ``/proc/self/mountinfo``.
    ``root`` prefixes every path (tests read a fake tree)."""
    found = CgroupLimits()
    for kind, path in _own_cgroups(root):
        folders = _folders(root, kind, path)
        memory, swap, both = (_smallest(folders, names) for names in _LIMIT_FILES[kind])
        found = CgroupLimits(*map(_both, found, (memory, swap, both)))
    return found


@functools.cache
def host_memory(root: str = "/") -> int | None:
    """Bytes of host memory a process can fill on Linux: physical memory, or its cgroup's
    limit where lower (:func:`cgroup_limits`: a SLURM or Kubernetes job's), plus the swap
    its cgroup lets it use; None elsewhere (macOS swaps without a fixed limit). ``root``:
    as :func:`cgroup_limits`, ``/proc/meminfo`` read under it."""
    if not sys.platform.startswith("linux"):
        return None
    limits = cgroup_limits(root)
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    ram = _both(ram, limits.memory)
    meminfo = _read(_under(root, "proc/meminfo")).splitlines()
    swap = [line.split()[1] for line in meminfo if line.startswith("SwapTotal:")]
    swap = _both(1024 * int(swap[0]) if swap and swap[0].isdigit() else 0, limits.swap)
    return _both(ram + swap, limits.memory_and_swap)


def capacity(devices=None) -> int | None:
    """Bytes ``devices`` (a device, a set of them, None: the default one) hold together:
    :func:`host_memory` for CPUs (they share it), else the sum of the allocators' limits;
    None where unknown."""
    devices = devices or jax.local_devices()[0]
    devices = [devices] if isinstance(devices, jax.Device) else list(devices)
    if any(d.platform == "cpu" for d in devices):
        return host_memory()
    limits = [bytes_limit(d) for d in devices]
    return None if None in limits else sum(limits)


def beyond(need: int, devices=None, on_host=False) -> str | None:
    """``"more than {where}'s {capacity}"`` when ``need`` bytes exceed the host's memory
    (``on_host``) or the :func:`capacity` of ``devices`` (a list; None: the default
    device), else None (also where the capacity is unknown)."""
    devices = devices or jax.local_devices()[:1]
    have = host_memory() if on_host else capacity(devices)
    if have is None or need <= have:
        return None
    where = "the host" if on_host or devices[0].platform == "cpu" else ", ".join(map(str, devices))
    return f"more than {where}'s {human_bytes(have)}"


def compiled_bytes(stats) -> tuple[int, int, int, int] | None:
    """``(need, arguments, output, temporaries)`` in bytes of a compiled XLA program from
    its ``memory_analysis()`` ``stats``: what it holds while it runs, arguments + output +
    temporaries − aliased (donated arguments reused as outputs); None where XLA gives
    no analysis (some backends)."""
    names = ("argument", "output", "temp", "alias")
    try:
        a, o, t, alias = (int(getattr(stats, f"{n}_size_in_bytes")) for n in names)
    except (AttributeError, TypeError, ValueError):  # None, or fields missing
        return None
    return a + o + t - alias, a, o, t
