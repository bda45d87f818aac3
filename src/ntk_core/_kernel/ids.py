"""Integer ids outside the table they index, refused before a kernel is computed.

JAX defines a ``gather`` at an id outside its operand only in two ways that break a
kernel: ``table[ids]`` (mode ``PROMISE_IN_BOUNDS``) clamps the id forward while its
transpose drops it, so the Jacobian, NTK-vector-product and structured kernels disagree
with no error; ``jnp.take`` (Flax's ``nn.Embed``; mode ``FILL_OR_DROP`` with a NaN fill)
returns a NaN row, then a ``NonFiniteError`` whose fix points elsewhere. A *site* is such a
gather whose indices are computed from x alone (not from params: a router's argmax is in
range by construction). Gathers that clamp both ways (mode ``CLIP``: equinox's
``nn.Embedding``, ``jnp.take(..., mode="clip")``) or fill with a finite value define their
derivative consistently and are left alone.

Cost: the sites are found once per jaxpr (one walk of its equations; a model without
sites then pays a dict lookup per call); per call, only the equations that the sites'
indices depend on run (jitted once per jaxpr, compiled once per input signature: one
comparison per id, one boolean and one id per sample and site read back). Under an outer
``jax.jit`` or ``vmap`` (traced x) the check is skipped, as the non-finite checks are;
inside a ``scan`` body, the sites whose indices come from the scanned-over inputs and
the constants (not the carry) are checked for every step at once (the body's index
equations vmapped over the steps); sites inside ``cond`` and ``while`` bodies, or whose
indices depend on a scan's carry, are not looked for.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives as prims

from ntk_core._errors import bad
from ntk_core._jax import caches as _caches
from ntk_core._jax.jaxpr_walk import bind, call_body, inlined, is_literal
from ntk_core._kernel.model import one_sample, per_sample_jaxpr

#: Calls whose body runs once on the call's own operands: walked into.
_CUSTOM = (prims.custom_jvp_call_p, prims.custom_vjp_call_p)
#: Primitives through which a table keeps its name (``params['E']``).
_SAME = frozenset({"convert_element_type", "copy", "copy_p"})


class Site(NamedTuple):
    """One gather checked: the operand's ``sizes`` and largest valid ``highs`` start along
    the axes its index components address; ``inputs``: bit i set where the ids read x's
    leaf i."""

    table: str
    sizes: tuple[int, ...]
    highs: tuple[int, ...]
    inputs: int
    axes: tuple[int, ...] = ()  # the operand's axes its index components address


def _ill_defined(eqn) -> bool:
    """Whether ``eqn`` is a gather whose out-of-range ids break the kernel (module doc)."""
    if eqn.primitive is not prims.gather_p:
        return False
    mode = eqn.params.get("mode")
    if mode == jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS:
        return True
    fill = eqn.params.get("fill_value")
    floating = jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.inexact)
    return (
        mode == jax.lax.GatherScatterMode.FILL_OR_DROP
        and floating
        and (
            fill is None or fill != fill  # None: JAX fills floating arrays with NaN
        )
    )


def _body(eqn):
    """``(jaxpr, consts)`` of a call evaluated once on its operands, else None."""
    if not (inlined(eqn) or eqn.primitive in _CUSTOM):
        return None
    body = call_body(eqn)
    return body if body is not None and len(body[0].invars) == len(eqn.invars) else None


def _scan_parts(eqn):
    """(body jaxpr, its consts, number of consts, number of carries) of a ``scan``."""
    closed = eqn.params["jaxpr"]
    return closed.jaxpr, closed.consts, eqn.params["num_consts"], eqn.params["num_carry"]


def _walk(jaxpr, masks: list, names: list, n_params: int, n_x: int, carry: int = 0):
    """``(output masks, found)``: ``masks`` hold, per input of ``jaxpr``, bit i for each
    top-level input leaf it depends on (params, then x, then the fixed parts); ``found``
    maps ``id(eqn)`` to its :class:`Site` or, for a call holding sites, its body's found."""
    params_bits, x_bits = (1 << n_params) - 1, ((1 << n_x) - 1) << n_params
    mask = dict(zip(jaxpr.invars, masks, strict=True))
    name = {v: n for v, n in zip(jaxpr.invars, names, strict=True) if n}
    found: dict = {}

    def read(v) -> int:
        return 0 if is_literal(v) else mask.get(v, 0)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        body = _body(eqn)
        if body is not None:
            inner = [None if is_literal(v) else name.get(v) for v in eqn.invars]
            outs, sub = _walk(body[0], ins, inner, n_params, n_x, carry)
            if sub:
                found[id(eqn)] = sub
        elif eqn.primitive is prims.scan_p:
            body_jaxpr, _, n_consts, n_carry = _scan_parts(eqn)
            both = 0
            for m in ins:
                both |= m
            # a carry may hold anything the scan reads, and marks what depends on it
            step_bit = 1 << (n_params + n_x + len(masks) + 1) if not carry else carry
            inner_masks = ins[:n_consts] + [both | step_bit] * n_carry + ins[n_consts + n_carry :]
            inner = [None if is_literal(v) else name.get(v) for v in eqn.invars]
            _, sub = _walk(body_jaxpr, inner_masks, inner, n_params, n_x, step_bit)
            if sub:
                found[id(eqn)] = ("scan", sub)
            outs = [both] * len(eqn.outvars)
        else:
            both = 0
            for m in ins:
                both |= m
            outs = [both] * len(eqn.outvars)
            if (
                _ill_defined(eqn)
                and ins[1] & x_bits
                and not ins[1] & params_bits
                and not ins[1] & carry  # a scan's carry: not known before the loop runs
            ):
                found[id(eqn)] = _site(eqn, name.get(eqn.invars[0]), ins[1] >> n_params)
            elif eqn.primitive.name in _SAME and not is_literal(eqn.invars[0]):
                if eqn.invars[0] in name:
                    name[eqn.outvars[0]] = name[eqn.invars[0]]
        mask.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars], found


