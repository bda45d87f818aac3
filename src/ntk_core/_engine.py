"""Validated, jitted kernel functions shared by the core API and the adapters.

A :class:`KernelFunction` validates its inputs in Python (before any tracing), resolves
the output layout and the implementation once per distinct input signature (tree
structures, shapes and dtypes), and then calls ``jax.jit``-compiled phases (DESIGN.md):
per-sample features of each batch, compiled per ``(apply3, vmap_axes, precision)`` and
shared across axes settings, then the pairwise contraction. A second call with the
same shapes neither re-validates the model nor recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _blocked, _caches, _checks, _cost, _jacobian, _ntvp, _probe, _structured
from ._batches import even_batches
from ._layout import LeafLayout, resolve_layout
from ._model import per_sample, per_sample_jaxpr
from ._options import KernelOptions

_PRECISION = {
    "highest": lax.Precision.HIGHEST,
    "high": lax.Precision.HIGH,
    "default": lax.Precision.DEFAULT,
}


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static configuration of one compiled call."""

    kind: str  # "ntk", "ntk_per_leaf" or "nngp"
    implementation: str  # "jacobian", "ntvp", "structured" or "nngp"
    vmap_axes: int | None
    precision: str
    out_tree: Any
    layouts: tuple[LeafLayout, ...]
    shapes1: tuple[jax.ShapeDtypeStruct, ...]
    symmetric: bool
    params_tree: Any = None
    structure: tuple = ()  # "structured": Analysis.leaves(...)
    analysis: Any = None  # "structured": the _structured.Analysis
    n2: int = 0  # samples of x2 (of x1 when x2 is None)
    param_sizes: tuple[int, ...] = ()  # entries of each parameter leaf
    whole_batch: Any = None  # vmap_axes=None: the _cost.WholeBatch memory model


@_caches.lru_cache(maxsize=64)
def _jacobian_features(apply3, vmap_axes, precision):
    """The jitted first phase of ``"jacobian"``: per-sample Jacobians of one batch.

    Shared by every kernel function of the same ``apply3`` and the same
    ``merge_limits`` (:func:`_merge_limits`), so changing ``trace_axes`` or
    ``diagonal_axes`` recompiles the contraction, and the features only where the
    kernel values per pair change.
    """

    def features(params, x, aux, *, out_tree, merge_limits, cotangent_chunk):
        with jax.default_matmul_precision(precision):
            return _jacobian.jacobians(
                apply3, params, x, aux, vmap_axes, out_tree, merge_limits, cotangent_chunk
            )

    return jax.jit(features, static_argnames=("out_tree", "merge_limits", "cotangent_chunk"))


@_caches.lru_cache(maxsize=64)
def _whole_batch_phases(apply3, precision):
    """The jitted phases of ``"jacobian"`` with ``vmap_axes=None`` in cotangent chunks
    driven from Python (:meth:`KernelFunction._whole_batch_features`): ``rows`` (one
    chunk of Jacobian rows from ``start``) and ``assemble`` (the chunks, their overlap
    dropped, as :func:`_jacobian.jacobians` returns the Jacobians)."""

    def rows(params, x, aux, start, *, size):
        with jax.default_matmul_precision(precision):
            index = start + jnp.arange(size)
            return _jacobian.whole_batch_rows(lambda p: apply3(p, x, aux), params, index)

    def assemble(params, x, aux, parts, *, skip, out_tree, merge_limits):
        last = jax.tree.map(lambda v: v[skip:], parts[-1])
        flat = jax.tree.map(lambda *v: jnp.concatenate(v), *parts[:-1], last)
        out_shapes = jax.eval_shape(apply3, params, x, aux)
        jac = _jacobian.rows_as_jacobian(flat, out_shapes)
        return _jacobian.matrices(jac, params, out_tree, merge_limits)

    return (
        jax.jit(rows, static_argnames=("size",)),
        jax.jit(assemble, static_argnames=("skip", "out_tree", "merge_limits")),
    )


@_caches.lru_cache(maxsize=64)
def _ntvp_features(apply3, vmap_axes, precision):
    """The jitted full-kernel phase of ``"ntvp"`` (reductions are compiled apart)."""

    def features(params, x1, x2, aux, *, out_tree, batch_diagonal):
        with jax.default_matmul_precision(precision):
            return _ntvp.full_kernels(
                apply3, params, x1, x2, aux, vmap_axes, out_tree, batch_diagonal
            )

    return jax.jit(features, static_argnames=("out_tree", "batch_diagonal"))


@_caches.lru_cache(maxsize=64)
def _structured_features(apply3, precision, fuse_bias):
    """The jitted first phase of ``"structured"``: layer inputs, cotangents, fallbacks,
    ``chunk`` samples at a time."""

    def features(params, x, aux, *, out_tree, modes, merge_limits, chunk):
        with jax.default_matmul_precision(precision):
            return _structured.features_in_chunks(
                apply3, params, x, aux, out_tree, fuse_bias, modes, merge_limits, chunk
            )

    return jax.jit(features, static_argnames=("out_tree", "modes", "merge_limits", "chunk"))


def _pair_sizes(shapes1, layouts) -> list[int]:
    """Kernel entries per pair of samples (O'), per output leaf."""
    sizes = []
    for s, layout in zip(shapes1, layouts, strict=True):
        size = 1
        for a in range(1, layout.ndim):
            if a not in layout.trace and a not in layout.diag:
                size *= s.shape[a]
            size *= s.shape[a]
        sizes.append(size)
    return sizes


