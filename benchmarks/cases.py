"""The benchmark cases, in plain JAX (``jax.numpy`` and ``jax.lax`` only).

Imported by both sides of the comparison: ``bench_core.py`` (this project, current JAX,
Flax models) and ``bench_neural_tangents.py`` (neural-tangents 0.6.5 in its own
environment: jax 0.4.23, no Flax). So this module imports neither Flax nor ``ntk_core``
and uses only APIs that exist in both JAX versions.

Each model is written as a plain ``apply(variables, x)`` over Flax's parameter layout
(``{"params": {"Conv_0": {"kernel", "bias"}, ...}, "batch_stats": ...}``), the twin of
the Flax module ``bench_core.py`` times; ``bench_core.py`` checks that both give the
same outputs before it measures anything. Parameters and inputs travel between the
two environments in one ``.npz`` file per case (:func:`save_case`, :func:`load_case`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case: a model, its inputs and the kernel's axes."""

    key: str
    title: str
    model: str  # "mlp", "lenet", "resnet", "resnet18", "tokens", "vit" or "bert"
    n: int  # default number of samples N (the Gram matrix is N x N)
    trace_axes: tuple
    widths: tuple = ()  # MLP layer widths, input first


CASES = {
    c.key: c
    for c in [
        Case("mlp1", "MLP 784-1000-1, trace_axes=()", "mlp", 1000, (), (784, 1000, 1)),
        Case("lenet", "LeNet (C1), trace_axes=()", "lenet", 500, ()),
        Case("mlp10", "MLP 784-512-512-10", "mlp", 1000, (-1,), (784, 512, 512, 10)),
        Case(
            "mlp10-full", "MLP 784-512-512-10, trace_axes=()", "mlp", 1000, (), (784, 512, 512, 10)
        ),
        Case("resnet", "ResNet-style CNN, BatchNorm (eval), 10 logits", "resnet", 256, (-1,)),
        Case("tokens", "token transformer (test zoo)", "tokens", 256, (-1,)),
        Case("mlp-small", "MLP 784-192-10 (P = 153 k)", "mlp", 32, (-1,), (784, 192, 10)),
        Case(
            "resnet18", "ResNet-18, BatchNorm (eval), 10 logits, trace_axes=()", "resnet18", 16, ()
        ),
        Case("vit", "ViT (4x4 patches, 4 pre-LN blocks, width 128), trace_axes=()", "vit", 64, ()),
        Case("bert", "BERT-tiny (2 layers, width 128, masked), trace_axes=()", "bert", 64, ()),
    ]
}

# -- the models --------------------------------------------------------------------------


def _dense(p, x):
    return jnp.dot(x, p["kernel"], precision=HIGHEST) + p["bias"]


def _conv(p, x, strides=(1, 1)):
    y = jax.lax.conv_general_dilated(
        x,
        p["kernel"],
        strides,
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=HIGHEST,
    )
    return y + p["bias"] if "bias" in p else y


def mlp(variables, x):
    """Dense → ReLU → ... → Dense (layers ``Dense_0``, ``Dense_1``, ...)."""
    p = variables["params"]
    n_layers = len(p)
    for i in range(n_layers):
        x = _dense(p[f"Dense_{i}"], x)
        if i < n_layers - 1:
            x = jax.nn.relu(x)
    return x


def _avg_pool(x):
    return jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4


def lenet(variables, x):
    """Twin of ``ntk_flax.LeNet`` (case C1)."""
    p = variables["params"]
    for name in ("Conv_0", "Conv_1"):
        x = _avg_pool(jax.nn.relu(_conv(p[name], x)))
    x = x.reshape((x.shape[0], -1))
    for name in ("Dense_0", "Dense_1"):
        x = jax.nn.relu(_dense(p[name], x))
    return _dense(p["Dense_2"], x)


#: ResNet-style CNN: (features, stride) of each residual block after a 16-channel stem.
RESNET_BLOCKS = ((16, 1), (32, 2), (64, 2))
BN_EPS = 1e-5


def _batch_norm(p, stats, x):
    """BatchNorm in eval mode, computed as Flax does: (x - mean)·rsqrt(var + eps)·scale + bias."""
    mul = jax.lax.rsqrt(stats["var"] + BN_EPS) * p["scale"]
    return (x - stats["mean"]) * mul + p["bias"]


#: ResNet-18 as ``hk.nets.ResNet18`` lays it out (issue 28's model): a 7x7/2 stem of 64
#: channels, 3x3/2 max pool, four stages of two blocks; 11.2 M parameters with 10 logits.
RESNET18_BLOCKS = tuple(
    (f, s) for f, first in ((64, 1), (128, 2), (256, 2), (512, 2)) for s in (first, 1)
)


def _max_pool(x):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")


