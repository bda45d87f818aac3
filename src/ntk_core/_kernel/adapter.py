"""The one seam between the core and a framework adapter (``ntk_flax``, ``ntk_haiku``).

An adapter describes its framework once, as an :class:`Adapter`: the names of its
arguments (``model, variables`` or ``transformed, params``), its keyword arguments, its
words for the docstrings, and ``make``, which turns one model into a :class:`PureModel`
(the pure ``apply3(params, x, aux)``, which of the caller's arguments are ``params`` and
which ``aux``, the model-specific ``check`` and the evaluation-mode hint) and builds its
kernel function with :func:`build_kernel`. :func:`entry_point` then makes each public
entry point (``kernel``, ``kernel_fn``, ``nngp``, ...) from the adapter and the entry's
:class:`Entry`: the signature, the behaviour and the docstring, filled from one template
per entry point. What an entry point means (its kind, its form, its text) is written
once, here; no kernel maths lives in an adapter.

Also the helpers the adapters share: option checking, input-shape messages, the one-call
cache. Not part of the public API.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import inspect
import re
import textwrap
from collections.abc import Callable, Mapping

import jax
import numpy as np

from ntk_core._api import _checked_arguments
from ntk_core._jax import caches as _caches
from ntk_core._kernel.caller import Caller
from ntk_core._kernel.engine import Engine
from ntk_core._kernel.function import KernelFunction
from ntk_core._kernel.options import NNGP_OPTION_NAMES, NTK_OPTION_NAMES, make_options
from ntk_core._kernel.pipeline import Spec

#: Options of the other framework's spelling, per adapter: the fix to give instead.
_RENAMED = {
    "ntk_haiku": {
        "rngs": "pass rng=key (Haiku takes one PRNG key, not rngs=)",
        "mutable": "pass state= for an hk.TransformedWithState (Haiku has no mutable=)",
    },
    "ntk_flax": {"rng": "pass rngs={'dropout': key} (Flax takes a dict of PRNG keys, not rng=)"},
}


def check_apply_kwargs(fn_name: str, apply_kwargs, example: str) -> dict:
    """``apply_kwargs`` as a dict (``None`` -> ``{}``); a TypeError naming ``example``
    (e.g. ``"{'train': False}"``) for anything that is not a mapping."""
    if apply_kwargs is not None and not isinstance(apply_kwargs, Mapping):
        raise TypeError(
            f"{fn_name}: apply_kwargs must be a dict of the model's keyword arguments, got "
            f"{type(apply_kwargs).__name__} {apply_kwargs!r}. Fix: pass e.g. "
            f"apply_kwargs={example}."
        )
    return dict(apply_kwargs or {})


def _param_shapes(tree) -> dict[str, tuple[int, ...]]:
    return {
        jax.tree_util.keystr(path): tuple(np.shape(leaf))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def input_shape_mismatch(
    fn_name: str, params_name: str, params, init_params: Callable, x1, init_call: str
) -> ValueError | None:
    """The ValueError for params made by the model's init for inputs of another shape
    than x1's (e.g. a Dense layer initialised for 3 features, given 5), else ``None``.

    Compares shapes, not the framework's error text: ``init_params(x)`` returns the
    parameters the model's init makes for inputs ``x`` (run under ``jax.eval_shape``, so
    nothing is computed). When params and the parameters made for x1 have the same
    leaves but some shapes differ, the inputs do not fit; changing one axis of x1 to the
    size the first differing parameter was made for, and finding that init then makes
    exactly params' shapes, gives the per-sample shape the model was initialised with.
    Error path only: a few abstract traces of init.
    """

    def made_for(x):
        try:
            return _param_shapes(jax.eval_shape(init_params, x))
        except Exception:  # the model cannot be initialised on x: not this mistake
            return None

    given = _param_shapes(params)
    for_x1 = made_for(x1)
    if for_x1 is None or set(for_x1) != set(given):
        return None  # init fails on x1 too, or params of another model: not this mistake
    differ = [(k, given[k], for_x1[k]) for k in given if given[k] != for_x1[k]]
    if not differ:
        return None
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
        return ValueError(
            f"{fn_name}: applying the model to x1 failed: {name} has per-sample shape "
            f"{sample}, but {params_name} were made by {init_name} for inputs of per-sample "
            f"shape {original}: parameter {path} has shape {has}, but inputs like x1 need "
            f"{needs}{more}. Fix: pass {'inputs' if name == 'x1' else name} of "
            f"shape (N, {', '.join(map(str, original))}), the shape the model was initialised "
            f"with, or re-initialise it for these inputs ({init_call})."
        )
    samples = [tuple(np.shape(v))[1:] for v in jax.tree.leaves(x1)]
    return ValueError(
        f"{fn_name}: applying the model to x1 failed: {params_name} do not fit inputs of "
        f"x1's per-sample shape{'s' if len(samples) > 1 else ''} "
        f"{', '.join(map(str, samples))}: parameter {path} has shape {has}, but the "
        f"model's init on x1 makes {needs}{more}. Fix: pass inputs of the per-sample "
        f"shape the model was initialised with, and {params_name} made by this model's "
        f"init (the same model built with other sizes makes other shapes), or "
        f"re-initialise it for these inputs ({init_call})."
    )


def kernel_function(caller: Caller, kind: str, apply3, options: dict, check=None, hint: str = ""):
    """Validates ``options`` (names and values) and builds the model's
    :class:`~ntk_core._kernel.engine.Engine` for the public function ``caller``."""
    fn_name = caller.name
    valid = NNGP_OPTION_NAMES if kind == "nngp" else NTK_OPTION_NAMES
    unknown = sorted(set(options) - set(valid))
    if unknown:
        renamed = _RENAMED.get(caller.package, {})
        fixes, model_kwargs = [], False
        for u in unknown:
            close = difflib.get_close_matches(u, valid, 1)
            if u in renamed:
                fixes.append(renamed[u])
            elif close:  # a misspelt option, e.g. trace_axis
                fixes.append(f"write {close[0]}= (not {u}=)")
            else:
                model_kwargs = True
        if model_kwargs:
            fixes.append("pass model keyword arguments through apply_kwargs={...}")
        raise TypeError(
            f"{fn_name}: unknown option(s) {', '.join(map(repr, unknown))}; valid options are "
            f"{', '.join(valid)}. Fix: {'; '.join(fixes)}."
        )
    opts = make_options(fn_name, **options)
    return Engine(Spec(fn_name, kind, apply3, opts, check, hint, caller))


def bound_kernel(
    fn_name: str,
    kernel: Engine,
    to_core,
    keywords: tuple[str, ...],
    *,
    with_x1: bool = False,
) -> KernelFunction:
    """The kernel function an adapter returns: ``call(first, x1, x2=None, **keywords)``,
    with ``.plan`` and ``.implementation_for`` taking the same arguments.

    ``to_core(first, **keywords) -> (params, aux)`` turns the adapter's arguments (Flax
    ``variables`` and ``rngs``, Haiku ``params``, ``state`` and ``rng``) into the core's;
    with ``with_x1``, ``to_core(first, x1, **keywords)`` also sees x1 (Flax reads what
    ``variables`` is from the model's init on x1). A keyword outside ``keywords`` gets a
    TypeError naming the valid ones. ``to_core``'s first parameter names the kernel
    function's first argument in its signature.
    """

    def bind(first, x1, given):
        unknown = sorted(set(given) - set(keywords))
        if unknown:
            raise TypeError(
                f"{fn_name}(...)(...): unknown keyword argument(s) "
                f"{', '.join(map(repr, unknown))}; the kernel function takes "
                f"{', '.join(f'{k}=' for k in keywords)}. Fix: give kernel options when "
                f"building it, and model arguments through apply_kwargs={{...}}."
            )
        return to_core(first, x1, **given) if with_x1 else to_core(first, **given)

    p = inspect.Parameter
    first = next(iter(inspect.signature(to_core).parameters), "params")
    signature = inspect.Signature(
        [
            p(first, p.POSITIONAL_OR_KEYWORD),
            p("x1", p.POSITIONAL_OR_KEYWORD),
            p("x2", p.POSITIONAL_OR_KEYWORD, default=None),
            *(p(k, p.KEYWORD_ONLY, default=None) for k in keywords),
        ]
    )
    return KernelFunction(kernel, bind, signature)


def freeze(value):
    """A hashable stand-in for nested dicts and lists (for cache keys)."""
    if isinstance(value, dict):
        return (dict, tuple(sorted((k, freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(freeze(v) for v in value))
    return value


class BuildCache:
    """A small FIFO cache of built kernel functions, so one-call entry points such as
    ``ntk_flax.kernel`` reuse the compiled function of an equal earlier call."""

    def __init__(self, size: int = 32):
        self._size = size
        self._items: dict = {}
        _caches.register(self._items.clear)  # ntk_core.clear_caches() empties it

    def get(self, key, build):
        try:
            hash(key)
        except TypeError:
            return build()
        fn = self._items.get(key)
        if fn is None:
            if len(self._items) >= self._size:
                self._items.pop(next(iter(self._items)))
            fn = self._items[key] = build()
        return fn


# --- The adapter seam -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PureModel:
    """One model as the core sees it: what an adapter's ``make`` builds for each model.

    Attributes:
      apply3: ``apply3(params, x, aux) -> outputs``, the one pure form every part of the
        core calls: ``params`` differentiated, ``aux`` held fixed (Flax's other
        collections and rngs, Haiku's state and rng, nnx's graph and other state).
      to_core: ``to_core(first, **call_keywords) -> (params, aux)``, or with
        ``to_core_reads_x1`` ``to_core(first, x1, **call_keywords)``: which of the
        caller's arguments (``variables``, ``rngs``; ``params``, ``state``, ``rng``)
        are the core's ``params`` and which its ``aux``, after checking them.
      call_keywords: the keyword arguments of the built kernel function, e.g.
        ``("rngs",)`` or ``("state", "rng")``.
      check: ``check(params, x1, x2, aux)``, run once per input signature before
        tracing: raises the model's own mistakes (a missing rng, parameters of
        another model, a model that updates its statistics) as ValueError / TypeError
        starting with the public function's name.
      eval_hint: how to put the model in evaluation mode (e.g. ``"model.eval()"``), for
        the message of the sample-independence probe.
      to_core_reads_x1: ``to_core`` also needs x1 (Flax reads what ``variables`` is
        from the model's init on x1).
    """

    apply3: Callable
    to_core: Callable
    call_keywords: tuple[str, ...]
    check: Callable | None = None
    eval_hint: str = ""
    to_core_reads_x1: bool = False


def build_kernel(caller: Caller, kind: str, model: PureModel, options: dict):
    """The kernel function of ``model`` for the public function ``caller`` (see
    :func:`bound_kernel`), ``kind`` one of ``"ntk"``, ``"nngp"``, ``"ntk_per_leaf"``;
    ``options`` are validated here."""
    kernel = kernel_function(caller, kind, model.apply3, options, model.check, model.eval_hint)
    return bound_kernel(
        caller.name, kernel, model.to_core, model.call_keywords, with_x1=model.to_core_reads_x1
    )


class Form(enum.Enum):
    """How an entry point takes the model's parameters and what it returns."""

    #: ``name(model, *, model keywords, **options)`` returns the reusable kernel
    #: function ``kernel(params, x1, x2=None, *, call keywords)``.
    BUILD = "build"
    #: ``name(model, params, x1, x2=None, *, keywords, **options)`` returns the kernel
    #: (its kernel function is built once and cached).
    CALL = "call"
    #: As ``CALL``, but returns the kernel function's ``plan(...)``: nothing computed.
    PLAN = "plan"
    #: The Monte Carlo kernels: the parameters come from the model's own init (the
    #: caller passes none, and no random keys), over many initialisations.
    MONTE_CARLO = "monte_carlo"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One public entry point of every adapter: its name (``ntk_flax.<name>``), the
    kernel it computes (``"ntk"``, ``"nngp"`` or ``"ntk_per_leaf"``), its :class:`Form`
    and its docstring template (see :func:`entry_point` for the fields)."""

    name: str
    kind: str
    form: Form
    doc: str = ""


# The docstring templates. A field {name} is filled from the adapter (see
# Adapter.fields); a multi-line value keeps the indentation of the line it stands on,
# and a line that held only an empty field is dropped.

_KERNEL_FN_DOC = """Jitted empirical NTK of {a_model}, reusable across training steps.

Returns ``{call}``.
{held_fixed}

Args:
  {model}: {model_doc}
  {model_keyword_args}
  **options: ``trace_axes``, ``diagonal_axes``, ``vmap_axes``, ``implementation``,
    ``precision`` as in :func:`ntk_core.ntk_fn`, and the blocked engine's
    ``batch_size``, ``store_on_device``, ``progress``, ``memory_budget`` (a Gram
    matrix of any size in tiles; a host ``numpy.ndarray`` by default when batched).

Returns:
  ``{call}``
  giving the kernel in the layout of :func:`ntk_core.empirical_ntk`: ``(N1, N2)`` for
  ``(N, O)`` outputs by default, ``(N1, N2, O, O)`` with ``trace_axes=()``.
  ``kernel.implementation_for({params}, x1, x2=None, ...)``, with the same arguments,
  tells which implementation such a call uses (what ``"auto"`` chose);
  ``kernel.plan(...)`` describes it per parameter leaf (see :func:`plan`).

Raises:
  {raises}

Cost: as :func:`ntk_core.ntk_fn`, plus, once per input shape, two small forward
passes that check per-sample independence{extra_cost}.

Example:
  {example_setup}
  >>> kernel = {pkg}.kernel_fn({example_model}, trace_axes=())
  >>> kernel({example_init}, x).shape  # (N1, N2, O, O)
  (4, 4, 3, 3)

References:
  Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Novak,
  Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
"""

_NNGP_FN_DOC = """Jitted empirical NNGP kernel of {a_model}; see :func:`kernel_fn`.

Args:
  {model}, {model_keywords}: as :func:`kernel_fn`.
  **options: ``trace_axes``, ``diagonal_axes``, ``vmap_axes``, ``precision``,
    ``batch_size``, ``store_on_device``, ``progress``, ``memory_budget``, as in
    :func:`ntk_core.nngp_fn`.

Returns:
  ``{call}``
  giving f(x1)·f(x2) in the layout of :func:`ntk_core.empirical_nngp`: ``(N1, N2)`` for
  ``(N, O)`` outputs by default, ``(N1, N2, O, O)`` with ``trace_axes=()``, in the
  outputs' dtype.

Raises:
  As :func:`kernel_fn`; TypeError for ``implementation=`` (an NNGP has none).

Cost: one forward pass per sample and N1·N2·O'·O multiply-adds.

Example:
  {example_setup}
  >>> {pkg}.nngp_fn({example_model})({example_init}, x).shape
  (4, 4)

References:
  Lee et al., "Deep Neural Networks as Gaussian Processes", ICLR 2018.
"""

_KERNEL_DOC = """Empirical NTK of {a_model} between x1 and x2 (x1 if None).

Θ(x1, x2)[i, j, a, b] = Σ_p ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p over {differentiated},
in the layout of :func:`ntk_core.empirical_ntk` (``(N1, N2)`` for ``(N, O)`` outputs
with the default ``trace_axes=(-1,)``, traced axes averaged).

Args:
  {model}: {model_doc}
  {params}: {params_doc}
  x1: array or pytree of arrays, batch axis 0 of size N1.
  x2: ``None`` (x2 is x1) or like x1 with N2 samples.
  {call_keyword_args}
  {model_keywords}, **options: see :func:`kernel_fn`.

Returns:
  The kernel, float32 by default: ``(N1, N2)``, ``(N1, N2, O, O)`` with
  ``trace_axes=()``, ``(N,)`` with ``diagonal_axes=(0,)``.

Raises:
  See :func:`kernel_fn`.

Cost: as :func:`kernel_fn` (compiled once per model, options and input shapes, and
cached).

Example:
  {example_setup}
  >>> {params} = {example_init}
  >>> {pkg}.kernel({example_model}, {params}, x).shape
  (4, 4)
  {more_kernel_examples}

References:
  Novak, Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel",
  ICML 2022.
"""

_NNGP_DOC = """Empirical NNGP kernel f(x1)·f(x2) of {a_model}; see :func:`kernel`.

Args:
  {model}, {params}, x1 (N1 samples), x2 (N2 samples or ``None``),
    {keywords}: as :func:`kernel`.
  **options: ``trace_axes``, ``diagonal_axes``, ``vmap_axes``, ``precision``,
    ``batch_size``, ``store_on_device``, ``progress``, ``memory_budget``.

Returns:
  The kernel in the layout of :func:`ntk_core.empirical_nngp` (``(N1, N2)`` for
  ``(N, O)`` outputs by default, ``(N1, N2, O, O)`` with ``trace_axes=()``), in the
  outputs' dtype.

Raises:
  See :func:`nngp_fn`.

Cost: as :func:`nngp_fn` (compiled once and cached).

Example:
  {example_setup}
  >>> {pkg}.nngp({example_model}, {example_init}, x, trace_axes=()).shape
  (4, 4, 3, 3)

References:
  Lee et al., "Deep Neural Networks as Gaussian Processes", ICLR 2018.
"""

_KERNEL_PER_LEAF_FN_DOC = """Jitted empirical NTK of {a_model}, split by parameter leaf.

Shows which layers drive the kernel: Σ_l Θ_l = Θ (see :func:`ntk_core.ntk_per_leaf_fn`).

Args:
  {model}, {model_keywords}: see :func:`kernel_fn`.
  **options: as :func:`kernel_fn`; ``implementation`` is ``"auto"``,
    ``"jacobian"`` or ``"structured"`` (NTK-vector products do not separate the
    leaves).

Returns:
  ``{call}``
  giving a dict shaped like {per_leaf_tree},
  whose leaves Θ_l are kernels in the layout of :func:`kernel` (``(N1, N2)`` by
  default, ``(N1, N2, O, O)`` with ``trace_axes=()``).

Raises:
  As :func:`kernel_fn`, and ValueError for ``implementation="ntvp"``.

Cost: as :func:`kernel_fn` with the same implementation (the per-leaf terms are what
it sums), plus the memory of L kernels instead of one.

Example:
  {example_setup}
  >>> k = {pkg}.kernel_per_leaf_fn({example_model})({example_init}, x)
  >>> k{example_layer}['{example_w}'].shape
  (4, 4)

References:
  Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Novak,
  Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
"""

_KERNEL_PER_LEAF_DOC = """Empirical NTK of {a_model} split by parameter leaf.

Θ_l(x1, x2)[i, j, a, b] = Σ_{p in leaf l} ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p for each
leaf l of {differentiated}; the leaves sum to :func:`kernel`.

Args:
  {model}, {params}, x1, x2, {keywords}: see :func:`kernel`.
  **options: see :func:`kernel_per_leaf_fn`.

Returns:
  A dict shaped like {per_leaf_tree},
  of kernels, each in the layout and dtype of :func:`kernel` (``(N1, N2)`` by default,
  ``(N1, N2, O, O)`` with ``trace_axes=()``).

Raises:
  See :func:`kernel_per_leaf_fn`.

Cost: as :func:`kernel_per_leaf_fn` (compiled once and cached).

Example:
  {example_setup}
  >>> k = {pkg}.kernel_per_leaf({example_model}, {example_init}, x)
  >>> sorted(k{example_layer}), k{example_layer}['{example_w}'].shape
  (['{example_b}', '{example_w}'], (4, 4))
  >>> float(k{example_layer}['{example_b}'][0, 0])  # the bias's kernel: 1 for every pair
  1.0

References:
  Novak, Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel",
  ICML 2022.
"""

_PLAN_DOC = """What :func:`kernel` with these arguments would do, without computing it.

Args:
  {model}, {params}, x1, x2, {keywords}, **options: as :func:`kernel`.

Returns:
  The ``Plan`` of :func:`ntk_core.plan` for {differentiated}:
  ``implementation`` (what ``"auto"`` chose), ``estimates`` (analytic FLOPs and feature
  bytes of each implementation considered) and ``leaves``, one per parameter leaf with
  its path (``"{leaf_path}"``), size P_l and method (e.g.
  ``"structured (1 matrix product)"`` or ``"jacobian (fallback: <reason>)"``).
  ``print(plan)`` shows a table. The estimates count N1·N2 pairs (N1 on the batch
  diagonal) of x1 with N1 samples and x2 with N2 (or ``None``).

Raises:
  As :func:`kernel_fn`.

Cost: one abstract trace of the model and the independence probe (two small forward
passes); no kernel is computed.

Example:
  {example_setup}
  >>> p = {pkg}.plan({example_model}, {example_init}, x)
  >>> for leaf in p.leaves:
  ...     print(leaf.path, leaf.size, leaf.method)
  {example_layer}['{example_b}'] 3 structured (bias fused with its matrix product)
  {example_layer}['{example_w}'] 6 structured (1 matrix product)

References:
  Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Novak,
  Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
"""

KERNEL_FN = Entry("kernel_fn", "ntk", Form.BUILD, _KERNEL_FN_DOC)
NNGP_FN = Entry("nngp_fn", "nngp", Form.BUILD, _NNGP_FN_DOC)
KERNEL = Entry("kernel", "ntk", Form.CALL, _KERNEL_DOC)
NNGP = Entry("nngp", "nngp", Form.CALL, _NNGP_DOC)
KERNEL_PER_LEAF_FN = Entry(
    "kernel_per_leaf_fn", "ntk_per_leaf", Form.BUILD, _KERNEL_PER_LEAF_FN_DOC
)
KERNEL_PER_LEAF = Entry("kernel_per_leaf", "ntk_per_leaf", Form.CALL, _KERNEL_PER_LEAF_DOC)
PLAN = Entry("plan", "ntk", Form.PLAN, _PLAN_DOC)
#: Every entry point :func:`entry_point` makes, in the order of the adapters' modules.
ENTRIES = (KERNEL_FN, NNGP_FN, KERNEL, NNGP, KERNEL_PER_LEAF_FN, KERNEL_PER_LEAF, PLAN)
#: The Monte Carlo kernels' two kernel functions (their entry point is the adapter's own).
MONTE_CARLO_NTK = Entry("monte_carlo_kernels", "ntk", Form.MONTE_CARLO)
MONTE_CARLO_NNGP = Entry("monte_carlo_kernels", "nngp", Form.MONTE_CARLO)


@dataclasses.dataclass(frozen=True)
class Keyword:
    """A keyword-only argument of an adapter's entry points (default ``None``).

    ``per_call``: given with each kernel call (Flax ``rngs``, Haiku ``state`` and
    ``rng``), else given when the kernel function is built (``method``,
    ``apply_kwargs``). ``doc`` is its one-paragraph description (Args);
    ``annotation`` the annotation ``inspect.signature`` shows, if any.
    """

    name: str
    doc: str
    per_call: bool = False
    annotation: str | None = None


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A framework's adapter, from which :func:`entry_point` makes its entry points.

    Attributes:
      package: the import package, e.g. ``"ntk_flax"``; entry points are named
        ``package.<entry>`` in messages.
      module: the module that holds the entry points (``help``, doctest).
      model: the name of the model argument (``"model"``, ``"transformed"``) and
        ``model_annotation`` its annotation, if any.
      params: the name of the parameters argument (``"variables"``, ``"params"``).
      keywords: the framework's keyword arguments, in the order of the one-call entry
        points' signatures.
      make: ``make(entry, model, options, **model keywords)`` -> the kernel function
        of ``model`` for ``entry`` (an :class:`Entry`, whose ``kind`` and ``form`` it
        may read for its messages), usually ``build_kernel(adapter.caller(entry),
        entry.kind, PureModel(...), options)``.
      words: the framework's own words for the docstring templates: ``a_model``,
        ``model_doc``, ``params_doc``, ``held_fixed``, ``differentiated``,
        ``per_leaf_tree``, ``leaf_path``, ``raises``, ``extra_cost``, and the example's
        ``example_setup`` (doctest lines making ``x`` and the model),
        ``example_model``, ``example_init``, ``example_layer``, ``example_w``,
        ``example_b`` and ``more_kernel_examples``.
    """

    package: str
    module: str
    model: str
    params: str
    keywords: tuple[Keyword, ...]
    make: Callable
    words: Mapping[str, str]
    model_annotation: str | None = None
    cache: BuildCache = dataclasses.field(default_factory=BuildCache, compare=False)

    def signature(self, entry: Entry) -> inspect.Signature:
        """The entry point's signature: ``(model, *, model keywords, **options) ->
        Callable`` for :attr:`Form.BUILD`, else ``(model, params, x1, x2=None, *,
        keywords, **options)``."""
        p = inspect.Parameter
        model = p(self.model, p.POSITIONAL_OR_KEYWORD, annotation=self.model_annotation or p.empty)
        built = entry.form is Form.BUILD
        keywords = [
            p(k.name, p.KEYWORD_ONLY, default=None, annotation=k.annotation or p.empty)
            for k in self.keywords
            if not (built and k.per_call)
        ]
        options = p("options", p.VAR_KEYWORD)
        if built:
            return inspect.Signature([model, *keywords, options], return_annotation="Callable")
        data = [
            p(self.params, p.POSITIONAL_OR_KEYWORD),
            p("x1", p.POSITIONAL_OR_KEYWORD),
            p("x2", p.POSITIONAL_OR_KEYWORD, default=None),
        ]
        return inspect.Signature([model, *data, *keywords, options])

    def caller(self, entry: Entry) -> Caller:
        """The :class:`~ntk_core._kernel.caller.Caller` of ``package.<entry.name>``, for its
        messages: its argument order from this adapter's argument names and the
        entry's form (``(variables, x1, x2)`` for the function a :attr:`Form.BUILD`
        entry point returns, ``(model, variables, x1, x2)`` for the others, the Monte
        Carlo kernels' ``(model, x1, x2)``)."""
        built = entry.form is Form.BUILD
        monte_carlo = entry.form is Form.MONTE_CARLO
        if monte_carlo:
            order = "(model, x1, x2)"
        elif built:
            order = f"({self.params}, x1, x2)"
        else:
            order = f"({self.model}, {self.params}, x1, x2)"
        return Caller(
            f"{self.package}.{entry.name}",
            order,
            model="the model",
            package=self.package,
            monte_carlo=monte_carlo,
            built=built,
        )

    def fields(self) -> dict[str, str]:
        """The template fields: the adapter's words and those made from its names."""
        model_keywords = [k for k in self.keywords if not k.per_call]
        call_keywords = [k for k in self.keywords if k.per_call]
        call = ", ".join(f"{k.name}=None" for k in call_keywords)
        return {
            **self.words,
            "pkg": self.package,
            "model": self.model,
            "params": self.params,
            "call": f"kernel({self.params}, x1, x2=None{', *, ' + call if call else ''})",
            "keywords": ", ".join(k.name for k in self.keywords),
            "model_keywords": ", ".join(k.name for k in model_keywords),
            "model_keyword_args": "\n".join(map(_argument, model_keywords)),
            "call_keyword_args": "\n".join(map(_argument, call_keywords)),
        }


def _argument(keyword: Keyword) -> str:
    """``name: description`` as an Args item, wrapped."""
    return textwrap.fill(
        f"{keyword.name}: {keyword.doc}",
        width=84,
        subsequent_indent="  ",
        break_long_words=False,
        break_on_hyphens=False,
    )


_FIELD = re.compile(r"\{(\w+)\}")


def fill(template: str, fields: Mapping[str, str]) -> str:
    """``template`` with each ``{name}`` replaced by ``fields[name]`` (a KeyError for a
    missing one): continuation lines of a multi-line value get the indentation of the
    line it stands on, and a line that held only an empty field is dropped."""

    def fill_line(line: str) -> str:
        indent = line[: len(line) - len(line.lstrip())]
        return _FIELD.sub(lambda m: fields[m.group(1)].replace("\n", "\n" + indent), line)

    lines = []
    for line in template.splitlines():
        filled = fill_line(line)
        if filled.strip() or not line.strip():
            lines.extend(row.rstrip() for row in filled.split("\n"))
    return "\n".join(lines) + "\n"


def entry_point(adapter: Adapter, entry: Entry) -> Callable:
    """The public function ``adapter.package.<entry.name>``: its signature from
    :meth:`Adapter.signature`, its docstring from ``entry.doc`` filled with
    :meth:`Adapter.fields`, Python's binding errors named as in the core
    (``_checked_arguments``).

    :attr:`Form.BUILD` returns ``adapter.make(...)``; :attr:`Form.CALL` and
    :attr:`Form.PLAN` build the kernel function once per model, model keywords and
    options (cached) and call it (or its ``plan``) on ``(params, x1, x2, **call
    keywords)``.
    """
    if entry.form is Form.MONTE_CARLO:  # its signature is the adapter's own
        raise ValueError(f"entry_point: {entry.name} has no generated entry point")
    signature = adapter.signature(entry)
    name = adapter.caller(entry).name
    model_keywords = [k.name for k in adapter.keywords if not k.per_call]
    call_keywords = [k.name for k in adapter.keywords if k.per_call]

    def public(*args, **kwargs):
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        arguments = given.arguments
        model, options = arguments[adapter.model], arguments["options"]
        built = {k: arguments[k] for k in model_keywords}
        if entry.form is Form.BUILD:
            return adapter.make(entry, model, options, **built)
        key = (entry.name, model, freeze(built), freeze(options))
        fn = adapter.cache.get(key, lambda: adapter.make(entry, model, options, **built))
        call = fn.plan if entry.form is Form.PLAN else fn
        per_call = {k: arguments[k] for k in call_keywords}
        return call(arguments[adapter.params], arguments["x1"], arguments["x2"], **per_call)

    public.__signature__ = signature
    public.__name__ = public.__qualname__ = entry.name
    public.__module__ = adapter.module
    public.__doc__ = fill(entry.doc, adapter.fields())
    return _checked_arguments(public, name)
