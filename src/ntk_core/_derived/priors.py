"""The priors of a derived kernel: each weight, gain and bias leaf's standard deviation,
read from ``W_std=`` / ``b_std=`` (one float, or a Mapping from a leaf's path name), and
checked against the given parameter values.

Meaning: a weight leaf used with fan-in n has entries of variance W_std²/n at
initialisation, a gain leaf (fan-in 1) entries of mean square W_std², a bias leaf entries
of variance b_std². The kernel is defined by the priors; the values only test them: a
weight leaf whose n·mean(W²)/W_std² is off 1 by more than 6/√(size/2) (six standard
deviations of that estimate for Gaussian and uniform entries) gets a UserWarning naming
it, its estimate and its prior.
"""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Mapping

import numpy as np

from ntk_core._derived.paths import caller
from ntk_core._errors import bad, check_real

ARGUMENT = {"weight": "W_std", "gain": "W_std", "bias": "b_std"}


def check_argument(name: str, value, names: list[str]):
    """``value`` (None, a float, or a Mapping path -> float) checked at construction."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        out = {}
        for path, std in value.items():
            if not isinstance(path, str) or path not in names:
                near = ", ".join(map(repr, difflib.get_close_matches(str(path), names, 3, 0.0)))
                what = f"{name} names the parameter {path!r}, which is not a leaf of params"
                fix = f"use a name of ntk_core.adapters.leaf_path_names(params); nearest: {near}"
                raise bad(ValueError, caller(), what, fix)
            out[path] = check_real(caller(), f"{name}[{path!r}]", std, f"pass a finite {name} >= 0")
        return out
    return check_real(
        caller(),
        name,
        value,
        f"pass a finite {name} >= 0, e.g. {name}=1.0, or a dict from leaf path names to stds",
    )


def _root(leaf: int, parents: dict) -> int:
    """The stored leaf a slice leaf (one layer of a stack, ``"w[3]"``) comes from."""
    while leaf in parents:
        leaf = parents[leaf][0]
    return leaf


def _values(leaf: int, leaves: list, parents: dict):
    if leaf in parents:
        parent, index = parents[leaf]
        return np.asarray(_values(parent, leaves, parents))[index]
    return leaves[leaf]


def resolve(roles: dict, names: list[str], w_std, b_std, parents=None) -> dict:
    """{leaf: std} for every leaf the graph uses; ValueError for one without a prior. A
    slice of a stacked leaf (``parents``: slice -> (leaf, index)) has the stack's prior."""
    out, parents = {}, parents or {}
    for leaf, (role, _, source) in roles.items():
        arg = ARGUMENT[role]
        value = w_std if arg == "W_std" else b_std
        key = names[_root(leaf, parents)]
        if isinstance(value, dict):
            value = value.get(key)
        if value is None:
            what = f"the {role} {names[leaf]!r} (used at {source}) has no prior"
            square = ("mean square" if role == "gain" else "variance") + f" is {arg}²"
            fix = f"pass {arg}={{{key!r}: std}} (or one {arg}=float for every {role}): "
            per = "/fan_in" if role == "weight" else ""
            raise bad(ValueError, caller(), what, f"{fix}its entries' {square}{per}")
        out[leaf] = float(value)
    return out


def check_values(roles: dict, names: list[str], leaves: list, priors: dict, parents=None) -> None:
    """UserWarning for each weight or gain leaf whose values contradict its prior (a
    stack's slices each on their own)."""
    for leaf, (role, fan_in, _) in roles.items():
        try:
            values = np.asarray(_values(leaf, leaves, parents or {}), np.float64)
        except Exception:  # noqa: BLE001 - traced or abstract values: nothing to check
            continue
        n = values.size
        std = priors[leaf]
        mean_sq = float(np.mean(values * values)) if n else 0.0
        if role == "bias":
            if mean_sq == 0.0 or n < 2:
                continue  # zero-initialised biases: any b_std is a prior, not a fact
            ratio, estimate = (mean_sq / std**2 if std else math.inf), math.sqrt(mean_sq)
        else:
            estimate = math.sqrt(fan_in * mean_sq)
            ratio = fan_in * mean_sq / std**2 if std else (0.0 if mean_sq == 0 else math.inf)
            if std == 0 and mean_sq == 0:
                continue
        tol = 6 / math.sqrt(max(n, 1) / 2)
        if role == "gain" and np.all(values == values.reshape(-1)[0]):
            tol = 1e-6  # a constant gain (LayerNorm's ones): its mean square is exact
        if abs(ratio - 1) > tol:
            arg = ARGUMENT[role]
            what = "√(fan_in·mean(W²))" if role == "weight" else "√mean(x²)"
            warnings.warn(
                f"{caller()}: the {role} {names[leaf]!r} has {what} = {estimate:.4g}, but its "
                f"prior {arg} is {std:.4g}. The kernel follows the prior. Fix: pass the {arg} its "
                "initialiser used, or check the parameters.",
                UserWarning,
                stacklevel=4,
            )
