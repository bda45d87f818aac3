"""The kinds of kernel, parsed once where a kernel function is built."""

from __future__ import annotations

import enum


class Kind(str, enum.Enum):  # enum.StrEnum needs Python 3.11; the project supports 3.10
    """The kernel a function computes; each equal to the string it was before (``"ntk"``,
    ``"nngp"``, ``"ntk_per_leaf"``), which :func:`~ntk_core.adapters.build_kernel` takes."""

    __str__ = str.__str__  # "ntk", not "Kind.NTK" (messages, manifests)

    NTK = "ntk"
    NNGP = "nngp"
    NTK_PER_LEAF = "ntk_per_leaf"


#: Options of the NTK kinds that the NNGP refuses: it takes no derivative.
NTK_ONLY = ("implementation", "wrt")
#: ``build_kernel``'s kind for the pseudo-NTK: the NTK of the outputs' sum over √O.
PNTK = "pntk"
