"""Issue 19, Monte Carlo kernels to files: ``out="mc.npy"`` writes the NNGP's and the
NTK's means to ``mc.nngp.npy`` and ``mc.ntk.npy`` with the running sum on disk; they
equal the in-memory average bit for bit, ``resume=True`` finishes a run killed at any
moment (SIGKILL, in a subprocess) bit for bit, and every refusal names what is wrong."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
import reference
from ntk_core._blocked import store as _store
from ntk_core._monte_carlo import files as _monte_carlo_files


def init(k):
    k1, k2 = jax.random.split(k)
    return {"w": jax.random.normal(k1, (5, 16)), "v": jax.random.normal(k2, (16, 3))}


def f(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


def f16(p, x):
    return f(p, x).astype(jnp.float16)


X1 = jax.random.normal(jax.random.PRNGKey(2), (23, 5))
X2 = jax.random.normal(jax.random.PRNGKey(3), (9, 5))
KEY = jax.random.PRNGKey(0)


def _mc(apply_fn=f, x2=None, init_fn=init, **options):
    options = {"key": KEY, "n_samples": 3, "batch_size": 7, **options}
    return ntk_core.monte_carlo_kernels(init_fn, apply_fn, X1, x2, **options)


def _files(folder) -> list[str]:
    return sorted(os.listdir(folder))


@pytest.mark.filterwarnings("ignore::ntk_core.PrecisionWarning")  # the float16 model
@pytest.mark.parametrize("n_samples", [1, 2, 3])
@pytest.mark.parametrize(
    "case",
    ["x2=None", "x2", "float16", "trace_axes=()", "diagonal_axes=(0,)", "structured"],
)
def test_files_equal_the_in_memory_average(tmp_path, case, n_samples):
    """Each mean equals the in-memory average bit for bit (the same sums in the same
    order, float32 for half-precision kernels), in its dtype; the running sums are
    removed, the manifests say complete."""
    options = {
        "x2=None": {},
        "x2": {"x2": X2},
        "float16": {"apply_fn": f16},
        "trace_axes=()": {"trace_axes": ()},
        "diagonal_axes=(0,)": {"diagonal_axes": (0,)},
        "structured": {"implementation": "structured", "x2": X2},
    }[case]
    options["n_samples"] = n_samples
    expected = _mc(**options)
    got = _mc(out=str(tmp_path / "mc.npy"), **options)
    for kind in ("nngp", "ntk"):
        a, b = getattr(got, kind), getattr(expected, kind)
        assert isinstance(a, np.memmap) and not a.flags.writeable
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == np.asarray(b).tobytes(), kind
        assert np.load(tmp_path / f"mc.{kind}.npy").tobytes() == a.tobytes()
    assert _files(tmp_path) == [
        "mc.nngp.npy",
        "mc.nngp.npy.manifest.json",
        "mc.ntk.npy",
        "mc.ntk.npy.manifest.json",
    ]
    for kind in ("nngp", "ntk"):
        manifest = json.load(open(tmp_path / f"mc.{kind}.npy.manifest.json"))
        assert manifest["complete"] and manifest["fingerprint"]["sample"] == n_samples - 1


def test_the_mean_is_the_float64_mean_of_the_samples_kernels(tmp_path):
    """Against an independent reference: the mean over the samples' parameters of the
    float64 Jacobian contraction J(x1) J(x2)ᵀ (traced over outputs) and of f(x1) f(x2)ᵀ
    (tests/reference.py)."""
    got = _mc(x2=X2, out=str(tmp_path / "mc.npy"))
    samples = [init(k) for k in jax.random.split(KEY, 3)]
    ntk = np.mean([reference.ntk(f, p, X1, X2)[0] for p in samples], axis=0)
    nngp = np.mean([reference.nngp(f, p, X1, X2)[0] for p in samples], axis=0)
    reference.assert_close(got.ntk, ntk)
    reference.assert_close(got.nngp, nngp)


def test_a_finished_run_is_returned_without_computing(tmp_path, monkeypatch):
    path = str(tmp_path / "mc.npy")
    first = _mc(out=path)
    calls = []
    monkeypatch.setattr(
        _store.NpyStore, "put", lambda *a, **k: calls.append(a) or pytest.fail("computed")
    )
    again = _mc(out=path)
    assert calls == [] and again.ntk.tobytes() == first.ntk.tobytes()
    assert again.nngp.tobytes() == first.nngp.tobytes()


def test_existing_files_are_never_overwritten_silently(tmp_path):
    path = str(tmp_path / "mc.npy")
    _mc(out=path, n_samples=2)
    with pytest.raises(
        ValueError,
        match=r"^monte_carlo_kernels: out=.*mc\.npy'?: .*mc\.nngp\.npy'? exists, and is not "
        r"the finished result of this call\. Fix: pass resume=True .* overwrite=True",
    ):
        _mc(out=path, n_samples=3)
    replaced = _mc(out=path, n_samples=3, overwrite=True)
    assert replaced.ntk.tobytes() == np.asarray(_mc(n_samples=3).ntk).tobytes()


@pytest.mark.parametrize(
    "change, names",
    [
        ({"n_samples": 4}, r"n_samples \(3 -> 4\)"),
        ({"key": jax.random.PRNGKey(7)}, r"key; initialisation \(sample 0\)"),
        ({"x2": X2}, r"x2"),
        ({"apply_fn": lambda p, x: 2 * f(p, x)}, r"options \(model \(its jaxpr\)"),
        ({"trace_axes": ()}, r"options \(trace_axes: \(-1,\) -> \(\)\); shape"),
        ({"init_fn": lambda k: {**init(k), "v": init(k)["v"] * 1.0}}, r"initialisation \(its"),
    ],
)
def test_resuming_another_computation_is_refused_naming_what_differs(tmp_path, change, names):
    """An interrupted run (its first sample summed, the second begun) resumed with
    something else is refused before anything is computed, naming what differs."""
    path = str(tmp_path / "mc.npy")
    _interrupted(path)
    before = {name: open(tmp_path / name, "rb").read() for name in _files(tmp_path)}
    with pytest.raises(
        ValueError, match=rf"^monte_carlo_kernels: resume=True, but .* different call: .*{names}"
    ):
        _mc(out=path, resume=True, **change)
    after = {name: open(tmp_path / name, "rb").read() for name in _files(tmp_path)}
    assert after == before  # nothing written
    resumed = _mc(out=path, resume=True)  # the same call finishes it
    assert resumed.ntk.tobytes() == np.asarray(_mc().ntk).tobytes()


def _interrupted(path):
    """A run of 3 samples stopped (by an exception) in sample 1's NTK, 4 tiles in."""
    written = []
    original = _store.NpyStore.put

    def put(self, *args):
        if "ntk" in self.path and self.manifest["fingerprint"].get("sample") == 1:
            if len(written) == 4:
                self.commit()
                raise KeyboardInterrupt
            written.append(1)
        original(self, *args)

    _store.NpyStore.put = put
    try:
        with pytest.raises(KeyboardInterrupt):
            _mc(out=path, resume=True)
    finally:
        _store.NpyStore.put = original


