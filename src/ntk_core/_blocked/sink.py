"""What ``out=`` may be besides a path: a :class:`Sink`, which opens the store of each
call (the Monte Carlo kernels' running sums, :mod:`ntk_core._monte_carlo.files`)."""

from __future__ import annotations


class Sink:
    """Where a blocked call with ``out=`` writes when ``out`` is not a path: ``open``
    returns the call's :class:`~ntk_core._blocked.store.NpyStore` for its
    :class:`~ntk_core._blocked.store.FileLayout`. ``path`` names it in messages."""

    path: str

    def open(self, fn: str, layout, x1, x2, params, aux):
        raise NotImplementedError
