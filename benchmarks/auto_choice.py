"""Issue 51: ``"auto"``'s choice against each implementation, and the cost model per platform.

``issue``: plan() of issue 51's accelerator cases, computed here (nothing compiled or
run), with the rates of ``--rates`` (``_impl/cost.RATES``: cpu, tpu, gpu): each
implementation's estimate in one call and in tiles, what ``"auto"`` takes, beside the
warm times the issue measured on one TPU v5e (HIGHEST). The figures that calibrated the
"tpu" rates (``_impl/cost.py``'s comment above ``RATES``).

``cpu``: on this machine, for small versions of the ``benchmarks/`` cases the cost model
is checked on (``plan_accuracy.py``), each implementation's warm time (best of 3, after
one call that compiles) and ``"auto"``'s choice: its warm time over the fastest one's
(issue 51: within 2x). One process; cases and N kept small for a shared 2-core CPU.

``device``: on a GPU or TPU, the issue's ViT with ``"auto"``: plan, first and warm call.

    python benchmarks/auto_choice.py issue --rates tpu
    python benchmarks/auto_choice.py cpu [--cases mlp1 lenet ...]
    python benchmarks/auto_choice.py device
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

#: Issue 51's warm times on one TPU v5e (seconds; HIGHEST; implementation measured).
TPU_MEASURED = {
    "fcn": ("structured", 1.65e-3),
    "mlp10k": ("structured", 28.9e-3),
    "lenet500": ("structured", 5.0e-3),  # 1 output (compile_anatomy.py, 10 logits: 29.5 ms)
    "resnet18-224": ("structured", 117e-3),
    "vit": ("structured", 0.267),  # 2026-12-07 19:54 UTC (before: ntvp 12.1 s, in the issue)
}


def _dense_net(widths, seed=0):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), len(widths))
    params = [
        {"w": jax.random.normal(k, (a, b)) / a**0.5, "b": jnp.zeros(b)}
        for k, a, b in zip(keys, widths[:-1], widths[1:], strict=False)
    ]

    def apply(p, x):
        for i, layer in enumerate(p):
            x = x @ layer["w"] + layer["b"]
            x = jax.nn.relu(x) if i < len(p) - 1 else x
        return x

    return apply, params


def _flax_case(key, n, size=32, **constants):
    """(apply, params, x) of a ``cases.py`` case through its Flax module, with some of
    ``cases``' module constants changed (the ViT's depth and width) and inputs of
    ``size`` x ``size`` x 3."""
    import bench_core
    import cases
    import numpy as np

    for name, value in constants.items():
        setattr(cases, name, value)
    case = cases.CASES[key]
    variables = bench_core.init_variables(case)
    params, _ = cases.split_variables(variables)
    apply = bench_core.apply_fn(case, variables)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, size, size, 3), dtype=np.float32)
    return apply, params, x, case.trace_axes


def issue_cases():
    """name -> (apply, params, x1, options): issue 51's accelerator cases."""
    import numpy as np

    rng = np.random.default_rng(0)
    found = {}
    apply, params = _dense_net((3072, 2048, 2048, 2048, 8))
    found["fcn"] = (apply, params, rng.standard_normal((16, 3072), np.float32), ())
    apply, params = _dense_net((784, 1000, 1))
    found["mlp10k"] = (apply, params, rng.standard_normal((10000, 784), np.float32), ())
    apply, params, x, _ = _flax_case("lenet", 500)
    found["lenet500"] = (apply, params, x, ())
    # 224 x 224 inputs; 10 logits where the issue's had 8 (its estimate ~10/8 high)
    apply, params, x, _ = _flax_case("resnet18", 8, size=224)
    found["resnet18-224"] = (apply, params, x, ())
    found["vit"] = issue_cases_vit()
    return found


def run_issue(rates: str) -> list[dict]:
    import ntk_core
    from ntk_core._impl import cost as _cost

    _cost.rates_for = lambda backend=None: _cost.RATES[rates]  # the platform's rates here
    if rates == "tpu":  # the tiles' budget there: half the v5e's 15.7 GiB, as on the chip
        import ntk_core._blocked as _blocked

        _blocked.default_memory_budget = lambda: int(15.75 * 2**30) // 2
        from ntk_core._kernel import planner  # and one call's limit there: half, too

        planner.one_call_limit = lambda tree: int(15.75 * 2**30) // 2
    rows = []
    for name, (apply, params, x, trace_axes) in issue_cases().items():
        plan = ntk_core.ntk_fn(apply, trace_axes=trace_axes).plan(params, x)
        measured_impl, measured_s = TPU_MEASURED[name]
        row = {
            "case": name,
            "n": int(x.shape[0]),
            "auto": plan.implementation,
            "auto_in_tiles": plan.in_tiles is not None,
            "estimates": {
                e.implementation: {
                    "one_call_s": e.seconds,
                    "one_call_bytes": e.memory_bytes,
                    "tiled_s": e.tiled.seconds if e.tiled else None,
                }
                for e in plan.estimates
            },
            "tpu_measured": {measured_impl: measured_s},
        }
        est = row["estimates"][measured_impl]["one_call_s"]
        row["measured_over_estimate"] = measured_s / est
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


#: (case, N) of the CPU check: plan_accuracy.py's cases, smaller.
CPU_RUNS = [
    ("mlp1", 200),
    ("lenet", 64),
    ("mlp10", 200),
    ("mlp10-full", 100),
    ("resnet", 32),
    ("tokens", 128),
    ("eqx-cnn", 32),
    ("wholebatch", 16),
]


