"""The sketched eNTK and low-rank kernel regression at N = 100 000 on the 2.49 M-parameter
CNN of ``bench_sketch.py``, killed once and resumed (issue 27's target: within 60 min, peak
RSS <= 8 GB, on a 2-core machine).

    python benchmarks/bench_sketch_100k.py [--n 100000] [--k 1024] [--batch-size 500]
                                           [--kill-after 600] [--test 2000] [--dir DIR]

Three worker processes (``harness.run_worker``), each timed from this process, so the total
includes every start, import, compilation and the work lost to the kill:

1. ``features``: ``ntk_sketch_fn(cnn, k=, key=PRNGKey(0), batch_size=, out=DIR/phi.npy,
   resume=True)`` on N Gaussian 32x32x3 inputs, SIGKILLed after ``--kill-after`` s;
   the manifest's finished blocks are counted.
2. ``features`` again: the same call finishes the file (only the missing blocks).
3. ``regress``: targets y = tanh(pool(x) W) (a random teacher on the 4x4-pixel means,
   192 values, W (192, 10)), ``low_rank_inference(np.load(phi,
   mmap_mode="r"), y, diag_reg=1e-3)``, the sketch of ``--test`` held-out inputs with the
   same key, their posterior mean; the test R² (1 − MSE / variance of y_test, per output,
   averaged) and the fitted weights against the normal equations summed here in float64.

Peak RSS: each worker's VmHWM. Results: ``results_sketch.json`` under ``n100k``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np
from bench_sketch import build, cnn, merge

import ntk_core
from ntk_core import predict


def _inputs(n: int, seed: int) -> np.ndarray:
    """N Gaussian 32x32x3 images, float32, made in blocks (the same for any run)."""
    key = jax.random.PRNGKey(seed)
    parts = [
        np.asarray(jax.random.normal(jax.random.fold_in(key, i), (min(10_000, n - i), 32, 32, 3)))
        for i in range(0, n, 10_000)
    ]
    return np.concatenate(parts)


def _targets(x: np.ndarray) -> np.ndarray:
    """y = tanh(pool(x) W): the 8x8x3 means of 4x4 pixel squares (192 values, variance 1/16
    each), W (192, 10) Gaussian · 4/√192, so each tanh's argument has variance 1."""
    w = np.random.default_rng(7).standard_normal((192, 10)) * 4 / np.sqrt(192)
    pooled = (
        x[i : i + 10_000].reshape(-1, 8, 4, 8, 4, 3).mean((2, 4)) for i in range(0, len(x), 10_000)
    )
    return np.concatenate([np.tanh(p.reshape(-1, 192) @ w) for p in pooled]).astype(np.float32)


def _features(spec: dict, out: str | None):
    return ntk_core.ntk_sketch_fn(
        cnn, k=spec["k"], key=jax.random.PRNGKey(0), batch_size=spec["batch_size"], out=out,
        resume=out is not None,
    )  # fmt: skip


def measure(spec: dict) -> dict:
    _, params, _ = build("cnn", 1)
    t0 = time.perf_counter()
    result = dict(load_before=harness.load())
    phi_path = str(pathlib.Path(spec["dir"]) / "phi.npy")
    if spec["part"] == "features":
        x = _inputs(spec["n"], 1)
        result["inputs_s"] = time.perf_counter() - t0
        phi = _features(spec, phi_path)(params, x)
        result["shape"] = list(phi.shape)
    else:
        x = _inputs(spec["n"], 1)
        y = _targets(x)
        del x
        x_test = _inputs(spec["test"], 2)
        y_test = _targets(x_test)
        result["targets_s"] = time.perf_counter() - t0
        phi = np.load(phi_path, mmap_mode="r")
        t1 = time.perf_counter()
        fit = predict.low_rank_inference(phi, y, diag_reg=1e-3)
        result["fit_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        phi_test = np.asarray(_features(spec, None)(params, x_test))
        mean = np.asarray(fit.posterior(phi_test).mean)
        result["test_s"] = time.perf_counter() - t1
        r2 = 1 - ((mean - y_test) ** 2).mean(0) / y_test.var(0)
        result["test_r2"] = float(r2.mean())
        # the normal equations, summed independently in float64
        a = np.zeros((phi.shape[1],) * 2)
        b = np.zeros((phi.shape[1], y.shape[1]))
        for i in range(0, len(phi), 10_000):
            block = np.asarray(phi[i : i + 10_000], np.float64)
            a += block.T @ block
            b += block.T @ y[i : i + 10_000]
        a[np.diag_indices_from(a)] += float(fit.regularizer)
        w = np.linalg.solve(a, b)
        result["weights_rel_err"] = float(np.linalg.norm(fit.weights - w) / np.linalg.norm(w))
    result.update(peak_rss_bytes=harness.max_rss_bytes(), load_after=harness.load())
    return result


def _blocks_done(phi_path: pathlib.Path) -> int:
    manifest = pathlib.Path(str(phi_path) + ".manifest.json")
    if not manifest.exists():
        return 0
    return len(json.loads(manifest.read_text()).get("done", []))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--kill-after", type=float, default=600.0)
    parser.add_argument("--test", type=int, default=2000)
    parser.add_argument("--dir", default="/tmp/sketch_100k")
    args = parser.parse_args()
    directory = pathlib.Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("phi.npy*"):
        stale.unlink()
    spec = dict(n=args.n, k=args.k, batch_size=args.batch_size, test=args.test, dir=args.dir)
    meta = harness.machine() | {k: v for k, v in spec.items() if k != "dir"}
    phases = []
    for part, timeout in (("features", args.kill_after), ("features", 3 * 3600.0),
                          ("regress", 3600.0)):  # fmt: skip
        t0 = time.perf_counter()
        out = harness.run_worker(
            __file__, spec | dict(part=part), timeout_s=timeout, kill_bytes=16 * harness.GIB
        )
        out.update(part=part, wall_s=time.perf_counter() - t0)
        out["blocks_done_after"] = _blocks_done(directory / "phi.npy")
        phases.append(out)
        print(json.dumps(out), flush=True)
    total = sum(p["wall_s"] for p in phases)
    peak = max(p.get("peak_rss_bytes", 0) for p in phases)
    merge("n100k", dict(meta=meta, phases=phases, total_s=total, peak_rss_bytes=peak))
    print(f"\nN = {args.n}, k = {args.k}: total {total / 60:.1f} min (three processes, one "
          f"SIGKILLed after {args.kill_after:.0f} s), peak RSS {peak / 1e9:.2f} GB")  # fmt: skip


if __name__ == "__main__":
    jnp.zeros(())
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        harness.worker_main(measure)
    else:
        main()
