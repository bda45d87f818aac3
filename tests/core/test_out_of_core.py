"""Issue 19, out-of-core kernels: ``out="k.npy"`` writes the blocked engine's tiles into
a standard .npy file with a manifest, ``resume=True`` finishes a run killed at any
moment (SIGKILL, in a subprocess) bit for bit, and every refusal names what is wrong."""

from __future__ import annotations

import json
import os
import re
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
import reference
from ntk_core._blocked import store as _store


def f(p, x):
    return jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]


P = {
    "w": jax.random.normal(jax.random.PRNGKey(0), (5, 16)),
    "b": jax.random.normal(jax.random.PRNGKey(4), (16,)),
    "v": jax.random.normal(jax.random.PRNGKey(1), (16, 3)),
}
X1 = jax.random.normal(jax.random.PRNGKey(2), (37, 5))
X2 = jax.random.normal(jax.random.PRNGKey(3), (23, 5))
AXES = {
    "traced": {},
    "full": {"trace_axes": ()},
    "diag_out": {"trace_axes": (), "diagonal_axes": (-1,)},
    "batch_diag": {"diagonal_axes": (0,)},
}


@pytest.mark.parametrize("axes", list(AXES))
@pytest.mark.parametrize("implementation", ["jacobian", "structured", "ntvp", "nngp"])
def test_out_of_core_equals_in_memory(tmp_path, implementation, axes):
    """Ragged sizes (37 and 23 samples in tiles of 8), x2=None and x2 given: the file
    equals the in-memory blocked kernel bit for bit (same tiles), and the float64
    reference to float32 round-off; the call returns the file read-only, memory-mapped."""
    options = dict(batch_size=8, progress=False, **AXES[axes])
    if implementation == "nngp":
        build, ref = ntk_core.nngp_fn, reference.nngp
    else:
        build, ref = ntk_core.ntk_fn, reference.ntk
        options["implementation"] = implementation
    for x2 in (None, X2) if axes != "batch_diag" else (None,):
        path = str(tmp_path / f"k{x2 is None}.npy")
        kernel = build(f, out=path, **options)(P, X1, x2)
        in_memory = build(f, **options)(P, X1, x2)
        assert isinstance(kernel, np.memmap) and not kernel.flags.writeable
        assert np.array_equal(kernel, in_memory)
        assert np.array_equal(np.load(path), in_memory)
        reference.assert_close(kernel, ref(f, P, X1, x2, **AXES[axes])[0])
        manifest = json.loads(open(_store.manifest_path(path)).read())
        assert manifest["complete"]


def test_a_finished_file_is_returned_without_computing(tmp_path, monkeypatch):
    path = str(tmp_path / "k.npy")
    kernel = ntk_core.ntk_fn(f, batch_size=8, out=path, progress=False)
    first = np.array(kernel(P, X1))
    stamp = os.stat(path).st_mtime_ns
    from ntk_core._blocked import tiles as _blocked

    def refuse(*args, **kwargs):
        raise AssertionError("a tile was computed")

    monkeypatch.setattr(_blocked, "compute", refuse)
    again = kernel(P, X1)
    assert np.array_equal(again, first) and os.stat(path).st_mtime_ns == stamp


def test_the_result_keeps_the_outputs_pytree(tmp_path):
    """A model returning {"logits": y}, and per-leaf kernels of one leaf: the file comes
    back in the pytree the in-memory kernel has, computed and when already finished."""
    g = lambda p, x: {"logits": f(p, x)}  # noqa: E731
    path = str(tmp_path / "k.npy")
    for _ in range(2):  # computed, then the finished file
        kernel = ntk_core.empirical_ntk(g, P, X1, batch_size=8, out=path, resume=True)
        assert list(kernel) == ["logits"] and isinstance(kernel["logits"], np.memmap)
        reference.assert_close(kernel["logits"], reference.ntk(f, P, X1, None)[0])
    w = {"w": P["w"]}
    h = lambda p, x: jnp.tanh(x @ p["w"])  # noqa: E731
    per_leaf = ntk_core.empirical_ntk_per_leaf(h, w, X1, batch_size=8, out=str(tmp_path / "l.npy"))
    assert list(per_leaf) == ["w"] and isinstance(per_leaf["w"], np.memmap)
    reference.assert_close(per_leaf["w"], reference.ntk(h, w, X1, None)[0])


