"""The out-of-memory guard on an accelerator (docs/errors.md#out-of-memory): for the MLP
10-16-1 (tanh, O = 1), N chosen so that ``plan()``'s peak estimate (two (N, N) float32
kernels: the kernel and its mirror) is a given share of the device's capacity (its
allocator's ``bytes_limit``), one call each:

* shares > 1: refused with a ValueError before anything runs (the seconds it took);
* shares < 1: the call runs (or fails with the device's own out-of-memory error); its
  peak device memory (``peak_bytes_in_use``, with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``;
  XLA's temporaries are not in it) against the estimate, and 64 entries against
  the closed form NTK_ij = t_i·t_j + (x_i·x_j)(g_i·g_j), t = tanh(x W), g = v ⊙ (1 - t²),
  in float64 on the host.

    python benchmarks/accelerator_memory.py --shares 1.02 0.6 0.9 0.97 --out memory.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import ntk_core
from ntk_core._jax import memory


def apply_fn(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


def closed_form(w, v, x, rows, cols):
    t = np.tanh(x @ w)
    g = v[:, 0] * (1.0 - t**2)
    return np.einsum("ik,ik->i", t[rows], t[cols]) + np.einsum(
        "ij,ij->i", x[rows], x[cols]
    ) * np.einsum("ik,ik->i", g[rows], g[cols])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shares", type=float, nargs="+", default=[1.02, 0.6, 0.9, 0.97])
    parser.add_argument("--out", default="memory.json")
    args = parser.parse_args()
    device = jax.local_devices()[0]
    have = memory.capacity(device)
    rng = np.random.default_rng(0)
    w64, v64 = rng.normal(size=(10, 16)) / 3.0, rng.normal(size=(16, 1)) / 4.0
    params = {"w": jnp.asarray(w64, jnp.float32), "v": jnp.asarray(v64, jnp.float32)}
    f = ntk_core.ntk_fn(apply_fn)
    results = dict(device=str(device), capacity_bytes=have, runs=[])
    print(f"{device}: capacity {have} bytes", flush=True)
    for share in args.shares:
        n = int(math.sqrt(share * have / 8))
        x64 = rng.normal(size=(n, 10))
        x = jnp.asarray(x64, jnp.float32)
        plan = ntk_core.plan(apply_fn, params, x)
        estimate = next(
            e.memory_bytes for e in plan.estimates if e.implementation == plan.implementation
        )
        row = dict(share=share, n=n, kernel_bytes=4 * n * n, estimate_bytes=estimate)
        start = time.perf_counter()
        try:
            k = jax.block_until_ready(f(params, x))
        except ValueError as e:
            row.update(outcome="refused", message=str(e))
        except Exception as e:  # noqa: BLE001 - what the device says beyond the guard
            row.update(outcome=type(e).__name__, message=str(e)[:300])
        else:
            i, j = rng.integers(0, n, 64), rng.integers(0, n, 64)
            got = np.asarray(k[i, j], np.float64)
            want = closed_form(w64, v64, x64, i, j)
            stats = device.memory_stats() or {}
            row.update(
                outcome="ran",
                peak_bytes=stats.get("peak_bytes_in_use"),
                max_rel_error=float(np.max(np.abs(got - want)) / np.max(np.abs(want))),
            )
            del k
        row["seconds"] = round(time.perf_counter() - start, 2)
        print(json.dumps(row), flush=True)
        results["runs"].append(row)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
