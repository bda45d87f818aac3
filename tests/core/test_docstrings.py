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
    "ntk_core._monte_carlo",
    "ntk_core._predict",
    "ntk_flax._kernel",
    "ntk_flax._monte_carlo",
    "ntk_haiku._kernel",
    "ntk_haiku._models",
    "ntk_haiku._monte_carlo",
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


ADAPTER_FUNCTIONS = [
    f"{package}.{name}"
    for package in ("ntk_flax", "ntk_haiku")
    for name in (
        "kernel",
        "kernel_fn",
        "nngp",
        "nngp_fn",
        "kernel_per_leaf",
        "kernel_per_leaf_fn",
        "plan",
        "monte_carlo_kernels",
    )
]


@pytest.mark.parametrize("name", ADAPTER_FUNCTIONS)
def test_adapter_kernel_functions_document_shapes_errors_cost_and_example(name):
    package, function = name.split(".")
    doc = getattr(importlib.import_module(package), function).__doc__
    for part in ("N1", "Raises:", "Cost", "Example:"):
        assert part in doc, part


@pytest.mark.parametrize("name", ["gp_inference", "gradient_descent_mse"])
def test_predict_functions_document_formula_shapes_errors_cost_and_references(name):
    doc = getattr(ntk_core.predict, name).__doc__
    for part in ("(N, N)", "(T, O...)", "Raises:", "Cost:", "Example:", "References:"):
        assert part in doc, part
    assert "λ = ``diag_reg`` · mean(diag K)" in doc and "λ = ``diag_reg`` when" in doc
