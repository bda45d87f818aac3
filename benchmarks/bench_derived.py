"""Infinite-width kernels derived from a model itself (issue 50): time against the stax
kernel of the same network, agreement, and Monte Carlo kernels against them.

Three parts, each run by ``python benchmarks/bench_derived.py <part>``; figures are merged
into ``results_derived.json`` (one entry per measurement, each with its runs, so that
parts may be repeated and the sides alternated), ``report`` prints the tables of
README.md. Works unchanged on a CPU, GPU or TPU (whatever ``jax.devices()[0]`` is).

``timing``: the same network as a Flax linen model through
``ntk_flax.infinite_kernel_fn(model, variables)`` ("derived") and written in
``ntk_core.stax`` with ``parameterization="standard"`` ("stax"; the CNN also with 21
distinct layer objects, "stax-distinct", and with its last 20 layers as ``stax.repeat``,
"stax-repeat": see :func:`cnn21_stax`). Each side is one fresh worker process
(``harness.py``): it builds the network, the variables (``jax.jit(model.init)``) and the
inputs, records its peak resident memory (the baseline), times the first call of the
Gram matrix ``kernel_fn(x, None)`` (NNGP and NTK: for "derived" the trace of the model,
the derivation of its layer graph and priors, compilation and run; blocked until
ready), then warm calls (until 1 s or 10 calls, one when a call takes over 5 s; the
fastest is reported) and its peak again; the kernels are saved, and ``timing`` reports
the largest relative difference max|a - b| / max|b| between the sides. Networks: case
C3's ``ErfMLP(13, 511)`` (examples/c3_gp_erf.py) on its 168 inputs against
``erf_network(13, 511, "standard")``; the 21-layer 3x3 ReLU CNN of bench_stax.py
(128 channels, W_std √2, b_std 0.05, Flatten, Dense(1) W_std 1, b_std 0) on 32x32x3.
``--rounds`` repeats the sides back to back (derived, stax, ..., derived, ...).

``mc``: the Monte Carlo kernels of C3's Flax model (its own initialisers), one
initialisation at a time (``ntk_flax.monte_carlo_kernels(model, x, key=k_s,
n_samples=1)``, k_s = split(key, S_max)[s], summed in float64), against the derived
kernel of the same model: the relative Frobenius error ||K_MC - K|| / ||K|| of the NNGP
and the NTK after 1, 2, 4, ... samples, until 1 % or the time cap (``--cap-s``), at the
case's width and a wider one. Seconds include the compilations.

``width``: a ReLU MLP with two hidden layers (8 inputs, N = 16) of each framework with
its DEFAULT initialisers (Flax ``nn.Dense``, ``hk.nets.MLP``, ``eqx.nn.MLP``) and with one
custom initialiser each, at widths 64, 256, 1024, 4096: the error of the mean of S
Monte Carlo NTKs (and NNGPs) against the derived kernel, and the sampling part of it
(||A - B|| / 2 for the means A, B of two independent halves), and the fitted slope of
log error against log width.

    python benchmarks/bench_derived.py timing --cases c3 cnn21 --rounds 2
    python benchmarks/bench_derived.py timing --cases c3 --dtype float64
    python benchmarks/bench_derived.py mc --widths 511 2048 --cap-s 180
    python benchmarks/bench_derived.py width --samples 64
    python benchmarks/bench_derived.py report
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import harness  # noqa: E402

RESULTS = os.path.join(HERE, "results_derived.json")
KERNEL_DIR = "/tmp/ntk-derived-bench"
DATA = os.path.join(ROOT, "tests", "data", "gp_erf_1d.npz")
SIDES = {"c3": ("derived", "stax"), "cnn21": ("derived", "stax", "stax-distinct", "stax-repeat")}
N_DEFAULT = {"c3": 168, "cnn21": 64}
WIDTHS = (64, 256, 1024, 4096)


# --- networks ------------------------------------------------------------------------


def c3_model(width=511, depth=13):
    """Case C3's Flax model, as examples/c3_gp_erf.py defines it."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import c3_gp_erf

    return c3_gp_erf.ErfMLP(depth, width), c3_gp_erf.erf_network(depth, width, "standard")


