"""The sketched eNTK against the exact kernel on a CNN: error, bias over seeds, variance
against the formula, time.

    python benchmarks/bench_sketch.py [--n 256] [--ks 512,2048,8192] [--seeds 8]

Model: 4 convolutions 3x3 SAME (3 -> 32 -> 64 -> 128 -> 256 channels, ReLU, 2x2 average
pools after the last three) on 32x32x3 inputs, then Dense 4096 -> 512 -> 10: 2.49 M
parameters, O = 10 outputs, traced (``trace_axes=(-1,)``). Inputs: Gaussian, N samples.

Exact: ``ntk_core.empirical_ntk(..., implementation="structured")`` (the structured
derivatives; the convolutions' per-sample Jacobians, the dense layers' Gram form), timed
on a first call (compilation included) and a second (warm). Sketch: ``ntk_sketch_fn``
with keys 0..S-1 per k; the first seed's call includes compilation, the others are warm
(the key is an argument). Per k: the relative Frobenius error ‖Θ̂ − Θ‖/‖Θ‖ and the top-10
eigenvalue errors max_i |λ̂_i − λ_i|/λ_i and ‖λ̂ − λ‖/‖λ‖ (mean over seeds), the same
errors of the mean kernel over the S seeds (no bias: falls like 1/√S), and the variance
across seeds summed over entries against the dense Gaussian formula Σ (Θ_ii Θ_jj + Θ_ij²)/k.
The load average (the machine is shared) before and after each phase goes into the results.
Results: ``results_sketch.json`` and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import ntk_core


def conv(p, x):
    y = lax.conv_general_dilated(
        x, p["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return y + p["bias"]


def pool(x):
    return lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0


def cnn(p, x):
    x = jax.nn.relu(conv(p["conv0"], x))
    for i in (1, 2, 3):
        x = pool(jax.nn.relu(conv(p[f"conv{i}"], x)))
    x = jax.nn.relu(x.reshape((x.shape[0], -1)) @ p["dense0"]["kernel"] + p["dense0"]["bias"])
    return x @ p["dense1"]["kernel"] + p["dense1"]["bias"]


def init(key):
    keys = iter(jax.random.split(key, 12))
    p = {}
    for i, (a, b) in enumerate([(3, 32), (32, 64), (64, 128), (128, 256)]):
        kernel = jax.random.normal(next(keys), (3, 3, a, b)) / math.sqrt(9 * a)
        p[f"conv{i}"] = {"kernel": kernel, "bias": 0.1 * jax.random.normal(next(keys), (b,))}
    for i, (a, b) in enumerate([(4 * 4 * 256, 512), (512, 10)]):
        kernel = jax.random.normal(next(keys), (a, b)) / math.sqrt(a)
        p[f"dense{i}"] = {"kernel": kernel, "bias": 0.1 * jax.random.normal(next(keys), (b,))}
    return p


def top_eigenvalues(k: np.ndarray, m: int = 10) -> np.ndarray:
    return np.linalg.eigvalsh(k)[::-1][:m]


def errors(estimate: np.ndarray, exact: np.ndarray, eig: np.ndarray) -> tuple[float, ...]:
    """Relative Frobenius error; top-10 eigenvalues: max_i |λ̂_i − λ_i|/λ_i, ‖λ̂ − λ‖/‖λ‖."""
    frob = np.linalg.norm(estimate - exact) / np.linalg.norm(exact)
    top = top_eigenvalues(estimate)
    worst = np.max(np.abs(top - eig) / eig)
    return float(frob), float(worst), float(np.linalg.norm(top - eig) / np.linalg.norm(eig))


def timed(fn):
    before = harness.load()
    t0 = time.perf_counter()
    out = np.asarray(fn(), np.float64)
    return out, time.perf_counter() - t0, before


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--ks", default="512,2048,8192")
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()
    params = init(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (args.n, 32, 32, 3))
    n_params = sum(v.size for v in jax.tree.leaves(params))
    meta = harness.machine() | {"n": args.n, "params": n_params, "outputs": 10}

    def exact_call():
        return ntk_core.empirical_ntk(cnn, params, x, implementation="structured")

    exact, exact_first_s, load0 = timed(exact_call)
    _, exact_warm_s, load1 = timed(exact_call)
    exact_run = dict(first_s=exact_first_s, warm_s=exact_warm_s, load_before=[load0, load1])
    print(json.dumps(dict(exact=exact_run)), flush=True)
    eig = top_eigenvalues(exact)
    diag = np.diag(exact)
    gauss_sum = (diag[:, None] * diag[None, :] + exact**2).sum()
    rows = []
    for k in map(int, args.ks.split(",")):
        runs, estimates = [], []
        for seed in range(args.seeds):  # one compiled program for all keys
            features = ntk_core.ntk_sketch_fn(cnn, k=k, key=jax.random.PRNGKey(seed))
            phi, seconds, load = timed(lambda f=features: f(params, x))
            estimates.append(phi @ phi.T)
            runs.append(dict(seed=seed, seconds=seconds, load_before=load))
        estimates = np.array(estimates)
        single = np.array([errors(e, exact, eig) for e in estimates])
        mean_frob, mean_eig, mean_eig_norm = errors(estimates.mean(axis=0), exact, eig)
        variance_ratio = estimates.var(axis=0, ddof=1).sum() / (gauss_sum / k)
        rows.append(
            dict(
                k=k,
                frob=float(single[:, 0].mean()),
                top10_eig=float(single[:, 1].mean()),
                top10_eig_norm=float(single[:, 2].mean()),
                top10_eig_norm_of_mean=mean_eig_norm,
                frob_of_mean=mean_frob,
                top10_eig_of_mean=mean_eig,
                variance_over_gaussian=float(variance_ratio),
                first_s=runs[0]["seconds"],
                warm_s=float(np.mean([r["seconds"] for r in runs[1:]] or [np.nan])),
                runs=runs,
            )
        )
        print(json.dumps({key: v for key, v in rows[-1].items() if key != "runs"}), flush=True)
    meta["load_after"] = harness.load()
    path = pathlib.Path(__file__).with_name("results_sketch.json")
    path.write_text(json.dumps(dict(meta=meta, exact=exact_run, sketch=rows), indent=1))
    print(f"\nN = {args.n}, P = {n_params}, {args.seeds} seeds; exact (structured): "
          f"{exact_first_s:.1f} s first call, {exact_warm_s:.1f} s warm; "
          f"load {meta['loadavg_1_5_15']} -> {meta['load_after']}")  # fmt: skip
    print("| k | rel. Frobenius | top-10 eig. max / norm | mean of seeds: Frob. / eig. max |"
          " Var / Gaussian | sketch first / warm s |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['k']} | {r['frob']:.4f} | {r['top10_eig']:.4f} / {r['top10_eig_norm']:.4f} | "
              f"{r['frob_of_mean']:.4f} / "
              f"{r['top10_eig_of_mean']:.4f} | {r['variance_over_gaussian']:.2f} | "
              f"{r['first_s']:.1f} / {r['warm_s']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    jnp.zeros(())  # backend up before the first timing
    main()
