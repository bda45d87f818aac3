"""Planning: the implementation of a call (``"auto"``: the cheapest by
:mod:`ntk_core._impl.cost`), the structured per-leaf modes, the whole-batch memory model;
returns a ``Config``. :func:`describe` is what ``plan()`` returns."""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._blocked import tiles as _blocked
from ntk_core._errors import bad
from ntk_core._impl import cost as _cost
from ntk_core._impl.base import at_top_level
from ntk_core._impl.phases import triangle_blocks
from ntk_core._impl.registry import AUTO, NNGP, PHASES, REGISTRY
from ntk_core._jax import memory as _memory
from ntk_core._jax.environment import _user_stacklevel
from ntk_core._kernel.layout import pair_bytes
from ntk_core._kernel.model import one_sample, per_sample_jaxpr
from ntk_core._kernel.options import AUTO_BATCH_SIZE
from ntk_core._kernel.pipeline import Checked, Config, Kind, Spec
from ntk_core._kernel.validate import sample_signature, signature
from ntk_core._units import human_bytes


def pair_sizes(shapes1, layouts) -> list[int]:
    """Kernel entries per pair of samples (O'), per output leaf."""
    sizes = []
    for s, layout in zip(shapes1, layouts, strict=True):  # s² per kept axis, else s
        kept = [a not in layout.trace and a not in layout.diag for a in range(layout.ndim)]
        sizes.append(math.prod(s.shape[a] ** (1 + kept[a]) for a in range(1, layout.ndim)))
    return sizes


def kernel_sizes(shapes1, layouts) -> list[int]:
    """Kernel values stored per pair of samples, per output leaf."""
    return [layout.values_per_pair(s.shape) for s, layout in zip(shapes1, layouts, strict=True)]


def _hooks():
    """The :class:`~ntk_core._impl.base.StructureHooks` of the implementation that runs
    on the structured analysis (structured derivatives)."""
    return next(impl.analysis for impl in REGISTRY.values() if impl.uses_analysis)


def structured_modes(analysis, shapes1, layouts, one_call: bool = False) -> tuple[str, ...]:
    """Per leaf group, ``"gram"`` or ``"explicit"``: the cheaper form for these outputs;
    in ``one_call`` where the backend's rates take them, late (``late_modes``; tiles
    would form them again in every tile)."""
    o_pair = sum(pair_sizes(shapes1, layouts))
    o_out = sum(math.prod(s.shape[1:]) for s in shapes1)
    modes = _hooks().modes(analysis, o_pair, o_out)
    if one_call and _cost.rates_for().late_jacobians:
        modes = _hooks().late(analysis, modes, o_out)
    return modes


def analysis(spec: Spec, analyses: dict, params, x1, aux):
    """The structured analysis of ``spec``'s model, cached per per-sample signature."""
    key = (signature(params), sample_signature(x1), signature(aux))  # not N
    found = analyses.get(key)
    if found is None:
        args = (spec.apply3, params, one_sample(x1), aux, spec.fuse_bias)
        found = analyses[key] = _hooks().analyse(*args, precision=spec.options.precision)[0]
    return found


