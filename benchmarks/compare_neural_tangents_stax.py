"""Infinite-width kernels of neural-tangents 0.6.5's stax and ours on the same networks
(``tests/stax_nets.py``, float64).

    # in neural-tangents' own environment (see README.md): writes the reference file
    /tmp/ntvenv/bin/python benchmarks/compare_neural_tangents_stax.py dump tests/data/nt_stax_reference.npz
    # ours against it (the tests do the same: tests/core/test_stax_reference.py)
    python benchmarks/compare_neural_tangents_stax.py check tests/data/nt_stax_reference.npz
"""

import os
import sys

import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import stax_nets  # noqa: E402


def kernels(stax):
    out = {}
    for name, (net, shape) in stax_nets.networks(stax, jnp).items():
        x1, x2 = stax_nets.inputs(name, shape)
        kernel_fn = net[2]
        for tag, args in (("x1x1", (x1, None)), ("x1x2", (x1, x2))):
            try:
                k = kernel_fn(*args, get=("nngp", "ntk"))
            except Exception as e:  # noqa: BLE001 - recorded: what the library refuses
                print(f"{name}/{tag}: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
                out[f"{name}/{tag}/error"] = np.asarray(type(e).__name__)
                continue
            out[f"{name}/{tag}/nngp"] = np.asarray(k.nngp)
            out[f"{name}/{tag}/ntk"] = np.asarray(k.ntk)
    return out


def main():
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "dump":
        import neural_tangents
        from neural_tangents import stax

        np.savez_compressed(path, __version__=neural_tangents.__version__, **kernels(stax))
        return
    from ntk_core import stax

    ref = np.load(path)
    worst = 0.0
    for key, ours in kernels(stax).items():
        if key not in ref:
            print(
                f"{key}: not in the reference ({[k for k in ref if k.startswith(key.rsplit('/', 1)[0])]})"
            )
            continue
        theirs = ref[key]
        if ours.shape != theirs.shape:
            print(f"{key}: shape {ours.shape} != {theirs.shape}")
            continue
        err = np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1e-300)
        worst = max(worst, err)
        print(f"{key:45s} {err:.2e}" + ("   <-- " if err > 1e-6 else ""))
    print(f"worst relative error {worst:.2e}")


if __name__ == "__main__":
    main()
