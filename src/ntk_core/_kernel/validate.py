"""Validation: one call's inputs checked, before anything is compiled.

The first part of a kernel call (docs/architecture.md): the arguments' types, sizes,
structures and dtypes; one abstract trace of the model for its outputs and the
precision checks (:mod:`ntk_core._kernel.checks`, :mod:`ntk_core._jax.environment`); the output
layouts (:mod:`ntk_core._kernel.layout`); and, with ``vmap_axes=0``, the per-sample
independence probe (:mod:`ntk_core._kernel.probe`). With ``vmap_axes=0`` the outcome depends
on the per-sample signature only, so a new N reuses it. Every error names the public
function, what it got and the fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._jax.signatures import sample_signature as sample_signature
from ntk_core._jax.signatures import signature as signature
from ntk_core._kernel import checks as _checks
from ntk_core._kernel import probe as _probe
from ntk_core._kernel.caller import Caller, core
from ntk_core._kernel.layout import resolve_layout
from ntk_core._kernel.model import one_sample, per_sample_trace
from ntk_core._kernel.pipeline import Checked, Spec


def caller_of(spec: Spec) -> Caller:
    """The public function whose messages ``spec`` raises: ``spec.caller``, made where
    that function is defined (a Spec built without one is a core kernel function of
    ``(params, x1, x2)``)."""
    return spec.caller if spec.caller is not None else core(spec.fn_name)


def as_arrays(tree):
    return jax.tree.map(lambda v: v if hasattr(v, "shape") else np.asarray(v), tree)


def describe(tree) -> str:
    shapes = jax.tree.map(lambda v: tuple(np.shape(v)), tree)
    text = repr(shapes)
    if len(text) > 300:  # e.g. a long Python list of numbers: one () per element
        n = len(jax.tree.leaves(tree))
        text = f"{text[:200]}... ({type(tree).__name__} with {n} leaves)"
    return text


def batch_size(caller: Caller, name: str, x) -> int:
    """The number of samples of ``x`` (axis 0 of every leaf), or a ValueError naming
    ``caller``, with its argument order."""
    fn_name = caller.name
    leaves = jax.tree.leaves(x)
    if not leaves:
        raise ValueError(
            f"{fn_name}: {name} has no arrays (got {x!r}). Fix: pass an array, or a pytree "
            f"of arrays, whose axis 0 indexes samples; {_checks.order_hint(caller)}."
        )
    sizes = set()
    for leaf in leaves:
        if np.ndim(leaf) == 0:
            raise ValueError(
                f"{fn_name}: {name} contains a scalar (shapes {describe(x)}); every input "
                f"array needs a batch axis 0. Fix: pass an array (np.asarray(x) for a nested "
                f"Python list), or add a batch axis, e.g. x[None] for a single sample."
            )
        sizes.add(np.shape(leaf)[0])
    if len(sizes) != 1:
        raise ValueError(
            f"{fn_name}: the arrays of {name} disagree on the batch size (axis 0): shapes "
            f"{describe(x)}. Fix: give every input array the same number of samples; "
            f"{_checks.order_hint(caller)}."
        )
    (n,) = sizes
    if n == 0:
        raise ValueError(
            f"{fn_name}: {name} is empty (0 samples, shapes {describe(x)}). Fix: pass at "
            f"least one sample."
        )
    return n


def validate(spec: Spec, samples: dict, params, x1, x2, aux) -> Checked:
    """The checked inputs of one call of ``spec``, or a ValueError / TypeError that
    names ``spec.fn_name``, what it got and the fix (the bad-input table of
    ``tests/core/test_bad_input.py``).

    Args:
      spec: the kernel function.
      samples: the per-sample signatures already validated (``vmap_axes=0``), read and
        updated: a new N of a known per-sample signature is checked without tracing
        or probing the model again.
      params, x1, x2, aux: the call's arguments (x2 None: x1's Gram matrix).

    Returns:
      a :class:`~ntk_core._kernel.pipeline.Checked`.

    Cost: with a new (per-sample) signature, one abstract trace of the model on x1
    (``jax.make_jaxpr``, nothing runs) and the independence probe's two forward
    passes on three samples (:mod:`ntk_core._kernel.probe`); otherwise O(number of leaves).
    """
    fn = spec.fn_name
    caller = caller_of(spec)
    opts = spec.options
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
    n1 = batch_size(caller, "x1", x1)
    n2 = n1
    if x2 is not None:
        n2 = batch_size(caller, "x2", x2)
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
                    f"{fn}: x1 and x2 differ in their non-batch shapes: x1 {describe(x1)} "
                    f"vs x2 {describe(x2)}. Fix: give both the per-sample shape the model "
                    f"expects."
                )
    if spec.check is not None:
        spec.check(params, x1, x2, aux)
    # One abstract trace of the model gives its outputs and the jaxpr the precision
    # checks read. With vmap_axes=0 it is the trace of one sample that the analysis, the
    # cost model and every implementation's features replay (_model.per_sample_trace),
    # and a new N of the same per-sample signature reuses its outputs and checks.
    sample_key = None
    if opts.vmap_axes is not None:
        sample_key = (signature(params), sample_signature(x1), signature(aux))
    known = samples.get(sample_key) if sample_key is not None else None
    closed, one_sample_error = None, None
    if known is not None:
        out_tree, sample_outputs = known
        out_leaves = [jax.ShapeDtypeStruct((n1,) + s, d) for s, d in sample_outputs]
    elif opts.vmap_axes is not None:
        x_one = one_sample(x1)
        try:
            closed, out = per_sample_trace(
                spec.apply3, params, x_one, aux, precision=opts.precision
            )
        except jax.errors.UnexpectedTracerError as e:
            raise _checks.leaked_tracer_error(fn, e) from e
        except Exception as e:  # the whole batch's trace below says what is wrong
            one_sample_error = e
        else:
            out_leaves, out_tree = jax.tree.flatten(out)
            out_leaves = [jax.ShapeDtypeStruct((n1,) + o.shape, o.dtype) for o in out_leaves]
    if known is None and closed is None:  # vmap_axes=None, or the error path
        x_abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v), v.dtype), x1)
        try:
            with jax.default_matmul_precision(opts.precision):
                closed, out = jax.make_jaxpr(spec.apply3, return_shape=True)(
                    params, x_abstract, aux
                )
        except Exception as e:  # the model's own error, with context
            raise _checks.model_call_error(
                fn,
                f"calling the model on x1 (shapes {describe(x1)})",
                e,
                _checks.model_call_fix(params, e, caller),
            ) from e
        out_leaves, out_tree = jax.tree.flatten(out)
    if not out_leaves:
        raise ValueError(
            f"{fn}: the model returned no arrays ({out!r}); expected its outputs, e.g. "
            f"logits (N, O). Fix: make {caller.model} return the network's "
            f"output."
        )
    layouts = []
    for i, leaf in enumerate(out_leaves):
        where = "the output" if len(out_leaves) == 1 else f"output leaf {i}"
        if not leaf.shape or leaf.shape[0] != n1:
            raise ValueError(
                f"{fn}: {where} has shape {leaf.shape} but x1 has {n1} samples (x1 shapes "
                f"{describe(x1)}); outputs must keep the batch axis 0. Fix: if x1 is a "
                f"single sample, add a batch axis (x1[None]); otherwise make "
                f"{caller.model} return one row per sample."
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
    if one_sample_error is not None:  # the batch of N runs; one sample does not
        e = one_sample_error
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(
            f"{fn}: the model runs on x1's batch of {n1} samples but not on a batch of one "
            f"sample, which per-sample derivatives (vmap_axes=0) run it on: "
            f"{type(e).__name__}: {first.rstrip('.')}. Fix: make the model keep the batch "
            f"axis for any batch size (e.g. x.reshape(x.shape[0], -1), not x.squeeze() "
            f"or a fixed batch size), or pass vmap_axes=None to differentiate the whole "
            f"batch as given."
        ) from e
    kernel = "NNGP" if spec.kind == "nngp" else "NTK"
    if known is None:
        _checks.after_trace(fn, spec.apply3, params, x1, x2, aux, out_leaves, opts, kernel, closed)
    if (known is None and opts.vmap_axes is not None) and _probe.samples_interact(
        spec.apply3, params, x1, x2, aux, fn_name=fn
    ):
        how = f" (e.g. {spec.hint})" if spec.hint else ""
        raise ValueError(
            f"{fn}: the model's output for one sample depends on the other samples of "
            f"its batch (batch statistics such as BatchNorm in training mode, a mean or "
            f"softmax over the batch), so per-sample independence (vmap_axes=0) would "
            f"give a wrong kernel. Fix: run the model in evaluation mode{how}, or pass "
            f"vmap_axes=None to differentiate the whole batch."
        )
    if sample_key is not None and known is None:
        samples[sample_key] = (out_tree, [(o.shape[1:], o.dtype) for o in out_leaves])
    shapes1 = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out_leaves)
    return Checked(n1, n2, x2 is None, out_tree, tuple(layouts), shapes1, closed)


def in_neural_tangents_order(spec: Spec, params, x1, x2, aux) -> ValueError | None:
    """The error to raise instead of a failed validation when the arguments are in
    neural-tangents' order ``(x1, x2, params)`` (where ``spec.caller`` says that order
    applies: the core's kernels; the adapters check their own arguments), else None."""
    if (
        not caller_of(spec).neural_tangents_order
        or x2 is None
        or not _checks.runs_in_neural_tangents_order(spec.apply3, params, x1, x2, aux)
    ):
        return None
    return ValueError(
        f"{spec.fn_name}: the arguments are in neural-tangents' order (x1, x2, "
        f"params): the model runs with the third one as its parameters and the "
        f"first as its inputs. Fix: pass params first, (params, x1, x2)."
    )


