"""How long XLA takes to compile plain matrix products on this backend, by precision and
shape (issue 51: the MLP 784-1000-1 at N = 10 000 compiles its two programs in 19 s on a
TPU v5e against the 5 s target; is that our programs or XLA's products?).

Each row: a fresh ``jax.jit`` of one function, ``lower(...).compile()`` timed (no
compilation cache), then one run. Shapes: the MLP's per-sample layer (10 000 x 784 times
784 x 1 000), the Gram product of its features (10 000 x 1 001 times 1 001 x 10 000),
their CPU-planned pieces (2 500 and 1 250 rows), and a batched matrix-vector product as
the structured features form it (2 500 x 1 001 x 1).

    python benchmarks/compile_dots_tpu.py --out compile_dots.json [--only LABEL ...] [--error]

``six``: the product as six bfloat16 passes at DEFAULT (:func:`six_passes`), the same
arithmetic HIGHEST asks of the MXU, written out.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SHAPES = {
    "layer 10000x784 @ 784x1000": ((10_000, 784), (784, 1_000), None),
    "layer 2500x784 @ 784x1000": ((2_500, 784), (784, 1_000), None),
    "gram 10000x1001 @ 1001x10000": ((10_000, 1_001), (1_001, 10_000), None),
    "gram 1250x1001 @ 1001x1250": ((1_250, 1_001), (1_001, 1_250), None),
    "batched 2500 x (1001x1 @ 1x1)": ((2_500, 1_001, 1), (2_500, 1, 1), "batched"),
    # convolutions (NHWC x HWIO): LeNet's first at N = 500, ResNet-18's stem and a 3x3 block
    "conv lenet 500x32x32x3 * 5x5x3x6": ((500, 32, 32, 3), (5, 5, 3, 6), ("conv", 1, "VALID")),
    "conv stem 8x224x224x3 * 7x7x3x64 /2": ((8, 224, 224, 3), (7, 7, 3, 64), ("conv", 2, "SAME")),
    "conv block 8x56x56x64 * 3x3x64x64": ((8, 56, 56, 64), (3, 3, 64, 64), ("conv", 1, "SAME")),
}


def _top16(x):
    """x with the low 16 bits of its float32 pattern cleared: exact in bfloat16. A bit
    mask, not a round trip through bfloat16, which XLA may fold away (excess precision)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def split3(x):
    """x as hi + mid + lo, each exact in bfloat16 (float32's 24-bit mantissa in 3 x 8)."""
    hi = _top16(x)
    mid = _top16(x - hi)
    lo = x - hi - mid
    return tuple(part.astype(jnp.bfloat16) for part in (hi, mid, lo))


def six_passes(a, b, op=None, parts=jnp.bfloat16):
    """a @ b (or ``op(a, b)``) as the six bfloat16 products that carry float32's precision
    (what HIGHEST does inside the MXU), each at DEFAULT: a compile-time lead (issue 51).
    ``parts``: the parts' dtype (float32 holds them exactly too)."""
    op = op or (lambda u, v, **kw: jnp.dot(u, v, **kw))
    a3, b3 = split3(a), split3(b)
    out = None
    for i, j in ((2, 0), (0, 2), (1, 1), (1, 0), (0, 1), (0, 0)):  # small terms first
        term = op(a3[i].astype(parts), b3[j].astype(parts), preferred_element_type=jnp.float32)
        out = term if out is None else out + term
    return out


PRESETS = {"X6": "BF16_BF16_F32_X6", "X9": "BF16_BF16_F32_X9", "F32": "F32_F32_F32"}


def product(kind, precision):
    if isinstance(kind, tuple):  # a convolution
        _, stride, padding = kind

        def op(a, b, precision=None, preferred_element_type=None):
            return lax.conv_general_dilated(
                a, b, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                precision=precision, preferred_element_type=preferred_element_type)  # fmt: skip

        if precision in ("six", "six32"):
            parts = jnp.float32 if precision == "six32" else jnp.bfloat16
            return lambda a, b: six_passes(a, b, op, parts)
        return lambda a, b: op(a, b, precision=PRESETS.get(precision, precision))
    if precision in ("six", "six32"):
        parts = jnp.float32 if precision == "six32" else jnp.bfloat16
        return lambda a, b: six_passes(a, b, None, parts)
    if precision in PRESETS:
        return lambda a, b: jnp.dot(a, b, precision=PRESETS[precision])
    if kind == "batched":
        return lambda a, b: jnp.einsum("nij,njk->nik", a, b, precision=precision)
    return lambda a, b: jnp.dot(a, b, precision=precision)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="compile_dots.json")
    p.add_argument("--only", nargs="*", help="labels (default: all)")
    p.add_argument("--error", action="store_true", help="error against float64 (host)")
    p.add_argument("--precisions", nargs="*", default=["HIGHEST", "HIGH", "DEFAULT", "six"],
                   help="Precision names, six, six32 (parts held in float32), X6 X9 F32 (presets)")  # fmt: skip
    args = p.parse_args()
    rows = []
    for label, (sa, sb, kind) in SHAPES.items():
        if args.only and label not in args.only:
            continue
        names = [n for n in args.precisions if kind != "batched" or n in lax.Precision.__members__]
        for name in names:
            precision = lax.Precision[name] if name in lax.Precision.__members__ else name
            a = jax.random.normal(jax.random.PRNGKey(0), sa, jnp.float32)
            b = jax.random.normal(jax.random.PRNGKey(1), sb, jnp.float32)
            fn = jax.jit(product(kind, precision))
            t0 = time.perf_counter()
            try:
                compiled = fn.lower(a, b).compile()
            except Exception as e:  # noqa: BLE001 - a preset this backend lacks
                rows.append(dict(what=label, precision=name, error=str(e)[:300]))
                print(json.dumps(rows[-1]), flush=True)
                save(args.out, rows)
                continue
            compile_s = time.perf_counter() - t0
            out = jax.block_until_ready(compiled(a, b))
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(a, b))
            row = dict(what=label, precision=name, compile_s=round(compile_s, 3),
                       run_ms=round(1e3 * (time.perf_counter() - t0), 3))  # fmt: skip
            if args.error and kind != "batched":  # against float64 on the host, 64 rows
                if kind is None:
                    ref = np.asarray(a[:64], np.float64) @ np.asarray(b, np.float64)
                else:  # the first 2 images, the convolution in float64 on the host's CPU
                    cpu = jax.devices("cpu")[0]
                    with jax.enable_x64(True):
                        a64, b64 = (
                            jax.device_put(np.asarray(v, np.float64), cpu) for v in (a[:2], b)
                        )
                        ref = np.asarray(jax.jit(product(kind, lax.Precision.HIGHEST))(a64, b64))
                got = np.asarray(out[: ref.shape[0]], np.float64)
                row["rel_err_vs_float64"] = float(np.abs(got - ref).max() / np.abs(ref).max())
            print(json.dumps(row), flush=True)
            rows.append(row)
            save(args.out, rows)  # after each row: a run cut short keeps what it measured


def save(path, rows):
    """``rows`` and the JAX version, device and date as JSON (also compile_model_tpu.py's)."""
    meta = dict(jax=jax.__version__, device=str(jax.devices()[0].device_kind),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))  # fmt: skip
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
