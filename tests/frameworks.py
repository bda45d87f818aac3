"""Which optional frameworks this environment has, for tests of ``tests/core`` that also
exercise Flax or Haiku, and for ``tests/equinox`` (Equinox): they run where the framework
is installed and are skipped, with the reason, where only the core is (CI's core-only
step installs ``.[test]`` alone)."""

from __future__ import annotations

import importlib.util

import pytest


def installed(name: str) -> bool:
    """Whether the package ``name`` is installed (checked without importing it).

    A bare directory of that name on ``sys.path`` does not count: pytest puts ``tests/``
    there, and ``tests/flax`` and ``tests/haiku`` would otherwise be found as namespace
    packages named ``flax`` and ``haiku`` (a spec without an origin) where neither is
    installed.
    """
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


def requires(*names: str):
    """A ``skipif`` mark for a test (or a ``pytest.param``) that needs ``names``."""
    missing = [name for name in names if not installed(name)]
    return pytest.mark.skipif(
        bool(missing), reason=f"needs {', '.join(missing)} (not installed: core-only run)"
    )


def skip_module_unless(*names: str) -> None:
    """Skips the calling test module, with the reason, where one of ``names`` is not
    installed. Call it before importing them: where a package is missing, ``import
    equinox`` would otherwise find ``tests/equinox`` as a namespace package."""
    missing = [name for name in names if not installed(name)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (not installed)", allow_module_level=True)
