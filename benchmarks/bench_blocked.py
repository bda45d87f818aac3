"""The blocked Gram engine (``batch_size=``): time and peak memory of large Gram matrices.

Each case runs in its own Python process so that its peak resident memory
(``ru_maxrss``) is its own; the driver collects the results, writes
``results_blocked.json`` and prints a markdown table. The load average of the machine
(``os.getloadavg()``) is recorded before and after each case: on a shared machine the
times are only as good as that load. Never run as a test.

    python benchmarks/bench_blocked.py                 # every case
    python benchmarks/bench_blocked.py --case mlp      # one case, printed as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

CASES = {
    # name: (model, N, batch_size, store_on_device, description)
    "mlp_10k": ("mlp", 10_000, "auto", False, "MLP 784-1000-1, 10000 x 10000, x2=None"),
    "lenet_5k": ("lenet", 5_000, "auto", False, "LeNet (C1), 5000 x 5000, x2=None"),
    "mlp_2k_one_call": ("mlp", 2_000, None, False, "MLP 784-1000-1, 2000 x 2000, one call"),
    "mlp_2k_batched": ("mlp", 2_000, 500, True, "MLP 784-1000-1, 2000 x 2000, batch 500"),
    "mlp_2k_batched_x2": ("mlp", 2_000, 500, True, "MLP, 2000 x 2000, x2 given, batch 500"),
    "mlp_2k_one_call_x2": ("mlp", 2_000, None, False, "MLP, 2000 x 2000, x2 given, one call"),
}


def _mlp(widths):
    import jax
    import jax.numpy as jnp
    import numpy as np

    def init(key):
        params = []
        for a, b in zip(widths[:-1], widths[1:], strict=True):
            key, sub = jax.random.split(key)
            params.append({"w": jax.random.normal(sub, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)})
        return params

    def apply(params, x):
        for i, layer in enumerate(params):
            x = x @ layer["w"] + layer["b"]
            if i < len(params) - 1:
                x = jax.nn.relu(x)
        return x

    return init(jax.random.PRNGKey(0)), apply, (784,)


def _lenet():
    import jax
    import jax.numpy as jnp

    import ntk_flax

    model = ntk_flax.LeNet(out_features=1)
    variables = model.init(jax.random.PRNGKey(0), jnp.ones((1, 32, 32, 3)))
    return variables["params"], lambda p, x: model.apply({"params": p}, x), (32, 32, 3)


def run_case(name: str) -> dict:
    """One case in this process: first call (compiles) and a warm second call."""
    import jax
    import numpy as np

    import ntk_core

    model, n, batch_size, on_device, description = CASES[name]
    params, apply, shape = _mlp((784, 1000, 1)) if model == "mlp" else _lenet()
    x = np.random.default_rng(0).standard_normal((n, *shape), dtype=np.float32)
    x2 = None
    if name.endswith("_x2"):
        x2 = np.random.default_rng(1).standard_normal((n, *shape), dtype=np.float32)
    kernel = ntk_core.ntk_fn(
        apply,
        trace_axes=(),
        batch_size=batch_size,
        store_on_device=on_device,
        progress=False,
    )
    load_before = os.getloadavg()
    times, k = [], None
    # The MLP: three calls (the first compiles); LeNet at 5000: one call (85 s).
    for _ in range(3 if model == "mlp" else 1 if n >= 5000 else 2):
        del k  # one result held at a time
        t = time.perf_counter()
        k = jax.block_until_ready(kernel(params, x, x2))
        times.append(time.perf_counter() - t)
    return {
        "case": name,
        "description": description,
        "n": n,
        "batch_size": batch_size,
        "store_on_device": on_device,
        "implementation": kernel.implementation_for(params, x[:2], None if x2 is None else x2[:2]),
        "first_call_s": times[0],
        "warm_s": min(times[1:]) if len(times) > 1 else None,
        "calls_s": times,
        "result_type": type(k).__name__,
        "result_shape": list(k.shape),
        "result_mb": k.nbytes / 1e6,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "jax": jax.__version__,
        "device": str(jax.devices()[0]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), help="run one case, print JSON")
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "results_blocked.json"))
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    results = []
    for name in CASES:
        proc = subprocess.run(
            [sys.executable, __file__, "--case", name], capture_output=True, text=True, check=True
        )
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(
            f"{name}: {r['first_call_s']:.2f} s / {r['warm_s']} s, {r['peak_rss_mb']:.0f} MB",
            flush=True,
        )
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    print()
    print(
        "| case | implementation | batch_size | first call s | warm s | peak RSS MB | "
        "load avg (1 min) before/after |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        warm = "-" if r["warm_s"] is None else f"{r['warm_s']:.2f}"
        print(
            f"| {r['description']} | {r['implementation']} | {r['batch_size']} | "
            f"{r['first_call_s']:.2f} | {warm} | "
            f"{r['peak_rss_mb']:.0f} | "
            f"{r['loadavg_before'][0]:.1f} / {r['loadavg_after'][0]:.1f} |"
        )


if __name__ == "__main__":
    main()
