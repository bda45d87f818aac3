"""The implementations by name (:data:`REGISTRY`), the one place that maps an
``implementation`` option to an :class:`~ntk_core._impl.base.Impl`. Filled by
``ntk_core/_impl/__init__.py``: read the dicts at call time. How to add one:
docs/architecture.md, "Implementations"."""

from __future__ import annotations

from ntk_core._impl.base import Impl

#: ``implementation="auto"``: the planner picks one of :data:`REGISTRY` per call.
AUTO = "auto"
#: The NTK implementations, in the order of ``IMPLEMENTATIONS`` and ``plan()``.
REGISTRY: dict[str, Impl] = {}
#: The ``Config.implementation`` of an NNGP kernel (its outputs phase, in :data:`PHASES`).
NNGP = "nngp"
#: Every phase the engine builds, by ``Config.implementation`` (REGISTRY and NNGP).
PHASES: dict[str, Impl] = {}
