"""``ntk_core.predict`` against neural-tangents 0.6.5's ``nt.predict`` (same formulas, layout).

neural-tangents runs in its own virtual environment (see compare_neural_tangents.py),
in float64 (x64 on there), and writes its inputs and outputs; this project's
environment reads the same inputs, recomputes and reports the worst relative
difference per quantity:

    /path/to/nt-venv/bin/python benchmarks/compare_neural_tangents_predict.py dump nt_predict.npz
    python benchmarks/compare_neural_tangents_predict.py check nt_predict.npz

Kernels are built from random features, so they are jointly PSD: traced ``(N, N)``
(``trace_axes=(-1,)``) and full ``(N, N, O, O)`` (``trace_axes=()``) layouts, relative
and absolute ``diag_reg``; GP (``get="nngp"``) and NTK-ensemble (``get="ntk"``)
posteriors with covariance; ``gradient_descent_mse`` at finite times and t = None.

Case C3 (float32 GP inference with a deep Erf network's kernels), both libraries on the
same kernels: neural-tangents' infinite-width ones (``c3-analytic``) or this project's
Monte Carlo ones (``python examples/c3_gp_erf.py --save-kernels c3.npz``):

    /path/to/nt-venv/bin/python benchmarks/compare_neural_tangents_predict.py c3-analytic c3.npz
    /path/to/nt-venv/bin/python benchmarks/compare_neural_tangents_predict.py c3 c3.npz
    python benchmarks/compare_neural_tangents_predict.py c3-ours c3.npz

print per kernel and diag_reg: NaN standard deviations, NaN means, and the mean's max
difference from a float64 numpy solve of the same float32 kernel (relative to max |mean|).
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

N, T, OUT, P = 20, 6, 3, 9
TIMES = np.array([0.5, 10.0, 1000.0])
REGS = {"rel": (1e-3, False), "abs": (1e-2, True)}


def inputs():
    rng = np.random.default_rng(0)
    phi = rng.standard_normal((N + T, OUT, P))  # NNGP features
    psi = rng.standard_normal((N + T, OUT, P))  # extra NTK features
    full = lambda f: np.einsum("iap,jbp->ijab", f, f)  # noqa: E731
    nngp_full, ntk_full = full(phi), full(phi) + full(psi)
    traced = lambda k: np.einsum("ijaa->ij", k) / OUT  # noqa: E731
    data = {
        "y": rng.standard_normal((N, OUT)),
        "f0": rng.standard_normal((N, OUT)),
        "ft0": rng.standard_normal((T, OUT)),
    }
    for layout, fn in (("traced", traced), ("full", lambda k: k)):
        for kind, k in (("nngp", nngp_full), ("ntk", ntk_full)):
            k = fn(k)
            data[f"{layout}/{kind}/xx"] = k[:N, :N]
            data[f"{layout}/{kind}/tx"] = k[N:, :N]
            data[f"{layout}/{kind}/tt"] = k[N:, N:]
    return data


def dump(path):
    import collections

    import jax

    jax.config.update("jax_enable_x64", True)
    import neural_tangents as nt

    Pair = collections.namedtuple("Pair", "nngp ntk")  # what nt.predict reads: .nngp, .ntk

    data = inputs()
    out = dict(data)
    for layout, axes in (("traced", (-1,)), ("full", ())):
        k = lambda kind, part, layout=layout: data[f"{layout}/{kind}/{part}"]  # noqa: E731
        kxx = Pair(nngp=k("nngp", "xx"), ntk=k("ntk", "xx"))
        ktx = Pair(nngp=k("nngp", "tx"), ntk=k("ntk", "tx"))
        for reg, (value, absolute) in REGS.items():
            fn = nt.predict.gp_inference(kxx, data["y"], value, absolute, axes)
            res = fn(get=("nngp", "ntk"), k_test_train=ktx, k_test_test=k("nngp", "tt"))
            for g in ("nngp", "ntk"):
                out[f"{layout}/{reg}/gp_{g}/mean"] = np.asarray(getattr(res, g).mean)
                out[f"{layout}/{reg}/gp_{g}/cov"] = np.asarray(getattr(res, g).covariance)
            mse = nt.predict.gradient_descent_mse(
                k("ntk", "xx"), data["y"], 0.5, value, absolute, axes
            )
            train, test = mse(TIMES, data["f0"], data["ft0"], k("ntk", "tx"))
            out[f"{layout}/{reg}/mse/train"] = np.asarray(train)
            out[f"{layout}/{reg}/mse/test"] = np.asarray(test)
            train, test = mse(None, data["f0"], data["ft0"], k("ntk", "tx"))
            out[f"{layout}/{reg}/mse_inf/train"] = np.asarray(train)
            out[f"{layout}/{reg}/mse_inf/test"] = np.asarray(test)
    np.savez(path, **out)
    print(f"wrote {len(out)} arrays to {path}")


def check(path):
    from ntk_core import predict

    ref = np.load(path)
    worst = 0.0
    rows = []
    for layout, axes in (("traced", (-1,)), ("full", ())):
        k = lambda kind, part, layout=layout: ref[f"{layout}/{kind}/{part}"]  # noqa: E731
        kxx = predict.Kernels(nngp=k("nngp", "xx"), ntk=k("ntk", "xx"))
        ktx = predict.Kernels(nngp=k("nngp", "tx"), ntk=k("ntk", "tx"))
        for reg, (value, absolute) in REGS.items():
            opts = dict(diag_reg=value, diag_reg_absolute_scale=absolute, trace_axes=axes)
            post = predict.gp_inference(kxx, ref["y"], dtype="float64", **opts)
            ours = {}
            for g in ("nngp", "ntk"):
                res = getattr(post, g)(ktx, k("nngp", "tt"))
                ours[f"gp_{g}/mean"], ours[f"gp_{g}/cov"] = res.mean, res.covariance
            mse = predict.gradient_descent_mse(
                k("ntk", "xx"), ref["y"], learning_rate=0.5, dtype="float64", **opts
            )
            res = mse(TIMES, ref["f0"], ref["ft0"], k("ntk", "tx"))
            ours["mse/train"], ours["mse/test"] = res.train, res.test
            res = mse(None, ref["f0"], ref["ft0"], k("ntk", "tx"))
            ours["mse_inf/train"], ours["mse_inf/test"] = res.train, res.test
            for name, value_ in ours.items():
                theirs = ref[f"{layout}/{reg}/{name}"]
                assert value_.shape == theirs.shape, (layout, reg, name, value_.shape, theirs.shape)
                err = float(np.abs(value_ - theirs).max() / np.abs(theirs).max())
                worst = max(worst, err)
                rows.append((layout, reg, name, value_.shape, err))
    print("| layout | diag_reg | quantity | shape | max abs diff / max abs |")
    print("| --- | --- | --- | --- | --- |")
    for layout, reg, name, shape, err in rows:
        print(f"| {layout} | {reg} | {name} | {shape} | {err:.1e} |")
    print(f"worst: {worst:.2e}")
    return worst


C3_DATA = pathlib.Path(__file__).parents[1] / "tests" / "data" / "gp_erf_1d.npz"


def c3_analytic(path):
    """(neural-tangents env) The case's infinite-width NNGP and NTK from nt.stax, float32:
    13 x (Dense(511, W_std=1.5, b_std=0.05), Erf), Dense(1, W_std=1.5, b_std=0.05)."""
    import neural_tangents as nt
    from neural_tangents import stax

    d = np.load(C3_DATA)
    layers = []
    for _ in range(13):
        layers += [stax.Dense(511, W_std=1.5, b_std=0.05), stax.Erf()]
    _, _, kernel_fn = stax.serial(*layers, stax.Dense(1, W_std=1.5, b_std=0.05))
    k = kernel_fn(np.concatenate([d["x_train"], d["x_test"]]), None, ("nngp", "ntk"))
    np.savez(path, nngp=np.asarray(k.nngp), ntk=np.asarray(k.ntk), n_train=len(d["x_train"]))
    print(f"neural-tangents {nt.__version__}: wrote {path}")


def _c3_cases(path):
    d = np.load(path)
    y = np.load(C3_DATA)["y_train"]
    n = int(d["n_train"])
    for name in ("nngp", "ntk"):
        k = d[name].astype(np.float32)
        for reg in (1e-2, 1e-3, 1e-4):
            kxx, ktx = k[:n, :n], k[n:, :n]
            lam = reg * np.mean(np.diag(kxx).astype(np.float64))
            a = kxx.astype(np.float64) + lam * np.eye(n)
            ref = ktx.astype(np.float64) @ np.linalg.solve(a, y.astype(np.float64))
            yield name, reg, k, n, y, ref


def c3(path):
    """(neural-tangents env) nt.predict.gp_inference in float32 on the kernels in path."""
    import neural_tangents as nt

    for name, reg, k, n, y, ref in _c3_cases(path):
        fn = nt.predict.gp_inference(k[:n, :n], y, diag_reg=reg)
        mean, cov = fn(get="nngp", k_test_train=k[n:, :n], k_test_test=k[n:, n:])
        mean = np.asarray(mean)
        with np.errstate(invalid="ignore"):
            std = np.sqrt(np.diagonal(np.asarray(cov)))
        err = np.abs(mean - ref).max() / np.abs(ref).max()
        print(
            f"| neural-tangents {nt.__version__} | {name} | {reg:.0e} | "
            f"{int(np.isnan(std).sum())}/{std.size} | {int(np.isnan(mean).sum())}/{mean.size} | "
            f"{err:.1e} |"
        )


def c3_ours(path):
    """(this project's env) ntk_core.predict.gp_inference in float32 on the same kernels."""
    from ntk_core import predict

    for name, reg, k, n, y, ref in _c3_cases(path):
        try:
            post = predict.gp_inference(k[:n, :n], y, diag_reg=reg)
        except ValueError as e:
            print(f"| ntk_core | {name} | {reg:.0e} | ValueError: {str(e)[:80]}... | | |")
            continue
        mean, var = post.nngp(k[n:, :n], np.diagonal(k)[n:])
        err = np.abs(mean - ref).max() / np.abs(ref).max()
        print(
            f"| ntk_core | {name} | {reg:.0e} | {int(np.isnan(var).sum())}/{var.size} "
            f"(min var {var.min():.1e}) | {int(np.isnan(mean).sum())}/{mean.size} | {err:.1e} |"
        )


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    modes = {"dump": dump, "check": check, "c3-analytic": c3_analytic, "c3": c3, "c3-ours": c3_ours}
    modes[mode](path)
