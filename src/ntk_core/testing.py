"""Assertions for comparing kernels in a user's own tests (pytest or not).

``assert_kernels_close`` compares two kernels with tolerances taken from their dtypes and
scaled by the kernels' magnitude, and says where they differ. ``assert_same_ntk`` checks
that two networks (the same architecture in two frameworks, or a model and its hand-written
twin) have the same NTK, and names the parameter leaves whose kernels differ. With the
weight transplants ``params_from_flax`` and ``params_from_haiku`` (also exported as
``ntk_haiku.params_from_flax`` and ``ntk_flax.params_from_haiku``) this is the whole of a
cross-framework check; ``examples/test_same_ntk.py`` is one to copy.

Importing this module needs neither pytest nor flax nor haiku. The pytest plugin
(``ntk_core.pytest_plugin``, registered when ntk-jax is installed) offers both assertions
as fixtures.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ntk_core._transplant import params_from_flax, params_from_haiku

__all__ = (
    "TOLERANCE",
    "assert_kernels_close",
    "assert_same_ntk",
    "params_from_flax",
    "params_from_haiku",
    "tolerance",
)

#: Relative tolerance by dtype: max |K_a − K_b| <= rtol · max(max |K_a|, max |K_b|).
#: float32 kernels of the same network agree to a few 1e-6 relative (round-off of the
#: Jacobian contraction, summed over P parameters); float64 to ~1e-14.
TOLERANCE = {"float16": 2e-2, "bfloat16": 2e-2, "float32": 2e-5, "float64": 1e-12}


def tolerance(*dtypes) -> tuple[float, str]:
    """``(rtol, dtype name)`` of the least precise of ``dtypes`` (dtypes not in
    :data:`TOLERANCE`, such as ints, count as float64); float64 when none is given."""
    names = [np.dtype(d).name for d in dtypes]
    names = [n if n in TOLERANCE else "float64" for n in names] or ["float64"]
    worst = max(names, key=TOLERANCE.__getitem__)
    return TOLERANCE[worst], worst


def _leaves(tree, name: str) -> list[tuple[str, np.ndarray, str]]:
    """``(path, float64 array, dtype name)`` for each array of ``tree``, in pytree order."""
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        items = [("", tree)]
    else:
        import jax

        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        items = [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]
    if not items:
        raise TypeError(f"assert_kernels_close: {name} holds no array, got {tree!r}")
    out = []
    for path, leaf in items:
        dtype = getattr(leaf, "dtype", np.asarray(leaf).dtype)
        out.append((path, np.asarray(leaf, dtype=np.float64), np.dtype(dtype).name))
    return out


def _where(index: tuple[int, ...]) -> str:
    """The sample and output indices of ``index`` in neural-tangents' layout."""
    if len(index) == 1:
        return f"sample {index[0]}"
    outputs = f"; outputs {index[2:]}" if len(index) > 2 else ""
    return f"samples x1[{index[0]}], x2[{index[1]}]{outputs}"


def _compare(path, a, b, rtol, atol, dtype_note) -> str | None:
    """The failure message for one pair of arrays, or None if they are close."""
    at = f" at {path}" if path else ""
    if a.shape != b.shape:
        return f"shapes differ{at}: k_a {a.shape}, k_b {b.shape}"
    bad = ~(np.isfinite(a) & np.isfinite(b))
    if bad.any():
        i = tuple(int(j) for j in np.unravel_index(np.argmax(bad), a.shape))
        count = f"{int(bad.sum())} of {a.size} entries"
        return f"non-finite entries{at} ({count}); first at {i}: k_a {a[i]}, k_b {b[i]}"
    scale = max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0))
    diff = np.abs(a - b)
    allowed = atol + rtol * scale
    if a.size == 0 or diff.max() <= allowed:
        return None
    i = tuple(int(j) for j in np.unravel_index(np.argmax(diff), a.shape))
    outside = int((diff > allowed).sum())
    return (
        f"kernels differ{at}: max |k_a - k_b| = {diff[i]:.3e} at {i} ({_where(i)}): "
        f"k_a = {a[i]:.6g}, k_b = {b[i]:.6g}; relative to max |K| = {scale:.4g}: "
        f"{diff[i] / max(scale, 1e-300):.2e} > rtol {rtol:.0e}{dtype_note}"
        f"{f' + atol {atol:.0e}' if atol else ''}; {outside} of {a.size} entries outside"
    )


