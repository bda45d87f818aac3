"""Statistics of an NTK too big to form (ntk_core.spectrum's matrix-free estimates): time, memory.

    python benchmarks/bench_matrix_free.py                   # N = 20 000
    python benchmarks/bench_matrix_free.py --n 500 --check   # also the exact kernel, compared

The model is ``cases.py``'s "mlp-small", MLP 784-192-10 (ReLU, P = 153 k, weights
N(0, 1/fan_in), zero biases), float32, inputs N(0, I) (seed 1). Its kernel with
``trace_axes=()`` is (N·10) x (N·10): 160 GB at N = 20 000, so it is never formed. Measured
in this one process: the exact trace (``spectrum.ntk_trace``, ``--trace-batch-size``), and
``spectrum.ntk_frobenius_sq`` with ``--m`` products (first call: validation, trace, compile,
run; then a warm call with another key); peak resident memory (``VmHWM``) at the end.
``--check`` (small N only) also forms the kernel and reports the estimate's error in units
of its standard error. Results: one JSON line on stdout. Never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import cases  # noqa: E402

import ntk_core  # noqa: E402
from ntk_core import spectrum  # noqa: E402


def _peak_mb() -> float:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1e3
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--m", type=int, default=30)
    ap.add_argument("--trace-batch-size", type=int, default=1000)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    case = cases.CASES["mlp-small"]
    keys = jax.random.split(jax.random.PRNGKey(0), len(case.widths) - 1)
    params = {
        f"Dense_{i}": {
            "kernel": jax.random.normal(k, (a, b)) / np.sqrt(a),
            "bias": jnp.zeros(b),
        }
        for i, (k, a, b) in enumerate(zip(keys, case.widths[:-1], case.widths[1:], strict=True))
    }
    apply_fn = lambda p, x: cases.mlp({"params": p}, x)  # noqa: E731
    x = jnp.asarray(cases.make_inputs(case, args.n))
    row = {"n": args.n, "m": args.m, "p": cases.n_params(params), "load": os.getloadavg()[0]}
    t = time.perf_counter()
    row["trace"] = spectrum.ntk_trace(apply_fn, params, x, batch_size=args.trace_batch_size)
    row["trace_s"] = time.perf_counter() - t
    for name, seed in (("first", 0), ("warm", 1)):
        t = time.perf_counter()
        est = spectrum.ntk_frobenius_sq(apply_fn, params, x, key=jax.random.PRNGKey(seed), m=args.m)
        row[f"frobenius_{name}_s"] = time.perf_counter() - t
        row[f"frobenius_sq_{name}"] = est._asdict()
    if args.check:
        theta = ntk_core.empirical_ntk(apply_fn, params, x, trace_axes=())
        exact = float(np.sum(np.square(np.asarray(theta, np.float64))))
        row["frobenius_sq_exact"] = exact
        row["z"] = [
            (row[f"frobenius_sq_{s}"]["estimate"] - exact)
            / row[f"frobenius_sq_{s}"]["standard_error"]
            for s in ("first", "warm")
        ]
    row["peak_mb"] = _peak_mb()
    row["load_after"] = os.getloadavg()[0]
    print(json.dumps(row))


if __name__ == "__main__":
    main()