def cnn21_flax(channels=128, depth=21):
    """bench_stax.py's ``cnn21`` as a Flax linen model: 21 x [Conv 3x3 SAME, relu],
    Flatten, Dense(1); W ~ N(0, 2 / fan_in), b ~ N(0, 0.05²), readout W ~ N(0, 1 / fan_in),
    b = 0."""
    import flax.linen as nn

    class CNN21(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(depth):
                x = nn.Conv(
                    channels,
                    (3, 3),
                    padding="SAME",
                    kernel_init=nn.initializers.variance_scaling(2.0, "fan_in", "normal"),
                    bias_init=nn.initializers.normal(0.05),
                )(x)
                x = nn.relu(x)
            x = x.reshape(x.shape[0], -1)
            init = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
            return nn.Dense(1, kernel_init=init, bias_init=nn.initializers.zeros)(x)

    return CNN21()


def cnn21_stax(stax, how="serial", channels=128, depth=21):
    """The same CNN in stax, standard parameterisation (the real widths): ``"serial"``
    ``[Conv, Relu] * 21`` as bench_stax.py writes it (``stax.serial`` runs consecutive
    repeats of the same layer objects as one ``lax.scan`` step), ``"distinct"`` 21
    separate [Conv, Relu] objects (really unrolled: the program the derived kernel, one
    node per Flax layer, compiles), ``"repeat"`` the last 20 as ``stax.repeat``."""

    def step():
        conv = stax.Conv(
            channels, (3, 3), padding="SAME", W_std=2**0.5, b_std=0.05, parameterization="standard"
        )
        return stax.serial(conv, stax.Relu())

    one = step()
    if how == "repeat":
        body = [one, stax.repeat(one, depth - 1)]
    elif how == "distinct":
        body = [step() for _ in range(depth)]
    else:
        body = [one] * depth
    readout = stax.Dense(1, W_std=1.0, b_std=0.0, parameterization="standard")
    return stax.serial(*body, stax.Flatten(), readout)


def case_inputs(case, n, dtype):
    import numpy as np

    if case == "c3":
        d = np.load(DATA)
        x = np.concatenate([d["x_train"], d["x_test"]])
        assert n <= len(x), f"C3 has {len(x)} inputs"
        return x[:n].astype(dtype)
    rng = np.random.RandomState(sum(ord(c) * (i + 1) for i, c in enumerate(case)))
    return rng.randn(n, 32, 32, 3).astype(dtype)


# --- part 1: the worker of one side ---------------------------------------------------


def measure_timing(spec):
    import jax

    if spec["dtype"] == "float64":
        jax.config.update("jax_enable_x64", True)
    import numpy as np

    import ntk_flax
    from ntk_core import stax

    case, side = spec["case"], spec["side"]
    x = jax.numpy.asarray(case_inputs(case, spec["n"], spec["dtype"]))
    if side == "derived":
        model = c3_model()[0] if case == "c3" else cnn21_flax()
        variables = jax.jit(model.init)(jax.random.PRNGKey(0), x[:1])
        jax.block_until_ready(variables)
        kernel_fn = ntk_flax.infinite_kernel_fn(model, variables)
    elif case == "c3":
        kernel_fn = c3_model()[1][2]
    else:
        kernel_fn = cnn21_stax(stax, {"stax": "serial"}.get(side, side[5:]))[2]
    baseline = harness.max_rss_bytes()
    load_before = harness.load()
    t0 = time.perf_counter()
    out = jax.block_until_ready(kernel_fn(x, None))
    first = time.perf_counter() - t0
    out, runs = harness.warm_runs(lambda: kernel_fn(x, None), first)
    arrays = {k: np.asarray(getattr(out, k), np.float64) for k in ("nngp", "ntk")}
    os.makedirs(spec["kernel_dir"], exist_ok=True)
    path = os.path.join(spec["kernel_dir"], f"{key_of(spec)}.npz")
    np.savez(path, **arrays)
    return {
        **harness.timing_record(first, runs, baseline, load_before),
        "dtype_out": str(np.asarray(out.ntk).dtype),
        "kernels": path,
        "machine": harness.machine(),
    }


def key_of(spec):
    return f"timing_{spec['case']}_{spec['side']}_n{spec['n']}_{spec['dtype']}"


# --- part 2: Monte Carlo samples to 1 % ---------------------------------------------


def rel(a, b):
    import numpy as np

    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def measure_mc(spec):
    import jax
    import numpy as np

    import ntk_flax

    width, cap_s = spec["width"], spec["cap_s"]
    x = case_inputs("c3", 168, "float32")
    model = c3_model(width)[0]
    t0 = time.perf_counter()
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), x[:1])
    exact = ntk_flax.infinite_kernel_fn(model, variables)(x, None)
    exact = {k: np.asarray(getattr(exact, k), np.float64) for k in ("nngp", "ntk")}
    derived_s = time.perf_counter() - t0
    keys = jax.random.split(jax.random.PRNGKey(1), spec["max_samples"])
    sums = {k: np.zeros_like(v) for k, v in exact.items()}
    sq = {k: 0.0 for k in exact}  # sum of squared single-sample errors
    rows, reached = [], {}
    t0 = time.perf_counter()
    for s in range(spec["max_samples"]):
        k = ntk_flax.monte_carlo_kernels(model, x, key=keys[s], n_samples=1)
        for name in exact:
            one = np.asarray(getattr(k, name), np.float64)
            sums[name] += one
            sq[name] += rel(one, exact[name]) ** 2
        count, seconds = s + 1, time.perf_counter() - t0
        errs = {name: rel(sums[name] / count, exact[name]) for name in exact}
        for name, e in errs.items():
            if e <= 0.01 and name not in reached:
                reached[name] = {"samples": count, "seconds": seconds}
        if count & (count - 1) == 0 or seconds > cap_s or count == spec["max_samples"]:
            rows.append({"samples": count, "seconds": seconds, **errs})
            print(f"width {width}: {rows[-1]}", file=sys.stderr, flush=True)
        if seconds > cap_s or len(reached) == len(exact):
            if rows[-1]["samples"] != count:
                rows.append({"samples": count, "seconds": seconds, **errs})
            break
    return {
        "width": width,
        "derived_first_call_s": derived_s,
        "rows": rows,
        "reached_1pct": reached,
        "single_sample_rms_error": {k: math.sqrt(v / count) for k, v in sq.items()},
        "loadavg_after": harness.load(),
        "machine": harness.machine(),
    }


