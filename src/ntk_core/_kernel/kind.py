"""The kinds of kernel, parsed once where a kernel function is built."""

from __future__ import annotations

import enum


class Kind(enum.StrEnum):
    """The kernel a function computes; each equal to the string it was before (``"ntk"``,
    ``"nngp"``, ``"ntk_per_leaf"``), which :func:`~ntk_core.adapters.build_kernel` takes."""

    NTK = "ntk"
    NNGP = "nngp"
    NTK_PER_LEAF = "ntk_per_leaf"