def resnet(variables, x, blocks=RESNET_BLOCKS, stem=16, deep_stem=False):
    """Twin of ``bench_core.ResNet``: stem Conv-BN-ReLU (ResNet-18: 7x7/2 and a 3x3/2 max
    pool), residual blocks (Conv3x3-BN-ReLU-Conv3x3-BN, plus the input, through a 1x1
    Conv-BN projection when the shape changes, then ReLU), global average pool, Dense 10."""
    p, s = variables["params"], variables["batch_stats"]
    x = _conv(p["Conv_0"], x, (2, 2) if deep_stem else (1, 1))
    x = jax.nn.relu(_batch_norm(p["BatchNorm_0"], s["BatchNorm_0"], x))
    x = _max_pool(x) if deep_stem else x
    channels = stem
    for i, (features, stride) in enumerate(blocks):
        name = f"ResBlock_{i}"
        bp, bs = p[name], s[name]
        y = _conv(bp["Conv_0"], x, (stride, stride))
        y = jax.nn.relu(_batch_norm(bp["BatchNorm_0"], bs["BatchNorm_0"], y))
        y = _batch_norm(bp["BatchNorm_1"], bs["BatchNorm_1"], _conv(bp["Conv_1"], y))
        if stride != 1 or features != channels:
            x = _conv(bp["Conv_2"], x, (stride, stride))
            x = _batch_norm(bp["BatchNorm_2"], bs["BatchNorm_2"], x)
        x = jax.nn.relu(x + y)
        channels = features
    x = jnp.mean(x, axis=(1, 2))
    return _dense(p["Dense_0"], x)


TOKEN_VOCAB, TOKEN_LENGTH = 11, 5


def tokens(variables, t):
    """Twin of the test zoo's ``TokenModel``: Embed(11, 8) → one 2-head self-attention
    block with a residual connection → LayerNorm → GELU (tanh form) → Dense 3 per
    token; integer tokens ``(N, 5)`` → logits ``(N, 5, 3)``."""
    p = variables["params"]
    h = jnp.take(p["Embed_0"]["embedding"], t, axis=0)
    h = _layer_norm(p["LayerNorm_0"], h + _attention(p["MultiHeadDotProductAttention_0"], h))
    return _dense(p["Dense_0"], jax.nn.gelu(h, approximate=True))


VIT_PATCH, VIT_WIDTH, VIT_HEADS, VIT_HIDDEN, VIT_BLOCKS = 4, 128, 4, 512, 4


def _layer_norm(p, h):
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(var + 1e-6) * p["scale"] + p["bias"]


def _attention(p, h):
    """``nn.MultiHeadDotProductAttention`` of Flax: DenseGeneral projections to (heads,
    head dim), scaled dot products, softmax, DenseGeneral back to the width."""

    def proj(name):
        return (
            jnp.einsum("...d,dhk->...hk", h, p[name]["kernel"], precision=HIGHEST) + p[name]["bias"]
        )

    q, k, v = proj("query"), proj("key"), proj("value")
    q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    weights = jax.nn.softmax(jnp.einsum("...qhd,...khd->...hqk", q, k, precision=HIGHEST))
    o = jnp.einsum("...hqk,...khd->...qhd", weights, v, precision=HIGHEST)
    return (
        jnp.einsum("...hd,hdo->...o", o, p["out"]["kernel"], precision=HIGHEST) + p["out"]["bias"]
    )


def vit(variables, x):
    """Twin of ``bench_core.ViT``: 4x4 patches of (N, 32, 32, 3) embedded by a stride-4
    convolution, learned positions, ``VIT_BLOCKS`` pre-LayerNorm blocks (attention,
    GELU MLP), LayerNorm, mean over the patches, Dense 10."""
    p = variables["params"]
    h = _conv(p["embed"], x, strides=(VIT_PATCH, VIT_PATCH))
    h = h.reshape(h.shape[0], -1, h.shape[-1]) + p["positions"]
    for b in range(VIT_BLOCKS):
        blk = p[f"Block_{b}"]
        h = h + _attention(
            blk["MultiHeadDotProductAttention_0"], _layer_norm(blk["LayerNorm_0"], h)
        )
        z = _dense(blk["Dense_0"], _layer_norm(blk["LayerNorm_1"], h))
        h = h + _dense(blk["Dense_1"], jax.nn.gelu(z, approximate=True))
    return _dense(p["head"], jnp.mean(_layer_norm(p["norm"], h), axis=1))


#: BERT-tiny's shape (Turc et al. 2019: L=2, H=128, A=2, I=512, BERT's 30 522 word pieces),
#: sequences of BERT_LENGTH tokens, id 0 the padding, 2 logits from the pooled [CLS] token.
BERT_VOCAB, BERT_LENGTH, BERT_CLS = 30522, 32, 101
BERT_WIDTH, BERT_HEADS, BERT_HIDDEN, BERT_LAYERS = 128, 2, 512, 2


