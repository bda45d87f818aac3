"""Out-of-core kernels (``out=``, issue 19): time, peak memory and the cost of a resume.

Cases, each in its own Python process (peak resident memory ``ru_maxrss`` is its own):

* ``in_memory``: MLP 784-1000-1, ``trace_axes=()``, N x N in memory
  (``batch_size="auto"``), N = ``--n-memory`` (10 000): the reference rate;
* ``out``: the same MLP, N x N written to a ``.npy`` file (``out=``), N = ``--n``
  (30 000: a 3.6 GB file);
* ``mc_in_memory``, ``mc_out``: Monte Carlo kernels of 3 initialisations at N =
  ``--n-memory``, in memory and to files (``out=``: the running sums on disk);
* ``resume``: the ``out`` case killed (SIGKILL) once its manifest lists half the tiles,
  then the same call with ``resume=True``; the total (both processes) against the
  uninterrupted ``out`` run, ``--repeat`` times interleaved (median reported).

Then the projected time of a 100 000 x 100 000 kernel on this machine from the measured
rate per entry (the file would take 40 GB). Writes ``results_out_of_core.json`` and
prints a Markdown table. Needs about 2.5 x the file size of free disk in ``--folder``.
Never run as a test.

    python benchmarks/bench_out_of_core.py                       # N = 30 000
    python benchmarks/bench_out_of_core.py --n 12000 --n-memory 6000   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

_WORKER = r"""
import json, os, resource, sys, time
import jax, jax.numpy as jnp, numpy as np
import ntk_core

n, path, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
# numpy's generator: jax.random compiles a program per shape in every process (1.5 s of
# each start-up here), which a job loading its data does not pay
rng = np.random.default_rng(0)
params = [{"w": rng.standard_normal((784, 1000), np.float32) / 28.0,
           "b": np.zeros(1000, np.float32)},
          {"w": rng.standard_normal((1000, 1), np.float32) / 31.6,
           "b": np.zeros(1, np.float32)}]

def apply(params, x):
    h = jax.nn.relu(x @ params[0]["w"] + params[0]["b"])
    return h @ params[1]["w"] + params[1]["b"]

x = rng.standard_normal((n, 784), np.float32)
options = dict(trace_axes=(), batch_size="auto", progress=False)
if mode in ("out", "mc_out"):
    options.update(out=path, resume=True)
kernel = ntk_core.ntk_fn(apply, **options)
plan = kernel.plan(params, x)
start = time.perf_counter()
if mode.startswith("mc_"):  # Monte Carlo: 3 initialisations, the running sums
    def init(key):
        k0, k1 = jax.random.split(key)
        return [{"w": jax.random.normal(k0, (784, 1000)) / 28.0, "b": jnp.zeros(1000)},
                {"w": jax.random.normal(k1, (1000, 1)) / 31.6, "b": jnp.zeros(1)}]
    k = ntk_core.monte_carlo_kernels(init, apply, x, key=jax.random.PRNGKey(0),
                                     n_samples=3, **options).ntk
else:
    k = kernel(params, x)
