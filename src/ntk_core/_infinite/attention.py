"""Global self-attention at infinite width (Hron, Bahri, Sohl-Dickstein, Novak, "Infinite
attention: NNGP and NTK for deep attention networks", ICML 2020, arXiv 2006.10540), with
neural-tangents' ``GlobalSelfAttention`` arguments and numbers.

One head of the finite layer, on a sample's T positions x (T, C) (every spatial axis
flattened into one):

    f(x) = ψ(QK · Q(x)·K(x)ᵀ / (C·d^s)) · V(x),  concatenated over heads, · W_out + b

with Q, K, V the positions' queries, keys, values (x times N(0, 1) matrices), d the key
width, ψ the mechanism (softmax over the key positions, identity, |·|, relu).

``linear_scaling=True`` (s = 1, the key and query weights tied): the logits converge to
QK·Σ̃(x, x), each sample's own covariance over pairs of positions (Σ̃ with positional
embeddings, below), so the attention weights G(x) = ψ(QK·Σ̃(x, x)) are deterministic and

    Σ'(x1, x2) = OV²·G(x1)·Σv(x1, x2)·G(x2)ᵀ + σb²
    Θ'(x1, x2) = OV²·G(x1)·(Θv + 2·Σv)(x1, x2)·G(x2)ᵀ + σb²

(the 2·Σv: the value and output weights; the tied key weights' gradient vanishes).
``linear_scaling=False`` (s = 1/2, independent Q and K): the logits stay Gaussian, and
only the identity mechanism has a closed form, with ⟨A, B⟩ the sum over all pairs of
positions:

    Σ'(x1, x2) = (QK·OV)²·⟨Σ̃, Σv⟩·Σ̃ + σb²
    Θ'(x1, x2) = (QK·OV)²·((⟨Σ̃, Θv⟩ + ⟨Σv, Θ̃⟩)·Σ̃ + ⟨Σ̃, Σv⟩·(Θ̃ + 4·Σ̃)) + σb²

QK = W_key_std·W_query_std, OV = W_out_std·W_value_std. Positional embeddings E (one
draw shared by every sample, covariance R over pairs of positions: the identity, or
``pos_emb_decay_fn`` of the p-th power of the L_p distance) enter the keys and queries
as Σ̃ = a·Σ + c·R (SUM: a = 1, c = W_pos_emb_std²; CONCAT: a = C/(C + P), c =
W_pos_emb_std²·P/(C + P) for P embedding channels), and their NTK as Θ̃ = a·Θ + c·R;
the values see them only with ``val_pos_emb`` (Σv = Σ̃, Θv = Θ̃; else Σv = Σ, Θv = Θ).
"""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._errors import bad, check_bool, check_int, check_real
from ntk_core._infinite import masking
from ntk_core._infinite.layer import Layer, Rule, make_layer
from ntk_core._infinite.layers import _axes_default, _choice, _std
from ntk_core._infinite.state import Kern, _pairs, remask

MECHANISMS = ("SOFTMAX", "IDENTITY", "ABS", "RELU")
POS_EMB_TYPES = ("NONE", "SUM", "CONCAT")
FN = "stax.GlobalSelfAttention"


def _mechanism(name: str):
    """ψ on logits whose last axis runs over the key positions."""
    return {
        "SOFTMAX": lambda g: jax.nn.softmax(g, axis=-1),
        "IDENTITY": lambda g: g,
        "ABS": jnp.abs,
        "RELU": jax.nn.relu,
    }[name]


# ----- positions flattened: (..., H, H', W, W') <-> (..., T, T) -----


def _flat(a, n_batch: int, spatial: tuple[int, ...]):
    """A covariance with zipped spatial pairs as ``(*batch, T, T)``, T = prod(spatial)
    (x's positions first, in C order, then the other side's)."""
    s = len(spatial)
    order = tuple(range(n_batch)) + tuple(n_batch + 2 * d for d in range(s))
    order += tuple(n_batch + 2 * d + 1 for d in range(s))
    t = math.prod(spatial)
    return jnp.transpose(a, order).reshape(a.shape[:n_batch] + (t, t))


def _zipped(a, n_batch: int, spatial: tuple[int, ...]):
    """The inverse of :func:`_flat`."""
    s = len(spatial)
    a = a.reshape(a.shape[:n_batch] + spatial + spatial)
    order = tuple(range(n_batch))
    for d in range(s):
        order += (n_batch + d, n_batch + s + d)
    return jnp.transpose(a, order)


