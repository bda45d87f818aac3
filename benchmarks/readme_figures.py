"""Measures the figures of README.md and the guides in docs/ and rewrites them in place.

    python benchmarks/readme_figures.py                        # every part, then rewrite
    python benchmarks/readme_figures.py --only demo,doctor     # a subset
    python benchmarks/readme_figures.py --only demo --dry-run  # print, write nothing

Each figure lives in one file (``FILES``: README.md or a guide in docs/) between marker
comments (invisible on GitHub)::

    <!-- figures:NAME -->
    Measured DATE UTC on MACHINE ...: the figures.
    <!-- /figures:NAME -->

and each part below rewrites its own block, stating the date (UTC), the machine (CPU
count and model, RAM, OS, Python, jax), the commit and the load average. A block whose
part was not run keeps its old text. The raw numbers go to
``benchmarks/results_readme_figures.json`` (merged per part, so a partial run keeps the
other parts' last results).

Parts (``--only``, comma-separated; default all, in this order):

* ``demo``: ``ntk demo --out TMP`` in a fresh process, without the persistent
  compilation cache: the whole command's wall time (Python start-up included) and the
  demo's own ``seconds.total`` from its ``summary.json``, with its implementation, test
  accuracy and Flax-vs-Haiku difference.
* ``cache``: JAX's persistent compilation cache as docs/environment.md enables it
  (``JAX_COMPILATION_CACHE_DIR`` set to a new empty folder): one ``ntk demo`` without
  it, the run that fills it (and the bytes it wrote), then ``--cache-runs-after`` runs.
* ``doctor``: ``ntk doctor`` in a fresh process: wall time, the checks' statuses and
  the range of the max |ΔK| / max |K| values they print.
* ``half``: the relative error of half-precision (bfloat16, float16) kernels against
  the float32 model's, on 10-64-64-3 ReLU and tanh MLPs (32 samples, ``--half-seeds``
  seeds per activation, two independent trials), for the NTK with every implementation
  and for the NNGP.
* ``c3``: ``python examples/c3_gp_erf.py`` (16 Monte Carlo samples): wall time.
* ``tests``: the README's test command, ``python -m pytest -n 2 --dist loadfile``
  (11 minutes or more on 2 cores): pytest's own summary and the whole wall time.

Figures are taken as measured (rounded for the text, full precision in the JSON);
a part whose command fails raises and writes nothing. Times depend on what else the
machine runs: the load average is recorded before and after each part.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: The file that holds each part's block.
FILES = {
    "demo": README,
    "cache": DOCS / "environment.md",
    "doctor": DOCS / "environment.md",
    "half": DOCS / "options.md",
    "c3": DOCS / "predictions.md",
    "track": DOCS / "spectra-and-tracking.md",
    "tests": README,
}
RESULTS = ROOT / "benchmarks" / "results_readme_figures.json"
PARTS = ("demo", "cache", "doctor", "half", "c3", "track", "tests")
TEST_COMMAND = ("-m", "pytest", "-n", "2", "--dist", "loadfile")
WIDTH = 88

# ---------------------------------------------------------------- the machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _ram_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+local changes" if dirty else "")


def machine() -> dict:
    """What the figures were measured on."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": _cpu_model(),
        "ram_bytes": _ram_bytes(),
        "system": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "ntk_jax": _version("ntk-jax"),
        "commit": _commit(),
    }


def describe(m: dict) -> str:
    """One phrase for the README, e.g. '2 CPUs (AMD EPYC), 23.5 GiB RAM, Linux, ...'."""
    cpus = m["cpus_usable"] or m["cpus"]
    parts = [f"{cpus} CPU{'s' if cpus != 1 else ''} ({m['cpu_model']})"]
    if m["ram_bytes"]:
        parts.append(f"{m['ram_bytes'] / 2**30:.1f} GiB RAM")
    parts.append(m["system"].split()[0])
    parts.append(f"Python {m['python']}")
    parts.append(f"jax {m['jax']}")
    if m["commit"]:
        parts.append(f"commit {m['commit']}")
    return ", ".join(parts)


def loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ---------------------------------------------------------------- running commands


