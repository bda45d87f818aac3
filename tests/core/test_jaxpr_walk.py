"""The shared jaxpr walker (ntk_core._jax.jaxpr_walk) and the structured analysis's typed
Structure (ntk_core._structured.analysis.Structure)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ntk_core._impl import cost as _cost
from ntk_core._jax import jaxpr_walk as _jaxpr_walk
from ntk_core._structured import analysis as _structured


def _only(closed, name):
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == name]
    return eqn


def test_sub_operands_map_scan_and_cond_inputs_and_not_while_bodies():
    """scan's body takes every operand, a cond branch all but the index; a while loop's
    body, with constants of its own, none by count."""
    xs = jnp.ones((5, 3))
    scan = _only(
        jax.make_jaxpr(lambda c: jax.lax.scan(lambda h, x: (h + x, h), c, xs))(xs[0]), "scan"
    )
    (body,) = _jaxpr_walk.sub_jaxprs(scan)
    assert _jaxpr_walk.sub_operands(scan, body) == list(scan.invars)

    cond = _only(
        jax.make_jaxpr(lambda x: jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x))(xs[0]), "cond"
    )
    for branch in _jaxpr_walk.sub_jaxprs(cond):
        assert _jaxpr_walk.sub_operands(cond, branch) == list(cond.invars[1:])

    def loop(x, a, b):
        return jax.lax.while_loop(
            lambda c: c[0] < a[0] + b[0], lambda c: (c[0] + a[0] * b[0], c[1] * a), (0.0, x)
        )

    loop_eqn = _only(jax.make_jaxpr(loop)(xs[0], xs[0], xs[0]), "while")
    subs = list(_jaxpr_walk.sub_jaxprs(loop_eqn))
    assert [_jaxpr_walk.sub_operands(loop_eqn, s) for s in subs] == [None, None]


def test_entries_count_array_values():
    closed = jax.make_jaxpr(lambda x: jnp.outer(x, x).sum())(jnp.ones(3))
    assert [_jaxpr_walk.entries(v) for e in closed.jaxpr.eqns for v in e.outvars][-1] == 1
    assert _jaxpr_walk.values_written(closed.jaxpr) == sum(
        _jaxpr_walk.entries(v) for e in closed.jaxpr.eqns for v in e.outvars
    )


def test_pass_cost_counts_the_costlier_cond_branch_and_scan_length():
    w = jnp.ones((4, 4))

    def f(w, x):
        x = jax.lax.cond(x[0] > 0, lambda v: v @ w, lambda v: v * 2.0, x)
        return jax.lax.scan(lambda h, _: (h @ w, None), x, None, length=3)[0]

    closed = jax.make_jaxpr(f)(w, jnp.ones(4))
    cost = _cost.pass_cost(closed.jaxpr, [(True, False), (False, True)])
    # The matmul branch (v @ w, v from the input alone: a weight gradient), then three
    # scan steps h @ w (h from both: an activation and a weight gradient), 32 FLOPs each.
    assert (cost.grad_activations, cost.grad_weights_dot) == (3 * 32.0, 4 * 32.0)


def test_structure_is_a_named_tuple_indexable_by_position():
    def f(p, x):
        return jnp.tanh(x @ p[0]) @ p[1]

    p = [jnp.ones((3, 4)), jnp.ones((4, 2))]
    one = jax.ShapeDtypeStruct((3,), jnp.float32)
    analysis, _ = _structured.analysis_for(
        lambda q, v, aux: f(q, v), p, one, None, precision="highest"
    )
    structure = analysis.leaves(2, ("gram", "explicit"))
    assert isinstance(structure, _structured.Structure)
    assert structure._fields == ("n_leaves", "fallback", "groups", "group_leaves", "modes")
    assert structure.n_leaves == structure[0] == 2
    assert structure.fallback == structure[1] == ()
    assert structure.groups == structure[2] == ((0,), (1,))
    assert structure.group_leaves == structure[3] == (0, 1)
    assert structure.modes == structure[4] == ("gram", "explicit")
    assert analysis.leaves(2).modes == ("gram", "gram")
    assert hash(structure) == hash(tuple(structure))  # jit-static configuration
