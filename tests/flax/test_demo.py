"""``ntk demo`` end to end on a smaller split (the full run is in the README)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from ntk_cli.cli import main


def test_demo_small_split(tmp_path, capsys):
    status = main(["demo", "--n-train", "300", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert status == 0, out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["flax_vs_haiku_max_relative_difference"] <= 1e-4
    assert summary["test_accuracy"] > 0.85, summary
    assert f"test accuracy {summary['test_accuracy']:.4f}" in out
    assert f"implementation: 'auto' -> {summary['implementation']}" in out
    assert summary["implementation"] in ("jacobian", "ntvp", "structured")
    k = np.load(tmp_path / "ntk_train_train.npy")
    assert k.shape == (300, 300)
    np.testing.assert_array_equal(k, k.T)
    assert np.load(tmp_path / "ntk_test_train.npy").shape == (1497, 300)
    assert (tmp_path / "ntk_demo.png").stat().st_size > 10_000


def test_demo_rejects_bad_split(tmp_path, capsys):
    assert main(["demo", "--n-train", "0", "--out", str(tmp_path)]) == 2
    assert "--n-train must be in [1, 1796], got 0" in capsys.readouterr().err


def test_console_script_help():
    result = subprocess.run(
        [sys.executable, "-m", "ntk_cli.cli", "demo", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0
    assert "--n-train" in result.stdout
    assert "--compilation-cache" in result.stdout


def test_compilation_cache_option_fills_the_folder_and_is_reused(tmp_path):
    """--compilation-cache DIR: the first process writes the compiled kernel programs
    into DIR; a second process with the same DIR writes nothing new (it loads them)."""
    script = (
        "import sys, jax, jax.numpy as jnp, ntk_core\n"
        "from ntk_cli.demo import use_compilation_cache\n"
        "use_compilation_cache(sys.argv[1])\n"
        "f = lambda p, x: jnp.tanh(x @ p) @ p.T\n"
        "k = ntk_core.ntk_fn(f, trace_axes=())(jnp.ones((3, 3)) / 3, jnp.ones((5, 3)))\n"
        "print(float(k.sum()))\n"
    )
    folder = tmp_path / "cache"
    runs = []
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-c", script, str(folder)], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        runs.append((result.stdout, sorted(p.name for p in folder.iterdir())))
    assert len(runs[0][1]) >= 2  # the kernel's programs, each one entry
    assert runs[1] == runs[0]  # the same kernel, and no new entry


def test_folders_that_cannot_be_made_are_one_line(tmp_path, capsys):
    """Issue 28: --out naming an existing file (or a path through one) was a bare
    FileExistsError traceback; now one line on stderr, exit status 2, nothing computed;
    so are demo's --compilation-cache and track's --out (were tracebacks)."""
    (tmp_path / "taken").write_text("a file")
    for out, why in (("taken", "is a file, not a folder"), ("taken/sub", "cannot be made")):
        path = str(tmp_path / out)
        for argv, option in (
            (["demo", "--out", path], "--out"),
            (
                ["demo", "--out", str(tmp_path / "d"), "--compilation-cache", path],
                "--compilation-cache",
            ),
            (["track", "--out", path, "--steps", "1"], "--out"),
        ):
            assert main([*argv, "--no-progress"]) == 2
            captured = capsys.readouterr()
            assert len(captured.err.splitlines()) == 1
            assert captured.err.startswith(f"ntk {argv[0]}: {option} {path!r} {why} (")
            assert captured.err.endswith(". Fix: give a folder path.\n")
    assert sorted(p.name for p in tmp_path.iterdir()) in (["taken"], ["d", "taken"])


def test_track_refuses_a_learning_rate_that_is_not_positive(capsys):
    for lr in ("-1", "0", "nan"):
        assert main(["track", "--lr", lr, "--out", "/nonexistent/never-made", "--no-progress"]) == 2
        assert "ntk track: --lr must be > 0" in capsys.readouterr().err
