"""Kernel comparisons: kernel distance, kernel-target alignment (plain and centred),
effective rank. Public through :mod:`ntk_core.metrics`.

Everything runs on the host in float64 numpy, whatever the kernels' dtype, reading
kernels in row chunks (:mod:`ntk_core._analysis.host_kernel`), so read-only memory-mapped
``.npy`` kernels are never loaded whole. Results are Python floats.
"""

from __future__ import annotations

import math

import numpy as np

from ntk_core._analysis.host_kernel import HostKernel, eigenvalues_of
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._predict.linalg import bad, check_finite

_TARGETS_FIX = "pass the targets of the kernel's N samples"

_SHAPES_DOC = """Kernels are ``(N, N)`` (``trace_axes=(-1,)``, or one output) or
    ``(N, N, O, O)`` (``trace_axes=()``; more output axes zipped, ``(N, N, O1, O1, O2,
    O2)``), numpy arrays, read-only memory maps (``np.load(path, mmap_mode="r")``) or
    jax arrays (copied to the host once); an ``(N, N, O, O)`` kernel is the ``(N·O,
    N·O)`` matrix with rows ordered (sample, output), ``K[i·O + a, j·O + b] = K[i, j, a,
    b]``. All sums run in float64 on the host."""


_TARGETS_DOC = """y: targets. For an ``(N, N)`` kernel ``(N,)`` or ``(N, O)`` (any
        number of target columns: the target kernel is Y Yᵀ, ``(N, N)``, summing
        over them); for an ``(N, N, O, O)`` kernel ``(N, O)``, one target per row of
        the flat ``(N·O, N·O)`` kernel (the target kernel is vec(y) vec(y)ᵀ).
        Floating or integer labels (e.g. ±1 or one-hot)."""


def _doc(fn):
    if fn.__doc__:
        fn.__doc__ = fn.__doc__.replace("{shapes}", _SHAPES_DOC).replace("{targets}", _TARGETS_DOC)
    return fn


@_doc
def kernel_distance(k1, k2) -> float:
    """Kernel distance of Fort et al. (2020): one minus the cosine of two kernels.

        d(K1, K2) = 1 − ⟨K1, K2⟩_F / (‖K1‖_F ‖K2‖_F),  ⟨A, B⟩_F = Σ A_ij B_ij

    0 for kernels equal up to a positive scale, 1 for orthogonal ones (``[0, 1]`` for
    positive semi-definite kernels, whose inner product is >= 0; ``[0, 2]`` in
    general). Fort et al. track it between the NTKs at two times of training.

    Args:
      k1: ``(N, N)`` or ``(N, N, O, O)`` kernel.
      k2: a kernel of the same shape.

    {shapes}

    Returns:
      ``d`` as a Python float (round-off below 0 clipped to 0).

    Raises:
      ValueError: shapes that differ or are not square kernels; NaN or Inf; an all-zero
        kernel (no direction).
      TypeError: non-floating arrays.

    Cost: one pass over both kernels, 3·M² multiply-adds (M = N·O); memory one row chunk
    (64 MiB) of each.

    Example:
      >>> import numpy as np
      >>> from ntk_core import metrics
      >>> k = np.array([[2.0, 1.0], [1.0, 2.0]])                # (N, N) = (2, 2)
      >>> metrics.kernel_distance(k, 3 * k)                     # same up to scale
      0.0
      >>> metrics.kernel_distance(np.diag([1.0, 0.0]), np.diag([0.0, 1.0]))  # orthogonal
      1.0

    References:
      Fort, Dziugaite, Paul, Kharaghani, Roy, Ganguli, "Deep learning versus kernel
      learning: an empirical study of loss landscape geometry and the time evolution of
      the Neural Tangent Kernel", NeurIPS 2020 (kernel distance, section 4).
    """
    fn = "kernel_distance"
    a, b = HostKernel(fn, "k1", k1), HostKernel(fn, "k2", k2)
    if a.arr.shape != b.arr.shape:
        what = f"k1 has shape {a.arr.shape} and k2 {b.arr.shape}; expected the same shape"
        raise bad(ValueError, fn, what, "compute both on the same inputs with the same trace_axes")
    dot = n1 = n2 = 0.0
    for (_, x), (_, y) in zip(a.chunks(), b.chunks(), strict=True):
        dot += float(np.vdot(x, y))
        n1 += float(np.vdot(x, x))
        n2 += float(np.vdot(y, y))
    for name, norm in (("k1", n1), ("k2", n2)):
        if norm == 0.0:
            raise _undefined(fn, f"{name} is all zeros", "the cosine", "a non-zero kernel")
    return max(0.0, 1.0 - dot / math.sqrt(n1 * n2))