# --- part 3: convergence with width -------------------------------------------------


def mlp_family(framework, custom, width):
    """(kernel_fn of the derived kernel, mc(x, key, n) -> Kernels) of a ReLU MLP with two
    hidden layers of ``width`` (8 inputs, 1 output) of ``framework``, default or custom
    initialisers."""
    import jax

    if framework == "flax":
        import flax.linen as nn

        import ntk_flax

        kw = {}
        if custom:  # He normal weights, N(0, 0.1²) biases
            kw = {
                "kernel_init": nn.initializers.he_normal(),
                "bias_init": nn.initializers.normal(0.1),
            }

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x):
                x = nn.relu(nn.Dense(width, **kw)(x))
                x = nn.relu(nn.Dense(width, **kw)(x))
                return nn.Dense(1, **kw)(x)

        model = MLP()

        def derived(x):
            return ntk_flax.infinite_kernel_fn(model, model.init(jax.random.PRNGKey(0), x[:1]))

        def mc(x, key, n):
            return ntk_flax.monte_carlo_kernels(model, x, key=key, n_samples=n)

        return derived, mc
    if framework == "haiku":
        import haiku as hk

        import ntk_haiku

        kw = {}
        if custom:  # VarianceScaling(2) (truncated normal, corrected), N(0, 0.1²) biases
            kw = {
                "w_init": hk.initializers.VarianceScaling(2.0),
                "b_init": hk.initializers.RandomNormal(0.1),
            }
        net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([width, width, 1], **kw)(x)))

        def derived(x):
            return ntk_haiku.infinite_kernel_fn(net, net.init(jax.random.PRNGKey(0), x[:1]))

        def mc(x, key, n):
            return ntk_haiku.monte_carlo_kernels(net, x, key=key, n_samples=n)

        return derived, mc
    import equinox as eqx

    import ntk_equinox

    def make(key):
        k0, k1 = jax.random.split(key)
        m = eqx.nn.MLP(8, 1, width, 2, activation=jax.nn.relu, key=k0)
        if not custom:
            return m
        # N(0, 2 / fan_in) weights and N(0, 0.1²) biases put in with eqx.tree_at: no
        # trace left in the model, so the derived kernel is given W_std and b_std
        ks = jax.random.split(k1, 2 * len(m.layers))
        new_w = [
            jax.random.normal(ks[2 * i], lin.weight.shape) * (2.0 / lin.weight.shape[1]) ** 0.5
            for i, lin in enumerate(m.layers)
        ]
        new_b = [
            0.1 * jax.random.normal(ks[2 * i + 1], lin.bias.shape) for i, lin in enumerate(m.layers)
        ]
        m = eqx.tree_at(lambda m: [lin.weight for lin in m.layers], m, new_w)
        return eqx.tree_at(lambda m: [lin.bias for lin in m.layers], m, new_b)

    priors = {"W_std": 2**0.5, "b_std": 0.1} if custom else {}

    def derived(x):
        return ntk_equinox.infinite_kernel_fn(make(jax.random.PRNGKey(0)), **priors)

    def mc(x, key, n):
        return ntk_equinox.monte_carlo_kernels(make, x, key=key, n_samples=n)

    return derived, mc


