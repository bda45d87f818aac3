"""Structured derivatives: the NTK of weights used in matrix products, without their
Jacobians.

For a weight W used in ``y = dot_general(x, W)`` the per-sample Jacobian of output
``o`` is ``∂f_o/∂W[c, k] = Σ_a x[a, c] g_o[a, k]`` with ``g = ∂f/∂y`` (the cotangent at
the product's output, for every output entry) and ``a`` the free axes of ``x`` (the
sample's batch axis of size 1, a sequence axis, ...). Its NTK contribution is

    Σ_{a,b} (Σ_c x1[a, c] x2[b, c]) (Σ_k g1_o[a, k] g2_o'[b, k]),

a four-operand contraction whose cheapest order (the Gram form above, or forming the
explicit Jacobian first) ``jnp.einsum`` picks from the shapes. For a Dense layer on
vectors this is (x1·x2)(g1·g2): O(C + O²K) per pair instead of O(O²·C·K).

Phase one (features, per sample, O(N)): the model's jaxpr (``jax.make_jaxpr``) is
evaluated by a small interpreter over public ``jax.extend.core`` objects that adds a
zero probe δ_u to the output of every structured product u and records its input x_u;
one reverse pass per output entry gives ∂f/∂δ_u = g_u and, jointly, the explicit
Jacobians of the *fallback* leaves. Phase two (contract, O(N1·N2)): the contraction
above per pair of uses of the same leaf (weight tying sums its per-use Jacobians, so
cross terms between uses count), plus the Jacobian contraction of the fallback leaves.

Fallback (explicit per-leaf Jacobian, the ``"jacobian"`` method) for every leaf that is
used in any other way: bias adds, scales, convolutions, gathers (embedding tables),
products of two parameters, or inside scan / cond / while / custom_vjp. Sub-jaxprs of
``jit``, ``closed_call`` and ``checkpoint`` are inlined; ``custom_jvp`` functions
(``jax.nn.relu``, ``gelu``) are evaluated with their own rules.

Reference: Novak, Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent
Kernel", ICML 2022, section 3.3.
"""

from __future__ import annotations

import dataclasses
import math
import string

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from ._model import per_sample

#: Primitives through which a parameter stays "the same numbers in another order".
_VIEW_PRIMITIVES = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p"})
#: Call-like primitives whose sub-jaxpr is evaluated inline.
_INLINE_PRIMITIVES = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint"}
)


@dataclasses.dataclass(frozen=True)
class Use:
    """One structured use of a parameter leaf: ``y = dot_general(x, view(W))``."""

    path: tuple[int, ...]  # indices of the equation through inlined sub-jaxprs
    leaf: int
    x_side: int  # 0: x is the lhs operand, 1: the rhs
    x_contract: tuple[int, ...]
    x_free: tuple[int, ...]
    key: tuple  # uses of one leaf with equal keys pair up coordinate by coordinate
    y_shape: tuple[int, ...]
    y_dtype: str
    w_free_size: int  # K
    x_contract_size: int  # C


@dataclasses.dataclass(frozen=True)
class Analysis:
    uses: tuple[Use, ...]
    fallback: tuple[int, ...]  # parameter leaves differentiated explicitly
    groups: tuple[tuple[int, ...], ...]  # use indices of each structured leaf
    biased: tuple[bool, ...] = ()  # per use: a bias added to its output is fused in

    def leaves(self, n_leaves: int) -> tuple:
        """``(n_leaves, fallback, groups, leaf of each group)`` for :func:`contract`."""
        group_leaves = tuple(self.uses[g[0]].leaf for g in self.groups)
        return (n_leaves, self.fallback, self.groups, group_leaves)


def _sub_jaxpr(eqn):
    for name in ("jaxpr", "call_jaxpr"):
        sub = eqn.params.get(name)
        if isinstance(sub, jex.ClosedJaxpr):
            return sub.jaxpr, list(sub.consts)
        if isinstance(sub, jex.Jaxpr):
            return sub, []
    return None


def _inlined(eqn) -> bool:
    return eqn.primitive.name in _INLINE_PRIMITIVES and _sub_jaxpr(eqn) is not None


def _literal(v) -> bool:
    return isinstance(v, jex.Literal)


def _order_preserving(chain, shape) -> bool:
    """A chain of reshapes / broadcasts that keeps the leaf's elements in order."""
    for name, params in chain:
        if name == "broadcast_in_dim":
            dims = dict(params).get("broadcast_dimensions", "")
            try:
                dims = tuple(int(d) for d in dims.strip("()").split(",") if d.strip())
            except ValueError:
                return False
            if list(dims) != sorted(dims):
                return False
        elif name != "reshape":
            return False
    return True


