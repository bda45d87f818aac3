"""The one-call executor (``batch_size=None``): the features of x1 and x2, then the
contraction, the same compiled phases as one tile of :mod:`ntk_core._blocked.tiles`."""

from __future__ import annotations

import jax

from ntk_core._blocked import tiles as _blocked
from ntk_core._kernel import checks as _checks
from ntk_core._kernel.pipeline import Config, Implementation


def one_call(implementation: Implementation, params, x1, x2, aux):
    """``(kernel, finite)`` of x1 and x2 (None: x1, exactly symmetric), on the device."""
    same = x2 is None
    features = implementation.features
    if features is None:  # "ntvp": pairwise, from the inputs
        return implementation.tile(params, None, None, aux, x1, x2, same)
    f1 = features(params, x1, aux)
    f2 = None if same else features(params, x2, aux)
    return implementation.tile(params, f1, f2, aux, None, None, same)


def check_finite_result(fn_name: str, result, config: Config, finite, x1, x2, params) -> None:
    """NonFiniteError for a non-finite one-call kernel, naming the first non-finite input
    sample or parameter leaf, else entry; nothing under an outer ``jax.jit``."""
    if _checks.concrete_bool(finite) is not False:
        return
    _checks.check_finite_inputs(fn_name, x1, x2, params)
    leaf = jax.tree.leaves(result)[0]
    diagonal = config.layouts[0].batch_diagonal
    n1 = leaf.shape[0]
    n2 = n1 if diagonal else leaf.shape[1]
    raise _blocked.nonfinite_tile_error(fn_name, result, 0, n1, 0, n2, diagonal)
