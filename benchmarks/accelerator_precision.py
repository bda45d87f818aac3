"""Kernels on an accelerator against a float64 reference computed on the host.

At JAX's default matmul precision a TPU multiplies float32 matrices in bf16 passes and a
GPU may use TF32: a kernel computed there can be wrong in the third digit with no error
raised. The kernels trace the model under their ``precision=`` (``"highest"`` by
default), so Flax models written without ``precision=``, as users write them, must still
give float32-exact kernels. This script measures that on the default device (run it on
the accelerator; on a CPU it is a plain check):

* models: Flax ``ntk_flax.LeNet`` (32x32x3, 1 output), a Flax MLP 784-512-10, a CNN
  whose Dense layer contracts 65 536 features (``--models cnn``) and the BERT-tiny of
  ``bench_core.Bert`` (``--models bert``: token ids, padding mask), all with no
  ``precision=``, ``trace_axes=()``;
* each implementation (jacobian, ntvp, structured), x2=None and x2 given, NTK and NNGP,
  with ``precision="highest"`` (the default) and ``precision="default"`` (to show what the
  option guards against);
* error: max |K - K_ref| / max |K_ref|, where K_ref contracts float32 Jacobians computed
  on the CPU (``tests/reference.py``) in float64 numpy; and the model's own forward pass
  on the device against the host's (dots at "highest"): the part of any error that is the
  device's float32 arithmetic (tanh, exp, GELU), not the kernel's.

    python benchmarks/accelerator_precision.py --out precision.json

Prints one Markdown table; ``benchmarks/accelerator_checks.sh`` runs it on a GPU or TPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import ntk_core  # noqa: E402
import ntk_flax  # noqa: E402
import reference  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(512)(x)))


class WideCNN(nn.Module):
    """Its Dense layer reads 32·32·64 = 65 536 features: a long contraction."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(64, (3, 3))(nn.relu(nn.Conv(16, (3, 3))(x))))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def models(n: int):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    lenet = ntk_flax.LeNet()
    x_img = jax.random.normal(k[0], (2 * n, 32, 32, 3))
    mlp = MLP()
    x_vec = jax.random.normal(k[1], (2 * n, 784))
    yield "mlp", "MLP 784-512-10 (Flax)", mlp, mlp.init(k[3], x_vec[:1]), x_vec
    yield "lenet", "LeNet (Flax)", lenet, lenet.init(k[2], x_img[:1]), x_img
    cnn = WideCNN()
    yield "cnn", "CNN 16-64 channels, Dense 65536-10 (Flax)", cnn, cnn.init(k[2], x_img[:1]), x_img
    import bench_core  # the BERT-tiny case (benchmarks/README.md): embeddings, masked attention
    import cases

    bert, tokens = bench_core.Bert(), jnp.asarray(cases.make_inputs(cases.CASES["bert"], 2 * n))
    yield "bert", "BERT-tiny, padding mask (Flax)", bert, bert.init(k[2], tokens[:1]), tokens


def rel_error(k, ref) -> float:
    k = np.asarray(k, np.float64)
    return float(np.abs(k - ref).max() / np.abs(ref).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32, help="samples in x1 and in x2")
    ap.add_argument("--out", default="results_accelerator_precision.json")
    models_ = ["mlp", "lenet", "cnn", "bert"]
    ap.add_argument("--models", nargs="+", default=models_[:2], choices=models_)
    ap.add_argument("--implementations", nargs="*", default=["jacobian", "ntvp", "structured"])
    ap.add_argument("--precisions", nargs="+", default=["highest", "default"])
    ap.add_argument("--nngp", action="store_true", help="also the NNGP")
    args = ap.parse_args()
    device = jax.devices()[0]
    rows, forward = [], {}  # forward: the model's own outputs, device against host
    for key, name, model, variables, x in models(args.n):
        if key not in args.models:
            continue
        x1, x2 = x[: args.n], x[args.n :]

        def apply(p, x, model=model, variables=variables):
            return model.apply({**variables, "params": p}, x)

        params = variables["params"]
        cpu = jax.devices("cpu")[0]
        with jax.default_matmul_precision("highest"):  # the model's other ops, not its dots
            out = np.asarray(jax.jit(apply)(params, x1), np.float64)
            with jax.default_device(cpu):
                host = jax.jit(apply)(jax.device_put(params, cpu), jax.device_put(x1, cpu))
        forward[name] = rel_error(out, np.asarray(host, np.float64))
        print(f"{name}: forward pass on {device.platform} vs the host CPU: {forward[name]:.1e}")
        refs = {
            ("ntk", None): reference.ntk(apply, params, x1, None, trace_axes=())[0],
            ("ntk", "x2"): reference.ntk(apply, params, x1, x2, trace_axes=())[0],
            ("nngp", None): reference.nngp(apply, params, x1, None, trace_axes=())[0],
            ("nngp", "x2"): reference.nngp(apply, params, x1, x2, trace_axes=())[0],
        }
        for precision in args.precisions:
            for impl in args.implementations + ["nngp"] * args.nngp:
                kind = "nngp" if impl == "nngp" else "ntk"
                errs = []
                for second in (None, "x2"):
                    opts = dict(trace_axes=(), precision=precision)
                    other = None if second is None else x2
                    if kind == "nngp":
                        k = ntk_core.empirical_nngp(apply, params, x1, other, **opts)
                    else:
                        k = ntk_core.empirical_ntk(
                            apply, params, x1, other, implementation=impl, **opts
                        )
                    errs.append(rel_error(jnp.asarray(k), refs[kind, second]))
                rows.append(
                    dict(
                        model=name,
                        precision=precision,
                        implementation=impl,
                        x2_none=errs[0],
                        x2_given=errs[1],
                    )
                )
                print(rows[-1], flush=True)
    result = dict(
        device=str(device),
        platform=device.platform,
        jax=jax.__version__,
        n=args.n,
        rows=rows,
        forward_vs_host=forward,
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"\n{device} (jax {jax.__version__}), N1 = N2 = {args.n}, max |K - K_ref| / max |K_ref|:\n"
    )
    print("| model | precision | implementation | x2=None | x2 given |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {r['precision']} | {r['implementation']} | "
            f"{r['x2_none']:.1e} | {r['x2_given']:.1e} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