def analyse(closed: jex.ClosedJaxpr, n_param_leaves: int, fuse_bias: bool = True) -> Analysis:
    """Finds the structured uses of the first ``n_param_leaves`` inputs of ``closed``.

    With ``fuse_bias``, a bias added to the output of a Dense-like product on one
    position (A = 1) joins that product's Gram identity as a constant input column:
    K_W + K_b = (x1·x2 + 1)(g1·g2).
    """
    uses: list[Use] = []
    bad: set[int] = set()
    use_of_output: dict = {}  # output var of a use -> use index
    bias_candidates: list[tuple[int, int, tuple, tuple]] = []  # (use, leaf, chain, shape)

    def walk(jaxpr, origins: dict, path: tuple):
        # origins: var -> (leaf, view chain) for parameter views
        def origin(v):
            return None if _literal(v) else origins.get(v)

        readers: dict = {}  # var -> how many equations (or the outputs) read it
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if not _literal(v):
                    readers[v] = readers.get(v, 0) + 1
        for v in jaxpr.outvars:
            if not _literal(v):
                readers[v] = readers.get(v, 0) + 1

        for i, eqn in enumerate(jaxpr.eqns):
            here = path + (i,)
            ins = [origin(v) for v in eqn.invars]
            name = eqn.primitive.name
            if not any(o is not None for o in ins):
                continue
            if _inlined(eqn):
                sub, _ = _sub_jaxpr(eqn)
                sub_origins = {v: o for v, o in zip(sub.invars, ins, strict=True) if o is not None}
                walk(sub, sub_origins, here)  # views it returns are marked there
                continue
            if name in _VIEW_PRIMITIVES or name == "broadcast_in_dim":
                if len(eqn.invars) != 1:
                    for o in ins:
                        if o is not None:
                            bad.add(o[0])
                    continue
                leaf, chain = ins[0]
                step = (name, tuple(sorted((k, repr(v)) for k, v in eqn.params.items())))
                origins[eqn.outvars[0]] = (leaf, chain + (step,))
                continue
            if name == "add" and len(ins) == 2 and sum(o is not None for o in ins) == 1:
                b_side = 0 if ins[0] is not None else 1
                y = eqn.invars[1 - b_side]
                # Fusable only when the product's output feeds this add alone, so the
                # cotangent at the product equals the one at the bias.
                if not _literal(y) and y in use_of_output and readers.get(y) == 1:
                    leaf, chain = ins[b_side]
                    shape = tuple(eqn.invars[b_side].aval.shape)
                    bias_candidates.append((use_of_output[y], leaf, chain, shape))
                    continue
            if name == "dot_general" and sum(o is not None for o in ins) == 1:
                (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
                w_side = 0 if ins[0] is not None else 1
                leaf, chain = ins[w_side]
                through_broadcast = any(step[0] == "broadcast_in_dim" for step in chain)
                if not lb and not rb and not through_broadcast:
                    x_side = 1 - w_side
                    x_var, w_var = eqn.invars[x_side], eqn.invars[w_side]
                    x_contract = tuple(lc if x_side == 0 else rc)
                    w_contract = tuple(rc if x_side == 0 else lc)
                    x_free = tuple(a for a in range(len(x_var.aval.shape)) if a not in x_contract)
                    w_free = tuple(a for a in range(len(w_var.aval.shape)) if a not in w_contract)
                    key = (chain, w_contract, w_free, x_side)
                    uses.append(
                        Use(
                            here,
                            leaf,
                            x_side,
                            x_contract,
                            x_free,
                            key,
                            tuple(eqn.outvars[0].aval.shape),
                            str(eqn.outvars[0].aval.dtype),
                            math.prod(w_var.aval.shape[a] for a in w_free),
                            math.prod(x_var.aval.shape[a] for a in x_contract),
                        )
                    )
                    use_of_output[eqn.outvars[0]] = len(uses) - 1
                    continue
            for o in ins:  # any other use of a parameter view
                if o is not None:
                    bad.add(o[0])
        for v in jaxpr.outvars:
            o = None if _literal(v) else origins.get(v)
            if o is not None:
                bad.add(o[0])

    invars = closed.jaxpr.invars[:n_param_leaves]
    walk(closed.jaxpr, {v: (i, ()) for i, v in enumerate(invars)}, ())
    by_leaf: dict[int, list[int]] = {}
    for u, use in enumerate(uses):
        by_leaf.setdefault(use.leaf, []).append(u)
    for leaf, members in by_leaf.items():
        if len({uses[u].key for u in members}) > 1:
            bad.add(leaf)  # the same leaf seen through different views: no pairing
    uses_per_leaf = {leaf: len(m) for leaf, m in by_leaf.items()}
    bias_count: dict[int, int] = {}
    for _, leaf, _, _ in bias_candidates:
        bias_count[leaf] = bias_count.get(leaf, 0) + 1
    fused: dict[int, int] = {}  # use index (in ``uses``) -> bias leaf
    leaf_sizes = [math.prod(v.aval.shape) for v in closed.jaxpr.invars[:n_param_leaves]]
    for u, leaf, chain, shape in bias_candidates:
        use = uses[u]
        ok = (
            fuse_bias
            and leaf not in bad
            and leaf not in by_leaf
            and bias_count[leaf] == 1
            and use.leaf not in bad
            and uses_per_leaf[use.leaf] == 1
            and use.x_side == 0
            and math.prod(use.y_shape) == use.w_free_size  # one position: A = 1
            and leaf_sizes[leaf] == use.w_free_size  # one bias entry per output unit
            and shape == use.y_shape
            and _order_preserving(chain, shape)
        )
        if ok:
            fused[u] = leaf
        else:
            bad.add(leaf)
    kept_index = [u for u, use in enumerate(uses) if use.leaf not in bad]
    kept = [uses[u] for u in kept_index]
    biased = tuple(u in fused for u in kept_index)
    groups: dict[int, list[int]] = {}
    for u, use in enumerate(kept):
        groups.setdefault(use.leaf, []).append(u)
    absorbed = set(fused.values())
    structured = set(groups) | absorbed
    fallback = tuple(i for i in range(n_param_leaves) if i not in structured)
    return Analysis(tuple(kept), fallback, tuple(tuple(g) for g in groups.values()), biased)


def _bind(eqn, invals):
    bound = eqn.primitive.get_bind_params(eqn.params)
    # Older JAX returns (sub-functions, params), newer JAX the params alone.
    if isinstance(bound, tuple) and len(bound) == 2 and isinstance(bound[1], dict):
        subfuns, params = bound
    else:
        subfuns, params = (), bound
    return eqn.primitive.bind(*subfuns, *invals, **params)


def _evaluate(jaxpr, consts, args, probes: dict, records: dict, path=()):
    env = {}

    def read(v):
        return v.val if _literal(v) else env[v]

    for v, val in zip(jaxpr.constvars, consts, strict=True):
        env[v] = val
    for v, val in zip(jaxpr.invars, args, strict=True):
        env[v] = val
    for i, eqn in enumerate(jaxpr.eqns):
        here = path + (i,)
        invals = [read(v) for v in eqn.invars]
        if _inlined(eqn):
            sub, sub_consts = _sub_jaxpr(eqn)
            outs = _evaluate(sub, sub_consts, invals, probes, records, here)
        else:
            outs = _bind(eqn, invals)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            if here in probes:
                x_side, delta = probes[here]
                records[here] = invals[x_side]
                outs = [outs[0] + delta]
        for v, val in zip(eqn.outvars, outs, strict=True):
            env[v] = val  # a dropped output (DropVar) is never read
    return [read(v) for v in jaxpr.outvars]


def analysis_for(
    apply3, params, x_one, aux, fuse_bias: bool = True
) -> tuple[Analysis, jex.ClosedJaxpr]:
    """The structured analysis of ``apply3`` on one sample (shapes suffice)."""
    closed = jax.make_jaxpr(per_sample(apply3))(params, x_one, aux)
    return analyse(closed, len(jax.tree.leaves(params)), fuse_bias), closed


def features(apply3, params, x, aux, out_tree, fuse_bias: bool = True):
    """Per-sample structured features of a batch.

    Returns a dict with ``"fallback"``: per output leaf, a list of explicit Jacobians
    ``(N, *O, P_l)``; ``"x"``: per use, layer inputs ``(N, A, C)``; ``"g"``: per output
    leaf, per use, cotangents ``(N, *O, A, K)``.
    """
    x_one = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape[1:], v.dtype), x)
    analysis, closed = analysis_for(apply3, params, x_one, aux, fuse_bias)
    param_leaves = jax.tree.leaves(params)

    def one(x_i):
        leaves_x = jax.tree.leaves(x_i)
        leaves_aux = jax.tree.leaves(aux)

        def run(fb, deltas):
            leaves = list(param_leaves)
            for i, v in zip(analysis.fallback, fb, strict=True):
                leaves[i] = v
            probes = {
                use.path: (use.x_side, d) for use, d in zip(analysis.uses, deltas, strict=True)
            }
            records: dict = {}
            outs = _evaluate(
                closed.jaxpr, closed.consts, leaves + leaves_x + leaves_aux, probes, records
            )
            return outs, [records[use.path] for use in analysis.uses]

        fb0 = [param_leaves[i] for i in analysis.fallback]
        d0 = [jnp.zeros(use.y_shape, use.y_dtype) for use in analysis.uses]
        # Per output leaf: (Jacobians of the fallback leaves, cotangents at each use).
        jac, xs = jax.jacrev(run, argnums=(0, 1), has_aux=True)(fb0, d0)
        return jac, xs

    jac, xs = jax.vmap(one)(x)
    j_fb = [pair[0] for pair in jac]
    j_d = [pair[1] for pair in jac]
    out_shapes = out_tree.flatten_up_to(jax.eval_shape(apply3, params, x, aux))
    fallback, g = [], []
    for k, o in enumerate(out_shapes):
        o_ndim = len(o.shape)  # (N, *O)
        fallback.append(
            [j.reshape(j.shape[:o_ndim] + (-1,)) for j in j_fb[k]] if analysis.fallback else []
        )
        per_use = []
        for use, gu in zip(analysis.uses, j_d[k], strict=True):
            # gu: (N, *O, *y); y = (x_free..., w_free...) or (w_free..., x_free...)
            a = math.prod(use.y_shape) // use.w_free_size
            lead = gu.shape[:o_ndim]
            if use.x_side == 0:
                gu = gu.reshape(lead + (a, use.w_free_size))
            else:
                gu = jnp.swapaxes(gu.reshape(lead + (use.w_free_size, a)), -1, -2)
            per_use.append(gu)
        g.append(per_use)
    x_mats = []
    biased_uses = analysis.biased or (False,) * len(analysis.uses)
    for use, xu, biased in zip(analysis.uses, xs, biased_uses, strict=True):
        # xu: (N, *x_shape) -> (N, A, C): free axes first, then contracting in order.
        perm = (0,) + tuple(1 + a for a in use.x_free) + tuple(1 + a for a in use.x_contract)
        xu = jnp.transpose(xu, perm)
        n_free = 1 + len(use.x_free)
        a = math.prod(xu.shape[1:n_free])
        xu = xu.reshape((xu.shape[0], a, -1))
        if biased:  # the fused bias: a constant input column
            xu = jnp.concatenate([xu, jnp.ones(xu.shape[:2] + (1,), xu.dtype)], axis=-1)
        x_mats.append(xu)
    return {"fallback": fallback, "x": x_mats, "g": g}


