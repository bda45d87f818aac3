"""Issue 51's accelerator cases in one run: ours (``"auto"`` and each implementation) and
the recipe side by side, first call and warm, error against a float64 host reference,
and the share of the chip's matmul rate.

    python benchmarks/accelerator_bench.py --out results_accelerator.json \
        [--cases fcn mlp10k lenet resnet18 vit] [--sides auto structured recipe ...] \
        [--budget-s 540] [--small]

Each (case, side) runs in a fresh process with no compilation cache, so its first call is
a user's first call (trace, compile, run); the warm figure is the fastest of three more
calls. Compile seconds per program come from JAX's compile log (``first_call.py``'s
handler). The reference is the naive float64 Jacobian contraction (``tests/reference.py``)
of the first ``k`` samples of each side, computed in a process of its own on the host's
CPU (``JAX_PLATFORMS=cpu``: the chip is held by one program at a time) while the sides
run. ``--small`` shrinks every case so the script can be tried on a CPU in a minute.

The cases (issue 51's table; models are ``cases.py``'s plain-JAX twins, float32, dots and
convolutions at HIGHEST as written, weights N(0, 1/fan_in), biases N(0, 0.01)):

* ``fcn``: MLP 3072-2048-2048-2048-8 (ReLU), 16 x 16 inputs, ``trace_axes=()``;
* ``mlp10k``: MLP 784-1000-1, N = 10 000, x2 = None (its FLOP count gives the rate share);
* ``lenet``: LeNet (case C1), 10 logits, N = 500, x2 = None, ``trace_axes=()``;
* ``resnet18``: ResNet-18 (BatchNorm in eval mode), 224x224x3, 8 logits, 8 x 8;
* ``vit``: ViT, 4x4 patches of 32x32x3, 6 pre-LayerNorm blocks of width 256 (4 heads, MLP
  512), 10 logits, N = 128, x2 = None, traced over the logits (``trace_axes=(-1,)``, as
  in the issue; before commit 8f3124a this script computed it with ``()``: 100
  entries per pair, 10x the contraction).

Sides: ``auto``, ``structured``, ``jacobian``, ``ntvp`` (``ntk_core.ntk_fn`` with
``implementation=``), ``structured-matmul-conv`` (structured with every convolution of the
features evaluated as patches times a matrix: ``MATMUL_MAX_POSITIONS`` unbounded, the
first-call lead of ``compile_anatomy.py``), ``structured-conv`` (every convolution with
more than 4 output positions as a convolution: the rule before 2026-12-07), ``recipe``
(``vmap(jacrev)`` per sample and one ``einsum`` at HIGHEST; not run where the N·O·P
Jacobians exceed ``--recipe-gib``),
``matmul`` (the chip's 8192² float32 matmul rate at HIGHEST, HIGH and DEFAULT).
Runs unchanged on a CPU, a CUDA GPU or a TPU; one JSON line per side, the file rewritten
after each, a Markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIDES = (
    "auto",
    "structured",
    "jacobian",
    "ntvp",
    "structured-matmul-conv",
    "structured-conv",
    "recipe",
)

#: key: (model, n1, n2 or None for x2 = None, reference samples k, outputs)
CASES = {
    "fcn": ("mlp", 16, 16, 4, 8),
    "mlp10k": ("mlp", 10_000, None, 4, 1),
    "lenet": ("lenet", 500, None, 4, 10),
    "resnet18": ("resnet18", 8, 8, 2, 8),
    "vit": ("vit", 128, None, 4, 10),
}
WIDTHS = {"fcn": (3072, 2048, 2048, 2048, 8), "mlp10k": (784, 1000, 1)}
SMALL = {"fcn": 4, "mlp10k": 64, "lenet": 8, "resnet18": 2, "vit": 4}
TRACE_AXES = {"vit": (-1,)}  # the others: () (every output pair)


def _setup(key: str, small: bool):
    """(apply(params, x), params, x1, x2) of a case, float32, seeded."""
    sys.path.insert(0, HERE)
    import cases
    import jax
    import jax.numpy as jnp
    import numpy as np

    model, n1, n2, _, outputs = CASES[key]
    if small:
        n1, n2 = SMALL[key], (None if n2 is None else SMALL[key])
    cases.VIT_BLOCKS, cases.VIT_WIDTH = (1, 32) if small else (6, 256)
    rng = np.random.default_rng(0)
    size = 224 if model == "resnet18" and not small else 32
    if model == "mlp":
        widths = (16, 32, outputs) if small else WIDTHS[key]
        shapes = {
            f"Dense_{i}": {"kernel": (a, b), "bias": (b,)}
            for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True))
        }
        x_shape = (widths[0],)
    else:
        x_shape = (size, size, 3)
        shapes = jax.tree_util.tree_map(
            tuple, _saved_shapes(key, small), is_leaf=lambda s: isinstance(s, list)
        )
    variables = jax.tree_util.tree_map_with_path(
        lambda path, s: _init(rng, str(path[-1].key), s), shapes, is_leaf=_is_shape
    )
    rest = {}
    if "batch_stats" in variables:
        rest["batch_stats"] = variables.pop("batch_stats")
    # on the device, as a user's weights are (numpy leaves would cross to it every call)
    params = jax.device_put(variables.get("params", variables))
    rest = jax.device_put(rest)
    fn = cases.MODELS[model]

    def apply(p, x):
        return fn({"params": p, **rest}, x)

    x1 = jnp.asarray(rng.standard_normal((n1, *x_shape), dtype=np.float32))
    x2 = None if n2 is None else jnp.asarray(rng.standard_normal((n2, *x_shape), np.float32))
    return apply, params, x1, x2


def _is_shape(s):
    return isinstance(s, tuple) and all(isinstance(d, int) for d in s)


def _init(rng, name, shape):
    import numpy as np

    if name == "kernel":
        fan_in = math.prod(shape[:-1]) if len(shape) != 3 else shape[0]
        return (rng.standard_normal(shape) / np.sqrt(max(fan_in, 1))).astype(np.float32)
    if name in ("scale", "var"):
        return np.ones(shape, np.float32)
    if name == "mean":
        return np.zeros(shape, np.float32)
    scale = {"bias": 0.1, "positions": 0.02}.get(name, 1.0)
    return (scale * rng.standard_normal(shape)).astype(np.float32)


SHAPES = os.path.join(HERE, "data", "accelerator_shapes.json")


def _saved_shapes(key: str, small: bool):
    """The parameter shapes of a case's plain-JAX twin in Flax's layout, saved by
    ``--write-shapes`` from the Flax modules of ``bench_core.py`` (the device has no Flax)."""
    with open(SHAPES) as f:
        saved = json.load(f)
    return saved[key + ("-small" if small else "")]


def write_shapes():
    """Saves every case's parameter shapes (run where Flax is installed)."""
    import bench_core
    import cases
    import jax
    import jax.numpy as jnp

    saved = {}
    for key, (model, *_, outputs) in CASES.items():
        if model == "mlp":
            continue
        for small in (False, True):
            cases.VIT_BLOCKS, cases.VIT_WIDTH = (1, 32) if small else (6, 256)
            module = bench_core.flax_module(cases.Case("x", "x", model, 2, ()))
            if model == "lenet":
                module = type(module)(out_features=outputs)
            size = 224 if model == "resnet18" and not small else 32
            variables = jax.eval_shape(
                module.init, jax.random.PRNGKey(0), jnp.zeros((2, size, size, 3))
            )
            shapes = jax.tree_util.tree_map(lambda a: [int(d) for d in a.shape], variables)
            head = {"resnet18": "Dense_0", "vit": "head"}.get(model)
            if head is not None:  # the logits the case asks for
                node = shapes["params"][head]
                node["kernel"] = [*node["kernel"][:-1], outputs]
                node["bias"] = [outputs]
            saved[key + ("-small" if small else "")] = shapes
    os.makedirs(os.path.dirname(SHAPES), exist_ok=True)
    with open(SHAPES, "w") as f:
        json.dump(saved, f)


