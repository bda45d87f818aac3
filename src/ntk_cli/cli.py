"""The ``ntk`` command line: ``ntk demo``, ``ntk track`` and ``ntk doctor``."""

from __future__ import annotations

import argparse
import importlib
import sys


def _needs(command: str, e: ImportError) -> int:
    print(
        f"{command} needs the optional dependencies ({e}). Fix: pip install 'ntk-jax[all]'",
        file=sys.stderr,
    )
    return 2


def _demo(args) -> int:
    try:
        from ntk_cli import demo as _demo
    except ImportError as e:
        return _needs("ntk demo", e)
    try:
        return _demo.run(
            args.out,
            args.n_train,
            args.seed,
            args.implementation,
            args.progress,
            args.compilation_cache,
        )
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2


def _track(args) -> int:
    try:
        from ntk_cli import track as tracking

        tracking.run_args(args)  # imports optax, scikit-learn and matplotlib when needed
    except ImportError as e:
        return _needs("ntk track", e)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


def _doctor(args, checks=None) -> int:
    from ntk_cli.doctor import all_checks
    from ntk_core._doctor import doctor

    if checks is None and not args.no_self_test:
        checks = all_checks()
    report = doctor(checks, self_test=not args.no_self_test)
    print(report.to_json() if args.json else report)
    return 0 if report.ok else 1


def main(argv=None, *, checks=None) -> int:
    """Runs ``ntk``; ``checks`` replaces the self-test of ``ntk doctor`` (for tests)."""
    parser = argparse.ArgumentParser(
        prog="ntk", description="Empirical NTK and NNGP kernels for JAX, Flax and Haiku."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    given = sys.argv[1:] if argv is None else list(argv)
    # A subcommand's options are defined (importing jax, flax and haiku) only when that
    # subcommand is called: `ntk --help` and `ntk doctor` import none of them.
    for name, text, run in (
        ("demo", "LeNet NTK on digits: Flax = Haiku, kernel regression", _demo),
        ("track", "LeNet NTK tracked through training on digits", _track),
    ):
        command = sub.add_parser(name, help=text)
        command.set_defaults(run=run)
        try:
            if name not in given[:1]:
                raise ImportError
            module = importlib.import_module(f"ntk_cli.{name}")
        except ImportError:
            command.add_argument("rest", nargs=argparse.REMAINDER)
        else:
            module.add_arguments(command)
    doctor = sub.add_parser("doctor", help="environment and self-test (exit 1 on failure)")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--no-self-test", action="store_true", help="report the environment only")
    doctor.set_defaults(run=lambda a: _doctor(a, checks))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
