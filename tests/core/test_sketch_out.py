"""Issue 27, sketch features out of core: ``ntk_sketch_fn(..., out="phi.npy")`` writes Φ
block by block through the blocked store (manifest, CRC-32 per block), returns it
memory-mapped read-only, and ``resume=True`` finishes a run stopped at any moment
(an exception, or SIGKILL in a subprocess) computing only the missing blocks, bit for bit.
Mirrors tests/core/test_out_of_core.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
from ntk_core._blocked import store as _store
from ntk_core._functional import sketch as _sketch


def f(p, x):
    return jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]


P = {
    "w": jax.random.normal(jax.random.PRNGKey(0), (5, 16)),
    "b": jax.random.normal(jax.random.PRNGKey(4), (16,)),
    "v": jax.random.normal(jax.random.PRNGKey(1), (16, 3)),
}
X = jax.random.normal(jax.random.PRNGKey(2), (37, 5))  # blocks of 8: 5 blocks, the last of 5
KEY = jax.random.PRNGKey(3)
_BLOCK_FN = _sketch._block_fn  # the module's own, before any test wraps it


def _features(path=None, k=64, key=KEY, **options):
    out = None if path is None else str(path)
    return ntk_core.ntk_sketch_fn(f, k=k, key=key, batch_size=8, out=out, **options)


def _manifest(path) -> dict:
    return json.loads(open(_store.manifest_path(str(path))).read())


def _unfinished(path, **changes):
    """The manifest of ``path`` marked as an interrupted run's, with ``changes``."""
    manifest = _manifest(path)
    manifest.update({"complete": False, **changes})
    open(_store.manifest_path(str(path)), "w").write(json.dumps(manifest))


def _calls(monkeypatch, fail_after=None) -> list:
    """The first rows of the blocks sketched from now on (each jitted block call);
    with ``fail_after``, the call after that many raises, as a run stopped midway."""
    calls, real = [], _BLOCK_FN

    def counting(*args):
        run = real(*args)

        def counted(params, aux, x, key):
            if fail_after is not None and len(calls) == fail_after:
                raise RuntimeError("stopped")
            calls.append(np.asarray(x)[0].tobytes())
            return run(params, aux, x, key)

        return counted

    monkeypatch.setattr(_sketch, "_block_fn", counting)
    return calls


def _blocks_of(calls) -> list[int]:
    """The block starts (in X's rows) of the recorded calls."""
    rows = [np.asarray(X)[i].tobytes() for i in range(0, 37, 8)]
    return [rows.index(c) * 8 for c in calls]


@pytest.mark.parametrize("trace_axes", [(-1,), ()])
def test_the_file_equals_the_in_memory_features_bit_for_bit(tmp_path, trace_axes):
    """37 samples in blocks of 8 (the last ragged): the file holds the bytes of the
    in-memory blocked features; the call returns it read-only memory-mapped; the
    manifest lists the 5 blocks, complete; low_rank_inference takes the memory map and
    gives the in-memory features' numbers exactly."""
    path = tmp_path / "phi.npy"
    phi = _features(path, trace_axes=trace_axes)(P, X)
    in_memory = _features(trace_axes=trace_axes)(P, X)
    assert isinstance(phi, np.memmap) and not phi.flags.writeable
    assert phi.shape == ((37, 64) if trace_axes else (37, 3, 64))
    assert np.load(path).tobytes() == in_memory.tobytes()
    manifest = _manifest(path)
    assert manifest["complete"] and [d[:2] for d in manifest["done"]] == [
        [r, r] for r in range(0, 37, 8)
    ]
    if trace_axes:
        y = np.sin(np.arange(37.0))
        on_disk = ntk_core.predict.low_rank_inference(phi, y, diag_reg=1e-2)
        in_ram = ntk_core.predict.low_rank_inference(in_memory, y, diag_reg=1e-2)
        assert np.array_equal(on_disk.weights, in_ram.weights)


