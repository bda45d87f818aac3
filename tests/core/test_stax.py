"""ntk_core.stax: infinite-width NNGP and NTK against neural-tangents' own kernels
(tests/data/nt_stax_reference.npz, recorded by benchmarks/compare_neural_tangents_stax.py
from neural-tangents 0.6.5 on the networks of tests/stax_nets.py), closed forms against
quadrature written here, Monte Carlo means of the finite networks' empirical kernels,
the blocked engine, and gradients at x = 0."""

import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_core import monte_carlo_kernels, stax
from ntk_core._infinite import closed_forms

TESTS = os.path.dirname(os.path.dirname(__file__))


# each layer whose kernel reads which pairs are one sample (Relu's ρ = 1, Dropout), pair
# variances (LayerNorm, attention), branches, positions kept or on their diagonal
TILED = {
    "fc_relu_standard", "residual_fc", "layernorm_fc", "dropout_fc", "cnn_flatten",
    "conv_only", "wide_resnet_block", "attn_softmax_image_pos",
}  # fmt: skip


def test_every_network_matches_neural_tangents_in_float64():
    """Each network's Gram matrix of [x1; x2] (one compiled program per network) holds
    neural-tangents' K(x1, x1) and K(x1, x2): NNGP and NTK within 1e-6 relative (the
    issue's bound; measured 2.9e-9, neural-tangents rounds a few same-sample entries);
    exactly symmetric; networks ending with positions in neural-tangents' axis order.
    Networks of TILED in tiles of 3 x 3 samples in their program (pair_tiles: the CPU's
    way for large N; 8 samples: 6 tiles, diagonal ones, padded ones, the mirror loop).
    Quadrature (ElementwiseNumerical, deg 25) within 1e-3: see below."""
    code = """
    import contextlib
    import jax, numpy as np, jax.numpy as jnp
    import stax_nets
    from ntk_core import stax
    from ntk_core._infinite import pair_tiles
    assert jax.config.jax_enable_x64
    ref = np.load(stax_nets.REFERENCE)
    worst = 0.0
    TILED = {TILED!r}
    for name, (net, shape) in stax_nets.networks(stax, jnp).items():
        x1, x2 = stax_nets.inputs(name, shape)
        with pair_tiles.using(3) if name in TILED else contextlib.nullcontext():
            k = net[2](np.concatenate([x1, x2]), None)
        for kind in ("nngp", "ntk"):
            gram = np.asarray(getattr(k, kind))
            assert gram.dtype == np.float64
            assert (gram == np.swapaxes(gram, 0, 1).transpose(
                (0, 1) + tuple(i + 1 if i % 2 == 0 else i - 1 for i in range(2, gram.ndim)))).all(), name
            for tag, block in (("x1x1", gram[:4, :4]), ("x1x2", gram[:4, 4:])):
                theirs = ref[f"{name}/{tag}/{kind}"]
                assert block.shape == theirs.shape, (name, tag, kind, block.shape, theirs.shape)
                err = np.abs(block - theirs).max() / np.abs(theirs).max()
                # quadrature (deg 25): neural-tangents' K(x1, x1) is itself asymmetric by
                # 3e-5 (u and v on different nodes), K(x1, x2) 6e-4 from the other order;
                # ours is the mean of both orders
                assert err <= (1e-3 if "numerical" in name else 1e-6), (name, tag, kind, err)
                worst = max(worst, err)
    print("ok", worst)
    """
    env = {**os.environ, "JAX_ENABLE_X64": "1"}
    env["PYTHONPATH"] = os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code).replace("{TILED!r}", repr(TILED))],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ok" in result.stdout


def _quadrature(phi, q11, q12, q22, deg=160):
    """E[φ(u)φ(v)] by numpy's Gauss–Hermite nodes in float64 (independent of the library)."""
    z, w = np.polynomial.hermite_e.hermegauss(deg)
    w = w / w.sum()
    rho = q12 / np.sqrt(q11 * q22)
    u = np.sqrt(q11) * z[:, None]
    v = np.sqrt(q22) * (rho * z[:, None] + np.sqrt(1 - rho**2) * z[None, :])
    return float(np.einsum("i,j,ij->", w, w, phi(u) * phi(v)))