def _undefined(fn, what, quantity, fix) -> ValueError:
    return bad(ValueError, fn, f"{what}, so {quantity} is undefined", f"pass {fix}")


def _targets(fn: str, k: HostKernel, y) -> np.ndarray:
    """Targets as the float64 ``(M, R)`` matrix Y with target kernel Y Yᵀ."""
    arr = np.asarray(y)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        what = f"y must be real numbers (floating or integer labels), got dtype {arr.dtype}"
        raise bad(TypeError, fn, what, "encode the targets as numbers, e.g. one-hot or ±1")
    if k.out_shape and arr.shape != (k.n,) + k.out_shape:  # one target per flat row
        what = f"k has shape {k.arr.shape}, so y must have shape {(k.n,) + k.out_shape}"
        raise bad(ValueError, fn, f"{what}, got {arr.shape}", _TARGETS_FIX)
    if arr.ndim == 0 or arr.shape[0] != k.n:
        what = f"k has N = {k.n} samples, so y must have shape (N,) or (N, O), got {arr.shape}"
        raise bad(ValueError, fn, what, _TARGETS_FIX)
    fix = "drop or impute the samples with missing targets (and their kernel rows and columns)"
    check_finite(fn, "y", arr, fix, cls=ValueError)
    return (arr.reshape(k.m, 1) if k.out_shape else arr.reshape(k.n, -1)).astype(np.float64)


def _alignment(fn: str, k, y, centered: bool) -> float:
    kern = HostKernel(fn, "k", k)
    t = _targets(fn, kern, y)
    if centered:  # H = I − 11ᵀ/N on the samples, per output entry (H ⊗ I_O)
        t3 = t.reshape(kern.n, kern.o, -1)
        t = (t3 - t3.mean(axis=0)).reshape(t.shape)
    n, o = kern.n, kern.o
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
            c = block.reshape(-1, o, n, o) - col_means[None]
            c -= row_means[s][:, :, None, :]
            c += grand[None, :, None, :]
            knorm2 += float(np.vdot(c, c))
    tnorm = float(np.linalg.norm(t.T @ t))  # ‖Y Yᵀ‖_F = ‖Yᵀ Y‖_F
    what = "centred " if centered else ""
    if knorm2 == 0.0:
        fix = "a non-zero kernel" + (" that is not constant over the samples" if centered else "")
        raise _undefined(fn, f"the {what}kernel is all zeros", "the alignment", fix)
    if tnorm == 0.0:
        fix = "targets that vary" + (
            " over the samples (centring removes the mean)" if centered else ""
        )
        raise _undefined(fn, f"the {what}targets are all zeros", "the alignment", fix)
    return num / (math.sqrt(knorm2) * tnorm)


@_doc
def kernel_alignment(k, y) -> float:
    """Kernel-target alignment of Cristianini et al.: the cosine between K and Y Yᵀ.

        A(K, Y) = ⟨K, Y Yᵀ⟩_F / (‖K‖_F ‖Y Yᵀ‖_F) = tr(Yᵀ K Y) / (‖K‖_F ‖Yᵀ Y‖_F)

    1 when K is a positive multiple of Y Yᵀ; in ``[0, 1]`` for positive semi-definite
    K; higher means the kernel's leading directions fit the targets.

    Args:
      k: the kernel.
      {targets}

    {shapes}

    Returns:
      ``A`` as a Python float.

    Raises:
      ValueError: k not a square kernel; y's shape not matching k; NaN or Inf in either;
        an all-zero kernel or targets.
      TypeError: non-floating k, non-numeric y.

    Cost: one pass over K, 2·M²·R multiply-adds for K Y (M = N·O, R target columns);
    memory one row chunk (64 MiB) and M·R.

    Example:
      >>> import numpy as np
      >>> from ntk_core import metrics
      >>> y = np.array([1.0, -1.0, 1.0])                       # (N,)
      >>> round(metrics.kernel_alignment(np.outer(y, y), y), 12)  # K = y yᵀ, (N, N)
      1.0
      >>> round(metrics.kernel_alignment(np.eye(3), y), 6)     # tr(yᵀy)/(√3·‖y‖²)
      0.57735

    References:
      Cristianini, Shawe-Taylor, Elisseeff, Kandola, "On Kernel-Target Alignment",
      Advances in Neural Information Processing Systems 14 (NIPS 2001), MIT Press 2002.
    """
    return _alignment("kernel_alignment", k, y, centered=False)


