"""The pytest plugin of ntk-jax (registered through the ``pytest11`` entry point).

Fixtures ``assert_kernels_close`` and ``assert_same_ntk`` (the functions of
:mod:`ntk_core.testing`), the option ``--ntk-implementation NAME`` (repeatable) that
restricts which implementations ``assert_same_ntk`` checks when the test names none, and
a report-header line with the versions that decide a kernel's round-off. Importing this
module imports neither jax nor a framework; disable it with ``-p no:ntk_core``.
"""

from __future__ import annotations

import functools

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("ntk_core", "ntk-jax kernel checks")
    group.addoption(
        "--ntk-implementation",
        action="append",
        default=None,
        metavar="NAME",
        help="implementation(s) that assert_same_ntk checks by default (default: all)",
    )


def pytest_report_header(config):
    from importlib import metadata

    versions = []
    for name in ("ntk-jax", "jax", "jaxlib"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} not installed")
    return ", ".join(versions)


@pytest.fixture
def assert_kernels_close():
    """:func:`ntk_core.testing.assert_kernels_close`."""
    from ntk_core.testing import assert_kernels_close

    return assert_kernels_close


@pytest.fixture
def assert_same_ntk(request):
    """:func:`ntk_core.testing.assert_same_ntk`, checking the implementations given with
    ``--ntk-implementation`` unless the call names its own."""
    from ntk_core.testing import assert_same_ntk

    chosen = request.config.getoption("--ntk-implementation")
    return functools.partial(assert_same_ntk, implementation=chosen) if chosen else assert_same_ntk