def timed(cmd: list[str], env: dict | None = None, timeout: float = 1800) -> dict:
    """Runs ``cmd`` in ROOT; returns its wall time (s), exit status and output."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    return {"cmd": cmd, "wall_s": wall, "rc": proc.returncode, "stdout": proc.stdout,
            "stderr": proc.stderr}  # fmt: skip


def _fail(what: str, run: dict) -> None:
    tail = (run["stdout"][-2000:] + "\n" + run["stderr"][-2000:]).strip()
    raise RuntimeError(f"{what} failed (exit status {run['rc']}):\n{tail}")


def ntk_executable() -> str:
    """The ``ntk`` script of the interpreter running this file (else the one on PATH)."""
    here = Path(sys.executable).parent / "ntk"
    if here.exists():
        return str(here)
    found = shutil.which("ntk")
    if found is None:
        raise RuntimeError('no `ntk` command: install the project (pip install -e ".[all]")')
    return found


def _env(cache_dir: str | None) -> dict:
    """The environment, with the persistent compilation cache at ``cache_dir`` or off."""
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    return env


def run_demo(cache_dir: str | None = None) -> dict:
    """``ntk demo --out TMP`` in a fresh process; wall time and its summary.json."""
    with tempfile.TemporaryDirectory(prefix="ntk-demo-") as out:
        run = timed([ntk_executable(), "demo", "--out", out], env=_env(cache_dir))
        if run["rc"] != 0:
            _fail("ntk demo", run)
        with open(os.path.join(out, "summary.json")) as fh:
            summary = json.load(fh)
    return {
        "wall_s": run["wall_s"],
        "demo_s": summary["seconds"]["total"],
        "summary": summary,
        "stdout": run["stdout"],
    }


def _folder_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# ---------------------------------------------------------------- the parts


def measure_demo(repeat: int) -> dict:
    runs = [run_demo() for _ in range(repeat)]
    return {"runs": [{k: r[k] for k in ("wall_s", "demo_s", "summary")} for r in runs]}


def measure_cache(runs_after: int) -> dict:
    without = run_demo()
    cache = tempfile.mkdtemp(prefix="ntk-jax-cache-")
    try:
        fill = run_demo(cache)
        cache_bytes = _folder_bytes(cache)
        cache_files = sum(1 for p in Path(cache).rglob("*") if p.is_file())
        after = [run_demo(cache) for _ in range(runs_after)]
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    def keep(r):
        return {"wall_s": r["wall_s"], "demo_s": r["demo_s"]}

    return {
        "without_cache": keep(without),
        "filling": {**keep(fill), "cache_bytes": cache_bytes, "cache_files": cache_files},
        "after": [keep(r) for r in after],
    }


_CHECK_LINE = re.compile(r"^\s*\[(PASS|FAIL|SKIP|ERROR)\s*\]\s*([^:]+):\s*(.*)\(([\d.]+) s\)\s*$")
_LABELLED = re.compile(r"(.+?) (\d+(?:\.\d+)?e[-+]\d+)(?:, |$)")


def parse_doctor(text: str) -> dict:
    """Checks (status, seconds) and the max |ΔK| / max |K| values of ``ntk doctor``'s
    text report; the tolerance printed after the values is not one of them."""
    checks, errors = [], {}
    for line in text.splitlines():
        match = _CHECK_LINE.match(line)
        if not match:
            continue
        status, name, detail, seconds = match.groups()
        checks.append({"name": name.strip(), "status": status.lower(), "seconds": float(seconds)})
        if status == "PASS" and "max |ΔK|/max|K|:" in detail:
            measured = detail.split("max |ΔK|/max|K|:", 1)[1].split("(tolerance", 1)[0]
            for label, value in _LABELLED.findall(measured.strip()):
                errors[f"{name.strip()}: {label.strip()}"] = float(value)
    return {"checks": checks, "errors": errors, "ok": text.rstrip().endswith("OK")}


def measure_doctor(repeat: int) -> dict:
    runs = []
    for _ in range(repeat):
        run = timed([ntk_executable(), "doctor"], env=_env(None))
        if run["rc"] != 0:
            _fail("ntk doctor", run)
        report = run["stdout"]
        runs.append({"wall_s": run["wall_s"], **parse_doctor(report), "report": report})
    return {"runs": runs}


_PYTEST_SUMMARY = re.compile(
    r"^=*\s*(?P<counts>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s(?: \((?P<clock>[\d:]+)\))?"
    r"\s*=*\s*$"
)


def parse_pytest_summary(text: str) -> dict | None:
    """The last summary line of pytest, e.g. '=== 1203 passed, 3 skipped, 2 warnings in
    674.12s (0:11:14) ===', as {'counts': {'passed': 1203, ...}, 'seconds': 674.12}."""
    for line in reversed(text.splitlines()):
        match = _PYTEST_SUMMARY.match(line.strip())
        if match:
            counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", match.group("counts"))}
            return {"counts": counts, "seconds": float(match.group("seconds")), "line": line}
    return None