def position_covariance(spatial: tuple[int, ...], p_norm: float, decay_fn, dtype):
    """R (T, T): the positional embeddings' covariance over pairs of flattened positions;
    the identity without ``decay_fn``, else ``decay_fn(Σ_d |i_d − j_d|^p)``."""
    t = math.prod(spatial)
    if decay_fn is None:
        return jnp.eye(t, dtype=dtype)
    coords = np.indices(spatial).reshape(len(spatial), t).T.astype(np.float64)
    distance = (np.abs(coords[:, None, :] - coords[None, :, :]) ** p_norm).sum(-1)
    return jnp.asarray(decay_fn(jnp.asarray(distance, dtype)), dtype)


# ----- the kernel -----


def transform(k: Kern, args) -> Kern:
    """The layer's Kern from its input's (the full spatial covariance); the maths in the
    module docstring, on positions flattened to T x T and zipped back."""
    spatial = k.spatial
    flat = {
        "nngp": _flat(k.nngp, 2, spatial),
        "ntk": None if k.ntk is None else _flat(k.ntk, 2, spatial),
        "cov1": _flat(k.cov1, 1, spatial),
        "cov2": None if k.cov2 is None else _flat(k.cov2, 1, spatial),
    }
    keys = None  # masked key positions (N, T) of x1 and x2 (None: x1's)
    if k.masks is not None:
        t = math.prod(spatial)
        keys = k.masks.map(lambda m: m.reshape(m.shape[0], t))
    mixed = dict(flat)  # Σ̃, Θ̃: what the keys and queries see
    if args.pos_emb_type != "NONE":
        a, c = _weights(args, k.channels)
        r = position_covariance(spatial, args.pos_emb_p_norm, args.pos_emb_decay_fn, k.nngp.dtype)
        rs = dict.fromkeys(flat, r)
        if keys is not None:  # the embeddings are 0 at masked positions (neural-tangents)
            other = keys.m1 if keys.m2 is None else keys.m2
            zero = jnp.zeros((), r.dtype)
            pair = jnp.where(_pairs(keys.m1, other, False), zero, r)
            rs = {
                "nngp": pair,
                "ntk": pair,
                "cov1": jnp.where(_pairs(keys.m1, None, False), zero, r),
                "cov2": jnp.where(_pairs(other, None, False), zero, r),
            }
        mixed = {n: None if m is None else a * m + c * rs[n] for n, m in flat.items()}
    values = mixed if args.val_pos_emb else flat
    if args.linear_scaling:
        out = _linear(mixed, values, args, keys)
    else:
        out = _square_root(flat, mixed, values, args)
    if keys is not None:  # the output is masked where the input is (every channel)
        k = k.replace(masks=k.masks.map(lambda m: m))
    out = k.replace(
        nngp=_zipped(out["nngp"], 2, spatial),
        ntk=None if out["ntk"] is None else _zipped(out["ntk"], 2, spatial),
        cov1=_zipped(out["cov1"], 1, spatial),
        cov2=None if out["cov2"] is None else _zipped(out["cov2"], 1, spatial),
        gaussian=True,
        channels=args.n_chan_out,
        is_input=False,
    )
    return remask(out)


def _pos_channels(args, channels: int, where: str) -> int:
    """P, the embeddings' channels; SUM adds them to the input, so P must be C."""
    p = channels if args.n_chan_pos_emb is None else args.n_chan_pos_emb
    if args.pos_emb_type == "SUM" and p != channels:
        what = (
            f"pos_emb_type='SUM' adds the embeddings to the input's {channels} channels, "
            f"but n_chan_pos_emb={p} ({where})"
        )
        fix = "pass n_chan_pos_emb=None, or pos_emb_type='CONCAT'"
        raise bad(ValueError, FN, what, fix)
    return p


def _weights(args, channels: int) -> tuple[float, float]:
    """(a, c) of Σ̃ = a·Σ + c·R (see the module docstring)."""
    p = _pos_channels(args, channels, "in kernel_fn")
    c = args.W_pos_emb_std**2
    if args.pos_emb_type == "CONCAT":
        return channels / (channels + p), c * p / (channels + p)
    return 1.0, c


def _affine(a, w2: float, b_std):
    return w2 * a + (0.0 if b_std is None else b_std**2)


