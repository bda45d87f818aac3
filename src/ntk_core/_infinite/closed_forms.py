"""E[φ(u)φ(v)] and E[φ'(u)φ'(v)] for (u, v) ~ N(0, [[q11, q12], [q12, q22]]).

Each form maps arrays (q11, q12, q22), broadcast together, to (Σ', Σ̇): the NNGP of the
layer's output and the derivative kernel that multiplies the NTK (Θ' = Σ̇·Θ). By Price's
theorem Σ̇ = ∂Σ'/∂q12, which is how :func:`by_autodiff` completes a user's ``nngp_fn``.

Stable forms: angles from the normalised correlation ρ = q12 / √(q11 q22) by
:func:`arccos` / :func:`arcsin` below, which take √((1 − |ρ|)/2) near |ρ| = 1 (the
naive arccos loses all precision there; products of variances overflow float32 in deep
networks); square roots whose derivative is set to 0 where their argument
is 0 (the kernel's derivative there is finite: the infinite parts cancel), so gradients
of a kernel with respect to its inputs are finite at x = 0 and on the diagonal.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


@jax.custom_jvp
def safe_sqrt(x):
    """√max(x, 0), with derivative 0 where x <= 0 (instead of inf)."""
    return jnp.sqrt(jnp.maximum(x, 0))


@safe_sqrt.defjvp
def _safe_sqrt_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = safe_sqrt(x)
    positive = y > 0
    return y, jnp.where(positive, t / (2 * jnp.where(positive, y, 1)), 0)


# asin(w) = w + w·z·R(z), z = w², for 0 <= w <= 1/2: R's coefficients (constant term
# first) fitted by least squares at 2 000 Chebyshev nodes of z in [0, 1/4] to R's Taylor
# series summed to 80 terms (R(z) = Σ_k C(2k, k)·z^(k−1) / (4^k·(2k + 1)), k >= 1), in
# float64. Largest relative error of asin(w) over [0, 1/2]: 2.8e-10 with the degree 5 fit
# (float32's ulp is 6e-8) and 2.2e-16 (one float64 ulp) with degree 11.
_ASIN_R32 = (
    0.16666659961280153, 0.07500503585091085, 0.04451729918580211, 0.03180376183807615,
    0.014456047596055677, 0.037489783516329915,
)  # fmt: skip
_ASIN_R64 = (
    0.16666666666665392, 0.07500000000339302, 0.04464285682891973, 0.03038195904117896,
    0.02237176166907413, 0.01735963355586167, 0.013886084746400972, 0.012162747289374136,
    0.006559573993130566, 0.019432275844501922, -0.016059385760185268, 0.03179000100072361,
)  # fmt: skip


def _asin_parts(x):
    """(near, p): ``near`` where |x| <= 1/2, and p = asin(w) for w = |x| there, else
    w = √((1 − |x|)/2) (asin|x| = π/2 − 2·asin w, exact in w where 1 − |x| is). A
    polynomial: XLA CPU's atan2 / acos / asin cost 14-36 ns a value, this 2-4 ns."""
    a = jnp.abs(x)
    near = a <= 0.5
    w = jnp.where(near, a, safe_sqrt((1 - a) * 0.5))  # derivative 0 at |x| = 1, as before
    z = w * w
    coefficients = _ASIN_R64 if x.dtype == jnp.float64 else _ASIN_R32
    r = coefficients[-1]
    for c in reversed(coefficients[:-1]):
        r = r * z + c
    return near, w + w * z * r


def arccos(x):
    """arccos x for x in [-1, 1] (clipped before), to one ulp of float64 and about two of
    float32 (the float32 rounding of π at x = −1); exactly 0 at x = 1."""
    near, p = _asin_parts(x)
    return jnp.where(
        near, math.pi / 2 - jnp.where(x < 0, -p, p), jnp.where(x < 0, math.pi - 2 * p, 2 * p)
    )


