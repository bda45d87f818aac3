"""The convolution's window sums of ntk_core.stax on an accelerator (issue 49: the 21-layer
3x3 ReLU CNN with a GlobalAvgPool readout at <= 1 ms per NTK entry on one TPU v5e).

A TPU holds float32 arrays in 8 x 128 tiles of the two minor-most axes, so the full
spatial covariance (N1, N2, H, H', W, W') = (..., 32, 32) moves 4x its bytes, and each of
the k strided slices of a window sum is its own pass. This script times every variant of
:mod:`ntk_core._infinite.windows` (``windows.using(method)``, read
when a network is traced; both exact, the same sums in another order):

1. the whole network: 21 x [Conv(3x3, SAME), Relu] (the last 20 as ``stax.repeat``), then
   GlobalAvgPool and Dense(1), x2=None, ``get="ntk"``, float32, N = ``--n``: first call
   (trace, compile, run) and fastest of ``--repeats`` warm calls, ms per NTK entry, and the
   largest difference from the first variant's kernel (the CPU-default ``slices``);
2. a micro-benchmark on one layer's state, ``--pairs`` pairs of (H, H', W, W') positions
   (64: N1 = N2 = 8): the Conv alone and Relu+Conv (one scanned step of the network), and
   two plain passes over the same bytes (x·2 in the (..., W, W') layout and merged to
   (..., W·W')): the memory's speed and what the tiles' padding costs.

The float64 kernel of the first two samples on the host checks the default's error. The
device runs with x64 off (as a user's float32 call), but for one variant: the setting of
stax_accelerator.py's measurement (11.3 ms per entry). A prototype of the network on a
merged (H·H', W·W') state layout (whole tiles; not the library's layout) shows what
moving ``state.Kern`` to it would buy.

    export PYTHONPATH=$PWD/src:$PYTHONPATH
    python benchmarks/stax_windows_tpu.py --out stax_windows_tpu.json [--n 8] [--budget-s 420]
    python benchmarks/stax_windows_tpu.py --n 2 --size 8 --pairs 4   # a CPU smoke run

Each row is printed as a JSON line when measured and the file is rewritten after each,
so a run cut short keeps what it measured; ``--budget-s`` stops starting new variants.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ntk_core import stax
from ntk_core._infinite import closed_forms, fused_conv, windows
from ntk_core._infinite.state import Kern, inputs_kernel

# (label, how): the first is the reference of the others. The run of 2026-12-07 09:14 UTC
# (benchmarks/README.md) also timed a reduce_window, a diagonal-filter convolution, the
# NNGP and NTK stacked through one sum, and barriers before each layer: all were slower
# than "slices" on the TPU, and were removed from the library after it.
VARIANTS = [
    # the library's default on a TPU: the whole CNN-GAP in one kernel per pair, from the
    # inputs (_infinite/fused_conv.network)
    ("fused", dict(method="slices")),
    # the 20 repeated [Relu, Conv] steps alone in one kernel, the rest XLA's
    ("fused, repeats only", dict(method="slices", layers_only=True)),
    ("slices", dict(method="slices", fused=False)),
    # 64-bit index arithmetic is emulated on a TPU: stax_accelerator.py runs with x64 on
    ("slices (x64 on)", dict(method="slices", x64=True, fused=False)),
    ("flat", dict(method="flat", fused=False)),
]


def conv_layer():
    return stax.Conv(1, (3, 3), padding="SAME", W_std=2**0.5, b_std=0.05)


def cnn(depth=21):
    """neural-tangents' README CNN, the 20 repeated layers scanned (as stax_accelerator.py)."""
    conv = conv_layer()
    body = stax.repeat(stax.serial(stax.Relu(), conv), depth - 1)
    return stax.serial(conv, body, stax.Relu(), stax.GlobalAvgPool(), stax.Dense(1))


