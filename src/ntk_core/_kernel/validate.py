"""Validation, before anything is compiled: arguments, one abstract trace of one sample,
output layouts and, with ``vmap_axes=0``, the independence probe (reused for a new N)."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._errors import bad, one_line
from ntk_core._jax.signatures import sample_signature as sample_signature
from ntk_core._jax.signatures import signature as signature
from ntk_core._kernel import checks as _checks
from ntk_core._kernel import probe as _probe
from ntk_core._kernel.caller import Caller, core
from ntk_core._kernel.layout import resolve_layout
from ntk_core._kernel.model import NotPerSample, one_sample, per_sample_trace
from ntk_core._kernel.options import AUTO_BATCH_SIZE
from ntk_core._kernel.pipeline import Checked, Kind, Spec


def as_arrays(fn_name: str, params, x1, x2) -> tuple:
    """``(params, x1, x2)`` with Python numbers as numpy arrays; TypeError for a
    ``jax.ShapeDtypeStruct`` (a shape without values), on every call."""
    trees = {"params": params, "x1": x1, "x2": x2}
    _checks.check_values(fn_name, trees)
    return tuple(
        jax.tree.map(lambda v: v if hasattr(v, "shape") else np.asarray(v), tree)
        for tree in trees.values()
    )


def describe(tree) -> str:
    text = " ".join(repr(jax.tree.map(lambda v: tuple(np.shape(v)), tree)).split())  # 1 line
    if len(text) > 300:  # e.g. a long Python list of numbers: one () per element
        text = f"{text[:200]}... ({type(tree).__name__} with {len(jax.tree.leaves(tree))} leaves)"
    return text


def batch_size(caller: Caller, name: str, x) -> int:
    """The number of samples of ``x``, or a ValueError with the caller's argument order."""
    fn_name, hint = caller.name, _checks.order_hint(caller)
    leaves = jax.tree.leaves(x)
    if not leaves:
        raise bad(ValueError, fn_name, f"{name} has no arrays (got {x!r})", f"pass arrays; {hint}")
    sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
    if None in sizes:
        listed = isinstance(x, list | tuple) and all(np.ndim(v) == 0 for v in leaves)
        fix = f"pass jnp.asarray({name}) (a list is a pytree)" if listed else f"pass {name}[None]"
        got = f"a {type(x).__name__} of numbers" if listed else describe(x)
        raise bad(ValueError, fn_name, f"{name} holds a scalar: {got}", fix)
    if len(sizes) != 1:
        what = f"the arrays of {name} disagree on the batch size (axis 0): {describe(x)}"
        raise bad(ValueError, fn_name, what, f"give every array the same N; {hint}")
    (n,) = sizes
    if n == 0:
        raise bad(ValueError, fn_name, f"{name} is empty (shapes {describe(x)})", "pass samples")
    return n


