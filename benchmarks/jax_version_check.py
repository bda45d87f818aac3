"""Times the same per-sample Jacobians of the ResNet case under any JAX version.

Plain ``vmap(jacrev)`` of the plain-JAX ResNet twin (``cases.resnet``) on the first 64
inputs ``bench_core.py`` wrote, and one forward pass, best of 3 warm runs. Run it with
both environments to separate JAX/XLA from ntk_core and neural-tangents:

    PYTHONPATH=src python benchmarks/jax_version_check.py
    /tmp/ntvenv/bin/python benchmarks/jax_version_check.py
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cases  # noqa: E402
import jax  # noqa: E402


def main(data_dir="/tmp/ntk-jax-bench", n=64):
    case = cases.CASES["resnet"]
    variables, x, _ = cases.load_case(data_dir, case, case.n)
    params, rest = cases.split_variables(variables)
    x = x[:n]

    def single(p, xi):
        return cases.resnet({"params": p, **rest}, xi[None])[0]

    jac = jax.jit(lambda p, x: jax.vmap(jax.jacrev(single), (None, 0))(p, x))
    fwd = jax.jit(lambda p, x: cases.resnet({"params": p, **rest}, x))
    for name, f in [(f"forward N={n}", fwd), (f"vmap(jacrev) N={n}", jac)]:
        jax.block_until_ready(f(params, x))
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            jax.block_until_ready(f(params, x))
            best = min(best, time.perf_counter() - t)
        print(f"jax {jax.__version__}: {name} {best:.3f} s, load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
