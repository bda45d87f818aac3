"""Top-k NTK eigenvalues, never forming the kernel (ntk_core.spectrum): time, memory, accuracy.

    python benchmarks/bench_spectrum.py                      # N = 10 000 and N = 50 000
    python benchmarks/bench_spectrum.py --n 500 --n-big 2000 --out /tmp/spectrum.json

The model is the MLP 784-1000-1 (ReLU, weights N(0, 1/fan_in), zero biases, as in
``bench_blocked.py``), float32, inputs N(0, I) (seed 0); its NTK is the N x N Gram
matrix (one output). Three measurements, each in its own Python process so that its
peak resident memory (``VmHWM`` of ``/proc/self/status``) is its own:

* ``formed`` (N = ``--n``): the kernel formed by ``ntk_core.empirical_ntk`` with the
  blocked engine (``--kernel-batch-size``, float32 on the host), then all its
  eigenvalues by ``numpy.linalg.eigvalsh`` in float64: the reference.
* ``matrix_free`` (N = ``--n``): ``spectrum.ntk_eigsh(k=--k)``, NTK-vector products
  batched by ``--batch-size``; the driver reports the largest relative difference
  of its top k from the reference (the issue's target: 1e-4).
* ``matrix_free_big`` (N = ``--n-big``): the same, never forming the 4·N² byte kernel
  (10 GB at N = 50 000).

Times: the operator's construction (validation, one abstract trace), the first
product (trace + compile + run), a warm product, and the whole ``ntk_eigsh`` call
(its own construction included; the compiled product is reused). The load average
(``os.getloadavg()``) is recorded before and after each measurement. Results:
``results_spectrum.json`` (``--out``) and a markdown table on stdout. Never a test.
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

WIDTHS = (784, 1000, 1)


def _vm_hwm_mb() -> float:
    """Peak resident set of this process in MB (``VmHWM``; ``ru_maxrss`` elsewhere)."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1e3
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def _problem(n: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    key = jax.random.PRNGKey(0)
    params = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)})

    def apply(params, x):
        for i, layer in enumerate(params):
            x = x @ layer["w"] + layer["b"]
            if i < len(params) - 1:
                x = jax.nn.relu(x)
        return x

    x = np.random.default_rng(0).standard_normal((n, WIDTHS[0]), dtype=np.float32)
    return apply, params, x


def run_formed(n: int, kernel_batch_size: int, k: int) -> dict:
    import jax
    import numpy as np

    import ntk_core

    apply, params, x = _problem(n)
    baseline = _vm_hwm_mb()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    kern = ntk_core.empirical_ntk(apply, params, x, batch_size=kernel_batch_size, progress=False)
    kern = np.asarray(jax.block_until_ready(kern))
    form_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    w = np.linalg.eigvalsh(kern.astype(np.float64))
    eigvalsh_s = time.perf_counter() - t0
    top = w[::-1][:k]
    return dict(
        case="formed",
        n=n,
        kernel_batch_size=kernel_batch_size,
        kernel_dtype=str(kern.dtype),
        kernel_gb=round(kern.nbytes / 1e9, 3),
        form_s=round(form_s, 2),
        eigvalsh_s=round(eigvalsh_s, 2),
        total_s=round(form_s + eigvalsh_s, 2),
        eigenvalues=[float(v) for v in top],
        trace=float(np.sum(w)),
        effective_rank=ntk_core.metrics.effective_rank(eigenvalues=w),
        baseline_rss_mb=round(baseline, 1),
        peak_rss_mb=round(_vm_hwm_mb(), 1),
        load_before=[round(v, 2) for v in load_before],
        load_after=[round(v, 2) for v in os.getloadavg()],
    )


def run_matrix_free(case: str, n: int, batch_size: int | None, k: int, tol: float) -> dict:
    import numpy as np

    from ntk_core import spectrum

    apply, params, x = _problem(n)
    baseline = _vm_hwm_mb()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    op = spectrum.ntk_operator(apply, params, x, batch_size=batch_size)
    construct_s = time.perf_counter() - t0
    v = np.random.default_rng(1).standard_normal(n)
    t0 = time.perf_counter()
    op @ v
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    op @ v
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    top = spectrum.ntk_eigsh(apply, params, x, k=k, tol=tol, batch_size=batch_size)
    eigsh_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trace = spectrum.ntk_trace(apply, params, x, batch_size=min(n, 10_000))
    trace_s = time.perf_counter() - t0
    return dict(
        case=case,
        n=n,
        batch_size=batch_size,
        k=k,
        tol=tol,
        construct_s=round(construct_s, 2),
        first_product_s=round(first_s, 2),
        warm_product_s=round(warm_s, 3),
        eigsh_s=round(eigsh_s, 2),
        matvecs=top.matvecs,
        s_per_matvec=round(eigsh_s / max(top.matvecs, 1), 3),
        eigenvalues=[float(w) for w in top.eigenvalues],
        trace=trace,
        trace_s=round(trace_s, 2),
        kernel_never_formed_gb=round(4 * n * n / 1e9, 2),
        baseline_rss_mb=round(baseline, 1),
        peak_rss_mb=round(_vm_hwm_mb(), 1),
        load_before=[round(v, 2) for v in load_before],
        load_after=[round(v, 2) for v in os.getloadavg()],
    )