SMOOTH = [
    (
        "erf",
        closed_forms.erf(1.3, 0.7, 0.2),
        lambda x: 1.3 * __import__("scipy.special").special.erf(0.7 * x) + 0.2,
        lambda x: 1.3 * 0.7 * 2 / np.sqrt(np.pi) * np.exp(-0.49 * x * x),
    ),
    (
        "gelu",
        closed_forms.gelu,
        lambda x: x * 0.5 * (1 + __import__("scipy.special").special.erf(x / np.sqrt(2))),
        lambda x: (
            0.5 * (1 + __import__("scipy.special").special.erf(x / np.sqrt(2)))
            + x * np.exp(-x * x / 2) / np.sqrt(2 * np.pi)
        ),
    ),
    (
        "sin",
        closed_forms.sin(1.2, 0.8, 0.3),
        lambda x: 1.2 * np.sin(0.8 * x + 0.3),
        lambda x: 1.2 * 0.8 * np.cos(0.8 * x + 0.3),
    ),
    (
        "exp",
        closed_forms.exp(0.5, 0.3),
        lambda x: 0.5 * np.exp(0.3 * x),
        lambda x: 0.15 * np.exp(0.3 * x),
    ),
]


def _polar(phi, q11, q12, q22, degree):
    """E[φ(u)φ(v)] for φ positively homogeneous of ``degree`` (ReLU 1, sign and steps 0):
    in polar coordinates of (z1, z2) the radial integral is 2^p·p!, the angular one is
    Gauss–Legendre on each arc between the angles where u or v changes sign."""
    rho = q12 / np.sqrt(q11 * q22)
    tail = np.sqrt(1 - rho**2)
    beta = np.arctan2(-rho, tail)  # v = 0 there and at beta + π
    cuts = np.sort(np.mod([np.pi / 2, 3 * np.pi / 2, beta, beta + np.pi], 2 * np.pi))
    edges = np.concatenate([[0.0], cuts, [2 * np.pi]])
    z, w = np.polynomial.legendre.leggauss(60)
    total = 0.0
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        alpha = (hi - lo) / 2 * z + (hi + lo) / 2
        u = np.sqrt(q11) * np.cos(alpha)
        v = np.sqrt(q22) * (rho * np.cos(alpha) + tail * np.sin(alpha))
        total += (hi - lo) / 2 * np.sum(w * phi(u) * phi(v))
    return 2**degree * math.factorial(degree) * total / (2 * np.pi)


KINKED = [
    ("relu", closed_forms.ab_relu(0.0, 1.0), lambda x: np.maximum(x, 0), lambda x: (x > 0) * 1.0),
    (
        "abrelu",
        closed_forms.ab_relu(-0.3, 1.2),
        lambda x: np.where(x > 0, 1.2 * x, -0.3 * x),
        lambda x: np.where(x > 0, 1.2, -0.3),
    ),
    ("sign", closed_forms.sign, np.sign, None),
]
POINTS = [(1.3, 0.4, 0.8), (0.7, -0.5, 0.9), (2.0, 1.9, 1.9), (0.5, 0.0, 1.5)]


