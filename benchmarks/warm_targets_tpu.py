"""Issue 51's warm targets, probed: what a symmetric kernel (x2 = None) gains from
computing only its upper block triangle, and the FCN's warm time over many calls.

    python benchmarks/warm_targets_tpu.py --out results_warm_targets.json [--small]
        [--parts mlp fcn]

``by-hand``: the MLP 784-1000-1 at N = 10 000 (``accelerator_bench.py``'s ``mlp10k``)
written by hand from its closed form, Θ(i, j) = (x_i·x_j + 1)(g_i·g_j) + h_i·h_j + 1
(g: the output's gradient at the hidden pre-activations, h: the hidden activations), in
one jitted program at HIGHEST: all N² entries (three N x N x ~1000 products), and only
the b(b+1)/2 blocks of the upper triangle for b = 2, 3, 4, the lower ones their
transposes. ``mlp``, ``resnet``: ours (``ntk_fn``, one call, the MLP and
``accelerator_bench.py``'s ResNet-18 8 x 8) with the ``VARIANTS`` of the triangular
contraction's smallest block and the features' chunk bytes. The FLOP count of the rate
is the full kernel's, as in ``accelerator_bench.py``. ``fcn``: its FCN 16 x 16 warm, min
and median of 30 calls.
Runs unchanged on a CPU (``--small``), a CUDA GPU or a TPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import accelerator_bench  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def _seconds(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def timed(fn, repeats):
    """(best, median) seconds of ``repeats`` warm calls, after one."""
    _seconds(fn)
    times = [_seconds(fn) for _ in range(repeats)]
    return min(times), statistics.median(times)


def _gram(a, b, c, rows, cols):
    """The closed form's block (rows, cols) from x (a), g (b), h (c)."""
    hi = jax.lax.Precision.HIGHEST
    dot = lambda u, v: jnp.dot(u[rows], v[cols].T, precision=hi)  # noqa: E731
    return (dot(a, a) + 1) * dot(b, b) + dot(c, c) + 1