def _cpu_case(key, n):
    """(kernel_fn(implementation), args, label) of a CPU case."""
    import ntk_core

    if key.startswith("eqx-cnn"):
        import plan_accuracy

        import ntk_equinox

        model, x = plan_accuracy._eqx_cnn(key == "eqx-cnn", n)
        return lambda impl: ntk_equinox.kernel_fn(model, implementation=impl), (model, x)
    if key == "wholebatch":
        import jax
        import plan_accuracy

        apply, params, k = plan_accuracy._wholebatch()
        x = jax.random.normal(k, (n, 28, 28, 1))
        options = dict(trace_axes=(), vmap_axes=None)
        return lambda impl: ntk_core.ntk_fn(apply, implementation=impl, **options), (params, x)
    import bench_core
    import cases
    import jax.numpy as jnp

    case = cases.CASES[key]
    variables = bench_core.init_variables(case)
    params, _ = cases.split_variables(variables)
    apply = bench_core.apply_fn(case, variables)
    x = jnp.asarray(cases.make_inputs(case, n))
    trace_axes = case.trace_axes
    return lambda impl: ntk_core.ntk_fn(apply, implementation=impl, trace_axes=trace_axes), (
        params,
        x,
    )


def _warm(fn, args, repeats=3) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compiles
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def run_cpu(keys, max_estimate_s: float) -> list[dict]:
    rows = []
    for key, n in CPU_RUNS:
        if key not in keys:
            continue
        build, args = _cpu_case(key, n)
        auto = build("auto")
        plan = auto.plan(*args)
        warm = {}
        for e in plan.estimates:
            if e.seconds > max_estimate_s:  # too slow to measure here: its estimate said so
                warm[e.implementation] = None
                continue
            warm[e.implementation] = _warm(build(e.implementation), args)
        auto_s = _warm(auto, args)
        measured = {k: v for k, v in warm.items() if v is not None}
        fastest = min(measured, key=measured.get)
        row = {
            "case": key,
            "n": n,
            "auto": plan.implementation,
            "auto_in_tiles": plan.in_tiles is not None,
            "estimates_s": {e.implementation: e.seconds for e in plan.estimates},
            "warm_s": warm,
            "auto_warm_s": auto_s,
            "fastest": fastest,
            "auto_over_fastest": auto_s / measured[fastest],
            "load": open("/proc/loadavg").read().split()[:3],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows) -> str:
    names = ("structured", "jacobian", "ntvp")
    lines = [
        "| case | N | "
        + " | ".join(f"{n} est / warm s" for n in names)
        + " | auto | auto / fastest |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " | --- | --- |",
    ]
    for r in rows:
        cells = []
        for name in names:
            if name not in r["estimates_s"]:
                cells.append("-")
                continue
            w = r["warm_s"][name]
            cells.append(f"{r['estimates_s'][name]:.3g} / {'skipped' if w is None else f'{w:.3g}'}")
        auto = r["auto"] + (" (tiles)" if r["auto_in_tiles"] else "")
        lines.append(
            f"| {r['case']} | {r['n']} | "
            + " | ".join(cells)
            + f" | {auto} | {r['auto_over_fastest']:.2f} |"
        )
    return "\n".join(lines)


def run_device() -> dict:
    """On an accelerator: the issue's ViT at N = 128 with ``"auto"`` (its plan, with the
    platform's own rates and budget), first call and best of 2 warm calls."""
    import jax

    import ntk_core

    apply, params, x, trace_axes = issue_cases_vit()
    kernel = ntk_core.ntk_fn(apply, trace_axes=trace_axes)
    plan = kernel.plan(params, x)
    print(plan, flush=True)
    start = time.perf_counter()
    jax.block_until_ready(kernel(params, x))
    first = time.perf_counter() - start
    warm = []
    for _ in range(2):
        start = time.perf_counter()
        jax.block_until_ready(kernel(params, x))
        warm.append(time.perf_counter() - start)
    chosen = plan.in_tiles or next(
        e for e in plan.estimates if e.implementation == plan.implementation
    )
    row = {
        "device": str(jax.devices()[0].device_kind),
        "auto": plan.implementation,
        "in_tiles": plan.in_tiles is not None,
        "estimate_s": chosen.seconds,
        "first_s": first,
        "warm_s": min(warm),
    }
    print(json.dumps(row), flush=True)
    return row


def issue_cases_vit():
    """The issue's ViT (6 blocks, width 256) on 128 inputs of 32x32x3, traced."""
    apply, params, x, _ = _flax_case("vit", 128, VIT_BLOCKS=6, VIT_WIDTH=256)
    return apply, params, x, (-1,)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    issue = sub.add_parser("issue")
    issue.add_argument("--rates", default="tpu", choices=("cpu", "tpu", "gpu"))
    cpu = sub.add_parser("cpu")
    keys = [k for k, _ in CPU_RUNS]
    cpu.add_argument("--cases", nargs="+", default=keys, choices=keys)
    cpu.add_argument("--max-estimate-s", type=float, default=30.0)
    cpu.add_argument("--out", default=os.path.join(HERE, "results_auto_choice.json"))
    sub.add_parser("device")
    args = parser.parse_args(argv)
    if args.what == "issue":
        run_issue(args.rates)
        return
    if args.what == "device":
        run_device()
        return
    rows = run_cpu(args.cases, args.max_estimate_s)
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