@pytest.mark.parametrize(
    ("name", "forms", "phi", "dphi"), SMOOTH + KINKED, ids=[c[0] for c in SMOOTH + KINKED]
)
def test_closed_forms_against_numerical_integrals(name, forms, phi, dphi):
    """Σ' = E[φ(u)φ(v)] and Σ̇ = E[φ'(u)φ'(v)] against float64 numerics written here: smooth
    φ by 160-node Gauss–Hermite quadrature, kinked φ (ReLU, ABRelu, sign; quadrature
    converges slowly there) by the polar integral; to 1e-9 of the scale √(Σ'11·Σ'22)."""
    kinked = name in [c[0] for c in KINKED]

    def integral(f, a, b, c, degree):
        return _polar(f, a, b, c, degree) if kinked else _quadrature(f, a, b, c)

    with jax.enable_x64(True):
        for q11, q12, q22 in POINTS:
            args = [jnp.asarray(v, jnp.float64) for v in (q11, q12, q22)]
            nngp, dot = (float(a) for a in forms(*args))
            p = 0 if name == "sign" else 1
            scale = np.sqrt(integral(phi, q11, q11, q11, p) * integral(phi, q22, q22, q22, p))
            assert abs(nngp - integral(phi, q11, q12, q22, p)) <= 1e-9 * scale, (
                name,
                q11,
                q12,
                q22,
            )
            if dphi is None:
                assert dot == 0.0
                continue
            dscale = np.sqrt(integral(dphi, q11, q11, q11, 0) * integral(dphi, q22, q22, q22, 0))
            assert abs(dot - integral(dphi, q11, q12, q22, 0)) <= 1e-9 * dscale, (
                name,
                q11,
                q12,
                q22,
            )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_polynomial_arccos_and_arcsin_against_numpy_in_float64(dtype):
    """The closed forms' arccos / arcsin (a polynomial, not XLA's atan2) at a dense grid of
    [-1, 1], the branch points ±1/2 and the ends ±1, ±(1 − ulp), against numpy's in
    float64 of the same inputs: within 2 ulps of π in the dtype (absolute, arccos; float32
    rounds π itself by 9e-8), relative 3 ulps (arcsin, whose values reach down to 1e-30);
    arccos(1) = 0 and arcsin(0) = 0 exactly."""
    with jax.enable_x64(True):
        eps = float(np.finfo(dtype).eps)
        edges = [-1, -1 + eps, -0.5 - eps, -0.5, -0.5 + eps, 0, 1e-30, 0.5, 0.5 + eps, 1 - eps, 1]
        x = np.concatenate([np.linspace(-1, 1, 200_001), edges]).astype(dtype)
        acos = np.asarray(jax.jit(closed_forms.arccos)(jnp.asarray(x)), np.float64)
        asin = np.asarray(jax.jit(closed_forms.arcsin)(jnp.asarray(x)), np.float64)
        x64 = x.astype(np.float64)
        assert np.abs(acos - np.arccos(x64)).max() <= 2 * eps * math.pi
        assert np.abs(asin - np.arcsin(x64)).max() <= 2 * eps * math.pi
        small = np.abs(x64) <= 0.5  # relative where arcsin is small
        rel = np.abs(asin - np.arcsin(x64))[small] / np.maximum(np.abs(x64[small]), 1e-300)
        assert rel.max() <= 3 * eps
        assert acos[x64 == 1].max() == 0 and asin[x64 == 0].max() == 0


def test_kernel_overflow_raises_nonfinite_error_naming_the_first_pair():
    """The kernel's finiteness is judged in the compiled program (a flag, not a copy of the
    kernels): Exp's kernel e^((q11 + q22 + 2 q12)/2) overflows float32 for the sample of
    norm 36 (e^650 against a maximum of 3.4e38); the first bad pair, in row-major order, is
    (0, 1) in the Gram matrix and with x2 given; without that sample no error and the
    kernel equals the closed form by hand (Dense(1) of Exp of Dense: e^((q + q' + 2c)/2))."""
    from ntk_core._errors import NonFiniteError

    *_, kernel_fn = stax.serial(stax.Dense(8), stax.Exp(1.0, 1.0), stax.Dense(1))
    x = np.array([[0.1, 0.2], [30.0, 20.0], [0.3, 0.1]], np.float32)
    for x2 in (None, x):
        with pytest.raises(NonFiniteError, match="first at x1 sample 0 and x2 sample 1"):
            kernel_fn(x if x2 is None else x[[0, 2]], x2)
    fine = x[[0, 2]].astype(np.float64)
    q = fine @ fine.T / 2
    expected = np.exp((np.diag(q)[:, None] + np.diag(q)[None] + 2 * q) / 2)
    np.testing.assert_allclose(
        np.asarray(kernel_fn(fine.astype(np.float32), None, "nngp")), expected, rtol=1e-5
    )


def _network(width, parameterization):
    d = stax.Dense
    return stax.serial(
        d(width, W_std=1.4, b_std=0.3, parameterization=parameterization),
        stax.Relu(),
        d(width, W_std=1.2, b_std=0.1, parameterization=parameterization),
        stax.Erf(),
        d(256, W_std=0.9, b_std=0.2, parameterization=parameterization),  # outputs averaged
    )