def configure(spec: Spec, checked: Checked, analyses: dict, params, x1, x2, aux) -> Config:
    """The ``Config`` of a checked call; ValueError for ``"ntvp"`` on a model that fails
    inside its transformations, or a whole batch over ``memory_budget`` (:func:`whole_batch`)."""
    opts = spec.options
    shapes1, layouts = checked.shapes1, checked.layouts
    whole = None
    if opts.vmap_axes is None and spec.kind is not Kind.NNGP:
        whole = whole_batch(spec, checked, params)
    implementation = NNGP if spec.kind is Kind.NNGP else opts.implementation
    in_tiles = False
    if implementation == AUTO:  # per-leaf: among those that separate the leaves
        blocked = opts.batch_size is not None  # device memory bounded by the tiles
        # One call where it fits, else (outside a trace) tiles kept on the device
        tiles = not blocked and tiles_allowed(spec, (params, x1))
        budget = device_tiles_budget(spec, (params, x1)) if tiles else None
        found = estimates(spec, checked, analyses, params, x1, aux, whole, budget)
        limit = one_call_limit((params, x1))
        chosen = _cost.choice(found, blocked, tiles, limit)
        implementation = _cost.featureless() if chosen is None else chosen.implementation
        if model_failure(implementation, spec, checked, params, x1, x2, aux) is not None:
            others = [e for e in found if e.implementation != implementation]
            chosen = _cost.choice(others, blocked, tiles, limit)
            if chosen is None:  # none of the others fits: the fastest of them
                chosen = min(others, key=lambda e: e.seconds)  # in one call
            implementation = chosen.implementation
        in_tiles = not blocked and chosen is not None and chosen.batch > 0
        if not blocked and not tiles:
            warn_of_tiles(spec, found, implementation)
    elif implementation in REGISTRY:
        error = model_failure(implementation, spec, checked, params, x1, x2, aux)
        if error is not None:
            message = REGISTRY[implementation].failure_message(spec.fn_name, error)
            raise ValueError(message) from error
    structure, found_analysis = (), None
    if opts.vmap_axes is None:  # "structured": no per-sample structure to exploit
        implementation = PHASES[implementation].whole_batch_as
    if PHASES[implementation].uses_analysis:
        n_leaves = len(jax.tree.leaves(params))
        found_analysis = analysis(spec, analyses, params, x1, aux)
        one_call = opts.batch_size is None and not in_tiles
        modes = structured_modes(found_analysis, shapes1, layouts, one_call)
        structure = found_analysis.leaves(n_leaves, modes)
    return Config(
        kind=spec.kind,
        implementation=implementation,
        vmap_axes=opts.vmap_axes,
        precision=opts.precision,
        out_tree=checked.out_tree,
        layouts=layouts,
        shapes1=shapes1,
        symmetric=checked.symmetric,
        params_tree=jax.tree.structure(params),
        structure=structure,
        analysis=found_analysis,
        n2=checked.n2,
        param_sizes=tuple(math.prod(np.shape(v)) for v in jax.tree.leaves(params)),
        whole_batch=whole,
        in_tiles=in_tiles,
    )


def warn_of_tiles(spec: Spec, found, implementation: str) -> None:
    """Warns (once per input signature: configure's cache) when ``"auto"`` with
    ``batch_size=None`` had to stay in one call (under a JAX transformation, or with
    ``vmap_axes=None``: tiles need concrete arrays and per-sample rows) and took a slower
    implementation because the faster ones' features do not fit in one call, while a tiled
    alternative is estimated :data:`_cost.TILES_ADVICE_RATIO` times faster."""
    fastest = min(found, key=lambda e: e.seconds)
    advice = _cost.tiles_advice(found, implementation)
    if fastest.implementation == implementation or advice is None:
        return
    what = (
        f"implementation='auto' with batch_size=None inside a JAX transformation took "
        f"{implementation!r}: the features of faster ones do not fit in one call, and tiles "
        f"run outside transformations; {_cost.advice_text(found, implementation, advice)}"
    )
    fix = (
        "call the kernel function outside jax.jit / vmap / grad (auto then computes "
        f"the tiles on the device), or pass batch_size={AUTO_BATCH_SIZE!r} there"
    )
    warnings.warn(bad(UserWarning, spec.fn_name, what, fix).args[0], stacklevel=_user_stacklevel())


def model_failure(
    implementation: str, spec: Spec, checked: Checked, params, x1, x2, aux
) -> Exception | None:
    """The error the model raises inside ``implementation``'s transformations (traced on
    one sample), or None."""
    check = REGISTRY[implementation].model_failure
    return None if check is None else check(spec, checked, params, x1, x2, aux)


