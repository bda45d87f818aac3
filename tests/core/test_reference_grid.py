"""The reference grid (tests/reference_grid.py), first half of the models: every
implementation x model x axes setting x (x2 given or None) against the independent
float64 reference. Full grid, no sampling; the other models are in
test_reference_grid_conv.py."""

from __future__ import annotations

import core_zoo
import reference_grid

test_ntk_matches_reference, test_nngp_matches_reference = reference_grid.tests(reference_grid.FIRST)


def test_the_two_grid_files_cover_the_zoo_once():
    models = reference_grid.FIRST + reference_grid.CONV
    assert sorted(models) == sorted(core_zoo.ZOO)
