"""Per-sample independence behind ``vmap_axes=0`` (BatchNorm in training mode and batch
means break it): first a proof on the model's jaxpr that row i of every output reads only
row i of x (:func:`ntk_core._jax.sample_axes.rows_separate`, no compilation) and, its jaxpr
on one sample compared, that N is only the samples' axis (``sized_by_n``); where that is not
shown, the probe: the model on a batch of three and, for each row, on that batch with the
other rows changed, and alone; no row's outputs, nor their derivatives along a parameter
direction (jvp, or per-row pullbacks where a custom_vjp has no jvp), may move."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._errors import bad, one_line
from ntk_core._impl.base import QUICK_CPU_OPTIONS, at_top_level, tuned
from ntk_core._jax.environment import _user_stacklevel
from ntk_core._jax.sample_axes import rows_separate, sized_by_n
from ntk_core._kernel import checks as _checks


def _head(leaf, k: int) -> np.ndarray:
    """The first ``k`` samples, indexed on the host (no per-shape compilation)."""
    if (
        isinstance(leaf, jax.Array)
        and not isinstance(leaf, jax.core.Tracer)  # np.asarray refuses it: no probe
        and any(d.platform != "cpu" for d in leaf.devices())
    ):
        leaf = leaf[:k]  # only k samples cross to the host
    return np.asarray(leaf)[:k]


def _samples(x, k: int) -> list:
    """The first ``k`` samples of ``x``, each a batch of one."""
    x = jax.tree.map(lambda leaf: _head(leaf, k), x)
    n = jax.tree.leaves(x)[0].shape[0]
    return [jax.tree.map(lambda leaf, i=i: leaf[i : i + 1], x) for i in range(n)]


def _next_seen(row, seen):
    """Per position, the next larger value that a sample has there (cyclic); where all
    samples agree, 0 (1 where that is 0): integer inputs (token ids, masks) that differ."""
    v, s = np.asarray(row, np.float64), np.asarray(seen, np.float64)
    above = np.where(s > v, s, np.inf).min(axis=0, keepdims=True)
    other = np.where(np.isfinite(above), above, s.min(axis=0, keepdims=True))
    return np.where(other == v, (v == 0).astype(np.float64), other).astype(row.dtype)


def _batches(x1, x2):
    """A batch of three samples (two would hide a batch standardisation) and, for each row
    i, that batch with every other row changed, leaf by leaf: floats affinely plus noise
    (missing rows: affine copies of the first), integers to values other samples have at
    the same positions (a missing row mixes two samples)."""
    samples = _samples(x1, 4)
    if x2 is not None and len(samples) < 4:
        samples += _samples(x2, 4 - len(samples))
    leaves, tree = jax.tree.leaves(samples), jax.tree.structure(samples[0])
    width = len(leaves) // len(samples)
    rng = np.random.default_rng(1)  # an affine map alone keeps its fixed point (0.2)
    base, moved = [], []  # per leaf: its three rows, and those rows changed
    for per_sample in (leaves[i::width] for i in range(width)):
        b = per_sample[:3]
        if jnp.issubdtype(b[0].dtype, jnp.inexact):
            b = (b + [(a * b[0] + c).astype(b[0].dtype) for a, c in ((0.7, -0.3), (1.3, 0.2))])[:3]
            m = [
                (-1.5 * v + 0.5 + 0.25 * rng.standard_normal(np.shape(v))).astype(v.dtype)
                for v in b
            ]
        else:
            if len(b) == 2:  # every other position from the second sample
                b.append(np.where((np.arange(b[0].size) % 2 == 1).reshape(b[0].shape), b[1], b[0]))
            b = (b + [b[0]] * 2)[:3]
            m = [_next_seen(v, np.concatenate(per_sample)) for v in b]
        base.append(b)
        moved.append(m)
    rows = [jax.tree.unflatten(tree, [b[j] for b in base]) for j in range(3)]
    changed = [jax.tree.unflatten(tree, [m[j] for m in moved]) for j in range(3)]
    return rows, [[r if j == i else changed[j] for j, r in enumerate(rows)] for i in range(3)]


def _abstract(tree, n: int | None = None):
    """``tree``'s shapes and dtypes (axis 0 of size ``n`` if given), as a parameter
    direction when ``n`` is None: float0 for integer leaves."""

    def one(v):
        shape = np.shape(v) if n is None else (n, *np.shape(v)[1:])
        real = n is not None or jnp.issubdtype(v.dtype, jnp.inexact)
        return jax.ShapeDtypeStruct(shape, v.dtype if real else jax.dtypes.float0)

    return jax.tree.map(one, tree)


def _tangent(params):
    """A fixed random direction in parameter space (float0 zeros for integer leaves)."""
    rng = np.random.default_rng(0)

    def one(v):
        if jnp.issubdtype(v.dtype, jnp.inexact):
            return rng.standard_normal(np.shape(v)).astype(v.dtype)
        return np.zeros(np.shape(v), jax.dtypes.float0)

    return jax.tree.map(one, params)


def _proved(run, params, x, aux, n: int) -> bool:
    """Whether the jaxprs of ``run(params, x, aux, tangent)`` (a jit) on ``n`` samples and on
    one prove that row i of its outputs reads only row i of ``x`` and that N is only a
    size (the tangent abstract: nothing is drawn)."""

    def trace(rows: int):
        args = (params, _abstract(x, rows), aux, _abstract(params))
        flags = [i == 1 for i, tree in enumerate(args) for _ in jax.tree.leaves(tree)]
        closed = run.trace(*args).jaxpr
        extra = len(closed.jaxpr.invars) - len(flags)  # values a user's jax.grad traces: first
        shapes = [tuple(np.shape(v)) for v in jax.tree.leaves(args)]
        if extra < 0 or [tuple(v.aval.shape) for v in closed.jaxpr.invars[extra:]] != shapes:
            return None, flags
        return closed, [False] * extra + flags

    (closed, flags), (one, _) = trace(n), trace(1)  # 1: what the kernel's vmap evaluates
    sized = None if closed is None or one is None else sized_by_n(closed, one, n, 1)
    return sized is not None and rows_separate(closed, flags, n, sized)


def _with_derivative(apply3):
    """The model's outputs and their derivative along a parameter direction: row i of the
    derivative moves with the other rows where only the gradient mixes samples (a gate at
    zero, a custom_jvp rule, stop_gradient tricks)."""

    def outputs(params, x, aux, tangent):
        return jax.jvp(lambda p: apply3(p, x, aux), (params,), (tangent,))

    return outputs


def _proved_abstract(apply3, params, x1, aux, fn_name: str, warn: bool):
    """With traced arguments (no values to probe): False where the jaxpr proves the
    samples independent; else None, with a warning if ``warn`` (a user's jax.jit or grad
    around the kernel, not the library's own traced parameters)."""
    try:
        if _proved(jax.jit(_with_derivative(apply3)), params, x1, aux, 3):
            return False
    except (TypeError, ValueError, NotImplementedError):
        pass  # no jvp (custom_vjp) or the model fails here: not shown
    if warn:
        what = "inside jax.jit or grad the samples' independence cannot be probed nor proved"
        fix = "call the kernel once outside jit (it is checked then), or pass vmap_axes=None"
        warnings.warn(bad(UserWarning, fn_name, what, fix).args[0], stacklevel=_user_stacklevel())
    return None


def _with_pullbacks(apply3):
    """For a model without a jvp (custom_vjp): its outputs and, per row i, the parameter
    gradient of row i's outputs along a fixed direction (stacked on axis 0), which moves
    with the other rows where a custom backward pass mixes samples."""

    def outputs(params, x, aux, tangent):
        out, pull = jax.vjp(lambda p: apply3(p, x, aux), params)
        first = jax.tree.leaves(out)[0]
        rows = jnp.eye(first.shape[0], dtype=first.dtype)

        def row(e):  # ones on row i of every output, zeros elsewhere
            def on_row(o):
                return jnp.ones_like(o) * e.reshape(e.shape + (1,) * (o.ndim - 1))

            return pull(jax.tree.map(on_row, out))

        return out, jax.vmap(row)(rows)

    return outputs


#: What :func:`samples_interact` found: the ValueError's text.
INTERACT = "the model's output for one sample depends on the other samples of its batch"
POSITION = "the model's output for one sample depends on N or on its place in the batch"
#: A row's outputs alone against the batch of three: two programs whose rounding a chaotic
#: float32 recurrence amplifies (a tanh RNN of gain 2.5 over 100 steps: 4e-5; x / N: 0.7).
ALONE_RTOL = 1e-2


def _moved(a, b, rows_a, rows_b, rtol: float) -> bool:
    """Whether rows ``rows_a`` of outputs ``a`` and ``rows_b`` of ``b`` differ (finite)."""
    for u, v in zip(a, b, strict=True):
        if u.dtype == jax.dtypes.float0:  # the gradient of an integer leaf
            continue
        u, v = np.asarray(u, np.float64)[rows_a], np.asarray(v, np.float64)[rows_b]
        scale = max(np.abs(u).max(initial=0.0), np.abs(v).max(initial=0.0), 1e-30)
        finite = np.all(np.isfinite(u)) and np.all(np.isfinite(v))  # else reported elsewhere
        if finite and np.abs(u - v).max(initial=0.0) > rtol * scale:
            return True
    return False


def samples_interact(apply3, params, x1, x2, aux, fn_name: str, rtol: float = 1e-4):
    """Whether some sample's outputs, or their derivatives along a parameter direction,
    change with the other samples of its batch (:data:`INTERACT`), or with N or its place
    (:data:`POSITION`, each row alone in a batch of one): that text, False, or None when
    not checked (abstract arguments the jaxprs do not prove independent)."""
    traced = any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves((params, aux)))
    x1_traced = any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(x1))
    if traced or x1_traced or not at_top_level():  # or a user's grad of a closed-over value
        return _proved_abstract(apply3, params, x1, aux, fn_name, warn=x1_traced or not traced)
    try:
        batches = _batches(x1, x2)

        def stack(samples):
            return jax.tree.map(lambda *leaves: np.concatenate(leaves), *samples)

        base, variants = stack(batches[0]), [stack(v) for v in batches[1]]
        alone = [jax.tree.map(lambda v, i=i: v[i : i + 1], base) for i in range(3)]

        def attempt(fn, prove: bool):
            run = jax.jit(fn, **tuned(QUICK_CPU_OPTIONS))
            if prove and _proved(run, params, base, aux, len(batches[0])):
                return None
            tangent = _tangent(params)  # drawn only for a numeric probe
            runs = [run(params, x, aux, tangent) for x in [base, *variants, *alone]]
            return [jax.tree.leaves(r) for r in runs], len(jax.tree.leaves(runs[0][0]))

        try:
            try:
                found = attempt(_with_derivative(apply3), prove=True)
            except (TypeError, ValueError, NotImplementedError):  # no jvp (custom_vjp)
                found = attempt(_with_pullbacks(apply3), prove=False)
            if found is None:
                return False
            outs, width = found
        except jax.errors.UnexpectedTracerError as error:
            raise _checks.leaked_tracer_error(fn_name, error) from error
        except (TypeError, ValueError, IndexError) as error:
            what = f"the model fails on a batch of 1 or 3 samples: {one_line(error)}"
            raise _checks.samples_interact_error(
                fn_name, what, "keep the batch axis for any N (vmap_axes=0 checks small batches)"
            ) from error
        # Row i alone kept: its outputs must not move; nor in a batch of its own.
        if any(_moved(outs[0], moved, i, i, rtol) for i, moved in enumerate(outs[1:4])):
            return INTERACT
        # Alone: the outputs only (programs of two shapes round apart, which a chaotic
        # recurrence amplifies in its derivative: 1e-2 measured), to ALONE_RTOL.
        whole, own = outs[0][:width], enumerate(outs[4:])
        moved = any(_moved(whole, o[:width], i, 0, ALONE_RTOL) for i, o in own)
        return POSITION if moved else False
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
