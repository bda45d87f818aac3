"""The ``ntk`` command line (``ntk demo``, ``ntk track``, ``ntk doctor``): the one package
that may import the core and both adapters."""

from ntk_cli.cli import main as main

__all__ = ("main",)
