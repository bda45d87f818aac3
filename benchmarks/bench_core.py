"""Times ntk_core's implementations against a naive vmap(jacrev) + einsum baseline.

Separates trace+lower, compile and warm run (blocking until ready) for each case, and
records the JAX version, the device and the peak resident memory of the process.
Writes ``results_core.json`` and prints a markdown table. Never run as a test.

    python benchmarks/bench_core.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

import ntk_core
import ntk_flax


def _mlp(widths):
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

    return init, apply


def _lenet():
    model = ntk_flax.LeNet(out_features=1)
    variables = model.init(jax.random.PRNGKey(0), jnp.ones((1, 32, 32, 3)))
    return lambda key: variables["params"], lambda p, x: model.apply({"params": p}, x)


def naive_ntk(apply_fn):
    """The usual hand-written recipe: per-sample Jacobians by vmap(jacrev), one einsum."""

    def kernel(params, x1, x2):
        def single(p, x):
            return apply_fn(p, x[None])[0]

        def flat(x):
            j = jax.vmap(jax.jacrev(single), (None, 0))(params, x)
            return jnp.concatenate(
                [a.reshape(a.shape[:2] + (-1,)) for a in jax.tree.leaves(j)], axis=-1
            )

        return jnp.einsum("iap,jbp->ijab", flat(x1), flat(x2), precision="highest")

    return jax.jit(kernel)


def _time(fn, *args):
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    runs = []
    for _ in range(1):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        runs.append(time.perf_counter() - t)
    return {"trace_lower_s": t1 - t0, "compile_s": t2 - t1, "run_s": min(runs)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller N for a smoke run")
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results_core.json")
    )
    args = parser.parse_args()
    scale = 0.2 if args.quick else 1.0
    cases = [
        ("MLP 784-1000-1, trace_axes=()", *_mlp([784, 1000, 1]), (784,), int(500 * scale)),
        ("LeNet (C1), trace_axes=()", *_lenet(), (32, 32, 3), int(500 * scale)),
    ]
    results = []
    for name, init, apply, shape, n in cases:
        params = init(jax.random.PRNGKey(0))
        x = jax.random.normal(jax.random.PRNGKey(1), (n, *shape))
        row = {"case": name, "N": n}
        for impl in ["structured", "jacobian", "ntvp"]:
            kf = ntk_core.ntk_fn(apply, trace_axes=(), implementation=impl)
            kernel = jax.jit(lambda p, a, b, kf=kf: kf(p, a, b))
            row[impl] = _time(kernel, params, x, x)
        row["naive vmap(jacrev)"] = _time(naive_ntk(apply), params, x, x)
        row["auto chose"] = ntk_core.ntk_fn(apply, trace_axes=()).implementation_for(params, x, x)
        results.append(row)
        print(json.dumps(row), flush=True)
    meta = {
        "jax": jax.__version__,
        "device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
    }
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=2)
    print(f"\njax {meta['jax']} on {meta['device']}, peak RSS {meta['peak_rss_gb']:.1f} GB")
    print("| case | N | implementation | trace+lower s | compile s | warm run s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in results:
        for impl in ["structured", "jacobian", "ntvp", "naive vmap(jacrev)"]:
            t = row[impl]
            print(
                f"| {row['case']} | {row['N']} | {impl} | {t['trace_lower_s']:.2f} | "
                f"{t['compile_s']:.2f} | {t['run_s']:.3f} |"
            )


if __name__ == "__main__":
    main()
