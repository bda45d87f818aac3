"""neural-tangents 0.6.5's standard-parameterised stax kernels of the adapters' held-out
networks (issue 50), written for ``tests/{flax,haiku,equinox}/test_infinite_*.py``.

    /tmp/ntvenv/bin/python benchmarks/dump_nt_adapter_references.py \
        tests/data/nt_adapter_reference.npz

Each network is written here in neural-tangents' stax with the priors its framework's
initialisers give, taken from the frameworks' documented defaults (not from our reading
of them): Flax ``nn.Dense`` (lecun_normal, zeros) W_std = 1, b_std = 0; Haiku
``hk.nets.MLP`` (TruncatedNormal(1/√fan_in) on ±2 standard deviations, not rescaled, zeros)
W_std² = Var of N(0, 1) truncated to (-2, 2) (scipy), b_std = 0; equinox ``eqx.nn.MLP``
(weights and biases uniform in ±1/√fan_in) W_std² = 1/3, b_std² = 1/(3·fan_in); case C3's
Erf network (13 x Dense(511) + erf, Dense(1)) with W_std = 1.5, b_std = 0.05. Inputs: 5
features (C3: 1, its data's range), fixed seeds; kernels of (x1, x1) and (x1, x2), float64.
"""

import sys

import jax

jax.config.update("jax_enable_x64", True)
import numpy as np  # noqa: E402
import scipy.stats  # noqa: E402


def networks(stax):
    def dense(n, w, b):
        return stax.Dense(n, W_std=w, b_std=b, parameterization="standard")

    haiku_w = float(np.sqrt(scipy.stats.truncnorm(-2, 2).var()))
    third = float(np.sqrt(1 / 3))
    return {
        "flax_mlp": stax.serial(
            dense(64, 1.0, 0.0), stax.Relu(), dense(64, 1.0, 0.0), stax.Relu(), dense(1, 1.0, 0.0)
        ),
        "haiku_mlp": stax.serial(
            dense(64, haiku_w, 0.0),
            stax.Relu(),
            dense(64, haiku_w, 0.0),
            stax.Relu(),
            dense(1, haiku_w, 0.0),
        ),
        "equinox_mlp": stax.serial(
            dense(64, third, np.sqrt(1 / 15)),
            stax.Relu(),
            dense(64, third, np.sqrt(1 / 192)),
            stax.Relu(),
            dense(1, third, np.sqrt(1 / 192)),
        ),
        "c3_erf": stax.serial(*[dense(511, 1.5, 0.05), stax.Erf()] * 13, dense(1, 1.5, 0.05)),
    }


def inputs(name):
    rng = np.random.default_rng(50)
    if name == "c3_erf":  # the case's inputs lie on [0, 3.4]
        return rng.uniform(0, 3.4, (5, 1)), rng.uniform(0, 3.4, (3, 1))
    return rng.normal(size=(5, 5)), rng.normal(size=(3, 5))


def main():
    import neural_tangents
    from neural_tangents import stax

    out = {"__version__": np.asarray(neural_tangents.__version__)}
    for name, (_, _, kernel_fn) in networks(stax).items():
        x1, x2 = inputs(name)
        out[f"{name}/x1"], out[f"{name}/x2"] = x1, x2
        for tag, args in (("x1x1", (x1, None)), ("x1x2", (x1, x2))):
            k = kernel_fn(*args, get=("nngp", "ntk"))
            out[f"{name}/{tag}/nngp"], out[f"{name}/{tag}/ntk"] = (
                np.asarray(k.nngp),
                np.asarray(k.ntk),
            )
    np.savez_compressed(sys.argv[1], **out)
    print(sorted(out))


if __name__ == "__main__":
    main()