def arcsin(x):
    """arcsin x for x in [-1, 1], accurate as :func:`arccos` (relatively, near 0)."""
    near, p = _asin_parts(x)
    a = jnp.where(near, p, math.pi / 2 - 2 * p)
    return jnp.where(x < 0, -a, a)


def _correlation(q11, q12, q22):
    """(√(q11 q22), ρ clipped to [-1, 1]); ρ = 0 where a variance is 0. √(q·q) is q
    exactly in IEEE arithmetic (√q·√q is not), so a sample with itself has ρ = 1 and
    θ = 0 exactly; √q11·√q22 only where the product overflows."""
    product = q11 * q22
    norm = jnp.where(jnp.isfinite(product), safe_sqrt(product), safe_sqrt(q11) * safe_sqrt(q22))
    positive = norm > 0
    rho = jnp.where(positive, q12 / jnp.where(positive, norm, 1), 0)
    return norm, jnp.clip(rho, -1, 1)


def ab_relu(a: float, b: float):
    """φ(x) = a·min(x, 0) + b·max(x, 0) = a·x + (b − a)·relu(x): the arc-cosine kernel of
    order 1 (Cho & Saul 2009), θ = arccos ρ:

        Σ' = a·b·q12 + (b − a)²·√(q11 q22)·(sin θ + (π − θ) cos θ) / (2π)
        Σ̇ = (a² + b²)·(π − θ) / (2π) + a·b·θ / π
    """

    def forms(q11, q12, q22):
        norm, rho = _correlation(q11, q12, q22)
        sin = safe_sqrt(1 - rho * rho)
        theta = arccos(rho)  # one angle for both kernels
        relu_pair = norm * (sin + (math.pi - theta) * rho) / (2 * math.pi)
        nngp = a * b * q12 + (b - a) ** 2 * relu_pair
        dot = (a * a + b * b) * (math.pi - theta) / (2 * math.pi) + a * b * theta / math.pi
        return nngp, dot

    return forms


def erf(a: float, b: float, c: float):
    """φ(x) = a·erf(b·x) + c (Williams 1997), with Q = 2b²q:

    Σ' = a²·(2/π)·arcsin(Q12 / √((1 + Q11)(1 + Q22))) + c²
    Σ̇ = a²b²·(4/π) / √((1 + Q11)(1 + Q22) − Q12²)
    """

    def forms(q11, q12, q22):
        s1, s2 = jnp.sqrt(1 + 2 * b * b * q11), jnp.sqrt(1 + 2 * b * b * q22)
        r = jnp.clip(2 * b * b * q12 / (s1 * s2), -1, 1)
        nngp = a * a * (2 / math.pi) * arcsin(r) + c * c
        dot = a * a * b * b * (4 / math.pi) / (s1 * s2 * safe_sqrt(1 - r * r))
        return nngp, dot

    return forms


def gelu(q11, q12, q22):
    """φ(x) = x·Φ(x) (exact GELU; Tsuchida et al. 2021, arXiv 2002.08517), with
    P = (1 + q11)(1 + q22) and Δ = √(P − q12²):

        Σ' = q12 / 4 + (q12·arcsin(q12 / √P) + (q12² + q11 q22 Δ²) / (P Δ)) / (2π)

    and Σ̇ = ∂Σ'/∂q12 by autodiff (Δ² >= 1 + q11 + q22 > 0: no singular point)."""

    def nngp(c):
        p = (1 + q11) * (1 + q22)
        delta2 = p - c * c
        delta = jnp.sqrt(delta2)
        angle = jnp.arctan2(c, delta)  # arcsin(c / √P)
        return c / 4 + (c * angle + (c * c + q11 * q22 * delta2) / (p * delta)) / (2 * math.pi)

    return jax.jvp(nngp, (q12,), (jnp.ones_like(q12),))


