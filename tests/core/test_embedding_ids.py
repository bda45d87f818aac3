"""Integer ids outside the table they index (issue 48): refused by every kernel entry
before anything is computed (``ntk_core._kernel.ids``); ids in [-V, 0) wrap as numpy's
and give the float64 reference's kernel; gathers that clamp both ways are left alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
import reference

V = 7  # rows of the table


def f(p, ids):  # the model: (N, 4) ids -> (N, 3)
    return jnp.tanh(p["E"][ids]).mean(1) @ p["O"]


def clipped(p, ids):  # clamps forward and backward: a consistent derivative
    return jnp.tanh(jnp.take(p["E"], ids, axis=0, mode="clip")).mean(1) @ p["O"]


K1, K2 = jax.random.split(jax.random.PRNGKey(0))
P = {"E": jax.random.normal(K1, (V, 5)), "O": jax.random.normal(K2, (5, 3))}
OUTSIDE = jnp.array([[0, 1, 2, 3], [4, 5, 6, 8], [9, 9, 1, 2]])  # sample 1's 8 comes first
INSIDE = jnp.array([[0, 1, 2, 3], [4, 5, 6, -7], [-1, -2, 1, 2]])  # [-V, V): numpy's wrap
MESSAGE = r"x1 sample 1 holds the id 8, outside \[-7, 7\) for the 7 rows of params\['E'\]"

ENTRIES = {
    "auto": lambda x: ntk_core.empirical_ntk(f, P, x, trace_axes=()),
    "blocked": lambda x: ntk_core.empirical_ntk(f, P, x, batch_size=2),
    "whole-batch": lambda x: ntk_core.empirical_ntk(f, P, x, vmap_axes=None),
    "x2": lambda x: ntk_core.empirical_ntk(f, P, INSIDE, x),
    "nngp": lambda x: ntk_core.empirical_nngp(f, P, x),
    "ntk-vp": lambda x: ntk_core.ntk_vp_fn(f, P, x),
    "sketch": lambda x: ntk_core.empirical_ntk_sketch(f, P, x, k=8, key=K1),
}


@pytest.mark.parametrize("entry", ENTRIES, ids=list(ENTRIES))
def test_ids_outside_the_table_are_refused(entry):
    message = MESSAGE.replace("x1", "x2") if entry == "x2" else MESSAGE
    message = message.replace("x1", "x") if entry in ("ntk-vp", "sketch") else message
    with pytest.raises(ValueError, match=message) as info:
        ENTRIES[entry](OUTSIDE)
    assert type(info.value) is ValueError  # not a NonFiniteError, not a kernel
    assert "Fix: keep the ids of" in str(info.value)


def test_negative_ids_in_range_give_the_reference_kernel():
    kernel = ntk_core.empirical_ntk(f, P, INSIDE, OUTSIDE[:1], trace_axes=())
    (expected,) = reference.ntk(f, P, INSIDE, OUTSIDE[:1], trace_axes=())
    reference.assert_close(kernel, expected)


def scanned(p, ids):  # the lookups inside a lax.scan over the tokens (the batch in the carry)
    total, _ = jax.lax.scan(
        lambda c, i: (c + jnp.tanh(p["E"][i]), None), jnp.zeros((len(ids), 5)), ids.T
    )
    return total / ids.shape[1] @ p["O"]


def test_lookups_inside_a_scan_are_checked_at_every_step():
    """A scan whose body indexes the table with the scanned-over ids (verification
    helper's D1: ntvp, which auto picked, was 0.157 off jacrev there): refused; ids in
    range give the float64 reference's kernel."""
    with pytest.raises(ValueError, match="^empirical_ntk: " + MESSAGE):
        ntk_core.empirical_ntk(scanned, P, OUTSIDE, trace_axes=(), vmap_axes=None)
    k = ntk_core.empirical_ntk(scanned, P, INSIDE, trace_axes=(), vmap_axes=None)
    reference.assert_close(k, reference.ntk(scanned, P, INSIDE, INSIDE, trace_axes=())[0])


def test_a_gather_clamping_both_ways_is_left_alone():
    kernel = ntk_core.empirical_ntk(clipped, P, OUTSIDE, trace_axes=())
    (expected,) = reference.ntk(clipped, P, OUTSIDE, OUTSIDE, trace_axes=())
    reference.assert_close(kernel, expected)


def test_a_flax_embed_is_refused_before_its_nan_rows():
    nn = pytest.importorskip("flax.linen")
    ntk_flax = pytest.importorskip("ntk_flax")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return nn.Dense(3)(nn.Embed(V, 5)(ids).mean(1))

    model = Model()
    variables = model.init(jax.random.PRNGKey(0), INSIDE)
    assert np.isnan(model.apply(variables, OUTSIDE)[1]).all()  # what it would compute
    message = MESSAGE.replace(r"params\['E'\]", r"params\['Embed_0'\]\['embedding'\]")
    with pytest.raises(ValueError, match=message) as info:
        ntk_flax.kernel(model, variables, OUTSIDE)
    assert type(info.value) is ValueError  # not the NonFiniteError of the NaN rows