@pytest.mark.parametrize("parameterization", ["ntk", "standard"])
def test_monte_carlo_means_of_finite_networks_converge(parameterization):
    """The mean of our empirical NNGP and NTK of the finite network (init_fn, apply_fn) over
    initialisations approaches kernel_fn: relative Frobenius error at width 512 below
    0.08 (NNGP) and 0.04 (NTK), the NTK's below half of its error at width 16 (standard:
    the kernel of the real widths, compared at each)."""
    x = np.random.RandomState(0).randn(5, 3).astype(np.float32)
    errors = []
    for width in (16, 512):
        init_fn, apply_fn, kernel_fn = _network(width, parameterization)
        exact = kernel_fn(x, None)
        mc = monte_carlo_kernels(
            lambda key, init_fn=init_fn: init_fn(key, x.shape)[1],
            apply_fn,
            x,
            key=jax.random.PRNGKey(1),
            n_samples=8,
            trace_axes=(-1,),
        )
        errors.append(
            [
                np.linalg.norm(np.asarray(getattr(mc, k)) - getattr(exact, k))
                / np.linalg.norm(getattr(exact, k))
                for k in ("nngp", "ntk")
            ]
        )
    (small_nngp, small_ntk), (large_nngp, large_ntk) = errors
    assert large_nngp < 0.08 and large_ntk < 0.04, errors
    # the NTK concentrates as the width grows (its spread falls like 1/√width); the NNGP's
    # spread is that of the outputs themselves, 1/√(samples·outputs) at any width
    assert large_ntk < small_ntk / 2, errors


def test_convolutional_monte_carlo_converges():
    """A CNN (SAME and strided VALID convolutions, ReLU, GlobalAvgPool): Monte Carlo at 256
    channels within 0.1 of kernel_fn (NNGP and NTK)."""
    x = np.random.RandomState(2).randn(3, 5, 4, 2).astype(np.float32)
    init_fn, apply_fn, kernel_fn = stax.serial(
        stax.Conv(256, (3, 3), padding="SAME", b_std=0.2),
        stax.Relu(),
        stax.Conv(256, (2, 2), strides=(2, 1)),
        stax.Relu(),
        stax.GlobalAvgPool(),
        stax.Dense(64),  # outputs averaged: the NNGP's error falls with samples x outputs
    )
    exact = kernel_fn(x, None)
    mc = monte_carlo_kernels(
        lambda key: init_fn(key, x.shape)[1], apply_fn, x, key=jax.random.PRNGKey(3), n_samples=8
    )
    for k in ("nngp", "ntk"):
        err = np.linalg.norm(np.asarray(getattr(mc, k)) - getattr(exact, k)) / np.linalg.norm(
            getattr(exact, k)
        )
        assert err < 0.1, (k, err)


def test_self_attention_monte_carlo_converges():
    """GlobalSelfAttention (softmax, 2 heads, summed positional embeddings) after a Dense
    embedding, on sequences: Monte Carlo of the finite layer at 256 channels within 0.1 of
    kernel_fn (NNGP and NTK, every pair of positions; measured 0.057 and 0.045, at 16
    channels 0.30 and 0.23). The
    embedding's own width matters: summed onto a 2-channel input, its covariance stays
    far from R (0.56)."""
    x = np.random.RandomState(4).randn(3, 4, 2).astype(np.float32)
    init_fn, apply_fn, kernel_fn = stax.serial(
        stax.Dense(256),
        # 64 outputs averaged: the NNGP's error falls with samples x outputs
        stax.GlobalSelfAttention(64, 256, 128, 2, W_key_std=1.5, pos_emb_type="SUM"),
    )
    exact = kernel_fn(x, None)
    mc = monte_carlo_kernels(
        lambda key: init_fn(key, x.shape)[1], apply_fn, x, key=jax.random.PRNGKey(3), n_samples=8
    )
    for k in ("nngp", "ntk"):
        ours, limit = np.asarray(getattr(mc, k)), np.asarray(getattr(exact, k))
        assert ours.shape == limit.shape == (3, 3, 4, 4), (k, ours.shape, limit.shape)
        err = np.linalg.norm(ours - limit) / np.linalg.norm(limit)
        assert err < 0.1, (k, err)