def _merge_limits(config) -> tuple[int, ...] | None:
    """Per output leaf, the widest per-leaf Jacobian merged into one contraction
    (:func:`ntk_core._jacobian.merge_limit` with O' the kept output axes squared and
    the diagonal ones once); None where each leaf's kernel is needed apart
    (``"ntk_per_leaf"``) or on the batch diagonal (N kernel values, too few to pay
    for a copy)."""
    if config.kind != "ntk" or config.layouts[0].batch_diagonal:
        return None
    # The larger N: a test-train call (N_test < N_train) then groups like the train
    # Gram matrix before it, and reuses its compiled features.
    n = max(config.shapes1[0].shape[0], config.n2)
    limits = []
    for s, layout in zip(config.shapes1, config.layouts, strict=True):
        pair = 1
        for a in range(1, layout.ndim):
            if a in layout.diag:
                pair *= s.shape[a]
            elif a not in layout.trace:
                pair *= s.shape[a] ** 2
        limit = _jacobian.merge_limit(n, math.prod(s.shape[1:]), pair)
        # Snapped down to a width that occurs (every merged matrix is one parameter
        # leaf's Jacobian): the same grouping, and the same static argument for every N
        # that groups alike, so a new N reuses the compiled features.
        limits.append(max((w for w in config.param_sizes if w <= limit), default=0))
    return tuple(limits)


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    sig = []
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            sig.append((tuple(leaf.shape), str(leaf.dtype)))
        else:
            sig.append((type(leaf).__name__, repr(leaf)))
    return treedef, tuple(sig)


