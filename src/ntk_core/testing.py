"""Kernel assertions for a user's own tests: ``assert_kernels_close`` (dtype tolerances scaled
by the kernels' magnitude), ``assert_same_ntk`` (two networks have the same NTK, or the leaves
that differ are named), the weight transplants ``params_from_flax`` / ``params_from_haiku``
(``examples/test_same_ntk.py``). Needs no pytest, flax or haiku; see ``pytest_plugin``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ntk_core._errors import bad
from ntk_core._transplant import params_from_flax, params_from_haiku

__all__ = ("TOLERANCE", "assert_kernels_close", "assert_same_ntk", "params_from_flax",
    "params_from_haiku", "tolerance")  # fmt: skip

#: Relative tolerance by dtype: max |K_a − K_b| <= rtol · max(max |K_a|, max |K_b|) (float32
#: kernels of one network agree to a few 1e-6, float64 to ~1e-14).
TOLERANCE = {"float16": 2e-2, "bfloat16": 2e-2, "float32": 2e-5, "float64": 1e-12}


def tolerance(*dtypes) -> tuple[float, str]:
    """``(rtol, dtype name)`` of the least precise of ``dtypes`` (others, e.g. ints, and none
    given count as float64)."""
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
    where = f"sample {i[0]}" if len(i) == 1 else f"samples x1[{i[0]}], x2[{i[1]}]"
    where += f"; outputs {i[2:]}" if len(i) > 2 else ""
    return (
        f"kernels differ{at}: max |k_a - k_b| = {diff[i]:.3e} at {i} ({where}): "
        f"k_a = {a[i]:.6g}, k_b = {b[i]:.6g}; relative to max |K| = {scale:.4g}: "
        f"{diff[i] / max(scale, 1e-300):.2e} > rtol {rtol:.0e}{dtype_note}"
        f"{f' + atol {atol:.0e}' if atol else ''}; {outside} of {a.size} entries outside"
    )


def assert_kernels_close(k_a, k_b, *, rtol: float | None = None, atol: float | None = None):
    """Asserts two kernels are equal up to round-off of their dtype.

    Passes when ``max |k_a − k_b| <= atol + rtol · s`` for every array, ``s`` the largest
    magnitude in either kernel (relative to the kernel's scale, not per entry). Defaults:
    ``rtol`` the :data:`TOLERANCE` of the less precise dtype (float32: 2e-5; float64: 1e-12;
    float16/bfloat16: 2e-2), ``atol`` 0.

    Args:
      k_a, k_b: arrays of one shape (jax or numpy), e.g. ``(N1, N2)``, ``(N1, N2, O, O)``
        or ``(N,)``, or equal pytrees of them (pytree outputs, per-leaf kernels).
      rtol, atol: relative and absolute tolerances; ``None`` for the defaults.

    Raises:
      AssertionError: shapes or pytrees differ, NaN or Inf, or a difference beyond the
        tolerance: the message gives it, its index with the sample pair (``x1``, ``x2``)
        and outputs, both values, the relative error, the tolerance and the count outside.
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
        what = f"implementation={implementation!r} names no implementation"
        raise bad(ValueError, "assert_same_ntk", what, f"pass None or names from {known}")
    return names


def _leaf_table(per_a, per_b, rtol, atol) -> str:
    """Per-leaf kernels side by side, each leaf of A beside the closest unused one of B."""
    rows_a, rows_b = _leaves(per_a, "per-leaf k_a"), _leaves(per_b, "per-leaf k_b")
    unused = list(range(len(rows_b)))
    lines, differ = [], []
    for path, a, dtype in rows_a:
        same = [j for j in unused if rows_b[j][1].shape == a.shape]
        close = {j: np.abs(a - rows_b[j][1]).max(initial=0.0) for j in same}
        best = min((j for j in same if close[j] < np.inf), key=close.get, default=None)
        scale = max(np.abs(a).max(initial=0.0), 1e-300)
        if best is None:
            lines.append(f"  {path:30s} max|K| {scale:10.4g}  | (no leaf of the same shape)")
            differ.append(path)
            continue
        unused.remove(best)
        b_path, b, b_dtype = rows_b[best]
        r = tolerance(dtype, b_dtype)[0] if rtol is None else rtol
        b_scale = np.abs(b).max(initial=0.0)
        ok = close[best] <= (atol or 0.0) + r * max(scale, b_scale)
        mark = "" if ok else "   <-- differs"
        lines.append(
            f"  {path:30s} max|K| {scale:10.4g}  | {b_path:30s} max|K| {b_scale:10.4g}{mark}"
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

    ``ntk_core.empirical_ntk(fn, params, x1, x2, implementation=..., **options)`` of both,
    compared by :func:`assert_kernels_close`. Each ``fn(params, x)`` is pure: Flax ``lambda
    p, x: model.apply({"params": p, **rest}, x)``, Haiku ``hk.without_apply_rng(...).apply``,
    equinox ``lambda p, x: eqx.combine(p, static)(x)``. A failure also lists both sides'
    per-leaf kernels (:func:`ntk_core.empirical_ntk_per_leaf`), each leaf of A beside the
    closest of B of its shape, naming the leaves of A without a match (a missed weight, a
    transposed kernel, another activation).

    Args:
      fn_a, params_a, fn_b, params_b: the two networks and their parameter pytrees (leaves
        are paired by kernel, not by name).
      x1: inputs ``(N1, ...)``; x2: ``(N2, ...)`` or ``None`` for ``x1``.
      implementation: ``None``: every name of ``ntk_core.IMPLEMENTATIONS`` but ``"auto"``;
        or a name or list of names.
      rtol, atol: as in :func:`assert_kernels_close`.
      **options: passed to ``empirical_ntk`` (``trace_axes``, ``diagonal_axes``, ...).

    Raises:
      AssertionError: the kernels differ for an implementation (named, with the largest
        difference and the per-leaf table).
      ValueError: an unknown ``implementation``; ``empirical_ntk``'s errors propagate.

    Cost: two kernels per implementation, O(N1 N2 O² P) each; two per-leaf kernels on failure.

    Example:
      >>> import jax.numpy as jnp
      >>> from ntk_core.testing import assert_same_ntk
      >>> x = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)
      >>> a = {"w": jnp.ones((2, 3)), "v": jnp.ones((3, 1))}
      >>> b = (a["w"], a["v"])                          # another pytree, same weights
      >>> assert_same_ntk(lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"], a,
      ...                 lambda p, x: jnp.tanh(x @ p[0]) @ p[1], b, x)

    References: the kernel of Jacot, Gabriel, Hongler, "Neural Tangent Kernel" (NeurIPS
    2018), in the layout of neural-tangents' ``empirical_ntk_fn``.
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
