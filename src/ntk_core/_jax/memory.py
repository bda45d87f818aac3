"""How many bytes a device can hold at once: what no call may need more of (a request
beyond it ends in an out-of-memory kill or, on XLA CPU, a hang instead of an error)."""

from __future__ import annotations

import functools
import os
import sys

import jax

from ntk_core._units import human_bytes

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@functools.cache  # fixed for a device's life: not asked again on every kernel call
def bytes_limit(device) -> int | None:
    """The allocator's ``bytes_limit`` of ``device`` where JAX reports one (GPUs, TPUs)."""
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # backends without memory statistics
        return None
    return int(limit) if limit else None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


@functools.cache
def host_memory() -> int | None:
    """Bytes of host memory a process can fill on Linux: physical memory (or the cgroup's
    limit where lower) plus swap; None elsewhere (macOS swaps without a fixed limit)."""
    if not sys.platform.startswith("linux"):
        return None
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in _CGROUP_LIMITS:
        limit = _read(path).strip()
        ram = min(ram, int(limit)) if limit.isdigit() else ram
    swap = [line.split()[1] for line in _read("/proc/meminfo").splitlines() if "SwapTotal" in line]
    return ram + 1024 * int(swap[0]) if swap else ram


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