def validate(spec: Spec, samples: dict, params, x1, x2, aux) -> Checked:
    """The ``Checked`` inputs of one call of ``spec``, or a ValueError / TypeError (the rows
    of ``tests/core/test_bad_input.py``). ``samples``: the per-sample signatures already
    validated, updated. Cost: for a new signature one abstract trace and the independence
    proof's two (on 3 samples and on 1), or the probe's compiled passes; otherwise O(leaves)."""
    fn, opts = spec.fn_name, spec.options
    caller = spec.caller if spec.caller is not None else core(fn)
    _checks.before_trace(fn, params, x1, x2, opts)  # backend guard, dtypes
    if not jax.tree.leaves(params):
        got = type(params).__name__
        raise bad(ValueError, fn, f"params has no arrays (got {got})", "pass its parameters")
    n1 = n2 = batch_size(caller, "x1", x1)
    if x2 is not None:

        def per_sample(tree):
            return jax.tree.structure(tree), [np.shape(v)[1:] for v in jax.tree.leaves(tree)]

        nt = caller.neural_tangents_order  # e.g. (x1, x2, params), recognised by its shapes
        if nt and per_sample(params) == per_sample(x1) != per_sample(x2):
            what = f"the arguments look in neural-tangents' order {nt}"
            raise bad(ValueError, fn, what, f"pass {caller.order}")
        n2 = batch_size(caller, "x2", x2)
        if per_sample(x1) != per_sample(x2):  # pytree structures or per-sample shapes
            what = f"x1 and x2 differ per sample: {describe(x1)} vs {describe(x2)}"
            raise bad(ValueError, fn, what, "give x2 the structure and per-sample shapes of x1")
        for a, b in zip(jax.tree.leaves(x1), jax.tree.leaves(x2), strict=True):
            ta, tb = jnp.result_type(a), jnp.result_type(b)
            if jnp.issubdtype(ta, jnp.inexact) != jnp.issubdtype(tb, jnp.inexact):
                raise bad(TypeError, fn, f"x1 has dtype {ta} where x2 has {tb}", "match them")
    if spec.check is not None:
        spec.check(params, x1, x2, aux)
    # One abstract trace (of one sample with vmap_axes=0, replayed by every later phase;
    # reused for a new N) gives the outputs and the jaxpr the precision checks read.
    sample_key = None
    if opts.vmap_axes is not None:
        sample_key = (signature(params), sample_signature(x1), signature(aux))
    known = samples.get(sample_key) if sample_key is not None else None
    closed, one_sample_error = None, None
    if known is not None:
        out_tree, sample_outputs = known
        out_leaves = [jax.ShapeDtypeStruct((n1,) + s, d) for s, d in sample_outputs]
    elif opts.vmap_axes is not None:
        try:
            closed, out = per_sample_trace(
                spec.apply3, params, one_sample(x1), aux, precision=opts.precision
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
            trace = jax.make_jaxpr(spec.apply3, return_shape=True)
            with jax.default_matmul_precision(opts.precision):
                closed, out = trace(params, x_abstract, aux)
        except Exception as e:  # the model's own error, with context
            doing = f"calling the model on x1 (shapes {describe(x1)})"
            fix = f"check params and x1's per-sample shape and dtype ({_checks.order_hint(caller)})"
            if spec.hint:  # how the adapter's models leave training mode
                fix += f"; or the mode: {spec.hint}"
            if isinstance(params, Mapping) and "params" in params:
                fix += "; for Flax variables use ntk_flax.kernel(model, variables, x)"
            raise _checks.model_call_error(fn, doing, e, fix) from e
        out_leaves, out_tree = jax.tree.flatten(out)
    if not out_leaves:
        raise bad(ValueError, fn, f"the model returned no arrays ({out!r})", "return arrays (N, O)")
    layouts, several = [], len(out_leaves) > 1
    for i, leaf in enumerate(out_leaves):
        where = f"output leaf {i}" if several else "the output"
        if not leaf.shape or leaf.shape[0] != n1:
            what = f"{where} has shape {leaf.shape} but x1 has {n1} samples ({describe(x1)})"
            fix = f"add a batch axis (x1[None]), or make {caller.model} return one row per sample"
            if isinstance(out, tuple) and several:  # e.g. (logits, aux)
                fix = f"make {caller.model} return its outputs alone, one row per sample"
            raise bad(ValueError, fn, what, fix)
        if not jnp.issubdtype(leaf.dtype, jnp.floating):  # ints, complex numbers
            what = f"{where} has dtype {leaf.dtype}; expected real floating point"
            raise bad(TypeError, fn, what, "return real float outputs (e.g. logits)")
        layout = resolve_layout(fn, opts.trace_axes, opts.diagonal_axes, leaf.shape, where, several)
        if layout.batch_diagonal and x2 is not None and n2 != n1:
            what = f"diagonal_axes={opts.diagonal_axes!r} needs N1 == N2, got N1={n1} and N2={n2}"
            raise bad(ValueError, fn, what, "pass x2 with N1 samples, or x2=None")
        layouts.append(layout)
    if one_sample_error is not None:  # the batch of N runs; one sample does not
        what = f"the model runs on x1's batch of {n1} samples but not on one (vmap_axes=0): "
        fix = "keep the batch axis for any N (no squeeze, no fixed N), or pass vmap_axes=None"
        rows = one_sample_error.shape[:1] if isinstance(one_sample_error, NotPerSample) else ()
        if n1 > 1 and rows == (n1,):  # N rows from one sample: a per-sample array held fixed
            held = "pass per-sample arrays in x1 (adapters: inputs='kwargs'), not apply_kwargs"
            fix = f"{held}; or {fix}"
        raise bad(ValueError, fn, what + one_line(one_sample_error), fix) from one_sample_error
    if known is None:
        kernel = "NNGP" if spec.kind is Kind.NNGP else "NTK"
        _checks.after_trace(fn, spec.apply3, params, x1, aux, opts, kernel, closed)
    if known is None and sample_key is not None:  # vmap_axes=0
        interact = _probe.samples_interact(spec.apply3, params, x1, x2, aux, fn)
        if interact:
            fix = "pass vmap_axes=None"
            if interact == _probe.INTERACT:  # e.g. BatchNorm in training mode
                how = f" (e.g. {spec.hint})" if spec.hint else ""
                fix = f"run the model in evaluation mode{how}, or {fix}"
            raise _checks.samples_interact_error(fn, interact, fix)
        if interact is not None:  # checked: later calls of this signature skip it
            samples[sample_key] = (out_tree, [(o.shape[1:], o.dtype) for o in out_leaves])
    shapes1 = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out_leaves)
    return Checked(n1, n2, x2 is None, out_tree, tuple(layouts), shapes1, closed)


