"""ntk_core.metrics against hand computations on tiny matrices (explicit H, loops, math)."""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import numpy as np
import pytest

from ntk_core import metrics, spectrum


def _psd(seed, n, p=3):
    phi = np.random.default_rng(seed).standard_normal((n, p))
    return phi @ phi.T


def _full_from_flat(flat, n, o):
    """(N·O, N·O) → (N, N, O, O) by explicit loops (rows ordered sample, output)."""
    out = np.zeros((n, n, o, o))
    for i in range(n):
        for j in range(n):
            out[i, j] = flat[i * o : (i + 1) * o, j * o : (j + 1) * o]
    return out


# -- kernel distance -------------------------------------------------------------------


def test_kernel_distance_hand_values():
    k = _psd(0, 5)
    assert metrics.kernel_distance(k, k) == pytest.approx(0.0, abs=1e-15)
    assert metrics.kernel_distance(k, 7.5 * k) == pytest.approx(0.0, abs=1e-15)
    assert metrics.kernel_distance(np.diag([1.0, 0.0]), np.diag([0.0, 2.0])) == 1.0
    # ⟨I, 11ᵀ⟩ = 2, ‖I‖ = √2, ‖11ᵀ‖ = 2: d = 1 − 2 / (2√2)
    d = metrics.kernel_distance(np.eye(2), np.ones((2, 2)))
    assert d == pytest.approx(1 - 1 / math.sqrt(2), rel=1e-15)
    # opposite signs: cosine −1
    assert metrics.kernel_distance(np.eye(2), -np.eye(2)) == pytest.approx(2.0)


def test_kernel_distance_full_layout_float32_and_jax_arrays():
    n, o = 4, 3
    a, b = _psd(1, n * o, p=5), _psd(2, n * o, p=5)
    expected = 1 - np.sum(a * b) / np.sqrt(np.sum(a * a) * np.sum(b * b))
    a4, b4 = _full_from_flat(a, n, o), _full_from_flat(b, n, o)
    assert metrics.kernel_distance(a4, b4) == pytest.approx(expected, rel=1e-12)
    d32 = metrics.kernel_distance(jnp.asarray(a4, jnp.float32), b4.astype(np.float32))
    assert d32 == pytest.approx(expected, rel=1e-5)


# -- alignment ---------------------------------------------------------------------------


def test_kernel_alignment_hand_values():
    y = np.array([1.0, -1.0, 1.0])
    assert metrics.kernel_alignment(np.outer(y, y), y) == pytest.approx(1.0, rel=1e-15)
    # ⟨I, y yᵀ⟩ = 3, ‖I‖ = √3, ‖y yᵀ‖ = 3
    assert metrics.kernel_alignment(np.eye(3), y) == pytest.approx(1 / math.sqrt(3), rel=1e-15)
    assert metrics.kernel_alignment(np.eye(3), np.array([1, -1, 1])) == pytest.approx(
        1 / math.sqrt(3)
    )  # integer labels
    # multi-output targets: K = Y Yᵀ aligns perfectly; another K by the explicit formula
    yy = np.random.default_rng(3).standard_normal((6, 2))
    assert metrics.kernel_alignment(yy @ yy.T, yy) == pytest.approx(1.0, rel=1e-12)
    k = _psd(4, 6)
    t = yy @ yy.T
    expected = np.sum(k * t) / (np.linalg.norm(k) * np.linalg.norm(t))
    assert metrics.kernel_alignment(k, yy) == pytest.approx(expected, rel=1e-12)


def test_kernel_alignment_full_layout_uses_vec_y():
    n, o = 4, 2
    y = np.random.default_rng(5).standard_normal((n, o))
    target = np.zeros((n, n, o, o))
    for i in range(n):
        for j in range(n):
            for a in range(o):
                for b in range(o):
                    target[i, j, a, b] = y[i, a] * y[j, b]
    assert metrics.kernel_alignment(target, y) == pytest.approx(1.0, rel=1e-12)
    flat = _psd(6, n * o, p=4)
    k4 = _full_from_flat(flat, n, o)
    yv = y.reshape(-1)
    expected = yv @ flat @ yv / (np.linalg.norm(flat) * (yv @ yv))
    assert metrics.kernel_alignment(k4, y) == pytest.approx(expected, rel=1e-12)