def _linear(mixed, values, args, keys=None):
    """linear_scaling=True: G(x) = ψ(QK·Σ̃(x, x)), then Σ' = OV²·G1·Σv·G2ᵀ + σb²; masked
    ``keys`` get no weight (their logits -1e20 before a softmax, else 0, as
    neural-tangents')."""
    psi = _mechanism(args.attention_mechanism)
    qk = args.W_key_std * args.W_query_std
    ov2 = (args.W_out_std * args.W_value_std) ** 2

    def weights(cov, masked):  # cov (N, T, T): the query position, then the key position
        if masked is not None:
            cov = jnp.where(masked[:, None, :], _masked_logit(args, cov.dtype), cov)
        return psi(qk * cov)

    g1 = weights(mixed["cov1"], None if keys is None else keys.m1)
    g2 = g1
    if mixed["cov2"] is not None:
        g2 = weights(mixed["cov2"], None if keys is None else keys.m2)

    def pair(m):
        return jnp.einsum("nha,nmab,mgb->nmhg", g1, m, g2, precision="highest")

    def own(g, m):
        return jnp.einsum("nha,nab,ngb->nhg", g, m, g, precision="highest")

    def readout(g, m):
        return None if m is None else _affine(own(g, m), ov2, args.b_std)

    weighed = pair(values["nngp"])
    ntk = None
    if values["ntk"] is not None:
        ntk = _affine(pair(values["ntk"]) + 2 * weighed, ov2, args.b_std)
    return {
        "nngp": _affine(weighed, ov2, args.b_std),
        "ntk": ntk,
        "cov1": readout(g1, values["cov1"]),
        "cov2": readout(g2, values["cov2"]),
    }


def _masked_logit(args, dtype):
    """A masked key's logit: -1e20 before a softmax (its weight 0; finite, so that a sample
    masked in full still has weights), 0 before the other mechanisms (ψ(0) = 0)."""
    return jnp.asarray(_NEG if args.attention_mechanism == "SOFTMAX" else 0.0, dtype)


_NEG = -1e20


def _square_root(flat, mixed, values, args):
    """linear_scaling=False with the identity mechanism (the only closed form)."""
    if args.attention_mechanism != "IDENTITY":
        what = (
            f"linear_scaling=False (1/√n_chan_key logits) has no closed-form kernel for "
            f"attention_mechanism={args.attention_mechanism!r}, only for 'IDENTITY'"
        )
        fix = "pass linear_scaling=True, or attention_mechanism='IDENTITY'"
        raise bad(ValueError, "kernel_fn", what, fix)
    w2 = (args.W_key_std * args.W_query_std * args.W_out_std * args.W_value_std) ** 2

    def inner(a, b):  # ⟨A, B⟩ over all pairs of positions, kept as (..., 1, 1)
        return jnp.sum(a * b, axis=(-2, -1), keepdims=True)

    out = {}
    for n in ("nngp", "cov1", "cov2"):
        m = mixed[n]
        out[n] = None if m is None else _affine(inner(m, values[n]) * m, w2, args.b_std)
    out["ntk"] = None
    if flat["ntk"] is not None:
        s, t = mixed["nngp"], mixed["ntk"]
        through_inputs = inner(s, values["ntk"]) + inner(values["nngp"], t)
        out["ntk"] = _affine(
            through_inputs * s + inner(s, values["nngp"]) * (t + 4 * s), w2, args.b_std
        )
    return out


# ----- the layer -----


