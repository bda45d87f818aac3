"""Where a kernel call's time goes: its two compiled phases timed apart, and the XLA
operations that take longest in each (from a ``jax.profiler`` trace).

For a case of ``cases.py`` (the Flax twin as ``bench_core.py`` builds it) at N samples,
``x2=None``: the implementation's ``features`` (O(N)) and its Gram ``tile`` (O(N²), with the
exact mirror), each warm, best of ``--repeats``; then one traced call of each, and per phase
the operation kinds and single operations with the most thread time. This is how the
ResNet-18's slow small-map convolutions were found (benchmarks/README.md).

    python benchmarks/profile_phases.py --case resnet18 --n 64
    python benchmarks/profile_phases.py --case mlp1 --n 1000 --implementation auto --top 10
    python benchmarks/profile_phases.py --accelerator-case vit --out phases.json

``--accelerator-case``: one of ``accelerator_bench.py``'s plain-JAX cases (no Flax needed:
runs on a device machine as it is), its ``TRACE_AXES`` (the ViT traced; the others
``()``; before commit 8f3124a every case ``()``), x2 = None, its own N (``--n``: its
samples repeated to N); ``--out``
writes the phases' seconds as JSON.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cases  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ntk_core  # noqa: E402


def best_of(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def op_times(trace_dir: str) -> dict:
    """{XLA module: Counter(op name -> microseconds)} of the trace's thunk events."""
    path = sorted(glob.glob(os.path.join(trace_dir, "plugins/profile/*/*.trace.json.gz")))[-1]
    events = json.load(gzip.open(path))["traceEvents"]
    names = {}  # (pid, tid or None) -> the process's / thread's name
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[e["pid"], e.get("tid") if e["name"] == "thread_name" else None] = e["args"][
                "name"
            ]
    modules: dict = collections.defaultdict(collections.Counter)
    runs = []  # a device's module runs: (start, end, name); its ops are placed in them
    device_ops = []
    for e in events:
        if e.get("ph") != "X":
            continue
        module = e.get("args", {}).get("hlo_module")
        process = names.get((e["pid"], None), "")
        thread = names.get((e["pid"], e.get("tid")), "")
        if not module and any(d in process for d in ("TPU", "GPU")):  # a device's events
            if thread == "XLA Modules":
                runs.append((e["ts"], e["ts"] + e["dur"], e["name"].split("(")[0]))
            elif thread == "XLA Ops":
                device_ops.append(e)
        elif module:
            modules[module][e["name"]] += e["dur"]
    runs.sort()
    for e in device_ops:
        inside = [name for start, end, name in runs if start <= e["ts"] < end]
        modules[f"device: {inside[0] if inside else '?'}"][e["name"]] += e["dur"]
    return modules


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="resnet18", choices=list(cases.CASES))
    parser.add_argument("--n", type=int, help="N (default: the case's own)")
    parser.add_argument("--implementation", default="structured")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=8, help="operations shown per phase")
    parser.add_argument("--accelerator-case", help="a case of accelerator_bench.py instead")
    parser.add_argument("--out", help="the phases' warm seconds as JSON")
    args = parser.parse_args(argv)

    if args.accelerator_case:
        import accelerator_bench

        apply, params, x, _ = accelerator_bench._setup(args.accelerator_case, False)
        if args.n:  # the case's samples repeated (or cut) to N
            x = jnp.resize(x, (args.n, *x.shape[1:]))
        title = args.accelerator_case
        trace_axes = accelerator_bench.TRACE_AXES.get(title, ())
    else:
        import bench_core  # Flax

        case = cases.CASES[args.case]
        variables = bench_core.init_variables(case)
        params, _ = cases.split_variables(variables)
        params = jax.tree.map(jnp.asarray, params)
        x = jnp.asarray(cases.make_inputs(case, args.n or case.n))
        apply, title, trace_axes = bench_core.apply_fn(case, variables), case.title, case.trace_axes
    n = x.shape[0]
    kernel = ntk_core.ntk_fn(apply, trace_axes=trace_axes, implementation=args.implementation)
    engine = kernel._engine  # the phases of one call (docs/architecture.md, "One kernel call")
    _, config = engine.prepare(params, x)
    impl = engine.implementation(config)
    print(f"{title}, N = {n}: implementation {config.implementation}")
    if impl.features is None:  # "ntvp": pairwise from the inputs, one phase
        phases = {"tile": lambda: impl.tile(params, None, None, None, x, None, True)}
    else:
        feats = impl.features(params, x, None)
        phases = {
            "features": lambda: impl.features(params, x, None),
            "tile": lambda: impl.tile(params, feats, None, None, None, None, True),
        }
    seconds = {}
    for name, fn in phases.items():
        seconds[name] = best_of(fn, args.repeats)
        print(f"  {name:<9} {seconds[name]:8.4f} s warm (best of {args.repeats})")
    if args.out:
        modes = list(getattr(config.structure, "modes", ()))
        row = dict(case=title, n=int(n), implementation=config.implementation, warm_s=seconds,
                   modes=modes, device=str(jax.devices()[0]))  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for fn in phases.values():
            jax.block_until_ready(fn())
        jax.profiler.stop_trace()
        modules = op_times(trace_dir)
    for module, ops in modules.items():
        kinds = collections.Counter()
        for op, us in ops.items():
            kinds[op.split(".")[0]] += us
        total = sum(ops.values()) / 1e3
        print(f"{module}: {total:.0f} ms of thread time")
        print("  by kind: " + ", ".join(f"{k} {v / 1e3:.0f} ms" for k, v in kinds.most_common(5)))
        for op, us in ops.most_common(args.top):
            print(f"    {us / 1e3:8.1f} ms  {op}")


if __name__ == "__main__":
    main()
