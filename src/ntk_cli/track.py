"""``ntk track``: a flax.linen LeNet trained with adam on the digits, its probe NTK tracked by
:class:`ntk_core.KernelTracker`; writes ``ntk_track.png`` and ``summary.json``. The helpers
serve ``examples/track_digits_nnx.py`` and ``examples/checkpoints_digits_haiku.py`` too."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import ntk_core
from ntk_core._errors import must
from ntk_core._kernel.options import DEFAULTS

#: Classes, held-out test samples, and the figure and summary written in ``--out``.
N_CLASSES, N_TEST, FIGURE, SUMMARY = 10, 297, "ntk_track.png", "summary.json"
FN = "ntk track"


class Digits(NamedTuple):
    """Training, test and probe sets (the first P training samples, one-hot labels (P, 10))."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    x_probe: np.ndarray
    y_probe: np.ndarray


def digits(seed: int, probe: int, fn: str = FN, top_k: int = 1) -> Digits:
    """The digits at 32x32x3, shuffled by ``seed``: 1500 training, 297 test samples;
    ``probe`` and the eigenvalues tracked of its (P, P) kernel, ``top_k``, checked."""
    from ntk_cli.demo import load_digits_32

    images, labels = load_digits_32(seed)
    n_train = len(images) - N_TEST
    if not 2 <= probe <= n_train:
        raise must(ValueError, fn, "--probe", f"in [2, {n_train}]", probe, eg=200)
    if not 1 <= top_k <= probe:  # eigenvalues of the (P, P) probe kernel
        raise must(ValueError, fn, "--top-k", f"in [1, --probe {probe}]", top_k, eg=min(5, probe))
    x_train, y_train = images[:n_train], labels[:n_train]
    one_hot = np.eye(N_CLASSES, dtype=np.float32)[y_train[:probe]]
    return Digits(x_train, y_train, images[n_train:], labels[n_train:], x_train[:probe], one_hot)


def check_sizes(fn: str, steps: int, every: int, batch: int, lr: float = 1e-3) -> None:
    for name, value, low in (("--steps", steps, 0), ("--every", every, 1), ("--batch", batch, 1)):
        if value < low:
            raise must(ValueError, fn, name, f">= {low}", value, f"pass e.g. {name} {low + 1}")
    if not lr > 0:  # NaN too; a negative rate would train by gradient ascent
        raise must(ValueError, fn, "--lr", "> 0", lr, "pass e.g. --lr 1e-3")


def kernels_folder(fn: str, out: str, save_kernels: bool) -> str | None:
    """``OUT/kernels`` with ``--save-kernels`` (a rerun replaces its files), else None; a
    ValueError where an earlier run's kernels there would sit beside this run's summary."""
    folder = os.path.join(out, "kernels")
    if not save_kernels and os.path.isdir(folder) and os.listdir(folder):
        what = f"{folder!r} holds an earlier run's kernels, which this run would not replace"
        raise ValueError(f"{fn}: {what}. Fix: pass --save-kernels, remove it, or another --out.")
    if save_kernels and os.path.exists(folder) and not os.path.isdir(folder):
        what = f"--save-kernels writes into {folder!r}, which is a file"
        raise ValueError(f"{fn}: {what}. Fix: remove it, or give another --out.")
    return folder if save_kernels else None


def add_arguments(parser: argparse.ArgumentParser, default_out: str = "./ntk-track") -> None:
    """The options shared by ``ntk track`` and the tracking examples."""
    from ntk_cli.demo import shared_options

    add = parser.add_argument
    add("--steps", type=int, default=1000, help="training steps (%(default)s)")
    add("--every", type=int, default=10, help="track the NTK every k steps (%(default)s)")
    add("--probe", type=int, default=200, help="probe samples P (%(default)s)")
    add("--batch", type=int, default=64, help="training batch size (%(default)s)")
    add("--lr", type=float, default=1e-3, help="adam learning rate (%(default)s)")
    add("--top-k", type=int, default=5, help="eigenvalues to track (%(default)s)")
    add("--save-kernels", action="store_true", help="save each NTK in OUT/kernels")
    shared_options(parser, default_out, "shuffle, init, batch")


