"""Case C3 at full size: GP inference with a 13 x 511 Erf network's infinite-width kernels.

    python examples/c3_gp_erf.py [--samples 16] [--depth 13] [--width 511] [--plot out.png]

Data: tests/data/gp_erf_1d.npz (98 training points with targets in the hundreds, 70
test points on [0, 3.4]). The case's network, as its user wrote it with neural-tangents'
stax (weight std 1.5, bias std 0.05, NTK parameterisation): ``depth`` hidden Dense layers
of ``width`` units with Erf activations and a Dense(1) output; its exact infinite-width
NNGP and NTK come from ``ntk_core.stax`` (the same code with the import changed), train
and test inputs in one Gram matrix, so the kernels are jointly PSD.

The same network written in Flax (standard parameterisation: W ~ N(0, 1.5² / fan_in),
b ~ N(0, 0.05²)) has its exact kernels computed from the model itself by
``ntk_flax.infinite_kernel_fn`` (the priors read from its ``kernel_init`` / ``bias_init``),
checked against the stax network with ``parameterization="standard"`` (the real widths).
Beside it, the Monte Carlo estimate the project offered before: the mean over
``--samples`` initialisations of the Flax model's empirical kernels, with its relative
distance to those exact kernels and both times (``--samples 0`` skips it).

For each kernel (NNGP, NTK used as the GP kernel) and ``diag_reg`` in 1e-2, 1e-3, 1e-4,
float32 GP inference either succeeds (the script checks: no NaN, 0 <= variance <= prior
variance, mean equal to a float64 numpy solve of the same kernel) or raises the
documented ValueError with the fix; then ``fit_amplitude=True`` puts the predicted
standard deviations on the targets' scale. Prints one line per case.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import time

import flax.linen as nn
import jax
import numpy as np

import ntk_flax
from ntk_core import predict, stax

DATA = pathlib.Path(__file__).parents[1] / "tests" / "data" / "gp_erf_1d.npz"


class ErfMLP(nn.Module):
    depth: int
    width: int

    @nn.compact
    def __call__(self, x):
        dense = functools.partial(
            nn.Dense,
            kernel_init=nn.initializers.variance_scaling(1.5**2, "fan_in", "normal"),
            bias_init=nn.initializers.normal(0.05),
        )
        for _ in range(self.depth):
            x = jax.scipy.special.erf(dense(self.width)(x))
        return dense(1)(x)


def erf_network(depth: int, width: int, parameterization: str = "ntk"):
    """The case's network in neural-tangents' stax: (init_fn, apply_fn, kernel_fn)."""
    dense = functools.partial(stax.Dense, W_std=1.5, b_std=0.05, parameterization=parameterization)
    return stax.serial(*[dense(width), stax.Erf()] * depth, dense(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--depth", type=int, default=13)
    parser.add_argument("--width", type=int, default=511)
    parser.add_argument("--plot", default=None, help="write a figure (needs matplotlib)")
    parser.add_argument("--save-kernels", default=None, help="write the kernels to this .npz")
    args = parser.parse_args()
    d = np.load(DATA)
    x_train, y_train, x_test = d["x_train"], d["y_train"], d["x_test"]
    n = len(x_train)
    x = np.concatenate([x_train, x_test])
    t0 = time.perf_counter()
    with jax.enable_x64(True):  # 13 layers: float32 rounds the kernel to 1e-5 (docs/errors.md)
        k64 = erf_network(args.depth, args.width)[2](x.astype(np.float64), None)
    k = predict.Kernels(*(np.asarray(a, np.float32) for a in k64))  # the case's float32 GP
    print(
        f"exact infinite-width kernels (ntk_core.stax): {args.depth} x {args.width} Erf network, "
        f"{len(x)} inputs, computed in float64, {time.perf_counter() - t0:.2f} s"
    )
    t0 = time.perf_counter()
    model = ErfMLP(args.depth, args.width)
    with jax.enable_x64(True):  # the Flax model's own exact kernels: priors from its initialisers
        variables = jax.jit(model.init)(jax.random.PRNGKey(0), x[:1])
        exact = ntk_flax.infinite_kernel_fn(model, variables)(x.astype(np.float64), None)
        twin = erf_network(args.depth, args.width, "standard")[2](x.astype(np.float64), None)
    gap = lambda a, b: np.abs(a - b).max() / np.abs(b).max()  # noqa: E731
    gaps = [f"{n} {gap(getattr(exact, n), getattr(twin, n)):.1e}" for n in ("nngp", "ntk")]
    print(
        f"exact kernels of the Flax model itself (ntk_flax.infinite_kernel_fn, W_std = 1.5 and "
        f"b_std = 0.05 read from its initialisers), {time.perf_counter() - t0:.2f} s; largest "
        f"relative gap to the stax network with parameterization='standard': {', '.join(gaps)}"
    )
    if args.samples:
        t0 = time.perf_counter()
        mc = ntk_flax.monte_carlo_kernels(
            ErfMLP(args.depth, args.width), x, key=jax.random.PRNGKey(0), n_samples=args.samples
        )
        seconds = time.perf_counter() - t0
        gaps = []
        for name in ("nngp", "ntk"):
            a, b = np.asarray(getattr(mc, name)), np.asarray(getattr(exact, name))
            gaps.append(f"{name} {np.linalg.norm(a - b) / np.linalg.norm(b):.3f}")
        print(
            f"Monte Carlo kernels of the Flax twin, {args.samples} samples: {seconds:.1f} s; "
            f"relative Frobenius distance to its exact kernels: {', '.join(gaps)}"
        )
    if args.save_kernels:
        np.savez(args.save_kernels, nngp=np.asarray(k.nngp), ntk=np.asarray(k.ntk), n_train=n)
    results = {}
    for name in ("nngp", "ntk"):
        kern = np.asarray(getattr(k, name))
        k_xx, k_tx, prior = kern[:n, :n], kern[n:, :n], np.diagonal(kern)[n:]
        w = np.linalg.eigvalsh(k_xx.astype(np.float64))
        print(
            f"{name}: eigenvalues of K_train {w[0]:.2e} .. {w[-1]:.2e}, "
            f"mean diagonal {np.mean(np.diag(k_xx)):.3e}"
        )
        for diag_reg in (1e-2, 1e-3, 1e-4):
            lam = diag_reg * np.mean(np.diag(k_xx).astype(np.float64))
            ref = k_tx.astype(np.float64) @ np.linalg.solve(
                k_xx.astype(np.float64) + lam * np.eye(n), y_train.astype(np.float64)
            )
            try:
                post = predict.gp_inference(k_xx, y_train, diag_reg=diag_reg, fit_amplitude=True)
            except ValueError as e:
                print(f"  diag_reg={diag_reg:.0e} float32: refused: {str(e)[:160]}...")
                continue
            mean, var = post.nngp(k_tx, prior)
            var_plain = var / post.amplitude
            ok = (
                np.isfinite(mean).all()
                and np.isfinite(var).all()
                and np.all(var_plain >= 0)
                and np.all(var_plain <= prior)
            )
            err = np.abs(mean - ref).max() / np.abs(ref).max()
            std = np.sqrt(var)
            print(
                f"  diag_reg={diag_reg:.0e} float32 ({post.method}): finite and 0 <= var <= prior: "
                f"{ok}; |mean - float64| / max|mean| = {err:.1e}; std without amplitude "
                f"{np.sqrt(var_plain).min():.2e}..{np.sqrt(var_plain).max():.2e}, with "
                f"fit_amplitude (sigma^2 = {post.amplitude:.3e}) {std.min():.1f}..{std.max():.1f} "
                f"(targets: std {y_train.std():.1f})"
            )
            results[(name, diag_reg)] = (mean, std)
    if args.plot and results:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, name in zip(axes, ("nngp", "ntk"), strict=True):
            for (kind, reg), (mean, std) in results.items():
                if kind != name:
                    continue
                xs = x_test[:, 0]
                ax.plot(xs, mean[:, 0], label=f"diag_reg={reg:.0e}")
                ax.fill_between(xs, mean[:, 0] - 2 * std, mean[:, 0] + 2 * std, alpha=0.15)
            ax.scatter(x_train[:, 0], y_train[:, 0], s=6, c="k", label="train")
            ax.set_title(f"GP posterior, {name.upper()} kernel (mean ± 2 std)")
            ax.set_xlabel("x")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