def _kernel(path, **options):
    return ntk_core.ntk_fn(f, batch_size=8, out=str(path), progress=False, **options)


def test_an_existing_file_is_never_overwritten_silently(tmp_path):
    path = tmp_path / "k.npy"
    _kernel(path)(P, X1)
    with pytest.raises(ValueError, match=r"^ntk_fn: out=.*k\.npy' exists.*Fix: pass resume=True"):
        _kernel(path)(P, X1 * 2.0)
    assert np.array_equal(np.load(path), _kernel(tmp_path / "fresh.npy")(P, X1))  # intact
    replaced = _kernel(path, overwrite=True)(P, X1 * 2.0)
    assert np.array_equal(replaced, _kernel(tmp_path / "other.npy")(P, X1 * 2.0))


@pytest.mark.parametrize(
    "change, names",
    [
        ({"x1": X1 * 2.0}, r"x1 differ"),
        ({"x2": X2}, r"x2; shape \(\[37, 37\] -> \[37, 23\]\) differ"),
        ({"params": jax.tree.map(lambda v: v + 1.0, P)}, r"params differ"),
        ({"trace_axes": ()}, r"options \(.*trace_axes: \(-1,\) -> \(\)\); shape"),
        ({"batch_size": 6}, r"tile grid \(\[8, 8\] -> \[6, 6\]\) differ"),
        ({"model": lambda p, x: jnp.sin(x @ p["w"] + p["b"]) @ p["v"]}, r"options \(model"),
    ],
    ids=["x1", "x2", "params", "trace_axes", "batch_size", "model"],
)
def test_resuming_another_computation_is_refused_naming_what_differs(tmp_path, change, names):
    path = str(tmp_path / "k.npy")
    ntk_core.ntk_fn(f, batch_size=8, out=path, progress=False)(P, X1)
    manifest = json.loads(open(_store.manifest_path(path)).read())
    manifest["complete"] = False  # as if interrupted
    open(_store.manifest_path(path), "w").write(json.dumps(manifest))
    options = dict(batch_size=change.get("batch_size", 8), progress=False, resume=True)
    if "trace_axes" in change:
        options["trace_axes"] = change["trace_axes"]
    kernel = ntk_core.ntk_fn(change.get("model", f), out=path, **options)
    with pytest.raises(
        ValueError,
        match=r"^ntk_fn: resume=True, but .* was started by a "
        r"different call: .*" + names + r".*Fix: resume the same",
    ):
        kernel(change.get("params", P), change.get("x1", X1), change.get("x2"))


def test_a_model_whose_captured_array_changed_is_not_the_finished_file(tmp_path):
    """A model closing over an array (a scale, a fixed embedding) is the same jaxpr with
    another constant: the finished file of the old value is not returned for the new
    one (a new-user trial found it returned silently), and a resume names the model."""
    path = str(tmp_path / "k.npy")

    def scaled(c):
        scale = jnp.full(3, c)
        return lambda p, x: f(p, x) * scale

    old = np.array(ntk_core.ntk_fn(scaled(1.0), batch_size=8, out=path, progress=False)(P, X1))
    with pytest.raises(ValueError, match=r"^ntk_fn: out=.*k\.npy' exists, and is not"):
        ntk_core.ntk_fn(scaled(2.0), batch_size=8, out=path, progress=False)(P, X1)
    with pytest.raises(ValueError, match=r"different call: options \(model \(its jaxpr\)"):
        ntk_core.ntk_fn(scaled(2.0), batch_size=8, out=path, progress=False, resume=True)(P, X1)
    new = ntk_core.ntk_fn(scaled(2.0), batch_size=8, out=path, progress=False, overwrite=True)
    np.testing.assert_allclose(new(P, X1), 4.0 * np.asarray(old), rtol=1e-6)