def _listen():
    """JAX's compile log, counted (``first_call.py``'s listener)."""
    sys.path.insert(0, HERE)
    from first_call import listen

    return listen()


def _timed(call, repeats=3, profiler=None):
    import jax

    if profiler is not None:  # the first call only: where its seconds go on the host
        profiler.enable()
    start = time.perf_counter()
    out = jax.block_until_ready(call())
    first = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
    warm = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        warm.append(time.perf_counter() - start)
    return out, first, min(warm)


def side_worker(key, side, small, out_dir, recipe_gib, profile=False) -> dict:
    handler = _listen()
    import jax
    import jax.numpy as jnp
    import numpy as np

    apply, params, x1, x2 = _setup(key, small)
    k = CASES[key][3]
    device = jax.devices()[0]
    row = dict(
        case=key, side=side, n1=int(x1.shape[0]), n2=None if x2 is None else int(x2.shape[0])
    )
    row["platform"], row["device"] = device.platform, device.device_kind
    jax.block_until_ready(jnp.ones(3) + 1)
    handler.take()
    if side == "recipe":
        p_count = sum(math.prod(v.shape) for v in jax.tree_util.tree_leaves(params))
        outputs = CASES[key][4]
        n_all = x1.shape[0] + (0 if x2 is None else x2.shape[0])
        gib = 4 * n_all * outputs * p_count / 2**30
        row["jacobian_gib"] = round(gib, 2)
        if gib > recipe_gib:
            row["skipped"] = f"N·O·P Jacobians {gib:.1f} GiB > --recipe-gib {recipe_gib}"
            return row

        def one(p, x):
            return apply(p, x[None])[0]

        jac = jax.vmap(jax.jacrev(one), in_axes=(None, 0))

        @jax.jit
        def recipe(p, a, b):
            ja = jac(p, a)
            jb = ja if b is None else jac(p, b)
            terms = [
                jnp.einsum(
                    "iaP,jbP->ijab",
                    u.reshape(*u.shape[:2], -1),
                    v.reshape(*v.shape[:2], -1),
                    precision="highest",
                )
                for u, v in zip(
                    jax.tree_util.tree_leaves(ja), jax.tree_util.tree_leaves(jb), strict=True
                )
            ]
            return sum(terms)

        def call():
            return recipe(params, x1, x2)
    else:
        import ntk_core

        implementation = "structured" if side.startswith("structured") else side
        if side in ("structured-matmul-conv", "structured-conv"):
            from ntk_core._structured.rules import conv

            many = side == "structured-matmul-conv"
            conv.MATMUL_MAX_POSITIONS = 1 << 62 if many else conv.MATMUL_MAX_POSITIONS
            conv.TPU_MATMUL_MAX_CONTRACTION = 1 << 62 if many else 0
        trace_axes = TRACE_AXES.get(key, ())
        kernel_fn = ntk_core.ntk_fn(apply, trace_axes=trace_axes, implementation=implementation)
        if implementation == "auto":
            try:
                row["auto_plan"] = str(kernel_fn.plan(params, x1, x2))[-1500:]
            except Exception as e:  # noqa: BLE001 - the plan is information only
                row["auto_plan"] = f"{type(e).__name__}: {e}"[:300]
            handler.take()

        def call():
            return kernel_fn(params, x1, x2)

    import cProfile
    import io
    import pstats

    first_profile = cProfile.Profile() if profile else None
    try:
        out, first, warm = _timed(call, profiler=first_profile)
    except Exception as e:  # noqa: BLE001 - one side failing must not stop the others
        row["error"] = f"{type(e).__name__}: {e}"[:600]
        row["compiles"] = handler.take()
        return row
    row["compiles"] = handler.take()
    row["first_s"], row["warm_s"] = round(first, 3), round(warm, 5)
    if profile:  # where a warm call's time goes on the host (Python, dispatch, waits)
        text = io.StringIO()
        pstats.Stats(first_profile, stream=text).sort_stats("cumulative").print_stats(30)
        row["profile_first_call"] = text.getvalue()[-6000:]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            jax.block_until_ready(call())
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
        row["profile_5_warm_calls"] = text.getvalue()[-3000:]
    block = np.asarray(out[:k, :k], np.float64)
    np.save(os.path.join(out_dir, f"{key}-{side}.npy"), block)
    stats = device.memory_stats() or {}
    row["peak_gib"] = round(stats.get("peak_bytes_in_use", 0) / 2**30, 3)
    if key.startswith("mlp") or key == "fcn":
        widths = (16, 32, CASES[key][4]) if small else WIDTHS[key]
        o = CASES[key][4]
        per_pair = sum(
            2 * ((a + 1) + b * o * o) for a, b in zip(widths[:-1], widths[1:], strict=True)
        )
        n2 = x1.shape[0] if x2 is None else x2.shape[0]
        row["tflop_s"] = round(per_pair * x1.shape[0] * n2 / warm / 1e12, 2)
    return row


