"""First call against warm call, ours and neural-tangents 0.6.5 side by side (issue 17).

A researcher's first kernel of a new model or shape pays for tracing and compiling;
then each new shape (test-train after train-train, a larger probe set) pays again.
For each case (MLP 784-1000-1 at N = 1000, LeNet at N = 500, ``trace_axes=()``) and each
side, one fresh worker process measures, on the same parameters and inputs:

* ``first``: the Gram matrix K(x, x) of the N training inputs, first call (trace,
  compile and run), with the XLA programs compiled and their compile seconds, and the
  traces of the model's apply function;
* ``warm``: the same call again (best of 3);
* ``new_n``: K(x_test, x) with N/2 test inputs, the first call of that shape;
* ``new_n_warm``: that call again.

Ours: ``ntk_core.ntk_fn(apply, trace_axes=())`` (``implementation="auto"``), called as
users call it (it jits internally); the LeNet's apply is the Flax module's. Theirs:
``jax.jit`` of ``neural_tangents.empirical_ntk_fn(..., vmap_axes=0,
implementation=STRUCTURED)`` (their fastest, jitted as their README recommends) on the
plain-JAX twin (``cases.py``). Runs alternate ours / theirs, ``--repeats`` times; the
table reports the median of each figure. neural-tangents runs in its own environment:

    python3 -m venv /tmp/ntvenv && /tmp/ntvenv/bin/pip install "jax[cpu]==0.4.23" \\
        "jaxlib==0.4.23" "neural-tangents==0.6.5" "numpy<2" "scipy<1.13"
    python benchmarks/first_call.py --nt-python /tmp/ntvenv/bin/python

Writes ``results_first_call.json`` and prints the Markdown table for ``README.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

DATA_DIR = "/tmp/ntk-jax-first-call"
CASE_KEYS = ("mlp1", "lenet", "mlp-small", "resnet18")


class _Compiles(logging.Handler):
    """Counts XLA compilations and their seconds from JAX's ``jax_log_compiles`` log
    (the same wording in jax 0.4.23 and 0.10), and beside them the seconds spent tracing
    and lowering to MLIR, and the persistent compilation cache's hits and misses (its
    hits are counted in ``compile_s`` too: JAX times the cache read as the compile)."""

    pattern = re.compile(r"Finished XLA compilation of (.*) in ([0-9.eE+-]+) sec")
    phases = {
        "trace_s": re.compile(r"Finished tracing .* in ([0-9.eE+-]+) sec"),
        "lower_s": re.compile(r"Finished jaxpr to MLIR module conversion .* in ([0-9.eE+-]+) sec"),
    }  # fmt: skip
    cache = {
        "cache_hits": re.compile(r"Persistent compilation cache hit for '([^']*)'"),
        "cache_misses": re.compile(r"PERSISTENT COMPILATION CACHE MISS for '([^']*)'"),
    }

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.programs: list[tuple[str, float]] = []
        self.seconds = dict.fromkeys(self.phases, 0.0)
        self.names: dict = {key: [] for key in self.cache}

    def emit(self, record):
        message = record.getMessage()
        match = self.pattern.search(message)
        if match:
            self.programs.append((match.group(1), float(match.group(2))))
        for key, pattern in self.phases.items():
            match = pattern.search(message)
            if match:
                self.seconds[key] += float(match.group(1))
        for key, pattern in self.cache.items():
            match = pattern.search(message)
            if match:
                self.names[key].append(match.group(1))

    def take(self):
        programs, self.programs = self.programs, []
        out = {
            "programs": len(programs),
            "compile_s": round(sum(s for _, s in programs), 3),
            "names": [name for name, _ in programs],
            **{key: round(s, 3) for key, s in self.seconds.items()},
            **{key: names for key, names in self.names.items() if names},
        }
        self.seconds = dict.fromkeys(self.phases, 0.0)
        self.names = {key: [] for key in self.cache}
        return out


def listen() -> _Compiles:
    """JAX's compile log, counted from now on (compile_anatomy.py and
    accelerator_bench.py listen the same way)."""
    import jax

    handler = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    jax.config.update("jax_log_compiles", True)
    return handler


def _worker(side: str, key: str, n: int) -> dict:
    handler = listen()
    import cases
    import jax
    import jax.numpy as jnp

    case = cases.CASES[key]
    variables, x, _ = cases.load_case(DATA_DIR, case, n)
    params, rest = cases.split_variables(variables)
    x_test = jnp.asarray(cases.make_inputs(case, n // 2, seed=2))
    if side == "ours":
        import bench_core

        import ntk_core

        apply = bench_core.apply_fn(case, variables)
        traces = [0]

        def counted(p, xs):
            traces[0] += 1
            return apply(p, xs)

        kernel_fn = ntk_core.ntk_fn(counted, trace_axes=case.trace_axes)

        def gram():
            return kernel_fn(params, x)

        def test_train():
            return kernel_fn(params, x_test, x)

        version = getattr(ntk_core, "__version__", "?")
    else:
        import neural_tangents as nt

        plain = cases.plain_apply(case)
        traces = [0]

        def counted(p, xs):
            traces[0] += 1
            return plain({"params": p, **rest}, xs)

        ntk = nt.empirical_ntk_fn(
            counted,
            trace_axes=case.trace_axes,
            vmap_axes=0,
            implementation=nt.NtkImplementation.STRUCTURED_DERIVATIVES,
        )
        fn = jax.jit(lambda p, a, b: ntk(a, b, p))

        def gram():
            return fn(params, x, None)

        def test_train():
            return fn(params, x_test, x)

        version = nt.__version__
    jax.block_until_ready(jnp.ones(3) + 1)  # the backend is up before timing
    handler.take()
    result = {"side": side, "case": key, "n": n, "version": version, "jax": jax.__version__}
    for name, call in (("first", gram), ("new_n", test_train)):
        before = traces[0]
        start = time.perf_counter()
        jax.block_until_ready(call())
        result[name + "_s"] = round(time.perf_counter() - start, 3)
        result[name + "_traces"] = traces[0] - before
        result[name + "_compiles"] = handler.take()
        warm = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(call())
            warm.append(time.perf_counter() - start)
        key_warm = "warm_s" if name == "first" else "new_n_warm_s"
        result[key_warm] = round(min(warm), 4)
    return result


def _run(python: str, side: str, key: str, n: int, timeout_s: float, xla_flags=None) -> dict:
    cmd = [python, os.path.abspath(__file__), "worker", side, key, str(n)]
    env = dict(os.environ, PYTHONPATH=HERE, TF_CPP_MIN_LOG_LEVEL="3")
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            result["process_wall_s"] = round(wall, 2)
            if xla_flags:
                result["side"] += f" XLA_FLAGS={xla_flags}"
            return result
    return {"side": side, "case": key, "error": proc.stderr.strip()[-800:]}


def _prepare(key: str, n: int) -> None:
    import bench_core
    import cases

    if not os.path.exists(cases.case_paths(DATA_DIR, key, n)[0]):
        bench_core.prepare(cases.CASES[key], n, DATA_DIR)


def _table(results: list[dict]) -> str:
    rows = [
        "| case | side | first call s | programs (compile s) | model traces | warm s | "
        "new N first s | programs (compile s) | traces | new N warm s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    sides = list(dict.fromkeys(r["side"] for r in results if "side" in r))
    for key in CASE_KEYS:
        for side in sides:
            runs = [r for r in results if r.get("case") == key and r.get("side") == side]
            runs = [r for r in runs if "error" not in r]
            if not runs:
                continue

            def med(field, runs=runs):
                return statistics.median(r[field] for r in runs)

            def compiles(phase, runs=runs):
                progs = statistics.median(r[phase + "_compiles"]["programs"] for r in runs)
                secs = statistics.median(r[phase + "_compiles"]["compile_s"] for r in runs)
                return f"{progs:g} ({secs:.2f})"

            title = f"{key} N={runs[0]['n']}"
            side = side.replace("neural-tangents", f"neural-tangents {runs[0]['version']}")
            rows.append(
                f"| {title} | {side} | {med('first_s'):.2f} | "
                f"{compiles('first')} | {med('first_traces'):g} | {med('warm_s'):.3f} | "
                f"{med('new_n_s'):.2f} | {compiles('new_n')} | {med('new_n_traces'):g} | "
                f"{med('new_n_warm_s'):.3f} |"
            )
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nt-python", help="neural-tangents' interpreter (omit: ours only)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=["mlp1", "lenet"], choices=CASE_KEYS)
    parser.add_argument("--n", type=int, help="N for every case (default: each case's own)")
    parser.add_argument("--ours-xla-flags", help="also run ours with these XLA_FLAGS")
    parser.add_argument("--out", default=os.path.join(HERE, "results_first_call.json"))
    args = parser.parse_args(argv)
    import cases
    import harness

    results = []
    for key in args.cases:
        n = args.n or cases.CASES[key].n
        _prepare(key, n)
        for _ in range(args.repeats):
            results.append(_run(sys.executable, "ours", key, n, 600))
            print(json.dumps(results[-1])[:400], flush=True)
            if args.ours_xla_flags:
                results.append(_run(sys.executable, "ours", key, n, 600, args.ours_xla_flags))
                print(json.dumps(results[-1])[:400], flush=True)
            if args.nt_python:
                results.append(_run(args.nt_python, "neural-tangents", key, n, 600))
                print(json.dumps(results[-1])[:400], flush=True)
    meta = harness.machine()
    with open(args.out, "w") as fh:
        json.dump({"machine": meta, "results": results}, fh, indent=1)
    print(_table(results))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        out = _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        print("RESULT " + json.dumps(out), flush=True)
    else:
        main()