def _centred_reference(flat, ymat, n, o):
    """Explicit (H ⊗ I_O) K (H ⊗ I_O) and H Y Yᵀ H, then the cosine."""
    h = np.kron(np.eye(n) - np.ones((n, n)) / n, np.eye(o))
    kc, lc = h @ flat @ h, h @ ymat @ ymat.T @ h
    return np.sum(kc * lc) / (np.linalg.norm(kc) * np.linalg.norm(lc))


def test_centered_alignment_matches_explicit_centring_and_is_shift_invariant():
    n = 7
    k = _psd(7, n)
    y = np.random.default_rng(8).standard_normal((n, 2))
    expected = _centred_reference(k, y, n, 1)
    assert metrics.centered_kernel_alignment(k, y) == pytest.approx(expected, rel=1e-12)
    # centring removes constant offsets of the kernel and of the targets
    shifted = metrics.centered_kernel_alignment(k + 4.0, y + np.array([3.0, -2.0]))
    assert shifted == pytest.approx(expected, rel=1e-10)
    assert metrics.kernel_alignment(k + 4.0, y) != pytest.approx(metrics.kernel_alignment(k, y))
    yc = np.array([1.0, -1.0, 1.0, -1.0])
    assert metrics.centered_kernel_alignment(np.outer(yc, yc) + 5.0, yc) == pytest.approx(1.0)


def test_centered_alignment_full_layout_and_row_chunks(monkeypatch):
    from ntk_core._analysis import host_kernel as _host_kernel

    n, o = 5, 3
    flat = _psd(9, n * o, p=6)
    y = np.random.default_rng(10).standard_normal((n, o))
    expected = _centred_reference(flat, y.reshape(-1, 1), n, o)
    k4 = _full_from_flat(flat, n, o)
    assert metrics.centered_kernel_alignment(k4, y) == pytest.approx(expected, rel=1e-12)
    monkeypatch.setattr(_host_kernel, "CHUNK_ENTRIES", 50)  # one sample row per chunk
    assert metrics.centered_kernel_alignment(k4, y) == pytest.approx(expected, rel=1e-12)


def test_memory_mapped_kernels_give_the_same_numbers(tmp_path):
    k = _psd(11, 9).astype(np.float32)
    y = np.random.default_rng(12).standard_normal(9)
    np.save(tmp_path / "k.npy", k)
    mm = np.load(tmp_path / "k.npy", mmap_mode="r")
    assert metrics.kernel_alignment(mm, y) == metrics.kernel_alignment(k, y)
    assert metrics.centered_kernel_alignment(mm, y) == metrics.centered_kernel_alignment(k, y)
    assert metrics.kernel_distance(mm, k + 1) == metrics.kernel_distance(k, k + 1)
    assert metrics.effective_rank(mm) == metrics.effective_rank(k)


# -- effective rank -----------------------------------------------------------------------


def test_effective_rank_hand_values():
    assert metrics.effective_rank(np.eye(6)) == pytest.approx(6.0, rel=1e-12)
    v = np.array([1.0, 2.0, -1.0])
    assert metrics.effective_rank(np.outer(v, v)) == pytest.approx(1.0, abs=1e-6)
    assert metrics.effective_rank(eigenvalues=[2.0, 2.0, 0.0]) == pytest.approx(2.0)
    # p = (3/4, 1/4): exp(−(3/4 ln 3/4 + 1/4 ln 1/4)) = 1.7547654...
    assert metrics.effective_rank(eigenvalues=np.array([3.0, 1.0])) == pytest.approx(
        1.7547654, rel=1e-7
    )
    k = _psd(13, 8, p=8)
    from_kernel = metrics.effective_rank(k)
    assert from_kernel == pytest.approx(
        metrics.effective_rank(eigenvalues=np.linalg.eigvalsh(k)), rel=1e-10
    )
    assert spectrum.effective_rank is metrics.effective_rank


def test_effective_rank_full_layout_is_that_of_the_flat_matrix():
    n, o = 3, 2
    flat = _psd(14, n * o, p=4)
    expected = metrics.effective_rank(eigenvalues=np.linalg.eigvalsh(flat))
    assert metrics.effective_rank(_full_from_flat(flat, n, o)) == pytest.approx(expected)