def GlobalSelfAttention(
    n_chan_out,
    n_chan_key,
    n_chan_val,
    n_heads,
    linear_scaling=True,
    W_key_std=1.0,
    W_value_std=1.0,
    W_query_std=1.0,
    W_out_std=1.0,
    b_std=None,
    attention_mechanism="SOFTMAX",
    pos_emb_type="NONE",
    pos_emb_p_norm=2,
    pos_emb_decay_fn=None,
    n_chan_pos_emb=None,
    W_pos_emb_std=1.0,
    val_pos_emb=False,
    batch_axis=0,
    channel_axis=-1,
) -> Layer:
    """Global scaled dot-product self-attention over all positions of (N, *S, C) inputs
    (neural-tangents' arguments; the maths: :mod:`ntk_core._infinite.attention`).

    Args:
      n_chan_out, n_chan_key, n_chan_val, n_heads: the finite layer's output, key/query
        and value widths per head, and its number of heads (kernel_fn: all infinite).
      linear_scaling: True: logits scaled by 1/n_chan_key with the key and query weights
        tied (a closed form for every mechanism); False: 1/√n_chan_key, independent
        weights (kernel_fn only with ``attention_mechanism="IDENTITY"``).
      W_key_std, W_query_std: enter through their product; W_value_std, W_out_std the
        same; b_std: the output bias (None: no bias).
      attention_mechanism: "SOFTMAX" (over the key positions), "IDENTITY", "ABS", "RELU".
      pos_emb_type: "NONE", "SUM" (added to the input; n_chan_pos_emb None) or "CONCAT"
        (n_chan_pos_emb channels appended, None: the input's C); the embeddings are
        N(0, W_pos_emb_std²) parameters shared by every sample, with covariance over
        positions the identity or ``pos_emb_decay_fn(Σ_d |i_d − j_d|^pos_emb_p_norm)``
        (a positive definite result: the finite layer draws them by its Cholesky factor).
      val_pos_emb: the values see the embeddings too (else only keys and queries).
      batch_axis, channel_axis: 0 and -1 only.

    Returns:
      ``(init_fn, apply_fn, kernel_fn)``; the output has shape (N, *S, n_chan_out); the
      kernels keep every pair of positions, (N1, N2, H, H, W, W, ...), float64 with x64.

    Raises:
      ValueError / TypeError for bad arguments here, and from kernel_fn for
      ``linear_scaling=False`` with a mechanism other than IDENTITY (no closed form) and
      for SUM embeddings of n_chan_pos_emb other than the input's channels. With
      neural-tangents' ``mask_constant`` (kernel_fn and apply_fn) masked keys get no
      weight and the positional embeddings are 0 at masked positions.

    Cost: per pair of inputs O(T³) for T = prod(S) positions (two T x T products), O(T²)
    memory; the layer needs the full spatial covariance of its input.
    """
    _axes_default(FN, batch_axis, channel_axis)
    args = types.SimpleNamespace(
        n_chan_out=check_int(FN, "n_chan_out", n_chan_out, "pass e.g. n_chan_out=64"),
        n_chan_key=check_int(FN, "n_chan_key", n_chan_key, "pass e.g. n_chan_key=64"),
        n_chan_val=check_int(FN, "n_chan_val", n_chan_val, "pass e.g. n_chan_val=64"),
        n_heads=check_int(FN, "n_heads", n_heads, "pass e.g. n_heads=4"),
        linear_scaling=check_bool(FN, "linear_scaling", linear_scaling),
        W_key_std=_std(FN, "W_key_std", W_key_std),
        W_value_std=_std(FN, "W_value_std", W_value_std),
        W_query_std=_std(FN, "W_query_std", W_query_std),
        W_out_std=_std(FN, "W_out_std", W_out_std),
        b_std=_std(FN, "b_std", b_std, optional=True),
        attention_mechanism=_choice(FN, "attention_mechanism", attention_mechanism, MECHANISMS),
        pos_emb_type=_choice(FN, "pos_emb_type", pos_emb_type, POS_EMB_TYPES),
        pos_emb_p_norm=check_real(
            FN, "pos_emb_p_norm", pos_emb_p_norm, "pass e.g. pos_emb_p_norm=2", open_low=True
        ),
        pos_emb_decay_fn=pos_emb_decay_fn,
        n_chan_pos_emb=check_int(
            FN, "n_chan_pos_emb", n_chan_pos_emb, "pass e.g. n_chan_pos_emb=None", optional=True
        ),
        W_pos_emb_std=_std(FN, "W_pos_emb_std", W_pos_emb_std),
        val_pos_emb=check_bool(FN, "val_pos_emb", val_pos_emb),
    )
    if pos_emb_decay_fn is not None and not callable(pos_emb_decay_fn):
        what = f"pos_emb_decay_fn must be None or callable, got {type(pos_emb_decay_fn).__name__}"
        raise bad(TypeError, FN, what, "pass e.g. pos_emb_decay_fn=lambda d: jnp.exp(-d)")
    init_fn, apply_fn = _finite(args)
    decay = getattr(pos_emb_decay_fn, "__name__", repr(pos_emb_decay_fn))
    name = (
        f"GlobalSelfAttention({args.n_chan_out}, {args.n_chan_key}, {args.n_chan_val}, "
        f"{args.n_heads}, {args.attention_mechanism}, linear_scaling={args.linear_scaling}, "
        f"QK={args.W_key_std * args.W_query_std:g}, OV={args.W_out_std * args.W_value_std:g}, "
        f"b_std={args.b_std}, pos_emb={args.pos_emb_type}({args.pos_emb_p_norm:g}, {decay}, "
        f"{args.n_chan_pos_emb}, {args.W_pos_emb_std:g}, values={args.val_pos_emb}))"
    )
    # positions mix: the input must hold every pair of positions
    rule = Rule(name, lambda k: transform(k, args), lambda full: True)
    return make_layer(rule, init_fn, apply_fn, masking.channels_all)


