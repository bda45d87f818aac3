"""stax.ElementwiseNumerical and stax.Elementwise refuse a φ that mixes entries (its
kernel would be some other network's, silently), and an elementwise φ, written as a
jnp ufunc or with jnp.where, gives the Gauss–Hermite kernel computed here in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_core import stax

NOT_ELEMENTWISE = {
    "normalised": lambda x: x / jnp.linalg.norm(x),
    "softmax": jax.nn.softmax,
    "centred": lambda x: x - x.mean(),
}


@pytest.mark.parametrize("fn", NOT_ELEMENTWISE.values(), ids=NOT_ELEMENTWISE)
def test_a_function_that_mixes_entries_is_refused(fn):
    with pytest.raises(ValueError, match=r"^stax\.ElementwiseNumerical: fn must act elementwise"):
        stax.ElementwiseNumerical(fn, 10)
    with pytest.raises(ValueError, match=r"^stax\.Elementwise: fn must act elementwise.*Fix: "):
        stax.Elementwise(fn, lambda c, v1, v2: c)


def _elu(x):
    return np.where(x > 0, x, np.expm1(np.minimum(x, 0)))


def _d_elu(x):
    return np.where(x > 0, 1.0, np.exp(np.minimum(x, 0)))


def _d_tanh(x):
    return 1 - np.tanh(x) ** 2


def _expectation(f, q11, q12, q22, deg):
    """E[f(u)·f(v)], (u, v) ~ N(0, [[q11, q12], [q12, q22]]), by numpy's probabilists'
    Gauss–Hermite nodes (deg²) in float64."""
    z, w = np.polynomial.hermite_e.hermegauss(deg)
    w = w / w.sum()
    rho = np.clip(q12 / np.sqrt(q11 * q22), -1, 1)
    u = np.sqrt(q11) * z[:, None]
    v = np.sqrt(q22) * (rho * z[:, None] + np.sqrt(1 - rho**2) * z[None, :])
    return float(np.einsum("i,j,ij->", w, w, f(u) * f(v)))


CASES = {
    "tanh": (jnp.tanh, np.tanh, _d_tanh),
    "where": (lambda x: jnp.where(x > 0, x, jnp.expm1(jnp.minimum(x, 0))), _elu, _d_elu),
}


@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_an_elementwise_function_gives_the_quadrature_kernel(case):
    """Dense -> ElementwiseNumerical(φ, 20) -> Dense in float64 against the recursion
    written here (quadrature at the same nodes, φ' by hand, the Gram matrix as the mean
    of both node orders): within 1e-10 relative."""
    fn, phi, dphi = CASES[case]
    deg = 20  # even: no node at 0, where ELU's φ' convention would matter
    x = np.random.RandomState(1).randn(3, 4)
    with jax.enable_x64(True):
        net = stax.serial(
            stax.Dense(5, W_std=1.5, b_std=0.2),
            stax.ElementwiseNumerical(fn, deg),
            stax.Dense(1, W_std=1.1, b_std=0.1),
        )
        k = net[2](x, None)
        ours = np.asarray(k.nngp), np.asarray(k.ntk)
    assert ours[0].dtype == np.float64
    q = 2.25 * x @ x.T / 4 + 0.04  # Σ = Θ after the first Dense
    n = len(x)
    sigma, dot = np.zeros((n, n)), np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            sigma[i, j] = _expectation(phi, q[i, i], q[i, j], q[j, j], deg)
            dot[i, j] = _expectation(dphi, q[i, i], q[i, j], q[j, j], deg)
    # a Gram matrix is the mean of both orders (u on x_i's nodes or on x_j's)
    sigma, dot = (sigma + sigma.T) / 2, (dot + dot.T) / 2
    nngp = 1.21 * sigma + 0.01
    ntk = nngp + 1.21 * dot * q
    for got, want in zip(ours, (nngp, ntk), strict=True):
        assert np.abs(got - want).max() <= 1e-10 * np.abs(want).max()
