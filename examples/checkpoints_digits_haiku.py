"""NTK through training from saved checkpoints: a Haiku LeNet on handwritten digits.

    python examples/checkpoints_digits_haiku.py [--steps 1000] [--every 25] [--probe 200]
        [--batch 64] [--seed 0] [--out ./ntk-track-haiku]

Two phases, as when the kernels are wanted after (or apart from) training:

1. train ``ntk_haiku.lenet`` (10 outputs) with optax (adam, softmax cross-entropy),
   saving the params with orbax (``ocp.StandardCheckpointer``) every ``--every`` steps
   into ``OUT/checkpoints/step_XXXXXXXX``;
2. restore each checkpoint found there, in step order, and hand its params to a
   :class:`ntk_core.KernelTracker` built on ``ntk_haiku.kernel_fn(net)``: the NTK
   (outputs traced, ``(P, P)``) of a fixed probe set of P training samples, its kernel
   distance from the first checkpoint's, its (centred) alignment with the one-hot
   labels and its top eigenvalues.

The LeNet has no Haiku state; for an ``hk.transform_with_state`` model save
``{"params": params, "state": state}`` and call ``tracker.update(step,
restored["params"], state=restored["state"])`` (keyword arguments go to the kernel
function; build it with ``apply_kwargs={"is_training": False}`` for BatchNorm).
Writes ``ntk_track.png`` and ``summary.json`` to --out (the figure and summary of ``ntk
track``, from ``ntk_cli.track``).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import ntk_core
import ntk_haiku
from ntk_cli import track as _track
from ntk_core._blocked.progress import progress_bar

FN = "checkpoints_digits_haiku"


def train_and_save(args, net, data, ckpt_dir: str) -> dict:
    """Phase 1: adam steps, params saved every ``args.every`` steps; returns the final
    params, the saved ``(step, path)`` pairs, the losses there and the test accuracy."""
    params = net.init(jax.random.PRNGKey(args.seed), data.x_train[:1])
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)
    x_train, y_train = jnp.asarray(data.x_train), jnp.asarray(data.y_train)

    @jax.jit
    def train_step(params, opt_state, idx):
        def loss_fn(p):
            logits = net.apply(p, x_train[idx])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y_train[idx]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batches = np.random.default_rng(args.seed).integers(
        0, len(data.x_train), (args.steps, args.batch)
    )
    losses, loss, saved = {}, None, []
    bar = progress_bar(FN, args.progress, args.steps, unit="step")
    with ocp.StandardCheckpointer() as checkpointer:
        for step in range(args.steps + 1):
            if step % args.every == 0:
                if loss is not None:
                    losses[str(step)] = float(loss)
                path = os.path.join(ckpt_dir, f"step_{step:08d}")
                checkpointer.save(path, {"params": params}, force=True)  # asynchronous
                saved.append((step, path))
            if step < args.steps:
                params, opt_state, loss = train_step(params, opt_state, batches[step])
                if bar is not None:
                    bar.update()
        checkpointer.wait_until_finished()
    if bar is not None:
        bar.close()
    logits = np.asarray(jax.jit(net.apply)(params, jnp.asarray(data.x_test)))
    accuracy = float(np.mean(np.argmax(logits, axis=1) == data.y_test))
    return {"params": params, "saved": saved, "train_loss": losses, "test_accuracy": accuracy}


def kernels_from_checkpoints(args, net, data, saved, like) -> ntk_core.KernelTracker:
    """Phase 2: the tracker fed with the params restored from each checkpoint
    ``(step, path)`` of ``saved``; ``like`` gives the params' shapes and dtypes."""
    kernel = ntk_haiku.kernel_fn(net, implementation=args.implementation)
    tracker = ntk_core.KernelTracker(
        kernel,
        data.x_probe,
        data.y_probe,
        every=args.every,
        top_k=args.top_k,
        out=_track.kernels_folder(FN, args.out, args.save_kernels),
    )
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": like})
    with ocp.StandardCheckpointer() as checkpointer:
        for step, path in saved:
            restored = checkpointer.restore(path, abstract)
            tracker.update(step, restored["params"])
    return tracker


def run(args) -> dict:
    """Both phases with the options of ``_track.add_arguments``; returns the summary."""
    t_start = time.perf_counter()
    _track.check_sizes(FN, args.steps, args.every, args.batch)
    data = _track.digits(args.seed, args.probe, FN, args.top_k)
    ckpt_dir = os.path.abspath(os.path.join(args.out, "checkpoints"))  # orbax: absolute
    os.makedirs(ckpt_dir, exist_ok=True)
    _track.kernels_folder(FN, args.out, args.save_kernels)  # an earlier run's: before training
    net = hk.without_apply_rng(
        hk.transform(functools.partial(ntk_haiku.lenet, out_features=_track.N_CLASSES))
    )
    print(
        f"{FN}: LeNet (Haiku) on {len(data.x_train)} handwritten digits, {args.steps} adam "
        f"steps (batch {args.batch}, lr {args.lr:g}), params saved every {args.every} steps; "
        f"then the NTK of {args.probe} probe samples from each checkpoint"
    )
    t_train = time.perf_counter()
    trained = train_and_save(args, net, data, ckpt_dir)
    t_train = time.perf_counter() - t_train
    tracker = kernels_from_checkpoints(args, net, data, trained["saved"], trained["params"])
    summary = {
        "framework": "haiku",
        "steps": args.steps,
        "every": args.every,
        "probe": args.probe,
        "batch": args.batch,
        "learning_rate": args.lr,
        "seed": args.seed,
        "checkpoints": ckpt_dir,
        "training_and_saving_seconds": t_train,
        "test_accuracy": trained["test_accuracy"],
        "train_loss": trained["train_loss"],
    }
    title = (
        f"NTK of a LeNet (Haiku) on digits from checkpoints of {args.steps} adam steps, "
        f"P = {args.probe}"
    )
    return _track.finish(args.out, tracker, title, summary, t_start)


def main(argv=None) -> int:
    """Parses the options (see ``--help``), trains, saves, computes, writes figure and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _track.add_arguments(parser, default_out="./ntk-track-haiku")
    parser.set_defaults(every=25)  # one checkpoint (about 0.5 MB) every 25 steps
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
