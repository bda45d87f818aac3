"""Parameter subsets (``wrt=``): time of the kernel against the subset's size.

    PYTHONPATH=src python benchmarks/bench_wrt.py [--case resnet] [--n 64] [--repeats 3]

The case's model (``cases.py``; default the ResNet-style CNN with BatchNorm in evaluation
mode, P = 78 k) and N inputs; for each subset (all parameters, the last residual block
and the head, the biases and BatchNorm shifts, the head alone) and each implementation,
one process measures the first call (trace, compile, run) and the median of
``--repeats`` warm calls of ``ntk_core.empirical_ntk(..., wrt=subset)``, x2=None, float32,
and checks that the subsets' kernels of a partition (head + the rest) sum to the whole
kernel. Writes ``results_wrt.json`` and a markdown table. Never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cases  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_core import apply_fn, init_variables  # noqa: E402

import ntk_core  # noqa: E402


def subsets(params) -> dict:
    """name -> wrt predicate on the key path (a tuple of keys)."""
    blocks = sorted(k for k in params if k.startswith("ResBlock"))
    last, head = blocks[-1] if blocks else None, "Dense_0"
    return {
        "all": None,
        f"{last} + head": lambda path: path[0] in (last, head),
        "biases and BatchNorm shifts": lambda path: path[-1] == "bias",
        "head only": lambda path: path[0] == head,
        "all but the head": lambda path: path[0] != head,
    }


def size(params, wrt) -> int:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    keys = [(tuple(getattr(k, "key", k) for k in p), v) for p, v in leaves]
    return sum(int(np.size(v)) for p, v in keys if wrt is None or wrt(p))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="resnet")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--implementations", nargs="+", default=["structured", "jacobian"])
    parser.add_argument("--out", default=os.path.join(HERE, "results_wrt.json"))
    args = parser.parse_args(argv)
    case = cases.CASES[args.case]
    variables = init_variables(case)
    params = variables["params"]
    f = apply_fn(case, variables)
    x = jax.numpy.asarray(cases.make_inputs(case, args.n))
    rows, kernels = [], {}
    for implementation in args.implementations:
        for name, wrt in subsets(params).items():
            options = dict(trace_axes=case.trace_axes, implementation=implementation, wrt=wrt)
            kernel_fn = ntk_core.ntk_fn(f, **options)
            start = time.perf_counter()
            k = np.asarray(kernel_fn(params, x))
            first = time.perf_counter() - start
            warm = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                jax.block_until_ready(kernel_fn(params, x))
                warm.append(time.perf_counter() - start)
            kernels[implementation, name] = k
            row = dict(implementation=implementation, subset=name, parameters=size(params, wrt))
            row |= dict(first_s=first, warm_s=statistics.median(warm))
            rows.append(row)
            print(json.dumps(row), flush=True)
        whole = kernels[implementation, "all"]
        parts = kernels[implementation, "head only"] + kernels[implementation, "all but the head"]
        error = float(np.abs(parts - whole).max() / np.abs(whole).max())
        print(f"{implementation}: head + rest vs all, relative error {error:.2e}", flush=True)
        rows.append(dict(implementation=implementation, partition_relative_error=error))
    meta = dict(
        case=case.title,
        n=args.n,
        jax=jax.__version__,
        cpus=os.cpu_count(),
        load=os.getloadavg()[0],
        machine=platform.platform(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    with open(args.out, "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    print(f"\n{case.title}, N = {args.n}, {meta['date']}, load {meta['load']:.1f}")
    print("| implementation | subset | parameters | first call (s) | warm (s) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        if "subset" in r:
            print(
                f"| {r['implementation']} | {r['subset']} | {r['parameters']:,} | "
                f"{r['first_s']:.2f} | {r['warm_s']:.3f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
