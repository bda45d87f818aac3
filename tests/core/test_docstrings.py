"""The Examples in public docstrings run (doctest) and every public function documents
its shapes, errors and cost."""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

import ntk_core

MODULES = [
    "ntk_core._api",
    "ntk_core._doctor",
    "ntk_core._environment",
    "ntk_flax._kernel",
    "ntk_haiku._kernel",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted > 0


@pytest.mark.parametrize("name", ntk_core.__all__)
def test_public_functions_document_shapes_errors_and_cost(name):
    obj = getattr(ntk_core, name)
    if not inspect.isfunction(obj):  # constants, and classes (warnings, errors, reports)
        return
    doc = obj.__doc__
    assert "N1" in doc and "Raises:" in doc and "Example" in doc
