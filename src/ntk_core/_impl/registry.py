"""The implementations, by name: :data:`REGISTRY`, the one place that maps an
``implementation`` option to what computes it. ``"auto"``, the planner, the cost model,
the blocked engine and the option checks read it; no other module compares names.

Each entry is an :class:`~ntk_core._impl.base.Impl` (a NamedTuple of pure functions
and capabilities), defined in its own module: ``jacobian_phases.py``,
``ntvp_phases.py``, ``structured_phases.py``; the NNGP's outputs phase is
``nngp_phases.NNGP``, selected by the kernel kind, not by the option. The entries are
listed in ``ntk_core/_impl/__init__.py``, which Python runs before any module of
``ntk_core._impl`` is used, so the dicts below are always filled when read (read them
at call time, not at import time, inside ``ntk_core._impl``).

How to add an implementation:

1. Write ``_impl/<name>_phases.py`` with its ``features(apply3, config, chunks)``
   (jitted, module-level and cached on static arguments, or None to start the
   tiles from the inputs), its ``contract`` (traced inside the tile) and its
   ``<NAME> = Impl(name=..., title=..., separates_leaves=..., whole_batch_as=...,
   pair_terms=...)``.
   Give it its cost formula, ``estimate=`` (``estimate(call) -> CostEstimate``, from
   the shared terms of :class:`ntk_core._impl.cost.Call`).
2. Add one line ``"<name>": <NAME>,`` to the registry in ``ntk_core/_impl/__init__.py``:
   the option accepts it (``IMPLEMENTATIONS``), ``plan()`` and ``"auto"`` consider it,
   the executors run it.
3. Add tests (tests/reference_grid.py, tests/core/test_cost_model.py).
"""

from __future__ import annotations

from ntk_core._impl.base import Impl

#: ``implementation="auto"``: the planner picks one of :data:`REGISTRY` per call.
AUTO = "auto"

#: The NTK implementations, in the order of ``IMPLEMENTATIONS`` and of ``plan()``'s
#: estimates (filled by ``ntk_core/_impl/__init__.py``).
REGISTRY: dict[str, Impl] = {}

#: The ``Config.implementation`` of an NNGP kernel (its outputs phase, in :data:`PHASES`).
NNGP = "nngp"

#: Every phase the engine builds, by ``Config.implementation``: the registry and the
#: NNGP's outputs.
PHASES: dict[str, Impl] = {}
