"""``ntk doctor`` and ``ntk_core.doctor()``: the report, the self-test, the exit status."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import frameworks
import ntk_core
from ntk_cli import cli as _cli
from ntk_cli import doctor as _cli_doctor
from ntk_core import _doctor
from ntk_core._doctor import Check, CheckResult


def passing():
    return CheckResult("", "pass", "measured 0")


def failing():
    return CheckResult("", "fail", "max |ΔK|/max|K| = 1.2e-01", "install CUDA >= 11")


def crashing():
    raise RuntimeError("the device vanished")


def test_report_fields(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    report = ntk_core.doctor(self_test=False)
    assert report.python == platform.python_version()
    assert report.packages["jax"] == jax.__version__
    assert report.packages["jaxlib"] == importlib.metadata.version("jaxlib")
    for name in ("flax", "dm-haiku", "equinox", "optax"):
        try:
            expected = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            expected = None
        assert report.packages[name] == expected
    assert report.ntk_jax == ntk_core.__version__
    assert report.backend == jax.default_backend()
    assert report.platform_version == jax.devices()[0].client.platform_version
    assert [d["id"] for d in report.devices] == [d.id for d in jax.devices()]
    assert report.x64 is bool(jax.config.jax_enable_x64)
    assert report.default_matmul_precision == jax.config.jax_default_matmul_precision
    assert report.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert report.checks == [] and report.ok
    if report.backend == "cpu":
        assert (report.accelerator, report.cuda, report.devices[0]["memory"]) == ("CPU", None, None)
    parsed = json.loads(report.to_json())
    assert parsed["packages"] == report.packages and parsed["ok"] is True


def test_absent_package_is_reported_not_raised():
    assert _doctor._version("surely-not-an-installed-distribution") is None


def test_comparison_fails_beyond_round_off():
    k = np.random.default_rng(0).normal(size=(4, 3, 2, 2))
    assert _doctor._compare({"same": (k + 1e-7 * np.abs(k).max(), k)}, "float32").status == "pass"
    bad = _doctor._compare({"drift": (k * 1.1, k)}, "float32")  # C1: 1e-1 off
    assert bad.status == "fail" and "drift" in bad.detail and bad.fix


def test_cli_json_and_exit_status_zero(capsys):
    assert _cli.main(["doctor", "--json"], checks=[Check("fine", passing)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True
    assert [(c["name"], c["status"]) for c in out["checks"]] == [("fine", "pass")]


def test_cli_failing_check_gives_exit_1_with_reason_and_fix(capsys):
    checks = [Check("fine", passing), Check("blocked equals one block", failing)]
    assert _cli.main(["doctor"], checks=checks) == 1
    out = capsys.readouterr().out
    assert "[FAIL ] blocked equals one block: max |ΔK|/max|K| = 1.2e-01" in out
    assert "Fix: install CUDA >= 11" in out
    assert out.rstrip().endswith("FAILED: see the checks above")


def test_cli_crashing_check_is_an_error(capsys):
    assert _cli.main(["doctor", "--json"], checks=[Check("crash", crashing)]) == 1
    (check,) = json.loads(capsys.readouterr().out)["checks"]
    assert check["status"] == "error"
    assert check["detail"] == "RuntimeError: the device vanished"


def test_default_self_test_passes_on_this_device(capsys):
    """The real self-test on a small CNN (``ntk doctor`` runs it on a LeNet)."""
    checks = _cli_doctor.all_checks(samples=3, image_size=8, model="small")
    assert _cli.main(["doctor", "--json"], checks=checks) == 0
    out = json.loads(capsys.readouterr().out)
    statuses = {c["name"]: c["status"] for c in out["checks"]}
    assert statuses["backend supported"] == "pass"
    assert statuses["implementations agree (jacobian, ntvp, structured)"] == "pass"
    assert "ntvp vs jacobian" in out["checks"][1]["detail"]
    both = all(frameworks.installed(m) for m in ("flax", "haiku"))
    assert statuses["Flax equals Haiku (same weights)"] == ("pass" if both else "skip")
    assert statuses["batched equals unbatched"] == "pass"
    assert "batch_size=2 vs one call, x2=None" in out["checks"][3]["detail"]


def test_console_entry():
    exe = shutil.which("ntk", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("the ntk console script is not installed next to this Python")
    result = subprocess.run(
        [exe, "doctor", "--json", "--no-self-test"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["packages"]["jax"] == jax.__version__


def test_plain_jax_lenet_matches_the_flax_lenet_shapes():
    """Without Flax the self-test uses a plain-JAX LeNet of the same architecture."""
    x = jax.numpy.ones((2, 16, 16, 3))
    apply, params, _ = _doctor._plain_cnn(x, 2, "lenet")
    assert jax.eval_shape(apply, params, x).shape == (2, 2)
    sizes = sorted(np.size(p) for p in jax.tree.leaves(params))
    nn = pytest.importorskip("flax.linen")
    del nn
    import ntk_flax

    variables = jax.eval_shape(ntk_flax.LeNet(2).init, jax.random.PRNGKey(0), x)
    assert sorted(np.prod(p.shape) for p in jax.tree.leaves(variables)) == sizes


def test_help_imports_no_framework():
    """`ntk --help` defines no subcommand's options, so it imports neither jax nor flax
    (it took 1.8 s with them, 0.08 s without)."""
    code = (
        "import sys\n"
        "from ntk_cli.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in ('jax', 'flax', 'haiku') if m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"
    assert "doctor" in run.stdout
