"""The reference grid of the core: every implementation x zoo model (plain JAX,
tests/core_zoo.py) x axes setting x (x2 given or None) against the independent float64
reference (tests/reference.py). Full grid, no sampling.

The grid is split by model over two test files (``tests/core/test_reference_grid*.py``)
so that pytest-xdist's ``--dist loadfile`` gives each worker about half of it; each file
calls :func:`tests` with its models. The float64 references are shared across the
parametrizations of a file: each input's flattened Jacobian (or outputs) is computed
once per model and input, and each full kernel once per model, kind and x2; the axes
settings reduce that full kernel.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
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
IMPLEMENTATIONS = ["jacobian", "ntvp", "structured", "auto"]
#: The models of each grid file, about half of the grid's time each (measured).
FIRST = ["tokens", "batchnorm_eval", "tied"]
CONV = ["lenet", "cnn10", "mlp", "dict_input"]


def _n2(axes):
    return 3 if axes == "diag_batch" else 2


def _inputs(name, axes, with_x2):
    entry = core_zoo.ZOO[name]
    x1, x2 = core_zoo.inputs(entry, 3, _n2(axes))
    return x1, (x2 if with_x2 else None)


@functools.cache
def _per_input(kind, name, which, n):
    """Input ``which`` (1: x1, 2: x2) of ``n`` samples: its flattened float64 Jacobian
    per output leaf (``ntk``) or its float64 outputs (``nngp``)."""
    entry = core_zoo.ZOO[name]
    x = core_zoo.inputs(entry, 3, n)[which - 1]
    if kind == "ntk":
        return reference._flat_jacobian(core_zoo.apply_fn(entry), entry.params, x)
    return reference._outputs(core_zoo.apply_fn(entry), entry.params, x)


@functools.cache
def _full_reference(kind, name, n2):
    """The full float64 reference kernel per output leaf, ``(N1, *O, N2, *O)``, with
    x2 of ``n2`` samples (``n2=None``: x2=None, the kernel of x1 with itself); the same
    contraction as ``reference.full_ntk`` / ``reference.full_nngp``."""
    a = _per_input(kind, name, 1, 3)
    b = a if n2 is None else _per_input(kind, name, 2, n2)
    if kind == "ntk":
        return [np.tensordot(u, v, axes=([-1], [-1])) for u, v in zip(a, b, strict=True)]
    return [np.tensordot(u, v, axes=0) for u, v in zip(a, b, strict=True)]


def _reference(kind, name, axes, with_x2):
    full = _full_reference(kind, name, _n2(axes) if with_x2 else None)
    opts = AXES[axes]
    trace, diagonal = opts.get("trace_axes", (-1,)), opts.get("diagonal_axes", ())
    return [reference.reduce_full(k, trace, diagonal) for k in full]


def _check(result, expected):
    leaves = jax.tree.leaves(result)
    assert len(leaves) == len(expected)
    for actual, exp in zip(leaves, expected, strict=True):
        reference.assert_close(actual, exp)


def tests(models):
    """The two grid tests (NTK, NNGP) over ``models``, for a test module to bind."""

    @pytest.mark.parametrize("with_x2", [False, True], ids=["x2_none", "x2_given"])
    @pytest.mark.parametrize("axes", list(AXES))
    @pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
    @pytest.mark.parametrize("name", models)
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
    @pytest.mark.parametrize("name", models)
    def test_nngp_matches_reference(name, axes, with_x2):
        entry = core_zoo.ZOO[name]
        x1, x2 = _inputs(name, axes, with_x2)
        k = ntk_core.empirical_nngp(core_zoo.apply_fn(entry), entry.params, x1, x2, **AXES[axes])
        _check(k, _reference("nngp", name, axes, with_x2))

    return test_ntk_matches_reference, test_nngp_matches_reference
