"""The adapters' side of infinite-width kernels: priors read from a model's initialisers,
merged with the user's ``W_std`` / ``b_std``, handed to :func:`ntk_core.infinite_kernel_fn`.

An adapter reads one :class:`Prior` per weight and bias leaf of the layers it recognises
(the standard deviation, or why it could not be read); :func:`merge` lets the user's
values win; :class:`Deferred` builds the core's kernel function at the first call where
reading needs an input (Flax linen and Haiku create their layers while running on one).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import NamedTuple

from ntk_core._derived.graph import traced_failure
from ntk_core._derived.paths import leaf_path_names, naming
from ntk_core._errors import bad


class Prior(NamedTuple):
    """The prior of one parameter leaf: ``kind`` ``"weight"`` (W_std: its entries have
    variance W_std² / fan_in), ``"gain"`` (a LayerNorm's scale, W_std: its entries have
    mean square W_std²) or ``"bias"`` (b_std: variance b_std²); ``std`` ``None``
    when it could not be read, ``why`` then says why; ``where``: the layer, for messages."""

    path: str
    kind: str
    std: float | None
    why: str = ""
    where: str = ""

    @classmethod
    def read(cls, path: str, kind: str, variance: float | str, where: str, fan: float = 1.0):
        """The prior of a leaf whose initialiser draws entries of mean square ``variance``
        (float) with fan-in ``fan``: std = √(fan·variance); or, ``variance`` a str, why
        it could not be read (std ``None``)."""
        if isinstance(variance, str):
            return cls(path, kind, None, variance, where)
        return cls(path, kind, math.sqrt(fan * variance), "", where)


def _pdf(t: float) -> float:
    return math.exp(-t * t / 2) / math.sqrt(2 * math.pi) if math.isfinite(t) else 0.0


def _cdf(t: float) -> float:
    return 0.5 * (1 + math.erf(t / math.sqrt(2)))


def truncated_normal_moments(lower: float, upper: float) -> tuple[float, float]:
    """``(E[z], E[z²])`` of a standard normal ``z`` truncated to ``(lower, upper)``, in
    closed form: with Z = Φ(upper) − Φ(lower), E[z] = (φ(lower) − φ(upper)) / Z and
    E[z²] = 1 + (lower·φ(lower) − upper·φ(upper)) / Z (an infinite bound adds 0)."""
    z = _cdf(upper) - _cdf(lower)
    tail = lambda t: t * _pdf(t) if math.isfinite(t) else 0.0  # noqa: E731
    return (_pdf(lower) - _pdf(upper)) / z, 1 + (tail(lower) - tail(upper)) / z


def _std(fn_name: str, name: str, value, kind: str):
    """``value`` as a float (one value for every leaf), a dict (per path) or ``None``."""
    if value is None or isinstance(value, Mapping):
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    what = f"{name} must be a float or a Mapping from a {kind} leaf's path to a float"
    example = "1.5" if kind == "weight" else "0.05"
    fix = f"pass {name}={example} for every {kind}, or {name}={{'<path>': {example}}}"
    raise bad(TypeError, fn_name, f"{what}, got {type(value).__name__}", fix)


def merge(fn_name: str, priors: list[Prior], W_std=None, b_std=None, names=()) -> tuple:
    """``(W_std, b_std)`` for :func:`ntk_core.infinite_kernel_fn`: a Mapping given by the
    user replaces the read priors of the paths it names (the core checks that each names a
    leaf); a float given stands for every weight (every leaf of ``names``, the params' leaf
    paths, gains excepted: a LayerNorm's scale keeps its read prior) or every bias; a leaf
    neither read nor given is a ValueError naming it, why, and the fix."""
    out = []
    for arg, kinds in (("W_std", ("weight", "gain")), ("b_std", ("bias",))):
        given = _std(fn_name, arg, W_std if arg == "W_std" else b_std, kinds[0])
        mine = [p for p in priors if p.kind in kinds]
        if isinstance(given, float):
            gains = {p.path: p.std for p in mine if p.kind == "gain" and p.std is not None}
            out.append({**dict.fromkeys(names, given), **gains} if gains else given)
            continue
        given, read = dict(given or {}), {}
        for prior in mine:
            if prior.path in given:
                continue
            if prior.std is None:
                what = f"the {prior.kind} {prior.path!r} ({prior.where}) has no known prior: "
                fix = f"pass {arg}={{{prior.path!r}: <its std>}}"
                fix += f", or one {arg} for every {kinds[0]}" if prior.kind != "gain" else ""
                raise bad(ValueError, fn_name, what + prior.why, fix, see="infinite-priors")
            read[prior.path] = prior.std
        out.append({**read, **given})
    return tuple(out)


def _core():
    from ntk_core._derived.api import infinite_kernel_fn

    return infinite_kernel_fn


class Deferred:
    """The core's infinite-width kernel function of ``apply_fn(params, x)``, built when the
    priors are known: now with ``eager`` (``read(None)``), else at the first call, from
    ``read(x1)`` (a list of :class:`Prior`). Calls and attributes (``report(x)``, ...) go to
    the core's function; before it exists, an attribute that is a method builds it from its
    first argument, an input like x1."""

    def __init__(
        self, fn_name: str, apply_fn: Callable, params, read, W_std=None, b_std=None, eager=False
    ):
        self._name, self._apply, self._params, self._read = fn_name, apply_fn, params, read
        self._given = (
            _std(fn_name, "W_std", W_std, "weight"),
            _std(fn_name, "b_std", b_std, "bias"),
        )
        self._fn, self._merged = None, None
        if eager:
            self._build(None)

    @property
    def priors(self) -> tuple:
        """``(W_std, b_std)`` as passed to the core (``None`` before the first call)."""
        return self._merged if self._fn is not None else None  # set with _fn

    def _build(self, x):
        if self._fn is None:
            try:
                read = self._read(x)
            except Exception as e:  # noqa: BLE001 - the model failed on x: say on what shape
                shape = getattr(x, "shape", None)
                if shape is None or str(e).startswith("ntk_"):  # one of ours: as it is
                    raise
                raise traced_failure(self._name, shape, e) from e
            names = leaf_path_names(self._params)
            self._merged = merge(self._name, read, *self._given, names=names)
            w, b = self._merged
            with naming(self._name):
                self._fn = _core()(self._apply, self._params, W_std=w, b_std=b)
            self._fn.caller = self._name  # its messages name the adapter's function
        return self._fn

    def __call__(self, x1, x2=None, get=None, **options):
        return self._build(x1)(x1, x2, get, **options)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if self._fn is not None:
            return getattr(self._fn, name)

        def method(x, *args, **kwargs):
            return getattr(self._build(x), name)(x, *args, **kwargs)

        return method

    def __repr__(self) -> str:
        return f"<{self._name} kernel function{'' if self._fn else ' (built at its first call)'}>"