def sin(a: float, b: float, c: float):
    """φ(x) = a·sin(b·x + c), with A = b²(q11 + q22 − 2q12)/2, B = b²(q11 + q22 + 2q12)/2:

    Σ' = a²/2·(e^−A − cos(2c)·e^−B),   Σ̇ = a²b²/2·(e^−A + cos(2c)·e^−B)
    """

    def forms(q11, q12, q22):
        minus = jnp.exp(-b * b * (q11 + q22 - 2 * q12) / 2)
        plus = math.cos(2 * c) * jnp.exp(-b * b * (q11 + q22 + 2 * q12) / 2)
        return a * a / 2 * (minus - plus), a * a * b * b / 2 * (minus + plus)

    return forms


def exp(a: float, b: float):
    """φ(x) = a·e^(b·x): Σ' = a²·e^(b²(q11 + q22 + 2q12)/2), Σ̇ = b²·Σ'."""

    def forms(q11, q12, q22):
        nngp = a * a * jnp.exp(b * b * (q11 + q22 + 2 * q12) / 2)
        return nngp, b * b * nngp

    return forms


def sign(q11, q12, q22):
    """φ(x) = sign(x): Σ' = (2/π)·arcsin ρ; Σ̇ = 0 (φ' = 0 almost everywhere)."""
    _, rho = _correlation(q11, q12, q22)
    nngp = (2 / math.pi) * arcsin(rho)
    return nngp, jnp.zeros_like(nngp)


def by_autodiff(nngp_fn, d_nngp_fn=None):
    """A user's ``nngp_fn(cov12, var1, var2)`` (neural-tangents' ``Elementwise``) as a
    form; Σ̇ from ``d_nngp_fn`` or, if None, ∂nngp_fn/∂cov12 (Price's theorem)."""

    def forms(q11, q12, q22):
        if d_nngp_fn is not None:
            return nngp_fn(q12, q11, q22), d_nngp_fn(q12, q11, q22)
        return jax.jvp(lambda c: nngp_fn(c, q11, q22), (q12,), (jnp.ones_like(q12),))

    return forms


def elementwise_derivative(fn):
    """φ' of an elementwise ``fn`` by forward-mode autodiff."""
    return lambda x: jax.jvp(fn, (x,), (jnp.ones_like(x),))[1]


def quadrature(fn, deg: int, dfn=None):
    """Any φ by 2-D Gauss–Hermite quadrature with deg² nodes: u = √q11·z1,
    v = √q22·(ρ·z1 + √(1 − ρ²)·z2), z1, z2 ~ N(0, 1) at the probabilists' Hermite nodes;
    φ' by autodiff unless ``dfn`` is given. Exact for polynomials of degree < 2·deg in
    each variable; smooth φ converge fast (neural-tangents suggests deg = 25), kinks (ReLU)
    slowly. One node pair at a time: memory of one kernel, deg² elementwise passes."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(deg)
    weights = weights / weights.sum()
    dfn = elementwise_derivative(fn) if dfn is None else dfn
    grid = np.stack(np.meshgrid(np.arange(deg), np.arange(deg), indexing="ij"), -1).reshape(-1, 2)

    def forms(q11, q12, q22):
        q11, q12, q22 = jnp.broadcast_arrays(q11, q12, q22)
        _, rho = _correlation(q11, q12, q22)
        s1, s2, tail = safe_sqrt(q11), safe_sqrt(q22), safe_sqrt(1 - rho * rho)
        z, w = jnp.asarray(nodes, q12.dtype), jnp.asarray(weights, q12.dtype)

        def body(k, sums):
            i, j = grid_j[k, 0], grid_j[k, 1]
            u, v = s1 * z[i], s2 * (rho * z[i] + tail * z[j])
            weight = w[i] * w[j]
            return sums[0] + weight * fn(u) * fn(v), sums[1] + weight * dfn(u) * dfn(v)

        grid_j = jnp.asarray(grid)
        zero = jnp.zeros_like(q12)
        return jax.lax.fori_loop(0, len(grid), body, (zero, zero))

    return forms
