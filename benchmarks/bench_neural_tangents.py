"""Times neural-tangents 0.6.5 on the cases of ``bench_core.py`` (never a dependency).

Runs in neural-tangents' own environment (Python 3.11, jax 0.4.23, no Flax), on the
plain-JAX twins of ``cases.py`` with the parameters and inputs ``bench_core.py``
wrote to ``--data-dir`` (run that first). For each case and each of neural-tangents'
implementations (Jacobian contraction, NTK-vector products, structured derivatives),
one worker process measures trace+lower, compile and warm run of
``jax.jit(empirical_ntk_fn(...))`` on the Gram matrix of the N inputs (``x2=None``) and
its peak resident memory, as ``harness.py`` describes. Measurements whose estimate
(written by ``bench_core.py``) passes the limits are skipped. Writes
``results_neural_tangents.json``; ``report.py`` puts it next to ours.

    /tmp/ntvenv/bin/python benchmarks/bench_neural_tangents.py [--cases mlp1 lenet] [--n 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cases  # noqa: E402
import harness  # noqa: E402
import jax  # noqa: E402

IMPLEMENTATIONS = {
    "jacobian": "JACOBIAN_CONTRACTION",
    "ntvp": "NTK_VECTOR_PRODUCTS",
    "structured": "STRUCTURED_DERIVATIVES",
}
DEFAULT_DATA_DIR = "/tmp/ntk-jax-bench"


def measure(spec):
    import neural_tangents as nt

    case = cases.CASES[spec["case"]]
    variables, x, _ = cases.load_case(spec["data_dir"], case, spec["n"])
    params, rest = cases.split_variables(variables)
    model = cases.plain_apply(case)

    def apply(p, xs):
        return model({"params": p, **rest}, xs)

    impl = getattr(nt.NtkImplementation, IMPLEMENTATIONS[spec["implementation"]])
    ntk = nt.empirical_ntk_fn(apply, trace_axes=case.trace_axes, vmap_axes=0, implementation=impl)
    fn = jax.jit(lambda p, a: ntk(a, None, p))
    result = harness.time_jitted(fn, (params, x))
    result["neural_tangents"] = nt.__version__
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(cases.CASES), choices=list(cases.CASES))
    parser.add_argument("--n", type=int, help="N for every case (default: each case's own)")
    parser.add_argument(
        "--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=list(IMPLEMENTATIONS)
    )
    parser.add_argument("--max-est-s", type=float, default=15.0)
    parser.add_argument("--max-est-gib", type=float, default=6.0)
    parser.add_argument("--kill-gib", type=float, default=12.0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--skip-rate-gflops",
        type=float,
        help="FLOP/s (in GFLOP/s) that --max-est-s assumes (default: the matmul rate "
        "measured at the start; pin it to make the skips independent of the load)",
    )
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default=os.path.join(HERE, "results_neural_tangents.json"))
    args = parser.parse_args(argv)

    import neural_tangents as nt

    meta = harness.machine()
    meta["neural_tangents"] = nt.__version__
    meta["matmul_flops_per_s_start"] = rate = harness.matmul_rate()
    skip_rate = args.skip_rate_gflops * 1e9 if args.skip_rate_gflops else rate
    meta["limits"] = {
        **{k: getattr(args, k) for k in ("max_est_s", "max_est_gib", "kill_gib", "timeout_s")},
        "skip_rate_flops_per_s": skip_rate,
    }
    print(meta, flush=True)
    results = []
    started = time.time()
    for key in args.cases:
        case = cases.CASES[key]
        n = args.n or case.n
        npz, meta_path = cases.case_paths(args.data_dir, key, n)
        if not os.path.exists(npz):
            print(f"{key} N={n}: no data in {args.data_dir}; run bench_core.py first")
            continue
        _, _, info = cases.load_case(args.data_dir, case, n)
        row = {"case": key, "title": case.title, "N": n, "trace_axes": list(case.trace_axes)}
        for impl in args.implementations:
            estimate = info.get("nt", {}).get(impl)
            reason = harness.skip_reason(
                estimate, skip_rate, args.max_est_s, args.max_est_gib * harness.GIB
            )
            if reason:
                row[impl] = {"skipped": reason, "loadavg": harness.load()}
            else:
                spec = {"case": key, "n": n, "implementation": impl, "data_dir": args.data_dir}
                row[impl] = harness.run_worker(
                    __file__, spec, timeout_s=args.timeout_s, kill_bytes=args.kill_gib * harness.GIB
                )
            print(f"{key} N={n} {impl}: {json.dumps(row[impl])[:300]}", flush=True)
        results.append(row)
    meta["matmul_flops_per_s_end"] = harness.matmul_rate()
    meta["matmul_flops_per_s"] = max(rate, meta["matmul_flops_per_s_end"])
    meta["loadavg_end"] = harness.load()
    meta["wall_s"] = time.time() - started
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1)
    print(f"wrote {args.out} ({meta['wall_s']:.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        harness.worker_main(measure)
    else:
        main()
