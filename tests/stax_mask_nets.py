"""Small masked networks (neural-tangents' ``mask_constant``) built with NT's own stax
calls, their inputs, and the recording of neural-tangents 0.6.5's kernels of them:

    /tmp/ntvenv/bin/python tests/stax_mask_nets.py     # writes tests/data/nt_stax_masks.npz

(``/tmp/ntvenv``: neural-tangents 0.6.5 on its old JAX, as benchmarks/ uses it)."""

import os

import numpy as np

REFERENCE = os.path.join(os.path.dirname(__file__), "data", "nt_stax_masks.npz")
MASK = -7.0  # the padding value (NaN for the "nan" network)


def networks(stax):
    """name -> ((init_fn, apply_fn, kernel_fn), per-sample shape, mask constant)."""
    return {
        # variable-length sequences: Conv1D stacks and a mean over the unmasked positions
        "conv1d_gap": (
            stax.serial(
                stax.Conv(8, (3,), padding="SAME", W_std=1.3, b_std=0.2),
                stax.Relu(),
                stax.Conv(8, (3,), padding="SAME", W_std=1.1, b_std=0.1),
                stax.Erf(),
                stax.GlobalAvgPool(),
                stax.Dense(1, W_std=1.2, b_std=0.3),
            ),
            (7, 2),
            MASK,
        ),
        # strides and VALID windows move the masks; AvgPool, then a Flatten readout
        "conv1d_stride_avgpool_flatten": (
            stax.serial(
                stax.Conv(8, (3,), strides=(2,), padding="VALID", b_std=0.1),
                stax.Relu(),
                stax.AvgPool((2,), strides=(1,), padding="SAME"),
                stax.Flatten(),
                stax.Dense(1, W_std=1.5, b_std=0.2),
            ),
            (9, 2),
            MASK,
        ),
        # 2-D: masked pixels through a SAME pool and a global sum
        "conv2d_sumpool": (
            stax.serial(
                stax.Conv(4, (2, 2), padding="SAME", W_std=1.2, b_std=0.3),
                stax.Gelu(),
                stax.SumPool((2, 2), strides=(1, 1), padding="SAME"),
                stax.GlobalSumPool(),
                stax.Dense(1),
            ),
            (4, 3, 2),
            MASK,
        ),
        # fully connected: masked feature entries are zero; a sample masked in full is 0
        "fc": (
            stax.serial(
                stax.Dense(8, W_std=1.4, b_std=0.2),
                stax.Relu(),
                stax.Dense(8, W_std=1.2, b_std=0.1),
                stax.Sin(),
                stax.Dense(1),
            ),
            (5,),
            MASK,
        ),
        # attention: masked keys get no weight (softmax over the unmasked ones)
        "attention_softmax": (
            stax.serial(
                stax.Dense(8, W_std=1.3, b_std=0.1),
                stax.GlobalSelfAttention(8, 4, 4, 2, W_key_std=1.4, W_out_std=1.2, b_std=0.2),
                stax.Relu(),
                stax.GlobalAvgPool(),
                stax.Dense(1),
            ),
            (6, 3),
            MASK,
        ),
        # relu weights, summed positional embeddings (0 at masked positions) in the values
        "attention_relu_pos_emb": (
            stax.serial(
                stax.Conv(8, (2,), padding="SAME", b_std=0.2),
                stax.GlobalSelfAttention(
                    8,
                    4,
                    4,
                    1,
                    W_key_std=0.9,
                    attention_mechanism="RELU",
                    pos_emb_type="SUM",
                    W_pos_emb_std=0.7,
                    val_pos_emb=True,
                    pos_emb_decay_fn=lambda d: 1 / (1 + d),
                ),
                stax.GlobalSumPool(),
                stax.Dense(1, b_std=0.1),
            ),
            (5, 2),
            MASK,
        ),
        # 1/sqrt(d) logits (identity mechanism), concatenated embeddings (0 at masked
        # positions: there the values' covariance is 0 too)
        "attention_identity_sqrt_concat": (
            stax.serial(
                stax.Dense(8, b_std=0.1),
                stax.GlobalSelfAttention(
                    8,
                    4,
                    4,
                    2,
                    linear_scaling=False,
                    attention_mechanism="IDENTITY",
                    pos_emb_type="CONCAT",
                    n_chan_pos_emb=4,
                    W_value_std=1.1,
                    val_pos_emb=True,
                ),
                stax.Erf(),
                stax.GlobalAvgPool(),
                stax.Dense(1),
            ),
            (5, 2),
            MASK,
        ),
        # LayerNorm over the channels, then over positions and channels (masked statistics)
        "layer_norm": (
            stax.serial(
                stax.Conv(8, (2,), padding="SAME", W_std=1.2, b_std=0.3),
                stax.LayerNorm(),
                stax.Relu(),
                stax.Conv(8, (3,), padding="SAME", b_std=0.1),
                stax.LayerNorm(axis=(1, -1), eps=0.1),
                stax.Erf(),
                stax.GlobalAvgPool(),
                stax.Dense(1),
            ),
            (7, 2),
            MASK,
        ),
        # branches that mask differently (window centres 1, 3, 5, 7 and 0, 2, 4, 6): a
        # position is masked where both are
        "branches_sum": (
            stax.serial(
                stax.FanOut(2),
                stax.parallel(
                    stax.Conv(8, (3,), strides=(2,), padding="SAME", b_std=0.1),
                    stax.Conv(8, (2,), strides=(2,), padding="VALID", W_std=1.3),
                ),
                stax.FanInSum(),
                stax.Relu(),
                stax.GlobalAvgPool(),
                stax.Dense(1),
            ),
            (8, 2),
            MASK,
        ),
        "branches_concat": (
            stax.serial(
                stax.FanOut(2),
                stax.parallel(
                    stax.Conv(8, (3,), strides=(2,), padding="SAME", b_std=0.1),
                    stax.serial(
                        stax.Conv(4, (2,), strides=(2,), padding="VALID", W_std=1.3),
                        stax.Relu(),
                    ),
                ),
                stax.FanInConcat(),
                stax.Dense(8, b_std=0.2),
                stax.Relu(),
                stax.GlobalAvgPool(),
                stax.Dense(1),
            ),
            (8, 2),
            MASK,
        ),
        # NaN as the mask constant
        "conv1d_gap_nan": (
            stax.serial(
                stax.Conv(8, (2,), padding="SAME", b_std=0.2),
                stax.Relu(),
                stax.GlobalAvgPool(),
                stax.Dense(1, b_std=0.1),
            ),
            (6, 3),
            float("nan"),
        ),
    }


