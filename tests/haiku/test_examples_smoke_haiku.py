"""examples/checkpoints_digits_haiku.py at a tiny size: trains, saves orbax checkpoints,
computes the NTK from each restored checkpoint, writes a figure and a summary."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
METRICS = ("kernel_distance", "alignment", "centered_alignment", "effective_rank", "trace")


def test_checkpoints_example_runs_at_a_tiny_size(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "checkpoints_digits_haiku", EXAMPLES / "checkpoints_digits_haiku.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    argv = ["--steps", "4", "--every", "2", "--probe", "8", "--batch", "8", "--top-k", "3"]
    assert example.main([*argv, "--no-progress", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000000",
        "step_00000002",
        "step_00000004",
    ]
    assert (tmp_path / "ntk_track.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "summary.json").read_text())
    history = summary["history"]
    assert history["step"] == [0, 2, 4]
    assert history["kernel_distance"][0] == 0.0
    assert history["kernel_distance"][-1] > 0.0  # the checkpoints differ
    for name in METRICS:
        assert np.isfinite(history[name]).all(), name
    assert np.asarray(history["top_eigenvalues"]).shape == (3, 3)
    assert summary["framework"] == "haiku"
    assert "wrote" in capsys.readouterr().out
