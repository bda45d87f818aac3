"""Infinite-width kernels: ``ntk_core.stax`` against neural-tangents 0.6.5's ``stax``
(issue 49), on the same networks, built by one function from either ``stax`` module.

Runs under either environment (ours: the project's venv; neural-tangents: its own, jax
0.4.23, see README.md). Each measurement is one fresh worker process (``harness.py``):
it builds the network and the inputs (float64 draws from a seed of the case's name, cast
to ``--dtype``, the same in both environments), records its peak resident memory
(``VmHWM``, the baseline), times the first call of the Gram matrix ``kernel_fn(x, None,
get)`` (trace + compile + run, blocked until ready), then warm calls (until 1 s or 10
calls; one when a call takes over 5 s; the fastest is reported), and its peak resident
memory again. Ours is called as a user calls it (``kernel_fn`` compiles itself, checks
the inputs and the result); neural-tangents' as its README advises,
``jax.jit(kernel_fn, static_argnames="get")``, or ``nt.batch(kernel_fn, batch_size)``
(tiles jitted) where a case gives a batch size, ours then with the same ``batch_size``.
The kernels are saved (``--kernel-dir``) so that ``compare`` reports how far apart the two
libraries are.

    python benchmarks/bench_stax.py --library ours --dtype float32 [--cases c3 fc3 ...]
    /tmp/ntvenv/bin/python benchmarks/bench_stax.py --library nt --dtype float32
    python benchmarks/bench_stax.py compare    # max relative difference per kernel
    python benchmarks/bench_stax.py report     # the markdown table of README.md

Results are merged into ``results_stax_ours.json`` / ``results_stax_nt.json`` (one entry
per case, dtype, N and ``get``, each with its runs), so measurements may be repeated
and alternated between the environments; ``report`` takes, per entry, the fastest run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402

RESULTS = {
    "ours": os.path.join(HERE, "results_stax_ours.json"),
    "nt": os.path.join(HERE, "results_stax_nt.json"),
}
KERNEL_DIR = "/tmp/ntk-stax-bench"


# --- networks: stax names only, so that either library's module builds them ----------


def c3_erf(stax):
    """Case C3: 13 x [Dense(511), Erf], Dense(1), W_std 1.5, b_std 0.05, scalar inputs."""
    d = stax.Dense
    layers = [d(511, W_std=1.5, b_std=0.05), stax.Erf()] * 13
    return stax.serial(*layers, d(1, W_std=1.5, b_std=0.05))


def fc3_relu(stax):
    """Three hidden ReLU layers of 512 (He-style W_std = sqrt 2), linear readout."""
    layers = [stax.Dense(512, W_std=2**0.5, b_std=0.05), stax.Relu()] * 3
    return stax.serial(*layers, stax.Dense(1, W_std=1.0, b_std=0.05))


def cnn21(stax, readout="flatten"):
    """neural-tangents' README benchmark: 21 x [Conv 3x3 SAME, Relu], then Flatten (the
    spatial diagonal suffices) or GlobalAvgPool (every pair of positions), Dense(1)."""
    conv = [stax.Conv(128, (3, 3), padding="SAME", W_std=2**0.5, b_std=0.05), stax.Relu()]
    pool = stax.Flatten() if readout == "flatten" else stax.GlobalAvgPool()
    return stax.serial(*(conv * 21), pool, stax.Dense(1, W_std=1.0, b_std=0.0))


def cnn21_repeat(stax):
    """The same 21-layer CNN with its last 20 [Conv, Relu] as ``stax.repeat`` (one layer
    scanned 20 times: one compiled step instead of 20 unrolled ones)."""
    conv = stax.Conv(128, (3, 3), padding="SAME", W_std=2**0.5, b_std=0.05)
    step = stax.serial(conv, stax.Relu())
    return stax.serial(
        step, stax.repeat(step, 20), stax.Flatten(), stax.Dense(1, W_std=1.0, b_std=0.0)
    )


def myrtle5(stax):
    """Myrtle-5 (Shankar et al. 2020, "Neural Kernels Without Tangents"): four 3x3 ReLU
    convolutions, the first two at full resolution, a 2x2 average pool after the second
    and the third, the last conv's map averaged to one position, a linear readout of 10.
    The paper's three final 2x2 pools of the 8x8 map are one global average here (the
    same kernel: each is an exact mean over disjoint windows)."""

    def conv():
        return stax.Conv(128, (3, 3), padding="SAME", W_std=2**0.5, b_std=0.0)

    pool = stax.AvgPool((2, 2), strides=(2, 2))
    return stax.serial(
        conv(), stax.Relu(), conv(), stax.Relu(), pool,
        conv(), stax.Relu(), pool,
        conv(), stax.Relu(), stax.GlobalAvgPool(),
        stax.Dense(10, W_std=1.0, b_std=0.0),
    )  # fmt: skip


def wide_resnet(stax, block_size=1, k=1, num_classes=10):
    """The WideResNet of neural-tangents' README (Zagoruyko & Komodakis 2016 in the
    infinite-width limit): a 3x3 conv of 16 k channels, three groups of ``block_size``
    pre-activation residual blocks (16 k, 32 k, 64 k channels; the 2nd and 3rd
    stride 2; a group's first block takes a conv shortcut), global average pool, Dense.
    The README's AvgPool((8, 8)) of a 32x32 input's 8x8 map is a global average."""

    def block(channels, strides, conv_shortcut):
        main = stax.serial(
            stax.Relu(),
            stax.Conv(channels, (3, 3), strides, padding="SAME"),
            stax.Relu(),
            stax.Conv(channels, (3, 3), padding="SAME"),
        )
        if conv_shortcut:
            shortcut = stax.Conv(channels, (3, 3), strides, padding="SAME")
        else:
            shortcut = stax.Identity()
        return stax.serial(stax.FanOut(2), stax.parallel(main, shortcut), stax.FanInSum())

    def group(channels, strides):
        blocks = [block(channels, strides, True)]
        blocks += [block(channels, (1, 1), False) for _ in range(block_size - 1)]
        return stax.serial(*blocks)

    return stax.serial(
        stax.Conv(16 * k, (3, 3), padding="SAME"),
        group(16 * k, (1, 1)),
        group(32 * k, (2, 2)),
        group(64 * k, (2, 2)),
        stax.GlobalAvgPool(),
        stax.Dense(num_classes, W_std=1.0, b_std=0.0),
    )


# name: (builder, per-sample shape, N, batch_size or None, full spatial covariance?)
CASES = {
    "c3": (c3_erf, (1,), 168, None, False),
    "fc3": (fc3_relu, (784,), 4000, None, False),
    "cnn21": (cnn21, (32, 32, 3), 256, None, False),
    "cnn21-repeat": (cnn21_repeat, (32, 32, 3), 256, None, False),
    "cnn21-gap": (lambda s: cnn21(s, "gap"), (32, 32, 3), 8, None, True),
    "myrtle5": (myrtle5, (32, 32, 3), 64, 8, True),
    "wrn": (wide_resnet, (8, 8, 3), 64, None, True),
}
LABELS = {
    "c3": "C3 Erf, 13 x Dense(511)",
    "fc3": "ReLU FC 784-3x512-1",
    "cnn21": "21-layer 3x3 ReLU CNN, Flatten, 32x32x3",
    "cnn21-repeat": "the same CNN, 20 layers as stax.repeat",
    "cnn21-gap": "21-layer 3x3 ReLU CNN, GlobalAvgPool, 32x32x3",
    "myrtle5": "Myrtle-5, 32x32x3",
    "wrn": "WideResNet block_size=1, k=1, 8x8x3",
}


def inputs(case: str, n: int, dtype: str):
    """The float64 draws of ``case`` (seeded from its name), cast to ``dtype``."""
    import numpy as np

    rng = np.random.RandomState(sum(ord(c) * (i + 1) for i, c in enumerate(case)))
    return rng.randn(n, *CASES[case][1]).astype(dtype)


def estimate_bytes(case: str, n: int, dtype: str, batch_size, names) -> float:
    """A rough peak of either library: about 12 per-pair arrays of every tracked pair of
    positions (the kernels, the inputs' covariances and temporaries) for the pairs of one
    call (a tile of batch_size x batch_size), plus the kernels themselves."""
    shape = CASES[case][1]
    spatial = math.prod(shape[:-1])
    positions = spatial * spatial if CASES[case][4] else spatial
    itemsize = 8 if dtype == "float64" else 4
    b = min(batch_size or n, n)
    return itemsize * (12 * positions * b * b + len(names) * n * n)


# --- the worker ---------------------------------------------------------------------


def measure(spec):
    import jax

    if spec["dtype"] == "float64":
        jax.config.update("jax_enable_x64", True)
    import numpy as np

    names = tuple(spec["get"])
    get = names[0] if len(names) == 1 else names
    batch_size = spec.get("batch_size")
    if spec["library"] == "nt":
        import neural_tangents as nt
        from neural_tangents import stax

        kernel_fn = CASES[spec["case"]][0](stax)[2]
        if batch_size:
            fn = nt.batch(kernel_fn, batch_size=batch_size)
        else:
            fn = jax.jit(kernel_fn, static_argnames="get")

        def call(x):
            return fn(x, None, get)

        version = nt.__version__
    else:
        import ntk_core
        from ntk_core import stax

        kernel_fn = CASES[spec["case"]][0](stax)[2]

        def call(x):
            return kernel_fn(x, None, get, batch_size=batch_size)

        version = ntk_core.__version__
    x = jax.numpy.asarray(inputs(spec["case"], spec["n"], spec["dtype"]))
    baseline = harness.max_rss_bytes()
    load_before = harness.load()
    t0 = time.perf_counter()
    out = jax.block_until_ready(call(x))
    first = time.perf_counter() - t0
    out, runs = harness.warm_runs(lambda: call(x), first)
    kernels = out if len(names) > 1 else (out,)
    arrays = {name: np.asarray(k, np.float64) for name, k in zip(names, kernels, strict=True)}
    path = None
    if spec.get("kernel_dir"):
        os.makedirs(spec["kernel_dir"], exist_ok=True)
        path = os.path.join(spec["kernel_dir"], f"{spec['library']}_{key_of(spec)}.npz")
        np.savez(path, **arrays)
    return {
        **harness.timing_record(first, runs, baseline, load_before),
        "shapes": {k: list(v.shape) for k, v in arrays.items()},
        "dtype_out": str(np.asarray(kernels[0]).dtype),
        "norms": {k: float(np.linalg.norm(v)) for k, v in arrays.items()},
        "kernels": path,
        "library_version": version,
        "machine": harness.machine(),
    }


def key_of(spec) -> str:
    return f"{spec['case']}_n{spec['n']}_{spec['dtype']}_{'+'.join(spec['get'])}"


# --- the driver ---------------------------------------------------------------------


def run(args):
    out = args.out or RESULTS[args.library]
    results = json.load(open(out)) if os.path.exists(out) else {}
    names = ("ntk",) if args.get == "ntk" else ("nngp", "ntk")
    sizes = dict(kv.split("=") for kv in args.n)
    for case in args.cases:
        for dtype in args.dtype:
            n = int(sizes.get(case, CASES[case][2]))
            batch_size = CASES[case][3] if CASES[case][3] and CASES[case][3] < n else None
            spec = {
                "library": args.library, "case": case, "n": n, "dtype": dtype,
                "get": list(names), "batch_size": batch_size, "kernel_dir": args.kernel_dir,
            }  # fmt: skip
            key = key_of(spec)
            est = estimate_bytes(case, n, dtype, batch_size, names)
            if est > args.max_est_gib * harness.GIB:
                result = {"skipped": f"estimate {est / harness.GIB:.1f} GiB > {args.max_est_gib}"}
            else:
                result = harness.run_worker(
                    __file__,
                    spec,
                    timeout_s=args.timeout_s,
                    kill_bytes=args.kill_gib * harness.GIB,
                )
            result["estimate_gib"] = est / harness.GIB
            result["started_utc"] = harness.machine()["date_utc"]
            entry = results.setdefault(key, {"spec": spec, "runs": []})
            entry["runs"].append(result)
            if "error" in result or "skipped" in result:
                print(f"{args.library} {key}: {result.get('error') or result.get('skipped')}")
            else:
                print(
                    f"{args.library} {key}: first {result['first_call_s']:.3f} s, "
                    f"warm {result['warm_s']:.3f} s, peak "
                    f"{result['peak_rss_bytes'] / 2**20:.0f} MiB "
                    f"(baseline {result['baseline_rss_bytes'] / 2**20:.0f}), load "
                    f"{result['loadavg_before'][0]}-{result['loadavg_after'][0]}",
                    flush=True,
                )
            with open(out, "w") as fh:
                json.dump(results, fh, indent=1)


def best(entry):
    """The entry's fastest successful run (first call and warm each their minimum; peak
    memory the smallest) and the load averages of its runs, or None."""
    ok = [r for r in entry["runs"] if "first_call_s" in r]
    if not ok:
        return None
    loads = [v for r in ok for v in (r["loadavg_before"][0], r["loadavg_after"][0])]
    return {
        "first": min(r["first_call_s"] for r in ok),
        "warm": min(r["warm_s"] for r in ok),
        "peak_mib": min(r["peak_rss_bytes"] for r in ok) / 2**20,
        "added_mib": min(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in ok) / 2**20,
        "load": (min(loads), max(loads)),
        "runs": len(ok),
        "kernels": ok[-1].get("kernels"),
    }


def compare(args):
    """Max |ours - theirs| / max |theirs| per kernel, from the saved kernels."""
    import numpy as np

    ours = json.load(open(args.ours))
    theirs = json.load(open(args.nt))
    rows = {}
    for key in sorted(set(ours) & set(theirs)):
        a, b = best(ours[key]), best(theirs[key])
        if not (a and b and a["kernels"] and b["kernels"]):
            continue
        ka, kb = np.load(a["kernels"]), np.load(b["kernels"])
        for name in ka.files:
            x, y = ka[name], kb[name]
            err = float(np.max(np.abs(x - y)) / np.max(np.abs(y)))
            rows[f"{key}/{name}"] = err
            print(f"{key}/{name:5s} {err:.2e}")
    if args.save:
        with open(args.save, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


def report(args):
    ours = json.load(open(args.ours))
    theirs = json.load(open(args.nt))
    agree = json.load(open(args.agreement)) if os.path.exists(args.agreement) else {}
    print(
        "| case | dtype | N | get | ours first / warm s, peak MiB (added) | NT first / warm s, "
        "peak MiB (added) "
        "| first / warm / peak ratio | targets (first ≤ 1.0, warm ≤ 0.5, peak ≤ 1.0) "
        "| max rel. diff nngp / ntk | load |"
    )
    print("| --- " * 10 + "|")

    def cell(b, entry):
        if b is None:
            why = entry["runs"][-1].get("error") or entry["runs"][-1].get("skipped", "?")
            return why.split(":")[0][:60]
        return f"{b['first']:.3g} / {b['warm']:.3g}, {b['peak_mib']:.0f} ({b['added_mib']:.0f})"

    for key in sorted(
        set(ours) | set(theirs), key=lambda k: (list(CASES).index(k.split("_")[0]), k)
    ):
        eo, et = ours.get(key), theirs.get(key)
        spec = (eo or et)["spec"]
        a = best(eo) if eo else None
        b = best(et) if et else None
        ratios, met = "", ""
        if a and b:
            r = (a["first"] / b["first"], a["warm"] / b["warm"], a["peak_mib"] / b["peak_mib"])
            ratios = " / ".join(f"{v:.2f}" for v in r)
            ok = (r[0] <= 1.0, r[1] <= 0.5, r[2] <= 1.0)
            met = ", ".join("met" if v else "**not met**" for v in ok)
        diffs = " / ".join(
            f"{agree[f'{key}/{name}']:.1e}" for name in spec["get"] if f"{key}/{name}" in agree
        )
        loads = [v for x in (a, b) if x for v in x["load"]]
        load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else ""
        print(
            f"| {LABELS[spec['case']]} | {spec['dtype']} | {spec['n']}"
            + (f" (tiles {spec['batch_size']})" if spec["batch_size"] else "")
            + f" | {'+'.join(spec['get'])} | {cell(a, eo) if eo else '-'} | "
            f"{cell(b, et) if et else '-'} | {ratios} | {met} | {diffs} | {load} |"
        )


def main(argv=None):
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return harness.worker_main(measure)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="run", choices=("run", "compare", "report"))
    parser.add_argument("--library", choices=("ours", "nt"), default="ours")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=("float32", "float64"))
    parser.add_argument("--get", choices=("both", "ntk"), default="both")
    parser.add_argument("--n", nargs="*", default=[], help="case=N, e.g. fc3=1000")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--kill-gib", type=float, default=12.0)
    parser.add_argument("--max-est-gib", type=float, default=12.0)
    parser.add_argument("--kernel-dir", default=KERNEL_DIR)
    parser.add_argument("--out", help="results file (default: results_stax_<library>.json)")
    parser.add_argument("--ours", default=RESULTS["ours"])
    parser.add_argument("--nt", default=RESULTS["nt"])
    parser.add_argument("--agreement", default=os.path.join(KERNEL_DIR, "agreement.json"))
    parser.add_argument("--save", help="compare: write the differences to this JSON file")
    args = parser.parse_args(argv)
    if args.mode == "compare":
        args.save = args.save or args.agreement
        return compare(args)
    if args.mode == "report":
        return report(args)
    return run(args)


if __name__ == "__main__":
    main()
