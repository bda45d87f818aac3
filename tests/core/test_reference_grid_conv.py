"""The reference grid (tests/reference_grid.py), second half of the models (the
convolutional networks, the MLP and the pytree model): every implementation x model x
axes setting x (x2 given or None) against the independent float64 reference. Full grid,
no sampling; the other models are in test_reference_grid.py."""

from __future__ import annotations

import reference_grid

test_ntk_matches_reference, test_nngp_matches_reference = reference_grid.tests(reference_grid.CONV)
