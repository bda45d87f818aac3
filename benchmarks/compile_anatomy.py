"""Where a first kernel call's time goes on an accelerator (issue 51): one fresh process
per step, XLA's compile seconds per program from JAX's ``jax_log_compiles`` log.

    python benchmarks/compile_anatomy.py [--steps kernel pieces dump] [--n 500] [--out DIR]

Steps (each in its own process, so nothing is cached between them):

* ``kernel``: the LeNet (case C1, plain JAX, 32x32x3, 10 logits) NTK Gram matrix of N
  inputs, ``trace_axes=()``, ``implementation="structured"``, ``precision="highest"``:
  first call, the compile seconds of each program, warm call;
* ``pieces``: the programs a structured kernel is made of, compiled alone at N: the
  forward pass, ``vmap(vjp)`` per sample, and each convolution of the backward pass at
  HIGHEST and DEFAULT precision, to tell whether compile time follows the precision, the
  convolutions or the program's size;
* ``forward``: the model's forward pass alone and its first convolution at HIGHEST,
  DEFAULT and as patches times a matrix (each ``(lower s, compile s)``);
* ``dump``: XLA's optimized HLO of the kernel's programs at N (``$OUT/dump``), whose
  op counts say what the compiler was given.

Runs unchanged on a CPU, a CUDA GPU or a TPU; prints one JSON line per step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from first_call import listen as _listen  # noqa: E402 (JAX's compile log, counted)


def _lenet_params(seed: int = 0):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)

    def layer(shape, fan_in):
        return {
            "kernel": jnp.asarray(rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)),
            "bias": jnp.asarray(0.1 * rng.standard_normal(shape[-1:], dtype=np.float32)),
        }

    return {
        "Conv_0": layer((5, 5, 3, 6), 75),
        "Conv_1": layer((5, 5, 6, 16), 150),
        "Dense_0": layer((8 * 8 * 16, 120), 1024),
        "Dense_1": layer((120, 84), 120),
        "Dense_2": layer((84, 10), 84),
    }


def _inputs(n: int):
    import jax.numpy as jnp
    import numpy as np

    return jnp.asarray(np.random.default_rng(1).standard_normal((n, 32, 32, 3), dtype=np.float32))


def _apply():
    sys.path.insert(0, HERE)
    import cases

    return lambda p, x: cases.lenet({"params": p}, x)


def step_kernel(n: int, chunk: int = 0) -> dict:
    handler = _listen()
    import jax

    import ntk_core

    if chunk:  # samples per features chunk, forced (the structured features' XLA loop)
        from ntk_core._structured import analysis

        analysis.feature_chunk = lambda n, *rest: min(n, chunk)

    params, x, apply = _lenet_params(), _inputs(n), _apply()
    jax.block_until_ready(x + 1)
    handler.programs.clear()
    fn = ntk_core.ntk_fn(apply, trace_axes=(), implementation="structured", precision="highest")
    t0 = time.perf_counter()
    jax.block_until_ready(fn(params, x))
    first = time.perf_counter() - t0
    programs = list(handler.programs)
    warm = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params, x))
        warm.append(time.perf_counter() - t0)
    return {
        "step": "kernel",
        "n": n,
        "chunk": chunk or "auto",
        "first_s": round(first, 3),
        "warm_s": round(min(warm), 5),
        "compile_s": round(sum(s for _, s in programs), 3),
        "programs": programs,
    }


def _compile_seconds(fn, *args) -> tuple[float, float]:
    import jax

    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    return round(t1 - t0, 3), round(time.perf_counter() - t1, 3)


def step_pieces(n: int) -> dict:
    import jax
    import jax.numpy as jnp

    params, x, apply = _lenet_params(), _inputs(n), _apply()
    out: dict = {"step": "pieces", "n": n}
    out["forward"] = _compile_seconds(apply, params, x)

    def per_sample_vjp(p, xs):
        def one(xi):
            y, pull = jax.vjp(lambda q: apply(q, xi[None]), p)
            return pull(jnp.ones_like(y))

        return jax.vmap(one)(xs)

    out["vmap_vjp"] = _compile_seconds(per_sample_vjp, params, x)
    out["per_sample_jacobian_10"] = _compile_seconds(
        lambda p, xs: jax.vmap(lambda xi: jax.jacrev(lambda q: apply(q, xi[None]))(p))(xs),
        params,
        x,
    )
    for precision in ("highest", "default"):
        p = jax.lax.Precision.HIGHEST if precision == "highest" else jax.lax.Precision.DEFAULT

        def conv(a, w, p=p):
            return jax.lax.conv_general_dilated(
                a, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=p
            )

        a = jnp.ones((n, 16, 16, 6), jnp.float32)
        w = jnp.ones((5, 5, 6, 16), jnp.float32)
        out[f"conv_{precision}"] = _compile_seconds(conv, a, w)
        # the weight gradient of that convolution, per sample (vmap of its transpose)
        out[f"conv_weight_grad_per_sample_{precision}"] = _compile_seconds(
            lambda a, g, conv=conv, w=w: jax.vmap(
                lambda ai, gi: jax.vjp(lambda q: conv(ai[None], q), w)[1](gi[None])[0]
            )(a, g),
            a,
            jnp.ones((n, 16, 16, 16), jnp.float32),
        )
    return out


def step_forward(n: int) -> dict:
    """The model's forward pass alone, and its first convolution (3 -> 6 channels, 5x5) at
    HIGHEST and DEFAULT, and that convolution as patches times a matrix at HIGHEST."""
    import jax
    import jax.numpy as jnp

    params, x, apply = _lenet_params(), _inputs(n), _apply()
    out: dict = {"step": "forward", "n": n, "forward": _compile_seconds(apply, params, x)}
    w = params["Conv_0"]["kernel"]
    for precision in ("highest", "default"):
        p = getattr(jax.lax.Precision, precision.upper())

        def conv(a, w, p=p):
            numbers = ("NHWC", "HWIO", "NHWC")
            return jax.lax.conv_general_dilated(
                a, w, (1, 1), "SAME", dimension_numbers=numbers, precision=p
            )

        out[f"conv0_{precision}"] = _compile_seconds(conv, x, w)

    def patches_matmul(a, w):
        numbers = ("NHWC", "HWIO", "NHWC")
        patches = jax.lax.conv_general_dilated_patches(
            a,
            (5, 5),
            (1, 1),
            "SAME",
            dimension_numbers=numbers,
            precision=jax.lax.Precision.HIGHEST,
        )
        return jnp.einsum("nhwk,ko->nhwo", patches, w.reshape(-1, w.shape[-1]), precision="highest")

    out["conv0_patches_matmul_highest"] = _compile_seconds(patches_matmul, x, w)
    return out


def step_dump(n: int, out_dir: str) -> dict:
    # XLA_FLAGS is read when the backend starts: set by the parent for this process
    result = step_kernel(n)
    result["step"] = "dump"
    counts = {}
    dump = os.path.join(out_dir, "dump")
    for name in sorted(os.listdir(dump)) if os.path.isdir(dump) else []:
        if "after_optimizations.txt" not in name or not re.search("features|tile", name):
            continue
        text = open(os.path.join(dump, name)).read()
        counts[name] = {
            "lines": text.count("\n"),
            "fusions": len(re.findall(r"\bfusion\(", text)),
            "convolutions": len(re.findall(r"\bconvolution\(", text)),
            "dots": len(re.findall(r"\bdot\(", text)),
            "whiles": len(re.findall(r"\bwhile\(", text)),
        }
    result["optimized_modules"] = counts
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", nargs="+", default=["kernel", "pieces", "dump"])
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument(
        "--chunks", type=int, nargs="*", default=[0], help="kernel step: forced feature chunks"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "compile_anatomy"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=240)
    args = parser.parse_args(argv)
    if args.worker:
        if args.worker == "kernel":
            print(json.dumps(step_kernel(args.n, args.chunks[0])))
        elif args.worker == "forward":
            print(json.dumps(step_forward(args.n)))
        elif args.worker == "pieces":
            print(json.dumps(step_pieces(args.n)))
        else:
            print(json.dumps(step_dump(args.n, args.out)))
        return 0
    os.makedirs(args.out, exist_ok=True)
    results = []
    runs = [(s, c) for s in args.steps for c in (args.chunks if s == "kernel" else [0])]
    for step, chunk in runs:
        env = dict(os.environ)
        if step == "dump":
            env["XLA_FLAGS"] = (
                env.get("XLA_FLAGS", "")
                + f" --xla_dump_to={os.path.join(args.out, 'dump')}"
                + " --xla_dump_hlo_module_re=.*(features|tile).*"
            ).strip()
        cmd = [sys.executable, __file__, "--worker", step, "--n", str(args.n), "--out", args.out]
        cmd += ["--chunks", str(chunk)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.timeout
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            result = (
                json.loads(lines[-1]) if lines else {"step": step, "error": proc.stderr[-2000:]}
            )
        except subprocess.TimeoutExpired:
            result = {"step": step, "error": f"timeout after {args.timeout} s"}
        result["process_s"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(result), flush=True)
        results.append(result)
    with open(os.path.join(args.out, "compile_anatomy.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
