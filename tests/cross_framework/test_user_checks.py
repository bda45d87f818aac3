"""The worked example a user copies (examples/test_same_ntk.py) passes under pytest with
the plugin's fixtures, and fails, naming the layer, when one transplanted weight is wrong.
Each runs in a pytest session of its own inside this process (pytester: the frameworks
are imported once)."""

from __future__ import annotations

import pathlib

import frameworks

frameworks.skip_module_unless("flax", "haiku")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "test_same_ntk.py"


pytest_plugins = ["pytester"]


def _pytest(pytester, path, *args) -> tuple[int, str]:
    """The exit status and output of pytest on ``path``."""
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", str(path), *args)
    return result.ret, "\n".join(result.outlines)


def test_example_passes_with_the_plugin_fixtures(pytester):
    status, output = _pytest(pytester, EXAMPLE, "--ntk-implementation", "structured")
    assert status == 0, output[-3000:]
    assert "2 passed" in output


def test_example_with_a_wrong_weight_names_the_layer(pytester, tmp_path):
    broken = EXAMPLE.read_text().replace(
        'params = ntk_haiku.params_from_flax(variables["params"], template)',
        'params = ntk_haiku.params_from_flax(variables["params"], template)\n'
        "    params['mlp/~/linear_1']['w'] = params['mlp/~/linear_1']['w'][::-1]",
    )
    assert broken != EXAMPLE.read_text()
    (tmp_path / "test_broken.py").write_text(broken)
    status, output = _pytest(
        pytester, tmp_path / "test_broken.py", "-k", "same_ntk", "--ntk-implementation", "jacobian"
    )
    assert status == 1, output[-3000:]
    assert "implementation='jacobian': kernels differ" in output
    assert "per-leaf NTKs" in output
