"""``ntk demo``: the train-train and test-train NTK of the LeNet of case C1 on scikit-learn's
digits, in Flax and in its Haiku twin (same weights, kernels must agree), NTK kernel
regression on one-hot labels; writes the Gram matrices, a picture and ``summary.json``."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import time

import jax
import numpy as np

import ntk_core
import ntk_flax
from ntk_core._errors import must

#: The regression's λ = DIAG_REG · mean(diag K_train); the largest max|K_haiku − K_flax| /
#: max|K_flax| accepted by the twin check.
DIAG_REG, TWIN_TOLERANCE = 1e-4, 1e-4
FILES = ("ntk_train_train.npy", "ntk_test_train.npy", "ntk_demo.png", "summary.json")
FN = "ntk demo"


def load_digits_32(seed: int):
    """scikit-learn's 1797 8x8 digits, upsampled to the LeNet's 32x32x3 and shuffled."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0
    images = np.kron(images, np.ones((1, 4, 4), np.float32))  # 8x8 -> 32x32, nearest
    images = np.repeat(images[..., None], 3, axis=-1)  # grey -> 3 channels
    images = (images - images.mean()) / images.std()
    order = np.random.default_rng(seed).permutation(len(images))
    return images[order], digits.target[order]


def kernel_regression(k_train, k_test_train, labels, n_classes, diag_reg):
    """Mean prediction K_st (K_tt + λI)⁻¹ Y with λ = diag_reg · mean(diag K_tt), float64."""
    k_train = np.asarray(k_train, np.float64)
    targets = np.eye(n_classes)[labels]
    lam = diag_reg * np.mean(np.diag(k_train))
    alpha = np.linalg.solve(k_train + lam * np.eye(len(k_train)), targets)
    return np.asarray(k_test_train, np.float64) @ alpha, lam


def shared_options(parser: argparse.ArgumentParser, out: str, seed: str) -> None:
    """The options of ``ntk demo``, ``ntk track``, the examples (progress None: bar on a tty)."""
    add, choices = parser.add_argument, list(ntk_core.IMPLEMENTATIONS)
    add("--out", default=out, help="output folder (%(default)s)")
    add("--seed", type=int, default=0, help=f"{seed} seed (%(default)s)")
    add("--implementation", default="auto", choices=choices, help="NTK method (%(default)s)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--progress", action="store_true", default=None, help="progress bar")
    group.add_argument("--no-progress", dest="progress", action="store_false", help="no bar")


def pyplot():
    """``matplotlib.pyplot`` drawing to files (the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(path, k_train, labels):
    plt = pyplot()
    order = np.argsort(labels, kind="stable")
    eig = np.sort(np.linalg.eigvalsh(np.asarray(k_train, np.float64)))[::-1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    im = ax1.imshow(np.asarray(k_train)[np.ix_(order, order)], cmap="viridis")
    for b in np.flatnonzero(np.diff(labels[order])) + 0.5:  # between classes
        for draw in (ax1.axhline, ax1.axvline):
            draw(b, color="white", lw=0.4)
    classes = np.unique(labels)
    ticks = [np.mean(np.flatnonzero(labels[order] == c)) for c in classes]
    ax1.set_xticks(ticks, [str(c) for c in classes])
    ax1.set_yticks(ticks, [str(c) for c in classes])
    ax1.set_title("Empirical NTK, train x train, sorted by class")
    fig.colorbar(im, ax=ax1, fraction=0.046)
    ax2.semilogy(np.arange(1, len(eig) + 1), np.clip(eig, 1e-12, None))
    ax2.set(xlabel="index", ylabel="eigenvalue", title="NTK eigenvalue spectrum (train x train)")
    ax2.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def device() -> str:
    """The JAX version and the default device's platform, as the commands print them."""
    return f"jax {jax.__version__} on {jax.devices()[0].platform}"


def make_folder(fn: str, option: str, folder: str) -> None:
    """``folder`` made if missing; a ValueError naming ``option`` where it cannot be."""
    try:
        os.makedirs(folder, exist_ok=True)  # fail before computing, not after
    except OSError as e:  # a file of that name, or in the way
        why = "is a file, not a folder" if os.path.isfile(folder) else "cannot be made"
        raise ValueError(
            f"{fn}: {option} {folder!r} {why} ({e.strerror}). Fix: give a folder path."
        ) from e


