"""Jacobian contraction (Novak et al., ICML 2022, s. 3.1): Θ(x1_i, x2_j) = Σ_p J(x1_i)_p
J(x2_j)_p^T; (N1 + N2)·O reverse passes, (N1 + N2)·O·P memory, N1·N2·O'·P multiply-adds.
Narrow per-leaf Jacobians are concatenated (:func:`merge`) into one einsum."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._jax.batches import map_in_batches

#: FLOP-equivalents per output value of each separate contraction einsum beyond its
#: multiply-adds (XLA CPU, token model: ~9 ns per value and einsum).
EINSUM_PASS_FLOPS = 400.0
#: Per value copied when concatenating Jacobians (1.5 ns per value).
COPY_FLOPS = 64.0
#: A TPU's float32 matrix product loses accuracy over long sums even at precision
#: HIGHEST (a v5e, 16 x 407 050 Gram: 2.5e-5 relative in one product, 1.1e-7 summed in
#: chunks of 16 384; benchmarks/README.md): on the platforms named here, products that
#: contract more values than CHUNK are summed chunk by chunk (a scan).
CHUNKED_PLATFORMS = ("tpu",)
CHUNK = 2**14


def merge_limit(n: int, out_size: int, pair_size: int) -> int:
    """Widest per-leaf Jacobian worth concatenating: the copy, (N1 + N2)·O·P_l values,
    pays against one more einsum pass over N1·N2·O' values when P_l ≤
    (EINSUM_PASS_FLOPS / COPY_FLOPS)·n·O'/(2·O); callers pass n = max(N1, N2)."""
    return int(EINSUM_PASS_FLOPS / COPY_FLOPS * n * pair_size / (2.0 * max(out_size, 1)))


def merge_groups(widths, dtypes, limit: float) -> list[list[int]]:
    """Index groups: the narrow ones (width ≤ ``limit``) per dtype, then each wide one."""
    narrow: dict = {}
    wide = []
    for i, (w, dt) in enumerate(zip(widths, dtypes, strict=True)):
        if w <= limit:
            narrow.setdefault(str(dt), []).append(i)
        else:
            wide.append([i])
    return list(narrow.values()) + wide


def einsum_count(widths, limit: float) -> int:
    """Einsums that :func:`merge` leaves for matrices of these widths (one dtype)."""
    wide = sum(1 for w in widths if w > limit)
    return wide + int(len(widths) > wide)


def merge(mats, limit: int | None):
    """Matrices ``(N, *O, P_l)`` with the narrow ones concatenated (``limit`` None: apart)."""
    if limit is None or len(mats) < 2:
        return list(mats)
    groups = merge_groups([m.shape[-1] for m in mats], [m.dtype for m in mats], limit)
    return [
        mats[g[0]] if len(g) == 1 else jnp.concatenate([mats[i] for i in g], axis=-1)
        for g in groups
    ]


def whole_batch_rows(f, params, index):
    """Rows ``index`` (flat output positions) of the whole batch's Jacobian of ``f``:
    the parameter tree with leaves ``(len(index), *param_shape)``."""
    out, pullback = jax.vjp(f, params)
    out_leaves, out_def = jax.tree.flatten(out)
    starts = np.cumsum([0] + [math.prod(o.shape) for o in out_leaves])
    cotangents = [
        (index[:, None] == (start + jnp.arange(o.size))[None, :])
        .astype(o.dtype)
        .reshape((index.shape[0],) + o.shape)  # not -1: o may hold no values
        for o, start in zip(out_leaves, starts, strict=False)
    ]
    return jax.vmap(lambda *ct: pullback(jax.tree.unflatten(out_def, list(ct)))[0])(*cotangents)


def rows_as_jacobian(rows, out_shapes):
    """All rows of :func:`whole_batch_rows` in ``jax.jacrev``'s layout."""
    leaves, out_def = jax.tree.flatten(out_shapes)
    starts = np.cumsum([0] + [math.prod(o.shape) for o in leaves])
    per_out = [
        jax.tree.map(
            lambda j, o=o, s=s: j[s : s + math.prod(o.shape)].reshape(o.shape + j.shape[1:]), rows
        )
        for o, s in zip(leaves, starts, strict=False)
    ]
    return jax.tree.unflatten(out_def, per_out)


def whole_batch_jacobian(f, params, chunk: int):
    """``jax.jacrev(f)(params)``, ``chunk`` cotangents at a time in one XLA loop."""
    out_shapes = jax.eval_shape(f, params)
    total = sum(math.prod(o.shape) for o in jax.tree.leaves(out_shapes))
    rows = map_in_batches(lambda i: whole_batch_rows(f, params, i), jnp.arange(total), chunk)
    return rows_as_jacobian(rows, out_shapes)


def jacobians(apply3, params, x, aux, vmap_axes, out_tree, merge_limits, cotangent_chunk, single):
    """Per-output-leaf lists of Jacobians ``(N, *out_shape[1:], P_leaf)`` (merged by
    ``merge_limits``); ``vmap_axes=None``: ``cotangent_chunk`` at a time; ``single``: the
    model on one sample."""
    if vmap_axes is None:
        jac = whole_batch_jacobian(lambda p: apply3(p, x, aux), params, cotangent_chunk)
    else:
        jac = jax.vmap(jax.jacrev(single), in_axes=(None, 0, None))(params, x, aux)
    return matrices(jac, params, out_tree, merge_limits)