def test_a_damaged_running_sum_is_refused_with_the_fix(tmp_path):
    """The earlier sample's sum cut short (a full disk, a copy interrupted): refused
    naming the file, not numpy's error from inside."""
    path = str(tmp_path / "mc.npy")
    _interrupted(path)  # sample 0's sums finished in mc.K.npy (3 samples: the odd ones)
    summed = tmp_path / "mc.ntk.npy"
    os.truncate(summed, os.path.getsize(summed) // 2)
    with pytest.raises(
        ValueError,
        match=r"^monte_carlo_kernels: .*mc\.ntk\.npy'? cannot be read as the running sum its "
        r"manifest describes \(ValueError: .*\)\. Fix: pass overwrite=True",
    ):
        _mc(out=path, resume=True)


def test_an_interrupted_run_resumes_from_the_sample_it_was_in(tmp_path, monkeypatch):
    """Resumed, sample 0 is not computed again and sample 1's NTK computes only the
    tiles its manifest does not list (10 tiles of 7 samples: 4 blocks, 4·5/2)."""
    path = str(tmp_path / "mc.npy")
    _interrupted(path)
    puts = []
    original = _store.NpyStore.put

    def put(self, *args):
        puts.append((os.path.basename(self.path), self.manifest["fingerprint"]["sample"]))
        original(self, *args)

    monkeypatch.setattr(_store.NpyStore, "put", put)
    resumed = _mc(out=path, resume=True)
    assert {s for _, s in puts} == {1, 2}
    ntk_1 = [name for name, s in puts if s == 1]
    assert len(ntk_1) == 10 - 4 and all("ntk" in name for name in ntk_1)
    assert resumed.ntk.tobytes() == np.asarray(_mc().ntk).tobytes()
    assert resumed.nngp.tobytes() == np.asarray(_mc().nngp).tobytes()


def test_refusals_before_anything_is_computed(tmp_path, monkeypatch):
    path = str(tmp_path / "mc.npy")
    with pytest.raises(ValueError, match=r"^monte_carlo_kernels: out=.* but batch_size is None"):
        ntk_core.monte_carlo_kernels(init, f, X1, key=KEY, n_samples=2, out=path)
    with pytest.raises(ValueError, match=r"^monte_carlo_kernels: out must be a path ending in"):
        _mc(out=str(tmp_path / "mc.bin"))
    with pytest.raises(ValueError, match=r"^monte_carlo_kernels: resume=True applies to the file"):
        _mc(resume=True)
    with pytest.raises(ValueError, match=r"cannot run inside batch_size_samples=2"):
        _mc(out=path, batch_size_samples=2)
    open(path[:-4] + ".ntk.sum-a.npy", "wb").write(b"not a kernel")
    with pytest.raises(ValueError, match=r"^monte_carlo_kernels: resume=True, but .*sum-a"):
        _mc(out=path, resume=True)
    os.unlink(path[:-4] + ".ntk.sum-a.npy")
    os.mkdir(path[:-4] + ".ntk.sum-a.npy")
    with pytest.raises(
        ValueError, match=r"^monte_carlo_kernels: out=.*: .*sum-a.npy'? is a folder, not a file"
    ):
        _mc(out=path, overwrite=True)
    os.rmdir(path[:-4] + ".ntk.sum-a.npy")
    with pytest.raises(ValueError, match=r"^monte_carlo_kernels: out=.*/\.npy' has no name before"):
        _mc(out=str(tmp_path / ".npy"))
    usage = _store.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(
        _monte_carlo_files.shutil, "disk_usage", lambda folder: usage._replace(free=3000)
    )
    with pytest.raises(
        ValueError,
        match=r"^monte_carlo_kernels: out=.* needs 4232 bytes, the disk has 3000 bytes",
    ):
        _mc(out=path)
    assert _files(tmp_path) == []  # refused before creating anything


_CHILD = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, ntk_core
    path, dtype = sys.argv[1], sys.argv[2]
    ntk_core._blocked.store.COMMIT_SECONDS = 0.0  # tiles listed after every tile
    def init(k):
        k1, k2 = jax.random.split(k)
        return {"w": jax.random.normal(k1, (5, 64)), "v": jax.random.normal(k2, (64, 3))}
    f = lambda p, x: (jnp.tanh(x @ p["w"]) @ p["v"]).astype(dtype)
    x = jax.random.normal(jax.random.PRNGKey(2), (60, 5))
    ntk_core.monte_carlo_kernels(init, f, x, key=jax.random.PRNGKey(0), n_samples=4,
                                 trace_axes=(), batch_size=6, out=path, resume=True)
    """
)


def _child(path, dtype, cache):
    """The children of one test module share a compilation cache of their own (JAX's, in
    ``cache``): the first compiles, the others read its programs (the same executables,
    so the same bits; the three tests 16.6 s against 18.6 s, measured alone)."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache))
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.update(JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), dtype],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )


@pytest.fixture(scope="module")
def child_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("children_xla_cache")


def _progress(folder) -> set:
    """(kind, sample, tiles listed) of every buffer being written."""
    found = set()
    for name in os.listdir(folder):
        if name.endswith(".manifest.json"):
            try:
                manifest = json.load(open(os.path.join(folder, name)))
            except (OSError, ValueError):
                continue
            kind = name.split(".")[1]
            fp = manifest["fingerprint"]
            found.add((kind, fp["sample"], len(manifest["done"]), manifest["complete"]))
    return found


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``uninterrupted(dtype)``: the folder of an uninterrupted run (one per dtype), the
    children's program run in this process (the XLA_FLAGS they inherit are this process's;
    no interpreter start and no fresh compile: about 2 s less per dtype)."""
    runs = {}

    def folder(dtype):
        if dtype not in runs:
            runs[dtype] = tmp_path_factory.mktemp(f"whole_{dtype}")
            argv, commit = sys.argv, _store.COMMIT_SECONDS
            sys.argv = ["-c", str(runs[dtype] / "mc.npy"), dtype]
            try:
                with warnings.catch_warnings():  # float16's PrecisionWarning, as in a child
                    warnings.simplefilter("ignore")
                    exec(_CHILD, {"__name__": "__uninterrupted__"})
            finally:
                sys.argv, _store.COMMIT_SECONDS = argv, commit
        return runs[dtype]

    return folder


@pytest.mark.parametrize(
    "dtype, kind, sample, tiles",
    [
        ("float32", "nngp", 0, 3),  # the first sample: no earlier sum to resume from
        ("float32", "ntk", 3, 40),  # the last sample: the mean being written
        ("float16", "nngp", 2, 10),  # summed in float32: the sum-b buffer
    ],
)
def test_killed_at_any_moment_and_resumed_equals_an_uninterrupted_run(
    tmp_path, uninterrupted, child_cache, dtype, kind, sample, tiles
):
    """SIGKILL (no cleanup runs) once ``kind``'s buffer of ``sample`` lists ``tiles``
    of its 55 tiles (60 samples in tiles of 6), then the same call with resume=True
    finishes it: both files equal an uninterrupted run's bit for bit."""
    (tmp_path / "killed").mkdir()
    whole = uninterrupted(dtype) / "mc.npy"
    path = tmp_path / "killed" / "mc.npy"
    child = _child(path, dtype, child_cache)
    start = time.monotonic()
    while child.poll() is None and not any(
        k == kind and s == sample and done >= tiles and not complete
        for k, s, done, complete in _progress(path.parent)
    ):
        assert time.monotonic() - start < 300
        time.sleep(0.002)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    if child.returncode == 0:
        pytest.skip("the run finished before it could be killed")  # not seen in practice
    resumed = _child(path, dtype, child_cache)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    for k in ("nngp", "ntk"):
        a = np.load(tmp_path / "killed" / f"mc.{k}.npy")
        b = np.load(whole.parent / f"mc.{k}.npy")
        assert a.dtype == np.dtype(dtype if k == "nngp" else "float32")
        assert a.tobytes() == b.tobytes(), k
    assert _files(path.parent) == _files(whole.parent)