def _sample_signature(tree) -> tuple:
    """:func:`_signature` without the batch axis: what one sample looks like."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(v)[1:]), str(jnp.result_type(v))) for v in leaves)


def _as_arrays(tree):
    return jax.tree.map(lambda v: v if hasattr(v, "shape") else np.asarray(v), tree)


def _describe(tree) -> str:
    shapes = jax.tree.map(lambda v: tuple(np.shape(v)), tree)
    text = repr(shapes)
    if len(text) > 300:  # e.g. a long Python list of numbers: one () per element
        n = len(jax.tree.leaves(tree))
        text = f"{text[:200]}... ({type(tree).__name__} with {n} leaves)"
    return text


def _batch_size(fn_name: str, name: str, x) -> int:
    leaves = jax.tree.leaves(x)
    if not leaves:
        raise ValueError(
            f"{fn_name}: {name} has no arrays (got {x!r}). Fix: pass an array, or a pytree "
            f"of arrays, whose axis 0 indexes samples; {_checks.order_hint(fn_name)}."
        )
    sizes = set()
    for leaf in leaves:
        if np.ndim(leaf) == 0:
            raise ValueError(
                f"{fn_name}: {name} contains a scalar (shapes {_describe(x)}); every input "
                f"array needs a batch axis 0. Fix: pass an array (np.asarray(x) for a nested "
                f"Python list), or add a batch axis, e.g. x[None] for a single sample."
            )
        sizes.add(np.shape(leaf)[0])
    if len(sizes) != 1:
        raise ValueError(
            f"{fn_name}: the arrays of {name} disagree on the batch size (axis 0): shapes "
            f"{_describe(x)}. Fix: give every input array the same number of samples; "
            f"{_checks.order_hint(fn_name)}."
        )
    (n,) = sizes
    if n == 0:
        raise ValueError(
            f"{fn_name}: {name} is empty (0 samples, shapes {_describe(x)}). Fix: pass at "
            f"least one sample."
        )
    return n


def _structured_modes(analysis, shapes1, layouts) -> tuple[str, ...]:
    """Per leaf group, ``"gram"`` or ``"explicit"``: the cheaper form for these outputs."""
    o_pair = sum(_pair_sizes(shapes1, layouts))
    o_out = sum(math.prod(s.shape[1:]) for s in shapes1)
    return _structured.choose_modes(analysis, o_pair, o_out)


class KernelFunction:
    """A jitted empirical kernel ``(params, x1, x2=None, aux=None) -> kernel``.

    Args:
      fn_name: public name used in error messages.
      kind: ``"ntk"`` or ``"nngp"``.
      apply3: ``apply3(params, x, aux)``, pure.
      options: validated :class:`KernelOptions`.
      check: optional ``check(params, x1, x2, aux)`` run once per new input signature
        (before compiling), for adapter-specific validation.
      hint: how to put the model in evaluation mode, added to the error raised when
        samples interact under ``vmap_axes=0``.
    """

    def __init__(
        self,
        fn_name: str,
        kind: str,
        apply3: Callable,
        options: KernelOptions,
        check: Callable | None = None,
        hint: str = "",
    ):
        if kind == "ntk_per_leaf" and options.implementation == "ntvp":
            raise ValueError(
                f"{fn_name}: per-leaf kernels need implementation 'jacobian', 'structured' "
                f"or 'auto', got 'ntvp' (NTK-vector products do not separate the leaves). "
                f"Fix: pass implementation='auto'."
            )
        self._fn_name = fn_name
        self._kind = kind
        self._apply3 = apply3
        self._options = options
        self._check = check
        self._hint = hint
        self._configs: dict = {}
        self._analyses: dict = {}
        self._samples: dict = {}  # per-sample signature -> (output tree, per-sample shapes)
        self._chunks: dict = {}  # (config, x signature) -> structured features chunk
        # The jitted phases are functions of their static arguments alone (no self), so
        # kernel functions of the same model and configuration (e.g. with and without
        # batch_size, or "auto" and what it chose) share their compilations.
        self._outputs = functools.partial(_JITS["outputs"], apply3=apply3)
        self._tile_jit = _JITS["tile"]

    def tile(self, params, fa, fb, aux, xa, xb, *, config: _Config, same: bool):
        """One tile of the blocked engine and its all-finite flag (jitted)."""
        return self._tile_jit(
            params, fa, fb, aux, xa, xb, apply3=self._apply3, config=config, same=same
        )

    # -- validation --------------------------------------------------------------------
    def _prepare(self, params, x1, x2, aux) -> _Config:
        try:
            return self._validated(params, x1, x2, aux)
        except (TypeError, ValueError) as e:
            core = _checks.model_noun(self._fn_name) == "apply_fn"  # adapters check theirs
            if (
                not core
                or x2 is None
                or not _checks.runs_in_neural_tangents_order(self._apply3, params, x1, x2, aux)
            ):
                raise
            raise ValueError(
                f"{self._fn_name}: the arguments are in neural-tangents' order (x1, x2, "
                f"params): the model runs with the third one as its parameters and the "
                f"first as its inputs. Fix: pass params first, (params, x1, x2)."
            ) from e

    def _validated(self, params, x1, x2, aux) -> _Config:
        """The configuration of a call; raises on bad input (see :meth:`_prepare`)."""
        fn = self._fn_name
        opts = self._options
        _checks.before_trace(fn, params, x1, x2, opts)  # backend guard, dtypes
        if not jax.tree.leaves(params):
            raise ValueError(
                f"{fn}: params has no arrays (got {type(params).__name__}). Fix: pass the "
                f"model's parameters, e.g. the pytree returned by its init function."
            )
        for leaf in jax.tree.leaves(params):
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
                raise TypeError(
                    f"{fn}: params contains an array of dtype {jnp.result_type(leaf)}; the NTK "
                    f"differentiates every parameter, so all must be floating point. Fix: "
                    f"cast them, or close over integer constants in apply_fn instead."
                )
        n1 = _batch_size(fn, "x1", x1)
        n2 = n1
        if x2 is not None:
            n2 = _batch_size(fn, "x2", x2)
            s1, s2 = jax.tree.structure(x1), jax.tree.structure(x2)
            if s1 != s2:
                raise ValueError(
                    f"{fn}: x1 and x2 have different pytree structures ({s1} vs {s2}). "
                    f"Fix: pass inputs of the same structure."
                )
            for a, b in zip(jax.tree.leaves(x1), jax.tree.leaves(x2), strict=True):
                kind_a = jnp.issubdtype(jnp.result_type(a), jnp.inexact)
                if kind_a != jnp.issubdtype(jnp.result_type(b), jnp.inexact):
                    raise TypeError(
                        f"{fn}: x1 has dtype {jnp.result_type(a)} where x2 has "
                        f"{jnp.result_type(b)}; one is integer and the other floating point. "
                        f"Fix: give x2 the dtype of x1 (e.g. integer tokens for both)."
                    )
                if np.shape(a)[1:] != np.shape(b)[1:]:
                    raise ValueError(
                        f"{fn}: x1 and x2 differ in their non-batch shapes: x1 {_describe(x1)} "
                        f"vs x2 {_describe(x2)}. Fix: give both the per-sample shape the model "
                        f"expects."
                    )
        if self._check is not None:
            self._check(params, x1, x2, aux)
        # One abstract trace of the model gives its outputs and the jaxpr the precision
        # checks read. With vmap_axes=0 the model is analysed per sample, so a new N of
        # the same per-sample signature reuses the first trace's outputs and checks.
        sample_key = None
        if opts.vmap_axes is not None:
            sample_key = (_signature(params), _sample_signature(x1), _signature(aux))
        known = self._samples.get(sample_key) if sample_key is not None else None
        closed = None
        if known is not None:
            out_tree, sample_outputs = known
            out_leaves = [jax.ShapeDtypeStruct((n1,) + s, d) for s, d in sample_outputs]
        else:
            x_abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v), v.dtype), x1)
            try:
                with jax.default_matmul_precision(opts.precision):
                    closed, out = jax.make_jaxpr(self._apply3, return_shape=True)(
                        params, x_abstract, aux
                    )
            except jax.errors.UnexpectedTracerError as e:
                raise _checks.leaked_tracer_error(fn, e) from e
            except Exception as e:  # the model's own error, with context
                raise ValueError(
                    f"{fn}: calling the model on x1 (shapes {_describe(x1)}) failed with "
                    f"{type(e).__name__}: {str(e).rstrip().rstrip('.')}. "
                    f"Fix: {_checks.model_call_fix(params, e, fn)}."
                ) from e
            out_leaves, out_tree = jax.tree.flatten(out)
        if not out_leaves:
            raise ValueError(
                f"{fn}: the model returned no arrays ({out!r}); expected its outputs, e.g. "
                f"logits (N, O). Fix: make {_checks.model_noun(fn)} return the network's "
                f"output."
            )
        layouts = []
        for i, leaf in enumerate(out_leaves):
            where = "the output" if len(out_leaves) == 1 else f"output leaf {i}"
            if not leaf.shape or leaf.shape[0] != n1:
                raise ValueError(
                    f"{fn}: {where} has shape {leaf.shape} but x1 has {n1} samples (x1 shapes "
                    f"{_describe(x1)}); outputs must keep the batch axis 0. Fix: if x1 is a "
                    f"single sample, add a batch axis (x1[None]); otherwise make "
                    f"{_checks.model_noun(fn)} return one row per sample."
                )
            if not jnp.issubdtype(leaf.dtype, jnp.inexact):
                raise TypeError(
                    f"{fn}: {where} has dtype {leaf.dtype}; kernels need floating-point "
                    f"outputs. Fix: return the model's float logits, not integer labels."
                )
            layout = resolve_layout(fn, opts.trace_axes, opts.diagonal_axes, leaf.shape, where)
            if layout.batch_diagonal and x2 is not None and n2 != n1:
                raise ValueError(
                    f"{fn}: diagonal_axes={opts.diagonal_axes!r} asks for the per-sample "
                    f"diagonal K(x1_i, x2_i), which needs x1 and x2 of the same size, got "
                    f"N1={n1} and N2={n2}. Fix: pass x2 with N1 samples, or x2=None."
                )
            layouts.append(layout)
        kernel = "NNGP" if self._kind == "nngp" else "NTK"
        if known is None:
            _checks.after_trace(
                fn, self._apply3, params, x1, x2, aux, out_leaves, opts, kernel, closed
            )
        if (known is None and opts.vmap_axes is not None) and _probe.samples_interact(
            self._apply3, params, x1, x2, aux, fn_name=fn
        ):
            how = f" (e.g. {self._hint})" if self._hint else ""
            raise ValueError(
                f"{fn}: the model's output for one sample depends on the other samples of "
                f"its batch (batch statistics such as BatchNorm in training mode, a mean or "
                f"softmax over the batch), so per-sample independence (vmap_axes=0) would "
                f"give a wrong kernel. Fix: run the model in evaluation mode{how}, or pass "
                f"vmap_axes=None to differentiate the whole batch."
            )
        if sample_key is not None and known is None:
            self._samples[sample_key] = (out_tree, [(o.shape[1:], o.dtype) for o in out_leaves])
        shapes1 = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out_leaves)
        whole_batch = None
        if opts.vmap_axes is None and self._kind != "nngp":
            whole_batch = self._whole_batch(closed, params, n1, n2, x2 is None, shapes1, layouts)
        implementation = "nngp" if self._kind == "nngp" else opts.implementation
        if implementation == "auto":  # per-leaf: among those that separate the leaves
            estimates = self._estimates(
                params, x1, aux, n1, n2, x2 is None, shapes1, layouts, whole_batch
            )
            implementation = _cost.choose(estimates)
            if implementation == "ntvp" and (
                self._ntvp_failure(params, x1, x2, aux, out_tree, layouts) is not None
            ):
                others = [e for e in estimates if e.implementation != "ntvp"]
                fitting = [e for e in others if e.memory_bytes <= _cost.JACOBIAN_MEMORY_BUDGET]
                implementation = min(fitting or others, key=lambda e: e.seconds).implementation
        elif implementation == "ntvp":
            error = self._ntvp_failure(params, x1, x2, aux, out_tree, layouts)
            if error is not None:
                raise ValueError(
                    f"{fn}: the model cannot run inside NTK-vector products' nested "
                    f"transformations (a vmap of JVPs of a vmap over samples): "
                    f"{type(error).__name__}: {str(error).splitlines()[0][:200]}. This "
                    f"happens with models that apply their own transformations, e.g. "
                    f"flax.nnx.scan or nnx.RNN. Fix: pass implementation='auto' (which "
                    f"avoids them for such models), 'structured' or 'jacobian'."
                ) from error
        structure, analysis = (), None
        if implementation == "structured":
            if opts.vmap_axes is None:
                implementation = "jacobian"  # no per-sample structure to exploit
            else:
                n_leaves = len(jax.tree.leaves(params))
                analysis = self._analysis(params, x1, aux)
                modes = _structured_modes(analysis, shapes1, layouts)
                structure = analysis.leaves(n_leaves, modes)
        return _Config(
            self._kind,
            implementation,
            opts.vmap_axes,
            opts.precision,
            out_tree,
            tuple(layouts),
            shapes1,
            x2 is None,
            jax.tree.structure(params),
            structure,
            analysis,
            n2,
            tuple(math.prod(np.shape(v)) for v in jax.tree.leaves(params)),
            whole_batch,
        )

    def _ntvp_failure(self, params, x1, x2, aux, out_tree, layouts) -> Exception | None:
        """The error NTK-vector products raise on one sample of x1 and x2 when traced
        (``jax.eval_shape``, nothing runs), or None: models that apply their own
        transformations (``flax.nnx.scan``) can fail inside ntvp's nesting alone."""
        one = functools.partial(jax.tree.map, lambda a: a[:1])
        xb = x1 if x2 is None else x2
        pairwise = self._options.vmap_axes is not None and layouts[0].batch_diagonal

        def trace(p, a, b, aux):
            return _ntvp.full_kernels(
                self._apply3, p, a, b, aux, self._options.vmap_axes, out_tree, pairwise
            )

        try:
            jax.eval_shape(trace, params, one(x1), one(xb), aux)
        except Exception as e:  # the model's own error, found by the first trace
            return e
        return None

    @property
    def _fuse_bias(self) -> bool:
        """Biases join their product's Gram identity, except when split per leaf."""
        return self._kind != "ntk_per_leaf"

    def _analysis(self, params, x1, aux):
        """The structured analysis (one abstract trace), cached per input signature."""
        key = (_signature(params), _sample_signature(x1), _signature(aux))  # not N
        analysis = self._analyses.get(key)
        if analysis is None:
            x_one = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v)[1:], v.dtype), x1)
            analysis = _structured.analysis_for(self._apply3, params, x_one, aux, self._fuse_bias)[
                0
            ]
            self._analyses[key] = analysis
        return analysis

    def _whole_batch(self, closed, params, n1, n2, symmetric, shapes1, layouts):
        """The :class:`_cost.WholeBatch` of ``vmap_axes=None`` (from the abstract trace
        of x1's batch, scaled to the larger of x1's and x2's, or to one block of
        ``batch_size``); refuses, before anything runs, a batch whose forward pass and
        one output cotangent's reverse pass alone exceed ``memory_budget``."""
        opts = self._options
        n_max = max(n1, n2)
        n = min(n_max, opts.batch_size) if isinstance(opts.batch_size, int) else n_max
        leaves = jax.tree.leaves(params)
        n_params = sum(math.prod(np.shape(v)) for v in leaves)
        itemsize = max(np.dtype(jnp.result_type(v)).itemsize for v in leaves)
        out_total = sum(math.prod(s.shape[1:]) for s in shapes1)
        jac_bytes = (n1 if symmetric else n1 + n2) * out_total * n_params * itemsize
        pairs = n1 if layouts[0].batch_diagonal else n1 * n2
        kernel_bytes = pairs * sum(_pair_sizes(shapes1, layouts)) * itemsize * (1 + symmetric)
        held = int(1.5 * jac_bytes) + kernel_bytes  # as _cost.estimate counts them
        budget = opts.memory_budget or _blocked.default_memory_budget()
        model = _cost.whole_batch(  # values of the forward pass grow with the batch
            closed.jaxpr, n_params, n * out_total, itemsize, budget, held, n / n1
        )
        one = model.residual_bytes + model.cotangent_bytes
        if one > budget and opts.batch_size != "auto":
            given = "memory_budget" if opts.memory_budget else "the default memory_budget"
            raise ValueError(
                f"{self._fn_name}: with vmap_axes=None the whole batch of {n} samples is "
                f"differentiated at once: its forward pass keeps {_gib(model.residual_bytes)} "
                f"and the reverse pass of each of its {n * out_total} output cotangents "
                f"needs {_gib(model.cotangent_bytes)} more, {_gib(one)} for one at a time, "
                f"beyond {given} of {_gib(budget)}. Fix: pass vmap_axes=0 if each sample's "
                f"output depends on that sample alone (BatchNorm in evaluation mode), pass "
                f"fewer samples per call, or raise memory_budget to at least {one} bytes "
                f"if the device has the memory."
            )
        return model

    def _estimates(self, params, x1, aux, n1, n2, symmetric, shapes1, layouts, whole_batch=None):
        x_one = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v)[1:], v.dtype), x1)
        out_sizes = [math.prod(s.shape[1:]) for s in shapes1]
        pair_sizes = _pair_sizes(shapes1, layouts)
        batch_diag = any(layout.batch_diagonal for layout in layouts)
        traced_batch = any(0 in layout.trace for layout in layouts)
        estimates = _cost.estimate(
            per_sample(self._apply3),
            params,
            x_one,
            aux,
            n1=n1,
            n2=n2,
            pairs=n1 if batch_diag else n1 * n2,
            triangle=None if batch_diag or not symmetric or traced_batch else triangle_blocks,
            out_sizes=out_sizes,
            pair_sizes=pair_sizes,
            symmetric=symmetric,
            analysis=self._analysis(params, x1, aux),
            whole_batch=whole_batch,
            jaxpr=per_sample_jaxpr(self._apply3, params, x_one, aux),
        )
        if self._options.vmap_axes is None:  # "structured" needs per-sample independence
            estimates = tuple(e for e in estimates if e.implementation != "structured")
        if self._kind == "ntk_per_leaf":  # NTK-vector products do not separate the leaves
            estimates = tuple(e for e in estimates if e.implementation != "ntvp")
        return estimates

    # -- computation -------------------------------------------------------------------
    @staticmethod
    def _finish(per_leaf, config: _Config):
        """Per output leaf lists of per-parameter-leaf kernels -> the result pytree."""
        if config.kind == "ntk_per_leaf":
            by_leaf = [
                jax.tree.unflatten(config.out_tree, [terms[i] for terms in per_leaf])
                for i in range(config.params_tree.num_leaves)
            ]
            return jax.tree.unflatten(config.params_tree, by_leaf)
        return jax.tree.unflatten(config.out_tree, [functools.reduce(jnp.add, t) for t in per_leaf])

    @staticmethod
    def _contract_jacobians(j1, j2, *, config: _Config):
        with jax.default_matmul_precision(config.precision):
            per_leaf = _jacobian.contract(
                config.layouts, j1, j1 if j2 is None else j2, _PRECISION[config.precision]
            )
        return KernelFunction._finish(per_leaf, config)

    @staticmethod
    def _contract_structured(f1, f2, *, config: _Config):
        with jax.default_matmul_precision(config.precision):
            per_leaf = _structured.contract(
                config.layouts,
                config.structure,
                config.analysis,
                f1,
                f1 if f2 is None else f2,
                _PRECISION[config.precision],
            )
        return KernelFunction._finish(per_leaf, config)

    @staticmethod
    def _reduce_ntvp(fulls, *, config: _Config):
        kernels = _ntvp.reduce(config.layouts, fulls, KernelFunction._pairwise(config))
        return jax.tree.unflatten(config.out_tree, kernels)

    # -- blocked engine (ntk_core._blocked) ----------------------------------------------
    @staticmethod
    def _nngp_outputs(params, x, aux, *, apply3, config: _Config):
        """The first phase of the NNGP: the model's outputs on one block."""
        with jax.default_matmul_precision(config.precision):
            return config.out_tree.flatten_up_to(apply3(params, x, aux))

    @staticmethod
    def _contract_nngp(out1, out2, *, config: _Config):
        out2 = out1 if out2 is None else out2
        kernels = []
        for layout, a, b in zip(config.layouts, out1, out2, strict=True):
            lhs, rhs, out = layout.specs()
            k = _jacobian.pair_einsum(lhs, rhs, out, a, b, _PRECISION[config.precision])
            kernels.append(k / layout.trace_size(a.shape))
        return jax.tree.unflatten(config.out_tree, kernels)

    def block_features(self, config: _Config):
        """``features(params, x_block, aux)``, jitted, or None for ``"ntvp"``."""
        impl = config.implementation
        if impl == "jacobian":
            jac = _jacobian_features(self._apply3, config.vmap_axes, config.precision)
            chunk = None if config.whole_batch is None else config.whole_batch.chunk
            jac = functools.partial(
                jac,
                out_tree=config.out_tree,
                merge_limits=_merge_limits(config),
                cotangent_chunk=chunk,
            )
            if chunk is None or chunk >= config.whole_batch.cotangents:
                return jac
            return functools.partial(self._whole_batch_features, jac, config)
        if impl == "structured":
            feat = _structured_features(self._apply3, config.precision, self._fuse_bias)
            feat = functools.partial(
                feat,
                out_tree=config.out_tree,
                modes=config.structure[4],
                merge_limits=_merge_limits(config),
            )
            return functools.partial(self._structured_in_chunks, feat, config)
        if impl == "nngp":
            return functools.partial(self._outputs, config=config)
        return None

    def _whole_batch_features(self, in_program, config: _Config, params, x, aux):
        """``"jacobian"`` features of a whole batch (``vmap_axes=None``), the output
        cotangents pulled back ``config.whole_batch.chunk`` at a time by a loop in
        Python over one compiled chunk, so that memory stays within the budget at the
        speed of one pass (XLA CPU runs convolutions' reverse passes about 8x slower
        inside an XLA loop). Under an outer ``jax.jit`` the chunks loop inside the
        program instead (``in_program``)."""
        if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves((params, x, aux))):
            return in_program(params, x, aux)
        rows, assemble = _whole_batch_phases(self._apply3, config.precision)
        n = jax.tree.leaves(x)[0].shape[0]
        total = n * sum(math.prod(s.shape[1:]) for s in config.shapes1)
        size, starts = even_batches(total, config.whole_batch.chunk)
        parts = [rows(params, x, aux, np.int32(start), size=size) for start in starts]
        skip = (starts[-2] + size - starts[-1]) if len(starts) > 1 else 0
        return assemble(
            params,
            x,
            aux,
            parts,
            skip=skip,
            out_tree=config.out_tree,
            merge_limits=_merge_limits(config),
        )

    def _structured_in_chunks(self, features, config: _Config, params, x, aux):
        """``features(params, x, aux)`` computed :func:`_structured.chunk_size` samples
        at a time (:func:`_structured.features_in_chunks`); the chunk size is cached
        per configuration and input shapes."""
        key = (config, _signature(x))
        chunk = self._chunks.get(key)
        if chunk is None:
            chunk = _structured.chunk_size(
                self._apply3, params, x, aux, config.out_tree, self._fuse_bias, config.structure[4]
            )
            self._chunks[key] = chunk
        return features(params, x, aux, chunk=chunk)

    @staticmethod
    def _tile(params, fa, fb, aux, xa, xb, *, apply3, config: _Config, same: bool):
        """One tile of the blocked engine and its all-finite flag.

        ``fa``/``fb``: features of a row and a column block (``xa``/``xb``, their
        inputs, for ``"ntvp"``); ``same``: a diagonal tile of x2=None (``fb``/``xb``
        unused; the tile is made exactly symmetric here).
        """
        impl = config.implementation
        if impl == "ntvp":
            with jax.default_matmul_precision(config.precision):
                fulls = _ntvp.full_kernels(
                    apply3,
                    params,
                    xa,
                    xa if same else xb,
                    aux,
                    config.vmap_axes,
                    config.out_tree,
                    KernelFunction._pairwise(config),
                )
            kernel = KernelFunction._reduce_ntvp(fulls, config=config)
        else:
            contract = {
                "jacobian": KernelFunction._contract_jacobians,
                "structured": KernelFunction._contract_structured,
                "nngp": KernelFunction._contract_nngp,
            }[impl]
            k = _triangle_blocks(fa, config) if same else 1
            if k > 1:
                kernel = _triangular(contract, fa, k, config)
            else:
                kernel = contract(fa, None if same else fb, config=config)
        if same:  # exactly symmetric (barriers inside: no fusion across the mirror)
            kernel = _blocked.symmetrize(kernel, config)
        return _blocked.finish_tile(kernel)

    @staticmethod
    def _pairwise(config: _Config) -> bool:
        """NTK-vector products on pairs (x1_i, x2_i) only: the O(N) batch diagonal."""
        return config.vmap_axes is not None and config.layouts[0].batch_diagonal

    # -- calling -----------------------------------------------------------------------
    def config_for(self, params, x1, x2=None, aux=None) -> _Config:
        """The validated configuration for these inputs (cached per signature)."""
        key = (_signature(params), _signature(x1), _signature(x2), _signature(aux))
        config = self._configs.get(key)
        if config is None:
            config = self._prepare(params, x1, x2, aux)
            self._configs[key] = config
        return config

    def plan(self, params, x1, x2=None, aux=None) -> _cost.Plan:
        """What a call with these inputs does: implementation, cost estimates, per leaf."""
        params, x1, x2 = _as_arrays(params), _as_arrays(x1), _as_arrays(x2)
        config = self.config_for(params, x1, x2, aux)
        if config.kind == "nngp":
            raise ValueError(
                f"{self._fn_name}: plan() describes NTK computations; an NNGP kernel has no "
                f"implementation to choose (one forward pass per sample, then the outputs' "
                f"N1·N2 contraction). Fix: call plan on the NTK kernel function of the same "
                f"model (ntk_core.ntk_fn, ntk_flax.kernel_fn or ntk_haiku.kernel_fn)."
            )
        n1 = _batch_size(self._fn_name, "x1", x1)
        n2 = n1 if x2 is None else _batch_size(self._fn_name, "x2", x2)
        estimates = self._estimates(
            params, x1, aux, n1, n2, x2 is None, config.shapes1, config.layouts, config.whole_batch
        )
        paths = [
            jax.tree_util.keystr(k) or "(root)"  # params that are one array
            for k, _ in jax.tree_util.tree_leaves_with_path(params)
        ]
        sizes = [math.prod(np.shape(v)) for v in jax.tree.leaves(params)]
        structured = config.implementation == "structured"
        analysis, modes = config.analysis, config.structure[4] if structured else None
        if not structured and any(e.implementation == "structured" for e in estimates):
            # Another implementation runs: say what "structured" would do, leaf by leaf.
            analysis = self._analysis(params, x1, aux)
            modes = _structured_modes(analysis, config.shapes1, config.layouts)
        methods = {} if analysis is None else _structured.method_labels(analysis, modes)
        leaves = []
        for i, (path, size) in enumerate(zip(paths, sizes, strict=True)):
            method = methods.get(i, "jacobian (fallback)") if methods else ""
            if structured:
                leaves.append(_cost.LeafPlan(path, size, method))
            else:
                leaves.append(_cost.LeafPlan(path, size, config.implementation, method))
        tiling = None
        if self._options.batch_size is not None:
            tiling = _blocked.tiling(self, config, params, x1, x2, aux)
        return _cost.Plan(
            config.implementation,
            tuple(estimates),
            tuple(leaves),
            self._options.implementation,
            tiling,
            config.whole_batch if config.implementation == "jacobian" else None,
        )

    def implementation_for(self, params, x1, x2=None, aux=None) -> str:
        """The implementation a call with these inputs uses (what ``"auto"`` chose)."""
        params, x1, x2 = _as_arrays(params), _as_arrays(x1), _as_arrays(x2)
        return self.config_for(params, x1, x2, aux).implementation

    def __call__(self, params, x1, x2=None, aux=None):
        try:
            return self._call(params, x1, x2, aux)
        except jax.errors.UnexpectedTracerError as e:  # found when the phases trace
            raise _checks.leaked_tracer_error(self._fn_name, e) from e

    def _call(self, params, x1, x2, aux):
        params, x1, x2 = _as_arrays(params), _as_arrays(x1), _as_arrays(x2)
        config = self.config_for(params, x1, x2, aux)
        if self._options.batch_size is not None:
            if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves((params, x1, x2))):
                raise ValueError(
                    f"{self._fn_name}: batch_size={self._options.batch_size!r} was used inside "
                    f"jax.jit (or another transformation), but the blocked engine writes its "
                    f"tiles to a host array and cannot run on traced values. Fix: call the "
                    f"kernel function outside jax.jit (it is jitted internally), or pass "
                    f"batch_size=None to compute the whole kernel in one traced call."
                )
            return _blocked.compute(self, config, params, x1, x2, aux)
        result, finite = self._one_call(config, params, x1, x2, aux)
        _check_finite_result(self._fn_name, result, config, finite, x1, x2)
        return result

    def _one_call(self, config, params, x1, x2, aux):
        """The whole kernel in one call (``batch_size=None``), on the device.

        The same compiled phases as one tile of the blocked engine (so a batch size of
        at least N reuses this call's compilations): features of x1 and x2, then the
        contraction and its all-finite flag; returns ``(kernel, flag)``.
        """
        same = x2 is None
        features = self.block_features(config)
        if features is None:  # "ntvp": pairwise, from the inputs
            return self.tile(params, None, None, aux, x1, x2, config=config, same=same)
        f1 = features(params, x1, aux)
        f2 = None if same else features(params, x2, aux)
        return self.tile(params, f1, f2, aux, None, None, config=config, same=same)


