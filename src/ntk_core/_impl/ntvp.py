"""NTK-vector products (Novak et al., ICML 2022, s. 3.2): Θ v = J(x1) (J(x2)^T v), one VJP
and one JVP per output basis vector, no Jacobian stored. Cost: N2·O VJPs and N2·O JVPs
over the x1 batch; memory O·P + O·N1·O (full O x O blocks, then traced or diagonalised)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _leaf_basis(out_shapes, k):
    """Cotangents selecting each entry of output leaf ``k`` (others zero): leading axis."""
    size = math.prod(out_shapes[k].shape)
    return [
        jnp.eye(size, dtype=s.dtype).reshape((size,) + s.shape)
        if i == k
        else jnp.zeros((size,) + s.shape, s.dtype)
        for i, s in enumerate(out_shapes)
    ]


def reduce(layouts, fulls, batch_diagonal):
    """Applies each leaf's layout to its full kernel from :func:`full_kernels`."""
    result = []
    for layout, full in zip(layouts, fulls, strict=True):
        lhs, rhs, out = layout.specs()
        operand = lhs + (rhs[1:] if batch_diagonal else rhs)
        shape = full.shape[: len(lhs)]
        result.append(jnp.einsum(f"{operand}->{out}", full) / layout.trace_size(shape))
    return result


def full_kernels(apply3, params, x1, x2, aux, vmap_axes, out_tree, batch_diagonal, single):
    """Full NTK per output leaf, ``(N1, *O, N2, *O)`` or ``(N, *O, *O)`` with
    ``batch_diagonal`` (``vmap_axes=0`` only); ``single``: the model on one sample."""
    n_out = out_tree.num_leaves
    batch = apply3 if vmap_axes is None else jax.vmap(single, in_axes=(None, 0, None))
    shapes1 = [
        jax.ShapeDtypeStruct(o.shape, o.dtype)
        for o in out_tree.flatten_up_to(jax.eval_shape(batch, params, x1, aux))
    ]

    if vmap_axes is None:

        def f(p, x):
            return out_tree.flatten_up_to(apply3(p, x, aux))

        out2, vjp_fn = jax.vjp(lambda p: f(p, x2), params)
        shapes2 = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out2]
        results = []
        for k in range(n_out):

            def column(ct, k=k):
                (tangent,) = vjp_fn(ct)
                return jax.jvp(lambda p: f(p, x1), (params,), (tangent,))[1][k]

            cols = jax.lax.map(column, _leaf_basis(shapes2, k))
            full = cols.reshape(shapes2[k].shape + shapes1[k].shape)
            n2_ndim = len(shapes2[k].shape)
            results.append(jnp.moveaxis(full, tuple(range(n2_ndim)), tuple(range(-n2_ndim, 0))))
        return results

    def f_one(p, x_i):
        return out_tree.flatten_up_to(single(p, x_i, aux))

    def f_batch(p, x):
        return jax.vmap(lambda x_i: f_one(p, x_i))(x)

    def tangents(x2_j, k):
        """Output leaf ``k``'s shapes at ``x2_j``, and its basis pulled back to the params."""
        out2, vjp_fn = jax.vjp(lambda p: f_one(p, x2_j), params)
        shapes2 = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out2]
        return shapes2, jax.vmap(lambda ct: vjp_fn(ct)[0])(_leaf_basis(shapes2, k))

    results = []
    for k in range(n_out):
        if batch_diagonal:

            def pair(x1_i, x2_i, k=k):
                shapes2, tangents_k = tangents(x2_i, k)
                jvp = lambda t: jax.jvp(lambda p: f_one(p, x1_i), (params,), (t,))[1][k]  # noqa: E731
                cols = jax.vmap(jvp)(tangents_k)
                # cols: (O2..., O1...) flattened over O2 -> put x1's axes first.
                o = shapes2[k].shape
                cols = cols.reshape(o + o)
                return jnp.moveaxis(cols, tuple(range(len(o))), tuple(range(-len(o), 0)))

            results.append(jax.vmap(pair)(x1, x2))
        else:

            def column(x2_j, k=k):
                shapes2, tangents_k = tangents(x2_j, k)
                jvp = lambda t: jax.jvp(lambda p: f_batch(p, x1), (params,), (t,))[1][k]  # noqa: E731
                cols = jax.vmap(jvp)(tangents_k)
                # cols: (prod O2, N1, O1...)
                return cols.reshape(shapes2[k].shape + cols.shape[1:])

            full = jax.lax.map(column, x2)  # (N2, O2..., N1, O1...)
            n2_ndim = len(shapes1[k].shape)
            results.append(jnp.moveaxis(full, tuple(range(n2_ndim)), tuple(range(-n2_ndim, 0))))
    return results