def measure_width(spec):
    import jax
    import numpy as np

    x = np.random.RandomState(50).randn(16, 8).astype(np.float32)
    derived, mc = mlp_family(spec["framework"], spec["custom"], spec["width"])
    t0 = time.perf_counter()
    exact = derived(x)(x, None)
    exact = {k: np.asarray(getattr(exact, k), np.float64) for k in ("nngp", "ntk")}
    derived_s = time.perf_counter() - t0
    half = spec["samples"] // 2
    t0 = time.perf_counter()
    a = mc(x, jax.random.PRNGKey(1), half)
    b = mc(x, jax.random.PRNGKey(2), half)
    mc_s = time.perf_counter() - t0
    out = {"derived_s": derived_s, "mc_s": mc_s, "loadavg_after": harness.load()}
    for name in exact:
        ka, kb = (np.asarray(getattr(k, name), np.float64) for k in (a, b))
        out[name] = {
            "error": rel((ka + kb) / 2, exact[name]),
            "sampling": float(np.linalg.norm(ka - kb) / 2 / np.linalg.norm(exact[name])),
        }
    return out


def measure(spec):
    return {"timing": measure_timing, "mc": measure_mc, "width": measure_width}[spec["part"]](spec)


# --- the driver ---------------------------------------------------------------------


def load_results(path):
    return json.load(open(path)) if os.path.exists(path) else {}


def record(args, key, spec, result):
    results = load_results(args.out)
    result["started_utc"] = result.get("machine", {}).get("date_utc") or harness_date()
    entry = results.setdefault(key, {"spec": spec, "runs": []})
    entry["runs"].append(result)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)


