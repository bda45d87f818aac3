"""The plain-JAX zoo of the core tests (``tests/core_zoo.py``) is the Flax zoo
(``tests/zoo.py``) written out by hand: with the Flax models' own weights, each plain-JAX
network has the same parameter tree and inputs, gives the Flax model's outputs, gets the
same plan (the method of every parameter leaf: the core tests exercise the same
structured-derivative rules on the same uses of every weight) and the same kernel from
every implementation, each against the float64 reference of the Flax model."""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest

import core_zoo
import ntk_core
import reference
import zoo

NAMES = list(zoo.ZOO)


def _shapes(tree):
    return jax.tree.map(lambda a: (a.shape, str(a.dtype)), tree)


@functools.cache
def _pair(name):
    """``(flax apply_fn, plain-JAX apply_fn, the Flax params, x1, x2)``: both functions of
    the Flax weights, the plain-JAX one reading the Flax model's batch statistics."""
    entry = zoo.ZOO[name]
    stats = entry.variables.get("batch_stats", {})

    def plain(params, x):
        return core_zoo.ZOO[name].forward(params, stats, x)

    return (zoo.apply_fn(entry), plain, entry.variables["params"], *zoo.inputs(entry))


def _methods(f, params, x1, x2):
    """Each leaf's path and method, the code location of a fallback's reason left out."""
    plan = ntk_core.plan(f, params, x1, x2, trace_axes=(), implementation="structured")
    return [
        (leaf.path, re.sub(r"at \S+:\d+, in [^);]+", "at <location>", leaf.method))
        for leaf in plan.leaves
    ]


def test_both_zoos_hold_the_same_entries():
    assert list(core_zoo.ZOO) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_same_parameters_inputs_outputs_and_plan(name):
    entry, twin = zoo.ZOO[name], core_zoo.ZOO[name]
    assert _shapes(twin.params) == _shapes(entry.variables["params"])
    assert _shapes(twin.state) == _shapes(entry.variables.get("batch_stats", {}))
    for a, b in zip(
        jax.tree.leaves(core_zoo.inputs(twin)), jax.tree.leaves(zoo.inputs(entry)), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    f_flax, f_plain, params, x1, x2 = _pair(name)
    out_flax, out_plain = f_flax(params, x1), f_plain(params, x1)
    assert jax.tree.structure(out_plain) == jax.tree.structure(out_flax)
    for a, b in zip(jax.tree.leaves(out_plain), jax.tree.leaves(out_flax), strict=True):
        reference.assert_close(a, np.asarray(b, np.float64))
    assert _methods(f_plain, params, x1, x2) == _methods(f_flax, params, x1, x2)
    chosen = [ntk_core.plan(f, params, x1, x2).implementation for f in (f_plain, f_flax)]
    assert chosen[0] == chosen[1], chosen  # implementation="auto" picks the same


@functools.cache
def _reference(name):
    f_flax, _, params, x1, x2 = _pair(name)
    return reference.ntk(f_flax, params, x1, x2, trace_axes=())


@pytest.mark.parametrize("implementation", ["jacobian", "ntvp", "structured"])
@pytest.mark.parametrize("name", NAMES)
def test_same_kernels_against_the_reference(name, implementation):
    """The full kernel (``trace_axes=()``, every other axes setting is a reduction of
    it) of the Flax model from every implementation, and of its plain-JAX twin from the
    structured one, x2 given: the implementation whose rules read the jaxpr, where the
    twin's plan equals the Flax model's (test_same_parameters_inputs_outputs_and_plan);
    the twin's kernels from every implementation are the core's reference grid."""
    f_flax, f_plain, params, x1, x2 = _pair(name)
    expected = _reference(name)
    for f in (f_flax, f_plain) if implementation == "structured" else (f_flax,):
        k = ntk_core.empirical_ntk(f, params, x1, x2, trace_axes=(), implementation=implementation)
        assert len(jax.tree.leaves(k)) == len(expected)
        for actual, exp in zip(jax.tree.leaves(k), expected, strict=True):
            reference.assert_close(actual, exp)