def measure_tests() -> dict:
    run = timed([sys.executable, *TEST_COMMAND], env=_env(None), timeout=4 * 3600)
    summary = parse_pytest_summary(run["stdout"])
    if summary is None:
        _fail("the test command (no pytest summary line)", run)
    return {
        "command": "python " + " ".join(TEST_COMMAND),
        "rc": run["rc"],
        "wall_s": run["wall_s"],
        "pytest_seconds": summary["seconds"],
        "counts": summary["counts"],
        "summary_line": summary["line"].strip(),
    }


def measure_half(seeds: int, trials: int = 2, samples: int = 32) -> dict:
    """max |K_half − K_32| / max |K_32| of 10-64-64-3 MLPs, half = params and inputs in
    bfloat16/float16, K_32 the float32 model's kernel (precision 'highest')."""
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np

    import ntk_core

    sizes = (10, 64, 64, 3)
    implementations = ("jacobian", "ntvp", "structured")

    def make(act):
        def apply_fn(params, x):
            for i, (w, b) in enumerate(params):
                x = x @ w + b
                if i < len(params) - 1:
                    x = act(x)
            return x

        return apply_fn

    def init(key):
        keys = jax.random.split(key, 2 * (len(sizes) - 1) + 1)
        params = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            w = jax.random.normal(keys[2 * i], (a, b)) / np.sqrt(a)
            params.append((w, 0.1 * jax.random.normal(keys[2 * i + 1], (b,))))
        x = jax.random.normal(keys[-1], (samples, sizes[0]))
        return params, x

    def rel(k, ref):
        k, ref = np.asarray(k, np.float64), np.asarray(ref, np.float64)
        return float(np.abs(k - ref).max() / np.abs(ref).max())

    rows = []
    for act_name, act in (("relu", jax.nn.relu), ("tanh", jnp.tanh)):
        apply_fn = make(act)
        for trial in range(trials):
            for seed in range(seeds):
                params, x = init(jax.random.PRNGKey(10_000 * (trial + 1) + seed))
                ntk32 = ntk_core.empirical_ntk(apply_fn, params, x, implementation="jacobian")
                nngp32 = ntk_core.empirical_nngp(apply_fn, params, x)
                for dtype in ("bfloat16", "float16"):
                    cast = jax.tree.map(lambda v, d=dtype: v.astype(d), (params, x))
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", ntk_core.PrecisionWarning)
                        for impl in implementations:
                            k = ntk_core.empirical_ntk(apply_fn, *cast, implementation=impl)
                            rows.append(
                                {
                                    "kernel": "NTK",
                                    "dtype": dtype,
                                    "activation": act_name,
                                    "trial": trial,
                                    "seed": seed,
                                    "implementation": impl,
                                    "error": rel(k, ntk32),
                                }  # fmt: skip
                            )
                        k = ntk_core.empirical_nngp(apply_fn, *cast)
                        rows.append(
                            {
                                "kernel": "NNGP",
                                "dtype": dtype,
                                "activation": act_name,
                                "trial": trial,
                                "seed": seed,
                                "implementation": None,
                                "error": rel(k, nngp32),
                            }  # fmt: skip
                        )
    ranges = {}
    for kernel in ("NTK", "NNGP"):
        for dtype in ("bfloat16", "float16"):
            sel = [r for r in rows if r["kernel"] == kernel and r["dtype"] == dtype]
            worst = max(sel, key=lambda r: r["error"])
            ranges[f"{kernel} {dtype}"] = {
                "min": min(r["error"] for r in sel),
                "max": worst["error"],
                "max_activation": worst["activation"],
            }
    return {
        "sizes": sizes,
        "samples": samples,
        "seeds": seeds,
        "trials": trials,
        "implementations": implementations,
        "ranges": ranges,
        "rows": rows,
    }


def measure_c3() -> dict:
    run = timed([sys.executable, "examples/c3_gp_erf.py"], env=_env(None))
    if run["rc"] != 0:
        _fail("examples/c3_gp_erf.py", run)
    return {"command": "python examples/c3_gp_erf.py", "wall_s": run["wall_s"],
            "stdout": run["stdout"]}  # fmt: skip


def measure_track() -> dict:
    """``ntk track --out TMP`` with its defaults in a fresh process; its summary.json."""
    with tempfile.TemporaryDirectory(prefix="ntk-track-") as out:
        run = timed([ntk_executable(), "track", "--out", out, "--no-progress"], env=_env(None))
        if run["rc"] != 0:
            _fail("ntk track", run)
        with open(os.path.join(out, "summary.json")) as fh:
            summary = json.load(fh)
    history = summary.get("history", {})
    return {
        "wall_s": run["wall_s"],
        "seconds": summary["seconds"],
        "steps": summary["steps"],
        "every": summary["every"],
        "probe": summary["probe"],
        "implementation": summary["implementation"],
        "test_accuracy": summary["test_accuracy"],
        "kernels": len(history.get("step", [])),
        "final_distance": (history.get("kernel_distance") or [None])[-1],
        "final_centered_alignment": (history.get("centered_alignment") or [None])[-1],
    }