def whole_batch(spec: Spec, checked: Checked, params) -> _cost.WholeBatch:
    """The ``WholeBatch`` of ``vmap_axes=None``; refuses a batch whose forward pass and one
    reverse pass exceed ``memory_budget``."""
    opts = spec.options
    n1, n2, symmetric = checked.n1, checked.n2, checked.symmetric
    shapes1, layouts = checked.shapes1, checked.layouts
    n_max = max(n1, n2)
    n = min(n_max, opts.batch_size) if isinstance(opts.batch_size, int) else n_max
    leaves = jax.tree.leaves(params)
    n_params = sum(math.prod(np.shape(v)) for v in leaves)
    itemsize = max(np.dtype(jnp.result_type(v)).itemsize for v in leaves)
    out_total = sum(math.prod(s.shape[1:]) for s in shapes1)
    jac_bytes = (n1 if symmetric else n1 + n2) * out_total * n_params * itemsize
    pairs = n1 if layouts[0].batch_diagonal else n1 * n2
    kernel_bytes = pairs * sum(kernel_sizes(shapes1, layouts)) * itemsize * (1 + symmetric)
    held = int(1.5 * jac_bytes) + kernel_bytes  # as _cost.estimate counts them
    budget = opts.memory_budget or _blocked.default_memory_budget()
    model = _cost.whole_batch(  # values of the forward pass grow with the batch
        checked.closed.jaxpr, n_params, n * out_total, itemsize, budget, held, n / n1
    )
    one = model.residual_bytes + model.cotangent_bytes
    if one > budget and opts.batch_size != AUTO_BATCH_SIZE:
        need, have = human_bytes(one), human_bytes(budget)
        what = f"vmap_axes=None differentiates {n} samples at once: {need} > memory_budget {have}"
        raise bad(ValueError, spec.fn_name, what, f"pass vmap_axes=0, or memory_budget >= {one}")
    return model


def estimates(
    spec: Spec, checked: Checked, analyses: dict, params, x1, aux, whole=None, budget=None
):
    """The :class:`_cost.CostEstimate` of each implementation that can compute the call.
    With ``vmap_axes=None`` the costs are read from validation's jaxpr of the whole batch
    (per sample: its totals / N1) and nothing is traced: a model whose rows are not
    samples (a squeeze, a product over the batch axis) need not run on a batch of one.
    ``budget``: the tiles' memory budget (default: ``memory_budget``'s)."""
    shapes1, layouts = checked.shapes1, checked.layouts
    n1, n2 = checked.n1, checked.n2
    if spec.options.vmap_axes is None:  # no per-sample structure: no structured analysis
        closed, x_traced, batch, found_analysis = checked.closed, x1, n1, None
    else:
        x_traced, batch = one_sample(x1), 1
        closed = per_sample_jaxpr(
            spec.apply3, params, x_traced, aux, precision=spec.options.precision
        )
        found_analysis = analysis(spec, analyses, params, x1, aux)
    batch_diag = any(layout.batch_diagonal for layout in layouts)
    budget = budget or spec.options.memory_budget or _blocked.default_memory_budget()

    def block(feature_bytes, pair_bytes):  # as batch_size="auto" cuts the call
        args = (n1, n2, feature_bytes, pair_bytes, budget, batch_diag, checked.symmetric)
        return _blocked.auto_batch_size(*args)

    found = _cost.estimate(
        closed,
        params,
        x_traced,
        n1=n1,
        n2=checked.n2,
        pairs=n1 if batch_diag else n1 * n2,
        triangle=None if batch_diag or not checked.symmetric else triangle_blocks,
        out_sizes=[math.prod(s.shape[1:]) for s in shapes1],
        pair_sizes=pair_sizes(shapes1, layouts),
        kernel_sizes=kernel_sizes(shapes1, layouts),
        symmetric=checked.symmetric,
        analysis=found_analysis,
        whole_batch=whole,
        batch=batch,
        tiles=(budget, block, batch_diag),
    )
    if spec.kind is Kind.NTK_PER_LEAF:  # some do not separate the leaves
        found = tuple(e for e in found if REGISTRY[e.implementation].separates_leaves)
    return found


