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
(the same models in many files, each through a new jit): the test processes keep JAX's
persistent compilation cache, removed at exit (measured: the structured and
reference-grid files 194 s -> 148 s in one process), and under xdist both workers share
one folder (measured 2026-12-07, test_structured, both reference grids and test_traces
with -n 2, back to back: shared 106 and 114 s at load 3.0-3.3, one folder per worker
181 and 214 s at load 3.9-5.4). It is set in the process's config, not its environment,
so the subprocesses tests start compile afresh.
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
import importlib.util
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


#: The environment variable through which the xdist controller hands its workers one
#: shared compilation cache folder.
SHARED_CACHE = "NTK_TESTS_XLA_CACHE"


def _atomic_cache_writes() -> bool:
    """Makes JAX's file cache write each entry to a temporary file renamed into place, so
    a worker never reads another's half-written entry. JAX locks its folder only with a
    size limit, and then scans the whole folder on every write (thousands of entries
    here); without the lock, writes are plain ``write_bytes``. False (each process keeps
    its own folder) where this JAX's cache class is not the one patched."""
    try:
        from jax._src import lru_cache
    except ImportError:
        return False
    cache, suffix = getattr(lru_cache, "LRUCache", None), getattr(lru_cache, "_CACHE_SUFFIX", None)
    if cache is None or suffix is None or not hasattr(cache, "put"):
        return False

    locked_put = cache.put

    def put(self, key: str, value: bytes) -> None:
        if getattr(self, "eviction_enabled", True):  # a size limit: JAX's own, locked
            return locked_put(self, key, value)
        path = self.path / f"{key}{suffix}"
        if not key or path.exists():
            return
        part = path.with_name(f".{path.name}.{os.getpid()}.part")
        part.write_bytes(value)
        os.replace(part, path)

    cache.put = put
    return True


def pytest_configure(config):
    """The persistent compilation cache of the processes that run tests: under xdist the
    controller makes one folder that its workers share (they inherit its environment when
    it starts them, after this hook), so a program one worker compiled is read by the
    other; JAX locks the folder (``filelock``) once a cache size limit is set. Without
    ``filelock`` each process keeps a folder of its own."""
    under_xdist = bool(getattr(config.option, "numprocesses", None))
    if under_xdist and not hasattr(config, "workerinput"):  # the controller
        if os.environ.get("NTK_TESTS_SHARED_CACHE", "1") == "1":
            folder = tempfile.mkdtemp(prefix="ntk-tests-xla-cache-")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            os.environ[SHARED_CACHE] = folder
        return
    import jax

    folder = os.environ.get(SHARED_CACHE) if hasattr(config, "workerinput") else None
    if folder is None or not _atomic_cache_writes():
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