def plot_history(history: dict, path: str, title: str) -> None:
    """Three panels over training steps: kernel distance from the initial NTK, centred
    (and plain) alignment with the one-hot labels, the top eigenvalues (log scale)."""
    from ntk_cli.demo import pyplot

    plt = pyplot()
    h, steps, dots = history, history["step"], dict(marker="o", ms=3)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].plot(steps, h["kernel_distance"], **dots)
    axes[0].set(title="kernel distance from the initial NTK", ylabel="1 - cos(K_0, K_t)")
    axes[1].plot(steps, h["centered_alignment"], **dots, label="centred")
    axes[1].plot(steps, h["alignment"], "--", color="grey", label="plain")
    axes[1].set(title="kernel-target alignment (one-hot labels)")
    for i, eigenvalue in enumerate(h["top_eigenvalues"].T):
        axes[2].semilogy(steps, eigenvalue, **dots, label=f"λ_{i + 1}")
    axes[2].set(title="top eigenvalues of the probe NTK")
    for ax in axes:
        ax.set(xlabel="training step")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # the alignment and eigenvalue panels
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def finish(out: str, tracker, title: str, summary: dict, t_start: float) -> dict:
    """Writes the figure and ``summary.json`` (settings, timings and the tracker's
    :meth:`~ntk_core.KernelTracker.to_dict`), prints a short table; returns the summary."""
    h, picture = tracker.history, os.path.join(out, FIGURE)
    plot_history(h, picture, title)
    tracking, total = float(h["seconds"].sum()), time.perf_counter() - t_start
    seconds = dict(total=total, tracking=tracking, other=total - tracking)
    summary = dict(summary, seconds=seconds, jax=jax.__version__, device=str(jax.devices()[0]))
    summary.update(tracker.to_dict())
    with open(os.path.join(out, SUMMARY), "w") as fh:
        json.dump(summary, fh, indent=1)
    n = len(h["step"])
    rows = np.unique(np.linspace(0, n - 1, min(11, n))).astype(int)
    print(f"{'step':>7} {'distance':>9} {'c.align':>8} {'eff.rank':>9} {'λ_1':>10}")
    columns = "step kernel_distance centered_alignment effective_rank".split()
    for row in zip(*[h[c][rows] for c in columns], h["top_eigenvalues"][rows, 0], strict=True):
        print("{:>7} {:9.4f} {:8.4f} {:9.2f} {:10.4g}".format(*row))
    if "test_accuracy" in summary:
        print(f"test accuracy after {summary['steps']} steps: {summary['test_accuracy']:.4f}")
    print(
        f"{n} kernels of {tracker.n_probe} probe samples in {tracking:.1f} s; total {total:.1f} s"
    )
    print(f"wrote {picture} and {os.path.join(out, SUMMARY)}")
    return summary


def run(
    out: str,
    steps: int,
    every: int,
    probe: int,
    batch: int,
    seed: int,
    lr: float = 1e-3,
    top_k: int = 5,
    implementation: str = DEFAULTS.implementation,
    save_kernels: bool = False,
    progress: bool | None = None,
) -> dict:
    """Trains the linen LeNet ``steps`` adam steps, tracking the probe NTK at steps 0,
    ``every``, 2·``every``, ... up to ``steps``; returns the summary written."""
    import optax
    from flax.training import train_state

    import ntk_flax
    from ntk_cli.demo import device, make_folder
    from ntk_core._blocked.progress import progress_bar

    t_start = time.perf_counter()
    check_sizes(FN, steps, every, batch, lr)
    data = digits(seed, probe, FN, top_k)
    make_folder(FN, "--out", out)
    kernels = kernels_folder(FN, out, save_kernels)
    model = ntk_flax.LeNet(out_features=N_CLASSES)
    key_init, key_batches = jax.random.split(jax.random.PRNGKey(seed))
    params = jax.jit(model.init)(key_init, data.x_train[:1])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(lr))
    x_train, y_train = jnp.asarray(data.x_train), jnp.asarray(data.y_train)

    def apply(params, x):
        return model.apply({"params": params}, x)

    @jax.jit
    def train_step(state, idx):
        def loss_fn(p):
            logits = apply(p, x_train[idx])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y_train[idx]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    kernel = ntk_flax.kernel_fn(model, implementation=implementation)  # (P, P), compiled once
    tracker = ntk_core.KernelTracker(  # data[4:]: the probe set
        kernel, *data[4:], every=every, top_k=top_k, out=kernels, overwrite=True
    )  # a rerun replaces its own files, as the figure
    chosen = kernel.implementation_for(state, data.x_probe)
    n = len(data.x_train)
    print(f"{FN}: LeNet (flax.linen) on {n} handwritten digits, {steps} adam steps (batch {batch},")
    print(f"  lr {lr:g}); NTK of {probe} probe samples every {every} steps ({chosen}); {device()}")
    batches = np.random.default_rng(seed).integers(0, n, (steps, batch))
    losses, loss = {}, None
    bar = progress_bar(FN, progress, steps, unit="step")
    for step in range(steps + 1):
        if tracker.is_due(step) and loss is not None:
            losses[step] = float(loss)  # waits for the queued steps: timings stay apart
        record = tracker.update(step, state)  # None at once unless step % every == 0
        if record is not None and bar is not None:
            bar.set_postfix(distance=f"{record.kernel_distance:.3f}", refresh=False)
        if step < steps:
            state, loss = train_step(state, batches[step])
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    logits = jax.jit(apply)(state.params, jnp.asarray(data.x_test))
    accuracy = float(np.mean(np.argmax(np.asarray(logits), axis=1) == data.y_test))
    summary = dict(framework="flax.linen", steps=steps, every=every, probe=probe, batch=batch)
    summary.update(learning_rate=lr, seed=seed, implementation=chosen, test_accuracy=accuracy)
    summary.update(train_loss={str(k): v for k, v in losses.items()})
    title = f"NTK of a LeNet (flax.linen) on digits through {steps} adam steps, P = {probe}"
    return finish(out, tracker, title, summary, t_start)


def run_args(args) -> dict:
    """:func:`run` with the options of :func:`add_arguments`."""
    return run(**{k: getattr(args, k) for k in inspect.signature(run).parameters})
