"""The engine: one kernel call through validate, plan, implementation and executor,
caching per input signature the checks and plan, and per per-sample signature
(``vmap_axes=0``) the outputs and analysis, so a new N reuses them."""

from __future__ import annotations

import dataclasses

import jax

from ntk_core._blocked import store as _store
from ntk_core._blocked import tiles as _blocked
from ntk_core._errors import bad
from ntk_core._impl import phases as _implementations
from ntk_core._impl.base import memory_checked
from ntk_core._impl.registry import AUTO, REGISTRY
from ntk_core._kernel import checks as _checks
from ntk_core._kernel import executor as _executor
from ntk_core._kernel import ids as _ids
from ntk_core._kernel import planner as _planner
from ntk_core._kernel import subset as _subset
from ntk_core._kernel import validate as _validate
from ntk_core._kernel.layout import as_result
from ntk_core._kernel.model import one_sample, per_sample_jaxpr
from ntk_core._kernel.pipeline import Checked, Config, Implementation, Kind, Spec


class Engine:
    """One kernel function's pipeline: ``engine(params, x1, x2, aux) -> kernel``; ValueError
    for per-leaf kernels with an implementation that does not separate leaves. With ``wrt``
    every entry splits ``params`` first (:mod:`ntk_core._kernel.subset`)."""

    def __init__(self, spec: Spec):
        if spec.options.wrt is not None:  # the model of the subset, the rest held in aux
            check = spec.check and _subset.OnSubset(spec.check)
            spec = dataclasses.replace(spec, apply3=_subset.OnSubset(spec.apply3), check=check)
        impl = REGISTRY.get(spec.options.implementation)  # None: "auto"
        if spec.kind is Kind.NTK_PER_LEAF and impl is not None and not impl.separates_leaves:
            separating = [repr(name) for name, i in REGISTRY.items() if i.separates_leaves]
            what = f"per-leaf kernels need implementation {', '.join(separating)} or {AUTO!r}"
            what += f", got {impl.name!r} ({impl.title} do not separate the leaves)"
            raise bad(ValueError, spec.fn_name, what, f"pass implementation={AUTO!r}")
        self.spec = spec
        self._prepared: dict = {}  # input signature -> (Checked, Config)
        self._samples: dict = {}  # per-sample signature -> outputs (_validate)
        self._analyses: dict = {}  # per-sample signature -> structured analysis
        self._chunks: dict = {}  # (config, x signature) -> structured features chunk
        self._masks: dict = {}  # wrt: params tree structure -> the leaves it selects
        # batch_size=None: input signature -> True (one call, its compiled memory checked)
        # or False ("auto" that does not fit in one call: tiles on the device)
        self._one_call: dict = {}

    def prepare(self, params, x1, x2=None, aux=None) -> tuple[Checked, Config]:
        """Validation and planning of a call (cached per input signature)."""
        return self._prepare(params, x1, x2, aux)[1:]

    def _prepare(self, params, x1, x2, aux) -> tuple[tuple, Checked, Config]:
        key = tuple(_validate.signature(t) for t in (params, x1, x2, aux))
        # "auto" plans tiles only outside a trace: a traced call has its own plan
        key += (_planner.tiles_allowed(self.spec, (params, x1)),)
        found = self._prepared.get(key)
        if found is None:
            spec = self.spec
            checked = _validate.validate(spec, self._samples, params, x1, x2, aux)
            config = _planner.configure(spec, checked, self._analyses, params, x1, x2, aux)
            found = self._prepared[key] = (checked, config)
        return (key, *found)

    def implementation(self, config: Config) -> Implementation:
        """The compiled phases of ``config``'s implementation."""
        return _implementations.build(self.spec.apply3, config, self._chunks)

    def _split(self, params, aux):
        wrt = self.spec.options.wrt
        if wrt is None:
            return params, aux
        return _subset.split(self.spec.fn_name, wrt, params, aux, self._masks)

    def plan(self, params, x1, x2=None, aux=None):
        """What a call with these inputs does (:func:`_planner.describe`)."""
        params, aux = self._split(params, aux)
        params, x1, x2 = _validate.as_arrays(self.spec.fn_name, params, x1, x2)
        checked, config = self.prepare(params, x1, x2, aux)
        implementation = self.implementation(config)
        return _planner.describe(
            self.spec, checked, config, implementation, self._analyses, params, x1, x2, aux
        )

    def implementation_for(self, params, x1, x2=None, aux=None) -> str:
        """The implementation a call with these inputs uses (what ``"auto"`` chose)."""
        params, aux = self._split(params, aux)
        params, x1, x2 = _validate.as_arrays(self.spec.fn_name, params, x1, x2)
        return self.prepare(params, x1, x2, aux)[1].implementation

    def __call__(self, params, x1, x2=None, aux=None):
        params, aux = self._split(params, aux)
        try:
            return self._call(params, x1, x2, aux)
        except jax.errors.UnexpectedTracerError as e:  # found when the phases trace
            raise _checks.leaked_tracer_error(self.spec.fn_name, e) from e

    def _call(self, params, x1, x2, aux):
        spec, options = self.spec, self.spec.options
        params, x1, x2 = _validate.as_arrays(self.spec.fn_name, params, x1, x2)
        if options.batch_size is None:
            _validate.check_one_device(spec, params, x1, x2, aux)
        key, checked, config = self._prepare(params, x1, x2, aux)
        _ids.check_call(spec, checked, params, x1, x2, aux)  # every call: ids are values
        implementation = self.implementation(config)
        if options.batch_size is None:
            one_call = self._one_call.get(key)
            if one_call is None:  # first call: the guards, XLA's figures once compiled
                try:
                    result, checked_all = self._first_call(
                        checked, config, implementation, params, x1, x2, aux
                    )
                except _planner.TilesInstead:
                    self._one_call[key] = one_call = False
                else:
                    if checked_all:  # else traced: XLA's figures wait for a concrete call
                        self._one_call[key] = True
                    return result
            if not one_call:
                return self._on_device_in_tiles(config, implementation, params, x1, x2, aux)
            _planner.check_fits(spec, checked, config, self._analyses, params, x1, aux)
            result, finite = _executor.one_call(implementation, params, x1, x2, aux)
            _executor.check_finite_result(spec.fn_name, result, config, finite, x1, x2, params)
            return result
        _validate.check_untraced(spec, params, x1, x2)
        cut = _blocked.tiling(implementation, config, options, params, x1, x2, aux)
        _validate.check_budget(spec, cut)
        _planner.check_result_fits(spec, cut)
        _validate.check_blocks_independent(spec, checked, cut, params, x1, x2, aux)
        store = None
        if options.out is not None:  # written to a .npy file, resumable (_store)
            closed = checked.closed  # the model's jaxpr, as validation traced it
            if options.vmap_axes is not None:  # per sample
                args = (spec.apply3, params, one_sample(x1), aux)
                closed = per_sample_jaxpr(*args, precision=options.precision)
            model = _store.model_digest(closed)
            store = _store.for_call(spec, config, cut, model, params, x1, x2, aux)
            if store.finished:
                return as_result(config, [store.result()])
        kernel = _blocked.compute(
            implementation, config, cut, options, spec.fn_name, params, x1, x2, aux, store
        )
        return kernel if store is None else as_result(config, [kernel])

    def _first_call(self, checked, config, implementation, params, x1, x2, aux):
        """``(kernel, checked)`` of a one call's first run for an input signature: the
        memory model's guard, then each program checked against XLA's memory analysis
        once compiled, before it runs (:func:`_planner.check_compiled`; ``checked``: some
        were, nothing traced them); :class:`_planner.TilesInstead` for ``"auto"`` where
        either finds it does not fit."""
        spec, analyses, programs = self.spec, self._analyses, []
        _planner.check_fits(spec, checked, config, analyses, params, x1, aux)

        def check(program, stats):
            programs.append(program)
            args = (spec, checked, config, analyses, params, x1, aux, program, stats)
            _planner.check_compiled(*args)

        with memory_checked(check):
            result, finite = _executor.one_call(implementation, params, x1, x2, aux)
        _executor.check_finite_result(spec.fn_name, result, config, finite, x1, x2, params)
        return result, bool(programs)

    def _on_device_in_tiles(self, config, implementation, params, x1, x2, aux):
        """The kernel of an ``"auto"`` call that does not fit in one call, in tiles that
        fit the device (``batch_size="auto"`` within its capacity), kept on the device."""
        config = _planner.for_tiles(config)  # explicit Jacobians once per block, not per tile
        implementation = self.implementation(config)
        options = _planner.device_tiles_options(self.spec, (params, x1))
        cut = _blocked.tiling(implementation, config, options, params, x1, x2, aux)
        fn = self.spec.fn_name
        return _blocked.compute(implementation, config, cut, options, fn, params, x1, x2, aux)