def check_untraced(spec: Spec, params, x1, x2) -> None:
    """The blocked engine writes tiles to a host array: refuses traced arguments."""
    if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves((params, x1, x2))):
        raise ValueError(
            f"{spec.fn_name}: batch_size={spec.options.batch_size!r} was used inside "
            f"jax.jit (or another transformation), but the blocked engine writes its "
            f"tiles to a host array and cannot run on traced values. Fix: call the "
            f"kernel function outside jax.jit (it is jitted internally), or pass "
            f"batch_size=None to compute the whole kernel in one traced call."
        )


def check_blocks_independent(spec: Spec, checked: Checked, cut, params, x1, x2, aux) -> None:
    """With ``vmap_axes=None``, blocks smaller than the batch differentiate each block
    as its own batch: refuses a model whose samples interact (``cut``: the
    :class:`~ntk_core._blocked.tiles.Tiling`)."""
    if spec.options.vmap_axes is not None or max(cut.b1, cut.b2) >= max(checked.n1, checked.n2):
        return
    if _probe.samples_interact(spec.apply3, params, x1, x2, aux, fn_name=spec.fn_name):
        raise ValueError(
            f"{spec.fn_name}: batch_size={spec.options.batch_size!r} with vmap_axes=None "
            f"would differentiate each block of {cut.b1} samples as its own batch, but the "
            f"model's samples interact (batch statistics such as BatchNorm in training "
            f"mode), so the blocked kernel would differ from the one-call kernel. Fix: "
            f"pass batch_size=None, or run the model in evaluation mode with "
            f"vmap_axes=0."
        )