def timed(fn, *args, repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    warm = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        warm.append(time.perf_counter() - t0)
    return out, first, min(warm)


def merged_layout_cnn(x, depth=21, settled=False):
    """A prototype of a state layout the library does not have (yet): the same network's
    NTK with each pair's covariance held as (H·H', W·W') = (1024, 1024), whole 8 x 128
    tiles, the convolution's shared offset δ a shift by δ·(S + 1) along a merged axis with
    the positions whose partner falls outside masked (SAME, stride 1, 3x3). What moving
    ``state.Kern`` to this layout would buy; checked against the library's kernel."""
    n, size = x.shape[0], x.shape[1]
    s2 = size * size
    pos = jnp.arange(s2)
    h, g = pos // size, pos % size

    def conv(a, axis):  # a[..., f, ...] on axis ``axis`` (negative) of S² merged positions
        out = 0
        for d in (-1, 0, 1):
            keep = ((h + d >= 0) & (h + d < size) & (g + d >= 0) & (g + d < size)).astype(a.dtype)
            shift = d * (size + 1)
            widths = [(0, 0, 0)] * a.ndim
            widths[axis] = (-shift, shift, 0)  # out[f] = a[f + shift], zero beyond the ends
            shape = [1] * a.ndim
            shape[axis] = s2
            out = out + lax.pad(a, jnp.zeros((), a.dtype), widths) * keep.reshape(shape)
        return out / 3

    def spread(a):
        return conv(conv(a, -2), -1)

    def affine(nngp, ntk, cov):
        nngp = 2.0 * spread(nngp) + 0.0025
        return nngp, nngp + 2.0 * spread(ntk), 2.0 * spread(cov) + 0.0025

    relu = closed_forms.ab_relu(0.0, 1.0)

    def nonlinearity(nngp, ntk, cov):
        v = cov[:, :: size + 1, :: size + 1]  # (N, H, W): each position with itself
        first = jnp.repeat(jnp.repeat(v, size, 1), size, 2)  # v[i, hh' // S, ww' // S]
        second = jnp.tile(v, (1, size, size))  # v[j, hh' % S, ww' % S]
        q12 = nngp.at[jnp.arange(n), jnp.arange(n)].set(cov)  # as the library: ρ = 1 there
        new, dot = relu(first[:, None], q12, second[None])
        return new, dot * ntk, relu(first, cov, second)[0]

    def merged(a, b):
        k = jnp.einsum("nhwc,mgvc->nmhgwv", a, b, precision="highest") / a.shape[-1]
        return k.reshape(k.shape[0], k.shape[1], s2, s2)

    nngp = merged(x, x)
    cov = merged(x, x)[jnp.arange(n), jnp.arange(n)]
    state = affine(nngp, jnp.zeros_like(nngp), cov)

    def step(state, _):
        state = nonlinearity(*state)
        if settled:
            state = lax.optimization_barrier(state)
        return affine(*state), None

    state, _ = lax.scan(step, state, None, length=depth - 1)
    nngp, ntk, _ = nonlinearity(*state)
    nngp, ntk = nngp.mean((-2, -1)), ntk.mean((-2, -1))
    ntk = nngp + ntk  # Dense(1), W_std = 1, no bias
    return (ntk + ntk.T) / 2


class Report:
    def __init__(self, path, meta):
        self.path, self.data = path, dict(meta=meta, network=[], layer=[], pieces=[])

    def add(self, part, row):
        print(json.dumps({"part": part, **row}), flush=True)
        self.data[part].append(row)
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1)


def _network_row(label, n, first, warm) -> dict:
    """One variant's figures: first call, fastest warm call, ms per NTK entry (x2 = None)."""
    return dict(
        variant=label,
        n=n,
        first_s=round(first, 3),
        warm_s=round(warm, 5),
        ms_per_entry=round(1e3 * warm / n**2, 4),
    )