def assert_kernels_close(k_a, k_b, *, rtol: float | None = None, atol: float | None = None):
    """Asserts two kernels are equal up to round-off of their dtype.

    Passes when ``max |k_a − k_b| <= atol + rtol · s`` for every array, where ``s`` is the
    largest magnitude in either kernel (so the test is relative to the kernel's scale and
    does not fail on entries near zero). Default ``rtol`` is :data:`TOLERANCE` of the less
    precise dtype of the two (float32: 2e-5; float64: 1e-12; float16/bfloat16: 2e-2),
    default ``atol`` 0.

    Args:
      k_a, k_b: kernels of the same shape: arrays (jax or numpy), e.g. ``(N1, N2)``,
        ``(N1, N2, O, O)`` or ``(N,)`` in neural-tangents' layout, or equal pytrees of
        them (kernels of a pytree output, per-leaf kernels).
      rtol, atol: relative and absolute tolerances; ``None`` for the defaults above.

    Raises:
      AssertionError: shapes or pytree structures differ; an entry is NaN or Inf; or the
        largest difference exceeds the tolerance. The message gives that difference, its
        index with the sample pair (axes 0 and 1 index ``x1`` and ``x2``) and output
        pair, both values, the relative error, which tolerance applied and how many
        entries are outside it.
      TypeError: a kernel holds no array.

    Cost: O(size of the kernels) on the host, in float64.

    Example:
      >>> import numpy as np
      >>> from ntk_core.testing import assert_kernels_close
      >>> k = np.array([[2.0, 1.0], [1.0, 2.0]], np.float32)
      >>> assert_kernels_close(k, k * (1 + 1e-6))
      >>> assert_kernels_close(k, k + np.eye(2, dtype=np.float32) * 1e-3)
      Traceback (most recent call last):
      AssertionError: kernels differ: max |k_a - k_b| = ...e-04 at (0, 0) (samples x1[0], x2[0])...
    """
    a_leaves, b_leaves = _leaves(k_a, "k_a"), _leaves(k_b, "k_b")
    if [p for p, _, _ in a_leaves] != [p for p, _, _ in b_leaves]:
        paths = [p for p, _, _ in a_leaves], [p for p, _, _ in b_leaves]
        raise AssertionError(f"kernel pytrees differ: k_a has {paths[0]}, k_b has {paths[1]}")
    for (path, a, da), (_, b, db) in zip(a_leaves, b_leaves, strict=True):
        default, worst = tolerance(da, db)
        r = default if rtol is None else float(rtol)
        note = f" ({worst} tolerance of {da} and {db})" if rtol is None else " (given)"
        failure = _compare(path, a, b, r, 0.0 if atol is None else float(atol), note)
        if failure:
            raise AssertionError(failure)


def _implementations(implementation) -> list[str]:
    from ntk_core._kernel.options import IMPLEMENTATIONS  # ("auto", *the registry)

    known = list(IMPLEMENTATIONS[1:])
    if implementation is None:
        return known
    names = [implementation] if isinstance(implementation, str) else list(implementation)
    unknown = [n for n in names if n not in IMPLEMENTATIONS]
    if unknown or not names:
        what = f"implementation={implementation!r}"
        raise ValueError(f"assert_same_ntk: {what}; expected None or names from {known}")
    return names


def _leaf_table(per_a, per_b, rtol, atol) -> str:
    """Side-by-side per-leaf kernels; pairs each leaf of A with the closest unused leaf of
    B of the same kernel shape and marks those with no close partner."""
    rows_a, rows_b = _leaves(per_a, "per-leaf k_a"), _leaves(per_b, "per-leaf k_b")
    unused = list(range(len(rows_b)))
    lines, differ = [], []
    for path, a, dtype in rows_a:
        best, best_err = None, np.inf
        for j in unused:
            b = rows_b[j][1]
            if b.shape == a.shape:
                err = np.abs(a - b).max(initial=0.0)
                if err < best_err:
                    best, best_err = j, err
        scale = max(np.abs(a).max(initial=0.0), 1e-300)
        if best is None:
            lines.append(f"  {path:30s} max|K| {scale:10.4g}  | (no leaf of the same shape)")
            differ.append(path)
            continue
        unused.remove(best)
        b_path, b, b_dtype = rows_b[best]
        r = tolerance(dtype, b_dtype)[0] if rtol is None else rtol
        ok = best_err <= (atol or 0.0) + r * max(scale, np.abs(b).max(initial=0.0))
        mark = "" if ok else "   <-- differs"
        lines.append(
            f"  {path:30s} max|K| {scale:10.4g}  | {b_path:30s} max|K| "
            f"{np.abs(b).max(initial=0.0):10.4g}{mark}"
        )
        if not ok:
            differ.append(path)
    lines += [f"  {'':41s}  | {rows_b[j][0]:30s} (no leaf of A pairs with it)" for j in unused]
    named = f"leaves of A whose kernel differs: {differ}" if differ else "every leaf pairs up"
    return "per-leaf NTKs, A | B:\n" + "\n".join(lines) + "\n" + named