def _subprocess(args: list[str]) -> dict:
    cmd = [sys.executable, __file__, *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000, help="N of the accuracy check")
    parser.add_argument("--n-big", type=int, default=50_000, help="N of the big matrix-free run")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--tol", type=float, default=1e-6, help="ARPACK's tol")
    parser.add_argument("--batch-size", type=int, default=5_000, help="0: unbatched products")
    parser.add_argument("--kernel-batch-size", type=int, default=2_500)
    parser.add_argument("--skip-big", action="store_true")
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).with_name("results_spectrum.json"))
    )
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batch = args.batch_size or None
    if args.run == "formed":
        print(json.dumps(run_formed(args.n, args.kernel_batch_size, args.k)))
        return
    if args.run in ("matrix_free", "matrix_free_big"):
        n = args.n if args.run == "matrix_free" else args.n_big
        print(json.dumps(run_matrix_free(args.run, n, batch, args.k, args.tol)))
        return

    common = ["--n", str(args.n), "--n-big", str(args.n_big), "--k", str(args.k)]
    common += ["--tol", str(args.tol), "--batch-size", str(args.batch_size)]
    common += ["--kernel-batch-size", str(args.kernel_batch_size)]
    results = []
    for case in ["formed", "matrix_free"] + ([] if args.skip_big else ["matrix_free_big"]):
        results.append(_subprocess(common + ["--run", case]))
        print({key: v for key, v in results[-1].items() if key != "eigenvalues"}, file=sys.stderr)
    ref, mf = results[0]["eigenvalues"], results[1]["eigenvalues"]
    rel = [abs(a - b) / abs(b) for a, b in zip(mf, ref, strict=True)]
    accuracy = dict(
        n=args.n,
        k=args.k,
        max_rel_diff=max(rel),
        rel_diff=rel,
        max_diff_over_lambda_max=max(abs(a - b) for a, b in zip(mf, ref, strict=True)) / ref[0],
        target=1e-4,
        met=max(rel) <= 1e-4,
        trace_rel_diff=abs(results[1]["trace"] - results[0]["trace"]) / results[0]["trace"],
    )
    import jax

    meta = dict(
        jax=jax.__version__,
        device=str(jax.devices()[0]),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        model="MLP 784-1000-1, ReLU, N(0, 1/fan_in) weights, zero biases, float32",
    )
    out = pathlib.Path(args.out)
    out.write_text(json.dumps(dict(meta=meta, accuracy=accuracy, results=results), indent=1))
    print(f"jax {meta['jax']}, {meta['device']}, {meta['machine']}, {meta['date']}\n")
    print(
        f"Top-{args.k} at N = {args.n}: max relative difference matrix-free vs eigvalsh of the "
        f"formed kernel {accuracy['max_rel_diff']:.2e} (target 1e-4: "
        f"{'met' if accuracy['met'] else 'NOT met'}); trace {accuracy['trace_rel_diff']:.1e}\n"
    )
    print(
        "| case | N | products (batch) | time s | matvecs | s / matvec | first product s "
        "| peak RSS MB (baseline) | kernel GB | λ_1 | λ_k | load before → after |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if r["case"] == "formed":
            how = f"formed, batch {r['kernel_batch_size']}; eigvalsh"
            time_s = f"{r['total_s']} ({r['form_s']} + {r['eigvalsh_s']})"
            mv, per, first, gb = "—", "—", "—", f"{r['kernel_gb']} (formed)"
        else:
            how = f"matrix-free ({r['batch_size'] or 'unbatched'})"
            time_s = str(r["eigsh_s"])
            mv, per, first = r["matvecs"], r["s_per_matvec"], r["first_product_s"]
            gb = f"{r['kernel_never_formed_gb']} (never formed)"
        print(
            f"| {r['case']} | {r['n']} | {how} | {time_s} | {mv} | {per} | {first} | "
            f"{r['peak_rss_mb']} ({r['baseline_rss_mb']}) | {gb} | {r['eigenvalues'][0]:.6g} | "
            f"{r['eigenvalues'][-1]:.6g} | {r['load_before'][0]} → {r['load_after'][0]} |"
        )


if __name__ == "__main__":
    main()