def whole_network(args, report, deadline, device):
    x = np.random.RandomState(0).randn(args.n, args.size, args.size, 3)
    xd = jax.device_put(jnp.asarray(x, jnp.float32), device)
    base = None
    for label, how in VARIANTS:
        if args.variants and label not in args.variants:
            continue
        if time.time() > deadline:
            report.add("network", dict(variant=label, skipped="--budget-s reached"))
            continue
        kernel_fn = cnn()[2]  # a fresh kernel function: its own trace and compilation
        how = dict(how)
        x64 = jax.enable_x64(True) if how.pop("x64", False) else contextlib.nullcontext()
        scan = fused_conv.off() if not how.pop("fused", True) else contextlib.nullcontext()
        if how.pop("layers_only", False):
            scan = fused_conv.layers_only()
        try:
            with windows.using(**how), x64, scan:
                k, first, warm = timed(
                    lambda a, f=kernel_fn: f(a, None, "ntk"), xd, repeats=args.repeats
                )
        except Exception as e:  # noqa: BLE001 - one variant failing must not stop the others
            report.add("network", dict(variant=label, error=f"{type(e).__name__}: {e}"[:400]))
            continue
        k = np.asarray(k, np.float64)
        row = _network_row(label, args.n, first, warm)
        if base is None:
            base = k
        row["max_rel_diff_vs_first"] = float(np.abs(k - base).max() / np.abs(base).max())
        report.add("network", row)
    for settled in (False, True):
        label = "prototype: merged (HH', WW') layout" + (" +settled" if settled else "")
        if args.variants and label not in args.variants:
            continue
        if time.time() > deadline:
            report.add("network", dict(variant=label, skipped="--budget-s reached"))
            continue
        try:
            fn = jax.jit(lambda a, st=settled: merged_layout_cnn(a, settled=st))
            k, first, warm = timed(fn, xd, repeats=args.repeats)
        except Exception as e:  # noqa: BLE001
            report.add("network", dict(variant=label, error=f"{type(e).__name__}: {e}"[:400]))
            continue
        k = np.asarray(k, np.float64)
        row = _network_row(label, args.n, first, warm)
        if base is not None:
            row["max_rel_diff_vs_first"] = float(np.abs(k - base).max() / np.abs(base).max())
        report.add("network", row)
    if base is not None and not args.no_host_reference:
        with jax.default_device(jax.devices("cpu")[0]), jax.enable_x64(True):
            ref = np.asarray(cnn()[2](np.asarray(x[:2], np.float64), None, "ntk"))
        err = float(np.abs(base[:2, :2] - ref).max() / np.abs(ref).max())
        report.add("network", dict(variant=VARIANTS[0][0], rel_err_2x2_vs_host_float64=err))


def one_layer(args, report, deadline, device):
    """One layer's state: ``pairs`` = N1·N2 pairs of (S, S, S, S) positions."""
    n1 = int(round(args.pairs**0.5))
    n2 = args.pairs // n1
    s = args.size
    rng = np.random.RandomState(1)
    x = rng.randn(max(n1, n2), s, s, 3).astype(np.float32)
    # a valid covariance (the inputs' kernel after one convolution), float32 on the device
    k0 = inputs_kernel(jnp.asarray(x[:n1]), jnp.asarray(x[:n2]), False, True)
    arrays = [
        jax.device_put(jnp.asarray(a, jnp.float32), device)
        for a in (k0.nngp, k0.nngp * 0.5, k0.cov1, k0.cov2)
    ]

    def state(nngp, ntk, cov1, cov2):
        return Kern(
            nngp, ntk, cov1, cov2, spatial=(s, s), diagonal=False, gaussian=True, channels=1
        )

    relu_conv = stax.serial(stax.Relu(), conv_layer())[2].rule
    conv = conv_layer()[2].rule
    gib = 2 * 4 * args.pairs * s**4 / 2**30  # nngp and ntk, float32, unpadded

    # the memory's own speed: one read and one write of nngp and ntk, as held and merged
    copies = {
        "copy x2 (.., W, W')": lambda a, b: (a * 2, b * 2),
        "copy x2 (.., W*W')": lambda a, b: (
            a.reshape(*a.shape[:-2], -1) * 2,
            b.reshape(*b.shape[:-2], -1) * 2,
        ),
    }
    for label, fn in copies.items():
        _, first, warm = timed(jax.jit(fn), arrays[0], arrays[1], repeats=args.repeats + 2)
        report.add(
            "layer",
            dict(
                what=label,
                pairs=args.pairs,
                warm_ms=round(1e3 * warm, 3),
                us_per_pair=round(1e6 * warm / args.pairs, 2),
                GBps_unpadded=round(2 * gib * 2**30 / warm / 1e9, 1),
            ),
        )
    base = {}
    for label, how in VARIANTS:
        if (args.variants and label not in args.variants) or set(how) != {"method", "fused"}:
            continue
        for what, rule in (("conv", conv), ("relu+conv", relu_conv)):
            if time.time() > deadline:
                report.add("layer", dict(what=what, variant=label, skipped="--budget-s reached"))
                continue
            try:
                with windows.using(how["method"]):
                    fn = jax.jit(
                        lambda a, b, c, d, r=rule: (lambda k: (k.nngp, k.ntk))(
                            r.transform(state(a, b, c, d))
                        )
                    )
                    out, first, warm = timed(fn, *arrays, repeats=args.repeats + 2)
            except Exception as e:  # noqa: BLE001
                report.add(
                    "layer", dict(what=what, variant=label, error=f"{type(e).__name__}: {e}"[:400])
                )
                continue
            out = np.asarray(out[1], np.float64)
            ref = base.setdefault(what, out)
            report.add(
                "layer",
                dict(
                    what=what,
                    variant=label,
                    pairs=args.pairs,
                    first_s=round(first, 3),
                    warm_ms=round(1e3 * warm, 3),
                    us_per_pair=round(1e6 * warm / args.pairs, 2),
                    x21_ms_per_pair=round(21e3 * warm / args.pairs, 3),
                    max_rel_diff_vs_first=float(np.abs(out - ref).max() / np.abs(ref).max()),
                ),
            )