def test_refusals_before_anything_is_computed(tmp_path, monkeypatch):
    with pytest.raises(
        ValueError,
        match=r"^ntk_fn: out='k.npy' writes tiles to a file, but batch_size is None.*Fix: pass a",
    ):
        ntk_core.ntk_fn(f, out="k.npy")
    with pytest.raises(ValueError, match=r"^ntk_fn: out must be a path ending in '\.npy'"):
        ntk_core.ntk_fn(f, batch_size=8, out="k.bin")
    with pytest.raises(
        ValueError,
        match=r"^ntk_fn: out='k.npy' writes to the host, which store_on_device=True contradicts",
    ):
        ntk_core.ntk_fn(f, batch_size=8, out="k.npy", store_on_device=True)
    with pytest.raises(ValueError, match=r"^ntk_fn: resume=True applies to the file of out="):
        ntk_core.ntk_fn(f, resume=True)
    with pytest.raises(
        ValueError,
        match=r"^ntk_fn: resume=True, but .*manifest.json' is "
        r"missing.*Fix: .*overwrite=True",
    ):
        np.save(tmp_path / "orphan.npy", np.zeros((37, 37), np.float32))
        _kernel(tmp_path / "orphan.npy", resume=True)(P, X1)
    with pytest.raises(
        ValueError,
        match=r"^ntk_fn: out=.*: the folder .* does not exist.* Fix: create it",
    ):
        _kernel(tmp_path / "missing" / "k.npy")(P, X1)
    two = ntk_core.ntk_fn(
        lambda p, x: {"a": f(p, x), "b": f(p, x) ** 2}, batch_size=8, out=str(tmp_path / "t.npy")
    )
    with pytest.raises(
        ValueError,
        match=r"^ntk_fn: out=.* writes one kernel array, but this kernel is a pytree of 2",
    ):
        two(P, X1)
    usage = _store.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(_store.shutil, "disk_usage", lambda folder: usage._replace(free=1000))
    with pytest.raises(
        ValueError,
        match=r"^ntk_fn: out=.* needs 5476 bytes, the disk has 1000 bytes free",
    ):
        _kernel(tmp_path / "big.npy")(P, X1)
    assert not os.path.exists(tmp_path / "big.npy")  # refused before creating anything


_CHILD = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, ntk_core
    path, n, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ntk_core._blocked.store.COMMIT_SECONDS = float(sys.argv[4])  # how often tiles are listed
    x = jax.random.normal(jax.random.PRNGKey(2), (n, 5))
    p = {"w": jax.random.normal(jax.random.PRNGKey(0), (5, 64)),
         "v": jax.random.normal(jax.random.PRNGKey(1), (64, 3))}
    f = lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"]
    ntk_core.ntk_fn(f, trace_axes=(), batch_size=b, out=path, resume=True,
                    progress=False)(p, x)
    """
)


def _run_child(path, n, b, commit=0.0):
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), str(n), str(b), str(commit)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _done(path) -> tuple[int, bool]:
    try:
        manifest = json.loads(open(_store.manifest_path(str(path))).read())
    except (OSError, ValueError):
        return 0, False
    return len(manifest["done"]), manifest["complete"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The file of an uninterrupted run (the same call every kill case resumes): the
    children's program run in this process (the XLA_FLAGS they inherit are this
    process's; no interpreter start, no fresh compile)."""
    whole = tmp_path_factory.mktemp("whole") / "whole.npy"
    argv, commit = sys.argv, _store.COMMIT_SECONDS
    sys.argv = ["-c", str(whole), "120", "6", "0.0"]
    try:
        exec(_CHILD, {"__name__": "__uninterrupted__"})
    finally:
        sys.argv, _store.COMMIT_SECONDS = argv, commit
    assert _done(whole) == (210, True)
    return whole


@pytest.mark.parametrize("kill_after, commit", [(40, 0.0), (1, 0.05)])
def test_killed_at_any_tile_and_resumed_equals_an_uninterrupted_run(
    tmp_path, uninterrupted, kill_after, commit
):
    """SIGKILL (no cleanup runs) once the manifest lists ``kill_after`` of the 210
    tiles (120 samples in tiles of 6: 20 blocks, 20·21/2 tiles), then the same call
    with resume=True finishes it: the file equals an uninterrupted run's bit for bit.
    The manifest lists the tiles after every tile (``commit`` 0 s: kills between any
    two tiles) or every 0.05 s (tiles written but not yet listed are computed again)."""
    n, b = 120, 6
    whole = uninterrupted
    path = tmp_path / "killed.npy"
    child = _run_child(path, n, b, commit)
    start = time.monotonic()
    while _done(path)[0] < kill_after and child.poll() is None:
        assert time.monotonic() - start < 300
        time.sleep(0.002)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    done, complete = _done(path)
    if complete:
        pytest.skip("the run finished before it could be killed")  # not seen in practice
    assert child.returncode == -signal.SIGKILL and done >= kill_after
    resumed = _run_child(path, n, b)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert _done(path) == (210, True)
    assert np.array_equal(np.load(path), np.load(whole))
    assert np.load(path).tobytes() == np.load(whole).tobytes()
    assert [name for name in os.listdir(tmp_path) if ".tmp-" in name] == []  # no leftovers


