"""The implementations and their cost; the registry's entries, in ``plan()``'s order."""

from ntk_core._impl.jacobian_phases import JACOBIAN
from ntk_core._impl.nngp_phases import NNGP
from ntk_core._impl.ntvp_phases import NTVP
from ntk_core._impl.registry import PHASES, REGISTRY
from ntk_core._impl.structured_phases import STRUCTURED

REGISTRY.update((impl.name, impl) for impl in (JACOBIAN, NTVP, STRUCTURED))
PHASES.update(REGISTRY, nngp=NNGP)
