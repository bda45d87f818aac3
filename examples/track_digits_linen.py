"""Track the NTK of a flax.linen LeNet through training on handwritten digits.

    python examples/track_digits_linen.py [--steps 1000] [--every 10] [--probe 200]
        [--batch 64] [--seed 0] [--out ./ntk-track-linen]

The same run as ``ntk track`` (the code is ``src/ntk_cli/track.py``, installed with the
package so that the command works from any folder). The loop, in short::

    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(lr))
    tracker = ntk_core.KernelTracker(ntk_flax.kernel_fn(model), x_probe, y_probe_one_hot, every=50)
    for step in range(steps + 1):
        tracker.update(step, state)     # the NTK at steps 0, 50, 100, ...; else returns at once
        if step < steps:
            state, loss = train_step(state, batch_indices[step])
    tracker.history["kernel_distance"], tracker.history["centered_alignment"], ...

Writes ``ntk_track.png`` (kernel distance from the initial NTK, centred alignment with
the one-hot labels, top eigenvalues, over training steps) and ``summary.json`` to --out.
"""

from __future__ import annotations

import sys

from ntk_cli import track as _track


def main(argv=None) -> int:
    """Parses the options (see ``--help``), trains, tracks, writes the figure and JSON."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _track.add_arguments(parser, default_out="./ntk-track-linen")
    _track.run_args(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
