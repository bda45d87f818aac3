"""Measuring, shared by ``bench_core.py`` and ``bench_neural_tangents.py``.

Works under both JAX versions (plain ``jax`` APIs only). Each measurement runs in its
own Python process (:func:`run_worker`), so that its peak resident memory is its own:
the worker reads its peak resident memory (:func:`max_rss_bytes`) once its model and
inputs are built (the *baseline*: Python, JAX, the model, parameters and inputs) and
again after the measurement (the *peak*); both are reported, and ``peak - baseline`` is
what the measurement added.
The parent polls the worker's resident memory and kills it above a hard limit, so a
wrong estimate cannot take the shared machine down.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

GIB = 2**30
LONG_RUN_S = 5.0


def warm_runs(call, first_s: float):
    """(last output, run seconds) of warm calls of ``call()`` after a first call of
    ``first_s``: up to 10 calls or 1 s in all; one only after a first call past
    :data:`LONG_RUN_S`."""
    import jax

    out, runs = None, []
    while len(runs) < 10 and sum(runs) < 1.0 and not (first_s > LONG_RUN_S and runs):
        t = time.perf_counter()
        out = jax.block_until_ready(call())
        runs.append(time.perf_counter() - t)
    return out, runs


def timing_record(first_s: float, runs, baseline_rss: int, load_before) -> dict:
    """The fields every fresh-process measurement reports: first call, fastest and all
    warm runs, resident memory before and at the peak, load before and after."""
    return {
        "first_call_s": first_s,
        "warm_s": min(runs),
        "runs_s": runs,
        "baseline_rss_bytes": baseline_rss,
        "peak_rss_bytes": max_rss_bytes(),
        "loadavg_before": load_before,
        "loadavg_after": load(),
    }


def max_rss_bytes() -> int:
    """Peak resident memory of this process image so far.

    ``VmHWM`` from ``/proc/self/status`` where it exists (Linux): ``ru_maxrss`` of a
    child process starts at its parent's resident size at ``fork`` (Linux carries the
    high-water mark over ``exec``), so it would charge the driver's memory to every
    worker. ``ru_maxrss`` (KiB on Linux, bytes on macOS) elsewhere.
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def machine() -> dict:
    """JAX version, device, CPU count, load average and date of this run."""
    device = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "device": f"{device.platform}:{device.id} ({getattr(device, 'device_kind', '?')})",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_1_5_15": load(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def matmul_rate(size: int = 2000, repeats: int = 5) -> float:
    """Best FLOP/s of a ``size x size`` float32 matmul at highest precision."""
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.float32)
    f = jax.jit(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST))
    jax.block_until_ready(f(a, a))
    best = np.inf
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(a, a))
        best = min(best, time.perf_counter() - t)
    return 2.0 * size**3 / best


def device_peak_bytes():
    """Peak device memory from the allocator, where the backend reports it (GPU, TPU)."""
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    return None if not stats else stats.get("peak_bytes_in_use")


def time_jitted(fn, args, *, min_total_s: float = 1.0, max_repeats: int = 20) -> dict:
    """Trace+lower, compile, first run and warm runs of ``jax.jit`` function ``fn``.

    Warm runs repeat (at most ``max_repeats``) until they took ``min_total_s`` in all;
    ``run_s`` is the fastest; a first run longer than ``LONG_RUN_S`` counts as warm.
    Every step blocks until the result is ready.
    """
    baseline = max_rss_bytes()
    load_before = load()
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    t3 = time.perf_counter()
    # A first run past LONG_RUN_S is timed as the warm run (its allocation overhead is
    # negligible at that length), so a long measurement runs once, not twice.
    runs = [t3 - t2] if t3 - t2 > LONG_RUN_S else []
    while len(runs) < max_repeats and sum(runs) < min_total_s:
        t = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        runs.append(time.perf_counter() - t)
    leaves = [np.asarray(v, np.float64) for v in jax.tree_util.tree_leaves(out)]
    return {
        "trace_lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "first_run_s": t3 - t2,
        "run_s": min(runs),
        "runs_s": runs,
        "baseline_rss_bytes": baseline,
        "peak_rss_bytes": max_rss_bytes(),
        "device_peak_bytes": device_peak_bytes(),
        "loadavg_before": load_before,
        "loadavg_after": load(),
        "shape": [list(v.shape) for v in leaves],
        "checksum": {
            "sum": float(sum(v.sum() for v in leaves)),
            "norm": float(np.sqrt(sum((v**2).sum() for v in leaves))),
        },
    }


def worker_main(measure) -> None:
    """Entry of a worker process: ``measure(spec) -> dict``, printed as the last line."""
    spec = json.loads(sys.argv[2])
    try:
        result = measure(spec)
    except Exception as e:  # reported, not raised: the parent records the failure
        result = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    print("RESULT " + json.dumps(result), flush=True)


def _rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_worker(script: str, spec: dict, *, timeout_s: float, kill_bytes: float) -> dict:
    """Runs ``python script worker '<spec>'`` and returns its result dict.

    Kills the worker when it runs past ``timeout_s`` or its resident memory passes
    ``kill_bytes``, and says so in the result.
    """
    cmd = [sys.executable, script, "worker", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = {}

    def watch():
        start = time.monotonic()
        while proc.poll() is None:
            rss = _rss_of(proc.pid)
            if rss > kill_bytes:
                killed["why"] = (
                    f"killed at {rss / GIB:.1f} GiB resident (limit {kill_bytes / GIB:.1f})"
                )
                proc.kill()
            elif time.monotonic() - start > timeout_s:
                killed["why"] = f"killed after {timeout_s:.0f} s (timeout)"
                proc.kill()
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stdout, stderr = proc.communicate()
    watcher.join()
    if killed:
        return {"error": killed["why"]}
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": f"worker exited {proc.returncode}: {stderr.strip()[-500:]}"}


def skip_reason(estimate: dict | None, rate: float, max_est_s: float, max_est_bytes: float):
    """Why a measurement is skipped (``None`` to run it): estimated FLOPs at the
    measured matmul rate above ``max_est_s``, or estimated memory above the limit."""
    if not estimate:
        return None
    seconds = estimate["flops"] / rate
    if seconds > max_est_s:
        flops = estimate["flops"]
        return f"estimate {flops:.2e} FLOP = {seconds:.0f} s at {rate / 1e9:.0f} GFLOP/s"
    if estimate["memory_bytes"] > max_est_bytes:
        return f"estimate {estimate['memory_bytes'] / GIB:.1f} GiB"
    return None
