"""``out=`` other than a path (the Monte Carlo kernels' running sums)."""

from __future__ import annotations


class Sink:
    """``open`` returns a call's :class:`~ntk_core._blocked.store.NpyStore` for its
    :class:`~ntk_core._blocked.store.FileLayout`; ``path`` names it in messages."""

    path: str

    def open(self, fn: str, layout, x1, x2, params, aux):
        raise NotImplementedError