def assert_same_ntk(
    fn_a,
    params_a,
    fn_b,
    params_b,
    x1,
    x2=None,
    *,
    implementation: str | Sequence[str] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    **options,
):
    """Asserts two networks have the same empirical NTK on ``x1`` (and ``x2``).

    Computes ``ntk_core.empirical_ntk(fn, params, x1, x2, implementation=..., **options)``
    for both sides and compares them with :func:`assert_kernels_close`. Each side is a
    pure ``fn(params, x)``: for Flax, ``lambda p, x: model.apply({"params": p, **rest},
    x)``; for Haiku, ``transformed.apply`` of ``hk.without_apply_rng``; for equinox,
    ``lambda p, x: eqx.combine(p, static)(x)``. On failure the message also lists the
    per-leaf kernels (:func:`ntk_core.empirical_ntk_per_leaf`) of both sides side by side,
    each leaf of A paired with the closest leaf of B of the same shape, and names the
    leaves of A whose kernel has no match: the layer that differs (a missed weight in a
    transplant, a transposed kernel, another activation).

    Args:
      fn_a, params_a, fn_b, params_b: the two networks and their parameter pytrees (any
        structure and names; leaves are paired by kernel, not by name).
      x1: inputs ``(N1, ...)``; x2: ``(N2, ...)`` or ``None`` for ``x1``.
      implementation: ``None`` checks every implementation of
        ``ntk_core.IMPLEMENTATIONS`` other than ``"auto"``; a name or a list of names
        checks those.
      rtol, atol: as in :func:`assert_kernels_close`.
      **options: passed to ``empirical_ntk`` (``trace_axes``, ``diagonal_axes``,
        ``vmap_axes``, ``precision``, ...).

    Raises:
      AssertionError: the kernels differ for some implementation (the message names it,
        the largest difference, and the per-leaf table).
      ValueError: an unknown ``implementation``; errors of ``empirical_ntk`` for bad
        ``fn``, ``params``, inputs or options propagate.

    Cost: two kernels per implementation, O(N1 N2 O² P) each, plus two per-leaf kernels
    on failure.

    Example:
      >>> import jax.numpy as jnp
      >>> from ntk_core.testing import assert_same_ntk
      >>> x = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)
      >>> a = {"w": jnp.ones((2, 3)), "v": jnp.ones((3, 1))}
      >>> b = (a["w"], a["v"])                          # another pytree, same weights
      >>> assert_same_ntk(lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"], a,
      ...                 lambda p, x: jnp.tanh(x @ p[0]) @ p[1], b, x)

    References:
      The kernel is that of Jacot, Gabriel, Hongler, "Neural Tangent Kernel" (NeurIPS
      2018); the layout that of neural-tangents' ``empirical_ntk_fn``.
    """
    from ntk_core._api import empirical_ntk, empirical_ntk_per_leaf

    for name in _implementations(implementation):
        opts = dict(options, implementation=name)
        k_a = empirical_ntk(fn_a, params_a, x1, x2, **opts)
        k_b = empirical_ntk(fn_b, params_b, x1, x2, **opts)
        try:
            assert_kernels_close(k_a, k_b, rtol=rtol, atol=atol)
        except AssertionError as error:
            per_a = empirical_ntk_per_leaf(fn_a, params_a, x1, x2, **opts)
            per_b = empirical_ntk_per_leaf(fn_b, params_b, x1, x2, **opts)
            table = _leaf_table(per_a, per_b, rtol, atol)
            raise AssertionError(f"implementation={name!r}: {error}\n{table}") from None
