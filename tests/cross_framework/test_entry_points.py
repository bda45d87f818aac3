"""The adapters' entry points are plain functions on ``ntk_core.adapters``: the Flax
and Haiku versions of each take the same arguments apart from the model's own, document
the same sections, and point to the core's docstring for the options."""

from __future__ import annotations

import inspect
import re

import pytest

import ntk_flax
import ntk_haiku

#: Each framework's own arguments: the model, its parameters, its keywords.
OWN = {
    "ntk_flax": {"model", "variables", "method", "rngs"},
    "ntk_haiku": {"transformed", "params", "state", "rng"},
}
BUILD = ("kernel_fn", "nngp_fn", "kernel_per_leaf_fn")
NAMES = [*BUILD, "kernel", "nngp", "kernel_per_leaf", "plan"]


def _shared(package, name):
    """(name, kind, default) of the parameters that are not the framework's own."""
    parameters = inspect.signature(getattr(package, name)).parameters.values()
    return [(p.name, p.kind, p.default) for p in parameters if p.name not in OWN[package.__name__]]


@pytest.mark.parametrize("name", NAMES)
def test_flax_and_haiku_entry_points_take_the_same_arguments_apart_from_the_model(name):
    assert _shared(ntk_flax, name) == _shared(ntk_haiku, name)
    flax, haiku = (inspect.signature(getattr(p, name)) for p in (ntk_flax, ntk_haiku))
    assert list(flax.parameters)[0] == "model" and list(haiku.parameters)[0] == "transformed"
    assert flax.return_annotation == haiku.return_annotation


@pytest.mark.parametrize("name", NAMES)
def test_flax_and_haiku_docstrings_have_the_same_sections_in_the_same_order(name):
    def sections(doc):
        return re.findall(r"^ *(Args:|Returns:|Raises:|Example:)", doc, re.M)

    flax, haiku = (getattr(p, name).__doc__ for p in (ntk_flax, ntk_haiku))
    assert sections(flax) == sections(haiku) == ["Args:", "Returns:", "Raises:", "Example:"]
    assert "ntk_haiku" not in flax and "ntk_flax" not in haiku
    for doc in (flax, haiku):  # the options, cost and references are written once
        assert "Options, Cost and References: see :func:`ntk_core.ntk_fn`." in doc


def test_every_entry_point_is_exported_with_its_signature():
    for package in (ntk_flax, ntk_haiku):
        for name in NAMES:
            fn = getattr(package, name)
            assert name in package.__all__
            assert fn.__module__ == f"{package.__name__}._kernel"
            assert fn.__name__ == name
            assert (inspect.signature(fn).return_annotation == "Callable") == (name in BUILD)
            options = list(inspect.signature(fn).parameters.values())[-1]
            assert options.kind is options.VAR_KEYWORD


STATISTICS = ["ntk_trace", "ntk_frobenius_sq", "ntk_effective_rank", "ntk_kernel_alignment"]


@pytest.mark.parametrize("name", STATISTICS)
def test_matrix_free_statistics_take_the_same_arguments_apart_from_the_model(name):
    """The statistics (``_statistics``): the core's own arguments, the frameworks' model ones."""
    assert _shared(ntk_flax, name) == _shared(ntk_haiku, name)
    for package in (ntk_flax, ntk_haiku):
        fn = getattr(package, name)
        assert name in package.__all__ and fn.__module__ == f"{package.__name__}._statistics"
        assert inspect.signature(fn).parameters["x"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert f":func:`ntk_core.spectrum.{name}`" in fn.__doc__


@pytest.mark.parametrize("name", ["ntk_sketch", "ntk_sketch_fn"])
def test_sketch_entry_points_take_the_same_arguments_apart_from_the_model(name):
    """The sketch (``_sketch``): ``k``, ``key`` and the frameworks' model arguments, the
    same sections, the definition written once in the core's docstring."""
    assert _shared(ntk_flax, name) == _shared(ntk_haiku, name)
    for package in (ntk_flax, ntk_haiku):
        fn = getattr(package, name)
        assert name in package.__all__ and fn.__module__ == f"{package.__name__}._sketch"
        sections = re.findall(r"^ *(Args:|Returns:|Raises:|Example:)", fn.__doc__, re.M)
        assert sections == ["Args:", "Returns:", "Raises:", "Example:"]
        assert ":func:`ntk_core.ntk_sketch_fn`" in fn.__doc__


def test_binding_errors_name_the_adapters_function():
    with pytest.raises(TypeError, match=r"^ntk_flax\.kernel: .*missing"):
        ntk_flax.kernel(None)
    with pytest.raises(TypeError, match=r"^ntk_haiku\.plan: .*missing"):
        ntk_haiku.plan(None)