def by_hand(blocks: int):
    def kernel(x, g, h):
        n = x.shape[0]
        edges = [n * k // blocks for k in range(blocks + 1)]
        cut = [slice(edges[k], edges[k + 1]) for k in range(blocks)]
        upper = {
            (i, j): _gram(x, g, h, cut[i], cut[j]) for i in range(blocks) for j in range(i, blocks)
        }
        rows = [
            jnp.concatenate(
                [upper[(i, j)] if j >= i else upper[(j, i)].T for j in range(blocks)], 1
            )
            for i in range(blocks)
        ]
        return jnp.concatenate(rows, 0)

    return jax.jit(kernel)


def by_hand_part(small, repeats):
    key = "mlp10k"
    _, params, x, _ = accelerator_bench._setup(key, small)
    n = x.shape[0]
    w1, b1 = params["Dense_0"]["kernel"], params["Dense_0"]["bias"]
    w2 = params["Dense_1"]["kernel"]
    z = jnp.dot(x, w1, precision="highest") + b1
    g = (z > 0) * w2[:, 0]
    h = jax.nn.relu(z)
    rows = []
    reference = None
    for blocks in (1, 2, 3, 4):
        fn = by_hand(blocks)
        start = time.perf_counter()
        out = jax.block_until_ready(fn(x, g, h))
        first = time.perf_counter() - start
        best, median = timed(lambda fn=fn: fn(x, g, h), repeats)
        if reference is None:
            reference = out
        diff = float(jnp.max(jnp.abs(out - reference)) / jnp.max(jnp.abs(reference)))
        asym = float(jnp.max(jnp.abs(out - out.T)))
        rate = round(_flop(n, small) / best / 1e12, 2)
        rows.append(dict(part="mlp", variant=f"by hand, {blocks}x{blocks} blocks",
                         first_s=round(first, 2), warm_s=best, median_s=median, tflop_s=rate,
                         diff_from_full=diff, asymmetry=asym))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _flop(n, small):
    widths = (16, 32, 1) if small else accelerator_bench.WIDTHS["mlp10k"]
    return n * n * sum(2 * ((a + 1) + b) for a, b in zip(widths[:-1], widths[1:], strict=True))


#: ``_impl/phases.TRIANGLE_MIN_BLOCK`` (None: as it is) and the features' chunk bytes
#: (``_structured/analysis``'s, CPU's and accelerators' alike; None: as they are) per variant
VARIANTS = {
    "mlp": [(None, None), (None, 2**28), (2**62, None)],
    "resnet": [(None, None), (None, 2**31)],
}


def ntk_fn_part(part, small, repeats):
    import ntk_core
    from ntk_core._impl import phases
    from ntk_core._structured import analysis

    key = "mlp10k" if part == "mlp" else "resnet18"
    apply, params, x1, x2 = accelerator_bench._setup(key, small)
    saved = (
        phases.TRIANGLE_MIN_BLOCK,
        analysis.FEATURE_CHUNK_BYTES,
        analysis.ACCELERATOR_FEATURE_CHUNK_BYTES,
    )
    rows = []
    for min_block, chunk_bytes in VARIANTS[part]:
        phases.TRIANGLE_MIN_BLOCK = min_block or saved[0]
        analysis.FEATURE_CHUNK_BYTES = chunk_bytes or saved[1]
        analysis.ACCELERATOR_FEATURE_CHUNK_BYTES = chunk_bytes or saved[2]
        jax.clear_caches()  # the programs read them when traced
        fn = ntk_core.ntk_fn(apply, trace_axes=())
        start = time.perf_counter()
        out = jax.block_until_ready(fn(params, x1, x2))
        first = time.perf_counter() - start
        best, median = timed(lambda fn=fn: fn(params, x1, x2), repeats)
        row = dict(part=part, triangle_min_block=phases.TRIANGLE_MIN_BLOCK,
                   feature_chunk_bytes=analysis.feature_chunk_bytes(), first_s=round(first, 2),
                   warm_s=best, median_s=median)  # fmt: skip
        if x2 is None:
            n = x1.shape[0]
            k = out.reshape(n, n)
            row["asymmetry"] = float(jnp.max(jnp.abs(k - k.T)))
            row["tflop_s"] = round(_flop(n, small) / best / 1e12, 2)
        row["first_samples"] = np.asarray(out[:2, :2], np.float64).ravel().tolist()
        rows.append(row)
        print(json.dumps(row), flush=True)
        del out
    phases.TRIANGLE_MIN_BLOCK = saved[0]
    analysis.FEATURE_CHUNK_BYTES, analysis.ACCELERATOR_FEATURE_CHUNK_BYTES = saved[1:]
    return rows


def fcn_part(small, repeats):
    import ntk_core

    apply, params, x1, x2 = accelerator_bench._setup("fcn", small)
    fn = ntk_core.ntk_fn(apply, trace_axes=())
    best, median = timed(lambda: fn(params, x1, x2), repeats)
    row = dict(part="fcn", variant="ntk_fn auto", warm_s=best, median_s=median)
    print(json.dumps(row), flush=True)
    return [row]


PARTS = {
    "by-hand": by_hand_part,
    "mlp": lambda small, repeats: ntk_fn_part("mlp", small, repeats),
    "resnet": lambda small, repeats: ntk_fn_part("resnet", small, repeats),
    "fcn": fcn_part,
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="*", default=list(PARTS), choices=list(PARTS))
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--small", action="store_true")
    p.add_argument("--out", default="results_warm_targets.json")
    args = p.parse_args()
    device = jax.devices()[0]
    data = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                device=f"{device.platform} {device.device_kind}", rows=[])  # fmt: skip
    for part in args.parts:
        data["rows"] += PARTS[part](args.small, args.repeats)
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