def test_blocked_equals_one_call_and_is_symmetric(tmp_path):
    """Tiles of 4 over N = 11 (ragged), x2 None and given, into memory and into an .npy
    file that resumes: equal to the one call to 1e-5·max in float32; x2=None exactly
    symmetric both ways."""
    x = np.random.RandomState(0).randn(11, 5, 4, 2).astype(np.float32)
    x2 = np.random.RandomState(1).randn(6, 5, 4, 2).astype(np.float32)
    *_, kernel_fn = stax.serial(
        stax.Conv(3, (3, 3), padding="SAME", b_std=0.1),
        stax.Relu(),
        stax.AvgPool((2, 2)),
        stax.Flatten(),
        stax.Dense(1),
    )
    one = kernel_fn(x, None)
    assert (np.asarray(one.ntk) == np.asarray(one.ntk).T).all()
    blocked = kernel_fn(x, None, batch_size=4)
    for k in ("nngp", "ntk"):
        a, b = np.asarray(getattr(one, k)), getattr(blocked, k)
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
        assert (b == b.T).all()
    cross = np.asarray(kernel_fn(x, x2, "ntk"))
    assert np.abs(kernel_fn(x, x2, "ntk", batch_size=4) - cross).max() <= 1e-5 * np.abs(cross).max()
    path = tmp_path / "k.npy"
    written = kernel_fn(x, x2, "ntk", batch_size=4, out=str(path))
    assert np.abs(np.load(path) - cross).max() <= 1e-5 * np.abs(cross).max()
    again = kernel_fn(x, x2, "ntk", batch_size=4, out=str(path), resume=True)  # finished: read back
    assert (np.asarray(again) == np.asarray(written)).all()


def test_gradients_with_respect_to_inputs_are_finite_at_zero():
    """d K(x1, x2)[0, 1] / d x1 is finite at x1[0] = 0 and for a sample with itself
    (neural-tangents issues 14 and 123), and equals central differences elsewhere."""
    *_, kernel_fn = stax.serial(
        stax.Dense(4, b_std=0.1), stax.Relu(), stax.Dense(4), stax.Gelu(), stax.Dense(1)
    )
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.RandomState(0).randn(3, 2))
        zero = x.at[0].set(0.0)
        for inputs in (zero, x):
            g = jax.grad(
                lambda a: kernel_fn(a, None, "ntk")[0, 1] + kernel_fn(a, None, "ntk")[2, 2]
            )(inputs)
            assert np.isfinite(np.asarray(g)).all()
        g = jax.grad(lambda a: kernel_fn(a, None, "nngp")[0, 1])(x)
        h = 1e-6
        step = jnp.zeros_like(x).at[0, 1].set(h)
        diff = (
            kernel_fn(x + step, None, "nngp")[0, 1] - kernel_fn(x - step, None, "nngp")[0, 1]
        ) / (2 * h)
        assert abs(float(g[0, 1]) - float(diff)) <= 1e-6 * max(1.0, abs(float(diff)))


def test_deep_relu_with_large_weights_is_finite_and_psd_in_float32():
    """20 ReLU layers with W_std = 2 (neural-tangents issue 197: NaN in float32): finite,
    eigenvalues >= −1e-6·max; the Erf network of case C3 too."""
    x = np.random.RandomState(0).randn(6, 5).astype(np.float32)
    d = stax.Dense
    for net in (  # repeat: the same recursion as serial, one scanned step to compile
        stax.serial(
            d(64, W_std=2.0, b_std=0.1),
            stax.repeat(stax.serial(stax.Relu(), d(64, W_std=2.0, b_std=0.1)), 19),
            stax.Relu(),
            d(1),
        ),
        stax.serial(
            d(511, W_std=1.5, b_std=0.05),
            stax.repeat(stax.serial(stax.Erf(), d(511, W_std=1.5, b_std=0.05)), 12),
            stax.Erf(),
            d(1, W_std=1.5, b_std=0.05),
        ),
    ):
        k = net[2](x, None)
        for a in (np.asarray(k.nngp), np.asarray(k.ntk)):
            assert a.dtype == np.float32 and np.isfinite(a).all()
            eig = np.linalg.eigvalsh(a.astype(np.float64))
            assert eig.min() >= -1e-6 * eig.max()