@pytest.mark.parametrize("budget", [2**30, 2 * 4 * 768 + 8], ids=["roomy", "4-rows"])
def test_auto_batch_size_blocks_from_memory(tmp_path, monkeypatch, budget):
    """batch_size="auto" (as ntk_fn's): blocks whose Φ fits in half the memory budget
    (one block in memory when it fits; to a file at least 8 blocks, each a resume
    point); bit for bit the features of that int batch_size."""
    monkeypatch.setattr(_sketch, "default_memory_budget", lambda: budget)
    rows = 37 if budget == 2**30 else 4  # Φ of a sample: 3 x 64 float32 = 768 bytes
    for path, want in [(None, rows), (tmp_path / "phi.npy", min(rows, 5))]:  # ⌈37 / 8⌉ = 5
        calls = _calls(monkeypatch)
        out = None if path is None else str(path)
        fn = ntk_core.ntk_sketch_fn(f, k=64, key=KEY, trace_axes=(), batch_size="auto", out=out)
        phi = fn(P, X)
        assert len(calls) == -(-37 // want), (path, len(calls))
        same = ntk_core.ntk_sketch_fn(f, k=64, key=KEY, trace_axes=(), batch_size=want)(P, X)
        assert np.asarray(phi).tobytes() == np.asarray(same).tobytes()


def test_a_finished_file_is_returned_without_computing(tmp_path, monkeypatch):
    path = tmp_path / "phi.npy"
    first = np.array(_features(path)(P, X))
    stamp = os.stat(path).st_mtime_ns
    calls = _calls(monkeypatch)
    again = _features(path)(P, X)
    assert calls == [] and np.array_equal(again, first) and os.stat(path).st_mtime_ns == stamp


def test_stopped_midway_then_resumed_computes_only_the_missing_blocks(tmp_path, monkeypatch):
    """A run stopped by an exception in its third block (the manifest listing every
    block as written: COMMIT_SECONDS 0) leaves 2 blocks; resume=True sketches the other
    3 and the file equals an uninterrupted run's bytes."""
    monkeypatch.setattr(_store, "COMMIT_SECONDS", 0.0)
    whole = np.array(_features(tmp_path / "whole.npy")(P, X))
    path = tmp_path / "phi.npy"
    stopped = _calls(monkeypatch, fail_after=2)
    with pytest.raises(RuntimeError, match="stopped"):
        _features(path, resume=True)(P, X)
    manifest = _manifest(path)
    assert not manifest["complete"] and [d[0] for d in manifest["done"]] == [0, 8]
    assert _blocks_of(stopped) == [0, 8]
    with pytest.raises(ValueError, match=r"^ntk_sketch_fn: out=.*phi\.npy' exists, and is not"):
        _features(path)(P, X)  # without resume=True the unfinished file is kept
    resumed = _calls(monkeypatch)
    phi = _features(path, resume=True)(P, X)
    assert _blocks_of(resumed) == [16, 24, 32]
    assert np.load(path).tobytes() == whole.tobytes() and np.array_equal(phi, whole)
    assert _manifest(path)["complete"]


@pytest.mark.parametrize(
    "change, names",
    [
        ({"key": jax.random.PRNGKey(4)}, r"key differ"),
        ({"k": 32}, r"options \(k: 64 -> 32\); shape \(\[37, 64\] -> \[37, 32\]\) differ"),
        ({"x": X[:30]}, r"x; shape \(\[37, 64\] -> \[30, 64\]\) differ"),
        ({"params": jax.tree.map(lambda v: v + 1.0, P)}, r"params differ"),
        ({"wrt": ["v"]}, r"params; params held \(wrt\); options \(.*wrt: unset -> \[.*'v'"),
        ({"trace_axes": ()}, r"options \(.*trace_axes: \(-1,\) -> \(\)\); shape"),
        ({"model": lambda p, x: jnp.sin(x @ p["w"] + p["b"]) @ p["v"]}, r"options \(model"),
    ],
    ids=["key", "k", "N", "params", "wrt", "trace_axes", "model"],
)
def test_resuming_another_sketch_is_refused_naming_what_differs(tmp_path, change, names):
    path = tmp_path / "phi.npy"
    _features(path)(P, X)
    _unfinished(path)
    options = {"key": change.get("key", KEY), "k": change.get("k", 64)}
    options |= {name: change[name] for name in ("wrt", "trace_axes") if name in change}
    model = change.get("model", f)
    features = ntk_core.ntk_sketch_fn(model, batch_size=8, out=str(path), resume=True, **options)
    with pytest.raises(
        ValueError,
        match=r"^ntk_sketch_fn: resume=True, but .*phi\.npy' was started by a different "
        r"call: .*" + names + r".*Fix: resume the same call, or pass overwrite=True",
    ):
        features(change.get("params", P), change.get("x", X))


def test_a_changed_block_is_named_and_computed_again(tmp_path, monkeypatch):
    """A resume checks every listed block's CRC-32: the block of rows 8..15, changed on
    disk, is named in a warning and sketched again, alone."""
    path = tmp_path / "phi.npy"
    first = np.array(_features(path)(P, X))
    phi = np.load(path, mmap_mode="r+")
    phi[9, 30] += 1.0
    phi.flush()
    del phi
    _unfinished(path)
    calls = _calls(monkeypatch)
    with pytest.warns(
        UserWarning, match=r"phi\.npy': 1 blocks changed since written \(CRC-32\): \[8, 8\]"
    ):
        resumed = _features(path, resume=True)(P, X)
    assert _blocks_of(calls) == [8]
    assert np.load(path).tobytes() == first.tobytes() and np.array_equal(resumed, first)


def test_overwrite_replaces_another_sketch_and_nothing_else_does(tmp_path):
    path = tmp_path / "phi.npy"
    old = np.array(_features(path)(P, X))
    mapped = np.load(path, mmap_mode="r")
    other = jax.random.PRNGKey(9)
    with pytest.raises(
        ValueError,
        match=r"^ntk_sketch_fn: out=.*phi\.npy' exists, and is not the finished result of "
        r"this call\. Fix: pass resume=True \(same call\), overwrite=True, or another path",
    ):
        _features(path, key=other)(P, X)
    assert np.load(path).tobytes() == old.tobytes()
    new = _features(path, key=other, overwrite=True)(P, X)
    assert new.tobytes() == _features(key=other)(P, X).tobytes()
    assert np.array_equal(mapped, old) and not np.array_equal(new, old)  # the old map intact


def test_refusals_before_anything_is_computed(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"^ntk_sketch_fn: out='phi.npy' writes blocks of rows to a file, but batch_size "
        r"is None\. Fix: pass a batch_size, e.g\. 1024",
    ):
        ntk_core.ntk_sketch_fn(f, k=8, key=KEY, out="phi.npy")
    with pytest.raises(
        ValueError, match=r"^ntk_sketch_fn: resume=True applies to the file of out="
    ):
        ntk_core.ntk_sketch_fn(f, k=8, key=KEY, resume=True)
    with pytest.raises(ValueError, match=r"^ntk_sketch_fn: resume=True and overwrite=True"):
        ntk_core.ntk_sketch_fn(
            f, k=8, key=KEY, batch_size=8, out="p.npy", resume=True, overwrite=True
        )
    with pytest.raises(TypeError, match=r"^ntk_sketch_fn: overwrite must be True or False"):
        ntk_core.ntk_sketch_fn(f, k=8, key=KEY, batch_size=8, out="p.npy", overwrite=1)
    with pytest.raises(ValueError, match=r"^ntk_sketch_fn: out=.*: the folder .* does not exist"):
        _features(tmp_path / "missing" / "phi.npy")(P, X)


_CHILD = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, ntk_core
    path, n, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ntk_core._blocked.store.COMMIT_SECONDS = float(sys.argv[4])  # how often blocks are listed
    x = jax.random.normal(jax.random.PRNGKey(2), (n, 8))
    p = {"w": jax.random.normal(jax.random.PRNGKey(0), (8, 64)),
         "v": jax.random.normal(jax.random.PRNGKey(1), (64, 3))}
    f = lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"]
    ntk_core.ntk_sketch_fn(f, k=512, key=jax.random.PRNGKey(5), trace_axes=(), batch_size=b,
                           out=path, resume=True)(p, x)
    """
)
N_CHILD, B_CHILD = 600, 4  # 150 blocks


def _run_child(path, commit=0.0):
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), str(N_CHILD), str(B_CHILD), str(commit)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _done(path) -> tuple[int, bool]:
    try:
        manifest = _manifest(path)
    except (OSError, ValueError):
        return 0, False
    return len(manifest["done"]), manifest["complete"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The file of an uninterrupted run: the children's program run in this process (the
    XLA_FLAGS they inherit are this process's; no interpreter start, no fresh compile)."""
    whole = tmp_path_factory.mktemp("whole") / "whole.npy"
    argv, commit = sys.argv, _store.COMMIT_SECONDS
    sys.argv = ["-c", str(whole), str(N_CHILD), str(B_CHILD), "0.0"]
    try:
        exec(_CHILD, {"__name__": "__uninterrupted__"})
    finally:
        sys.argv, _store.COMMIT_SECONDS = argv, commit
    assert _done(whole) == (150, True)
    return whole


@pytest.mark.parametrize("kill_after, commit", [(20, 0.0), (1, 0.05)])
def test_killed_at_any_block_and_resumed_equals_an_uninterrupted_run(
    tmp_path, uninterrupted, kill_after, commit
):
    """SIGKILL (no cleanup) once the manifest lists ``kill_after`` of the 150 blocks,
    then the same call with resume=True finishes it: the file equals an uninterrupted
    run's bytes. Blocks listed after every block (``commit`` 0 s) or every 0.05 s
    (written but unlisted blocks are computed again)."""
    path = tmp_path / "killed.npy"
    child = _run_child(path, commit)
    start = time.monotonic()
    while _done(path)[0] < kill_after and child.poll() is None:
        assert time.monotonic() - start < 300
        time.sleep(0.002)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    done, complete = _done(path)
    if complete:
        pytest.skip("the run finished before it could be killed")
    assert child.returncode == -signal.SIGKILL and kill_after <= done < 150
    resumed = _run_child(path)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert _done(path) == (150, True)
    assert np.load(path).tobytes() == np.load(uninterrupted).tobytes()
    assert [name for name in os.listdir(tmp_path) if ".tmp-" in name] == []