@_doc
def centered_kernel_alignment(k, y) -> float:
    """Centred kernel-target alignment of Cortes, Mohri & Rostamizadeh (2012).

        A_c(K, Y) = ⟨K_c, L_c⟩_F / (‖K_c‖_F ‖L_c‖_F),  K_c = H K H,  L_c = H Y Yᵀ H,
        H = I − 11ᵀ/N

    Centring removes the samples' mean in feature space, so a constant offset of the
    kernel (K + c·11ᵀ) or of the targets does not change it, unlike
    :func:`kernel_alignment`. For an ``(N, N, O, O)`` kernel H acts on the samples
    only, for each output entry (H ⊗ I_O on the flat kernel). Computed as
    tr(Y_cᵀ K Y_c) / (‖K_c‖_F ‖Y_cᵀ Y_c‖_F) with Y_c = H Y (H is idempotent).

    Args:
      k: the kernel.
      {targets}

    {shapes}

    Returns:
      ``A_c`` as a Python float, in ``[-1, 1]`` (``[0, 1]`` for positive semi-definite
      K).

    Raises:
      ValueError: as :func:`kernel_alignment`, and a kernel or targets that centring
        makes zero (constant over the samples).
      TypeError: as :func:`kernel_alignment`.

    Cost: two passes over K (the second forms K_c chunk by chunk), about 4·M² + 2·M²·R
    flops; memory one row chunk, M·R and N·O² row sums.

    Example:
      >>> import numpy as np
      >>> from ntk_core import metrics
      >>> y = np.array([1.0, -1.0, 1.0, -1.0])                 # (N,)
      >>> k = np.outer(y, y) + 5.0                              # y yᵀ plus a constant
      >>> round(metrics.centered_kernel_alignment(k, y), 12)
      1.0
      >>> metrics.kernel_alignment(k, y) < 0.5
      True

    References:
      Cortes, Mohri, Rostamizadeh, "Algorithms for Learning Kernels Based on Centered
      Alignment", Journal of Machine Learning Research 13, 2012 (definition 1, 2).
    """
    return _alignment("centered_kernel_alignment", k, y, centered=True)


@_doc
def effective_rank(kernel=None, *, eigenvalues=None) -> float:
    """Effective rank of Roy & Vetterli (2007): exp of the entropy of the spectrum.

        erank = exp(−Σ_i p_i log p_i),  p_i = σ_i / Σ_j σ_j,

    σ_i = |λ_i| the singular values of the (symmetric) kernel, its eigenvalues when it
    is positive semi-definite (round-off below 0 counts by magnitude); 0·log 0 = 0.
    Between 1 (rank one) and M (all eigenvalues equal); N for the identity.

    Args:
      kernel: a symmetric kernel; all its eigenvalues are computed (dense).
      eigenvalues: instead of ``kernel`` (keyword-only), a 1-D array of eigenvalues,
        e.g. from :func:`ntk_core.spectrum.kernel_eigsh`. Given only the top k, the
        result is the effective rank of that truncated spectrum (at most k).

    {shapes}

    Returns:
      The effective rank as a Python float.

    Raises:
      TypeError: both or neither of kernel and eigenvalues given; a non-floating kernel.
      ValueError: kernel not square, not symmetric (to 100·u·max|K|) or 1-D (a
        per-sample diagonal, or eigenvalues passed positionally); NaN or Inf;
        eigenvalues not 1-D, complex, or all zero.

    Cost: with ``kernel``, one float64 eigenvalue decomposition of the ``(M, M)``
    matrix (M = N·O): about 4/3·M³ flops and 8·M² bytes; with ``eigenvalues``, O(M).

    Example:
      >>> import numpy as np
      >>> from ntk_core import metrics
      >>> round(metrics.effective_rank(np.eye(4)), 12)          # (N, N) = (4, 4)
      4.0
      >>> round(metrics.effective_rank(np.ones((4, 4))), 12)    # rank one
      1.0
      >>> round(metrics.effective_rank(eigenvalues=[1.0, 1.0, 0.0]), 12)
      2.0

    References:
      Roy, Vetterli, "The effective rank: A measure of effective dimensionality",
      15th European Signal Processing Conference (EUSIPCO), 2007.
    """
    fn = "effective_rank"
    s = np.abs(eigenvalues_of(fn, kernel, eigenvalues))
    total = float(s.sum())
    if total == 0.0:
        what = "every eigenvalue is 0 (a zero kernel)"
        raise _undefined(fn, what, "the normalised spectrum p_i", "a non-zero kernel")
    p = s[s > 0] / total
    return float(math.exp(-float(np.sum(p * np.log(p)))))


kernel_distance = _checked_arguments(kernel_distance)
kernel_alignment = _checked_arguments(kernel_alignment)
centered_kernel_alignment = _checked_arguments(centered_kernel_alignment)
effective_rank = _checked_arguments(effective_rank)
