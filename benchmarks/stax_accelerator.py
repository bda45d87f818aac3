"""Infinite-width kernels of ntk_core.stax on an accelerator: the 21-layer 3x3 ReLU CNN of
neural-tangents' README (32x32x3 inputs) with a GlobalAvgPool readout (the full (HW)²
covariance, O(N²·(HW)²)) and with a Flatten readout (the spatial diagonal only), float32,
x2=None; first call (trace, compile, run) and warm time, time per NTK entry, peak device
memory; the error of a 2-sample sub-Gram against float64 on the host.

    python benchmarks/stax_accelerator.py [--n-gap 8] [--n-flatten 64] [--out stax_tpu.json]

neural-tangents published (README, float32, per NTK entry): GlobalAvgPool 2.70 ms on a
V100, 2.30 ms on a TPU v3; Flatten 0.00465 ms (V100), 0.00106 ms (TPU v3).
"""

import argparse
import json
import time

import jax

jax.config.update("jax_enable_x64", True)  # the host reference; the device runs float32
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ntk_core import stax  # noqa: E402


def cnn(readout, depth=21, channels=1, scan=True):
    """21 x [Conv(3x3, SAME), Relu] then the readout and Dense(1); ``scan``: the 20 repeated
    layers as stax.repeat (one compiled step) rather than serial (unrolled)."""
    conv = stax.Conv(channels, (3, 3), padding="SAME")
    block = stax.serial(stax.Relu(), conv)
    body = stax.repeat(block, depth - 1) if scan else stax.serial(*[block] * (depth - 1))
    return stax.serial(conv, body, stax.Relu(), readout, stax.Dense(1))


def measure(name, kernel_fn, x, repeats=3):
    device = jax.devices()[0]
    x = jax.device_put(jnp.asarray(x, jnp.float32), device)
    t0 = time.perf_counter()
    k = kernel_fn(x, None, "ntk")
    k.block_until_ready()
    first = time.perf_counter() - t0
    warm = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        kernel_fn(x, None, "ntk").block_until_ready()
        warm.append(time.perf_counter() - t0)
    stats = device.memory_stats() or {}
    n = x.shape[0]
    row = dict(case=name, n=n, first_s=first, warm_s=min(warm), ms_per_entry=1e3 * min(warm) / n**2,
               peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30, platform=device.platform,
               device=str(device.device_kind))
    # the host's float64 kernel of the first two samples
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        ref = np.asarray(kernel_fn(np.asarray(x[:2], np.float64), None, "ntk"))
    got = np.asarray(k)[:2, :2]
    row["rel_err_vs_float64"] = float(np.abs(got - ref).max() / np.abs(ref).max())
    print(json.dumps(row), flush=True)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n-gap", type=int, default=8)
    p.add_argument("--n-flatten", type=int, default=64)
    p.add_argument("--serial", action="store_true", help="also the unrolled serial GAP network")
    p.add_argument("--out", default="stax_accelerator.json")
    args = p.parse_args()
    x = np.random.RandomState(0).randn(max(args.n_gap, args.n_flatten), 32, 32, 3)
    rows = [
        measure("cnn21-flatten (repeat)", cnn(stax.Flatten())[2], x[: args.n_flatten]),
        measure("cnn21-gap (repeat)", cnn(stax.GlobalAvgPool())[2], x[: args.n_gap]),
    ]
    if args.serial:
        rows.append(measure("cnn21-gap (serial)", cnn(stax.GlobalAvgPool(), scan=False)[2], x[: args.n_gap]))
    meta = dict(jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
