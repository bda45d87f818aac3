"""The Examples in public docstrings run (doctest)."""

from __future__ import annotations

import doctest
import importlib

import pytest

import frameworks

MODULES = [
    "ntk_core._api",
    "ntk_core._jax.caches",
    "ntk_core._doctor",
    "ntk_core._jax.environment",
    "ntk_core._functional.linearize",
    "ntk_core._analysis.metrics",
    "ntk_core._analysis.matrix_free",
    "ntk_core._monte_carlo.kernels",
    "ntk_core._functional.ntk_vp",
    "ntk_core._functional.pntk",
    "ntk_core._functional.sketch",
    "ntk_core._predict.inference",
    "ntk_core._predict.ensemble",
    "ntk_core._infinite.kernel_fn",
    "ntk_core._infinite.layers",
    "ntk_core._derived.api",
    "ntk_core._analysis.spectrum",
    "ntk_core._analysis.tracking",
    "ntk_core.testing",
    "ntk_core._transplant",
    pytest.param("ntk_flax._kernel", marks=frameworks.requires("flax")),
    pytest.param("ntk_flax._linearize", marks=frameworks.requires("flax")),
    pytest.param("ntk_flax._monte_carlo", marks=frameworks.requires("flax")),
    pytest.param("ntk_flax._statistics", marks=frameworks.requires("flax")),
    pytest.param("ntk_flax._sketch", marks=frameworks.requires("flax")),
    pytest.param("ntk_haiku._kernel", marks=frameworks.requires("haiku")),
    pytest.param("ntk_haiku._linearize", marks=frameworks.requires("haiku")),
    pytest.param("ntk_haiku._models", marks=frameworks.requires("haiku")),
    pytest.param("ntk_haiku._monte_carlo", marks=frameworks.requires("haiku")),
    pytest.param("ntk_haiku._statistics", marks=frameworks.requires("haiku")),
    pytest.param("ntk_haiku._sketch", marks=frameworks.requires("haiku")),
    pytest.param("ntk_equinox._statistics", marks=frameworks.requires("equinox")),
    pytest.param("ntk_equinox._sketch", marks=frameworks.requires("equinox")),
    pytest.param("ntk_equinox._more", marks=frameworks.requires("equinox")),
    pytest.param("ntk_equinox._linearize", marks=frameworks.requires("equinox")),
    pytest.param("ntk_equinox._monte_carlo", marks=frameworks.requires("equinox")),
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted > 0