def describe(spec, checked, config, implementation, analyses, params, x1, x2, aux) -> _cost.Plan:
    """What a call does, as ``plan()`` returns it."""
    if config.kind is Kind.NNGP:
        what = "plan() describes NTK computations, not an NNGP"
        raise bad(ValueError, spec.fn_name, what, "call plan on the NTK kernel function")
    auto, blocked = spec.options.implementation == AUTO, spec.options.batch_size is not None
    tiles = auto and not blocked and tiles_allowed(spec, (params, x1))  # as configure's
    budget = device_tiles_budget(spec, (params, x1)) if tiles else None
    found = estimates(spec, checked, analyses, params, x1, aux, config.whole_batch, budget)
    limit = one_call_limit((params, x1))
    weighed = tuple(_cost.candidates(found, blocked, tiles, limit)) if auto else ()
    in_tiles = None
    if config.in_tiles:
        in_tiles = next(e.tiled for e in found if e.implementation == config.implementation)
    paths = [
        jax.tree_util.keystr(k) or "(root)"  # params that are one array
        for k, _ in jax.tree_util.tree_leaves_with_path(params)
    ]
    structured = REGISTRY[config.implementation].uses_analysis
    leaf_analysis, modes = config.analysis, config.structure.modes if structured else None
    if not structured and any(REGISTRY[e.implementation].uses_analysis for e in found):
        # Another implementation runs: say what "structured" would do, leaf by leaf.
        leaf_analysis = analysis(spec, analyses, params, x1, aux)
        modes = structured_modes(leaf_analysis, config.shapes1, config.layouts)
    methods = {} if leaf_analysis is None else _hooks().labels(leaf_analysis, modes)
    leaves = []
    for i, (path, size) in enumerate(zip(paths, config.param_sizes, strict=True)):
        method = methods.get(i, "jacobian (fallback)") if methods else ""
        how = (method,) if structured else (config.implementation, method)
        leaves.append(_cost.LeafPlan(path, size, *how))
    tiling, options = None, spec.options
    if config.in_tiles:  # the tiles the engine cuts (Engine._on_device_in_tiles)
        options = device_tiles_options(spec, (params, x1))
    if options.batch_size is not None:
        tiling = _blocked.tiling(implementation, config, options, params, x1, x2, aux)
    if in_tiles is not None and tiling is not None:  # the header names the tiles that run
        in_tiles = dataclasses.replace(in_tiles, batch=tiling.b1)
    return _cost.Plan(
        config.implementation,
        tuple(found),
        tuple(leaves),
        spec.options.implementation,
        tiling,
        config.whole_batch if REGISTRY[config.implementation].cotangent_chunks else None,
        spec.options.batch_size is not None,
        in_tiles,
        weighed,
        limit,
    )


_TO_FILE = "out='kernel.npy' (the kernel written to that file tile by tile, memory-mapped)"


def _devices(tree) -> list:
    """The devices of the first committed array of ``tree`` (else the default one)."""
    for a in jax.tree.leaves(tree):
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and a.committed:
            return sorted(a.sharding.device_set, key=lambda d: d.id)
    return jax.local_devices()[:1]


