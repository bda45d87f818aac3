"""Embedding lookups ``y = view(W)[tokens]`` of a ``(V, D)`` table (clip, fill or
promise-in-bounds mode): ``x[a, v] = [t_a = v]``, so ∂f_o/∂W[v, d] = Σ_a [t_a = v] g_o[a, d]
and the Gram factor is the token match [t1_a = t2_b]. Out-of-range tokens are clamped
(clip) or dropped, as the lookup's transpose does."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import primitives as prims

from ntk_core._structured.rules._base import Rule, Use, broadcast_reason, broadcasts, scaled

_MODE = lax.GatherScatterMode
CLIP = _MODE.CLIP
GATHER_MODES = frozenset({CLIP, _MODE.FILL_OR_DROP, _MODE.PROMISE_IN_BOUNDS})


@dataclasses.dataclass(frozen=True)
class Lookup:
    mode: lax.GatherScatterMode  # one of GATHER_MODES


class GatherRule(Rule):
    """``gather`` of table rows: tokens ``(N, A)``; the Gram factor is a token match."""

    primitives = frozenset({prims.gather_p})
    kind_names = {"gather": "embedding gather"}

    def match(self, eqn, ins, here, leaf_shapes):
        if ins[0] is None or ins[1] is not None:
            return None  # a parameter table looked up with non-parameter indices
        chain, factor = scaled(ins[0].chain)
        table, idx_shape, y_shape = (tuple(v.aval.shape) for v in (*eqn.invars, *eqn.outvars))
        mode = _row_lookup(table, idx_shape, y_shape, **eqn.params)
        if broadcasts(chain) or mode is None:
            return None
        sizes = (math.prod(idx_shape[:-1]), table[1], table[0])
        key, y_perm = (chain, table), tuple(range(len(y_shape)))
        y, info = eqn.outvars[0], Lookup(mode)
        return self.use(here, ins[0].leaf, 1, key, y, y_perm, sizes, info, factor)

    def miss_reason(self, eqn, ins):
        other = "a gather other than a row lookup table[tokens] with integer tokens"
        return broadcast_reason(eqn, ins) or other

    def input_features(self, use, x, bias_column):
        """The tokens ``(N, A)``."""
        return x.reshape((x.shape[0], use.a_size))

    def jacobian(self, use, xj, g, biased):
        """``J[v, d] = Σ_a [t_a = v] g[a, d]``: ``(N, *O, V, D)``."""
        vocab = use.x_contract_size
        tokens = jnp.clip(xj, 0, vocab - 1) if use.info.mode is CLIP else xj
        hot = jax.nn.one_hot(tokens, vocab, dtype=g.dtype)  # out of range: all zero
        return jnp.einsum("nav,n...ad->n...vd", hot, g)

    def sketch_input(self, use, x, hashes, signs, k):
        """A one-hot token's CountSketch: s(t) at bucket h(t), zero for a dropped token."""
        vocab = use.x_contract_size
        t = jnp.clip(x, 0, vocab - 1) if use.info.mode is CLIP else x
        valid = (t >= 0) & (t < vocab)
        t = jnp.where(valid, t, 0)
        sign = jnp.where(valid, signs[t], 0).astype(use.y_dtype)
        return jax.nn.one_hot(hashes[t], k, dtype=use.y_dtype) * sign[..., None]

    def gram_input_width(self, c):
        return 1

    def input_values(self, c):
        return 1

    def gram_term(self, u, v, x1, x2, g1, g2, s, precision, plus_one):
        """Σ_ab [t1_a = t2_b] (g1_a·g2_b)."""
        diagonal = s.left[0] == s.right[0]
        match = token_match(u, x1, x2, diagonal)
        n1, n2 = s.left[0], s.right[0]
        m_spec = f"{n1}{s.a}{s.b}" if diagonal else f"{n1}{s.a}{n2}{s.b}"
        spec = f"{m_spec},{s.left}{s.a}{s.k},{s.right}{s.b}{s.k}->{s.out}"
        return jnp.einsum(spec, match, g1, g2, precision=precision, optimize="optimal")

    def label(self, uses):
        return uses[0].name if len(uses) == 1 else super().label(uses)


def _row_lookup(table, idx_shape, y_shape, *, dimension_numbers, slice_sizes, mode, **_):
    """The mode of a gather of rows ``table[tokens]`` with integer tokens, else None."""
    dn, mode = dimension_numbers, _MODE.from_any(mode)
    ok = (
        len(table) == 2
        and tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,)
        and tuple(dn.operand_batching_dims) == ()
        and tuple(dn.offset_dims) == (len(y_shape) - 1,)
        and tuple(slice_sizes) == (1, table[1])
        and idx_shape[-1:] == (1,)
        and y_shape == idx_shape[:-1] + (table[1],)
    )
    return mode if ok and mode in GATHER_MODES else None


def token_match(use: Use, t1, t2, batch_diagonal: bool):
    """``[t1_a = t2_b]`` as floats: ``(N1, A, N2, B)``, or ``(N, A, B)`` on the diagonal."""
    vocab = use.x_contract_size
    mode = use.info.mode

    def norm(t):
        if mode is CLIP:
            return jnp.clip(t, 0, vocab - 1)
        return jnp.where((t >= 0) & (t < vocab), t, -1)

    t1, t2 = norm(t1), norm(t2)
    if batch_diagonal:
        eq = t1[:, :, None] == t2[:, None, :]
        valid = (t1 >= 0)[:, :, None]
    else:
        eq = t1[:, :, None, None] == t2[None, None, :, :]
        valid = (t1 >= 0)[:, :, None, None]
    return (eq & valid).astype(use.y_dtype)


GATHER = GatherRule()
