"""Issue 19: several processes under ``jax.distributed`` (two local CPU processes on
127.0.0.1) share one out= file: each computes a disjoint share of the tiles and lists
them in its own manifest; the file equals a single-process run's bit for bit; after
one process is killed (SIGKILL) any set of processes, here a single one, resumes it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from ntk_core._blocked import store as _store

_CHILD = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import ntk_core  # before initialize(): importing it starts no JAX backend
    index, count, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if count > 1:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                                   num_processes=count, process_id=index,
                                   initialization_timeout=120)
    ntk_core._blocked.store.COMMIT_SECONDS = 0.0  # tiles listed as they are written
    x = jax.random.normal(jax.random.PRNGKey(2), (120, 5))
    p = {"w": jax.random.normal(jax.random.PRNGKey(0), (5, 64)),
         "v": jax.random.normal(jax.random.PRNGKey(1), (64, 3))}
    f = lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"]
    if sys.argv[5] == "kernel":
        k = ntk_core.ntk_fn(f, trace_axes=(), batch_size=6, out=path, resume=True,
                            progress=False)(p, x)
        assert k.shape == (120, 120, 3, 3)
    elif sys.argv[5] == "sketch":  # sketch features Φ (120, 64) in row blocks of 6
        phi = ntk_core.ntk_sketch_fn(f, k=64, key=jax.random.PRNGKey(5), batch_size=6,
                                     out=path, resume=True)(p, x)
        assert phi.shape == (120, 64)
    else:  # Monte Carlo: 2 initialisations of the same network, 30 samples
        init = lambda k: {"w": jax.random.normal(k, (5, 64)), "v": p["v"]}
        k = ntk_core.monte_carlo_kernels(init, f, x[:30], key=jax.random.PRNGKey(4),
                                         n_samples=2, batch_size=6, out=path,
                                         resume=True, progress=False)
        assert k.ntk.shape == (30, 30)
    print("finished", index, flush=True)
    if count > 1:
        jax.distributed.shutdown()
    """
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(path, count, port, what="kernel"):
    env = dict(os.environ)
    return [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(i), str(count), str(port), str(path), what],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(count)
    ]


def _listed(path) -> int:
    found = json.loads(open(f"{path}.manifest.p1of2.json").read())
    return len(found["done"])


def _in_this_process(path, what="kernel") -> None:
    """A single-process run: the children's program with a count of 1 (no
    jax.distributed), run in this process, whose XLA_FLAGS the children inherit; no
    interpreter start and no fresh compile."""
    argv, commit = sys.argv, _store.COMMIT_SECONDS
    sys.argv = ["-c", "0", "1", "0", str(path), what]
    try:
        exec(_CHILD, {"__name__": "__single__"})
    finally:
        sys.argv, _store.COMMIT_SECONDS = argv, commit


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The kernel file of a single-process run (what the process groups must equal)."""
    single = tmp_path_factory.mktemp("single") / "single.npy"
    _in_this_process(single)
    return single


def test_two_processes_share_the_tiles_and_equal_one_process(tmp_path, single):
    shared = tmp_path / "shared.npy"
    both = _start(shared, 2, _port())
    for process in both:
        assert process.wait(timeout=300) == 0, process.stderr.read()[-3000:]
    assert np.load(shared).tobytes() == np.load(single).tobytes()
    manifest = json.loads(open(f"{shared}.manifest.json").read())
    assert manifest["complete"] and len(manifest["done"]) == 210  # 20 blocks: 20·21/2
    assert not [n for n in os.listdir(tmp_path) if ".manifest.p" in n]  # merged


def test_a_killed_process_group_is_resumed_by_one_process(tmp_path, single):
    shared = tmp_path / "shared.npy"
    both = _start(shared, 2, _port())
    start = time.monotonic()
    while True:  # until process 1 has listed a few tiles of its share
        assert time.monotonic() - start < 300 and all(p.poll() is None for p in both)
        try:
            if _listed(shared) >= 5:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    for process in both:  # SIGKILL: no cleanup runs (process 0 would wait for 1)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    listed = _listed(shared)
    assert 5 <= listed < 105  # its share of 210 tiles was not finished
    (resumed,) = _start(shared, 1, 0)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()[-2000:]
    assert np.load(shared).tobytes() == np.load(single).tobytes()


def _one_then_two(tmp_path, name: str, what: str) -> None:
    """Runs ``what`` to ``tmp_path/one/name`` in this process, then to ``tmp_path/two/name``
    in two under jax.distributed; each run must succeed."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    _in_this_process(tmp_path / "one" / name, what)
    for process in _start(tmp_path / "two" / name, 2, _port(), what):
        assert process.wait(timeout=300) == 0, process.stderr.read()[-3000:]