class TilesInstead(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by the memory guards for an ``"auto"`` call (``vmap_axes=0``) whose one call
    does not fit on its device but whose kernel does: the engine computes it in tiles,
    kept on the device (a ``jax.Array``, as one call returns)."""


def tiles_allowed(spec: Spec, tree) -> bool:
    """Whether an ``"auto"`` call on ``tree`` may go to tiles: per sample, and outside a
    trace (tiles run outside XLA, on concrete arrays)."""
    if spec.options.implementation != AUTO or spec.options.vmap_axes is None:
        return False
    traced = any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(tree))
    return at_top_level() and not traced


def for_tiles(config: Config) -> Config:
    """``config`` for tiles: each late structured group explicit again (formed in the
    features, once per block, not again in every tile), ``in_tiles`` set."""
    structure = config.structure
    if config.analysis is not None:  # the modes of tiles: none late
        modes = structured_modes(config.analysis, config.shapes1, config.layouts)
        structure = config.analysis.leaves(structure.n_leaves, modes)
    return dataclasses.replace(config, structure=structure, in_tiles=True)


def one_call_limit(tree) -> int:
    """Peak bytes up to which ``"auto"`` computes a call in one call: on a GPU or TPU half
    the memory of the devices holding ``tree`` (the other half: XLA's temporaries beyond
    the estimate; the compiled program is checked before it runs), at least
    :data:`_cost.JACOBIAN_MEMORY_BUDGET`, which is the limit on a CPU (the host's memory
    is shared with everything else there)."""
    devices = _devices(tree)
    if any(d.platform == "cpu" for d in devices):
        return _cost.JACOBIAN_MEMORY_BUDGET
    have = _memory.capacity(devices) or 0
    return max(_cost.JACOBIAN_MEMORY_BUDGET, have // 2)


def device_tiles_budget(spec: Spec, tree) -> int:
    """The memory budget of the tiles an ``"auto"`` call with ``batch_size=None`` is
    computed in: ``memory_budget`` (else its default), at most half the capacity of the
    device holding ``tree`` (the other half holds the kernel, kept there)."""
    budget = spec.options.memory_budget or _blocked.default_memory_budget()
    have = _memory.capacity(_devices(tree))
    return budget if have is None else min(budget, have // 2)


def device_tiles_options(spec: Spec, tree):
    """The options of those tiles: ``batch_size="auto"`` within :func:`device_tiles_budget`,
    the kernel stored on the device (a ``jax.Array``, as one call returns)."""
    budget = device_tiles_budget(spec, tree)
    return dataclasses.replace(
        spec.options, batch_size=AUTO_BATCH_SIZE, store_on_device=True, memory_budget=budget
    )


def tiles_fix(spec: Spec, checked: Checked, config: Config, analyses, params, x1, aux) -> str:
    """The fix of a one-call kernel that does not fit its device: ``batch_size=B``, the
    tiles of ``config``'s implementation that fit it (the block size of the cost model's
    tiled estimate at the smaller of ``memory_budget`` and the device's capacity), with
    its estimated time, and the fastest tiled alternative where another implementation's
    is estimated faster; ``batch_size='auto'`` where the cost model has no tiled estimate
    (NTK-vector products, ``vmap_axes=None``, an NNGP) or none fits."""
    plain = f"pass batch_size={AUTO_BATCH_SIZE!r} (tiles, the same kernel)"
    if spec.kind is Kind.NNGP or spec.options.vmap_axes is None:
        return plain
    have = _memory.capacity(_devices((x1, params)))
    budget = spec.options.memory_budget or _blocked.default_memory_budget()
    budget = budget if have is None else min(budget, have)
    found = estimates(spec, checked, analyses, params, x1, aux, budget=budget)
    tiled = {e.implementation: e.tiled for e in found if e.tiled is not None}
    mine = tiled.get(config.implementation)
    if mine is None or (have is not None and mine.memory_bytes > have):
        return plain
    fix = (
        f"pass batch_size={mine.batch} (tiles of {mine.batch} samples, the same kernel; "
        f"estimated ~{mine.seconds:.3g} s)"
    )
    best = min(tiled.values(), key=lambda e: e.seconds)
    if best.implementation != mine.implementation and best.seconds < mine.seconds:
        fix += (
            f", or implementation={best.implementation!r} with batch_size={best.batch} "
            f"(~{best.seconds:.3g} s)"
        )
    return fix


def check_fits(
    spec: Spec, checked: Checked, config: Config, analyses: dict, params, x1, aux
) -> None:
    """Refuses a one-call kernel (``batch_size=None``) that cannot fit on its device
    (:func:`_memory.capacity`): the kernel, twice for a Gram matrix (x2=None: the kernel and
    its mirror (K + Kᵀ)/2 are held at once), plus the features where the implementation
    knows their size without a trace (``Impl.feature_bytes``: the per-sample Jacobians),
    naming the tiles that fit (:func:`tiles_fix`); with ``"auto"``, where the kernel alone
    fits, raises :class:`TilesInstead`. A lower bound: passes in flight and XLA's
    temporaries come on top (:func:`check_compiled` reads them once compiled). An
    ``"auto"`` call planned in tiles (``config.in_tiles``) raises :class:`TilesInstead`
    where its kernel fits."""
    devices = _devices((x1, params))
    leaves = len(config.param_sizes) if spec.kind is Kind.NTK_PER_LEAF else 1
    diagonal = checked.layouts[0].batch_diagonal
    pairs = checked.n1 if diagonal else checked.n1 * checked.n2
    kernel = pairs * pair_bytes(checked.shapes1, checked.layouts, leaves)
    copies = 2 if checked.symmetric and not diagonal else 1
    per_sample = PHASES[config.implementation].feature_bytes
    n = checked.n1 + (0 if checked.symmetric else checked.n2)
    features = 0 if per_sample is None else n * per_sample(config)
    need = kernel * copies + features
    over = _memory.beyond(need, devices)
    if over is None and not config.in_tiles:
        return
    if tiles_allowed(spec, (params, x1)) and _memory.beyond(kernel * copies, devices) is None:
        raise TilesInstead
    if over is None:  # planned in tiles, but traced: the one call fits
        return
    parts = f"the kernel {human_bytes(kernel)}" + (" twice (with its mirror)" * (copies == 2))
    parts += f" and the features of its {n} samples {human_bytes(features)}" if features else ""
    what = f"this call holds {human_bytes(need)} at once ({parts}), {over}"
    fix = tiles_fix(spec, checked, config, analyses, params, x1, aux)
    host = _memory.host_memory()
    fix += f" with {_TO_FILE}" if host is not None and kernel > host else ""
    fix += f", or implementation={AUTO!r}" if features > kernel * copies else ""
    raise bad(ValueError, spec.fn_name, what, fix, see="out-of-memory")


#: What each compiled program of a call is, as :func:`check_compiled` names it.
_PROGRAMS = {
    "features": "its features",
    "_tile": "its contraction",
    "symmetrize": "its mirror (K + Kᵀ)/2",
}


def check_compiled(
    spec: Spec, checked: Checked, config: Config, analyses: dict, params, x1, aux, program, stats
) -> None:
    """Refuses a one-call program that XLA compiled (``stats``: its ``memory_analysis()``,
    None: nothing to check) to need more than its device holds, arguments + output +
    temporaries − aliased (:func:`_memory.compiled_bytes`), or that the compiler refused
    (``stats`` its ``RESOURCE_EXHAUSTED`` error), naming the figure and the fix
    (:func:`tiles_fix`); with ``"auto"`` raises :class:`TilesInstead`. Called before
    the program runs, once per input signature (``_impl.base.memory_checked``)."""
    name = _PROGRAMS.get(program, f"its program {program!r}")
    if isinstance(stats, Exception):  # the compiler found it does not fit (XLA TPU)
        if tiles_allowed(spec, (params, x1)):
            raise TilesInstead from stats
        said = str(stats).strip().splitlines()[0].rstrip(".")
        what = f"implementation={config.implementation!r} does not fit the device for {name}"
        what += f": XLA says {said!r}"
    else:
        found = _memory.compiled_bytes(stats)
        if found is None:
            return
        need, arguments, output, temporaries = found
        if (over := _memory.beyond(need, _devices((x1, params)))) is None:
            return
        if tiles_allowed(spec, (params, x1)):
            raise TilesInstead
        what = (
            f"implementation={config.implementation!r} needs {human_bytes(need)} at once for "
            f"{name} as XLA compiled it (arguments {human_bytes(arguments)}, output "
            f"{human_bytes(output)}, temporaries {human_bytes(temporaries)}), {over}"
        )
    fix = tiles_fix(spec, checked, config, analyses, params, x1, aux)
    per_leaf = spec.kind is Kind.NTK_PER_LEAF
    others = [
        repr(other)
        for other, impl in REGISTRY.items()
        if other != config.implementation and (impl.separates_leaves or not per_leaf)
    ]
    if spec.kind is not Kind.NNGP and others:
        fix += f", or implementation={' or '.join(others)} in one call"
    error = bad(ValueError, spec.fn_name, what, fix, see="out-of-memory")
    raise error from (stats if isinstance(stats, Exception) else None)


def check_result_fits(spec: Spec, cut) -> None:
    """Refuses a blocked call without ``out`` whose result (``cut.out_bytes``) exceeds the
    memory holding it: the host's, or with ``store_on_device`` the device's."""
    opts = spec.options
    devices = [d for d in cut.devices[:1] if d is not None]
    on_host = not opts.store_on_device
    if opts.out is not None or (over := _memory.beyond(cut.out_bytes, devices, on_host)) is None:
        return
    what = f"the kernel is {human_bytes(cut.out_bytes)}, {over}"
    fix = f"pass {_TO_FILE}" + ("" if on_host else " instead")
    raise bad(ValueError, spec.fn_name, what, fix, see="out-of-memory")
