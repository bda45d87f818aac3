"""The tracking examples (examples/track_digits_linen.py, examples/track_digits_nnx.py)
and ``ntk track`` at a tiny size: they run, and write a figure and a summary whose
metrics are finite, with kernel distance 0 at step 0. Full sizes:
docs/spectra-and-tracking.md."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from ntk_cli.cli import main as cli_main

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
TINY = ["--steps", "4", "--every", "2", "--probe", "8", "--batch", "8", "--top-k", "3"]
METRICS = ("kernel_distance", "alignment", "centered_alignment", "effective_rank", "trace")


def load_example(name: str):
    """An example script as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_outputs(out: pathlib.Path, steps=(0, 2, 4), probe=8, top_k=3) -> dict:
    assert (out / "ntk_track.png").stat().st_size > 10_000
    summary = json.loads((out / "summary.json").read_text())
    history = summary["history"]
    assert history["step"] == list(steps)
    assert history["kernel_distance"][0] == 0.0
    for name in METRICS:
        assert np.isfinite(history[name]).all(), name
    top = np.asarray(history["top_eigenvalues"])
    assert top.shape == (len(steps), top_k) and np.isfinite(top).all()
    assert np.all(np.diff(top, axis=1) <= 0)  # largest first
    assert summary["n_probe"] == probe and summary["kernel_shape"] == [probe, probe]
    assert 0.0 <= summary["test_accuracy"] <= 1.0
    return summary


@pytest.mark.parametrize("name", ["track_digits_linen", "track_digits_nnx"])
def test_example_runs_at_a_tiny_size(name, tmp_path, capsys):
    assert load_example(name).main([*TINY, "--no-progress", "--out", str(tmp_path)]) == 0
    summary = check_outputs(tmp_path)
    assert summary["framework"] == {"track_digits_linen": "flax.linen"}.get(name, "flax.nnx")
    assert "wrote" in capsys.readouterr().out


def test_ntk_track_command(tmp_path, capsys):
    out = tmp_path / "track"
    status = cli_main(["track", *TINY, "--save-kernels", "--no-progress", "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    summary = check_outputs(out)
    assert printed.startswith("ntk track: LeNet (flax.linen)")
    assert f"wrote {out / 'ntk_track.png'}" in printed
    kernel = np.load(out / "kernels" / "kernel_step_00000004.npy")
    assert kernel.shape == (8, 8)
    saved = json.loads((out / "kernels" / "metrics.json").read_text())
    assert saved["history"] == summary["history"]
    # a rerun without --save-kernels would leave these kernels beside its new summary
    assert cli_main(["track", *TINY, "--no-progress", "--out", str(out)]) == 2
    assert "holds an earlier run's kernels" in capsys.readouterr().err
    assert np.array_equal(np.load(out / "kernels" / "kernel_step_00000004.npy"), kernel)
    other = tmp_path / "other"
    (other / "kernels").parent.mkdir()
    (other / "kernels").write_text("a file")
    assert cli_main(["track", *TINY, "--save-kernels", "--out", str(other)]) == 2
    assert "ntk track: --save-kernels writes into" in capsys.readouterr().err


def test_ntk_track_rejects_bad_sizes(tmp_path, capsys):
    assert cli_main(["track", "--probe", "1", "--out", str(tmp_path)]) == 2
    assert "ntk track: --probe must be in [2, 1500], got 1" in capsys.readouterr().err
    assert cli_main(["track", "--every", "0", "--out", str(tmp_path)]) == 2
    assert "ntk track: --every must be >= 1, got 0" in capsys.readouterr().err
    assert cli_main(["track", "--probe", "4", "--out", str(tmp_path)]) == 2  # --top-k 5
    assert "ntk track: --top-k must be in [1, --probe 4], got 5" in capsys.readouterr().err


def test_ntk_track_help_from_the_installed_command(tmp_path):
    script = pathlib.Path(sys.executable).with_name("ntk")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "ntk_cli.cli"]
    result = subprocess.run(
        [*command, "track", "--help"], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    for option in ("--out", "--steps", "--every", "--probe", "--seed", "--no-progress"):
        assert option in result.stdout