def check_one_device(spec: Spec, params, x1, x2, aux) -> None:
    """One call is one program: refuses arrays committed to different devices (as JAX's jit
    would, in its own words), naming where each part is."""
    places = {}  # device ids -> the first part found there
    parts = ("params", params), ("x1", x1), ("x2", x2), ("the model's fixed state", aux)
    for name, tree in parts:
        for a in jax.tree.leaves(tree):
            if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and a.committed:
                places.setdefault(tuple(sorted(d.id for d in a.sharding.device_set)), name)
    if len(places) > 1:
        where = ", ".join(f"{name} on device(s) {list(ids)}" for ids, name in places.items())
        fix = "jax.device_put them on one device, or pass a batch_size (tiles are placed)"
        raise bad(ValueError, spec.fn_name, f"the arrays are on different devices: {where}", fix)


def check_untraced(spec: Spec, params, x1, x2) -> None:
    """The blocked engine writes tiles to the host: refuses traced arguments."""
    if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves((params, x1, x2))):
        fn, b = spec.fn_name, spec.options.batch_size
        raise bad(
            ValueError, fn, f"batch_size={b!r} was used inside jax.jit", "call it outside jit"
        )


def check_budget(spec: Spec, cut) -> None:
    """Refuses a ``memory_budget`` given with ``batch_size="auto"`` that even tiles of one
    sample exceed (``cut``: the ``Tiling``)."""
    options, need = spec.options, cut.smallest_bytes
    auto = options.batch_size == AUTO_BATCH_SIZE
    if options.memory_budget is None or not auto or need <= cut.available:
        return
    what = f"memory_budget={options.memory_budget} bytes is below the {need} bytes of a 1 x 1 tile"
    fix = f"pass memory_budget >= {need}, or None (the device's memory)"
    raise bad(ValueError, spec.fn_name, what, fix)


def check_blocks_independent(spec: Spec, checked: Checked, cut, params, x1, x2, aux) -> None:
    """With ``vmap_axes=None``, refuses blocks smaller than the batch when samples
    interact (``cut``: the ``Tiling``)."""
    if spec.options.vmap_axes is not None or max(cut.b1, cut.b2) >= max(checked.n1, checked.n2):
        return
    if _probe.samples_interact(spec.apply3, params, x1, x2, aux, fn_name=spec.fn_name):
        b = spec.options.batch_size
        what = f"batch_size={b!r} with vmap_axes=None splits interacting samples"
        raise _checks.samples_interact_error(spec.fn_name, what, "pass batch_size=None")
