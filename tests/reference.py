"""Independent float64 reference kernels and the one tolerance table of the test suite.

The reference never uses the library's layout code: it builds whole-batch Jacobians
with ``jax.jacrev`` (no vmap, no per-sample trick), flattens them to float64 numpy,
forms the full kernel with one ``np.einsum``, then traces and takes diagonals pair by
pair with ``np.trace`` / ``np.diagonal`` (neural-tangents' ``_trace_and_diagonal``
semantics).
"""

from __future__ import annotations

import jax
import numpy as np

#: max |K - K_ref| <= TOLERANCE[dtype] * max |K_ref|
TOLERANCE = {"float32": 2e-5, "float64": 1e-12}


def _on_host(*trees):
    """The trees on the CPU: on an accelerator (a TPU multiplies float32 in bf16 passes
    by default) the reference is still computed at the CPU's full float32 precision."""
    return jax.device_put(trees, jax.devices("cpu")[0])


def _flat_jacobian(apply_fn, params, x) -> list[np.ndarray]:
    """Per output leaf: the whole-batch Jacobian as float64 ``(N, *O, P)``."""
    params, x = _on_host(params, x)
    jac = jax.jit(jax.jacrev(lambda p, x: apply_fn(p, x)))(params, x)
    out = jax.eval_shape(apply_fn, params, x)
    out_leaves, out_tree = jax.tree.flatten(out)
    result = []
    for o, leaf_jac in zip(out_leaves, out_tree.flatten_up_to(jac), strict=True):
        parts = [
            np.asarray(j, np.float64).reshape(o.shape + (-1,)) for j in jax.tree.leaves(leaf_jac)
        ]
        result.append(np.concatenate(parts, axis=-1))
    return result


def _outputs(apply_fn, params, x) -> list[np.ndarray]:
    params, x = _on_host(params, x)
    return [np.asarray(o, np.float64) for o in jax.tree.leaves(jax.jit(apply_fn)(params, x))]


def reduce_full(full: np.ndarray, trace_axes, diagonal_axes) -> np.ndarray:
    """From ``(N1, *O, N2, *O)`` to the neural-tangents layout."""
    d = full.ndim // 2
    trace = {a % d for a in trace_axes}
    diag = {a % d for a in diagonal_axes}
    k = np.transpose(full, [i for a in range(d) for i in (a, d + a)])  # zipped pairs
    for a in reversed(range(d)):
        if a in trace:
            k = np.trace(k, axis1=2 * a, axis2=2 * a + 1) / k.shape[2 * a]
        elif a in diag:
            k = np.moveaxis(np.diagonal(k, axis1=2 * a, axis2=2 * a + 1), -1, 2 * a)
    return k


def full_ntk(apply_fn, params, x1, x2):
    """Reference NTK per output leaf (list), full form ``(N1, *O, N2, *O)``."""
    j1 = _flat_jacobian(apply_fn, params, x1)
    j2 = j1 if x2 is None else _flat_jacobian(apply_fn, params, x2)
    return [np.tensordot(a, b, axes=([-1], [-1])) for a, b in zip(j1, j2, strict=True)]


def full_nngp(apply_fn, params, x1, x2):
    """Reference NNGP per output leaf (list), full form ``(N1, *O, N2, *O)``."""
    o1 = _outputs(apply_fn, params, x1)
    o2 = o1 if x2 is None else _outputs(apply_fn, params, x2)
    return [np.tensordot(a, b, axes=0) for a, b in zip(o1, o2, strict=True)]


def ntk(apply_fn, params, x1, x2, trace_axes=(-1,), diagonal_axes=()):
    """Reference NTK per output leaf (list) in the neural-tangents layout."""
    return [reduce_full(k, trace_axes, diagonal_axes) for k in full_ntk(apply_fn, params, x1, x2)]


def nngp(apply_fn, params, x1, x2, trace_axes=(-1,), diagonal_axes=()):
    """Reference NNGP per output leaf (list) in the neural-tangents layout."""
    return [reduce_full(k, trace_axes, diagonal_axes) for k in full_nngp(apply_fn, params, x1, x2)]


def leaf_alone(apply_fn, params, index):
    """``(f, leaf)``: ``apply_fn`` as a function ``f(leaf, x)`` of parameter leaf number
    ``index`` (in ``jax.tree.leaves`` order), the others held fixed; its reference NTK is
    that leaf's share of the kernel."""
    leaves, treedef = jax.tree.flatten(params)

    def f(leaf, x):
        return apply_fn(
            jax.tree.unflatten(treedef, [*leaves[:index], leaf, *leaves[index + 1 :]]), x
        )

    return f, leaves[index]


def assert_close(actual, expected, dtype="float32", scale=None):
    """Asserts shape equality and max |a - e| <= TOLERANCE[dtype] * max |e|.

    ``scale`` replaces max |e| where a part is compared whose size is not the
    computation's (one leaf's share of a kernel, which can be zero: pass the whole
    kernel's max |K|).
    """
    actual = np.asarray(actual, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(np.abs(expected).max() if scale is None else scale, 1e-30)
    err = np.abs(actual - expected).max()
    assert err <= TOLERANCE[dtype] * scale, f"max error {err:.3e} vs scale {scale:.3e}"