def use_compilation_cache(folder: str) -> None:
    """JAX's persistent compilation cache in ``folder``, for every program (JAX: above 1 s)."""
    make_folder(FN, "--compilation-cache", folder)
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def run(out, n_train, seed, implementation, progress, compilation_cache=None) -> int:
    """Runs the demo (arguments: :func:`add_arguments`); returns the exit status (1: failed)."""
    import haiku as hk

    import ntk_haiku
    from ntk_core._blocked.progress import NO_BAR, progress_bar

    t_start = time.perf_counter()
    make_folder(FN, "--out", out)
    if compilation_cache:
        use_compilation_cache(compilation_cache)
    images, labels = load_digits_32(seed)
    if not 0 < n_train < len(images):
        raise must(ValueError, FN, "--n-train", f"in [1, {len(images) - 1}]", n_train, eg=1000)
    x_train, y_train = images[:n_train], labels[:n_train]
    x_test, y_test = images[n_train:], labels[n_train:]

    model = ntk_flax.LeNet(out_features=1)
    variables = jax.jit(model.init)(jax.random.PRNGKey(seed), x_train[:1])
    twin = hk.without_apply_rng(hk.transform(ntk_haiku.lenet))
    twin_params = ntk_haiku.params_from_flax(variables["params"])
    kernel = ntk_flax.kernel_fn(model, implementation=implementation)
    chosen = kernel.implementation_for(variables, x_test, x_train)

    print(f"{FN}: LeNet (C1), {n_train} train / {len(x_test)} test digits, {device()}")
    print(f"implementation: {implementation!r} -> {chosen}")
    n_check = min(128, n_train)
    steps = ["train x train NTK", "test x train NTK", "Haiku twin check", "kernel regression"]
    timings = {}
    bar = progress_bar(FN, progress, len(steps), unit="step") or NO_BAR

    def timed(name, compute, *args):
        bar.set_description(name)
        start = time.perf_counter()
        result = compute(*args)
        timings[name] = time.perf_counter() - start
        bar.update()
        return result

    def twin_check():
        k = ntk_haiku.kernel(twin, twin_params, x_train[:n_check], implementation=implementation)
        k_flax = k_train[:n_check, :n_check]
        return float(np.abs(np.asarray(k) - k_flax).max()) / float(np.abs(k_flax).max())

    def ntk(*x):
        return np.asarray(jax.block_until_ready(kernel(variables, *x)))

    k_train = timed(steps[0], ntk, x_train)
    k_test_train = timed(steps[1], ntk, x_test, x_train)
    twin_rel = timed(steps[2], twin_check)
    mean, lam = timed(steps[3], kernel_regression, k_train, k_test_train, y_train, 10, DIAG_REG)
    accuracy = float(np.mean(np.argmax(mean, axis=1) == y_test))
    bar.close()

    paths = [os.path.join(out, name) for name in FILES]
    np.save(paths[0], k_train)
    np.save(paths[1], k_test_train)
    _figure(paths[2], k_train, y_train)
    timings.update(total=time.perf_counter() - t_start)
    summary = dict(n_train=n_train, n_test=len(x_test), implementation=chosen, diag_reg=DIAG_REG)
    summary.update({"lambda": lam}, test_accuracy=accuracy, seconds=timings, jax=jax.__version__)
    summary.update(flax_vs_haiku_max_relative_difference=twin_rel, device=str(jax.devices()[0]))
    with open(paths[3], "w") as fh:
        json.dump(summary, fh, indent=2)

    for name in steps:
        print(f"  {name:<20} {timings[name]:7.2f} s")
    twin = f"{twin_rel:.2e} (tolerance {TWIN_TOLERANCE:.0e})"
    print(f"Flax vs Haiku (first {n_check} train samples): max relative difference {twin}")
    regression = f"kernel regression on one-hot labels, regulariser λ = {DIAG_REG:g} x mean(diag K)"
    print(f"{regression} = {lam:.3e}: test accuracy {accuracy:.4f}")
    print(f"wrote {out}/{', '.join(FILES)}\ntotal time {timings['total']:.1f} s")
    if not twin_rel <= TWIN_TOLERANCE:
        print("FAILED: the Flax and Haiku kernels of the same network differ.")
    return int(not twin_rel <= TWIN_TOLERANCE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n-train", type=int, default=1000, help="training samples (%(default)s)")
    parser.add_argument("--compilation-cache", metavar="DIR", help="JAX's compilation cache folder")
    shared_options(parser, "./ntk-demo", "shuffle and init")


def run_args(args) -> int:  # run() with the options of add_arguments()
    return run(**{k: getattr(args, k) for k in inspect.signature(run).parameters})
