"""Every implementation x zoo model (plain JAX, tests/core_zoo.py) x axes setting x (x2
given or None) against the independent float64 reference (tests/reference.py). Full
grid, no sampling."""

from __future__ import annotations

import functools

import jax
import pytest

import core_zoo
import ntk_core
import reference

AXES = {
    "trace": dict(trace_axes=(-1,)),
    "full": dict(trace_axes=()),
    "diag_out": dict(trace_axes=(), diagonal_axes=(-1,)),
    "diag_batch": dict(trace_axes=(), diagonal_axes=(0,)),
}


def _inputs(name, axes, with_x2):
    entry = core_zoo.ZOO[name]
    n2 = 3 if axes == "diag_batch" else 2
    x1, x2 = core_zoo.inputs(entry, 3, n2)
    return x1, (x2 if with_x2 else None)


@functools.cache
def _full_reference(kind, name, n2, with_x2):
    entry = core_zoo.ZOO[name]
    x1, x2 = core_zoo.inputs(entry, 3, n2)
    fn = reference.full_ntk if kind == "ntk" else reference.full_nngp
    return fn(core_zoo.apply_fn(entry), entry.params, x1, x2 if with_x2 else None)


def _reference(kind, name, axes, with_x2):
    full = _full_reference(kind, name, 3 if axes == "diag_batch" else 2, with_x2)
    return [reference.reduce_full(k, **_ref_axes(axes)) for k in full]


def _ref_axes(axes):
    opts = AXES[axes]
    return dict(
        trace_axes=opts.get("trace_axes", (-1,)), diagonal_axes=opts.get("diagonal_axes", ())
    )


def _check(result, expected):
    leaves = jax.tree.leaves(result)
    assert len(leaves) == len(expected)
    for actual, exp in zip(leaves, expected, strict=True):
        reference.assert_close(actual, exp)


@pytest.mark.parametrize("with_x2", [False, True], ids=["x2_none", "x2_given"])
@pytest.mark.parametrize("axes", list(AXES))
@pytest.mark.parametrize("implementation", ["jacobian", "ntvp", "structured", "auto"])
@pytest.mark.parametrize("name", list(core_zoo.ZOO))
def test_ntk_matches_reference(name, implementation, axes, with_x2):
    entry = core_zoo.ZOO[name]
    x1, x2 = _inputs(name, axes, with_x2)
    k = ntk_core.empirical_ntk(
        core_zoo.apply_fn(entry),
        entry.params,
        x1,
        x2,
        implementation=implementation,
        **AXES[axes],
    )
    _check(k, _reference("ntk", name, axes, with_x2))


@pytest.mark.parametrize("with_x2", [False, True], ids=["x2_none", "x2_given"])
@pytest.mark.parametrize("axes", list(AXES))
@pytest.mark.parametrize("name", list(core_zoo.ZOO))
def test_nngp_matches_reference(name, axes, with_x2):
    entry = core_zoo.ZOO[name]
    x1, x2 = _inputs(name, axes, with_x2)
    k = ntk_core.empirical_nngp(core_zoo.apply_fn(entry), entry.params, x1, x2, **AXES[axes])
    _check(k, _reference("nngp", name, axes, with_x2))
