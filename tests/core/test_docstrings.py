"""The Examples in public docstrings run (doctest) and every public function documents
its shapes, errors and cost."""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

import frameworks
import ntk_core

MODULES = [
    "ntk_core._api",
    "ntk_core._jax.caches",
    "ntk_core._doctor",
    "ntk_core._jax.environment",
    "ntk_core._functional.linearize",
    "ntk_core._analysis.metrics",
    "ntk_core._monte_carlo.kernels",
    "ntk_core._functional.ntk_vp",
    "ntk_core._predict.inference",
    "ntk_core._analysis.spectrum",
    "ntk_core._analysis.tracking",
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


#: The adapters and the framework each needs.
ADAPTERS = {"ntk_flax": "flax", "ntk_haiku": "haiku"}


def _public(package: str):
    """(qualified name, object) of every public function and class of ``package`` and of
    its public submodules."""
    module = importlib.import_module(package)
    found = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.ismodule(obj):
            found += [(f"{package}.{name}.{n}", getattr(obj, n)) for n in obj.__all__]
        elif inspect.isfunction(obj) or inspect.isclass(obj):
            found.append((f"{package}.{name}", obj))
    return found


PUBLIC = [
    item
    for package in ("ntk_core", *ADAPTERS)
    if package == "ntk_core" or frameworks.installed(ADAPTERS[package])
    for item in _public(package)
]
FUNCTIONS = [(n, o) for n, o in PUBLIC if inspect.isfunction(o)]
CLASSES = [(n, o) for n, o in PUBLIC if inspect.isclass(o)]
#: An adapter whose framework is not installed (a core-only run) cannot be imported: one
#: skipped case stands for its public functions and classes, so the run reports them.
NOT_INSTALLED = [
    pytest.param(f"{package}.*", None, marks=frameworks.requires(framework), id=f"{package}.*")
    for package, framework in ADAPTERS.items()
    if not frameworks.installed(framework)
]
#: What every public function's docstring states (STYLE.md): shapes in named dimensions,
#: the arguments (or where they are described), what it returns, the errors, the cost,
#: an example and the source.
SECTIONS = ("Args", "Returns", "Raises:", "Cost", "Example", "Reference")


@pytest.mark.parametrize(
    "name, fn", [pytest.param(n, o, id=n) for n, o in FUNCTIONS] + NOT_INSTALLED
)
def test_public_functions_document_shapes_arguments_errors_cost_example_and_source(name, fn):
    doc = fn.__doc__ or ""
    missing = [part for part in SECTIONS if part not in doc]
    if not any(dim in doc for dim in ("N1", "(N", "N,", "(M", "(T")):
        missing.append("shapes in named dimensions (N1, N2, O)")
    assert not missing, f"{name} lacks {missing}"


@pytest.mark.parametrize(
    "name, cls", [pytest.param(n, o, id=n) for n, o in CLASSES] + NOT_INSTALLED
)
def test_public_classes_say_what_they_are(name, cls):
    doc = inspect.getdoc(cls) or ""
    assert len(doc.split()) >= 5, f"{name} has no docstring of its own"


def test_the_public_surface_is_found():
    names = {n for n, _ in FUNCTIONS}
    assert {"ntk_core.ntk_fn", "ntk_core.predict.gp_inference", "ntk_core.clear_caches"} <= names


ADAPTER_FUNCTIONS = [
    pytest.param(f"{package}.{name}", marks=frameworks.requires(framework))
    for package, framework in ADAPTERS.items()
    for name in (
        "kernel",
        "kernel_fn",
        "nngp",
        "nngp_fn",
        "kernel_per_leaf",
        "kernel_per_leaf_fn",
        "plan",
        "monte_carlo_kernels",
        "linearize",
        "taylor_expand",
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
