"""ntk_core.pntk_fn / empirical_pntk (the pseudo-NTK of Mohamadi et al. 2023) against
(1/O) Σ_ab of a float64 Jacobian contraction, and its relation to the traced eNTK."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
import reference

KEYS = jax.random.split(jax.random.PRNGKey(0), 6)
PARAMS = {
    "w": jax.random.normal(KEYS[0], (5, 32)) / 2.2,
    "b": jax.random.normal(KEYS[1], (32,)) / 10,
    "v": jax.random.normal(KEYS[2], (32, 3)) / 5.7,
}
X1 = jax.random.normal(KEYS[3], (6, 5))
X2 = jax.random.normal(KEYS[4], (4, 5))


def mlp(p, x):  # MLP 5-32-3
    return jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]


def two_leaves(p, x):  # outputs {"a": (N, 3), "b": (N, 2, 2)}: O = 7
    h = jnp.tanh(x @ p["w"] + p["b"])
    return {"a": h @ p["v"], "b": jnp.reshape(h[:, :4] * (h @ p["v"])[:, :1], (-1, 2, 2))}


def expected(f, x1, x2):
    """(1/O) (Σ_a J_a(x1_i)) · (Σ_b J_b(x2_j)), O over all output leaves, float64."""

    def summed_jacobian(x):
        leaves = reference._flat_jacobian(f, PARAMS, x)
        flat = np.concatenate([j.reshape(j.shape[0], -1, j.shape[-1]) for j in leaves], axis=1)
        return flat.sum(axis=1), flat.shape[1]

    (a, o), (b, _) = summed_jacobian(x1), summed_jacobian(X1 if x2 is None else x2)
    return a @ b.T / o


@pytest.mark.parametrize("implementation", ["jacobian", "ntvp", "structured", "auto"])
@pytest.mark.parametrize("f", [mlp, two_leaves], ids=["mlp", "two_leaves"])
def test_pntk_is_the_mean_of_every_output_pair_block(f, implementation):
    for x2 in (None, X2):
        got = ntk_core.empirical_pntk(f, PARAMS, X1, x2, implementation=implementation)
        reference.assert_close(got, expected(f, X1, x2))


def test_blocked_file_and_diagonal_forms(tmp_path):
    full = expected(mlp, X1, None)
    tiled = ntk_core.pntk_fn(mlp, batch_size=4)(PARAMS, X1)  # tiles of 4 x 4, ragged
    reference.assert_close(tiled, full)
    path = str(tmp_path / "pntk.npy")
    ntk_core.empirical_pntk(mlp, PARAMS, X1, X2, batch_size=4, out=path)
    reference.assert_close(np.load(path), expected(mlp, X1, X2))
    diag = ntk_core.empirical_pntk(mlp, PARAMS, X1, diagonal_axes=(0,))
    reference.assert_close(diag, np.diagonal(full))


def test_relation_to_the_traced_entk():
    """pNTK = traced eNTK (the mean over a = b) + (1/O) Σ_(a≠b) Θ[i, j, a, b]; the
    difference on this MLP is the figure the docstring states."""
    (full,) = reference.ntk(mlp, PARAMS, X1, None, trace_axes=())  # (N, N, O, O)
    o = full.shape[-1]
    traced = np.trace(full, axis1=2, axis2=3) / o
    off = (full.sum(axis=(2, 3)) - np.trace(full, axis1=2, axis2=3)) / o
    pntk = np.asarray(ntk_core.empirical_pntk(mlp, PARAMS, X1), np.float64)
    reference.assert_close(pntk, traced + off)
    gap = np.abs(pntk - traced).max() / np.abs(pntk).max()
    assert 0.01 < gap < 0.06, gap  # docstring: "differ by 2.4 % of max |pNTK|" (measured 0.0244)


def test_bad_input_names_pntk():
    with pytest.raises(TypeError, match=r"^pntk_fn: apply_fn must be a callable"):
        ntk_core.pntk_fn(3)
    with pytest.raises(TypeError, match=r"trace_axes"):
        ntk_core.pntk_fn(mlp, trace_axes=())
