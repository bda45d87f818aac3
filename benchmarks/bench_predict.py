"""Kernel regression with host kernels: time and peak memory of ``ntk_core.predict``.

    python benchmarks/bench_predict.py [--n 20000] [--t 1000] [--dir /tmp/ntk_bench_predict]

Writes a synthetic PSD kernel (RBF, exp(−|x − x'|² / (2·d)), of N training and T test
points drawn N(0, I_d), d = 8, float32) as ``.npy`` files, then, for each compute dtype,
runs in a fresh subprocess: ``gp_inference`` on the read-only memory-mapped train-train
kernel (checks, factorisation, refined solve for y), the posterior mean at T test
points, and the variances at the first T_var = 500 of them (a per-sample test-test
diagonal). Reports wall time per phase, the refinement steps of the solves, the
subprocess's peak RSS (file-backed pages of the memory map included), the kernel's and
the factor's sizes, and ``os.getloadavg()`` before and after (the machine is shared).
Results: ``results_predict.json`` and a markdown table on stdout. No jax array is
created: the solve is numpy/LAPACK on the host.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import subprocess
import sys
import time

import numpy as np

D = 8
T_VAR = 500


def write_kernels(directory: pathlib.Path, n: int, t: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / f"kxx_{n}.npy").exists() and (directory / f"ktx_{n}_{t}.npy").exists():
        return
    rng = np.random.default_rng(0)
    x, xt = rng.standard_normal((n, D)), rng.standard_normal((t, D))
    y = np.sin(x.sum(1, keepdims=True)) + 0.1 * rng.standard_normal((n, 1))
    np.save(directory / f"y_{n}.npy", y.astype(np.float32))

    def rbf(a, b):
        d2 = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T
        return np.exp(-np.maximum(d2, 0) / (2 * D)).astype(np.float32)

    kxx = np.lib.format.open_memmap(directory / f"kxx_{n}.npy", "w+", np.float32, (n, n))
    for s in range(0, n, 1000):
        kxx[s : s + 1000] = rbf(x[s : s + 1000], x)
    # exactly symmetric: the float32 rounding of the same value in both triangles
    kxx.flush()
    del kxx
    np.save(directory / f"ktx_{n}_{t}.npy", rbf(xt, x))
    np.save(directory / f"ktt_{t}.npy", np.ones(t, np.float32))  # RBF: k(x, x) = 1


def run_one(directory: pathlib.Path, n: int, t: int, dtype: str) -> dict:
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    from ntk_core import predict

    import_s = time.perf_counter() - t0
    kxx = np.load(directory / f"kxx_{n}.npy", mmap_mode="r")
    ktx = np.load(directory / f"ktx_{n}_{t}.npy", mmap_mode="r")
    ktt = np.load(directory / f"ktt_{t}.npy")
    y = np.load(directory / f"y_{n}.npy")
    t0 = time.perf_counter()
    post = predict.gp_inference(kxx, y, diag_reg=1e-3, dtype=None if dtype == "auto" else dtype)
    fit_s = time.perf_counter() - t0
    solver = post._train["nngp"].solver  # private: a diagnostic only
    steps_y = solver.steps
    t0 = time.perf_counter()
    mean, _ = post.nngp(ktx)
    mean_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, var = post.nngp(ktx[:T_VAR], ktt[:T_VAR])
    var_s = time.perf_counter() - t0
    steps_var = solver.steps
    assert np.isfinite(mean).all() and np.all(var >= 0) and np.all(var <= 1)
    import jax

    return dict(
        n=n,
        t=t,
        t_var=min(T_VAR, t),
        dtype=str(post.dtype),
        method=post.method,
        import_s=round(import_s, 2),
        fit_s=round(fit_s, 2),
        mean_s=round(mean_s, 2),
        var_s=round(var_s, 2),
        refinement_steps_y=steps_y,
        refinement_steps_var=steps_var,
        peak_rss_gb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        kernel_gb=round(kxx.nbytes / 2**30, 2),
        factor_gb=round(n * n * post.dtype.itemsize / 2**30, 2),
        jax_arrays_live=len(jax.live_arrays()),
        load_before=[round(v, 2) for v in load_before],
        load_after=[round(v, 2) for v in os.getloadavg()],
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--t", type=int, default=1000)
    parser.add_argument("--dir", default="/tmp/ntk_bench_predict")
    parser.add_argument("--dtypes", default="auto,float64")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    directory = pathlib.Path(args.dir)
    if args.run:
        print(json.dumps(run_one(directory, args.n, args.t, args.run)))
        return
    t0 = time.perf_counter()
    write_kernels(directory, args.n, args.t)
    print(f"kernels written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    results = []
    for dtype in args.dtypes.split(","):
        cmd = [sys.executable, __file__, "--n", str(args.n), "--t", str(args.t)]
        cmd += ["--dir", str(directory), "--run", dtype]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(results[-1], file=sys.stderr)
    import jax

    meta = dict(
        jax=jax.__version__,
        numpy=np.__version__,
        machine=platform.machine(),
        cpus=os.cpu_count(),
        date=time.strftime("%Y-%m-%d"),
    )
    path = pathlib.Path(__file__).with_name("results_predict.json")
    path.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    print(f"jax {meta['jax']}, numpy {meta['numpy']}, {meta['cpus']} cpus, {meta['date']}\n")
    print(
        "| N | T (mean) | T (var) | dtype | solver | fit s | mean s | variances s | refinement "
        "steps (y, var) | peak RSS GB | kernel GB | factor GB | load avg before → after |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['n']} | {r['t']} | {r['t_var']} | {r['dtype']} | {r['method']} | "
            f"{r['fit_s']} | {r['mean_s']} | {r['var_s']} | {r['refinement_steps_y']}, "
            f"{r['refinement_steps_var']} | {r['peak_rss_gb']} | "
            f"{r['kernel_gb']} | {r['factor_gb']} | {r['load_before']} → {r['load_after']} |"
        )


if __name__ == "__main__":
    main()