# -- errors --------------------------------------------------------------------------------

K3 = np.eye(3)
BAD = [
    (
        lambda: metrics.kernel_distance(K3, np.eye(4)),
        ValueError,
        "kernel_distance: k1 has shape (3, 3) and k2 (4, 4); expected the same shape",
    ),
    (
        lambda: metrics.kernel_distance(np.ones((3, 4)), np.ones((3, 4))),
        ValueError,
        "kernel_distance: k1 has shape (3, 4); expected a square kernel",
    ),
    (
        lambda: metrics.kernel_distance(np.ones((2, 2, 3, 4)), np.ones((2, 2, 3, 4))),
        ValueError,
        "expected a square kernel (N, N) / (N, N, O, O)",
    ),
    (
        lambda: metrics.kernel_distance(K3, np.diag([1.0, np.nan, 1.0])),
        ValueError,
        "kernel_distance: k2 contains NaN or Inf",
    ),
    (
        lambda: metrics.kernel_distance(K3, np.zeros((3, 3))),
        ValueError,
        "kernel_distance: k2 is all zeros",
    ),
    (
        lambda: metrics.kernel_distance(np.eye(3, dtype=int), K3),
        TypeError,
        "kernel_distance: k1 must be a floating array",
    ),
    (
        lambda: metrics.kernel_alignment(K3, np.ones(4)),
        ValueError,
        "kernel_alignment: k has shape (3, 3), so y must have shape (3,) or (3, O)",
    ),
    (
        lambda: metrics.kernel_alignment(np.ones((3, 3, 2, 2)), np.ones(3)),
        ValueError,
        "kernel_alignment: k has shape (3, 3, 2, 2), so y must have shape (3, 2)",
    ),
    (
        lambda: metrics.kernel_alignment(K3, np.array([1.0, np.inf, 0.0])),
        ValueError,
        "kernel_alignment: y contains NaN or Inf",
    ),
    (
        lambda: metrics.kernel_alignment(K3, np.array(["a", "b", "c"])),
        TypeError,
        "kernel_alignment: y must be real numbers",
    ),
    (
        lambda: metrics.kernel_alignment(K3, np.zeros(3)),
        ValueError,
        "kernel_alignment: the targets are all zeros",
    ),
    (
        lambda: metrics.centered_kernel_alignment(np.ones((3, 3)), np.arange(3.0)),
        ValueError,
        "centered_kernel_alignment: the centred kernel is all zeros",
    ),
    (
        lambda: metrics.centered_kernel_alignment(K3, np.ones(3)),
        ValueError,
        "centered_kernel_alignment: the centred targets are all zeros",
    ),
    (
        lambda: metrics.effective_rank(np.ones(3)),
        ValueError,
        "effective_rank: kernel has shape (3,), one value per sample",
    ),
    (
        lambda: metrics.effective_rank(),
        TypeError,
        "effective_rank: got neither of kernel and eigenvalues",
    ),
    (lambda: metrics.effective_rank(K3, eigenvalues=[1.0]), TypeError, "got both"),
    (
        lambda: metrics.effective_rank(eigenvalues=np.ones((2, 2))),
        ValueError,
        "effective_rank: eigenvalues must be a non-empty 1-D array of real numbers, got shape (2, 2)",
    ),
    (
        lambda: metrics.effective_rank(eigenvalues=np.array([1j, 1.0])),
        ValueError,
        "effective_rank: eigenvalues must be a non-empty 1-D array of real numbers, got dtype complex128",
    ),
    (
        lambda: metrics.effective_rank(eigenvalues=[1.0, np.nan]),
        ValueError,
        "effective_rank: eigenvalues contains NaN or Inf (first at index 1)",
    ),
    (
        lambda: metrics.effective_rank(eigenvalues=[0.0, 0.0]),
        ValueError,
        "effective_rank: every eigenvalue is 0",
    ),
    (
        lambda: metrics.effective_rank(np.triu(np.ones((3, 3)))),
        ValueError,
        "effective_rank: kernel is not symmetric",
    ),
]


@pytest.mark.parametrize("call, error, message", BAD, ids=[m[:48] for _, _, m in BAD])
def test_documented_errors(call, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        call()
    assert "Fix:" in str(info.value)
