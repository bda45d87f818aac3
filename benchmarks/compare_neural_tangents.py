"""Side-by-side check against neural-tangents 0.6.5 (never a project dependency).

neural-tangents no longer imports on current JAX, so it runs in its own virtual
environment (jax 0.4.23, Python 3.11) and writes its kernels to a file; this project's
environment then recomputes them and reports the differences:

    /path/to/nt-venv/bin/python benchmarks/compare_neural_tangents.py dump nt.npz
    python benchmarks/compare_neural_tangents.py check nt.npz

The network is the LeNet of case C1 written in plain JAX (the same numbers as
``ntk_flax.LeNet``; parameters stored in Flax's layout so both read them).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

AXES = {
    "trace": dict(trace_axes=(-1,), diagonal_axes=()),
    "full": dict(trace_axes=(), diagonal_axes=()),
    "diag_out": dict(trace_axes=(), diagonal_axes=(-1,)),
    "diag_batch": dict(trace_axes=(), diagonal_axes=(0,)),
}
N1, N2, OUT = 6, 4, 3


def lenet(params, x):
    """Conv(6,5x5,SAME)-ReLU-avgpool-Conv(16,5x5,SAME)-ReLU-avgpool-120-84-OUT."""
    for name in ("Conv_0", "Conv_1"):
        x = jax.lax.conv_general_dilated(
            x,
            params[name]["kernel"],
            (1, 1),
            "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            precision=jax.lax.Precision.HIGHEST,
        )
        x = jax.nn.relu(x + params[name]["bias"])
        x = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
    x = x.reshape((x.shape[0], -1))
    for name in ("Dense_0", "Dense_1"):
        x = jax.nn.relu(
            jnp.dot(x, params[name]["kernel"], precision="highest") + params[name]["bias"]
        )
    return jnp.dot(x, params["Dense_2"]["kernel"], precision="highest") + params["Dense_2"]["bias"]


def make_params(key):
    shapes = {
        "Conv_0": (5, 5, 3, 6),
        "Conv_1": (5, 5, 6, 16),
        "Dense_0": (1024, 120),
        "Dense_1": (120, 84),
        "Dense_2": (84, OUT),
    }
    params = {}
    for name, shape in shapes.items():
        key, k1, k2 = jax.random.split(key, 3)
        fan_in = int(np.prod(shape[:-1]))
        params[name] = {
            "kernel": jax.random.normal(k1, shape) / np.sqrt(fan_in),
            "bias": 0.1 * jax.random.normal(k2, (shape[-1],)),
        }
    return params


def dump(path):
    import neural_tangents as nt

    params = make_params(jax.random.PRNGKey(0))
    x1 = jax.random.normal(jax.random.PRNGKey(1), (N1, 32, 32, 3))
    x2 = jax.random.normal(jax.random.PRNGKey(2), (N2, 32, 32, 3))
    x2_same = jax.random.normal(jax.random.PRNGKey(3), (N1, 32, 32, 3))
    out = {"x1": x1, "x2": x2, "x2_same": x2_same, "jax": jax.__version__}
    for name, p in params.items():
        for leaf, v in p.items():
            out[f"param/{name}/{leaf}"] = v
    impls = {
        "jacobian": nt.NtkImplementation.JACOBIAN_CONTRACTION,
        "ntvp": nt.NtkImplementation.NTK_VECTOR_PRODUCTS,
        "structured": nt.NtkImplementation.STRUCTURED_DERIVATIVES,
    }
    for axes_name, axes in AXES.items():
        other = x2_same if axes_name == "diag_batch" else x2
        for impl_name, impl in impls.items():
            fn = nt.empirical_ntk_fn(lenet, vmap_axes=0, implementation=impl, **axes)
            try:
                out[f"ntk/{axes_name}/{impl_name}/x2"] = np.asarray(fn(x1, other, params))
                out[f"ntk/{axes_name}/{impl_name}/none"] = np.asarray(fn(x1, None, params))
            except Exception as e:  # record what neural-tangents refuses
                print(f"neural-tangents {impl_name} {axes_name}: {type(e).__name__}: {e}")
        nngp = nt.empirical_nngp_fn(lenet, **axes)
        out[f"nngp/{axes_name}/x2"] = np.asarray(nngp(x1, other, params))
        out[f"nngp/{axes_name}/none"] = np.asarray(nngp(x1, None, params))
    np.savez(path, **out)
    print(f"wrote {path} (neural-tangents {nt.__version__}, jax {jax.__version__})")


def check(path):
    import haiku as hk  # noqa: F401  (the Haiku twin is checked by the test suite)

    import ntk_core
    import ntk_flax

    data = np.load(path)
    params = {}
    for key in data.files:
        if key.startswith("param/"):
            _, name, leaf = key.split("/")
            params.setdefault(name, {})[leaf] = jnp.asarray(data[key])
    x1, x2, x2_same = (jnp.asarray(data[k]) for k in ("x1", "x2", "x2_same"))
    model = ntk_flax.LeNet(out_features=OUT)
    variables = {"params": params}
    np.testing.assert_allclose(model.apply(variables, x1), lenet(params, x1), rtol=1e-5, atol=1e-5)
    worst = 0.0
    print("| kernel | axes | x2 | ours | max rel. difference |")
    print("| --- | --- | --- | --- | --- |")
    for key in sorted(data.files):
        if not key.startswith(("ntk/", "nngp/")):
            continue
        parts = key.split("/")
        kind, axes_name, which = parts[0], parts[1], parts[-1]
        other = None if which == "none" else (x2_same if axes_name == "diag_batch" else x2)
        expected = data[key].astype(np.float64)
        scale = np.abs(expected).max()
        if kind == "ntk":
            ours = {
                impl: ntk_core.empirical_ntk(
                    lenet, params, x1, other, implementation=impl, **AXES[axes_name]
                )
                for impl in ("jacobian", "ntvp", "structured")
            }
            ours["ntk_flax.kernel"] = ntk_flax.kernel(
                model, variables, x1, other, **AXES[axes_name]
            )
        else:
            ours = {
                "empirical_nngp": ntk_core.empirical_nngp(
                    lenet, params, x1, other, **AXES[axes_name]
                )
            }
            ours["ntk_flax.nngp"] = ntk_flax.nngp(model, variables, x1, other, **AXES[axes_name])
        for name, value in ours.items():
            value = np.asarray(value, np.float64)
            if value.shape != expected.shape:
                print(f"| {key} | shape {value.shape} vs neural-tangents {expected.shape} | FAIL |")
                worst = np.inf
                continue
            rel = float(np.abs(value - expected).max() / scale)
            worst = max(worst, rel)
            impl = parts[2] if kind == "ntk" else "-"
            print(f"| {kind} ({impl}) | {axes_name} | {which} | {name} | {rel:.2e} |")
    print(f"worst max relative difference: {worst:.2e}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    sys.exit(dump(path) if mode == "dump" else check(path))
