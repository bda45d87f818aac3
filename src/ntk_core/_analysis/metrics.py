"""Kernel distance, alignment (plain, centred), effective rank: float64 on the host."""

from __future__ import annotations

import math

import numpy as np

from ntk_core._analysis.host_kernel import HostKernel, eigenvalues_of
from ntk_core._errors import bad
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._predict.linalg import SAME_AXES, real_array


def kernel_distance(k1, k2) -> float:
    """Kernel distance of Fort et al. (2020), in ``[0, 1]`` for PSD kernels (round-off clipped).

        d(K1, K2) = 1 − ⟨K1, K2⟩_F / (‖K1‖_F ‖K2‖_F)

    ``k1``, ``k2``: kernels of one shape, ``(N, N)`` or ``(N, N, O, O)`` (more output axes
    zipped): the flat ``(N·O, N·O)`` matrix ``K[i·O + a, j·O + b] = K[i, j, a, b]``. Raises
    ValueError (shapes differ or not square, NaN or Inf, all zeros), TypeError (non-floating).
    Cost: one pass, 3·M² multiply-adds (M = N·O), read in 64 MiB chunks.

    Example:
      >>> import numpy as np
      >>> from ntk_core import metrics
      >>> k = np.array([[2.0, 1.0], [1.0, 2.0]])                # (N, N) = (2, 2)
      >>> metrics.kernel_distance(k, 3 * k)                     # same up to scale
      0.0
      >>> metrics.kernel_distance(np.diag([1.0, 0.0]), np.diag([0.0, 1.0]))  # orthogonal
      1.0

    References: Fort et al., "Deep learning versus kernel learning", NeurIPS 2020, section 4.
    """
    fn = "kernel_distance"
    a, b = HostKernel(fn, k1, "k1"), HostKernel(fn, k2, "k2")
    if a.arr.shape != b.arr.shape:
        what = f"k1 has shape {a.arr.shape} and k2 {b.arr.shape}; expected the same shape"
        raise bad(ValueError, fn, what, SAME_AXES)
    dot = n1 = n2 = 0.0
    for (_, x), (_, y) in zip(a.chunks(), b.chunks(), strict=True):
        dot += float(np.vdot(x, y))
        n1 += float(np.vdot(x, x))
        n2 += float(np.vdot(y, y))
    for k, norm in ((a, n1), (b, n2)):
        if norm == 0.0:
            raise _undefined(fn, f"{k.name} is all zeros", "the cosine", "a non-zero kernel")
    return max(0.0, 1.0 - dot / math.sqrt(n1 * n2))


def _undefined(fn, what, quantity, fix) -> ValueError:
    return bad(ValueError, fn, f"{what}, so {quantity} is undefined", f"pass {fix}")


def _targets(fn: str, k: HostKernel, y) -> np.ndarray:
    """Targets as the float64 ``(M, R)`` matrix Y with target kernel Y Yᵀ."""
    arr, want = real_array(fn, "y", y), (k.n,) + k.out_shape  # one target per flat row
    if arr.shape[:1] != want[:1] or k.out_shape and arr.shape != want:
        expected = want if k.out_shape else f"({k.n},) or ({k.n}, O)"
        what = f"k has shape {k.arr.shape}, so y must have shape {expected}, got {arr.shape}"
        raise bad(ValueError, fn, what, "pass the targets of the kernel's N samples")
    return (arr.reshape(k.m, 1) if k.out_shape else arr.reshape(k.n, -1)).astype(np.float64)


