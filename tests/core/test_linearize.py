"""ntk_core.linearize and ntk_core.taylor_expand against independent references.

- Models linear / quadratic / cubic in their parameters, whose expansions are known in
  closed form (written out by hand here, in float64 NumPy).
- A tanh MLP's JVP against its hand-written float64 Jacobian, flattened and contracted;
  and, in a float64 process, against ``jax.jacrev`` / ``jax.hessian`` contractions
  (that check runs in tests/core/test_isolation.py's shared x64 process).
- Training the linearised MLP with full-batch SGD on the MSE against
  ``predict.gradient_descent_mse`` of its NTK, with an analytic tolerance.
- Every documented error, by message.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ntk_core
import reference
from ntk_core import predict


def _normal(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.PRNGKey(seed), shape)


def _f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


X = _normal(0, (6, 3))


# -- models linear in their parameters: the linearisation is the model ---------------


def affine(p, x):
    return x @ p["w"] + p["b"]


A = _normal(1, (3, 16))


def random_features(p, x):  # params as a list and a tuple: any pytree
    v, (b,) = p
    return jnp.tanh(x @ A) @ v + b


def affine64(p, x):
    return x @ p["w"] + p["b"]


def random_features64(p, x):
    v, (b,) = p
    return np.tanh(x @ np.asarray(A, np.float64)) @ v + b


LINEAR = {
    "affine": (
        affine,
        affine64,
        {"w": _normal(2, (3, 2)), "b": _normal(3, (2,))},
        {"w": _normal(4, (3, 2), 3.0), "b": _normal(5, (2,), 3.0)},
    ),
    "random_features": (
        random_features,
        random_features64,
        [_normal(6, (16, 2)), (_normal(7, (2,)),)],
        [_normal(8, (16, 2), 3.0), (_normal(9, (2,), 3.0),)],
    ),
}


@pytest.mark.parametrize("name", list(LINEAR))
def test_linear_model_equals_its_linearisation_far_from_params0(name):
    f, f64, params0, params = LINEAR[name]
    f_lin = ntk_core.linearize(f, params0)
    x64 = np.asarray(X, np.float64)
    expected = f64(_f64(params), x64)
    reference.assert_close(f_lin(params, X), expected)  # float32 round-off
    reference.assert_close(f_lin(params0, X), f64(_f64(params0), x64))
    for degree in (1, 2, 3):  # higher terms vanish
        f_taylor = jax.jit(ntk_core.taylor_expand(f, params0, degree))
        reference.assert_close(f_taylor(params, X), expected)


# -- polynomial models: each degree against the hand-written expansion -----------------


def product(p, x):  # (x W1) ⊙ (x W2): degree 2
    return (x @ p["w1"]) * (x @ p["w2"])


def chain(p, x):  # x W1 W2: degree 2
    return x @ p["w1"] @ p["w2"]


def product_terms(p0, d, x):
    """[f, D f[δ], D²f[δ, δ] / 2] of ``product`` in float64."""
    a1, a2, d1, d2 = x @ p0["w1"], x @ p0["w2"], x @ d["w1"], x @ d["w2"]
    return [a1 * a2, d1 * a2 + a1 * d2, d1 * d2]


def chain_terms(p0, d, x):
    w1, w2, d1, d2 = p0["w1"], p0["w2"], d["w1"], d["w2"]
    return [x @ w1 @ w2, x @ d1 @ w2 + x @ w1 @ d2, x @ d1 @ d2]


QUADRATIC = {
    "product": (product, product_terms, (3, 4), (3, 4)),
    "chain": (chain, chain_terms, (3, 5), (5, 2)),
}


@pytest.mark.parametrize("name", list(QUADRATIC))
def test_quadratic_model_every_degree_against_hand_written_terms(name):
    f, terms, s1, s2 = QUADRATIC[name]
    params0 = {"w1": _normal(10, s1), "w2": _normal(11, s2)}
    params = {"w1": _normal(12, s1, 2.0), "w2": _normal(13, s2, 2.0)}
    p0, d = _f64(params0), jax.tree.map(lambda a, b: a - b, _f64(params), _f64(params0))
    t0, t1, t2 = terms(p0, d, np.asarray(X, np.float64))
    scale = np.abs(t0).max() + np.abs(t1).max() + np.abs(t2).max()
    expected = {0: t0, 1: t0 + t1, 2: t0 + t1 + t2, 3: t0 + t1 + t2}
    for degree, value in expected.items():
        got = jax.jit(ntk_core.taylor_expand(f, params0, degree))(params, X)
        reference.assert_close(got, value, scale=scale)
    np.testing.assert_allclose(  # degree 2 is the model
        expected[2], np.asarray(f(_f64(params), np.asarray(X, np.float64))), rtol=1e-12
    )
    lin = ntk_core.linearize(f, params0)(params, X)
    np.testing.assert_array_equal(lin, ntk_core.taylor_expand(f, params0, 1)(params, X))


def test_cubic_model_checks_the_factorials():
    """(x w)³ = a³ + 3a²δ + 3aδ² + δ³ with a = x w0, δ = x (w − w0): the 1/k! weights."""

    def cube(w, x):
        return (x @ w) ** 3

    w0, w = _normal(20, (3, 2)), _normal(21, (3, 2))
    a = np.asarray(X, np.float64) @ np.asarray(w0, np.float64)
    d = np.asarray(X, np.float64) @ (np.asarray(w, np.float64) - np.asarray(w0, np.float64))
    terms = [a**3, 3 * a**2 * d, 3 * a * d**2, d**3]
    scale = sum(np.abs(t).max() for t in terms)
    for degree in range(5):
        got = jax.jit(ntk_core.taylor_expand(cube, w0, degree))(w, X)
        reference.assert_close(got, sum(terms[: degree + 1]), scale=scale)


# -- a tanh MLP: the JVP against its explicit float64 Jacobian --------------------------


def mlp(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def mlp_params(seed, d=3, h=8, o=2, scale=1.0):
    return {
        "w1": _normal(seed, (d, h), scale / math.sqrt(d)),
        "b1": _normal(seed + 1, (h,), 0.1 * scale),
        "w2": _normal(seed + 2, (h, o), scale / math.sqrt(h)),
        "b2": _normal(seed + 3, (o,), 0.1 * scale),
    }


def mlp_jacobian(p, x):
    """∂f/∂θ of ``mlp`` by hand, float64 ``(N, O, P)``, P in ``jax.tree.leaves`` order
    (b1, b2, w1, w2: dict keys sorted), each leaf flattened row-major."""
    p, x = _f64(p), np.asarray(x, np.float64)
    h = np.tanh(x @ p["w1"] + p["b1"])
    s = 1.0 - h**2  # tanh'
    n, o = x.shape[0], p["w2"].shape[1]
    eye = np.eye(o)
    j_b1 = np.einsum("nj,jo->noj", s, p["w2"])
    j_b2 = np.broadcast_to(eye, (n, o, o))
    j_w1 = np.einsum("nk,nj,jo->nokj", x, s, p["w2"]).reshape(n, o, -1)
    j_w2 = np.einsum("nj,oq->nojq", h, eye).reshape(n, o, -1)
    return np.concatenate([j_b1, j_b2, j_w1, j_w2], axis=-1)


def test_jvp_equals_hand_written_float64_jacobian_contraction():
    params0, params = mlp_params(30), mlp_params(40)
    jac = mlp_jacobian(params0, X)
    delta = np.concatenate(
        [
            np.ravel(a)
            for a in jax.tree.leaves(jax.tree.map(np.subtract, _f64(params), _f64(params0)))
        ]
    )
    expected = _mlp64(_f64(params0)) + jac @ delta
    reference.assert_close(ntk_core.linearize(mlp, params0)(params, X), expected)
    # the reference itself: J·δ against a central difference (float64, step 1e-6)
    eps = 1e-6
    plus = jax.tree.map(lambda a, b: a + eps * (b - a), _f64(params0), _f64(params))
    minus = jax.tree.map(lambda a, b: a - eps * (b - a), _f64(params0), _f64(params))
    fd = (_mlp64(plus) - _mlp64(minus)) / (2 * eps)
    np.testing.assert_allclose(jac @ delta, fd, rtol=1e-7, atol=1e-9)


def _mlp64(p):
    x = np.asarray(X, np.float64)
    return np.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


# -- pytrees, integer leaves, jit and grad ----------------------------------------------


def scaled(p, x):
    return (x @ p["w"]) * p["scale"] * p["mask"]


def _scaled_params(w, scale):
    return {"w": w, "scale": jnp.int32(scale), "mask": jnp.array([True, False])}


def test_integer_and_boolean_leaves_are_held_at_params0():
    params0 = _scaled_params(_normal(50, (3, 2)), 2)
    params = _scaled_params(_normal(51, (3, 2)), 2)
    f_lin = ntk_core.linearize(scaled, params0)
    reference.assert_close(f_lin(params, X), np.asarray(scaled(params, X), np.float64))
    with pytest.raises(
        ValueError,
        match=r"^linearize: params\['scale'\], of dtype int32, has no derivative, and its value differs from that of the expansion point \(params0\).* Fix:",
    ):
        f_lin(_scaled_params(params["w"], 5), X)
    # inside jax.jit the value cannot be checked: params0's is used, as documented
    jitted = jax.jit(f_lin)(_scaled_params(params["w"], 5), X)
    reference.assert_close(jitted, np.asarray(scaled(params, X), np.float64))


def test_integer_outputs_pass_through_every_degree():
    def two_outputs(w, x):
        y = x @ w
        return {"y": y, "argmax": jnp.argmax(y, axis=-1)}

    w0, w = _normal(52, (3, 2)), _normal(53, (3, 2))
    for degree in (1, 2):
        out = ntk_core.taylor_expand(two_outputs, w0, degree)(w, X)
        np.testing.assert_array_equal(out["argmax"], jnp.argmax(X @ w0, axis=-1))
        reference.assert_close(out["y"], np.asarray(X @ w, np.float64))


def test_jit_and_grad_through_the_linearised_model():
    params0, params = mlp_params(60), mlp_params(70)
    f_lin = ntk_core.linearize(mlp, params0)
    reference.assert_close(jax.jit(f_lin)(params, X), np.asarray(f_lin(params, X), np.float64))
    y = _normal(80, (6, 2))

    def loss(p):
        return 0.5 * jnp.mean((f_lin(p, X) - y) ** 2)

    grads = jax.jit(jax.grad(loss))(params)
    # f_lin is affine in θ: its gradient is J(θ0)ᵀ r with r = (f_lin(θ) − y) / (N·O)
    r = (f_lin(params, X) - y) / y.size
    expected = jax.vjp(lambda p: mlp(p, X), params0)[1](r)[0]
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        reference.assert_close(g, np.asarray(e, np.float64))
    # degree 2 of a quadratic model is the model: the same gradient
    f2 = ntk_core.taylor_expand(product, {"w1": _normal(81, (3, 4)), "w2": _normal(82, (3, 4))}, 2)
    p = {"w1": _normal(83, (3, 4)), "w2": _normal(84, (3, 4))}
    g2 = jax.jit(jax.grad(lambda q: jnp.sum(f2(q, X) ** 2)))(p)
    g = jax.grad(lambda q: jnp.sum(product(q, X) ** 2))(p)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g), strict=True):
        reference.assert_close(a, np.asarray(b, np.float64))


# -- training the linearised MLP: SGD against gradient_descent_mse -----------------------


def test_sgd_on_the_linearised_mlp_matches_gradient_descent_mse():
    """Full-batch SGD with step η on ½·mean((f_lin − y)²) (the library's loss: ½|f − y|²
    / (N·O)) moves the train residual r by (I − ηΘ/n) per step, n = N·O; gradient flow
    (gradient_descent_mse at t = T steps, τ = ηT) by exp(−ηΘT/n). Per eigenvalue w of Θ,
    with a = ηw/n ≤ a_max = ηλ_max/n ≤ 1:

        |(1 − a)^T − e^{−aT}| ≤ (T a²/2) e^{−a(T−1)} ≤ a e^a / (2e)   (for every T),

    so ‖Δ train‖₂ ≤ a_max e^{a_max}/(2e) ‖r0‖₂ and, as the test outputs move by
    Θ_tx V diag(·/w) Vᵀ r0, ‖Δ test‖₂ ≤ ‖Θ_tx‖₂ (η/n) e^{a_max}/(2e) ‖r0‖₂: O(η). The
    tolerance is that bound plus float32 round-off of T steps (1e-4 relative). A
    learning rate off by 2 (the ½ of the loss, or a sum for the mean) fails it."""
    n, d, h, steps, a_max = 16, 4, 32, 400, 0.02
    params0 = mlp_params(90, d=d, h=h, o=1)
    x_train, x_test = _normal(95, (n, d)), _normal(96, (5, d))
    y = jnp.sin(2.0 * x_train[:, :1]) + 0.5 * x_train[:, 1:2]
    k_all = ntk_core.empirical_ntk(mlp, params0, jnp.concatenate([x_train, x_test]))
    k_train, k_test = k_all[:n, :n], k_all[n:, :n]  # (N, N) and (T, N); O = 1
    lam_max = np.linalg.eigvalsh(np.asarray(k_train, np.float64)).max()
    lr = a_max * y.size / lam_max  # a_max = η λ_max / n

    f_lin = ntk_core.linearize(mlp, params0)

    def loss(p):
        return 0.5 * jnp.mean((f_lin(p, x_train) - y) ** 2)

    @jax.jit
    def train(p):
        def step(p, _):  # plain SGD (optax.sgd(lr) without momentum): p - lr * grad
            return jax.tree.map(lambda w, g: w - lr * g, p, jax.grad(loss)(p)), None

        return jax.lax.scan(step, p, None, length=steps)[0]

    outputs = jax.jit(lambda p: (f_lin(p, x_train), f_lin(p, x_test)))
    sgd_train, sgd_test = _f64(outputs(train(params0)))
    fx_train_0, fx_test_0 = outputs(params0)  # f_lin(θ0) = f(θ0)
    r0 = np.linalg.norm(np.asarray(fx_train_0 - y, np.float64))
    bound = a_max * math.exp(a_max) / (2 * math.e)
    theta_tx = np.linalg.norm(np.asarray(k_test, np.float64), 2)
    tol_train = bound * r0 + 1e-4 * r0
    tol_test = theta_tx * lr / y.size * math.exp(a_max) / (2 * math.e) * r0 + 1e-4 * r0

    def error(learning_rate):
        mse = predict.gradient_descent_mse(k_train, y, learning_rate=learning_rate)
        out = mse(steps, fx_train_0=fx_train_0, fx_test_0=fx_test_0, k_test_train=k_test)
        return np.linalg.norm(out.train - sgd_train), np.linalg.norm(out.test - sgd_test)

    err_train, err_test = error(lr)
    assert np.linalg.norm(sgd_train - np.asarray(y)) < 0.5 * r0  # it did train
    assert err_train <= tol_train, (err_train, tol_train)
    assert err_test <= tol_test, (err_test, tol_test)
    wrong_train, wrong_test = error(2 * lr)  # a factor-2 convention error
    assert wrong_train > 5 * tol_train and wrong_test > 5 * tol_test, (wrong_train, wrong_test)


# -- errors -------------------------------------------------------------------------------

P0 = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
F_LIN = ntk_core.linearize(affine, P0)

ERRORS = [
    (lambda: ntk_core.linearize(3, P0), TypeError, r"^linearize: apply_fn must be a callable apply_fn\(params, x\), got int\. Fix:"),
    (lambda: ntk_core.taylor_expand(affine, P0, 1.5), TypeError, r"^taylor_expand: degree must be an int in \[0, 10\], got 1\.5 \(float\)\. Fix:"),
    (lambda: ntk_core.taylor_expand(affine, P0, True), TypeError, r"^taylor_expand: degree must be an int in \[0, 10\], got True \(bool\)"),
    (lambda: ntk_core.taylor_expand(affine, P0, -1), ValueError, r"^taylor_expand: degree must be an int in \[0, 10\], got -1\. Fix:"),
    (lambda: ntk_core.linearize(affine, {"w": "abc"}), TypeError, r"^linearize: params0\['w'\] is str 'abc', not a numeric array.* Fix:"),
    (lambda: F_LIN({"w": jnp.ones((3, 2))}, X), ValueError, r"^linearize: params does not have the tree structure of the expansion point \(params0\) \(missing \[\['b'\]\], not in the expansion point \[\]\)\. Fix:"),
    (lambda: F_LIN([jnp.zeros(2), jnp.ones((3, 2))], X), ValueError, r"^linearize: params does not have the tree structure .*not in the expansion point \[\[0\], \[1\]\]"),
    (lambda: F_LIN({"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}, X), ValueError, r"^linearize: params\['w'\] has shape \(4, 2\), but the expansion point \(params0\) has shape \(3, 2\) there.* Fix:"),
    (lambda: F_LIN({"w": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.zeros(2)}, X), TypeError, r"^linearize: params\['w'\] has dtype bfloat16, but the expansion point \(params0\) has dtype float32 there\. Fix:"),
    (lambda: ntk_core.taylor_expand(random_features, [jnp.ones((16, 2)), (jnp.zeros(2),)], 2)([jnp.ones((16, 2)), [jnp.zeros(2)]], X), ValueError, r"^taylor_expand: params does not have the tree structure .*the same leaves in other containers"),
]  # fmt: skip


@pytest.mark.parametrize("call, error, pattern", ERRORS, ids=range(len(ERRORS)))
def test_documented_errors(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()
