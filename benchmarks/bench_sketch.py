"""The sketched eNTK against the exact (structured) kernel on a CNN and a small
transformer: error, bias over seeds, variance against the formula, time, peak memory.

    python benchmarks/bench_sketch.py [errors] [--model cnn|transformer] [--n 256]
                                      [--ks 512,2048,8192] [--seeds 8]
    python benchmarks/bench_sketch.py memory [--model cnn|transformer] [--n 256] [--ks ...]
    python benchmarks/bench_sketch.py large [--n 2000] [--sub 256] [--batch-size 250] [--ks ...]
    python benchmarks/bench_sketch.py report --out benchmarks/results_sketch.md

Models (float32, O = 10 outputs, traced: ``trace_axes=(-1,)``):

- ``cnn``: 4 convolutions 3x3 SAME (3 -> 32 -> 64 -> 128 -> 256 channels, ReLU, 2x2
  average pools after the last three) on 32x32x3 Gaussian inputs, then Dense 4096 -> 512
  -> 10: 2.49 M parameters.
- ``transformer``: integer tokens (T = 64 positions, vocabulary 512, uniform) -> embedding
  (width 64) plus learnt positions -> 2 pre-LayerNorm blocks (4-head self-attention with
  query/key/value/output projections, MLP 64 -> 256 -> 64 with GELU, residuals) ->
  LayerNorm -> mean over positions -> Dense 10: 137 k parameters.

``errors``: exact ``empirical_ntk(..., implementation="structured")`` timed on a first call
(compilation included) and a second (warm); sketch ``ntk_sketch_fn`` with keys 0..S-1 per
k (the first seed's call compiles, the others are warm: the key is an argument). Per k:
the relative Frobenius error ‖Θ̂ − Θ‖/‖Θ‖ and the top-10 eigenvalue errors max_i |λ̂_i −
λ_i|/λ_i and ‖λ̂ − λ‖/‖λ‖ (mean over seeds), the same errors of the mean kernel over the
S seeds (no bias: falls like 1/√S), and the variance across seeds summed over entries
against the dense Gaussian formula Σ (Θ_ii Θ_jj + Θ_ij²)/k.

``memory``: each side in its own process (``harness.run_worker``), so peaks do not mix:
peak resident memory (VmHWM) once the model and inputs are built (baseline) and after one
call at N (peak); the exact kernel and the sketch at each k, one call each (first call,
compilation included).

``large`` (the CNN, or ``--model transformer``, at N = 2 000): per k a worker process runs
the sketch in blocks of ``batch_size`` (a one-block call compiles first; the N-sample call
is timed warm), reports its peak RSS and writes the feature rows of a random sub-block of
``sub`` samples; this process computes the exact kernel of those samples (timed: the
measured N = ``sub`` exact time; ``--save-exact F.npz`` keeps it) and the sub-block's
errors. The exact kernel at N: ``plan()``'s estimate, and the measured N = ``sub`` time
scaled by (N/sub)²; the sketch at larger N: projected from its measured throughput
(samples/s), labelled as projections. ``errors --exact-from F.npz``: the seeds' errors on
that sub-block against the saved kernel (stored as ``{model}_sub{sub}``).

The load average (the machine is shared) before and after each measurement goes into the
results, merged into ``results_sketch.json``: the CNN's ``errors`` run at the top level
(``meta``, ``exact``, ``sketch``), the transformer's under ``transformer``, then ``memory``
(per model) and ``large``. A markdown table on stdout per run; ``report``: one table per
part from the results file.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import ntk_core

RESULTS = pathlib.Path(__file__).with_name("results_sketch.json")

# -- the models ---------------------------------------------------------------------------


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


def _dense_init(key, a, b):
    k1, k2 = jax.random.split(key)
    return {
        "kernel": jax.random.normal(k1, (a, b)) / math.sqrt(a),
        "bias": 0.1 * jax.random.normal(k2, (b,)),
    }


def init_cnn(key):
    keys = iter(jax.random.split(key, 12))
    p = {}
    for i, (a, b) in enumerate([(3, 32), (32, 64), (64, 128), (128, 256)]):
        kernel = jax.random.normal(next(keys), (3, 3, a, b)) / math.sqrt(9 * a)
        p[f"conv{i}"] = {"kernel": kernel, "bias": 0.1 * jax.random.normal(next(keys), (b,))}
    for i, (a, b) in enumerate([(4 * 4 * 256, 512), (512, 10)]):
        p[f"dense{i}"] = _dense_init(next(keys), a, b)
    return p


VOCAB, LENGTH, WIDTH, HEADS, HIDDEN, BLOCKS = 512, 64, 64, 4, 256, 2


def dense(p, x):
    return x @ p["kernel"] + p["bias"]


def layer_norm(p, x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-6) * p["scale"] + p["bias"]


def attention(p, h):
    n, t, _ = h.shape
    q, k, v = (dense(p[name], h).reshape(n, t, HEADS, -1) for name in ("query", "key", "value"))
    logits = jnp.einsum("nqhd,nkhd->nhqk", q, k) / math.sqrt(q.shape[-1])
    o = jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(logits), v)
    return dense(p["out"], o.reshape(n, t, -1))


def transformer(p, tokens):
    h = jnp.take(p["embed"], tokens, axis=0) + p["positions"]
    for b in range(BLOCKS):
        blk = p[f"block{b}"]
        h = h + attention(blk["attention"], layer_norm(blk["norm0"], h))
        h = h + dense(blk["mlp1"], jax.nn.gelu(dense(blk["mlp0"], layer_norm(blk["norm1"], h))))
    return dense(p["head"], jnp.mean(layer_norm(p["norm"], h), axis=1))


def init_transformer(key):
    keys = iter(jax.random.split(key, 32))

    def norm():
        return {
            "scale": 1.0 + 0.2 * jax.random.normal(next(keys), (WIDTH,)),
            "bias": 0.1 * jax.random.normal(next(keys), (WIDTH,)),
        }

    p = {
        "embed": jax.random.normal(next(keys), (VOCAB, WIDTH)),
        "positions": 0.5 * jax.random.normal(next(keys), (LENGTH, WIDTH)),
        "norm": norm(),
        "head": _dense_init(next(keys), WIDTH, 10),
    }
    for b in range(BLOCKS):
        att = {n: _dense_init(next(keys), WIDTH, WIDTH) for n in ("query", "key", "value", "out")}
        p[f"block{b}"] = {
            "attention": att,
            "norm0": norm(),
            "norm1": norm(),
            "mlp0": _dense_init(next(keys), WIDTH, HIDDEN),
            "mlp1": _dense_init(next(keys), HIDDEN, WIDTH),
        }
    return p


def build(model: str, n: int):
    """``(apply_fn, params, x)`` of ``model`` with N = ``n`` inputs (the same for any run)."""
    if model == "cnn":
        x = jax.random.normal(jax.random.PRNGKey(1), (n, 32, 32, 3))
        return cnn, init_cnn(jax.random.PRNGKey(0)), x
    tokens = jax.random.randint(jax.random.PRNGKey(1), (n, LENGTH), 0, VOCAB)
    return transformer, init_transformer(jax.random.PRNGKey(0)), tokens


# -- measuring ----------------------------------------------------------------------------


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


def merge(key: str | None, value: dict) -> None:
    """Writes ``value`` under ``key`` of the results file (at the top level for None)."""
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data.update(value if key is None else {key: value})
    RESULTS.write_text(json.dumps(data, indent=1))


def run_errors(args) -> None:
    if args.exact_from:  # the sub-block of a ``large --save-exact`` run: its inputs and kernel
        saved = np.load(args.exact_from)
        apply_fn, params, x = build(args.model, int(saved["n"]))
        x, exact = x[saved["rows"]], saved["exact"]
        args.n = x.shape[0]
    else:
        apply_fn, params, x = build(args.model, args.n)
    n_params = sum(v.size for v in jax.tree.leaves(params))
    meta = harness.machine() | {"model": args.model, "n": args.n, "params": n_params}
    meta["outputs"] = 10
    batch_size = args.batch_size if args.exact_from else None

    def exact_call():
        return ntk_core.empirical_ntk(apply_fn, params, x, implementation="structured")

    if args.exact_from:
        exact_run = dict(from_file=args.exact_from, first_s=float(saved["seconds"]))
        exact_first_s = exact_warm_s = float("nan")
    else:
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
            features = ntk_core.ntk_sketch_fn(
                apply_fn, k=k, key=jax.random.PRNGKey(seed), batch_size=batch_size
            )
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
    result = dict(meta=meta, exact=exact_run, sketch=rows)
    if args.exact_from:
        merge(f"{args.model}_sub{args.n}", result)
    else:
        merge(None if args.model == "cnn" else args.model, result)
    print(f"\n{args.model}: N = {args.n}, P = {n_params}, {args.seeds} seeds; exact (structured): "
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


# -- worker processes: one measurement each, its own peak memory -----------------------------


def measure(spec: dict) -> dict:
    apply_fn, params, x = build(spec["model"], spec["n"])
    jax.block_until_ready((params, x))
    result = dict(baseline_rss_bytes=harness.max_rss_bytes(), load_before=harness.load())
    if spec["side"] == "exact":
        t0 = time.perf_counter()
        out = ntk_core.empirical_ntk(apply_fn, params, x, implementation="structured")
        np.asarray(out)
        result["first_s"] = time.perf_counter() - t0
    else:
        features = ntk_core.ntk_sketch_fn(
            apply_fn, k=spec["k"], key=jax.random.PRNGKey(0), batch_size=spec.get("batch_size")
        )
        block = spec.get("batch_size")
        if block:  # compiles the block program; the N-sample call below is warm
            t0 = time.perf_counter()
            features(params, x[:block])
            result["warmup_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        phi = np.asarray(features(params, x))
        result["warm_s" if block else "first_s"] = time.perf_counter() - t0
        if spec.get("rows_path"):
            np.save(spec["rows_path"], phi[np.array(spec["rows"])])
    result.update(peak_rss_bytes=harness.max_rss_bytes(), load_after=harness.load())
    return result


def worker(spec: dict, timeout_s: float = 1800.0) -> dict:
    print(f"worker { {key: v for key, v in spec.items() if key != 'rows'} }", flush=True)
    out = harness.run_worker(__file__, spec, timeout_s=timeout_s, kill_bytes=12 * harness.GIB)
    print(json.dumps(out), flush=True)
    return out


def run_memory(args) -> None:
    meta = harness.machine() | {"model": args.model, "n": args.n}
    rows = [dict(side="exact", **worker(dict(model=args.model, n=args.n, side="exact")))]
    for k in map(int, args.ks.split(",")):
        rows.append(dict(side="sketch", k=k, **worker(dict(model=args.model, n=args.n,
                                                            side="sketch", k=k))))  # fmt: skip
    meta["load_after"] = harness.load()
    data = json.loads(RESULTS.read_text()).get("memory", {}) if RESULTS.exists() else {}
    merge("memory", data | {args.model: dict(meta=meta, rows=rows)})
    print(f"\n{args.model}, N = {args.n}: load {meta['loadavg_1_5_15']} -> {meta['load_after']}")
    print("| side | k | time s | peak RSS MB | baseline MB | load before / after |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['side']} | {r.get('k', '')} | {r.get('first_s', float('nan')):.1f} | "
              f"{r.get('peak_rss_bytes', 0) / 1e6:.0f} | {r.get('baseline_rss_bytes', 0) / 1e6:.0f}"
              f" | {r.get('load_before')} / {r.get('load_after')} |")  # fmt: skip


def run_large(args) -> None:
    apply_fn, params, x = build(args.model, args.n)
    meta = harness.machine() | {"model": args.model, "n": args.n, "sub": args.sub}
    meta["batch_size"], meta["exact_batch_size"] = args.batch_size, args.exact_batch_size
    rows_idx = np.sort(np.random.default_rng(0).choice(args.n, args.sub, replace=False))
    plan = ntk_core.plan(apply_fn, params, x, implementation="structured")
    estimate = next(e for e in plan.estimates if e.implementation == "structured")
    meta["plan_structured"] = dict(
        seconds=estimate.seconds, flops=estimate.flops, memory_bytes=estimate.memory_bytes
    )
    xs = x[rows_idx]
    exact, exact_s, load0 = timed(
        lambda: ntk_core.empirical_ntk(
            apply_fn, params, xs, implementation="structured", batch_size=args.exact_batch_size
        )
    )
    scale = (args.n / args.sub) ** 2
    exact_run = dict(sub_first_s=exact_s, load_before=load0, load_after=harness.load())
    exact_run["scaled_s"] = exact_s * scale
    if args.save_exact:
        np.savez(args.save_exact, exact=exact, rows=rows_idx, n=args.n, seconds=exact_s)
    print(json.dumps(dict(plan=meta["plan_structured"], exact=exact_run)), flush=True)
    eig = top_eigenvalues(exact)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in map(int, args.ks.split(",")):
            path = f"{tmp}/rows_{k}.npy"
            spec = dict(model=args.model, n=args.n, side="sketch", k=k, batch_size=args.batch_size)
            out = worker(spec | dict(rows=rows_idx.tolist(), rows_path=path), 4 * 3600.0)
            row = dict(k=k, **out)
            if "error" not in out:
                phi = np.load(path).astype(np.float64)
                row["frob"], row["top10_eig"], row["top10_eig_norm"] = errors(
                    phi @ phi.T, exact, eig
                )
                rate = args.n / out["warm_s"]
                row["samples_per_s"] = rate
                row["projected_s"] = {str(m): m / rate for m in (20_000, 100_000)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta["load_after"] = harness.load()
    merge(
        "large" if (args.n, args.model) == (2000, "cnn") else f"large_{args.model}_{args.n}",
        dict(meta=meta, exact=exact_run, sketch=rows),
    )
    print(f"\n{args.model} N = {args.n}: exact plan() {estimate.seconds:.0f} s, "
          f"measured N = {args.sub} {exact_s:.1f} s x {scale:.1f} = "
          f"{exact_s * scale:.0f} s (scaled)")  # fmt: skip
    print("| k | sketch s (warm-up) | peak RSS MB | sub-block Frob. | top-10 eig. max / norm |"
          " proj. 20k / 100k s |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['k']} | {r['error']} |")
            continue
        p = r["projected_s"]
        print(f"| {r['k']} | {r['warm_s']:.1f} ({r['warmup_s']:.1f}) | "
              f"{r['peak_rss_bytes'] / 1e6:.0f} | {r['frob']:.4f} | {r['top10_eig']:.4f} / "
              f"{r['top10_eig_norm']:.4f} | {p['20000']:.0f} / {p['100000']:.0f} |")  # fmt: skip


# -- the tables ---------------------------------------------------------------------------


def _mb(row: dict, key: str) -> str:
    return f"{row[key] / 1e6:.0f}" if key in row else "-"


def _load(row: dict) -> str:
    return f"{row['load_before'][0]:.1f} / {row['load_after'][0]:.1f}"


def run_report(args) -> None:
    """Markdown tables, one per benchmark, from ``results_sketch.json`` (``--out``)."""
    data = json.loads(RESULTS.read_text())
    cnn_run = {key: data[key] for key in ("meta", "exact", "sketch")}
    lines = ["# `bench_sketch.py` figures (from `results_sketch.json`)", ""]
    lines += ["## Error, bias and variance at N = 256 (`errors`, 8 seeds)", ""]
    lines += ["| model | k | rel. Frobenius (mean of 8) | of the 8-seed mean | "
              "top-10 eig. max rel. / ‖Δλ‖/‖λ‖ | Var / Gaussian formula | "
              "sketch warm s (first) | exact warm s (first) | load, start → end |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, run in (("CNN", cnn_run), ("transformer", data.get("transformer"))):
        if not run:
            continue
        ex, meta = run["exact"], run["meta"]
        for r in run["sketch"]:
            lines.append(
                f"| {name} | {r['k']} | {r['frob']:.4f} | {r['frob_of_mean']:.4f} | "
                f"{r['top10_eig']:.3f} / {r['top10_eig_norm']:.4f} | "
                f"{r['variance_over_gaussian']:.2f} | {r['warm_s']:.1f} ({r['first_s']:.1f}) | "
                f"{ex['warm_s']:.1f} ({ex['first_s']:.1f}) | "
                f"{meta['loadavg_1_5_15'][0]:.1f} → {meta['load_after'][0]:.1f} |"
            )
    for key in sorted(key for key in data if "_sub" in key):
        run = data[key]
        meta, ex = run["meta"], run["exact"]
        lines += ["", f"## Error, bias and variance at N = {meta['n']} (`errors --exact-from`, "
                  f"{len(run['sketch'][0]['runs'])} seeds): the exact kernel of a `large` run's "
                  f"sub-block ({ex['first_s']:.0f} s there)", ""]  # fmt: skip
        lines += ["| model | k | rel. Frobenius (mean) | of the seeds' mean | "
                  "top-10 eig. max rel. / ‖Δλ‖/‖λ‖ | Var / Gaussian formula | "
                  "sketch warm s (first) | load, start → end |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in run["sketch"]:
            lines.append(
                f"| {meta['model']} | {r['k']} | {r['frob']:.4f} | {r['frob_of_mean']:.4f} | "
                f"{r['top10_eig']:.3f} / {r['top10_eig_norm']:.4f} | "
                f"{r['variance_over_gaussian']:.2f} | {r['warm_s']:.1f} ({r['first_s']:.1f}) | "
                f"{meta['loadavg_1_5_15'][0]:.1f} → {meta['load_after'][0]:.1f} |"
            )
    lines += ["", "## Peak memory at N = 256, each side in its own process (`memory`)", ""]
    lines += ["| model | side | k | first call s | peak RSS MB | baseline MB | "
              "load before / after |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, run in data.get("memory", {}).items():
        for r in run["rows"]:
            seconds = f"{r['first_s']:.1f}" if "first_s" in r else r.get("error", "-")
            lines.append(
                f"| {name} | {r['side']} | {r.get('k', '')} | {seconds} | "
                f"{_mb(r, 'peak_rss_bytes')} | {_mb(r, 'baseline_rss_bytes')} | {_load(r)} |"
            )
    for large in (data[key] for key in sorted(data) if key.startswith("large")):
        meta, ex = large["meta"], large["exact"]
        n, sub = meta["n"], meta["sub"]
        name = meta.get("model", "cnn").replace("cnn", "CNN")
        lines += ["", f"## {name} at N = {n} (`large`, blocks of {meta['batch_size']})", ""]
        planned = meta["plan_structured"]
        lines += [
            f"Exact (structured) at N = {n}: `plan()` estimates {planned['seconds']:.0f}"
            f" s and {planned['memory_bytes'] / 1e9:.1f} GB (one call); the "
            f"measured N = {sub} first call {ex['sub_first_s']:.1f} s (load "
            f"{ex['load_before'][0]:.1f} / {ex['load_after'][0]:.1f}) scaled by ({n}/{sub})² "
            f"= **{ex['scaled_s']:.0f} s** (scaled, not measured). Errors: one seed, on a random "
            f"{sub}-sample sub-block against its exact kernel.",
            "",
            "| k | sketch warm s (one-block warm-up) | samples/s | peak RSS MB (baseline) | "
            "sub-block rel. Frobenius | top-10 eig. max rel. / ‖Δλ‖/‖λ‖ | exact scaled / sketch |"
            " exact `plan()` / sketch | sketch projected to larger N, s | load before / after |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in large["sketch"]:
            if "error" in r:
                lines.append(f"| {r['k']} | {r['error']} |")
                continue
            bigger = [f"{m}: {s:.0f}" for m, s in r["projected_s"].items() if int(m) > n]
            lines.append(
                f"| {r['k']} | {r['warm_s']:.1f} ({r['warmup_s']:.1f}) | "
                f"{r['samples_per_s']:.1f} | {_mb(r, 'peak_rss_bytes')} "
                f"({_mb(r, 'baseline_rss_bytes')}) | {r['frob']:.4f} | {r['top10_eig']:.3f} / "
                f"{r['top10_eig_norm']:.4f} | {ex['scaled_s'] / r['warm_s']:.1f}x | "
                f"{planned['seconds'] / r['warm_s']:.1f}x | {', '.join(bigger)} | {_load(r)} |"
            )
    huge = data.get("n100k")
    if huge:
        meta = huge["meta"]
        lines += ["", f"## N = {meta['n']}: sketch (k = {meta['k']}, blocks of "
                  f"{meta['batch_size']}, `out=`) killed once, resumed, then low-rank regression "
                  "(`bench_sketch_100k.py`)", ""]  # fmt: skip
        lines += ["| process | wall s | blocks in the file after | peak RSS MB | notes | "
                  "load before / after |", "|---|---|---|---|---|---|"]  # fmt: skip
        for r in huge["phases"]:
            notes = r.get("error", "")
            if r["part"] == "regress" and not notes:
                notes = (f"fit {r['fit_s']:.1f} s, test sketch + mean {r['test_s']:.1f} s, "
                         f"test R² {r['test_r2']:.3f}, weights vs float64 normal equations "
                         f"{r['weights_rel_err']:.1e}")  # fmt: skip
            load = _load(r) if "load_before" in r else "-"
            lines.append(f"| {r['part']} | {r['wall_s']:.0f} | {r['blocks_done_after']} | "
                         f"{_mb(r, 'peak_rss_bytes')} | {notes} | {load} |")  # fmt: skip
        lines += ["", f"Total {huge['total_s'] / 60:.1f} min, peak RSS "
                  f"{huge['peak_rss_bytes'] / 1e9:.2f} GB."]  # fmt: skip
    text = "\n".join(lines) + "\n"
    pathlib.Path(args.out).write_text(text) if args.out else print(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parts = dict(errors=run_errors, memory=run_memory, large=run_large, report=run_report)
    parser.add_argument("part", nargs="?", default="errors", choices=list(parts))
    parser.add_argument("--model", default="cnn", choices=["cnn", "transformer"])
    parser.add_argument("--n", type=int, default=None, help="256 (errors, memory), 2000 (large)")
    parser.add_argument("--ks", default="512,2048,8192")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--sub", type=int, default=256, help="large: the exact sub-block")
    parser.add_argument("--batch-size", type=int, default=250, help="large: sketch blocks")
    parser.add_argument("--exact-batch-size", type=int, default=None, help="large: exact tiles")
    parser.add_argument("--save-exact", default=None, help="large: .npz of the sub-block kernel")
    parser.add_argument("--exact-from", default=None, help="errors: a --save-exact .npz")
    parser.add_argument("--out", default=None, help="report: the markdown file (else stdout)")
    args = parser.parse_args()
    if args.n is None:
        args.n = 2000 if args.part == "large" else 256
    parts[args.part](args)


if __name__ == "__main__":
    jnp.zeros(())  # backend up before the first timing
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        harness.worker_main(measure)
    else:
        main()
