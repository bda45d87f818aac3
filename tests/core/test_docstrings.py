"""The Examples in public docstrings run (doctest)."""

from __future__ import annotations

import doctest
import importlib

import pytest

import frameworks

MODULES = [
    "ntk_core._api",
    "ntk_core._caches",
    "ntk_core._doctor",
    "ntk_core._environment",
    "ntk_core._linearize",
    "ntk_core._metrics",
    "ntk_core._monte_carlo",
    "ntk_core._ntk_vp",
    "ntk_core._predict",
    "ntk_core._spectrum",
    "ntk_core._tracking",
    pytest.param("ntk_flax._kernel", marks=frameworks.requires("flax")),
    pytest.param("ntk_flax._linearize", marks=frameworks.requires("flax")),
    pytest.param("ntk_flax._monte_carlo", marks=frameworks.requires("flax")),
    pytest.param("ntk_haiku._kernel", marks=frameworks.requires("haiku")),
    pytest.param("ntk_haiku._linearize", marks=frameworks.requires("haiku")),
    # ntk_haiku.params_from_flax's example builds a Flax model.
    pytest.param("ntk_haiku._models", marks=frameworks.requires("haiku", "flax")),
    pytest.param("ntk_haiku._monte_carlo", marks=frameworks.requires("haiku")),
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted > 0
