"""Peak memory of one kernel call whose contraction runs over blocks of x1's samples
(``_impl/phases.CONTRACT_TEMP_BYTES``) against the same call in one piece (the limit set
out of reach), and ``plan()``'s estimate. MLP 10-256-256-10 (tanh, no biases), float32,
``implementation="structured"``; x2 given and x2=None, traced and full outputs.

Each measurement is a fresh process whose programs come from a compilation cache that an
earlier process filled (no compiler memory, which ``plan()`` excludes): peak resident
memory added by the call (``VmHWM``), the kernel's bytes, the warm time (best of 3).

    python benchmarks/contract_memory.py   # -> results_contract_memory.json, a table
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402

#: (N1, N2 or None for x2=None, trace_axes "traced" or "full")
CASES = [(7000, 3500, "traced"), (2000, 1000, "full"), (1000, None, "full")]
MODES = ("blocks", "one piece")


def measure(spec):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import ntk_core
    from ntk_core._impl import phases

    jax.config.update("jax_compilation_cache_dir", spec["cache_dir"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if spec["mode"] == "one piece":
        phases.CONTRACT_TEMP_BYTES = 2**62
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    sizes = [(10, 256), (256, 256), (256, 10)]
    params = [jax.random.normal(k[i], s) / np.sqrt(s[0]) for i, s in enumerate(sizes)]

    def apply(p, x):
        return jnp.tanh(jnp.tanh(x @ p[0]) @ p[1]) @ p[2]

    x1 = jax.random.normal(k[3], (spec["n1"], 10))
    x2 = None if spec["n2"] is None else jax.random.normal(k[4], (spec["n2"], 10))
    trace_axes = (-1,) if spec["trace"] == "traced" else ()
    fn = ntk_core.ntk_fn(apply, trace_axes=trace_axes, implementation="structured")
    plan = fn.plan(params, x1, x2)
    estimate = next(e for e in plan.estimates if e.implementation == "structured")
    before = harness.max_rss_bytes()
    kernel = jax.block_until_ready(fn(params, x1, x2))
    peak = harness.max_rss_bytes() - before
    warm = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(fn(params, x1, x2))
        warm.append(time.perf_counter() - start)
    return {
        "added_peak_bytes": peak,
        "kernel_bytes": int(kernel.nbytes),
        "plan_bytes": estimate.memory_bytes,
        "warm_s": min(warm),
        "load": harness.load(),
    }


def main():
    results = []
    for n1, n2, trace in CASES:
        for mode in MODES:
            spec = {"n1": n1, "n2": n2, "trace": trace, "mode": mode}
            with tempfile.TemporaryDirectory(prefix="ntk-contract-cache-") as cache_dir:
                run = {**spec, "cache_dir": cache_dir}
                for _ in range(2):  # the first fills the cache; the second is measured
                    result = harness.run_worker(
                        os.path.abspath(__file__), run, timeout_s=600, kill_bytes=16 * 2**30
                    )
            results.append({**spec, **result})
            print(json.dumps(results[-1]), flush=True)
    out = os.path.join(HERE, "results_contract_memory.json")
    with open(out, "w") as fh:
        json.dump({"machine": harness.machine(), "results": results}, fh, indent=1)
    mib = 2**20
    print("| N1 x N2 | trace | kernel MiB | peak MiB blocks / one piece | plan MiB | warm s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i in range(0, len(results), 2):
        b, o = results[i], results[i + 1]
        size = f"{b['n1']} x {b['n2'] or 'None'}"
        peaks = f"{b['added_peak_bytes'] / mib:.0f} / {o['added_peak_bytes'] / mib:.0f}"
        times = f"{b['warm_s']:.2f} / {o['warm_s']:.2f}"
        print(
            f"| {size} | {b['trace']} | {b['kernel_bytes'] / mib:.0f} | {peaks} | "
            f"{b['plan_bytes'] / mib:.0f} | {times} |"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        harness.worker_main(measure)
    else:
        main()
