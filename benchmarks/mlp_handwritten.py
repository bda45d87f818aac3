"""The MLP 784-1000-1 case (N=1000, trace_axes=()) against a hand-written XLA program.

The hand-written program computes the same kernel as ``"structured"`` in one jitted
function: the forward pass, the ReLU mask, then (X Xᵀ + 1) ⊙ (G Gᵀ) + H Hᵀ + 1 (first
layer with its bias, second layer with its bias) in k x k triangle blocks. It is the
reference for how fast this maths runs through XLA on the machine at hand. Two more
programs bound what any assembly of the same products could gain: "first layer only"
(X W1 + b1) and "products only" (X W1 + b1 and the 84 block products of k = 7, returned
unassembled, with no combination). All are compiled ahead of time and timed interleaved
(rounds of 3 calls each), so that load changes hit them alike; prints the best, 25th
percentile and median in ms.

    PYTHONPATH=src python benchmarks/mlp_handwritten.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_core  # noqa: E402
import cases  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ntk_core  # noqa: E402


def triangle(x, g, h, k):
    """(X Xᵀ + 1) ⊙ (G Gᵀ) + H Hᵀ + 1 from the upper k x k blocks, mirrored."""
    n = x.shape[0]
    edges = [i * n // k for i in range(k + 1)]
    blocks = [[None] * k for _ in range(k)]
    for i in range(k):
        for j in range(i, k):
            a, b = slice(edges[i], edges[i + 1]), slice(edges[j], edges[j + 1])
            blocks[i][j] = (x[a] @ x[b].T + 1) * (g[a] @ g[b].T) + h[a] @ h[b].T + 1
    for i in range(k):
        for j in range(i):
            blocks[i][j] = blocks[j][i].T
    return jnp.block(blocks)


def products_only(params, x, k, first_layer_only=False):
    """The matrix products of :func:`handwritten`, neither combined nor assembled."""
    w1, b1 = params["Dense_0"]["kernel"], params["Dense_0"]["bias"]
    w2 = params["Dense_1"]["kernel"]
    z = x @ w1 + b1
    if first_layer_only:
        return z
    g, h = (z > 0) * w2[:, 0], jnp.maximum(z, 0)
    n = x.shape[0]
    edges = [i * n // k for i in range(k + 1)]
    out = []
    for i in range(k):
        for j in range(i, k):
            a, b = slice(edges[i], edges[i + 1]), slice(edges[j], edges[j + 1])
            out += [x[a] @ x[b].T, g[a] @ g[b].T, h[a] @ h[b].T]
    return tuple(out)


def handwritten(params, x, k):
    w1, b1 = params["Dense_0"]["kernel"], params["Dense_0"]["bias"]
    w2 = params["Dense_1"]["kernel"]
    z = x @ w1 + b1
    return triangle(x, (z > 0) * w2[:, 0], jnp.maximum(z, 0), k)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    case = cases.CASES["mlp1"]
    variables = bench_core.init_variables(case)
    params, _ = cases.split_variables(variables)
    params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
    apply = bench_core.apply_fn(case, variables)
    x = jnp.asarray(cases.make_inputs(case, case.n))
    fn = ntk_core.ntk_fn(apply, trace_axes=(), implementation="structured")
    compiled = {"ntk_core structured": jax.jit(fn).lower(params, x).compile()}
    for k in (3, 5, 7):
        f = jax.jit(lambda p, a, k=k: handwritten(p, a, k))
        compiled[f"hand-written, k={k}"] = f.lower(params, x).compile()
    for name, first in (("products only, k=7", False), ("first layer only", True)):
        f = jax.jit(lambda p, a, first=first: products_only(p, a, 7, first))
        compiled[name] = f.lower(params, x).compile()
    ours = np.asarray(compiled["ntk_core structured"](params, x)).reshape(case.n, case.n)
    theirs = np.asarray(compiled["hand-written, k=7"](params, x))
    print(f"max relative difference: {np.abs(ours - theirs).max() / np.abs(ours).max():.1e}")
    times = {name: [] for name in compiled}
    for _ in range(args.rounds):
        for name, c in compiled.items():
            jax.block_until_ready(c(params, x))
            for _ in range(3):
                t = time.perf_counter()
                jax.block_until_ready(c(params, x))
                times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        ms = 1e3 * np.asarray(ts)
        p25, median = np.percentile(ms, 25), np.median(ms)
        print(f"{name}: best {ms.min():.1f}, p25 {p25:.1f}, median {median:.1f} ms")


if __name__ == "__main__":
    main()