def reference_worker(key: str, small: bool, out_dir: str) -> dict:
    """The float64 host reference of the first k samples (a CPU-only process)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import reference

    apply, params, x1, x2 = _setup(key, small)
    k = CASES[key][3]
    to64 = lambda t: jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), t)  # noqa: E731
    start = time.perf_counter()
    ref = reference.ntk(
        apply,
        to64(params),
        to64(x1[:k]),
        None if x2 is None else to64(x2[:k]),
        trace_axes=TRACE_AXES.get(key, ()),
    )[0]
    np.save(os.path.join(out_dir, f"{key}-reference.npy"), np.asarray(ref))
    return dict(case=key, side="reference", seconds=round(time.perf_counter() - start, 1))


def matmul_worker(small: bool) -> dict:
    import jax
    import jax.numpy as jnp

    n = 1024 if small else 8192
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    row = dict(case="-", side="matmul", n=n)
    for precision in ("highest", "high", "default"):
        f = jax.jit(lambda u, v, p=precision: jnp.dot(u, v, precision=p))
        _, _, warm = _timed(lambda f=f: f(a, a), repeats=5)
        row[f"{precision}_tflop_s"] = round(2 * n**3 / warm / 1e12, 2)
    return row


def _child(args_list, env_extra, timeout_s):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env_extra)
    # NTK_BENCH_SRC: another tree's src/ (a snapshot of a commit) instead of this one's
    src = os.environ.get("NTK_BENCH_SRC", os.path.join(ROOT, "src"))
    env["PYTHONPATH"] = os.pathsep.join([src, HERE, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *args_list]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ), timeout_s


def _result(proc, timeout_s, label):
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return dict(label, error=f"timed out after {timeout_s:.0f} s")
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return dict(label, error=(stderr or stdout).strip()[-600:])


def _table(rows, rate):
    lines = [
        "| case | side | first call s (compile s, programs) | warm s | error vs float64 "
        "| peak GiB | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r.get("side") in ("matmul", "reference"):
            continue
        c = r.get("compiles", {})
        note = r.get("error") or r.get("skipped") or ""
        if "tflop_s" in r and rate:
            note += f"{r['tflop_s']} TFLOP/s = {100 * r['tflop_s'] / rate:.0f} % of HIGHEST matmul"
        err = r.get("rel_err")
        lines.append(
            f"| {r['case']} | {r['side']} | {r.get('first_s', '-')} ({c.get('compile_s', '-')}, "
            f"{c.get('programs', '-')}) | {r.get('warm_s', '-')} | "
            f"{'-' if err is None else f'{err:.1e}'} | {r.get('peak_gib', '-')} | {note[:160]} |"
        )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument(
        "--sides", nargs="*", default=["matmul", "auto", "recipe"], choices=["matmul", *SIDES]
    )
    p.add_argument("--budget-s", type=float, default=540.0, help="start no side after this")
    p.add_argument("--side-timeout-s", type=float, default=240.0)
    p.add_argument("--recipe-gib", type=float, default=6.0)
    p.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke run")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument(
        "--profile", action="store_true", help="cProfile of the first and 5 warm calls per side"
    )
    p.add_argument("--out", default="results_accelerator.json")
    p.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--write-shapes", action="store_true", help="save the models' shapes (Flax)")
    args = p.parse_args()
    if args.write_shapes:
        sys.path.insert(0, HERE)
        write_shapes()
        return
    if args.child is not None:
        what = args.child[0]
        if what == "side":
            row = side_worker(
                args.child[1],
                args.child[2],
                args.small,
                args.child[3],
                args.recipe_gib,
                args.profile,
            )
        elif what == "reference":
            row = reference_worker(args.child[1], args.small, args.child[2])
        else:
            row = matmul_worker(args.small)
        print("RESULT " + json.dumps(row), flush=True)
        return
    import numpy as np

    start = time.time()
    out_dir = os.path.splitext(os.path.abspath(args.out))[0] + "-blocks"
    os.makedirs(out_dir, exist_ok=True)
    small = ["--small"] if args.small else []
    refs = []
    if not args.no_reference:  # host CPU processes, two at a time, beside the chip's runs
        pending = list(args.cases)
        refs = [
            _child(["reference", k, out_dir, *small], {"JAX_PLATFORMS": "cpu"}, 900) + (k,)
            for k in pending[:2]
        ]
        pending = pending[2:]
    data = dict(
        meta=dict(
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            args={k: v for k, v in vars(args).items() if k != "child"},
        ),
        rows=[],
    )

    def add(row):
        print(json.dumps(row), flush=True)
        data["rows"].append(row)
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)

    jobs = [("matmul", None)] if "matmul" in args.sides else []
    jobs += [(s, k) for k in args.cases for s in args.sides if s != "matmul"]
    for side, key in jobs:
        if time.time() - start > args.budget_s:
            add(dict(case=key, side=side, skipped="--budget-s reached"))
            continue
        if side == "matmul":
            proc, t = _child(["matmul", *small], {}, args.side_timeout_s)
            key = "-"
        else:
            proc, t = _child(
                ["side", key, side, out_dir, *small, "--recipe-gib", str(args.recipe_gib)]
                + (["--profile"] if args.profile else []),
                {},
                args.side_timeout_s,
            )
        add(_result(proc, t, dict(case=key, side=side)))
        if refs and refs[0][0].poll() is not None:
            proc_ref, t_ref, k = refs.pop(0)
            add(_result(proc_ref, t_ref, dict(case=k, side="reference")))
            if not args.no_reference and pending:
                refs.append(
                    _child(
                        ["reference", pending[0], out_dir, *small], {"JAX_PLATFORMS": "cpu"}, 900
                    )
                    + (pending[0],)
                )
                pending = pending[1:]
    while refs or (not args.no_reference and pending):
        if not refs:
            refs.append(
                _child(["reference", pending[0], out_dir, *small], {"JAX_PLATFORMS": "cpu"}, 900)
                + (pending[0],)
            )
            pending = pending[1:]
        proc_ref, t_ref, k = refs.pop(0)
        add(_result(proc_ref, t_ref, dict(case=k, side="reference")))
    for r in data["rows"]:
        path = os.path.join(out_dir, f"{r.get('case')}-{r.get('side')}.npy")
        ref = os.path.join(out_dir, f"{r.get('case')}-reference.npy")
        if r.get("side") != "reference" and os.path.exists(path) and os.path.exists(ref):
            a, b = np.load(path), np.load(ref)
            if a.shape == b.shape:
                r["rel_err"] = float(np.abs(a - b).max() / np.abs(b).max())
            else:
                r["rel_err_shapes"] = [list(a.shape), list(b.shape)]
    rate = next((r.get("highest_tflop_s") for r in data["rows"] if r.get("side") == "matmul"), None)
    data["table"] = _table(data["rows"], rate)
    data["meta"]["total_s"] = round(time.time() - start, 1)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    print(data["table"])
    print(
        json.dumps(
            {
                k: v
                for k, v in next((r for r in data["rows"] if r.get("side") == "matmul"), {}).items()
            }
        )
    )


if __name__ == "__main__":
    main()