def test_an_unwritable_folder_is_refused(tmp_path, monkeypatch):
    # Tests run as root here, for whom every folder is writable: ask os.access instead.
    monkeypatch.setattr(_store.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=r"^ntk_fn: out=.*: the folder .* cannot be written"):
        _kernel(tmp_path / "k.npy")(P, X1)


def test_progress_counts_the_tiles_of_earlier_runs(tmp_path, monkeypatch):
    """The tile bar of a resumed run starts at the tiles already in the file."""
    from ntk_core._blocked import tiles as _blocked

    class Bar:
        def __init__(self):
            self.steps = []

        def update(self, k=1):
            self.steps.append(k)

        def close(self):
            pass

    bars = []
    monkeypatch.setattr(_blocked, "progress_bar", lambda *a, **kw: bars.append(Bar()) or bars[-1])
    path = str(tmp_path / "k.npy")
    ntk_core.ntk_fn(f, batch_size=8, out=path, progress=True)(P, X1)  # 5 blocks: 15 tiles
    manifest = json.loads(open(_store.manifest_path(path)).read())
    manifest["done"], manifest["complete"] = manifest["done"][:6], False
    open(_store.manifest_path(path), "w").write(json.dumps(manifest))
    ntk_core.ntk_fn(f, batch_size=8, out=path, progress=True, resume=True)(P, X1)
    assert bars[0].steps == [1] * 15
    assert bars[1].steps == [6] + [1] * 9  # 6 done before, 9 computed now


