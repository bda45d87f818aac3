"""Networks written with neural-tangents' stax names only, so that the same function
builds them with ``neural_tangents.stax`` (to record its reference kernels:
``benchmarks/compare_neural_tangents_stax.py``) and with ``ntk_core.stax`` (the tests).

``networks(stax, jnp)`` -> {name: (layer, input shape per sample)}; float64 inputs are
drawn by :func:`inputs` from the name, the same in both environments.
"""

import numpy as np

REFERENCE = __import__("os").path.join(
    __import__("os").path.dirname(__file__), "data", "nt_stax_reference.npz"
)


def networks(stax, jnp):
    d = stax.Dense
    nets = {}

    def head(act, *, std=False):
        p = "standard" if std else "ntk"
        return stax.serial(
            d(4, W_std=1.3, b_std=0.2, parameterization=p),
            act,
            d(3, W_std=0.9, b_std=0.1, parameterization=p),
        )

    activations = {
        "relu": stax.Relu(),
        "abrelu": stax.ABRelu(-0.3, 1.2),
        "leaky": stax.LeakyRelu(0.1),
        "abs": stax.Abs(),
        "erf": stax.Erf(),
        "erf_abc": stax.Erf(1.5, 0.7, 0.2),
        "sigmoid_like": stax.Sigmoid_like(),
        "gelu": stax.Gelu(),
        "sin": stax.Sin(1.2, 0.8, 0.3),
        "cos": stax.Cos(0.9, 1.1, -0.2),
        "rbf": stax.Rbf(0.5),
        "sign": stax.Sign(),
        "exp": stax.Exp(0.5, 0.3),
        "tanh_numerical": stax.ElementwiseNumerical(jnp.tanh, 25),
        "square_elementwise": stax.Elementwise(
            lambda x: x**2, lambda c, v1, v2: v1 * v2 + 2 * c**2
        ),
    }
    for name, act in activations.items():
        nets[f"fc_{name}"] = (head(act), (6,))
    nets["fc_relu_standard"] = (head(stax.Relu(), std=True), (6,))
    nets["fc_erf_standard_nobias"] = (
        stax.serial(
            d(5, parameterization="standard"),
            stax.Erf(),
            d(2, W_std=1.2, parameterization="standard"),
        ),
        (6,),
    )
    nets["c3_erf_13"] = (
        stax.serial(*[d(511, W_std=1.5, b_std=0.05), stax.Erf()] * 13, d(1, W_std=1.5, b_std=0.05)),
        (1,),
    )
    nets["relu_20_wstd2"] = (
        stax.serial(*[d(64, W_std=2.0, b_std=0.1), stax.Relu()] * 20, d(1)),
        (5,),
    )
    nets["repeat"] = (
        stax.serial(
            d(4, W_std=1.2), stax.repeat(stax.serial(stax.Relu(), d(4, W_std=1.4, b_std=0.3)), 3)
        ),
        (5,),
    )
    nets["concat_standard"] = (
        stax.serial(
            d(3, parameterization="standard"),
            stax.FanOut(2),
            stax.parallel(
                stax.serial(stax.Relu(), d(3, parameterization="standard")),
                stax.serial(stax.Erf(), d(5, b_std=0.2, parameterization="standard")),
            ),
            stax.FanInConcat(),
            d(3, b_std=0.1, parameterization="standard"),
            stax.Relu(),
            d(2, parameterization="standard"),
        ),
        (4,),
    )
    nets["residual_fc"] = (
        stax.serial(
            d(4, b_std=0.1),
            stax.FanOut(2),
            stax.parallel(stax.Identity(), stax.serial(stax.Relu(), d(4))),
            stax.FanInSum(),
            stax.Gelu(),
            d(1),
        ),
        (5,),
    )
    nets["layernorm_fc"] = (
        stax.serial(d(4, W_std=1.5, b_std=0.5), stax.LayerNorm(), stax.Relu(), d(2)),
        (5,),
    )
    nets["dropout_fc"] = (
        stax.serial(d(4, b_std=0.2), stax.Relu(), d(4), stax.Dropout(0.8), d(1)),
        (5,),
    )
    conv = stax.Conv
    nets["cnn_flatten"] = (
        stax.serial(
            conv(4, (3, 3), padding="SAME", W_std=1.2, b_std=0.1),
            stax.Relu(),
            conv(4, (2, 2), strides=(2, 1), padding="VALID"),
            stax.Erf(),
            stax.Flatten(),
            d(2, b_std=0.1),
        ),
        (6, 5, 2),
    )
    nets["cnn_flatten_standard"] = (
        stax.serial(
            conv(3, (3, 2), padding="SAME", b_std=0.1, parameterization="standard"),
            stax.Relu(),
            stax.Flatten(),
            d(1, parameterization="standard"),
        ),
        (5, 4, 2),
    )
    nets["cnn_gap"] = (
        stax.serial(
            conv(4, (3, 3), padding="SAME", b_std=0.2),
            stax.Relu(),
            conv(4, (3, 3), strides=(2, 2), padding="CIRCULAR", W_std=1.3),
            stax.Relu(),
            stax.GlobalAvgPool(),
            d(2, b_std=0.1),
        ),
        (6, 5, 2),
    )
    # on a TPU: fused (_infinite/fused_conv), the whole CNN-GAP from the inputs, or the
    # repeated [Relu, Conv] (serial finds the three repeats); the repeated standard Conv's
    # fan-in differs in its first step (4 channels in, then 3)
    repeated = conv(3, (3, 2), padding="SAME", W_std=1.4, b_std=0.1, parameterization="standard")
    nets["cnn_repeat_gap"] = (
        stax.serial(
            conv(4, (3, 2), padding="SAME", W_std=1.3, b_std=0.1),
            *[stax.Relu(), repeated] * 3,
            stax.LeakyRelu(0.1),
            stax.GlobalAvgPool(),
            d(1),
        ),
        (6, 5, 2),
    )
    nets["cnn_pools"] = (
        stax.serial(
            conv(3, (2, 2), padding="SAME"),
            stax.Relu(),
            stax.AvgPool((2, 2), strides=(2, 2), padding="SAME"),
            conv(3, (2, 2), padding="VALID"),
            stax.Abs(),
            stax.AvgPool((2, 2), padding="SAME", normalize_edges=True),
            conv(3, (2, 1), padding="CIRCULAR"),
            stax.Relu(),
            stax.SumPool((2, 2), strides=(1, 2), padding="VALID"),
            stax.GlobalSumPool(),
            d(1),
        ),
        (7, 6, 2),
    )
    nets["conv_only"] = (
        stax.serial(conv(3, (3, 3), padding="SAME", b_std=0.1), stax.Relu(), conv(2, (2, 2))),
        (5, 4, 2),
    )
    nets["conv_twice_only"] = (
        stax.serial(
            conv(3, (3, 3), padding="SAME"),
            stax.Relu(),
            conv(2, (2, 2)),
            stax.Relu(),
            conv(2, (2, 2)),
        ),
        (5, 4, 2),
    )
    nets["conv1d"] = (
        stax.serial(
            conv(3, (3,), padding="SAME"),
            stax.Relu(),
            conv(3, (2,), strides=(2,)),
            stax.Relu(),
            stax.GlobalAvgPool(),
            d(1),
        ),
        (7, 2),
    )
    nets["conv3d_flatten"] = (
        stax.serial(conv(2, (2, 2, 2), padding="SAME"), stax.Relu(), stax.Flatten(), d(1)),
        (3, 4, 3, 2),
    )

    def wide_block(channels, strides=(1, 1), mismatch=False):
        main = stax.serial(
            stax.Relu(),
            conv(channels, (3, 3), strides, padding="SAME"),
            stax.Relu(),
            conv(channels, (3, 3), padding="SAME"),
        )
        shortcut = conv(channels, (3, 3), strides, padding="SAME") if mismatch else stax.Identity()
        return stax.serial(stax.FanOut(2), stax.parallel(main, shortcut), stax.FanInSum())

    nets["wide_resnet_block"] = (
        stax.serial(
            conv(4, (3, 3), padding="SAME"),
            wide_block(4, (2, 2), True),
            wide_block(4),
            stax.Relu(),
            stax.GlobalAvgPool(),
            d(1),
        ),
        (6, 6, 2),
    )
    nets["layernorm_conv"] = (
        stax.serial(
            conv(3, (2, 2), padding="SAME", b_std=0.3),
            stax.LayerNorm(axis=(1, 2, 3)),
            stax.Relu(),
            stax.Flatten(),
            d(1),
        ),
        (4, 5, 2),
    )
    # self-attention (issue 49): sequences (T, C) and images (H, W, C); every mechanism,
    # positional embeddings summed (identity and decaying covariance) and concatenated
    attn = stax.GlobalSelfAttention
    nets["attn_softmax_image_pos"] = (
        stax.serial(
            conv(3, (2, 2), padding="SAME"),
            attn(
                3,
                2,
                2,
                2,
                W_query_std=1.5,
                pos_emb_type="SUM",
                pos_emb_p_norm=1,
                pos_emb_decay_fn=lambda r: jnp.exp(-0.7 * r),
                W_pos_emb_std=0.8,
                val_pos_emb=True,
            ),
            stax.Relu(),
            stax.GlobalAvgPool(),
            d(1),
        ),
        (3, 2, 2),
    )
    nets["attn_mechanisms_seq"] = (
        stax.serial(
            d(4, b_std=0.1),
            attn(4, 3, 3, 1, W_key_std=1.3, W_out_std=0.9, b_std=0.2),
            stax.Relu(),
            d(4),
            attn(4, 2, 2, 2, attention_mechanism="IDENTITY", pos_emb_type="SUM", b_std=0.1),
            stax.Relu(),
            d(3),
            attn(
                3,
                2,
                2,
                1,
                attention_mechanism="ABS",
                pos_emb_type="CONCAT",
                n_chan_pos_emb=2,
                W_pos_emb_std=1.2,
                W_value_std=1.1,
            ),
            stax.Erf(),
            d(4),
            attn(4, 2, 2, 2, attention_mechanism="RELU", pos_emb_type="CONCAT", val_pos_emb=True),
            stax.GlobalAvgPool(),
            d(1),
        ),
        (4, 2),
    )
    nets["attn_sqrt_identity_seq"] = (
        stax.serial(
            d(3, b_std=0.1),
            attn(3, 2, 2, 2, linear_scaling=False, attention_mechanism="IDENTITY", W_key_std=0.7),
            stax.Relu(),
            d(3),
            attn(
                3,
                2,
                2,
                1,
                linear_scaling=False,
                attention_mechanism="IDENTITY",
                pos_emb_type="SUM",
                W_pos_emb_std=0.6,
                b_std=0.3,
            ),
            stax.Flatten(),
            d(1),
        ),
        (4, 2),
    )
    return nets


def inputs(name: str, shape, n1: int = 4, n2: int = 3):
    """(x1, x2) float64 for network ``name``, seeded from the name."""
    seed = sum(ord(c) for c in name)
    rng = np.random.RandomState(seed)
    return rng.randn(n1, *shape), rng.randn(n2, *shape)
