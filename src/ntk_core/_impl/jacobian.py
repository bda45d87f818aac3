"""Jacobian contraction: per-sample Jacobians (features), then a dot over parameters.

Θ(x1_i, x2_j) = Σ_p J(x1_i)_p J(x2_j)_p^T with the output axes laid out by
:mod:`ntk_core._kernel.layout`. Cost: (N1 + N2)·O reverse passes for the Jacobians, memory
(N1 + N2)·O·P, and N1·N2·O'·P multiply-adds for the contraction (O' the product of the
kept output sizes). Reference: Novak et al., "Fast Finite Width Neural Tangent Kernel",
ICML 2022, section 3.1.

Unless the kernel is split per parameter leaf, the narrow per-leaf Jacobians are
concatenated once per block of samples (:func:`merge`) and contracted by one einsum:
each separate einsum writes and re-reads the whole (N1, N2, O') output through a
poorly shaped matrix product (a contraction of P_l values per output value), which on
XLA CPU costs about :data:`EINSUM_PASS_FLOPS` FLOPs per output value whatever P_l.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._jax.batches import map_in_batches
from ntk_core._kernel.model import per_sample

#: FLOP-equivalents of one output value of a separate Jacobian-contraction einsum
#: beyond its multiply-adds (writing, transposing and summing the (N1, N2, O') output).
#: Measured on XLA CPU (2 cores, jax 0.10.2; load average 1-4): 13 einsums
#: ``nabp,mcbp->nmac`` over leaves of the token model (N = 256, O = 5x3, P_l = 3..88)
#: take 0.26 s, one einsum over their concatenation (P = 419) 0.080 s: about 9 ns per
#: output value and einsum, i.e. ~400 FLOPs at the 40-50 GFLOP/s of those einsums.
EINSUM_PASS_FLOPS = 400.0
#: Copies of values that concatenating Jacobians costs, per value, in the same units
#: (1.6 M values concatenated in 2.4 ms, 1.5 ns per value): ~64 FLOPs.
COPY_FLOPS = 64.0


def merge_limit(n: int, out_size: int, pair_size: int) -> int:
    """Widest per-leaf Jacobian (P_l) worth copying into the concatenated matrix.

    For a kernel of N1 x N2 samples, copying a leaf's Jacobians costs (N1 + N2)·O·P_l
    copies (:data:`COPY_FLOPS` each), while contracting it apart costs one more einsum
    pass over the N1·N2·O' kernel values (:data:`EINSUM_PASS_FLOPS` each), with O the
    output entries per sample and O' the kernel values per pair. With n = min(N1, N2),
    the copy pays when

        P_l ≤ (EINSUM_PASS_FLOPS / COPY_FLOPS) · n · O' / (2·O)   (≈ 3·n·O'/O).

    The blocked engine computes each block's features once per band of tiles and
    contracts them with all the other side's blocks, so the whole call's N1, N2 hold
    there too. A wide leaf (e.g. the 784 000 weights of an MLP's first layer) stays
    apart: its einsum is a good matrix product already and a copy would double its
    memory. The engine and the cost model pass n = max(N1, N2): a test-train call
    (fewer test samples) then groups the leaves as the train Gram matrix before it did
    and reuses its compiled features; for unbalanced N1, N2 that merges a little more
    than the balance above asks.
    """
    return int(EINSUM_PASS_FLOPS / COPY_FLOPS * n * pair_size / (2.0 * max(out_size, 1)))


def merge_groups(widths, dtypes, limit: float) -> list[list[int]]:
    """Indices of the matrices contracted together: one group per dtype of the narrow
    ones (width ≤ ``limit``), in first-seen order, then each wide one alone."""
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
    """Per-sample Jacobian-type matrices ``(N, *O, P_l)`` of one output leaf, those of
    width P_l ≤ ``limit`` (:func:`merge_limit`) concatenated along the last axis;
    ``limit`` None keeps them apart (kernels split per leaf). The limit comes from the
    whole call, never from the block, so that both sides of a tile merge alike."""
    if limit is None or len(mats) < 2:
        return list(mats)
    groups = merge_groups([m.shape[-1] for m in mats], [m.dtype for m in mats], limit)
    return [
        mats[g[0]] if len(g) == 1 else jnp.concatenate([mats[i] for i in g], axis=-1)
        for g in groups
    ]


def whole_batch_rows(f, params, index):
    """Rows ``index`` (flat positions of the outputs, all leaves in order) of the
    Jacobian of ``f`` (``vmap_axes=None``: the whole batch): one forward pass, then
    ``len(index)`` output cotangents pulled back through it at once. Returns the
    parameter tree with leaves ``(len(index), *param_shape)``.

    Memory: the forward pass's residuals (V_batch values) and about V_batch more per
    cotangent. ``jax.jacrev`` pulls all N·O back at once: 16 GB for a 64-filter
    convolution on 64 MNIST-sized inputs (O = 10); the engine passes as many as fit
    in ``memory_budget`` (:func:`ntk_core._impl.cost.whole_batch`).
    """
    out, pullback = jax.vjp(f, params)
    out_leaves, out_def = jax.tree.flatten(out)
    starts = np.cumsum([0] + [math.prod(o.shape) for o in out_leaves])
    cotangents = [
        (index[:, None] == (start + jnp.arange(o.size))[None, :])
        .astype(o.dtype)
        .reshape((-1,) + o.shape)
        for o, start in zip(out_leaves, starts, strict=False)
    ]
    return jax.vmap(lambda *ct: pullback(jax.tree.unflatten(out_def, list(ct)))[0])(*cotangents)


def rows_as_jacobian(rows, out_shapes):
    """All rows of :func:`whole_batch_rows` in ``jax.jacrev``'s layout: per output
    leaf (``out_shapes``, a pytree of shapes), the parameter tree with leaves
    ``out_shape + param_shape``."""
    leaves, out_def = jax.tree.flatten(out_shapes)
    starts = np.cumsum([0] + [math.prod(o.shape) for o in leaves])
    per_out = [
        jax.tree.map(
            lambda j, o=o, s=s: j[s : s + math.prod(o.shape)].reshape(o.shape + j.shape[1:]), rows
        )
        for o, s in zip(leaves, starts, strict=False)
    ]
    return jax.tree.unflatten(out_def, per_out)


def whole_batch_size(apply3, params, x, aux) -> int:
    """N·O, the output entries of the whole batch (the rows of its Jacobian)."""
    return sum(math.prod(o.shape) for o in jax.tree.leaves(jax.eval_shape(apply3, params, x, aux)))


def whole_batch_jacobian(f, params, chunk: int):
    """``jax.jacrev(f)(params)``, ``chunk`` output cotangents at a time
    (:func:`whole_batch_rows`) in one XLA loop whose last chunk overlaps its
    predecessor. On CPU, XLA runs convolutions' reverse passes inside a loop several
    times slower (a 64-filter convolution: 8x); the engine loops over the chunks from
    Python where it can (concrete inputs) and uses this under an outer ``jax.jit``."""
    out_shapes = jax.eval_shape(f, params)
    total = sum(math.prod(o.shape) for o in jax.tree.leaves(out_shapes))
    rows = map_in_batches(lambda i: whole_batch_rows(f, params, i), jnp.arange(total), chunk)
    return rows_as_jacobian(rows, out_shapes)


def jacobians(
    apply3,
    params,
    x,
    aux,
    vmap_axes,
    out_tree,
    merge_limits=None,
    cotangent_chunk=None,
    single=None,
):
    """Per-output-leaf lists of Jacobians flattened to ``(N, *out_shape[1:], P_leaf)``.

    With ``merge_limits`` (per output leaf, see :func:`merge`), the narrow ones are
    concatenated: the lists then hold one matrix per contraction, not per leaf. With
    ``vmap_axes=None`` the whole batch is differentiated, ``cotangent_chunk`` output
    cotangents at a time (:func:`whole_batch_jacobian`; None: all at once). ``single``:
    the model on one sample (with ``vmap_axes=0``), by default ``per_sample(apply3)``;
    the engine passes :func:`ntk_core._kernel.model.replay` (no new trace of the model).
    """
    if vmap_axes is None:
        chunk = cotangent_chunk or whole_batch_size(apply3, params, x, aux)
        jac = whole_batch_jacobian(lambda p: apply3(p, x, aux), params, chunk)
    else:
        single = per_sample(apply3) if single is None else single
        jac = jax.vmap(jax.jacrev(single), in_axes=(None, 0, None))(params, x, aux)
    return matrices(jac, params, out_tree, merge_limits)


def matrices(jac, params, out_tree, merge_limits=None):
    """``jax.jacrev``-layout Jacobians as :func:`jacobians` returns them: per output
    leaf, the matrices ``(N, *out_shape[1:], P_leaf)``, merged by ``merge_limits``."""
    param_leaves = jax.tree.leaves(params)
    per_out = out_tree.flatten_up_to(jac)
    result = []
    for leaf_jac in per_out:
        flat = jax.tree.leaves(leaf_jac)
        mats = []
        for j, p in zip(flat, param_leaves, strict=True):
            out_ndim = j.ndim - jnp.ndim(p)
            mats.append(j.reshape(j.shape[:out_ndim] + (-1,)))
        result.append(mats)
    if merge_limits is not None:
        result = [merge(mats, lim) for mats, lim in zip(result, merge_limits, strict=True)]
    return result


def pair_einsum(a_spec: str, b_spec: str, out: str, a, b, precision):
    """``jnp.einsum(f"{a_spec},{b_spec}->{out}", a, b)`` as one 2-D matrix product.

    Axes that one operand alone has and ``out`` lacks (size-1 position axes) are summed
    first; the axes the operands share are flattened into the contracted dimension
    and each operand's other axes into its rows, so XLA sees ``(F_a, S) x (F_b, S)ᵀ``
    whatever the axis order and sizes. An output axis both operands have (a diagonal
    axis) needs a batched product, and a letter repeated within one operand a
    diagonal: those specs go to ``jnp.einsum`` unchanged.

    Why: ``jnp.einsum`` passes the axes to ``dot_general`` as they are, and with size-1
    and split contracted axes XLA CPU transposes a copy of one operand per product
    (the MLP 784-1000-1 kernel in 7 x 7 triangle blocks: 57 of its 85 matrix products
    read a transposed copy, against 1 of 85 for the same maths as plain matrices).
    """
    a_sum = tuple(i for i, s in enumerate(a_spec) if s not in out and s not in b_spec)
    b_sum = tuple(i for i, s in enumerate(b_spec) if s not in out and s not in a_spec)
    if a_sum:
        a = jnp.sum(a, axis=a_sum)
        a_spec = "".join(s for i, s in enumerate(a_spec) if i not in a_sum)
    if b_sum:
        b = jnp.sum(b, axis=b_sum)
        b_spec = "".join(s for i, s in enumerate(b_spec) if i not in b_sum)
    shared = [s for s in a_spec if s in b_spec]
    repeated = len(set(a_spec)) != len(a_spec) or len(set(b_spec)) != len(b_spec)
    if repeated or any(s in out for s in shared):
        return jnp.einsum(f"{a_spec},{b_spec}->{out}", a, b, precision=precision)
    size = dict(zip(a_spec, a.shape, strict=True)) | dict(zip(b_spec, b.shape, strict=True))
    free_a = [s for s in a_spec if s not in shared]
    free_b = [s for s in b_spec if s not in shared]
    dtype = jnp.result_type(a, b)

    def matrix(v, spec, free):
        v = jnp.transpose(v.astype(dtype), [spec.index(s) for s in free + shared])
        return v.reshape(math.prod(size[s] for s in free), math.prod(size[s] for s in shared))

    r = jax.lax.dot_general(
        matrix(a, a_spec, free_a),
        matrix(b, b_spec, free_b),
        (((1,), (1,)), ((), ())),
        precision=precision,
    )
    r = r.reshape([size[s] for s in free_a + free_b])
    return jnp.transpose(r, [(free_a + free_b).index(s) for s in out])


def contract(layouts, jac1, jac2, precision):
    """Per output leaf, the list of each parameter leaf's kernel (they sum to the NTK)."""
    kernels = []
    for layout, m1, m2 in zip(layouts, jac1, jac2, strict=True):
        lhs, rhs, out = layout.specs(n_contracted=1)
        size = layout.trace_size(m1[0].shape)
        kernels.append(
            [
                pair_einsum(lhs, rhs, out, a, b, precision) / size
                for a, b in zip(m1, m2, strict=True)
            ]
        )
    return kernels