def matrices(jac, params, out_tree, merge_limits=None):
    """``jax.jacrev``-layout Jacobians as :func:`jacobians` returns them."""
    param_leaves = jax.tree.leaves(params)
    per_out = out_tree.flatten_up_to(jac)

    def flat(j, p):
        lead = j.ndim - jnp.ndim(p)  # (N, *O), then the leaf's axes (maybe of size 0)
        return j.reshape(j.shape[:lead] + (math.prod(j.shape[lead:]),))

    limits = (None,) * len(per_out) if merge_limits is None else merge_limits
    return [
        merge([flat(j, p) for j, p in zip(jax.tree.leaves(lj), param_leaves, strict=True)], lim)
        for lj, lim in zip(per_out, limits, strict=True)
    ]


def pair_einsum(a_spec: str, b_spec: str, out: str, a, b, precision):
    """``jnp.einsum(f"{a_spec},{b_spec}->{out}", a, b)`` as one 2-D matrix product
    ``(F_a, S) x (F_b, S)ᵀ`` (else XLA CPU often transposes a copy of an operand);
    shared output axes or repeated letters go to ``jnp.einsum`` unchanged. Where
    :func:`chunked` (S values on a TPU), :func:`summed_in_chunks` sums over S instead."""
    a_sum = tuple(i for i, s in enumerate(a_spec) if s not in out and s not in b_spec)
    b_sum = tuple(i for i, s in enumerate(b_spec) if s not in out and s not in a_spec)
    if a_sum:
        a = jnp.sum(a, axis=a_sum)
        a_spec = "".join(s for i, s in enumerate(a_spec) if i not in a_sum)
    if b_sum:
        b = jnp.sum(b, axis=b_sum)
        b_spec = "".join(s for i, s in enumerate(b_spec) if i not in b_sum)
    shared = [s for s in a_spec if s in b_spec and s not in out]
    size = dict(zip(a_spec, a.shape, strict=True)) | dict(zip(b_spec, b.shape, strict=True))
    repeated = len(set(a_spec)) != len(a_spec) or len(set(b_spec)) != len(b_spec)
    shared_out = any(s in out and s in b_spec for s in a_spec)
    if repeated or (shared_out and not chunked(math.prod(size[s] for s in shared))):
        return jnp.einsum(f"{a_spec},{b_spec}->{out}", a, b, precision=precision)
    free_a = [s for s in a_spec if s not in shared]
    free_b = [s for s in b_spec if s not in shared]
    dtype = jnp.result_type(a, b)
    dims = (((1,), (1,)), ((), ()))

    def flat(v, spec, free, matrix):  # the contracted axes last, as one
        v = jnp.transpose(v.astype(dtype), [spec.index(s) for s in free + shared])
        lead = [math.prod(size[s] for s in free)] if matrix else [size[s] for s in free]
        return v.reshape(lead + [math.prod(size[s] for s in shared)])

    if shared_out:  # an einsum over the flattened contracted axes, in chunks
        z = next(c for c in "zyxwvutsrqponmlkjihgfedcba" if c not in a_spec + b_spec)
        spec = f"{''.join(free_a)}{z},{''.join(free_b)}{z}->{out}"
        a, b = flat(a, a_spec, free_a, False), flat(b, b_spec, free_b, False)
        return summed_in_chunks(lambda u, v: jnp.einsum(spec, u, v, precision=precision), a, b)
    a, b = flat(a, a_spec, free_a, True), flat(b, b_spec, free_b, True)
    r = summed_in_chunks(lambda u, v: jax.lax.dot_general(u, v, dims, precision=precision), a, b)
    r = r.reshape([size[s] for s in free_a + free_b])
    return jnp.transpose(r, [(free_a + free_b).index(s) for s in out])


def chunked(size: int) -> bool:
    """Whether a product contracting ``size`` values is summed in chunks here."""
    return size > CHUNK and jax.default_backend() in CHUNKED_PLATFORMS


def summed_in_chunks(product, a, b):
    """``product(a, b)``, a product contracting the last axis of ``a`` and of ``b``; on
    :data:`CHUNKED_PLATFORMS` with that axis longer than :data:`CHUNK`, the sum over it
    in chunks of CHUNK (zero-padded), each chunk's product added apart (a scan)."""
    s = a.shape[-1]
    if not chunked(s):
        return product(a, b)
    chunks = -(-s // CHUNK)

    def split(v):
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, chunks * CHUNK - s)])
        return jnp.moveaxis(v.reshape(*v.shape[:-1], chunks, CHUNK), -2, 0)

    def step(total, pair):
        return total + product(*pair), None

    parts = split(a), split(b)
    zero = jax.eval_shape(product, parts[0][0], parts[1][0])
    return jax.lax.scan(step, jnp.zeros(zero.shape, zero.dtype), parts)[0]


def contract(layouts, jac1, jac2, precision):
    """Per output leaf, each parameter leaf's kernel (they sum to the NTK)."""
    kernels = []
    for layout, m1, m2 in zip(layouts, jac1, jac2, strict=True):
        lhs, rhs, out = layout.specs(n_contracted=1)
        size = layout.trace_size(m1[0].shape)
        pairs = zip(m1, m2, strict=True)
        kernels.append([pair_einsum(lhs, rhs, out, a, b, precision) / size for a, b in pairs])
    return kernels