def harness_date():
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def run_timing(args):
    sizes = dict(kv.split("=") for kv in args.n)
    for _ in range(args.rounds):
        for case in args.cases:
            for dtype in args.dtype:
                for side in SIDES[case]:
                    if args.sides and side not in args.sides:
                        continue
                    n = int(sizes.get(case, N_DEFAULT[case]))
                    spec = {
                        "part": "timing", "case": case, "side": side, "n": n, "dtype": dtype,
                        "kernel_dir": args.kernel_dir,
                    }  # fmt: skip
                    load = harness.load()
                    result = harness.run_worker(
                        __file__,
                        spec,
                        timeout_s=args.timeout_s,
                        kill_bytes=args.kill_gib * harness.GIB,
                    )
                    result.setdefault("loadavg_before", load)
                    record(args, key_of(spec), spec, result)
                    if "error" in result:
                        print(f"{key_of(spec)}: {result['error']}", flush=True)
                    else:
                        print(
                            f"{key_of(spec)}: first {result['first_call_s']:.3f} s, warm "
                            f"{result['warm_s']:.4f} s, peak {result['peak_rss_bytes'] / 2**20:.0f}"
                            f" MiB (baseline {result['baseline_rss_bytes'] / 2**20:.0f}), load "
                            f"{result['loadavg_before'][0]}-{result['loadavg_after'][0]}",
                            flush=True,
                        )


def run_mc(args):
    for width in args.widths:
        spec = {"part": "mc", "width": width, "cap_s": args.cap_s, "max_samples": args.max_samples}
        result = harness.run_worker(
            __file__, spec, timeout_s=args.cap_s + 600, kill_bytes=args.kill_gib * harness.GIB
        )
        record(args, f"mc_c3_w{width}", spec, result)
        print(f"mc width {width}: {json.dumps(result)[:600]}", flush=True)


def run_width(args):
    for framework in args.frameworks:
        for custom in (False, True):
            for width in args.widths:
                spec = {
                    "part": "width", "framework": framework, "custom": custom, "width": width,
                    "samples": args.samples,
                }  # fmt: skip
                result = harness.run_worker(
                    __file__, spec, timeout_s=args.timeout_s, kill_bytes=args.kill_gib * harness.GIB
                )
                tag = "custom" if custom else "default"
                key = f"width_{framework}_{tag}_w{width}_s{args.samples}"
                record(args, key, spec, result)
                print(f"{key}: {json.dumps(result)}", flush=True)


# --- the report ---------------------------------------------------------------------


def best(entry):
    ok = [r for r in entry["runs"] if "first_call_s" in r]
    if not ok:
        return None
    loads = [v for r in ok for v in (r["loadavg_before"][0], r["loadavg_after"][0])]
    return {
        "first": [r["first_call_s"] for r in ok],
        "warm": [r["warm_s"] for r in ok],
        "peak_mib": min(r["peak_rss_bytes"] for r in ok) / 2**20,
        "load": (min(loads), max(loads)),
        "kernels": ok[-1]["kernels"],
    }


def max_rel_diff(path_a, path_b):
    import numpy as np

    a, b = np.load(path_a), np.load(path_b)
    return {k: float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(b[k]))) for k in ("nngp", "ntk")}