def test_two_processes_share_the_monte_carlo_sums_and_equal_one_process(tmp_path):
    """Monte Carlo kernels to files under jax.distributed: each sample's tiles are
    shared between the processes, which wait for each other between samples (the next
    sample reads the sum the previous one finished); the means equal one process's."""
    _one_then_two(tmp_path, "mc.npy", "mc")
    for kind in ("nngp", "ntk"):
        a, b = (np.load(tmp_path / run / f"mc.{kind}.npy") for run in ("one", "two"))
        assert a.tobytes() == b.tobytes(), kind
    assert sorted(os.listdir(tmp_path / "two")) == sorted(os.listdir(tmp_path / "one"))


def test_two_processes_share_the_sketch_rows_and_equal_one_process(tmp_path):
    """Sketch features to a file under jax.distributed: the row blocks are shared, the file
    equals one process's bit for bit."""
    _one_then_two(tmp_path, "phi.npy", "sketch")
    a, b = (np.load(tmp_path / run / "phi.npy") for run in ("one", "two"))
    assert a.tobytes() == b.tobytes() and np.abs(a).max() > 0
    manifest = json.loads(open(tmp_path / "two" / "phi.npy.manifest.json").read())
    assert manifest["complete"] and len(manifest["done"]) == 20  # 120 rows in blocks of 6
    assert not [n for n in os.listdir(tmp_path / "two") if ".manifest.p" in n]  # merged


_DIES = textwrap.dedent(
    """
    import os, sys
    import jax, jax.numpy as jnp
    index, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=index, initialization_timeout=60)
    import ntk_core
    jax.devices()  # every process joins the backend (it waits for all)
    if index == 1:
        os._exit(0)  # the peer stops (no cleanup, as after a crash)
    ntk_core._blocked.store.PEER_SECONDS = 2.0  # 30 s by default; beats come each 1 s
    x = jax.random.normal(jax.random.PRNGKey(2), (24, 5))
    p = jax.random.normal(jax.random.PRNGKey(0), (5, 3))
    try:
        ntk_core.ntk_fn(lambda p, x: jnp.tanh(x @ p), batch_size=6, out=path)(p, x)
    except ValueError as e:
        print(e, flush=True)
        os._exit(1)  # jax.distributed.shutdown() would wait for the dead peer
    """
)


def test_a_run_whose_peer_died_ends_with_an_error_naming_it(tmp_path):
    """Issue 28: process 1 of 2 stops; process 0 ends with a ValueError naming it within
    PEER_SECONDS (2 s here) of reaching a barrier, where a collective barrier waited for
    JAX's heartbeat timeout (100 s) and then aborted the process."""
    env = dict(os.environ)
    port, path, start = str(_port()), str(tmp_path / "k.npy"), time.monotonic()
    survivor, peer = (
        subprocess.Popen(
            [sys.executable, "-c", _DIES, str(i), port, path],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    )
    try:
        out, err = survivor.communicate(timeout=28)
    finally:
        for process in (survivor, peer):
            if process.poll() is None:
                process.kill()
    assert peer.wait() == 0 and survivor.returncode == 1, err[-2000:]
    assert re.match(
        r"ntk_fn: a process of this run stopped at '.*' \(RuntimeError: process 1 of 2 sent "
        r"no heartbeat for 2 s: it stopped\)\. Fix: start every process with resume=True",
        out,
    ), out + err[-2000:]
    assert time.monotonic() - start < 30
