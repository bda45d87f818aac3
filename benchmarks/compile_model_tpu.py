"""How long XLA takes to compile a model's own programs, by precision (issue 51: is
ResNet-18's 60-66 s first kernel call on a TPU the kernel's programs or the model's?).

One process, no compilation cache; each row a fresh ``jax.jit`` timed through
``lower(...).compile()``, then one run:

* ``forward``: ``apply(params, x)`` on the case's x1;
* ``vjp``: the forward pass and one VJP to the parameters (what a training step
  compiles), ``jax.grad`` of the outputs' sum;
* each at ``jax.default_matmul_precision`` HIGHEST and DEFAULT (``cases.py``'s twins ask
  for HIGHEST in their own convolutions and products; DEFAULT rows drop that request by
  rebinding ``cases.HIGHEST``), or a ``DotAlgorithmPreset`` (``X6``, ``F32``: the twins'
  request dropped, the preset set as the default; JAX lowers a convolution under a preset
  at DEFAULT, so only a model without convolutions keeps float32's accuracy there).

    python benchmarks/compile_model_tpu.py --case resnet18 [--small] [--out FILE]

Runs unchanged on a CPU, a CUDA GPU or a TPU; one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import time

import accelerator_bench as bench
from compile_dots_tpu import PRESETS, save


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="resnet18", choices=list(bench.CASES))
    p.add_argument("--small", action="store_true")
    p.add_argument("--precisions", nargs="*", default=["DEFAULT", "HIGHEST"])
    p.add_argument("--out", default="compile_model.json")
    args = p.parse_args()
    import cases
    import jax
    import jax.numpy as jnp
    from jax import lax

    apply, params, x1, _ = bench._setup(args.case, args.small)
    rows = []
    for name in args.precisions:
        preset = PRESETS.get(name)
        # the twins' own request, read at trace time (a preset: none, the default rules)
        cases.HIGHEST = None if preset else lax.Precision[name]
        programs = {
            "forward": lambda p, x: apply(p, x),
            "vjp": jax.grad(lambda p, x: jnp.sum(apply(p, x))),
        }
        for what, fn in programs.items():
            with jax.default_matmul_precision(preset or name.lower()):
                jitted = jax.jit(fn)
                t0 = time.perf_counter()
                lowered = jitted.lower(params, x1)
                lower_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                compiled = lowered.compile()
                compile_s = time.perf_counter() - t0
            jax.block_until_ready(compiled(params, x1))
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params, x1))
            row = dict(case=args.case, n=int(x1.shape[0]), program=what, precision=name,
                       lower_s=round(lower_s, 3), compile_s=round(compile_s, 3),
                       run_ms=round(1e3 * (time.perf_counter() - t0), 3))  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
            save(args.out, rows)  # after each row: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
