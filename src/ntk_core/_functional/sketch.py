"""The sketched eNTK Θ̂(x1, x2) = Φ(x1) Φ(x2)ᵀ: per sample, a random k-dimensional
projection of the per-sample gradient, built from the structured analysis' per-use inputs
and cotangents so that the P-long gradient is never formed.

Every parameter leaf ℓ gets an independent TensorSketch (Pham & Pagh 2013) of its gradient
seen as a matrix G_ℓ (R x M): bucket (h1(r) + h2(m)) mod k, sign s1(r)·s2(m), with h1, s1
(R values) and h2, s2 (M values) drawn from ``fold_in(key, ℓ)``:

- a use the rules cover: R = C (the use's input coordinates, a fused bias column
  included), M = (traced outputs, K units); G = Σ_pos x_pos ⊗ g_pos is sketched either
  as IFFT(Σ_pos FFT(CS1(x_pos)) · FFT(CS2(g_pos))) (``"tensor"``, nothing C x K formed)
  or from the use's per-sample Jacobian (``"explicit"``, when C·K is small): the same map,
  equal to rounding, chosen by :func:`choose_modes`;
- a leaf no rule covers, and the elementwise scales and shifts: R = traced outputs,
  M = the leaf's entries (a CountSketch with one traced output).

Φ = Σ_ℓ TS_ℓ(G_ℓ) / √(traced outputs): E[Φ_i·Φ_j] = Θ_ij (neural-tangents' traced
normalisation), the variance is in :func:`ntk_sketch_fn`'s docstring.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._blocked import store as _store
from ntk_core._blocked.tiles import auto_batch_size, default_memory_budget, non_finite
from ntk_core._errors import bad, check_int
from ntk_core._functional.ntk_vp import _outputs, checked_inputs
from ntk_core._impl.base import EXACT_CPU_OPTIONS, jit_tuned
from ntk_core._jax import caches as _caches
from ntk_core._jax import memory as _memory
from ntk_core._jax.batches import map_in_batches
from ntk_core._kernel import checks as _checks
from ntk_core._kernel import probe as _probe
from ntk_core._kernel import subset as _subset
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._kernel.caller import core
from ntk_core._kernel.ids import check_ids
from ntk_core._kernel.layout import resolve_layout
from ntk_core._kernel.model import from_apply_fn, one_sample, per_sample_jaxpr
from ntk_core._kernel.options import (
    AUTO_BATCH_SIZE,
    DEFAULTS,
    _block_options,
    _flags,
    _out_options,
    make_options,
    refuse_options,
)
from ntk_core._predict.linalg import check_key
from ntk_core._structured import analysis as _structured
from ntk_core._structured.rules._base import count_sketch
from ntk_core._units import human_bytes

TENSOR, EXPLICIT = _structured.GRAM, _structured.EXPLICIT  # a group's two sketch forms
_PARAMS_X = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("params", "x")]
)

#: Bytes of sketch intermediates per chunk of samples (one XLA loop step).
SKETCH_CHUNK_BYTES = 2**28
#: ``batch_size="auto"`` writes ``out=`` in at least this many blocks (each a resume point).
AUTO_FILE_BLOCKS = 8


def auto_rows(n: int, row_bytes: int, budget: int, to_file: bool) -> int:
    """``batch_size="auto"``: the kernels' :func:`auto_batch_size` of a batch diagonal with
    ``row_bytes`` (one sample's Φ) per sample, B·``row_bytes`` within half of ``budget``;
    with ``to_file`` at most ⌈N / AUTO_FILE_BLOCKS⌉ (both evened out to ⌈N / k⌉)."""
    b = auto_batch_size(n, n, row_bytes, 0, budget, batch_diagonal=True)
    return min(b, -(-n // AUTO_FILE_BLOCKS)) if to_file else b


#: FLOP-equivalents per value a memory-bound pass writes (scatters, FFT inputs), XLA CPU.
VALUE_FLOPS = 10.0
_LOW_PRECISION = (jnp.float16, jnp.bfloat16)


class NTKSketch(NamedTuple):
    """:func:`empirical_ntk_sketch`'s result: the estimate and the features it came from."""

    kernel: Any  # Θ̂(x1, x2): (N1, N2) traced, (N1, N2, O, O) with trace_axes=()
    features1: Any  # Φ(x1): (N1, k), or (N1, O, k)
    features2: Any  # Φ(x2) (features1 when x2 is None)


class Plan(NamedTuple):
    """What one block's jitted sketch needs (hashable: static)."""

    k: int
    trace: tuple[int, ...]  # traced axes of one sample's output
    modes: tuple[str, ...]  # per structured group: TENSOR or EXPLICIT
    chunk: int  # samples per loop step


def choose_modes(analysis, out_shape, trace, k: int) -> tuple[str, ...]:
    """Per group, the cheaper form per sample (FLOP-equivalents, :data:`VALUE_FLOPS` per
    value written): ``"tensor"`` Σ_u A·k·(1 + O_k)·(2.5·log2 k + 2V) + A·(C + M·O_k)·V;
    ``"explicit"`` Σ_u 2·A·C·K·O + C·(M + k)·O_k·V (O_k: kept outputs, M = O_t·K)."""
    o_total = math.prod(out_shape)
    o_traced = math.prod(out_shape[a] for a in trace)
    o_kept = o_total // max(o_traced, 1)
    modes = []
    for group in analysis.groups:
        use0 = analysis.uses[group[0]]
        c, units = analysis.input_size(group[0]), use0.w_free_size
        m = o_traced * units
        tensor = explicit = 0.0
        for u in group:
            a = analysis.uses[u].a_size
            tensor += a * k * (1 + o_kept) * (2.5 * math.log2(k) + 2 * VALUE_FLOPS)
            tensor += a * (c + m * o_kept) * VALUE_FLOPS
            explicit += 2.0 * a * c * units * o_total
        explicit += c * (m + k) * o_kept * VALUE_FLOPS
        gram = use0.rule.has_gram_form and tensor < explicit
        modes.append(TENSOR if gram else EXPLICIT)
    return tuple(modes)


def _hashes(key, leaf: int, rows: int, cols: int, k: int):
    """Leaf ``leaf``'s ``(h1, s1, h2, s2)``: buckets and signs of its R rows and M columns."""
    k1, k2, k3, k4 = jax.random.split(jax.random.fold_in(key, leaf), 4)
    return (
        jax.random.randint(k1, (rows,), 0, k),
        jax.random.rademacher(k2, (rows,), jnp.int32),
        jax.random.randint(k3, (cols,), 0, k),
        jax.random.rademacher(k4, (cols,), jnp.int32),
    )


def _outputs_last(v, o_ndim: int, trace: tuple[int, ...], before: int):
    """``v`` ``(n, *O, *rest)`` as ``(n, *O_kept, *rest[:before], O_t, *rest[before:])``."""
    kept = tuple(1 + a for a in range(o_ndim) if a not in trace)
    traced = tuple(1 + a for a in trace)
    rest = tuple(range(1 + o_ndim, v.ndim))
    v = jnp.transpose(v, (0, *kept, *rest[:before], *traced, *rest[before:]))
    lead = v.shape[: 1 + len(kept) + before]
    return v.reshape(lead + (-1,) + v.shape[len(lead) + len(traced) :])


def _direct(j, h1, s1, h2, s2, k: int):
    """TensorSketch of ``j`` ``(..., R, M)`` into ``(..., k)``: CountSketch of the columns,
    then row r shifted by h1(r) and signed by s1(r)."""
    y = count_sketch(j, h2, s2, k)  # (..., R, k)
    idx = (jnp.arange(k)[None, :] - h1[:, None]) % k
    shifted = jnp.take_along_axis(y, jnp.broadcast_to(idx, y.shape), axis=-1)
    return jnp.einsum("...rk,r->...k", shifted, s1.astype(y.dtype))


def sketch_chunk(apply3, plan: Plan, precision: str, params, aux, x, key):
    """Φ of a chunk of samples ``(n, *O_kept, k)`` (see the module docstring)."""
    args = (apply3, params, one_sample(x), aux)
    analysis, closed = _structured.analysis_for(*args, precision=precision)
    f = _structured.features(
        apply3, params, x, aux, True, plan.modes, None, precision=precision, columns=True
    )
    out = closed.out_avals[0]
    o_ndim, k, trace = len(out.shape), plan.k, plan.trace
    o_traced = math.prod(out.shape[a] for a in trace)
    spectrum, direct = None, None

    def add(total, part):
        return part if total is None else total + part

    explicit = iter(f.explicit[0])
    for group, mode in zip(analysis.groups, plan.modes, strict=True):
        use0 = analysis.uses[group[0]]
        rows, units = analysis.input_size(group[0]), use0.w_free_size
        h1, s1, h2, s2 = _hashes(key, use0.leaf, rows, o_traced * units, k)
        if mode == EXPLICIT:  # (n, *O, R·K) -> (n, *O_kept, R, O_t·K)
            j = next(explicit)
            j = j.reshape(j.shape[: 1 + o_ndim] + (rows, units))
            j = _outputs_last(j, o_ndim, trace, 1)
            j = j.reshape(j.shape[:-2] + (-1,))
            direct = add(direct, _direct(j, h1, s1, h2, s2, k))
            continue
        for u in group:  # Σ_pos FFT(CS1(x_pos)) · FFT(CS2(g_pos))
            use = analysis.uses[u]
            xs = jnp.fft.rfft(use.rule.sketch_input(use, f.x[u], h1, s1, k), axis=-1)
            g = _outputs_last(f.g[0][u], o_ndim, trace, 1)  # (n, *O_kept, A, O_t, K)
            g = g.reshape(g.shape[:-2] + (-1,))
            gs = jnp.fft.rfft(count_sketch(g, h2, s2, k), axis=-1)
            spectrum = add(spectrum, jnp.einsum("naf,n...af->n...f", xs, gs))
    for leaf, j in zip(analysis.fallback, f.fallback[0], strict=True):
        j = _outputs_last(j, o_ndim, trace, 0)  # (n, *O_kept, O_t, P_leaf)
        h1, s1, h2, s2 = _hashes(key, leaf, j.shape[-2], j.shape[-1], k)
        direct = add(direct, _direct(j, h1, s1, h2, s2, k))
    n = jax.tree.leaves(x)[0].shape[0]
    kept = tuple(d for a, d in enumerate(out.shape) if a not in trace)
    phi = jnp.zeros((n, *kept, k), out.dtype)
    if spectrum is not None:
        phi = phi + jnp.fft.irfft(spectrum, n=k, axis=-1).astype(out.dtype)
    if direct is not None:
        phi = phi + direct.astype(out.dtype)
    return phi / np.sqrt(o_traced).astype(out.dtype)


@_caches.lru_cache(maxsize=64)
def _block_fn(apply3, plan: Plan, precision: str) -> Callable:
    """The jitted ``block(params, aux, x, key) -> Φ``, in chunks of ``plan.chunk`` samples
    (``aux``: the parameters ``wrt=`` holds fixed, or None)."""

    def block(params, aux, x, key):
        with jax.default_matmul_precision(precision):
            one = functools.partial(sketch_chunk, apply3, plan, precision, params, aux, key=key)
            return map_in_batches(lambda xb: one(xb), x, plan.chunk)

    return jit_tuned(block, EXACT_CPU_OPTIONS)


def _chunk(apply3, params, aux, x, modes, analysis, out_shape, trace, k, precision) -> int:
    """Samples per loop step: the features' own chunk, and :data:`SKETCH_CHUNK_BYTES` over
    the bytes of one sample's sketch intermediates."""
    n = jax.tree.leaves(x)[0].shape[0]
    feats = _structured.chunk_size(apply3, params, x, aux, True, modes, precision=precision)
    o_traced = math.prod(out_shape[a] for a in trace)
    o_kept = math.prod(out_shape) // max(o_traced, 1)
    values = 0
    for group, mode in zip(analysis.groups, modes, strict=True):
        if mode == TENSOR:
            values += sum(3 * analysis.uses[u].a_size * k * (1 + o_kept) for u in group)
        else:
            values += 2 * analysis.input_size(group[0]) * k * o_kept
    values += 2 * o_traced * k * o_kept * len(analysis.fallback)
    per = max(4 * values, 1)
    most = int(max(1, min(n, feats, SKETCH_CHUNK_BYTES // per)))
    pieces = -(-n // most)
    return -(-n // pieces)


class _Sketcher:
    """The features function of :func:`ntk_sketch_fn` (``features(params, x)``) and of an
    adapter's kernel function (:func:`of_kernel`: ``features(first, x, **keywords)``):
    ``bind(first, x, keywords) -> (params, aux)`` reads the caller's arguments (None: the
    core's params, no keywords), ``split(params, aux)`` applies ``wrt``, ``check(params, x,
    None, aux)`` is an adapter's model check; plans cached per input signature."""

    def __init__(self, caller, apply3, k, key, trace_axes, batch_size, precision, split,
                 bind=None, check=None, signature=None, options=None, plans=None):  # fmt: skip
        self._caller, self._apply3 = caller, apply3
        self.k, self.key, self.trace_axes = k, key, trace_axes
        self.batch_size, self.precision = batch_size, precision
        self.options = options  # the core's: out=, resume=, overwrite=, wrt (None: no file)
        self._split, self._bind, self._check = split, bind, check
        self.__signature__ = signature or _PARAMS_X
        self._plans: dict = {} if plans is None else plans  # shared by keys: _make

    def __repr__(self) -> str:
        return f"<ntk sketch features k={self.k} trace_axes={self.trace_axes}>"

    def _plan(self, params, aux, x, block: int) -> Plan:
        fn = self._caller.name
        xb = jax.tree.map(lambda v: v[:block], x)
        shapes = jax.tree.map(lambda v: (v.shape, str(v.dtype)), (params, aux, xb))
        signature = (jax.tree.structure(shapes), str(shapes))
        found = self._plans.get(signature)
        if found is not None:
            return found
        if self._check is not None:
            self._check(params, xb, None, aux)
        outputs, _ = _outputs(self._caller, self._apply3, params, xb, aux, block)
        if len(outputs) != 1:
            what = f"apply_fn returned {len(outputs)} output arrays; the sketch takes one"
            raise bad(ValueError, fn, what, "concatenate the outputs into one (N, O) array")
        out = outputs[0]
        _check_dtypes(fn, params, out)
        layout = self._layout(out.shape)
        found = _probe.samples_interact(self._apply3, params, xb, None, aux, fn_name=fn)
        if found:
            fix = "sketch a model whose samples are independent (evaluation mode)"
            raise _checks.samples_interact_error(fn, found, fix)
        trace = tuple(a - 1 for a in layout.trace)
        analysis, _ = _structured.analysis_for(
            self._apply3, params, one_sample(xb), aux, precision=self.precision
        )
        modes = choose_modes(analysis, out.shape[1:], trace, self.k)
        args = (analysis, out.shape[1:], trace, self.k, self.precision)
        chunk = _chunk(self._apply3, params, aux, xb, modes, *args)
        plan = Plan(self.k, trace, modes, chunk)
        self._plans[signature] = plan
        return plan

    def _layout(self, out_shape):
        return resolve_layout(self._caller.name, self.trace_axes, (), out_shape, "the output")

    def _call_error(self, what: str) -> TypeError:
        first = next(iter(self.__signature__.parameters))
        return bad(TypeError, f"{self._caller.name}(...)(...)", what, f"call features({first}, x)")

    def _arguments(self, first, x, keywords: dict):
        """``(params, aux)`` of a call (the core's: ``(params, None)``, no keywords)."""
        if self._bind is not None:
            return self._bind(first, x, keywords)
        if keywords:
            names = ", ".join(map(repr, sorted(keywords)))
            raise self._call_error(f"unknown keyword argument(s) {names}")
        return first, None

    def __call__(self, *args, **kwargs):
        """Φ(x) ``(N, *O_kept, k)``: a ``jax.Array``, a numpy one with ``batch_size``; the
        first two arguments by position or by their names in ``__signature__``."""
        first, x = list(self.__signature__.parameters)[:2]
        head = inspect.Signature(list(self.__signature__.parameters.values())[:2])
        try:
            bound = head.bind(*args, **{n: kwargs.pop(n) for n in (first, x) if n in kwargs})
        except TypeError as e:
            raise self._call_error(str(e)) from None
        first, x = bound.arguments[first], bound.arguments[x]
        return self._features(*self._arguments(first, x, kwargs), x)

    def estimate(self, first, x1, x2=None, **keywords) -> NTKSketch:
        """:class:`NTKSketch` of Θ̂(x1, x2), Φ(x1) and Φ(x2) (Φ(x1) again when x2 is None)."""
        params, aux = self._arguments(first, x1, keywords)
        phi1 = self._features(params, aux, x1, "x1")
        phi2 = phi1 if x2 is None else self._features(params, aux, x2, "x2")
        lib = np if isinstance(phi1, np.ndarray) else jnp
        o_kept = math.prod(phi1.shape[1:-1])  # each kept output axis appears twice in Θ̂
        need = phi1.shape[0] * phi2.shape[0] * o_kept**2 * phi1.dtype.itemsize
        if (over := _memory.beyond(need, on_host=lib is np)) is not None:
            what = f"the sketched kernel Θ̂ of {phi1.shape[0]} x {phi2.shape[0]} samples is"
            what += f" {human_bytes(need)}, {over}"
            fix = "use the features Φ (ntk_sketch_fn) with ntk_core.predict.low_rank_inference"
            raise bad(ValueError, self._caller.name, what, fix, see="out-of-memory")
        kept = phi1.ndim - 2  # (N, *O, k): Θ̂[i, j, a, b, ...], each kept axis twice
        order = [0, kept + 1] + [a for i in range(kept) for a in (1 + i, kept + 2 + i)]
        with np.errstate(over="ignore", invalid="ignore"):  # overflow: refused below
            if kept:
                theta = lib.tensordot(phi1, phi2, axes=(-1, -1))  # (N1, *O, N2, *O)
                theta = lib.transpose(theta, order)
            else:
                theta = phi1 @ phi2.T
        if (at := _non_finite_at(theta)) is not None:
            what = f"the sketched kernel Θ̂ overflowed to Inf at x1 sample {at[0]} and x2 sample"
            raise non_finite(self._caller.name, f"{what} {at[1]}")
        return NTKSketch(theta, phi1, phi2)

    def _features(self, params, aux, x, name: str = "x"):
        options = make_options(self._caller.name, precision=self.precision)
        n, params, x = checked_inputs(self._caller, params, x, options, name)
        params, aux = self._split(params, aux)
        block = self._block(params, aux, x, n)
        plan = self._plan(params, aux, x, block)
        check_ids(
            self._caller.name, self._apply3, params, x, aux, precision=self.precision, name="x"
        )
        run = _block_fn(self._apply3, plan, self.precision)
        if self.options is not None and self.options.out is not None:
            return self._to_file(run, plan, params, aux, x, n, block)
        self._check_fits(params, aux, x, n)
        if block == n:  # with a batch_size, host numpy as the blocked result is
            phi = self._finite(run(params, aux, x, self.key), 0, params, x)
            return phi if self.batch_size is None else np.asarray(phi)
        blocks = self._blocks(run, params, aux, x, n, block, None)
        return np.concatenate([phi for _, _, phi in blocks])

    def _block(self, params, aux, x, n: int) -> int:
        """Samples per block: all, ``batch_size``, or :func:`auto_rows` of one sample's Φ."""
        if self.batch_size is None:
            return n
        if self.batch_size != AUTO_BATCH_SIZE:
            return min(self.batch_size, n)
        try:
            row_bytes = self._row_bytes(params, aux, x, n)
        except Exception:  # the plan of one block of all N raises it with the model's checks
            return n
        to_file = self.options is not None and self.options.out is not None
        return auto_rows(n, row_bytes, default_memory_budget(), to_file)

    def _row_bytes(self, params, aux, x, n: int) -> int:
        """Bytes of one sample's Φ (its kept output axes times k)."""
        args = (self._apply3, params, one_sample(x), aux)
        out = per_sample_jaxpr(*args, precision=self.precision).out_avals[0]
        layout = self._layout((n, *out.shape))
        kept = math.prod(d for a, d in enumerate(out.shape) if a + 1 not in layout.trace)
        return kept * self.k * out.dtype.itemsize

    def _check_fits(self, params, aux, x, n: int) -> None:
        """Refuses Φ of all N samples beyond the memory holding it: the device's with
        ``batch_size=None``, else the host's (it would end in an out-of-memory kill or, on
        XLA CPU, a hang)."""
        need = n * self._row_bytes(params, aux, x, n)
        if (over := _memory.beyond(need, on_host=self.batch_size is not None)) is None:
            return
        fix = "pass out='phi.npy' (written block by block), or a smaller k"
        if self.batch_size is None:
            fix = f"pass batch_size={AUTO_BATCH_SIZE!r} with out='phi.npy', or a smaller k"
        what = f"Φ of {n} samples x k={self.k} is {human_bytes(need)}, {over}"
        raise bad(ValueError, self._caller.name, what, fix, see="out-of-memory")

    def _blocks(self, run, params, aux, x, n: int, block: int, share):
        """``(start, stop, Φ)`` of each block of ``block`` samples (those ``(start, start)``
        in ``share``, or all), as host arrays."""
        for start in range(0, n, block):
            stop = min(start + block, n)
            if share is not None and (start, start) not in share:
                continue
            xb = jax.tree.map(lambda v, s=start, e=stop: v[s:e], x)
            if stop - start < block:  # the last block padded: one compiled shape
                pad = block - (stop - start)
                xb = jax.tree.map(lambda v, p=pad: jnp.concatenate([v, v[-1:].repeat(p, 0)]), xb)
            phi = np.asarray(run(params, aux, xb, self.key))[: stop - start]
            yield start, stop, self._finite(phi, start, params, x)

    def _finite(self, phi, start: int, params, x):
        """``phi``, once all finite; else a NonFiniteError naming the first non-finite
        input sample or parameter leaf, else Φ's first non-finite sample (none under jit)."""
        if (at := _non_finite_at(phi)) is None:
            return phi
        fn = self._caller.name
        _checks.check_finite_inputs(fn, x, None, params)
        what = f"the sketched features Φ came out NaN or Inf at x sample {start + at[0]}"
        raise non_finite(fn, what)

    def _to_file(self, run, plan: Plan, params, aux, x, n: int, block: int):
        """Φ written block by block into ``out=`` (:func:`_store.for_rows`: the manifest,
        CRC-32 per block, resume), returned memory-mapped read-only."""
        args = (self._apply3, params, one_sample(x), aux)
        closed = per_sample_jaxpr(*args, precision=self.precision)
        out = closed.out_avals[0]
        kept = tuple(d for a, d in enumerate(out.shape) if a not in plan.trace)
        named = {"kind": "ntk sketch", "k": self.k, "trace_axes": self.trace_axes}
        named |= {"precision": self.precision, "modes": plan.modes, "chunk": plan.chunk}
        named["model (its jaxpr)"] = _store.model_digest(closed)
        if self.options.wrt is not None:  # the subset by its paths (a predicate has no stable repr)
            paths = jax.tree_util.tree_leaves_with_path(params)
            named["wrt"] = [jax.tree_util.keystr(p) for p, _ in paths]
        trees = {"x": x, "params": params, "params held (wrt)": aux, "key": self.key}
        shape, fn = (n, *kept, self.k), self._caller.name
        store = _store.for_rows(fn, self.options, shape, out.dtype, block, named, trees)
        if not store.finished:
            try:
                for start, stop, phi in self._blocks(run, params, aux, x, n, block, store.share()):
                    store.put(phi, start, stop, start, stop, False)
            except BaseException:
                store.close()  # the blocks listed so far stay: resume=True continues
                raise
        return store.result()


def _non_finite_at(arr) -> tuple[int, ...] | None:
    """The index of ``arr``'s first NaN or Inf; None when all finite or abstract (jit)."""
    lib = np if isinstance(arr, np.ndarray) else jnp
    if _checks.concrete_bool(lib.isfinite(arr).all()) is not False:
        return None
    return tuple(int(i) for i in np.argwhere(~np.isfinite(np.asarray(arr)))[0])


def _check_dtypes(fn: str, params, out) -> None:
    """ValueError for a float16 / bfloat16 model (its gradients round to 3 digits)."""
    dtypes = [out.dtype] + [jnp.result_type(p) for p in jax.tree.leaves(params)]
    low = next((d for d in dtypes if d in _LOW_PRECISION), None)
    if low is not None:
        what = f"the model computes in {low}; the sketch needs float32 or float64 gradients"
        fix = "cast params and x to float32: jax.tree.map(lambda p: p.astype(jnp.float32), params)"
        raise bad(ValueError, fn, what, fix)


def _sizes(fn: str, k, key, batch_size) -> tuple[int, int | None]:
    """``k`` and ``batch_size`` checked (positive ints, batch_size None too), ``key`` too."""
    k = check_int(fn, "k", k, "pass e.g. k=1024 (the error falls like 1/sqrt(k))")
    if k >= 2**31:  # the hashes' range; N·k features would not fit anyway
        raise bad(ValueError, fn, f"k must be below 2**31, got {k}", "pass e.g. k=8192")
    check_key(fn, key)
    if isinstance(batch_size, str):  # "auto", or the options' message for another string
        _block_options(fn, batch_size, None)
        return k, batch_size
    fix = "pass e.g. 256, 'auto' (sized from memory), or None for one block"
    return k, check_int(fn, "batch_size", batch_size, fix, optional=True)


def _whole(params, aux):  # no wrt: every leaf differentiated
    return params, aux


def _make(fn: str, apply_fn, k, key, trace_axes, batch_size, precision, wrt, files=None):
    """The :class:`_Sketcher` of checked arguments; ``files``: ``(out, resume, overwrite)``."""
    _checks.check_apply_fn(fn, apply_fn)
    k, batch_size = _sizes(fn, k, key, batch_size)
    options = make_options(fn, trace_axes=trace_axes, precision=precision, wrt=wrt)
    out, resume, overwrite = files or (None, False, False)
    _flags(fn, resume=resume, overwrite=overwrite)
    out = _out_options(fn, out, resume, overwrite, batch_size, False, "blocks of rows", 1024)
    options = dataclasses.replace(
        options, batch_size=batch_size, out=out, resume=resume, overwrite=overwrite
    )
    wrt = options.wrt
    apply3, split = from_apply_fn(apply_fn), _whole
    if wrt is not None:  # the model of the subset, the other leaves held in aux
        apply3 = _subset.OnSubset(apply3)
        split = functools.partial(_subset.split, fn, wrt, masks={})
    caller = core(fn, one_input=True)
    args = (k, key, tuple(options.trace_axes), batch_size, precision, split)
    # Plans do not depend on the key: averaging sketches over seeds (one call per key)
    # probes and plans the model once (a small MLP, 4 samples: 6.0 -> 1.2 ms per key).
    plans = _caches.cached((fn, "plans", apply_fn, *args[:1], *args[2:5], wrt), dict)
    return _Sketcher(caller, apply3, *args, options=options, plans=plans)


#: The kernel options :func:`of_kernel` reads; it refuses the others.
TAKEN = ("trace_axes", "batch_size", "precision", "wrt")


def of_kernel(kernel, k, key) -> _Sketcher:
    """The sketch features of the model of ``kernel``, an NTK kernel function
    (``adapters.build_kernel(..., "ntk", ...)``), as its calls see it: its ``bind``, ``wrt``
    split, model check and options :data:`TAKEN` (others refused); messages name
    ``kernel.name``. Called ``features(first, x, **keywords)`` and ``.estimate(first, x1,
    x2=None, **keywords)`` with the kernel function's first argument and keywords."""
    fn, options = kernel.name, kernel.options
    refuse_options(fn, options, TAKEN, "the sketch computes features, not the kernel's tiles")
    k, batch_size = _sizes(fn, k, key, options.batch_size)
    engine, head = kernel._engine, list(kernel.__signature__.parameters.values())
    spec = engine.spec
    signature = inspect.Signature([head[0], head[1].replace(name="x"), *head[3:]])
    caller = spec.caller or core(fn, one_input=True)
    args = (options.trace_axes, batch_size, options.precision, engine._split, kernel._bind)
    return _Sketcher(caller, spec.apply3, k, key, *args, spec.check, signature)


def ntk_sketch_fn(
    apply_fn: Callable,
    *,
    k: int,
    key,
    trace_axes=DEFAULTS.trace_axes,
    batch_size: int | str | None = None,
    precision=DEFAULTS.precision,
    wrt=DEFAULTS.wrt,
    out=DEFAULTS.out,
    resume=DEFAULTS.resume,
    overwrite=DEFAULTS.overwrite,
) -> Callable:
    """Returns ``features(params, x) -> Φ``, random features of the eNTK: Θ̂ = Φ(x1) Φ(x2)ᵀ.

    Φ(x_i) = Σ_ℓ TS_ℓ(∂f(x_i)/∂θ_ℓ) / √O_t: per parameter leaf ℓ an independent
    TensorSketch (Pham & Pagh 2013; a CountSketch, Charikar et al. 2002, for leaves no
    structured rule covers) of the per-sample gradient, with the traced outputs hashed
    too, so that E Θ̂ = Θ of :func:`ntk_fn` with the same ``trace_axes``. The map depends
    only on ``key``, ``k`` and the parameters' shapes: features of x1 and x2 from separate
    calls (or machines) combine, Θ̂(x1, x2) = Φ(x1) Φ(x2)ᵀ. For the layers the structured
    rules cover (dense, convolution, embedding lookups) each use's inputs and output
    cotangents are hashed and multiplied in the Fourier domain: no P-long per-sample
    gradient and no P x k matrix exist; the hashes are C + K ints per leaf (P for the
    others).

    Args:
      apply_fn: ``apply_fn(params, x)`` returning one floating array ``(N, *O)`` (float32
        or float64), samples independent (checked by a probe).
      k: the sketch size, a positive int; the error falls like 1/√k.
      key: a JAX PRNG key (``jax.random.PRNGKey(seed)``): the same key, the same map.
      trace_axes: output axes averaged, as :func:`ntk_fn`: ``(-1,)`` gives Φ ``(N, k)``
        with Φ_i·Φ_j ≈ Θ[i, j] = (1/O) Σ_a Θ[i, j, a, a]; ``()`` gives ``(N, O, k)`` with
        Φ[i, a]·Φ[j, b] ≈ Θ[i, j, a, b].
      batch_size: None (one jitted call) or B: blocks of B samples (the last padded, so
        one compiled shape), returned as one host ``numpy.ndarray``; ``"auto"``: B from
        the device's memory (:func:`auto_rows`: a block's Φ within half of it; with
        ``out``, at least 8 blocks).
      precision: the matmul precision, as :func:`ntk_fn`.
      wrt: a parameter subset, as :func:`ntk_fn` (path names or a predicate on key
        paths): the sketch of the subset's kernel, its own map (the subset's leaves).
      out: None, or with ``batch_size`` a path ending in ``.npy``: Φ written block by
        block into that file (host memory holds one block), with
        ``<path>.manifest.json`` as :func:`ntk_fn`'s ``out=`` (what the file holds: x,
        params, key, k, model, options; the blocks done, each with its CRC-32); a
        finished file of the same call is returned as is.
      resume: with ``out``, ``True`` finishes an interrupted run's file (only the blocks
        missing or changed; bit for bit an uninterrupted run's); another call's file
        (other x, params, key, k, ...) is refused, naming what differs.
      overwrite: with ``out``, ``True`` replaces an existing file; ``False`` refuses one
        that is not the finished result of the same call.

    Returns ``features(params, x)``: Φ ``(N, *O_kept, k)`` in the output's dtype (a
    ``jax.Array``; numpy with ``batch_size``; with ``out`` the file memory-mapped
    read-only, which :func:`~ntk_core.predict.low_rank_inference` reads in row blocks),
    O_kept the output axes not traced.

    Variance: unbiased, E Θ̂_ij = Θ_ij. For a dense Gaussian projection Var Θ̂_ij =
    (Θ_ii Θ_jj + Θ_ij²)/k; here Var Θ̂_ij = (Θ_ii Θ_jj + Θ_ij²)/k + Σ_ℓ D_ℓ exactly, with
    per leaf, G_i = the leaf's per-sample gradient (in the traced normalisation) as the
    R x M matrix it is sketched as, g_p = G_i[p]·G_j[p]:
    CountSketch (R = 1): D = −(2/k) Σ_p g_p² ≤ 0;
    TensorSketch: D = (1/k)(S_rows + S_cols + S_both) − (‖G_i‖²‖G_j‖² + ⟨G_i, G_j⟩²)/k +
    O(1/k²), S_cols = Σ_{m≠m'} ((G_iᵀG_j)_{mm'}² + (G_iᵀG_j)_{mm'}(G_iᵀG_j)_{m'm}), S_rows
    the same of G_i G_jᵀ, S_both = Σ over entry pairs in different rows and columns of
    G_i[p]²G_j[q]² + g_p g_q; so Var Θ̂_ij ≤ (Θ_ii Θ_jj + Θ_ij² + 5 Σ_ℓ Θℓ_ii Θℓ_jj)/k +
    O(1/k²), Θℓ the leaf's share: at most 6x the Gaussian's. The exact formula is checked
    against 300 seeds in tests/core/test_sketch.py.

    Raises:
      TypeError: ``apply_fn`` not callable, ``k`` or ``batch_size`` not an int, ``key``
        not a JAX key, integer params or outputs.
      ValueError: ``k`` or ``batch_size`` <= 0; a float16 / bfloat16 model (cast to
        float32); several output arrays; interacting samples; axes out of range;
        non-finite params or x, or features Φ (NonFiniteError for x and Φ); ``out``
        without ``batch_size``, an existing file without ``resume`` or ``overwrite``, a
        resume of another call's file, a folder that cannot be written, too little disk
        space; Φ beyond the memory holding it: the device's with ``batch_size=None``,
        else the host's without ``out`` (docs/errors.md#out-of-memory).

    Cost: the model's reverse passes, (N·O per use's cotangents) as the structured
    kernel's features, then per sample and use with A positions, C inputs, K units:
    ``"tensor"`` 2 FFTs of A x k and A·(C + O·K) scattered values, ``"explicit"``
    2·A·C·K·O flops (the form is chosen per leaf, :func:`choose_modes`); leaves no rule
    covers: their explicit Jacobian (O·P_ℓ). No pair term: O(N) in N (against N²·O'·P
    for the exact kernel); memory: a chunk's intermediates, at most 256 MiB, and Φ
    (N·O_kept·k).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import ntk_core
      >>> apply_fn = lambda w, x: jnp.tanh(x @ w)
      >>> w, x = jnp.ones((3, 2)) / 3, jnp.eye(3)
      >>> features = ntk_core.ntk_sketch_fn(apply_fn, k=4096, key=jax.random.PRNGKey(0))
      >>> phi = features(w, x)                                # (N, k)
      >>> exact = ntk_core.empirical_ntk(apply_fn, w, x)
      >>> phi.shape, bool(jnp.abs(phi @ phi.T - exact).max() < 0.1 * exact.max())
      ((3, 4096), True)

    References: Pham, Pagh, "Fast and Scalable Polynomial Kernels via Explicit Feature
    Maps", KDD 2013; Charikar, Chen, Farach-Colton, "Finding Frequent Items in Data
    Streams", ICALP 2002; Avron, Nguyen, Woodruff, "Subspace Embeddings for the Polynomial
    Kernel", NeurIPS 2014; Park et al., "TRAK", ICML 2023; Malladi et al., "A Kernel-Based
    View of Language Model Fine-Tuning", ICML 2023.
    """
    files = (out, resume, overwrite)
    args = (apply_fn, k, key, trace_axes, batch_size, precision, wrt, files)
    return _make("ntk_sketch_fn", *args)


def empirical_ntk_sketch(
    apply_fn: Callable,
    params,
    x1,
    x2=None,
    *,
    k: int,
    key,
    trace_axes=DEFAULTS.trace_axes,
    batch_size: int | None = None,
    precision=DEFAULTS.precision,
    wrt=DEFAULTS.wrt,
) -> NTKSketch:
    """The one-call form of :func:`ntk_sketch_fn` (definition, variance, errors, cost
    there): :class:`NTKSketch` ``(kernel, features1, features2)``, the estimate Θ̂(x1, x2)
    in :func:`ntk_fn`'s layout (``(N1, N2)``, or ``(N1, N2, O, O)`` with
    ``trace_axes=()``) and the features Φ(x1), Φ(x2) it is the product of. ValueError
    also for a Θ̂ beyond the memory holding it (use Φ with ``low_rank_inference``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import ntk_core
      >>> key = jax.random.PRNGKey(0)
      >>> s = ntk_core.empirical_ntk_sketch(lambda w, x: x @ w, jnp.ones((3, 2)),
      ...                                   jnp.eye(3), k=64, key=key, trace_axes=())
      >>> s.kernel.shape, s.features1.shape
      ((3, 3, 2, 2), (3, 2, 64))
    """
    fn = "empirical_ntk_sketch"
    features = _make(fn, apply_fn, k, key, trace_axes, batch_size, precision, wrt)
    return features.estimate(params, x1, x2)


ntk_sketch_fn = _checked_arguments(ntk_sketch_fn)
empirical_ntk_sketch = _checked_arguments(empirical_ntk_sketch)