#: A Gram matrix of one set of samples (x2=None, or a diagonal tile of the blocked
#: engine) of N samples is contracted in k = min(TRIANGLE_MAX_BLOCKS, N //
#: TRIANGLE_MIN_BLOCK) blocks of samples, and only the k(k + 1)/2 block pairs on and
#: above the diagonal are computed (the rest are their mirrors): (k + 1)/2k of the pair
#: work, 9/16 at k = 8. Measured on the MLP 784-1000-1 at N = 1000 (XLA CPU, 2 cores):
#: blocks of 333 / 200 / 143 samples (k = 3, 5, 7) took 45 / 41 / 40 ms for the whole
#: kernel; smaller blocks lose more to smaller matrix products than they save.
TRIANGLE_MIN_BLOCK = 128
TRIANGLE_MAX_BLOCKS = 8
#: The blocks are slices of the features, which XLA copies: above this many feature
#: bytes the Gram matrix is contracted whole (ResNet case, 0.8 GB of features: 0.4 GB
#: more peak memory in blocks, for a quarter of a contraction that is not its main cost).
TRIANGLE_MAX_FEATURE_BYTES = 2**28


def _gib(nbytes: float) -> str:
    return _cost.human_bytes(nbytes)


def _triangle_blocks(features, config: _Config) -> int:
    """k, the number of sample blocks of a symmetric contraction (1: in one piece)."""
    layout = config.layouts[0]
    if features is None or 0 in layout.trace or 0 in layout.diag:
        return 1
    leaves = jax.tree.leaves(features)
    if not leaves:
        return 1
    nbytes = sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in leaves)
    return triangle_blocks(leaves[0].shape[0], nbytes)


