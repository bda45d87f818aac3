"""The adapters' seam, made public by :mod:`ntk_core.adapters`; no kernel maths."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping

import jax
import numpy as np

from ntk_core._errors import bad, must
from ntk_core._kernel.arguments import unknown_options
from ntk_core._kernel.caller import Caller
from ntk_core._kernel.checks import model_failed
from ntk_core._kernel.engine import Engine
from ntk_core._kernel.function import SIGNATURE, KernelFunction
from ntk_core._kernel.inputs import MODEL_KWARGS
from ntk_core._kernel.kind import PNTK
from ntk_core._kernel.model import flat_outputs
from ntk_core._kernel.options import NNGP_OPTION_NAMES, NTK_OPTION_NAMES, make_options
from ntk_core._kernel.pipeline import Kind, Spec

#: Options of the other framework's spelling, per adapter: the fix to give instead.
_RENAMED = {
    "ntk_haiku": {"rngs": "pass one PRNG key as rng=key", "mutable": "pass state= instead"},
    "ntk_flax": {"rng": "pass a dict of PRNG keys as rngs={'dropout': key}"},
}


def check_apply_kwargs(fn_name: str, apply_kwargs, example: str) -> dict:
    """``apply_kwargs`` as a dict (``None`` -> ``{}``); TypeError naming ``example`` otherwise."""
    if apply_kwargs is not None and not isinstance(apply_kwargs, Mapping):
        expect, got = "a dict of the model's keyword arguments", type(apply_kwargs).__name__
        raise must(TypeError, fn_name, "apply_kwargs", expect, got, eg=example)
    return dict(apply_kwargs or {})


def _param_shapes(tree) -> dict[str, tuple[int, ...]]:
    return {
        jax.tree_util.keystr(path): tuple(np.shape(leaf))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def input_shape_mismatch(
    fn_name: str, params_name: str, params, init_params: Callable, x1, init_call: str
) -> ValueError | None:
    """The ValueError for params the model's init made for inputs of another per-sample
    shape than x1's (found by comparing ``init_params(x)`` shapes under ``jax.eval_shape``,
    and naming the shape they were made for when one axis change explains it), else None."""

    def made_for(x):
        try:
            return _param_shapes(jax.eval_shape(init_params, x))
        except Exception:  # the model cannot be initialised on x: not this mistake
            return None

    given = _param_shapes(params)
    for_x1 = made_for(x1)
    if for_x1 is None or set(for_x1) != set(given) or for_x1 == given:
        return None  # init fails on x1 too, params of another model, or they fit x1
    differ = [(k, given[k], for_x1[k]) for k in given if given[k] != for_x1[k]]
    path, has, needs = differ[0]
    sizes = sorted({(n, h) for h, n in zip(has, needs, strict=False) if h != n})

    def original_shape():
        """(x1's leaf name, its per-sample shape, the one params were made for)."""
        leaves, treedef = jax.tree_util.tree_flatten(x1)
        names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(x1)]
        for i, leaf in enumerate(leaves):
            shape = tuple(np.shape(leaf))
            dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
            for axis in range(1, len(shape)):
                for need, had in sizes:
                    if shape[axis] != need:
                        continue
                    new = shape[:axis] + (had,) + shape[axis + 1 :]
                    trial = list(leaves)
                    trial[i] = jax.ShapeDtypeStruct(new, dtype)
                    if made_for(jax.tree_util.tree_unflatten(treedef, trial)) == given:
                        return f"x1{names[i]}", shape[1:], new[1:]
        return None

    more = f" ({len(differ) - 1} more parameter(s) differ)" if len(differ) > 1 else ""
    init_name = init_call.split("=")[-1].split("(")[0].strip()
    found = original_shape()
    if found is not None:
        name, sample, original = found
        what = f"{name} has per-sample shape {sample}, but {params_name} were made by {init_name} "
        what += f"for inputs of per-sample shape {original}"
        shape = ", ".join(map(str, original))
        fix = f"pass {'inputs' if name == 'x1' else name} of shape (N, {shape})"
    else:
        samples = ", ".join(str(tuple(np.shape(v))[1:]) for v in jax.tree.leaves(x1))
        what = f"{params_name} do not fit x1's per-sample shape {samples}"
        fix, needs = "pass matching inputs", f", init on x1 makes {needs}"
    what += f" (parameter {path} has shape {has}{needs if found is None else ''}){more}"
    return model_failed(fn_name, what, f"{fix}, or re-initialise ({init_call})")


def entry_kind(fn: Callable) -> tuple[str, bool]:
    """``(kind, built)`` of an adapter's entry point, read from its name: ``nngp_fn`` ->
    ``("nngp", True)``, ``pntk`` -> ``("pntk", False)``, ``kernel_per_leaf`` ->
    ``"ntk_per_leaf"``; the others (``kernel``, ``plan``, sketch, statistics) the NTK."""
    name, built, _ = fn.__name__.partition("_fn")
    kinds = dict(nngp="nngp", pntk="pntk", kernel_per_leaf="ntk_per_leaf")
    return kinds.get(name, "ntk"), bool(built)


def _value_key(value):
    """A hashable stand-in of ``value``, equal for equal values of the same types (True is not
    1: a model traced with one need not compute what it computes with the other); mappings,
    lists and tuples by their items, an unhashable dataclass (a linen module holding a list
    of layers) by its compared fields. TypeError for anything else unhashable (an array)."""
    if isinstance(value, Mapping):  # ordered by the keys' repr: equal dicts, one key
        items = [(_value_key(k), _value_key(v)) for k, v in value.items()]
        return type(value), tuple(sorted(items, key=lambda item: repr(item[0])))
    if isinstance(value, (list, tuple)):
        return type(value), tuple(_value_key(v) for v in value)
    try:
        hash(value)
        return type(value), value
    except TypeError:
        if not dataclasses.is_dataclass(value) or isinstance(value, type):
            raise
    fields = [f for f in dataclasses.fields(value) if f.compare]  # what its == compares
    return type(value), tuple((f.name, _value_key(getattr(value, f.name))) for f in fields)