def report(args):
    import numpy as np

    results = load_results(args.out)
    print("| network | dtype | N | side | first call s (runs) | warm s (runs) | peak MiB | "
          "derived / this side, fastest warm | max rel. diff nngp / ntk | load |")  # fmt: skip
    print("| --- " * 10 + "|")
    for case in SIDES:
        for dtype in ("float32", "float64"):
            for n in sorted(
                {e["spec"]["n"] for e in results.values() if e["spec"].get("case") == case}
            ):
                keys = {side: f"timing_{case}_{side}_n{n}_{dtype}" for side in SIDES[case]}
                got = {s: best(results[k]) for s, k in keys.items() if k in results}
                d = got.get("derived")
                for side, b in got.items():
                    if b is None:
                        why = results[keys[side]]["runs"][-1].get("error", "?")[:60]
                        print(f"| {case} | {dtype} | {n} | {side} | {why} | | | | | |")
                        continue
                    ratio = diff = ""
                    if d and side != "derived":
                        r = min(d["warm"]) / min(b["warm"])
                        ratio = f"{r:.2f} ({'met' if r <= 1.1 else '**not met**'})"
                        diff = " / ".join(
                            f"{v:.1e}" for v in max_rel_diff(d["kernels"], b["kernels"]).values()
                        )
                    print(
                        f"| {case} | {dtype} | {n} | {side} | "
                        + ", ".join(f"{v:.3g}" for v in b["first"])
                        + " | "
                        + ", ".join(f"{v:.3g}" for v in b["warm"])
                        + f" | {b['peak_mib']:.0f} | {ratio} | {diff} | "
                        f"{b['load'][0]:.1f}-{b['load'][1]:.1f} |"
                    )
    print()
    for key, entry in results.items():
        if not key.startswith("mc_"):
            continue
        r = entry["runs"][-1]
        if "rows" not in r:
            print(f"{key}: {r.get('error')}")
            continue
        rms = r["single_sample_rms_error"]
        print(
            f"**{key}** (derived kernel {r['derived_first_call_s']:.2f} s; single-sample "
            f"rms error nngp {rms['nngp']:.3f}, ntk {rms['ntk']:.3f}; 1 % first reached: "
            f"{r['reached_1pct'] or 'no'})"
        )
        print("| samples | seconds | nngp error | ntk error |\n| --- | --- | --- | --- |")
        for row in r["rows"]:
            cells = (
                f"{row['samples']} | {row['seconds']:.1f} | {row['nngp']:.4f} | {row['ntk']:.4f}"
            )
            print(f"| {cells} |")
        print()
    table = {}
    for key, entry in results.items():
        if key.startswith("width_") and "ntk" in entry["runs"][-1]:
            s = entry["spec"]
            table.setdefault((s["framework"], s["custom"], s["samples"]), {})[s["width"]] = entry[
                "runs"
            ][-1]
    widths = sorted({w for v in table.values() for w in v})
    print("| model | S | " + " | ".join(f"width {w}: ntk (sampling) / nngp" for w in widths)
          + " | slope of log ntk error |")  # fmt: skip
    print("| --- " * (len(widths) + 3) + "|")
    for (fw, custom, samples), row in sorted(table.items()):
        ws = sorted(row)
        slope = np.polyfit(np.log(ws), np.log([row[w]["ntk"]["error"] for w in ws]), 1)[0]
        cells = [
            f"{row[w]['ntk']['error']:.4f} ({row[w]['ntk']['sampling']:.4f}) / "
            f"{row[w]['nngp']['error']:.3f}"
            if w in row
            else "-"
            for w in widths
        ]
        name = f"{fw} {'custom' if custom else 'default'}"
        print(f"| {name} | {samples} | " + " | ".join(cells) + f" | {slope:.2f} |")


def main(argv=None):
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return harness.worker_main(measure)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("timing", "mc", "width", "report"))
    parser.add_argument("--cases", nargs="+", default=list(SIDES), choices=list(SIDES))
    parser.add_argument("--sides", nargs="*", default=[])
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=("float32", "float64"))
    parser.add_argument("--n", nargs="*", default=[], help="case=N, e.g. cnn21=256")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--widths", nargs="+", type=int)
    parser.add_argument("--cap-s", type=float, default=180.0)
    parser.add_argument("--max-samples", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--frameworks", nargs="+", default=["flax", "haiku", "equinox"])
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--kill-gib", type=float, default=12.0)
    parser.add_argument("--kernel-dir", default=KERNEL_DIR)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    if args.part == "timing":
        return run_timing(args)
    if args.part == "mc":
        args.widths = args.widths or [511, 2048]
        return run_mc(args)
    if args.part == "width":
        args.widths = args.widths or list(WIDTHS)
        return run_width(args)
    return report(args)


if __name__ == "__main__":
    main()