def _masked_attention(p, h, mask):
    """:func:`_attention` with Flax's key padding mask: masked logits set to the dtype's
    minimum before the softmax (``nn.dot_product_attention_weights``)."""

    def proj(name):
        return (
            jnp.einsum("...d,dhk->...hk", h, p[name]["kernel"], precision=HIGHEST) + p[name]["bias"]
        )

    q, k, v = proj("query"), proj("key"), proj("value")
    q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k, precision=HIGHEST)
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    o = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits), v, precision=HIGHEST)
    return (
        jnp.einsum("...hd,hdo->...o", o, p["out"]["kernel"], precision=HIGHEST) + p["out"]["bias"]
    )


def bert(variables, t):
    """Twin of ``bench_core.Bert``: word-piece and learned position embeddings, LayerNorm,
    ``BERT_LAYERS`` post-LayerNorm blocks (attention over the non-padding tokens, exact-GELU
    MLP), the tanh pooler on [CLS], Dense 2; integer tokens ``(N, BERT_LENGTH)``."""
    p = variables["params"]
    h = jnp.take(p["words"]["embedding"], t, axis=0) + p["positions"]
    h = _layer_norm(p["LayerNorm_0"], h)
    mask = (t != 0)[:, None, None, :]  # (N, heads, queries, keys)
    for b in range(BERT_LAYERS):
        blk = p[f"BertBlock_{b}"]
        a = _masked_attention(blk["MultiHeadDotProductAttention_0"], h, mask)
        h = _layer_norm(blk["LayerNorm_0"], h + a)
        z = jax.nn.gelu(_dense(blk["Dense_0"], h), approximate=False)
        h = _layer_norm(blk["LayerNorm_1"], h + _dense(blk["Dense_1"], z))
    pooled = jnp.tanh(_dense(p["pooler"], h[:, 0]))
    return _dense(p["classifier"], pooled)


def resnet18(variables, x):
    """Twin of ``bench_core.ResNet18``."""
    return resnet(variables, x, RESNET18_BLOCKS, 64, deep_stem=True)


MODELS = {
    "mlp": mlp,
    "lenet": lenet,
    "resnet": resnet,
    "resnet18": resnet18,
    "tokens": tokens,
    "vit": vit,
    "bert": bert,
}


def plain_apply(case: Case):
    """``apply(params, x)`` of the plain-JAX twin, other collections closed over later."""
    return MODELS[case.model]


# -- inputs and parameters through .npz ----------------------------------------------------


def make_inputs(case: Case, n: int, seed: int = 1) -> np.ndarray:
    """Inputs of the case: N(0, 1) images/vectors, or uniform integer tokens."""
    rng = np.random.default_rng(seed)
    if case.model == "mlp":
        return rng.standard_normal((n, case.widths[0]), dtype=np.float32)
    if case.model in ("lenet", "resnet", "resnet18", "vit"):
        return rng.standard_normal((n, 32, 32, 3), dtype=np.float32)
    if case.model == "bert":  # [CLS], word pieces, padding (id 0) after 8..32 tokens
        t = rng.integers(1000, BERT_VOCAB, (n, BERT_LENGTH))
        t[:, 0] = BERT_CLS
        t[np.arange(BERT_LENGTH)[None, :] >= rng.integers(8, BERT_LENGTH + 1, (n, 1))] = 0
        return t.astype(np.int32)
    return rng.integers(0, TOKEN_VOCAB, (n, TOKEN_LENGTH)).astype(np.int32)


def _flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def _unflatten(flat):
    tree = {}
    for path, v in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = jnp.asarray(v)
    return tree


def case_paths(data_dir: str, key: str, n: int):
    stem = os.path.join(data_dir, f"{key}-N{n}")
    return stem + ".npz", stem + ".json"


def save_case(data_dir: str, case: Case, n: int, variables, x, meta: dict) -> None:
    """Writes the case's variables and inputs (``.npz``) and its metadata (``.json``:
    cost estimates used to skip measurements, twin check)."""
    os.makedirs(data_dir, exist_ok=True)
    npz, meta_path = case_paths(data_dir, case.key, n)
    flat = {f"var/{k}": v for k, v in _flatten(variables).items()}
    np.savez(npz, x=np.asarray(x), **flat)
    with open(meta_path, "w") as fh:
        json.dump(meta, fh, indent=1)


def load_case(data_dir: str, case: Case, n: int):
    """(variables, x, meta) written by :func:`save_case`."""
    npz, meta_path = case_paths(data_dir, case.key, n)
    data = np.load(npz)
    variables = _unflatten({k[4:]: data[k] for k in data.files if k.startswith("var/")})
    with open(meta_path) as fh:
        meta = json.load(fh)
    return variables, jnp.asarray(data["x"]), meta


def split_variables(variables):
    """(params, apply_with_rest): the ``params`` collection is differentiated, the
    others (BatchNorm running statistics) are closed over."""
    rest = {k: v for k, v in variables.items() if k != "params"}
    return variables["params"], rest


def n_params(params) -> int:
    return sum(math.prod(np.shape(v)) for v in jax.tree_util.tree_leaves(params))