def inputs(name, shape, constant):
    """(x1, x2): 4 and 3 samples, positions padded after each sample's length (spatial
    nets) or single masked entries and one sample masked in full (fc)."""
    rng = np.random.RandomState(sum(map(ord, name)))
    x1, x2 = rng.randn(4, *shape), rng.randn(3, *shape)
    if len(shape) == 1:
        x1[0, 1] = x1[2, 3] = x2[1, 0] = constant
        x1[3, :] = constant
        return x1, x2
    for x in (x1, x2):
        for i in range(len(x)):
            length = 2 + (i * 3) % (shape[0] - 1)
            x[i, length:] = constant
        x[0, 0, ..., 0] = constant  # one entry of one channel: zero, the position unmasked
    if len(shape) == 3:
        x1[1, :, 1:] = constant  # a masked column
    return x1, x2


if __name__ == "__main__":
    import jax

    jax.config.update("jax_enable_x64", True)
    from neural_tangents import stax as nt_stax

    out = {}
    for name, (net, shape, constant) in networks(nt_stax).items():
        x1, x2 = inputs(name, shape, constant)
        for tag, b in (("x1x1", None), ("x1x2", x2)):
            k = net[2](x1, b, ("nngp", "ntk"), mask_constant=constant)
            out[f"{name}/{tag}/nngp"] = np.asarray(k.nngp)
            out[f"{name}/{tag}/ntk"] = np.asarray(k.ntk)
    np.savez(REFERENCE, **out)
    print("wrote", REFERENCE, len(out))
