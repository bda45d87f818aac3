"""The worked example a user copies (examples/test_same_ntk.py) passes under pytest with
the plugin's fixtures, and fails, naming the layer, when one transplanted weight is wrong."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import frameworks

frameworks.skip_module_unless("flax", "haiku")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "test_same_ntk.py"


def _pytest(path, *args):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_example_passes_with_the_plugin_fixtures():
    result = _pytest(EXAMPLE, "--ntk-implementation", "structured")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 passed" in result.stdout


def test_example_with_a_wrong_weight_names_the_layer(tmp_path):
    broken = EXAMPLE.read_text().replace(
        'params = ntk_haiku.params_from_flax(variables["params"], template)',
        'params = ntk_haiku.params_from_flax(variables["params"], template)\n'
        "    params['mlp/~/linear_1']['w'] = params['mlp/~/linear_1']['w'][::-1]",
    )
    assert broken != EXAMPLE.read_text()
    (tmp_path / "test_broken.py").write_text(broken)
    result = _pytest(
        tmp_path / "test_broken.py", "-k", "same_ntk", "--ntk-implementation", "jacobian"
    )
    assert result.returncode == 1, result.stdout[-3000:]
    assert "implementation='jacobian': kernels differ" in result.stdout
    assert "per-leaf NTKs" in result.stdout
