"""One nonlinearity from a traced chain of elementwise operations: the stax layer whose
closed form it is, checked numerically, or quadrature of the chain itself.

The chain f(u) is evaluated (float64) on a grid of pre-activations; a candidate closed
form (ABRelu: ReLU, leaky ReLU, |x|; a·erf(b·x) + c; exact GELU; sin, cos; a·e^(b·x);
sign) is accepted where it agrees with f to 1e-12 relatively everywhere on the grid and
its parameters are read from f's values. Otherwise ``ElementwiseNumerical(f, deg)``: the
chain itself by Gauss–Hermite quadrature (tanh, the logistic sigmoid, SiLU, tanh-GELU).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import numpy as np
from jax.scipy.special import erf

GRID = np.concatenate([np.linspace(-6.0, 6.0, 97), [-30.0, -0.01, 0.013, 30.0]])
Q_GRID = (0.05, 0.7, 1.0, 2.5, 40.0)


@dataclasses.dataclass(frozen=True)
class Form:
    """``name``: how the report shows it; ``linear``: a when f(u) = a·u (a scaling, not a
    nonlinearity), else None; ``make(deg)``: its stax layer."""

    name: str
    linear: float | None
    make: Callable | None
    closed: bool
    fn: Callable | None = None  # φ itself (the traced chain)
    homogeneous: bool = False  # φ'(u)·u = φ(u) (ABRelu): E[φ'φ'·uv] is the NNGP


def _values(fn, u):
    with jax.enable_x64(True):
        return np.asarray(fn(np.asarray(u, np.float64)), np.float64)


def values_key(fn) -> bytes:
    """φ's float64 values at a few points: equal keys of two forms of the same name mean
    the same closed form (its parameters were read from these values)."""
    return _values(fn, [0.0, 1.0, -1.0, 0.5, -2.0, 60.0]).tobytes()


def _close(a, b, tol=1e-12) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or not np.all(np.isfinite(a)) or not np.all(np.isfinite(b)):
        return False
    return bool(np.all(np.abs(a - b) <= tol * (1 + np.abs(b))))


def identify(f, prims) -> Form:
    """The stax form of the chain ``f(u, q)`` (q unused), from its values on :data:`GRID`
    and the primitives ``prims`` it is made of."""
    from ntk_core._infinite import layers as stax  # the layers, not the public face

    def fn(u):
        return f(u, u)

    try:
        y = _values(fn, GRID)
        y0, yp, ym = (float(v) for v in _values(fn, [0.0, 1.0, -1.0]))
    except Exception:  # noqa: BLE001 - a chain that cannot run in float64: quadrature
        y = None
    u = GRID
    tol = 1e-12
    if y is not None:
        if _close(y, yp * u, tol):
            return Form(f"scaling by {yp:g}", yp, None, True)
        a, b = 0.0 - ym, yp  # 0.0 - 0.0 is +0.0: no "ABRelu(-0, 1)" in reports
        if _close(y, a * np.minimum(u, 0) + b * np.maximum(u, 0), tol):
            if (a, b) == (0.0, 1.0):
                return Form("Relu()", None, lambda deg: stax.Relu(), True, fn, True)
            return Form(
                f"ABRelu({a:g}, {b:g})", None, lambda deg: stax.ABRelu(a, b), True, fn, True
            )
        if "erf" in prims or "erfc" in prims:
            gelu = u * 0.5 * (1 + np.asarray(_values(lambda t: erf(t / math.sqrt(2)), u)))
            if _close(y, gelu, tol):
                return Form("Gelu() (exact)", None, lambda deg: stax.Gelu(), True, fn)
            c = y0
            amp = float(_values(fn, [60.0])[0]) - c
            slope = float(_values(lambda t: jax.jvp(fn, (t,), (np.ones_like(t),))[1], [0.0])[0])
            if amp != 0:
                b_ = slope * math.sqrt(math.pi) / (2 * amp)
                cand = amp * np.asarray(_values(lambda t: erf(b_ * t), u)) + c
                if _close(y, cand, 1e-10):
                    return Form(
                        f"Erf({amp:g}, {b_:g}, {c:g})",
                        None,
                        lambda deg: stax.Erf(amp, b_, c),
                        True,
                        fn,
                    )
        if "sin" in prims and _close(y, np.sin(u), tol):
            return Form("Sin()", None, lambda deg: stax.Sin(), True, fn)
        if "cos" in prims and _close(y, np.cos(u), tol):
            return Form("Cos()", None, lambda deg: stax.Cos(), True, fn)
        if "exp" in prims and y0 != 0:
            b_ = math.log(yp / y0) if yp / y0 > 0 else None
            if b_ is not None and _close(y[np.abs(u) < 7], y0 * np.exp(b_ * u[np.abs(u) < 7])):
                return Form(f"Exp({y0:g}, {b_:g})", None, lambda deg: stax.Exp(y0, b_), True, fn)
        if "sign" in prims and _close(y, np.sign(u), tol):
            return Form("Sign()", None, lambda deg: stax.Sign(), True, fn)
    label = "+".join(p for p in prims if p not in ("convert_element_type", "copy")) or "chain"

    def numerical(deg):
        fn.__name__ = label
        return stax.ElementwiseNumerical(fn, deg)

    return Form(f"quadrature of {label}", None, numerical, False, fn)


def normaliser(f):
    """s(q) where f(u, q) = u·s(q) (a LayerNorm-like rescaling by a function of the
    pre-activation's variance q), checked on a grid of u and q; None otherwise."""
    try:  # every q of the grid in one compiled evaluation: the chain holds the statistics'
        # quadratures, hundreds of operations, each a compilation of its own if run eagerly
        q = np.asarray(Q_GRID, np.float64)
        u = np.concatenate([np.tile(GRID, q.size), np.ones_like(q)])
        with jax.enable_x64(True):
            values = jax.jit(f)(u, np.concatenate([np.repeat(q, GRID.size), q]))
            values = np.asarray(values, np.float64)
        y, ones = values[: -q.size].reshape(q.size, GRID.size), values[-q.size :]
        if not all(_close(y[k], ones[k] * GRID, 1e-9) for k in range(q.size)):
            return None
    except Exception:  # noqa: BLE001 - not a rescaling
        return None
    inverse = 1 / ones**2  # LayerNorm of a Gaussian: s(q)⁻² = q + ε exactly (E[u] = 0,
    a = (inverse[-1] - inverse[0]) / (q[-1] - q[0])  # E[u²] = q: its quadratures are exact)
    b = float(inverse[0] - a * q[0])
    if a > 0 and b >= 0 and _close(inverse, a * q + b, 1e-12):
        a = float(a)
        return lambda q: jax.lax.rsqrt(a * q + b)  # not hundreds of quadrature operations

    def scale(q):
        import jax.numpy as jnp

        return f(jnp.ones_like(q), q) - f(jnp.zeros_like(q), q)

    return scale
