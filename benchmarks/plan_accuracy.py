"""plan()'s estimates against measured warm time and memory (issue 17: within 2x).

For each benchmark case of ``cases.py`` (at the N given here) and each implementation
whose estimate fits the limits, one fresh worker process builds the kernel function,
reads ``plan()``'s estimate for that implementation (seconds; memory: the features or,
with ``vmap_axes=None``, the whole-batch passes), then measures the first call and the
warm call (best of 3) and the peak resident memory the call added (``VmHWM`` after,
less before). The programs it compiles go to a persistent compilation cache that a
second fresh process loads: its first call's added peak is the execution's alone (no
compiler memory; ``plan()`` excludes compilation), the figure memory is compared with.
Also the ``vmap_axes=None`` case of issue 17 (Conv 64 3x3 SAME, ReLU,
global average pool, Dense 10 on 28x28x1 inputs, full kernel). Writes
``results_plan_accuracy.json`` and prints the Markdown table for ``README.md``.

    python benchmarks/plan_accuracy.py [--cases mlp1 lenet ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402

DATA_DIR = "/tmp/ntk-jax-plan-accuracy"
#: (case, N, implementations) measured; the whole-batch conv net is "wholebatch".
RUNS = [
    ("mlp1", 1000, ("structured", "ntvp")),
    ("mlp1", 300, ("jacobian",)),
    ("lenet", 500, ("structured", "jacobian")),
    ("mlp10", 1000, ("structured",)),
    ("mlp10-full", 500, ("structured",)),
    ("resnet", 128, ("structured", "jacobian")),
    ("tokens", 256, ("structured", "jacobian")),
    ("resnet18", 64, ("structured",)),
    ("wholebatch", 32, ("jacobian", "ntvp")),
]


def _wholebatch():
    import jax
    import jax.numpy as jnp

    def apply(p, x):
        y = jax.lax.conv_general_dilated(
            x, p["conv"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        y = jax.nn.relu(y + p["b"]).mean(axis=(1, 2))
        return y @ p["w"] + p["c"]

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "conv": jax.random.normal(k[0], (3, 3, 1, 64)) / 3,
        "b": jnp.zeros(64),
        "w": jax.random.normal(k[1], (64, 10)) / 8,
        "c": jnp.zeros(10),
    }
    return apply, params, k[2]


def _reset_peak():
    """Resets this process's peak resident memory (VmHWM) to its current resident size
    and returns that size (None where /proc/self/clear_refs is missing)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def measure(spec):
    import jax

    # Compiled programs kept (every one, however small) for the second, cached run.
    jax.config.update("jax_compilation_cache_dir", spec["cache_dir"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    import ntk_core

    if spec["case"] == "wholebatch":
        apply, params, key = _wholebatch()
        x = jax.random.normal(key, (spec["n"], 28, 28, 1))
        options = dict(trace_axes=(), vmap_axes=None)
    else:
        import bench_core
        import cases

        case = cases.CASES[spec["case"]]
        variables, x, _ = cases.load_case(DATA_DIR, case, spec["n"])
        params, _ = cases.split_variables(variables)
        apply = bench_core.apply_fn(case, variables)
        options = dict(trace_axes=case.trace_axes)
    kernel = ntk_core.ntk_fn(apply, implementation=spec["implementation"], **options)
    plan = kernel.plan(params, x)
    (estimate,) = [e for e in plan.estimates if e.implementation == plan.implementation]
    before = harness.max_rss_bytes()
    start = time.perf_counter()
    jax.block_until_ready(kernel(params, x))
    first = time.perf_counter() - start
    added_first = harness.max_rss_bytes() - before
    if spec.get("cached"):  # programs loaded from the cache: the execution's peak alone
        return {"first_s": first, "added_rss_bytes": added_first, "load": harness.load()}
    # The warm call's own peak: the high-water mark reset (Linux clear_refs 5), then the
    # peak above the resident size before it (compilation memory excluded).
    resident = _reset_peak()
    warm = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(kernel(params, x))
        warm.append(time.perf_counter() - start)
    return {
        "implementation": plan.implementation,
        "estimate_s": estimate.seconds,
        "estimate_bytes": estimate.memory_bytes,
        "first_s": first,
        "warm_s": min(warm),
        "added_rss_bytes": added_first,
        "warm_added_rss_bytes": None if resident is None else harness.max_rss_bytes() - resident,
        "load": harness.load(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    keys = sorted({r[0] for r in RUNS})
    parser.add_argument("--cases", nargs="+", default=keys, choices=keys)
    parser.add_argument("--out", default=os.path.join(HERE, "results_plan_accuracy.json"))
    args = parser.parse_args(argv)
    import tempfile

    import bench_core
    import cases

    results = []
    for key, n, implementations in RUNS:
        if key not in args.cases:
            continue
        if key != "wholebatch":
            npz = cases.case_paths(DATA_DIR, key, n)[0]
            if not os.path.exists(npz):
                bench_core.prepare(cases.CASES[key], n, DATA_DIR)
        for implementation in implementations:
            spec = {"case": key, "n": n, "implementation": implementation}
            with tempfile.TemporaryDirectory(prefix="ntk-plan-cache-") as cache_dir:
                run = {**spec, "cache_dir": cache_dir}
                result = harness.run_worker(
                    os.path.abspath(__file__), run, timeout_s=600, kill_bytes=12 * 2**30
                )
                if "error" not in result:
                    cached = harness.run_worker(
                        os.path.abspath(__file__),
                        {**run, "cached": True},
                        timeout_s=600,
                        kill_bytes=12 * 2**30,
                    )
                    result["cached_first_s"] = cached.get("first_s")
                    result["cached_added_rss_bytes"] = cached.get("added_rss_bytes")
            results.append({**spec, **result})
            print(json.dumps(results[-1]), flush=True)
    with open(args.out, "w") as fh:
        json.dump({"machine": harness.machine(), "results": results}, fh, indent=1)
    print(table(results))


def _mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.0f}"


def _ratio(estimate, measured) -> str:
    return "-" if not measured else f"{estimate / measured:.2f}"


def table(results) -> str:
    rows = [
        "| case | N | implementation | plan s | warm s | warm / plan | plan MiB | warm call's "
        "peak MiB | first call's peak MiB | cached programs' first call peak MiB | "
        "plan / cached peak |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['case']} | {r['n']} | {r['implementation']} | {r['error']} |")
            continue
        rows.append(
            f"| {r['case']} | {r['n']} | {r['implementation']} | {r['estimate_s']:.3g} | "
            f"{r['warm_s']:.3g} | {r['warm_s'] / r['estimate_s']:.2f} | "
            f"{r['estimate_bytes'] / 2**20:.0f} | {(r['warm_added_rss_bytes'] or 0) / 2**20:.0f} | "
            f"{r['added_rss_bytes'] / 2**20:.0f} | {_mib(r.get('cached_added_rss_bytes'))} | "
            f"{_ratio(r['estimate_bytes'], r.get('cached_added_rss_bytes'))} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        harness.worker_main(measure)
    else:
        main()
