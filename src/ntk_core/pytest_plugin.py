"""ntk-jax's pytest plugin (``pytest11`` entry point; off with ``-p no:ntk_core``): fixtures
``assert_kernels_close`` and ``assert_same_ntk`` (:mod:`ntk_core.testing`), the repeatable
option ``--ntk-implementation NAME`` (what ``assert_same_ntk`` checks when a test names none)
and the report header's versions deciding round-off. Loading it imports the ``ntk_core``
package (jax: about 1.3 s; no framework, and no JAX backend is started)."""

from __future__ import annotations

import functools

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("ntk_core", "ntk-jax kernel checks")
    text = "implementation(s) that assert_same_ntk checks by default (default: all)"
    group.addoption("--ntk-implementation", action="append", metavar="NAME", help=text)


def pytest_report_header(config):
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return ", ".join(f"{name} {version(name)}" for name in ("ntk-jax", "jax", "jaxlib"))


@pytest.fixture
def assert_kernels_close():
    """:func:`ntk_core.testing.assert_kernels_close`."""
    from ntk_core.testing import assert_kernels_close

    return assert_kernels_close


@pytest.fixture
def assert_same_ntk(request):
    """:func:`ntk_core.testing.assert_same_ntk`, of ``--ntk-implementation`` by default."""
    from ntk_core.testing import assert_same_ntk

    chosen = request.config.getoption("--ntk-implementation")
    return functools.partial(assert_same_ntk, implementation=chosen) if chosen else assert_same_ntk