def _fresh_letters(used: str, n: int) -> list[str]:
    free = [c for c in string.ascii_letters if c not in used]
    return free[:n]


def contract(layouts, analysis_leaves, f1, f2, precision):
    """Per output leaf, the list of each parameter leaf's kernel (they sum to the NTK).

    ``analysis_leaves`` is ``(n_leaves, fallback leaf ids, groups of use indices, group
    leaf ids)``.
    """
    n_leaves, fallback, groups, group_leaves = analysis_leaves
    kernels = []
    for k, layout in enumerate(layouts):
        lhs, rhs, out = layout.specs(n_contracted=1)
        n1_shape = (f1["g"][k][0] if f1["g"][k] else f1["fallback"][k][0]).shape
        size = layout.trace_size(n1_shape)
        per_leaf = [None] * n_leaves
        for leaf, a, b in zip(fallback, f1["fallback"][k], f2["fallback"][k], strict=True):
            per_leaf[leaf] = jnp.einsum(f"{lhs},{rhs}->{out}", a, b, precision=precision) / size
        lo, ro, _ = layout.specs()
        ia, ib, c, kk = _fresh_letters(lo + ro + out, 4)
        spec = f"{lo[0]}{ia}{c},{ro[0]}{ib}{c},{lo}{ia}{kk},{ro}{ib}{kk}->{out}"
        for leaf, group in zip(group_leaves, groups, strict=True):
            total = None
            for u in group:
                for v in group:
                    term = jnp.einsum(
                        spec,
                        f1["x"][u],
                        f2["x"][v],
                        f1["g"][k][u],
                        f2["g"][k][v],
                        precision=precision,
                        optimize="optimal",
                    )
                    total = term if total is None else total + term
            per_leaf[leaf] = total / size
        kernels.append([term for term in per_leaf if term is not None])  # fused biases
    return kernels
