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
global average pool, Dense 10 on 28x28x1 inputs, full kernel), and issue 28's equinox
CNNs on 3x16x16 inputs through ``ntk_equinox`` (default ``trace_axes``): "eqx-cnn" Conv
3 -> 16 3x3 pad 1, ReLU, average pool 2, Conv 16 -> 32 pad 1, ReLU, average pool 2,
Linear 512 -> 10 (P = 10.2 k); "eqx-cnn-16k" the same without padding and with one pool
after the second convolution, Linear 1152 -> 10 (P = 16.6 k: the issue gives only "2
convolutions on 3x16x16, P = 16.6 k", this layout has that P). Writes
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
    ("eqx-cnn", 32, ("structured", "jacobian", "ntvp")),
    ("eqx-cnn-16k", 32, ("structured", "jacobian", "ntvp")),
]
#: Cases built here rather than from ``cases.py``.
OWN_CASES = ("wholebatch", "eqx-cnn", "eqx-cnn-16k")


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


def _eqx_cnn(padded: bool, n: int):
    """(model, x): issue 28's equinox CNN (module docstring) and N inputs of 3x16x16."""
    import equinox as eqx
    import jax

    class CNN(eqx.Module):
        c1: eqx.nn.Conv2d
        c2: eqx.nn.Conv2d
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            pad = 1 if padded else 0
            self.c1 = eqx.nn.Conv2d(3, 16, 3, padding=pad, key=k1)
            self.c2 = eqx.nn.Conv2d(16, 32, 3, padding=pad, key=k2)
            self.head = eqx.nn.Linear(32 * (4 * 4 if padded else 6 * 6), 10, key=k3)

        def __call__(self, x):
            pool = eqx.nn.AvgPool2d(2, 2)
            x = jax.nn.relu(self.c1(x))
            x = pool(x) if padded else x
            x = pool(jax.nn.relu(self.c2(x)))
            return self.head(x.reshape(-1))

    model = CNN(jax.random.PRNGKey(0))
    return model, jax.random.normal(jax.random.PRNGKey(1), (n, 3, 16, 16))


def _kernel_and_plan(spec):
    """(call, plan): the case's kernel call (no arguments) and its ``plan()``."""
    import jax

    import ntk_core

    impl = spec["implementation"]
    if spec["case"].startswith("eqx-cnn"):
        import ntk_equinox

        model, x = _eqx_cnn(spec["case"] == "eqx-cnn", spec["n"])
        kernel = ntk_equinox.kernel_fn(model, implementation=impl)
        return lambda: kernel(model, x), ntk_equinox.plan(model, x, implementation=impl)
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
    kernel = ntk_core.ntk_fn(apply, implementation=impl, **options)
    return lambda: kernel(params, x), kernel.plan(params, x)


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
    call, plan = _kernel_and_plan(spec)
    (estimate,) = [e for e in plan.estimates if e.implementation == plan.implementation]
    before = harness.max_rss_bytes()
    start = time.perf_counter()
    jax.block_until_ready(call())
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
        jax.block_until_ready(call())
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
        if key not in OWN_CASES:
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


IMPLEMENTATIONS = ("structured", "jacobian", "ntvp")


def _cell(r, n) -> str:
    """One measurement: plan / warm seconds (warm / plan), plan / cached peak MiB (ratio)."""
    if "error" in r:
        return r["error"]
    at = "" if r["n"] == n else f"N = {r['n']}: "
    peak = r.get("cached_added_rss_bytes")
    memory = "-" if not peak else f"{r['estimate_bytes'] / peak:.2f}"
    return (
        f"{at}{r['estimate_s']:.3g} / {r['warm_s']:.3g} s ({r['warm_s'] / r['estimate_s']:.2f}); "
        f"{r['estimate_bytes'] / 2**20:.0f} / {(peak or 0) / 2**20:.0f} MiB ({memory})"
    )


def table(results) -> str:
    """One row per case, one column per implementation: plan s / warm s (warm / plan);
    plan MiB / the cached programs' first call's added peak MiB (plan / peak)."""
    rows = [
        "| case | N | " + " | ".join(IMPLEMENTATIONS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in IMPLEMENTATIONS) + " |",
    ]
    cases = {}
    for r in results:
        cases.setdefault(r["case"], {})[r["implementation"]] = r
    for case, runs in cases.items():
        n = next(iter(runs.values()))["n"]
        cells = [_cell(runs[i], n) if i in runs else "" for i in IMPLEMENTATIONS]
        rows.append(f"| {case} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        harness.worker_main(measure)
    else:
        main()