def _site(eqn, table: str | None, inputs: int) -> Site:
    shape = eqn.invars[0].aval.shape
    axes = eqn.params["dimension_numbers"].start_index_map
    sizes = tuple(int(shape[a]) for a in axes)
    highs = tuple(int(shape[a] - eqn.params["slice_sizes"][a]) for a in axes)
    table = table or f"an array of shape {tuple(shape)}"
    return Site(table, sizes, highs, inputs, tuple(int(a) for a in axes))


class _Slice(NamedTuple):
    """The equations of one jaxpr that the sites' indices need, in order: ``("bind", eqn)``,
    ``("site", eqn, keeps_output)`` or ``("call", eqn, _Slice of its body)``;
    ``needed``: the jaxpr's inputs they read."""

    steps: list
    needed: frozenset


def _slice(jaxpr, found: dict, wanted: set) -> _Slice:
    """The slice of ``jaxpr`` computing the sites' indices and the outputs in ``wanted``."""
    needed = {v for v in wanted if not is_literal(v)}
    steps = []

    def need(vs):
        needed.update(v for v in vs if not is_literal(v))

    for eqn in reversed(jaxpr.eqns):
        entry = found.get(id(eqn))
        keep = any(v in needed for v in eqn.outvars)
        if isinstance(entry, Site):
            steps.append(("site", eqn, keep))
            need(eqn.invars if keep else eqn.invars[1:2])
        elif isinstance(entry, tuple):  # a scan holding sites: its steps' indices at once
            body_jaxpr = _scan_parts(eqn)[0]
            sub = _slice(body_jaxpr, entry[1], set())
            if keep:  # its outputs too: the whole scan runs
                steps.append(("bind", eqn))
                need(eqn.invars)
            steps.append(("scan", eqn, sub))
            need(v for v, b in zip(eqn.invars, body_jaxpr.invars, strict=True) if b in sub.needed)
        elif entry is not None:  # a call holding sites
            body = _body(eqn)[0]
            outs = {b for v, b in zip(eqn.outvars, body.outvars, strict=True) if v in needed}
            sub = _slice(body, entry, outs)
            steps.append(("call", eqn, sub))
            need(v for v, b in zip(eqn.invars, body.invars, strict=True) if b in sub.needed)
        elif keep:
            steps.append(("bind", eqn))
            need(eqn.invars)
    steps.reverse()
    return _Slice(steps, frozenset(needed))


