"""The ``ntk`` command line: ``ntk demo`` (more subcommands to come)."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    try:
        from ntk_flax import _demo
    except ImportError as e:
        print(
            f"ntk demo needs the optional dependencies ({e}). Fix: "
            f"python -m pip install 'ntk-jax[all]'",
            file=sys.stderr,
        )
        return 2
    try:
        return _demo.run(args.out, args.n_train, args.seed, args.implementation, args.progress)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="ntk", description="Empirical NTK and NNGP kernels for JAX, Flax and Haiku."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="NTK of a LeNet on handwritten digits: Flax vs Haiku check, kernel regression",
    )
    try:
        from ntk_flax._demo import add_arguments
    except ImportError:
        demo.add_argument("rest", nargs=argparse.REMAINDER)
    else:
        add_arguments(demo)
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
