"""The ``ntk`` command line: ``ntk demo``, ``ntk track`` and ``ntk doctor``."""

from __future__ import annotations

import argparse
import importlib
import sys

_EXTRAS = "Fix: pip install 'ntk-jax[all]'"


def _module(name: str):
    """``ntk_cli.{name}``: the subcommand's options and ``run_args``."""
    return importlib.import_module(f"{__package__}.{name}")


def _subcommand(name: str, args) -> int:
    """Runs ``ntk_cli.{name}.run`` with the parsed options; 2 on a missing extra or bad option."""
    try:  # imports optax, scikit-learn and matplotlib when needed
        status = _module(name).run_args(args)
        return status if isinstance(status, int) else 0  # track: the summary
    except ImportError as e:
        print(f"ntk {name} needs the optional dependencies ({e}). {_EXTRAS}", file=sys.stderr)
    except ValueError as e:
        print(e, file=sys.stderr)
    return 2


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
    about = "Empirical NTK and NNGP kernels for JAX, Flax and Haiku."
    parser = argparse.ArgumentParser(prog="ntk", description=about)
    sub = parser.add_subparsers(dest="command", required=True)
    given = sys.argv[1:] if argv is None else list(argv)
    # A subcommand's options are defined (importing jax, flax and haiku) only when that
    # subcommand is called: `ntk --help` and `ntk doctor` import none of them.
    for name, text in (
        ("demo", "LeNet NTK on digits: Flax = Haiku, kernel regression"),
        ("track", "LeNet NTK tracked through training on digits"),
    ):
        command = sub.add_parser(name, help=text, description=text)
        command.set_defaults(run=lambda a, name=name: _subcommand(name, a))
        try:
            if name not in given[:1]:
                raise ImportError
            module = _module(name)
        except ImportError:
            command.add_argument("rest", nargs=argparse.REMAINDER)
        else:
            module.add_arguments(command)
    text = "environment and self-test (exit 1 on failure)"
    doctor = sub.add_parser("doctor", help=text, description=text)
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--no-self-test", action="store_true", help="report the environment only")
    doctor.set_defaults(run=lambda a: _doctor(a, checks))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