def _finite(args):
    """(init_fn, apply_fn) of the finite layer (NTK parameterisation: N(0, 1) weights)."""
    has_pe = args.pos_emb_type != "NONE"

    def init_fn(key, input_shape):
        c = input_shape[-1]
        kq, kk, kv, ko, kb, kp = jax.random.split(key, 6)
        keys_in = values_in = c
        pos_emb = None
        if has_pe:
            p = _pos_channels(args, c, "in init_fn")
            pos_emb = jax.random.normal(kp, (1, *input_shape[1:-1], p))
            if args.pos_emb_type == "CONCAT":
                keys_in += p
                values_in += p if args.val_pos_emb else 0
        h, d = args.n_heads, args.n_chan_key
        query = None if args.linear_scaling else jax.random.normal(kq, (h, keys_in, d))
        keys = jax.random.normal(kk, (h, keys_in, d))
        values = jax.random.normal(kv, (h, values_in, args.n_chan_val))
        w_out = jax.random.normal(ko, (h * args.n_chan_val, args.n_chan_out))
        b = None if args.b_std is None else jax.random.normal(kb, (args.n_chan_out,))
        out_shape = tuple(input_shape[:-1]) + (args.n_chan_out,)
        return out_shape, (query, keys, values, w_out, b, pos_emb)

    def embedded(x, pos_emb, masked):
        """(keys' and queries' input, values' input), each (N, T, channels); ``masked``
        (N, T) or None: positions whose embeddings are 0 (neural-tangents')."""
        n, spatial = x.shape[0], x.shape[1:-1]
        t = math.prod(spatial)
        if not has_pe:
            flat = x.reshape(n, t, -1)
            return flat, flat
        e = pos_emb.reshape(t, -1)
        if args.pos_emb_decay_fn is not None:  # correlated over positions: E = L·Z, LLᵀ = R
            r = position_covariance(spatial, args.pos_emb_p_norm, args.pos_emb_decay_fn, e.dtype)
            e = jnp.matmul(jnp.linalg.cholesky(r), e, precision="highest")
        e = jnp.broadcast_to(args.W_pos_emb_std * e, (n, t, e.shape[-1])).astype(x.dtype)
        if masked is not None:
            e = jnp.where(masked[..., None], jnp.zeros((), e.dtype), e)
        flat = x.reshape(n, t, -1)
        mixed = flat + e if args.pos_emb_type == "SUM" else jnp.concatenate([flat, e], -1)
        return mixed, mixed if args.val_pos_emb else flat

    def apply_fn(params, x, mask=None, **kwargs):
        query, keys_w, values_w, w_out, b, pos_emb = params
        masked = None  # positions masked in every channel, (N, T)
        if mask is not None:
            masked = masking.channels_all(mask, x).reshape(x.shape[0], -1)
        xk, xv = embedded(x, pos_emb, masked)
        keys = jnp.einsum("ntc,hcd->hntd", xk, keys_w, precision="highest")
        queries = (
            keys
            if args.linear_scaling
            else jnp.einsum("ntc,hcd->hntd", xk, query, precision="highest")
        )
        scale = args.W_key_std * args.W_query_std / xk.shape[-1]
        scale /= args.n_chan_key if args.linear_scaling else math.sqrt(args.n_chan_key)
        logits = scale * jnp.einsum("hnad,hnbd->hnab", queries, keys, precision="highest")
        if masked is not None:  # the keys at masked positions get no weight
            logits = jnp.where(masked[None, :, None, :], _masked_logit(args, logits.dtype), logits)
        weights = _mechanism(args.attention_mechanism)(logits)
        values = jnp.einsum("ntc,hcv->hntv", xv, values_w, precision="highest")
        heads = jnp.einsum("hnab,hnbv->nahv", weights, values, precision="highest")
        heads = heads.reshape(heads.shape[:2] + (-1,))
        out = jnp.matmul(heads, w_out, precision="highest")
        out = out * (args.W_out_std * args.W_value_std / math.sqrt(heads.shape[-1] * xv.shape[-1]))
        out = out.reshape(x.shape[:-1] + (args.n_chan_out,))
        return out if b is None else out + args.b_std * b

    return init_fn, apply_fn