def _alignment(fn: str, k, y, centered: bool) -> float:
    kern = HostKernel(fn, k, "k")
    t, n, o = _targets(fn, kern, y), kern.n, kern.o
    if centered:  # H = I − 11ᵀ/N on the samples, per output entry (H ⊗ I_O)
        t3 = t.reshape(n, o, -1)
        t = (t3 - t3.mean(axis=0)).reshape(t.shape)
    num = knorm2 = 0.0
    row_sums = np.zeros((n, o, o))  # Σ_j K[i, a, j, b]
    col_sums = np.zeros((o, n, o))  # Σ_i K[i, a, j, b]
    for rows, block in kern.chunks():
        num += float(np.vdot(t[rows], block @ t))
        knorm2 += float(np.vdot(block, block))
        if centered:
            b4 = block.reshape(-1, o, n, o)
            row_sums[rows.start // o : rows.stop // o] = b4.sum(axis=2)
            col_sums += b4.sum(axis=0)
    if centered:  # ‖H K H‖²_F: K − row means − column means + grand mean, chunk by chunk
        row_means, col_means = row_sums / n, col_sums / n
        grand = row_means.mean(axis=0)  # (O, O)
        knorm2 = 0.0
        for rows, block in kern.chunks():
            s = slice(rows.start // o, rows.stop // o)
            c = block.reshape(-1, o, n, o) - col_means[None] - row_means[s][:, :, None, :]
            c += grand[None, :, None, :]
            knorm2 += float(np.vdot(c, c))
    tnorm = float(np.linalg.norm(t.T @ t))  # ‖Y Yᵀ‖_F = ‖Yᵀ Y‖_F
    the, after = ("the centred ", " once centred") if centered else ("the ", "")
    for name, norm in (("kernel is", knorm2), ("targets are", tnorm)):
        if norm == 0.0:
            raise _undefined(fn, f"{the}{name} all zeros", "the alignment", f"non-zero k, y{after}")
    return num / (math.sqrt(knorm2) * tnorm)


def kernel_alignment(k, y) -> float:
    """Kernel-target alignment of Cristianini et al., in [0, 1] for PSD K.

        A(K, Y) = ⟨K, Y Yᵀ⟩_F / (‖K‖_F ‖Y Yᵀ‖_F) = tr(Yᵀ K Y) / (‖K‖_F ‖Yᵀ Y‖_F)

    ``k`` as :func:`kernel_distance`; ``y``: floating or integer targets, ``(N,)`` / ``(N, O)``
    for ``(N, N)``, ``(N, O)`` for ``(N, N, O, O)`` (target kernel vec(y) vec(y)ᵀ). Raises
    ValueError (k not square, y's shape, NaN or Inf, all zeros), TypeError (non-floating k,
    non-numeric y). Cost: one pass, 2·M²·R multiply-adds (R columns of y).

    Example:
      >>> import numpy as np
      >>> from ntk_core import metrics
      >>> y = np.array([1.0, -1.0, 1.0])                       # (N,)
      >>> round(metrics.kernel_alignment(np.outer(y, y), y), 12)  # K = y yᵀ, (N, N)
      1.0
      >>> round(metrics.kernel_alignment(np.eye(3), y), 6)     # tr(yᵀy)/(√3·‖y‖²)
      0.57735

    References: Cristianini et al., "On Kernel-Target Alignment", NIPS 2001.
    """
    return _alignment("kernel_alignment", k, y, centered=False)


def centered_kernel_alignment(k, y) -> float:
    """Centred kernel-target alignment of Cortes, Mohri & Rostamizadeh (2012), in [-1, 1].

        A_c(K, Y) = ⟨H K H, H Y Yᵀ H⟩_F / (‖H K H‖_F ‖H Y Yᵀ H‖_F),  H = I − 11ᵀ/N

    Invariant to constant offsets; H acts on the samples per output (H ⊗ I_O). ``k``, ``y``,
    errors as :func:`kernel_alignment`, and ValueError for k or y constant over the samples.
    Cost: two passes, 4·M² + 2·M²·R flops, N·O² memory.

    Example:
      >>> import numpy as np
      >>> from ntk_core import metrics
      >>> y = np.array([1.0, -1.0, 1.0, -1.0])                 # (N,)
      >>> k = np.outer(y, y) + 5.0                              # y yᵀ plus a constant
      >>> round(metrics.centered_kernel_alignment(k, y), 12)
      1.0
      >>> metrics.kernel_alignment(k, y) < 0.5
      True

    References: Cortes, Mohri, Rostamizadeh, "Algorithms for Learning Kernels Based on
    Centered Alignment", JMLR 13, 2012.
    """
    return _alignment("centered_kernel_alignment", k, y, centered=True)


def effective_rank(kernel=None, *, eigenvalues=None) -> float:
    """Effective rank of Roy & Vetterli (2007), between 1 and M: exp of the spectrum's entropy.

        erank = exp(−Σ_i p_i log p_i),  p_i = |λ_i| / Σ_j |λ_j|   (0·log 0 = 0)

    ``kernel``: symmetric, as :func:`kernel_distance` (all eigenvalues, 4/3·M³ flops), or
    keyword-only ``eigenvalues``, 1-D (a top k gives at most k). Raises TypeError (both or
    neither, non-floating kernel), ValueError (kernel not square, symmetric or 2-D+; NaN or
    Inf; eigenvalues not real 1-D or all zero).

    Example:
      >>> import numpy as np
      >>> from ntk_core import metrics
      >>> round(metrics.effective_rank(np.eye(4)), 12)          # (N, N) = (4, 4)
      4.0
      >>> round(metrics.effective_rank(np.ones((4, 4))), 12)    # rank one
      1.0
      >>> round(metrics.effective_rank(eigenvalues=[1.0, 1.0, 0.0]), 12)
      2.0

    References: Roy, Vetterli, "The effective rank", EUSIPCO 2007.
    """
    fn = "effective_rank"
    s = np.abs(eigenvalues_of(fn, kernel, eigenvalues))
    if (total := float(s.sum())) == 0.0:
        raise _undefined(fn, "every eigenvalue is 0", "the spectrum's entropy", "a non-zero kernel")
    p = s[s > 0] / total
    return float(math.exp(-float(np.sum(p * np.log(p)))))


kernel_distance = _checked_arguments(kernel_distance)
kernel_alignment = _checked_arguments(kernel_alignment)
centered_kernel_alignment = _checked_arguments(centered_kernel_alignment)
effective_rank = _checked_arguments(effective_rank)