class Keyed:
    """``fn`` equal (``==``, ``hash``) to every ``Keyed`` of equal ``parts``; see :func:`keyed`."""

    __slots__ = ("fn", "key", "__weakref__")  # JAX holds traced functions weakly

    def __init__(self, fn: Callable, parts: tuple):
        self.fn = fn
        try:
            self.key = _value_key(parts)
        except TypeError:  # an array among them: equal only to itself, as a closure is
            self.key = object()

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __eq__(self, other) -> bool:
        return type(other) is Keyed and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"<keyed {getattr(self.fn, '__qualname__', self.fn)!r}>"


def keyed(fn: Callable, *parts) -> Keyed:
    """``fn`` as an object equal (``==``, ``hash``) to every ``keyed(other_fn, *parts)`` of
    equal ``parts``: an adapter's ``apply3`` (or a Monte Carlo initialiser) built again for an
    equal model hits every cache keyed on it, so a new kernel function, sketch or statistic
    compiles nothing new. ``parts``: everything ``fn`` closes over that fixes the function
    (model, method, keyword arguments, the public name its messages give), compared by value
    and type (dicts, lists, tuples by their items; an unhashable dataclass, such as a linen
    module holding a list of layers, by its compared fields); with an unhashable value (an
    array) among them the result is equal only to itself. Cost: one walk of ``parts``."""
    return Keyed(fn, parts)


@dataclasses.dataclass(frozen=True)
class PureModel:
    """One model as the core sees it, for :func:`build_kernel`.

    Attributes:
      apply3: pure ``apply3(params, x, aux) -> outputs``, ``params`` differentiated, ``aux``
        held fixed (Flax's other collections and rngs, Haiku's state and rng, nnx's state).
      to_core: ``to_core(first, **call_keywords) -> (params, aux)`` (with ``to_core_reads_x1``:
        ``to_core(first, x1, **call_keywords)``), checking the caller's arguments.
      call_keywords: the built kernel function's keywords, e.g. ``("state", "rng")``.
      check: ``check(params, x1, x2, aux)``, once per input signature before tracing, raising
        the model's own mistakes (ValueError / TypeError naming the public function).
      eval_hint: how to put the model in evaluation mode (e.g. ``"model.eval()"``).
      to_core_reads_x1: ``to_core`` also needs x1.
      model_kwargs: how the caller passes model keywords, for the unknown-option fix
        (``""``: it cannot).
    """

    apply3: Callable
    to_core: Callable
    call_keywords: tuple[str, ...]
    check: Callable | None = None
    eval_hint: str = ""
    to_core_reads_x1: bool = False
    model_kwargs: str = MODEL_KWARGS


def build_kernel(
    caller: Caller, kind: Kind | str, model: PureModel, options: dict
) -> KernelFunction:
    """The :class:`~ntk_core.KernelFunction` ``kernel(first, x1, x2=None, *, call keywords)``
    of ``model`` for ``caller``; ``kind``: ``"ntk"``, ``"nngp"``, ``"ntk_per_leaf"`` or ``"pntk"``;
    ``options``: the core's (:func:`ntk_core.ntk_fn`), validated here. ``first`` is named
    after ``model.to_core``'s first parameter; other keywords get a TypeError. ``"pntk"``:
    the pseudo-NTK (:func:`ntk_core.pntk_fn`), the NTK of the outputs' sum over √O."""
    fn_name = caller.name
    if kind == PNTK:  # an NTK of one output per sample
        if "trace_axes" in options:  # one output per sample: the pNTK is (N1, N2)
            raise bad(TypeError, fn_name, "the pseudo-NTK takes no trace_axes", "drop trace_axes=")
        model = dataclasses.replace(model, apply3=flat_outputs(model.apply3, summed=True))
        kind, options = Kind.NTK, dict(options, trace_axes=())
    kind = Kind(kind)
    valid = NNGP_OPTION_NAMES if kind is Kind.NNGP else NTK_OPTION_NAMES
    unknown = sorted(set(options) - set(valid))
    if unknown:
        renamed = _RENAMED.get(caller.package)
        raise unknown_options(fn_name, "option(s)", unknown, valid, model.model_kwargs, renamed)
    opts = make_options(fn_name, **options)
    engine = Engine(Spec(fn_name, kind, model.apply3, opts, model.check, model.eval_hint, caller))
    keywords = model.call_keywords

    def bind(first, x1, given):
        unknown = ", ".join(map(repr, sorted(set(given) - set(keywords))))
        if unknown:
            fix = f"pass only {', '.join(f'{k}=' for k in keywords)}; options go to the builder"
            what = f"unknown keyword argument(s) {unknown}"
            raise bad(TypeError, f"{fn_name}(...)(...)", what, fix)
        if model.to_core_reads_x1:
            return model.to_core(first, x1, **given)
        return model.to_core(first, **given)

    p = inspect.Parameter
    head = list(SIGNATURE.parameters.values())  # (params, x1, x2=None), params renamed
    head[0] = head[0].replace(name=next(iter(inspect.signature(model.to_core).parameters)))
    parameters = head + [p(k, p.KEYWORD_ONLY, default=None) for k in keywords]
    return KernelFunction(engine, bind, inspect.Signature(parameters))