seconds = time.perf_counter() - start
check = float(np.asarray(k[n - 1, n - 2]).ravel()[0])  # touches the file's last rows
print(json.dumps({
    "n": n, "mode": mode, "seconds": seconds, "tiles": plan.tiling.tiles,
    "tile": [plan.tiling.b1, plan.tiling.b2],
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "check": check, "devices": len(jax.local_devices()), "backend": jax.default_backend(),
    "device": str(jax.local_devices()[0].device_kind),
    "device_peak_bytes": (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
}))
"""


def _run(n, path, mode):
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-c", _WORKER, str(n), path, mode],
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def _done(path):
    try:
        with open(path + ".manifest.json") as f:
            return len(json.load(f)["done"])
    except (OSError, ValueError, KeyError):
        return 0


def _killed_at_half(n, path, tiles):
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(n), path, "out"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while _done(path) < tiles // 2 and child.poll() is None:
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    return time.perf_counter() - start, _done(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30_000)
    parser.add_argument("--n-memory", type=int, default=10_000)
    parser.add_argument("--folder", default=tempfile.gettempdir())
    parser.add_argument("--out", default=os.path.join(HERE, "results_out_of_core.json"))
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="uninterrupted and killed-and-resumed runs, interleaved (this machine's "
        "speed varies by 10-20%% from minute to minute; the median ratio is reported)",
    )
    args = parser.parse_args()
    path = os.path.join(args.folder, f"ntk_bench_{os.getpid()}.npy")
    results = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}

    def clean():
        for name in (path, path + ".manifest.json"):
            if os.path.exists(name):
                os.unlink(name)

    runs = []
    try:
        results["load_before"] = os.getloadavg()[0]
        memory = _run(args.n_memory, path, "in_memory")
        for _ in range(args.repeat):
            clean()
            out = _run(args.n, path, "out")
            clean()
            killed_s, done = _killed_at_half(args.n, path, out["tiles"])
            resumed = _run(args.n, path, "out")
            ratio = (killed_s + resumed["process_s"]) / out["process_s"]
            runs.append(
                {
                    "out": out,
                    "killed_after_s": killed_s,
                    "tiles_done": done,
                    "resumed": resumed,
                    "ratio": ratio,
                }  # fmt: skip
            )
        clean()
        mc_memory = _run(args.n_memory, path, "mc_in_memory")
        mc_out = _run(args.n_memory, path, "mc_out")
        results["load_after"] = os.getloadavg()[0]
    finally:
        clean()
        stem = path[:-4]
        for kind in ("nngp", "ntk"):
            for name in (f"{stem}.{kind}.npy", f"{stem}.{kind}.npy.manifest.json"):
                if os.path.exists(name):
                    os.unlink(name)
    run = sorted(runs, key=lambda r: r["ratio"])[len(runs) // 2]  # the median
    out, resumed = run["out"], run["resumed"]
    killed_s, done = run["killed_after_s"], run["tiles_done"]
    per_entry_memory = memory["seconds"] / memory["n"] ** 2
    per_entry_out = out["seconds"] / out["n"] ** 2
    results.update(
        in_memory=memory,
        runs=runs,
        out=out,
        resume={"killed_after_s": killed_s, "tiles_done": done, "resumed": resumed},
        seconds_per_entry={"in_memory": per_entry_memory, "out": per_entry_out},
        resume_total_over_uninterrupted=run["ratio"],
        resume_ratios=[r["ratio"] for r in runs],
        projected_100k_s=per_entry_out * 1e10,
        monte_carlo={"in_memory": mc_memory, "out": mc_out},
    )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("| case | N | tiles (tile) | seconds | s per 1e6 entries | peak RSS MB |")
    print("| --- | --- | --- | --- | --- | --- |")
    cases = (
        ("in memory", memory),
        ("out= file", out),
        ("Monte Carlo (3 samples) in memory", mc_memory),
        ("Monte Carlo (3 samples) to files", mc_out),
    )
    for name, r in cases:
        print(
            f"| {name} | {r['n']} | {r['tiles']} ({r['tile'][0]}) | {r['seconds']:.1f} | "
            f"{r['seconds'] / r['n'] ** 2 * 1e6:.4f} | {r['peak_rss_mb']:.0f} |"
        )
    print(
        f"\nresume: killed after {killed_s:.1f} s with {done} of {out['tiles']} tiles done; "
        f"the resumed process took {resumed['process_s']:.1f} s (its call "
        f"{resumed['seconds']:.1f} s); total / uninterrupted process "
        f"{results['resume_total_over_uninterrupted']:.2f}x (median of "
        f"{', '.join(f'{r:.2f}' for r in results['resume_ratios'])}). "
        f"Projected 100 000 x 100 000: "
        f"{results['projected_100k_s'] / 3600:.1f} h on this machine."
    )


if __name__ == "__main__":
    main()