def test_files_that_cannot_be_used_are_refused_with_the_fix(tmp_path, monkeypatch):
    """After a new-user trial (helper-19): a folder named like a .npy file, an existing
    file that cannot be replaced (its manifest is kept: the file stays known), and a
    finished file that was damaged each get a ValueError with the fix, not a bare
    OSError from numpy."""
    folder = tmp_path / "folder.npy"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"^ntk_fn: out=.*folder\.npy' is a folder, not a file"):
        _kernel(folder, overwrite=True)(P, X1)
    path = tmp_path / "k.npy"
    _kernel(path)(P, X1)
    manifest = open(_store.manifest_path(str(path))).read()

    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted", str(path))

    with monkeypatch.context() as m:
        m.setattr(_store, "open_memmap", refuse)
        with pytest.raises(
            ValueError,
            match=r"^ntk_fn: could not create out=.*Operation not "
            r"permitted.*Fix: make the file and its folder writable",
        ):
            _kernel(path, overwrite=True)(P, X1 * 2.0)
    assert open(_store.manifest_path(str(path))).read() == manifest  # still known
    with open(path, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(
        ValueError,
        match=r"^ntk_fn: .*k\.npy' cannot be read as the \.npy its "
        r"manifest describes .*Fix: pass overwrite=True",
    ):
        _kernel(path, resume=True)(P, X1)


def _unfinished(path, **changes):
    """The manifest of ``path`` marked as an interrupted run's, with ``changes``."""
    manifest = json.loads(open(_store.manifest_path(str(path))).read())
    manifest.update({"complete": False, **changes})
    open(_store.manifest_path(str(path)), "w").write(json.dumps(manifest))


def _computed(monkeypatch) -> list:
    """The tiles ``(r0, c0)`` written from now on."""
    written, put = [], _store.NpyStore.put

    def spy(self, tile, r0, r1, c0, c1, mirror):
        written.append((r0, c0))
        put(self, tile, r0, r1, c0, c1, mirror)

    monkeypatch.setattr(_store.NpyStore, "put", spy)
    return written


def test_tiles_changed_on_disk_are_named_and_computed_again(tmp_path, monkeypatch):
    """Issue 28: the manifest holds each tile's CRC-32; a resume checks every listed
    tile, names those whose bytes changed (here one entry of tile [8, 24], and one of
    the mirror of tile [0, 16]) and computes only them again; the result equals the
    float64 reference again."""
    path = tmp_path / "k.npy"
    first = np.array(_kernel(path, trace_axes=())(P, X1))
    reference.assert_close(first, reference.ntk(f, P, X1, None, trace_axes=())[0])
    k = np.load(path, mmap_mode="r+")
    k[9, 30, 1, 2] += 1.0  # tile [8, 24] (rows 8..15, columns 24..31)
    k[20, 3, 0, 0] = 7.0  # the mirror of tile [0, 16], written with it
    k.flush()
    del k
    _unfinished(path)
    written = _computed(monkeypatch)
    with pytest.warns(
        UserWarning,
        match=r"k\.npy': 2 tiles changed since written \(CRC-32\): \[0, 16\], \[8, 24\]; 0 ",
    ):
        resumed = _kernel(path, trace_axes=(), resume=True)(P, X1)
    assert sorted(written) == [(0, 16), (8, 24)]
    assert np.load(path).tobytes() == first.tobytes() and np.array_equal(resumed, first)
    assert _done(path) == (15, True)


def test_a_manifest_edited_into_nonsense_is_refused_or_computed_again(tmp_path, monkeypatch):
    """Entries that are not ``[r0, c0, crc32]`` of a tile of this file are computed
    again (and counted in a warning); a complete manifest that does not list every tile
    is not a finished file; a fingerprint that is not one is refused by name."""
    path = tmp_path / "k.npy"
    first = np.array(_kernel(path)(P, X1))
    manifest = json.loads(open(_store.manifest_path(str(path))).read())
    kept = manifest["done"][:3]
    _unfinished(path, done=kept + [[0, 8], ["a", 0, 1], [3, 5, 0], 7, [0, 0, 1, 2]])
    written = _computed(monkeypatch)
    with pytest.warns(
        UserWarning,
        match=r"k\.npy': 0 tiles changed .*; 5 entries of 'done' are no tile \[r0, c0, crc32\]",
    ):
        assert np.array_equal(_kernel(path, resume=True)(P, X1), first)
    assert len(written) == 12 and not {tuple(t[:2]) for t in kept} & set(written)
    with open(path, "r+b") as file:  # the data zeroed, the manifest complete but empty
        file.seek(128)
        file.write(bytes(os.path.getsize(path) - 128))
    _unfinished(path, complete=True, done=[])
    with pytest.raises(ValueError, match=r"k\.npy' exists, and is not the finished result"):
        _kernel(path)(P, X1)
    assert np.array_equal(_kernel(path, resume=True)(P, X1), first)
    _unfinished(path, fingerprint="nonsense")
    with pytest.raises(ValueError, match=r"different call: x1; x2; params; .*; shape "):
        _kernel(path, resume=True)(P, X1)


def test_overwrite_leaves_a_memory_map_of_the_old_result_unchanged(tmp_path):
    """Issue 28: overwrite=True creates a new file and renames it into place, so a
    memory map of the old result (another reader) keeps the old values."""
    path = tmp_path / "k.npy"
    old = np.array(_kernel(path)(P, X1))
    mapped = np.load(path, mmap_mode="r")
    new = _kernel(path, overwrite=True)(P, X1 * 2.0)
    assert np.array_equal(mapped, old) and not np.array_equal(new, old)
    assert np.array_equal(np.load(path), _kernel(tmp_path / "fresh.npy")(P, X1 * 2.0))
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["k.npy", "k.npy.manifest.json", "fresh.npy", "fresh.npy.manifest.json"]
    )


def test_a_file_where_a_folder_is_expected_and_a_read_only_file_system_are_named(tmp_path):
    """Issue 28: a path through a file was called a missing folder, and /proc (where
    os.access lets root write) 'a disk with 0 bytes free'; each now names its cause."""
    (tmp_path / "some_file.txt").write_text("not a folder")
    for out in ("some_file.txt/k.npy", "some_file.txt/sub/k.npy"):
        with pytest.raises(
            ValueError,
            match=r"^ntk_fn: out=.*: '.*some_file\.txt' is a file, where a folder is "
            r"expected\. Fix: give a path whose parents are all folders\.$",
        ):
            _kernel(tmp_path / out)(P, X1)
    if not (sys.platform == "linux" and os.path.isdir("/proc")):
        return
    with pytest.raises(ValueError) as info:
        _kernel("/proc/k.npy")(P, X1)
    assert "bytes free" not in str(info.value)
    if os.geteuid() == 0:  # root: os.access says the folder is writable
        assert re.match(
            r"ntk_fn: out='/proc/k\.npy': the file cannot be created, '/proc' is not "
            r"writable \(No such file or directory\)\. Fix: give a path on a writable",
            str(info.value),
        ), info.value