# ---------------------------------------------------------------- the README's text


def sci(x: float, digits: int = 1) -> str:
    """2 significant digits, compact exponent: 5.19e-07 -> '5.2e-7' (digits=1)."""
    mantissa, exponent = f"{x:.{digits}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def span(values, fmt=lambda v: f"{v:.1f}", sep="-") -> str:
    """'11.0-11.3' for a range, '11.0' when all values print alike."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def _head(result: dict) -> str:
    before, after = result["load_before"], result["load_after"]
    load = (
        f"1-minute load average {before[0]:.1f} before, {after[0]:.1f} after"
        if before and after
        else "load average not available"
    )
    return f"Measured {result['date']} on {describe(result['machine'])} ({load})"


def text_demo(r: dict) -> str:
    runs = r["runs"]
    summaries = [x["summary"] for x in runs]
    impls = sorted({s["implementation"] for s in summaries})
    accuracy = span([s["test_accuracy"] for s in summaries], lambda v: f"{v:.4f}")
    twin = span([s["flax_vs_haiku_max_relative_difference"] for s in summaries], sci, sep=" to ")
    times = "one run" if len(runs) == 1 else f"{len(runs)} runs"
    return (
        f"{_head(r)}: `ntk demo` in a fresh process ({times}), "
        f"{span([x['demo_s'] for x in runs])} s for the demo itself "
        f"({span([x['wall_s'] for x in runs])} s with the Python start-up), "
        f"`implementation: 'auto' -> {'/'.join(impls)}`, test accuracy {accuracy}, "
        f"Flax vs Haiku {twin}."
    )


def text_cache(r: dict) -> str:
    def both(runs):
        return (
            f"{span([x['wall_s'] for x in runs])} s "
            f"(the demo's own time {span([x['demo_s'] for x in runs])} s)"
        )

    fill, after = r["filling"], r["after"]
    runs_after = "run" if len(after) == 1 else f"{len(after)} runs"
    return (
        f"{_head(r)}: `ntk demo` (whole command, Python start-up included) took "
        f"{both([r['without_cache']])} without the cache, {both([fill])} on the run that "
        f"fills it ({fill['cache_bytes'] / 1e6:.1f} MB), {both(after)} on the "
        f"{runs_after} after."
    )


def text_doctor(r: dict) -> str:
    runs = r["runs"]
    errors = [e for x in runs for e in x["errors"].values()]
    nonzero = [e for e in errors if e != 0]
    zeros = len(errors) - len(nonzero)
    errs = span(nonzero, lambda v: sci(v, 0), sep=" to ") if nonzero else "0"
    if zeros and nonzero:
        errs += f" ({zeros} of {len(errors)} comparisons exactly 0)"
    checks = runs[-1]["checks"]
    passed = sum(c["status"] == "pass" for c in checks)
    skipped = sum(c["status"] == "skip" for c in checks)
    return (
        f"{_head(r)}: max |ΔK| / max |K| {errs} in the self-test "
        f"({passed} of {len(checks)} checks passed"
        f"{f', {skipped} skipped' if skipped else ''}); the whole `ntk doctor` took "
        f"{span([x['wall_s'] for x in runs], lambda v: f'{v:.0f}')} s with the Python "
        f"start-up, compilation dominating."
    )


def text_half(r: dict) -> str:
    g = r["ranges"]

    def rng(key):
        return span([g[key]["min"], g[key]["max"]], sci, sep=" to ")

    worst = {g[k]["max_activation"] for k in g}
    outliers = (
        "; the largest errors came from ReLU (units near zero that change sign when rounded)"
        if worst == {"relu"}
        else ""
    )
    sizes = "-".join(str(s) for s in r["sizes"])
    return (
        f"{_head(r)}: max |ΔK| / max |K| against the float32 model's kernel, on {sizes} "
        f"ReLU and tanh MLPs ({r['samples']} samples, {r['seeds']} seeds, "
        f"{r['trials']} independent trials; NTK with each of "
        f"{', '.join(f'`{i}`' for i in r['implementations'])}): NTK {rng('NTK bfloat16')} "
        f"in bfloat16 and {rng('NTK float16')} in float16, NNGP {rng('NNGP bfloat16')} "
        f"and {rng('NNGP float16')}{outliers}."
    )


def text_c3(r: dict) -> str:
    return (
        f"{_head(r)}: `python examples/c3_gp_erf.py` (16 Monte Carlo samples) took "
        f"{r['wall_s']:.0f} s with the Python start-up."
    )


def text_track(r: dict) -> str:
    tail = ""
    if r["final_distance"] is not None and r["final_centered_alignment"] is not None:
        tail = (
            f"; at the last step the kernel distance from the initial NTK was "
            f"{r['final_distance']:.3f} and the centred alignment "
            f"{r['final_centered_alignment']:.2f}"
        )
    return (
        f"{_head(r)}: `ntk track` with its defaults ({r['steps']} steps, the NTK of "
        f"{r['probe']} probe samples every {r['every']} steps: {r['kernels']} kernels, "
        f"`'auto' -> {r['implementation']}`) took {r['wall_s']:.0f} s with the Python "
        f"start-up, {r['seconds']['tracking']:.0f} s of it for the kernels and their "
        f"metrics; test accuracy {r['test_accuracy']:.3f}{tail}."
    )


def text_tests(r: dict) -> str:
    counts = ", ".join(f"{n} {word}" for word, n in r["counts"].items())
    minutes, seconds = divmod(round(r["wall_s"]), 60)
    return (
        f"The tests take about {round(r['wall_s'] / 60)} min on a "
        f"{r['machine']['cpus_usable']}-core machine, installation not included. "
        f"{_head(r)}: `{r['command']}` took {minutes} min {seconds} s "
        f"(pytest: {counts} in {r['pytest_seconds']:.0f} s)."
    )


TEXT = {
    "demo": text_demo,
    "cache": text_cache,
    "doctor": text_doctor,
    "half": text_half,
    "c3": text_c3,
    "track": text_track,
    "tests": text_tests,
}


def wrap(text: str) -> str:
    return textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False)


def _block(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- figures:{re.escape(name)} -->\n)(.*?)(\n<!-- /figures:{re.escape(name)} -->)",
        re.DOTALL,
    )


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` (of ``FILES[name]``) with the block ``name`` holding ``body``; the block
    must exist once."""
    pattern = _block(name)
    found = len(pattern.findall(text))
    if found != 1:
        where = FILES[name].relative_to(ROOT)
        raise ValueError(f"{where}: expected one block figures:{name}, found {found}")
    return pattern.sub(lambda m: m.group(1) + body + m.group(3), text)


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"comma-separated parts to measure, of {','.join(PARTS)} (default: all)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the blocks; write neither the files nor JSON"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of demo and doctor (1)")
    parser.add_argument(
        "--cache-runs-after", type=int, default=2, help="runs after the cache is filled (2)"
    )
    parser.add_argument("--half-seeds", type=int, default=13, help="seeds per activation (13)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"--only: unknown part(s) {unknown}; choose from {','.join(PARTS)}")
    texts = {path: path.read_text() for path in {FILES[name] for name in parts}}
    for name in parts:  # fail before measuring, not after
        replace_block(texts[FILES[name]], name, "")

    m = machine()
    measure = {
        "demo": lambda: measure_demo(args.repeat),
        "cache": lambda: measure_cache(args.cache_runs_after),
        "doctor": lambda: measure_doctor(args.repeat),
        "half": lambda: measure_half(args.half_seeds),
        "c3": measure_c3,
        "track": measure_track,
        "tests": measure_tests,
    }
    results = {}
    for name in PARTS:
        if name not in parts:
            continue
        print(f"[{name}] measuring ...", file=sys.stderr, flush=True)
        before, date = loadavg(), _now()
        result = measure[name]()
        result.update(date=date, machine=m, load_before=before, load_after=loadavg())
        results[name] = result
        body = wrap(TEXT[name](result))
        result["text"] = body
        texts[FILES[name]] = replace_block(texts[FILES[name]], name, body)
        print(f"<!-- figures:{name} -->\n{body}\n<!-- /figures:{name} -->\n", flush=True)

    if args.dry_run:
        print("--dry-run: the files and the JSON left unchanged.", file=sys.stderr)
        return 0
    for path, text in texts.items():
        path.write_text(text)
    stored = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for result in results.values():
        for run in result.get("runs", []):
            run.pop("stdout", None)
    stored.update(results)
    RESULTS.write_text(json.dumps(stored, indent=2, ensure_ascii=False) + "\n")
    written = ", ".join(str(path) for path in texts)
    print(f"wrote {written} and {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
