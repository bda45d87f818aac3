"""Track the NTK of a flax.nnx LeNet through training on handwritten digits.

    python examples/track_digits_nnx.py [--steps 1000] [--every 10] [--probe 200]
        [--batch 64] [--seed 0] [--out ./ntk-track-nnx]

The LeNet of ``ntk_flax.LeNet`` written as an ``nnx.Module``, trained with optax (adam,
softmax cross-entropy) through ``nnx.Optimizer``, which updates the module in place.
``ntk_flax.kernel_fn(model)`` called with ``None`` reads the module's ``nnx.Param``
state at each call, so the tracker sees every update without being handed parameters:
``tracker.update(step, None)``. Every ``--every`` steps it computes the NTK (outputs
traced, ``(P, P)``) of a fixed probe set of P training samples and records the kernel
distance from the initial NTK, the (centred) alignment with the one-hot labels and the
top eigenvalues. Writes ``ntk_track.png`` and ``summary.json`` to --out (the figure and
summary of ``ntk track``, from ``ntk_cli.track``).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ntk_core
import ntk_flax
from ntk_cli import track as _track
from ntk_core._blocked.progress import progress_bar

#: flax >= 0.11: ``optimizer.update(model, grads)``; flax 0.10: ``optimizer.update(grads)``.
_UPDATE_TAKES_MODEL = "model" in inspect.signature(nnx.Optimizer.update).parameters


class LeNet(nnx.Module):
    """``ntk_flax.LeNet`` (case C1) in flax.nnx, for 32x32xC inputs: Conv(6, 5x5) → ReLU →
    avg-pool 2x2 → Conv(16, 5x5) → ReLU → avg-pool 2x2 → Dense 120 → ReLU → Dense 84 →
    ReLU → Dense ``out_features``."""

    def __init__(self, out_features: int, rngs: nnx.Rngs, channels: int = 3):
        self.conv_0 = nnx.Conv(channels, 6, (5, 5), padding="SAME", rngs=rngs)
        self.conv_1 = nnx.Conv(6, 16, (5, 5), padding="SAME", rngs=rngs)
        self.dense_0 = nnx.Linear(16 * 8 * 8, 120, rngs=rngs)
        self.dense_1 = nnx.Linear(120, 84, rngs=rngs)
        self.dense_2 = nnx.Linear(84, out_features, rngs=rngs)

    def __call__(self, x):
        for conv in (self.conv_0, self.conv_1):
            x = nn.avg_pool(jax.nn.relu(conv(x)), (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = jax.nn.relu(self.dense_0(x))
        x = jax.nn.relu(self.dense_1(x))
        return self.dense_2(x)


@nnx.jit
def train_step(model, optimizer, x, y):
    """One adam step on a batch; updates ``model`` and ``optimizer`` in place."""

    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    if _UPDATE_TAKES_MODEL:
        optimizer.update(model, grads)
    else:  # flax 0.10
        optimizer.update(grads)
    return loss


def run(args) -> dict:
    """Trains and tracks with the options of ``_track.add_arguments``; returns the summary."""
    t_start = time.perf_counter()
    fn = "track_digits_nnx"
    _track.check_sizes(fn, args.steps, args.every, args.batch)
    data = _track.digits(args.seed, args.probe, fn, args.top_k)
    os.makedirs(args.out, exist_ok=True)
    model = LeNet(_track.N_CLASSES, nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)

    kernel = ntk_flax.kernel_fn(model, implementation=args.implementation)  # reads the module
    tracker = ntk_core.KernelTracker(
        kernel,
        data.x_probe,
        data.y_probe,
        every=args.every,
        top_k=args.top_k,
        out=_track.kernels_folder(fn, args.out, args.save_kernels),
    )
    chosen = kernel.implementation_for(None, data.x_probe)
    print(
        f"{fn}: LeNet (flax.nnx) on {len(data.x_train)} handwritten digits, {args.steps} adam "
        f"steps (batch {args.batch}, lr {args.lr:g}); NTK of {args.probe} probe samples every "
        f"{args.every} steps ({chosen})"
    )
    x_train, y_train = jnp.asarray(data.x_train), jnp.asarray(data.y_train)
    rng = np.random.default_rng(args.seed)
    batches = rng.integers(0, len(data.x_train), (args.steps, args.batch))
    losses, loss = {}, None
    bar = progress_bar(fn, args.progress, args.steps, unit="step")
    for step in range(args.steps + 1):
        if tracker.is_due(step) and loss is not None:
            losses[step] = float(loss)  # waits for the queued steps: timings stay apart
        tracker.update(step, None)  # None: the module's parameters now; else returns at once
        if step < args.steps:
            idx = batches[step]
            loss = train_step(model, optimizer, x_train[idx], y_train[idx])
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    logits = np.asarray(model(jnp.asarray(data.x_test)))
    summary = {
        "framework": "flax.nnx",
        "steps": args.steps,
        "every": args.every,
        "probe": args.probe,
        "batch": args.batch,
        "learning_rate": args.lr,
        "seed": args.seed,
        "implementation": chosen,
        "test_accuracy": float(np.mean(np.argmax(logits, axis=1) == data.y_test)),
        "train_loss": {str(k): v for k, v in losses.items()},
    }
    title = f"NTK of a LeNet (flax.nnx) on digits through {args.steps} adam steps, P = {args.probe}"
    return _track.finish(args.out, tracker, title, summary, t_start)


def main(argv=None) -> int:
    """Parses the options (see ``--help``), trains, tracks, writes the figure and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _track.add_arguments(parser, default_out="./ntk-track-nnx")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