def test_repeated_convolutions_keep_neural_tangents_axis_order():
    """Repeated [Conv, Relu] run as one scanned step, the same objects or distinct ones of
    equal arguments: the output's spatial axes follow the convolutions' parity (reversed
    after an odd number, as neural-tangents), and the kernel equals the unrolled one
    (blocks holding an Identity, whose rule has no key: never compared, never scanned)."""
    x = np.random.RandomState(0).randn(3, 5, 4, 2).astype(np.float32)

    def conv():
        return stax.Conv(2, (3, 3), padding="SAME", b_std=0.1)

    for n in (4, 5):
        same, relu = conv(), stax.Relu()
        distinct = [conv() if i % 2 == 0 else stax.Relu() for i in range(2 * n)]
        blocks = [stax.serial(conv(), stax.Relu(), stax.Identity()) for _ in range(n)]
        unrolled = np.asarray(stax.serial(*blocks)[2](x, None, "ntk"))
        assert unrolled.shape == ((3, 3, 4, 4, 5, 5) if n % 2 else (3, 3, 5, 5, 4, 4))
        in_blocks = [stax.serial(conv(), stax.Relu()) for _ in range(n)]
        # each form once, both parities of the scanned steps' count (test time)
        for layers in ([same, relu] * n, distinct) if n == 4 else (in_blocks,):
            kernel_fn = stax.serial(*layers)[2]
            assert "scan" in str(jax.make_jaxpr(lambda a, f=kernel_fn: f(a, None, "ntk"))(x))
            scanned = np.asarray(kernel_fn(x, None, "ntk"))
            assert scanned.shape == unrolled.shape
            assert np.abs(scanned - unrolled).max() <= 1e-6 * np.abs(unrolled).max()


def test_repeat_equals_serial_and_get_forms():
    """repeat(block, 4) (a lax.scan) equals serial of four blocks; get= as a name, a tuple
    (neural-tangents' namedtuple, in order) and None (.nngp, .ntk)."""
    block = stax.serial(stax.Relu(), stax.Dense(8, W_std=1.3, b_std=0.2))
    x = np.random.RandomState(0).randn(4, 3).astype(np.float32)
    first = stax.Dense(8)
    rep = stax.serial(first, stax.repeat(block, 4))[2](x, None)
    ser = stax.serial(first, block, block, block, block)[2](x, None)
    for k in ("nngp", "ntk"):
        # float32: ReLU's Σ̇ = (π − θ)/2π has a square-root singularity at ρ = 1, so the
        # two programs' last-bit differences show on the diagonal (6e-5 measured under the
        # suite's XLA flags; equal to 1e-7 with XLA's defaults and in float64)
        np.testing.assert_allclose(getattr(rep, k), getattr(ser, k), rtol=2e-4)
    kernel_fn = stax.serial(first, block)[2]
    pair = kernel_fn(x, None, ("ntk", "nngp"))
    assert pair._fields == ("ntk", "nngp")
    np.testing.assert_array_equal(pair.ntk, kernel_fn(x, None, "ntk"))


def test_convolutional_init_fn_in_float64():
    # x64 on: the weights are float64, the shape probe was float32 (a bare TypeError)
    init_fn, apply_fn, _ = stax.serial(stax.Conv(3, (3,), padding="SAME", b_std=0.1), stax.Relu())
    with jax.enable_x64(True):
        shape, params = init_fn(jax.random.PRNGKey(0), (2, 5, 2))
        x = np.random.RandomState(0).randn(2, 5, 2)
        y = np.asarray(apply_fn(params, x))
    w, b = params[0]
    assert shape == (2, 5, 3) and w.dtype == np.float64 and y.shape == shape
    padded = np.pad(x, ((0, 0), (1, 1), (0, 0)))
    # NTK parameterisation (the default): W_std / sqrt(fan_in) = 1 / sqrt(3 * 2), b_std 0.1
    want = sum(padded[:, d : d + 5] @ np.asarray(w)[d] for d in range(3)) / np.sqrt(6)
    want = want + 0.1 * np.asarray(b)
    np.testing.assert_allclose(y, np.maximum(want, 0), rtol=1e-12, atol=1e-12)
