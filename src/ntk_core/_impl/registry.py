"""The implementations, by name: :data:`REGISTRY`, the one place that maps an
``implementation`` option to what computes it. ``"auto"``, the planner, the cost model,
the blocked engine and the option checks read it; no other module compares names.

Each entry is an :class:`~ntk_core._impl.base.Impl` (a NamedTuple of pure functions
and capabilities), defined in its own module: ``jacobian_phases.py``,
``ntvp_phases.py``, ``structured_phases.py``; the NNGP's outputs phase is
:data:`NNGP`, selected by the kernel kind, not by the option.

How to add an implementation:

1. Write ``_impl/<name>_phases.py`` with its ``features(apply3, config, chunks)``
   (jitted, module-level and cached on static arguments, or None to start the
   tiles from the inputs), its ``contract`` (traced inside the tile) and its
   ``<NAME> = Impl(name=..., title=..., separates_leaves=..., whole_batch_as=...,
   pair_terms=...)``.
2. Add one line ``"<name>": <NAME>,`` to :data:`REGISTRY` below: the option accepts it
   (``IMPLEMENTATIONS``), ``plan()`` and ``"auto"`` consider it, the executors run it.
3. Add its cost formula ``<name>_estimate(call) -> CostEstimate`` and one line to
   ``ntk_core._impl.cost.ESTIMATES`` (``estimate`` returns them in the registry's
   order), and tests (tests/core/test_reference_grid.py, tests/core/test_cost_model.py).
"""

from __future__ import annotations

from ntk_core._impl.base import Impl
from ntk_core._impl.jacobian_phases import JACOBIAN
from ntk_core._impl.nngp_phases import NNGP
from ntk_core._impl.ntvp_phases import NTVP
from ntk_core._impl.structured_phases import STRUCTURED

#: ``implementation="auto"``: the planner picks one of :data:`REGISTRY` per call.
AUTO = "auto"

#: The NTK implementations, in the order of ``IMPLEMENTATIONS`` and of ``plan()``'s
#: estimates.
REGISTRY: dict[str, Impl] = {
    "jacobian": JACOBIAN,
    "ntvp": NTVP,
    "structured": STRUCTURED,
}

#: Every phase the engine builds, by ``Config.implementation``: the registry and the
#: NNGP's outputs.
PHASES: dict[str, Impl] = {**REGISTRY, NNGP.name: NNGP}