def pieces(args, report, deadline, device):
    """The network's time by piece when its layers run one by one (x2 = None, N = ``--n``):
    the inputs' kernel, the first Conv, the 20 repeated [Relu, Conv] steps, the readout
    (Relu, GlobalAvgPool, Dense), each its own jitted program; the repeats fused and as a
    scan (a Conv alone as a one-step kernel measured no faster, benchmarks/README.md)."""
    x = np.random.RandomState(0).randn(args.n, args.size, args.size, 3)
    xd = jax.device_put(jnp.asarray(x, jnp.float32), device)
    conv = conv_layer()
    rules = dict(
        conv=conv[2].rule,
        repeat=stax.repeat(stax.serial(stax.Relu(), conv), 20)[2].rule,
        readout=stax.serial(stax.Relu(), stax.GlobalAvgPool(), stax.Dense(1))[2].rule,
    )
    flags = dict(spatial=(args.size, args.size), diagonal=False, channels=1)

    def arrays(k):
        return (k.nngp, k.ntk, k.cov1)

    start = jax.jit(lambda a: arrays(inputs_kernel(a, None, False, True)))
    state = jax.block_until_ready(start(xd))
    _, first, warm = timed(start, xd, repeats=args.repeats)
    report.add("pieces", dict(piece="inputs' kernel", n=args.n, first_s=first, warm_ms=1e3 * warm))
    for piece, gaussian in (("conv", False), ("repeat", True), ("readout", True)):
        # only the repeats have a fused form here (the network's is the whole-network run)
        variants = (("fused", contextlib.nullcontext), ("scan", fused_conv.off))
        for label, scan in variants if piece == "repeat" else (("xla", contextlib.nullcontext),):
            if time.time() > deadline:
                report.add("pieces", dict(piece=piece, variant=label, skipped="--budget-s"))
                continue
            rule = rules[piece]

            def fn(a, b, c, rule=rule, gaussian=gaussian, piece=piece):
                k = Kern(a, b, c, None, gaussian=gaussian, **flags)
                out = rule.transform(k)
                return out.ntk if piece == "readout" else arrays(out)

            with scan():
                out, first, warm = timed(jax.jit(fn), *state, repeats=args.repeats)
            report.add(
                "pieces",
                dict(piece=piece, variant=label, n=args.n, first_s=round(first, 3),
                     warm_ms=round(1e3 * warm, 3), ms_per_entry=round(1e3 * warm / args.n**2, 4)),
            )  # fmt: skip
            if label != "scan" and piece != "readout":
                next_state = out
        state = next_state if piece != "readout" else state


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8, help="samples of the whole network (x2=None)")
    p.add_argument("--size", type=int, default=32, help="the images' height and width")
    p.add_argument("--pairs", type=int, default=64, help="pairs of the one-layer benchmark")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="*", default=None, help="labels (default: all)")
    p.add_argument(
        "--parts", nargs="*", default=["network", "layer"], choices=["network", "layer", "pieces"]
    )
    p.add_argument("--budget-s", type=float, default=400.0, help="start no variant after this")
    p.add_argument("--no-host-reference", action="store_true")
    p.add_argument("--out", default="stax_windows_tpu.json")
    args = p.parse_args()
    start = time.time()
    device = jax.devices()[0]
    meta = dict(
        jax=jax.__version__,
        platform=device.platform,
        device=str(device.device_kind),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        args=vars(args),
    )
    print(json.dumps(meta), flush=True)
    report = Report(args.out, meta)
    if "network" in args.parts:  # its share of the budget: the layer's part is quicker
        share = 0.65 if "layer" in args.parts else 1.0
        whole_network(args, report, start + share * args.budget_s, device)
    if "layer" in args.parts:
        one_layer(args, report, start + args.budget_s, device)
    if "pieces" in args.parts:
        pieces(args, report, start + args.budget_s, device)
    stats = device.memory_stats() or {}
    report.data["meta"]["peak_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30
    report.data["meta"]["total_s"] = round(time.time() - start, 1)
    report.add("layer", dict(what="done", total_s=report.data["meta"]["total_s"]))


if __name__ == "__main__":
    main()
