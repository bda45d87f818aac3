"""The adapters' entry points are made once, from ``ntk_core._kernel.adapter``: the Flax and
Haiku versions of each take the same arguments apart from the model's own, document the
same sections, and differ only in the framework's words."""

from __future__ import annotations

import inspect
import re

import pytest

import ntk_flax
import ntk_haiku
from ntk_core._kernel import adapter as _adapter
from ntk_core._kernel.adapter import ENTRIES, Form, fill

#: Each framework's own arguments: the model, its parameters, its keywords.
OWN = {
    "ntk_flax": {"model", "variables", "method", "rngs"},
    "ntk_haiku": {"transformed", "params", "state", "rng"},
}
NAMES = [entry.name for entry in ENTRIES]


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
        return re.findall(r"^(Args:|Returns:|Raises:|Cost:|Example:|References:)", doc, re.M)

    flax, haiku = (getattr(p, name).__doc__ for p in (ntk_flax, ntk_haiku))
    assert sections(flax) == sections(haiku)
    assert sections(flax) == ["Args:", "Returns:", "Raises:", "Cost:", "Example:", "References:"]
    assert "ntk_haiku" not in flax and "ntk_flax" not in haiku
    assert "{" + "example_" not in flax + haiku  # every template field filled


def test_every_entry_point_is_exported_and_made_from_its_entry():
    for package in (ntk_flax, ntk_haiku):
        for entry in ENTRIES:
            fn = getattr(package, entry.name)
            assert entry.name in package.__all__
            assert fn.__module__ == f"{package.__name__}._kernel"
            assert fn.__name__ == entry.name
            built = entry.form is Form.BUILD
            assert (inspect.signature(fn).return_annotation == "Callable") == built


def test_the_monte_carlo_kernels_name_their_kernel_functions_by_form_not_by_name():
    assert _adapter.MONTE_CARLO_NTK.form is Form.MONTE_CARLO
    assert _adapter.MONTE_CARLO_NNGP.kind == "nngp"
    assert all(entry.form is not Form.MONTE_CARLO for entry in ENTRIES)


def test_fill_indents_multi_line_fields_and_drops_empty_lines():
    template = "Title {a}.\n\nArgs:\n  {items}\n  {empty}\n  last\n"
    filled = fill(template, {"a": "one", "items": "x: 1\ny: 2", "empty": ""})
    assert filled == "Title one.\n\nArgs:\n  x: 1\n  y: 2\n  last\n"
    with pytest.raises(KeyError):
        fill("{missing}", {})
    assert fill('{"train": False}', {}) == '{"train": False}\n'  # not a field
