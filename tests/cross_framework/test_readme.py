"""The README's Python blocks run as written (quick start, pytest helpers)."""

from __future__ import annotations

import pathlib
import re

import numpy as np

import frameworks
import reference

frameworks.skip_module_unless("flax", "haiku", "equinox")

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    ns: dict = {}
    exec(compile("\n".join(blocks), str(README), "exec"), ns)  # noqa: S102 - our own README
    assert "implementation:" in capsys.readouterr().out  # the plan the quick start prints
    expected = reference.ntk(ns["apply_fn"], ns["params"], ns["x1"], ns["x2"])[0]
    assert np.abs(expected).max() > 0.1  # the example shows a kernel, not zeros
    reference.assert_close(ns["ntk"], expected)