def _run(jaxpr, piece: _Slice, consts, args, found: dict, record: list) -> list:
    """Evaluates ``piece`` of ``jaxpr`` (``args``: its inputs, None where unneeded),
    appending each site's indices to ``record`` in :func:`_sites_in` order; its outputs
    (None where not computed)."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return v.val if is_literal(v) else env.get(v)

    for step in piece.steps:
        eqn = step[1]
        if step[0] == "scan":
            _run_scan(eqn, step[2], found[id(eqn)][1], [read(v) for v in eqn.invars], record)
            continue
        if step[0] == "call":
            body, body_consts = _body(eqn)
            inner = [read(v) for v in eqn.invars]
            outs = _run(body, step[2], body_consts, inner, found[id(eqn)], record)
        else:
            if step[0] == "site":
                record.append(read(eqn.invars[1]))
                if not step[2]:
                    continue
            outs = bind(eqn, [read(v) for v in eqn.invars])
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _run_scan(eqn, piece: _Slice, found: dict, args: list, record: list) -> None:
    """Records the indices of a scan's sites for every step at once: the body's index
    equations vmapped over the scanned-over inputs (axis 0; the carries are not read)."""
    body_jaxpr, consts, n_consts, n_carry = _scan_parts(eqn)
    xs = args[n_consts + n_carry :]

    def step(*xs_t):
        inner: list = []
        _run(
            body_jaxpr, piece, consts, args[:n_consts] + [None] * n_carry + list(xs_t), found, inner
        )
        return inner

    axes = [None if x is None else 0 for x in xs]
    if all(a is None for a in axes):  # nothing scanned over: the same indices each step
        record.extend(step(*xs))
        return
    record.extend(jax.vmap(step, in_axes=axes)(*xs))


def _sites_in(found: dict, piece: _Slice, jaxpr) -> list[Site]:
    """The sites of ``found`` in the order :func:`_run` records their indices."""
    sites = []
    for step in piece.steps:
        if step[0] == "site":
            sites.append(found[id(step[1])])
        elif step[0] == "call":
            sites.extend(_sites_in(found[id(step[1])], step[2], _body(step[1])[0]))
        elif step[0] == "scan":
            sites.extend(_sites_in(found[id(step[1])][1], step[2], _scan_parts(step[1])[0]))
    return sites


class _Check(NamedTuple):
    """A jaxpr's sites and the jitted ``run(inputs) -> [(bad, id)]`` (per sample with
    ``vmap``: ``(N,)`` each; else over the batch), ``needed``: its top-level inputs read."""

    sites: list
    run: object
    needed: tuple


def _first_bad(idx, highs):
    """``(any id out of range, the first such id, its index component)`` of ``idx``, its
    last axis the index vector."""
    high = jnp.asarray(highs, idx.dtype)
    out = ((idx < 0) | (idx > high)).reshape(-1)
    k = jnp.argmax(out)
    return out.any(), idx.reshape(-1)[k], k % len(highs)


def _check_of(closed, names: list, n_params: int, n_x: int, n: int | None) -> _Check | None:
    """The :class:`_Check` of a model's jaxpr (inputs: params, x, fixed parts, ``names``
    their names or None), per sample (``n`` None) or on a batch of ``n``; or None."""
    jaxpr = closed.jaxpr
    masks = [1 << i for i in range(len(jaxpr.invars))]
    _, found = _walk(jaxpr, masks, names, n_params, n_x)
    if not found:
        return None
    piece = _slice(jaxpr, found, set())
    sites = _sites_in(found, piece, jaxpr)
    needed = tuple(v in piece.needed for v in jaxpr.invars)

    def flags(*inputs):
        record: list = []
        _run(jaxpr, piece, closed.consts, list(inputs), found, record)
        return [by_sample(idx, s.highs) for idx, s in zip(record, sites, strict=True)]

    def by_sample(idx, highs):  # the batch's ids: per sample where axis 0 holds them
        if n is None or idx.ndim < 2 or idx.shape[0] != n:
            return _first_bad(idx, highs)
        return jax.vmap(_first_bad, in_axes=(0, None))(idx, highs)

    x_axes = [0 if n_params <= i < n_params + n_x else None for i in range(len(needed))]
    run = jax.vmap(flags, in_axes=x_axes) if n is None else flags
    return _Check(sites, jax.jit(run), needed)


_CHECKS: dict = {}  # id(closed jaxpr) -> (weak reference, _Check or None)
_caches.register(_CHECKS.clear)
_MAX_CHECKS = 64


def _cached_check(closed, trees: tuple, n: int | None) -> _Check | None:
    """:func:`_check_of`, once per jaxpr (``trees``: its inputs, params, x, fixed parts)."""
    key = (id(closed), n)
    entry = _CHECKS.get(key)
    if entry is not None and entry[0]() is closed:
        return entry[1]
    names = []
    for tree, title in zip(trees, ("params", None, "the model's fixed part "), strict=True):
        for path, _ in jax.tree_util.tree_leaves_with_path(tree):
            names.append(title and f"{title}{jax.tree_util.keystr(path)}")
    n_params, n_x = (len(jax.tree.leaves(t)) for t in trees[:2])
    check = _check_of(closed, names, n_params, n_x, n)
    while len(_CHECKS) >= _MAX_CHECKS:
        _CHECKS.pop(next(iter(_CHECKS)))
    try:
        ref = weakref.ref(closed)
    except TypeError:  # not weakly referable: kept alive by a strong one
        ref = lambda c=closed: c  # noqa: E731
    _CHECKS[key] = (ref, check)
    return check


def check_ids(fn: str, apply3, params, x, aux, *, precision: str, name: str, closed=None) -> bool:
    """Refuses ids in ``x`` (called ``name``) outside the table a site gathers from, with
    a ValueError naming the input leaf, the sample, the id and the table's size. Per
    sample (vmapped, on the cached per-sample jaxpr) unless ``closed``, the model's jaxpr
    on the whole batch of ``x`` (``vmap_axes=None``). Traced ``x``: skipped. Returns
    False when the model has no site (a later call need not look again)."""
    if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(x)):
        return True  # (not known: checked again next time)
    n = None if closed is None else np.shape(jax.tree.leaves(x)[0])[0]
    if closed is None:
        try:
            closed = per_sample_jaxpr(apply3, params, one_sample(x), aux, precision=precision)
        except Exception:  # not per sample (reported by the caller's own checks)
            return True
    check = _cached_check(closed, (params, x, aux), n)
    if check is None:
        return False
    leaves = jax.tree.leaves((params, x, aux))
    flat = [v if use else None for v, use in zip(leaves, check.needed, strict=True)]
    if any(isinstance(v, jax.core.Tracer) for v in flat):
        return True
    with jax.ensure_compile_time_eval():  # concrete ids inside a jitted caller's trace too
        found = check.run(*flat)
    if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(found)):
        return True
    found = jax.device_get(found)
    for site, (out, ids, component) in zip(check.sites, found, strict=True):
        rows = np.nonzero(np.atleast_1d(out))[0]
        if rows.size:
            raise _refusal(fn, name, x, site, rows, ids, component, np.ndim(out) > 0)
    return True


def _refusal(fn, name, x, site, rows, ids, component, by_sample: bool) -> ValueError:
    """The ValueError for ``site``'s ids in the samples ``rows`` (``by_sample``: else the
    first out-of-range id of the whole batch, its sample found in x, if at all)."""
    j = int(rows[0])
    value, k = int(np.atleast_1d(ids)[j]), int(np.atleast_1d(component)[j])
    size, high = site.sizes[k], site.highs[k]
    where, sample = name, f" sample {j}" if by_sample else ""
    axis = site.axes[k] if k < len(site.axes) else 0
    entries = "rows" if axis == 0 else f"entries along axis {axis}"
    if high == size - 1:  # a row lookup: the id as x holds it (before -V wraps to V - 1)
        held = False
        for bit, (path, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(x)):
            values = np.asarray(leaf)
            if not site.inputs >> bit & 1 or not np.issubdtype(values.dtype, np.integer):
                continue
            rows_of = values[j : j + 1] if by_sample else values
            outside = (rows_of < -size) | (rows_of >= size)
            if outside.any():
                i = int(np.argmax(outside.reshape(len(rows_of), -1).any(1)))
                where, value = f"{name}{jax.tree_util.keystr(path)}", int(rows_of[outside][0])
                sample = f" sample {j if by_sample else i}"
                held = True
                break
        verb = "holds the id" if held else "leads to the index (computed from its ids)"
        what = f"{where}{sample} {verb} {value}, outside [-{size}, {size}) for the"
        what += f" {size} {entries} of {site.table}"
    else:
        what = f"{where}{sample} gives the index {value} into {site.table}, outside [0, {high}]"
    fix = f"keep the ids of {name} in [-{size}, {size}) (e.g. give padding or unknown ids"
    fix += " a row of their own), or enlarge the table"
    return bad(ValueError, fn, what, fix, see="embedding-ids")


_CALLS: dict = {}  # id(Checked) -> (weak reference, has sites, x2's batch jaxpr or None)
_caches.register(_CALLS.clear)


def check_call(spec, checked, params, x1, x2, aux) -> None:
    """:func:`check_ids` of x1 and x2 of one kernel call of ``spec`` (``checked``: its
    validated inputs); nothing but a dict lookup for a model without sites."""
    entry = _CALLS.get(id(checked))
    entry = entry if entry is not None and entry[0]() is checked else None
    if entry is not None and not entry[1]:
        return
    fn, options = spec.fn_name, spec.options
    whole = options.vmap_axes is None  # samples may interact: the batch's own jaxpr
    args = (fn, spec.apply3, params)
    kept = dict(precision=options.precision)
    sites = check_ids(*args, x1, aux, name="x1", closed=checked.closed if whole else None, **kept)
    if x2 is not None and sites:
        closed2 = checked.closed
        if whole and checked.n2 != checked.n1:  # traced once per signature, held here
            closed2 = entry[2] if entry is not None else None
            if closed2 is None:
                x_abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), x2)
                with jax.default_matmul_precision(options.precision):
                    closed2 = jax.make_jaxpr(spec.apply3)(params, x_abstract, aux)
        check_ids(*args, x2, aux, name="x2", closed=closed2 if whole else None, **kept)
    else:
        closed2 = None
    while len(_CALLS) >= _MAX_CHECKS:
        _CALLS.pop(next(iter(_CALLS)))
    _CALLS[id(checked)] = (weakref.ref(checked), sites, closed2)
