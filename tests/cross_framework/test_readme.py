"""The README's Python blocks run as written (quick start, pytest helpers)."""

from __future__ import annotations

import pathlib
import re

import frameworks

frameworks.skip_module_unless("flax", "haiku", "equinox")

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    exec(compile("\n".join(blocks), str(README), "exec"), {})  # noqa: S102 - our own README
    assert "implementation:" in capsys.readouterr().out  # the plan the quick start prints
