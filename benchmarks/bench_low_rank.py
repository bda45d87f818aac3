"""Low-rank kernel regression from features: time and peak memory of
``ntk_core.predict.low_rank_inference`` on a memory-mapped float32 ``.npy``.

    python benchmarks/bench_low_rank.py [--n 100000] [--k 512] [--m 10000] [--dir DIR]

Writes features Φ (N, k), float32, with a decaying spectrum (Gaussian rows scaled by
1/√(1 + j/16) per column j, as a sketch of a kernel with decaying eigenvalues), targets
y = Φ w + noise (N, O = 10) and test features (M, k). A fresh subprocess then runs
``low_rank_inference(np.load(..., mmap_mode="r"), y, diag_reg=1e-3)`` ("fit": one pass
over Φ, the eigenvalue check and the Cholesky of the k x k matrix), the posterior mean at
M test points and their variances, and reports wall time per phase and the subprocess's
peak RSS (``resource.getrusage``; the memory map's resident pages included). The parent
checks the fitted weights against the normal equations summed independently in float64.
Results: ``results_low_rank.json`` and a markdown table on stdout.
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

N_OUT = 10
CHUNK = 10_000


def write_data(directory: pathlib.Path, n: int, k: int, m: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / f"phi_{n}_{k}.npy").exists() and (directory / f"test_{m}_{k}.npy").exists():
        return
    rng = np.random.default_rng(0)
    scale = (1.0 / np.sqrt(1.0 + np.arange(k) / 16)).astype(np.float32)
    w = rng.standard_normal((k, N_OUT)).astype(np.float32)
    phi = np.lib.format.open_memmap(directory / f"phi_{n}_{k}.npy", "w+", np.float32, (n, k))
    y = np.empty((n, N_OUT), np.float32)
    for s in range(0, n, CHUNK):
        block = rng.standard_normal((min(CHUNK, n - s), k), np.float32) * scale
        phi[s : s + len(block)] = block
        y[s : s + len(block)] = block @ w + 0.1 * rng.standard_normal((len(block), N_OUT))
    phi.flush()
    del phi
    np.save(directory / f"y_{n}.npy", y)
    np.save(directory / f"test_{m}_{k}.npy", rng.standard_normal((m, k), np.float32) * scale)


def run_one(directory: pathlib.Path, n: int, k: int, m: int) -> dict:
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    from ntk_core import predict

    import_s = time.perf_counter() - t0
    phi = np.load(directory / f"phi_{n}_{k}.npy", mmap_mode="r")
    test = np.load(directory / f"test_{m}_{k}.npy", mmap_mode="r")
    y = np.load(directory / f"y_{n}.npy")
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    t0 = time.perf_counter()
    post = predict.low_rank_inference(phi, y, diag_reg=1e-3)
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    mean, _ = post.posterior(test)
    mean_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, var = post.posterior(test, variance=True)
    var_s = time.perf_counter() - t0
    assert np.isfinite(mean).all() and np.all(var >= 0)
    np.save(directory / "weights.npy", post.weights)
    return dict(
        n=n,
        k=k,
        o=N_OUT,
        m=m,
        import_s=round(import_s, 2),
        fit_s=round(fit_s, 2),
        mean_s=round(mean_s, 2),
        var_s=round(var_s, 2),
        regularizer=post.regularizer,
        rss_after_import_mb=round(rss_start),
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10),
        features_mb=round(phi.nbytes / 2**20),
        kernel_gb_never_formed=round(n * n * 4 / 2**30, 1),
        load_before=[round(v, 2) for v in load_before],
        load_after=[round(v, 2) for v in os.getloadavg()],
    )


def check_weights(directory: pathlib.Path, n: int, k: int, lam: float) -> float:
    """max |(ΦᵀΦ + λI) w − Φᵀy| / max |Φᵀy|, summed here in float64 chunks of 10 000 rows."""
    phi = np.load(directory / f"phi_{n}_{k}.npy", mmap_mode="r")
    y = np.load(directory / f"y_{n}.npy").astype(np.float64)
    w = np.load(directory / "weights.npy")
    gram, rhs = np.zeros((k, k)), np.zeros((k, N_OUT))
    for s in range(0, n, CHUNK):
        block = np.asarray(phi[s : s + CHUNK], np.float64)
        gram += block.T @ block
        rhs += block.T @ y[s : s + CHUNK]
    return float(np.abs(gram @ w + lam * w - rhs).max() / np.abs(rhs).max())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--m", type=int, default=10_000)
    parser.add_argument("--dir", default="/tmp/ntk_bench_low_rank")
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    directory = pathlib.Path(args.dir)
    if args.run:
        print(json.dumps(run_one(directory, args.n, args.k, args.m)))
        return
    t0 = time.perf_counter()
    write_data(directory, args.n, args.k, args.m)
    print(f"features written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    cmd = [sys.executable, __file__, "--n", str(args.n), "--k", str(args.k), "--m", str(args.m)]
    out = subprocess.run([*cmd, "--dir", str(directory), "--run"], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["normal_equations_residual"] = check_weights(directory, args.n, args.k, r["regularizer"])
    import numpy

    meta = dict(
        numpy=numpy.__version__,
        machine=platform.machine(),
        cpus=os.cpu_count(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    path = pathlib.Path(__file__).with_name("results_low_rank.json")
    path.write_text(json.dumps(dict(meta=meta, results=[r]), indent=1))
    print(f"numpy {meta['numpy']}, {meta['cpus']} cpus, {meta['date']}\n")
    print("| N | k | O | M | fit s | mean s | variances s | peak RSS MB (after import) "
          "| Φ MB | residual | load avg before → after |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| {r['n']} | {r['k']} | {r['o']} | {r['m']} | {r['fit_s']} | {r['mean_s']} | "
        f"{r['var_s']} | {r['peak_rss_mb']} ({r['rss_after_import_mb']}) | {r['features_mb']} | "
        f"{r['normal_equations_residual']:.1e} | {r['load_before']} → {r['load_after']} |"
    )


if __name__ == "__main__":
    main()