def triangle_blocks(n: int, feature_bytes: float = 0.0) -> int:
    """k for a symmetric contraction of ``n`` samples whose features take
    ``feature_bytes`` (see :data:`TRIANGLE_MIN_BLOCK`)."""
    if feature_bytes > TRIANGLE_MAX_FEATURE_BYTES:
        return 1
    return max(1, min(TRIANGLE_MAX_BLOCKS, n // TRIANGLE_MIN_BLOCK))


def _triangular(contract, features, k: int, config: _Config):
    """Θ(x, x) from the features of x, in k x k blocks of samples, of which only those
    on and above the diagonal are contracted; block (j, i) is block (i, j) with the x1
    and x2 axis of each pair swapped, so it equals it exactly mirrored.

    One loop over the k(k + 1)/2 block pairs (``lax.fori_loop``), so the program holds
    one block contraction whatever k: unrolled, the 28 pairs of k = 7 took 1.2 s of XLA
    compilation on the MLP 784-1000-1 at N = 1000, the loop 0.1 s. The blocks all have
    ceil(N/k) samples; the last starts at N - ceil(N/k) and overlaps its neighbour
    (those entries are written twice, from the same features).
    """
    n = jax.tree.leaves(features)[0].shape[0]
    size = -(-n // k)
    starts = np.minimum(np.arange(k) * size, n - size)
    pairs = np.array([(i, j) for i in range(k) for j in range(i, k)], dtype=np.int32)
    rows = jnp.asarray(starts[pairs[:, 0]], dtype=jnp.int32)
    cols = jnp.asarray(starts[pairs[:, 1]], dtype=jnp.int32)

    def part(start):
        return jax.tree.map(lambda v: lax.dynamic_slice_in_dim(v, start, size, axis=0), features)

    shapes = jax.eval_shape(lambda f: contract(f, f, config=config), part(0))
    leaves_shape, treedef = jax.tree.flatten(shapes)
    perms = [_blocked.swap_perm(layout) for layout in _blocked.leaf_layouts(config)]
    out = [jnp.zeros((n, n) + s.shape[2:], s.dtype) for s in leaves_shape]

    def body(p, out):
        r, c = rows[p], cols[p]
        block = jax.tree.leaves(contract(part(r), part(c), config=config))
        zeros = (0,) * (block[0].ndim - 2)
        new = []
        for acc, b, perm in zip(out, block, perms, strict=True):
            acc = lax.dynamic_update_slice(acc, b, (r, c) + zeros[: b.ndim - 2])
            mirror = jnp.transpose(b, perm)
            new.append(lax.dynamic_update_slice(acc, mirror, (c, r) + zeros[: b.ndim - 2]))
        return new

    out = lax.fori_loop(0, len(pairs), body, out)
    return jax.tree.unflatten(treedef, out)


_JITS = {
    "outputs": jax.jit(KernelFunction._nngp_outputs, static_argnames=("apply3", "config")),
    "tile": jax.jit(KernelFunction._tile, static_argnames=("apply3", "config", "same")),
}


def _check_finite_result(fn_name: str, result, config, finite, x1, x2) -> None:
    """Raises ValueError when a one-call kernel has NaN or Inf: naming the first
    non-finite input sample when there is one, the first non-finite entry otherwise."""
    ok = _checks.concrete_bool(finite)
    if ok is None or ok:
        return
    _checks.check_finite_inputs(fn_name, x1, x2)
    leaf = jax.tree.leaves(result)[0]
    n1 = leaf.shape[0]
    n2 = n1 if config.layouts[0].batch_diagonal else leaf.shape[1]
    raise _blocked._nonfinite_tile_error(
        fn_name, result, 0, n1, 0, n2, config.layouts[0].batch_diagonal
    )
