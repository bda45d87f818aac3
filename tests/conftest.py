"""Test-session setup.

The suite compiles hundreds of tiny XLA programs whose run time is negligible, so
compilation dominates it. LLVM's optimisation level 0 compiles them about a third
faster on CPU (measured: 80 reference-grid tests in 97 s instead of 143 s); it does not
change what is computed, and every test compares against tolerances or within one
compiled program. XLA's older CPU fusion emitters (``--xla_cpu_use_fusion_emitters=false``,
what the library's own features programs use on CPU) compile faster again (measured:
tests/core/test_structured.py 65 s -> 38 s on 2 cores). Set before JAX's backend
starts (importing ntk_core, as the pytest plugin does, starts none; until 2026-12-06 it
did, and a run without xdist compiled with XLA's defaults: test_structured.py alone
118 s, now 69 s); an XLA_FLAGS already naming an option is left as it is. Tests compile many identical programs
(the same models in many files, each through a new jit): each test process keeps JAX's
persistent compilation cache in a folder of its own, removed at exit (measured: the
structured and reference-grid files 194 s -> 148 s in one process). It is set in the
process's config, not its environment, so the subprocesses tests start compile afresh.
JAX's compile event still fires for a program read from the cache (the compilation
counts of tests/core/test_traces.py hold).

Under pytest-xdist a worker reports "workerfinished" and then still runs the outer
``pytest_sessionfinish`` wrappers (the terminal summary), ``pytest_unconfigure`` and the
config cleanups; the controller tells it to exit as soon as the last worker has
reported, and execnet sends a worker still busy 5 s later a SIGINT. The
KeyboardInterrupt then lands in whatever Python code runs, most often JAX's
``_xla_gc_callback`` during pytest's final ``gc.collect()``, where it cannot propagate
and is reported as a ``PytestUnraisableExceptionWarning``. :func:`pytest_sessionfinish`
keeps that last phase short.
"""

import atexit
import importlib
import os
import shutil
import subprocess
import sys
import tempfile

import pytest


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA accepts ``flag`` (it aborts on unknown XLA_FLAGS: jaxlib
    0.4.35 has no fusion-emitter option); asked once, in a subprocess, and remembered in
    the environment the xdist workers inherit."""
    key = "NTK_TESTS_XLA_KNOWS_FUSION_FLAG"
    if key not in os.environ:
        env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
        probe = [sys.executable, "-c", "import jax; jax.devices()"]
        os.environ[key] = str(subprocess.run(probe, env=env, capture_output=True).returncode == 0)
    return os.environ[key] == "True"


for _flag, _value in (
    ("--xla_backend_optimization_level", "0"),
    ("--xla_cpu_use_fusion_emitters", "false"),
):
    if _flag not in os.environ.get("XLA_FLAGS", "") and (
        "fusion" not in _flag or _xla_knows(f"{_flag}={_value}")
    ):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_flag}={_value}").strip()


def pytest_configure(config):
    """The persistent compilation cache of a process that runs tests (not the xdist
    controller)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import jax

    folder = tempfile.mkdtemp(prefix="ntk-tests-xla-cache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """In an xdist worker, import Hypothesis before the worker reports "workerfinished".

    Hypothesis's pytest plugin imports the package in its ``pytest_terminal_summary``
    (``from hypothesis.internal.observability import _WROTE_TO``), which a worker runs
    after "workerfinished", inside the terminal reporter's outer hook wrapper. No test
    here uses Hypothesis, so that was the first import: the whole package, assertions
    rewritten by pytest as the module of a plugin distribution (and not cached with
    PYTHONDONTWRITEBYTECODE=1), about 1 s on an idle machine and 4 s or more on a
    busy one, enough to outlast execnet's 5 s. A plain hook (trylast: after the
    session fixtures' teardown) runs before xdist's wrapper sends "workerfinished".
    """
    config = session.config
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        return
    if config.pluginmanager.has_plugin("hypothesispytest"):  # installed with hypothesis
        importlib.import_module("hypothesis")
