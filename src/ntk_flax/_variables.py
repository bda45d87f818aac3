"""What the ``variables`` argument of the ``flax.linen`` entry points may be.

``ntk_flax.kernel(model, variables, x1)`` and the other linen entry points take what a
Flax training loop holds:

(a) the variables dict returned by ``model.init`` (``{"params": ..., "batch_stats":
    ...}``), used as it is;
(b) a bare params dict, the ``params`` collection alone (``variables["params"]``,
    ``state.params``), used as ``{"params": params}``;
(c) a train state: an object with ``.params`` and ``.apply_fn``, such as
    ``flax.training.train_state.TrainState`` or a subclass of it. ``state.params`` is
    read as in (a) or (b), and for each other collection that ``model.init`` makes
    (e.g. ``batch_stats``) and ``state.params`` lacks, the attribute of that name
    (``state.batch_stats``) if the state has one and it is not ``None``. Nothing else is
    read: not ``step``, ``tx``, ``opt_state``, nor ``apply_fn`` (the kernel applies
    ``model``).

A mapping with a ``"params"`` key is a variables dict and is used as it is, with no
extra work (every training step's call). Any other mapping is a bare params dict when it
holds every parameter path that ``model.init`` makes, found with
``jax.eval_shape(model.init, x)`` on one abstract sample of x1 (one abstract trace per
per-sample signature, nothing computed), and is refused otherwise (parameters of another
model). A train state needs the same abstract init, for the names of the collections it
may carry. A bare params dict whose top-level layer is itself named ``params`` looks
like a variables dict; the model then fails, and :meth:`VariablesReader.misread` turns
that failure into a refusal that says so (Flax's ``model.apply`` refuses such a model's
variables dict too, so the fix is to rename the layer). When the
model cannot be initialised abstractly on x1, a bare mapping is used as params and the
model's own error on x1 is reported.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping

import flax.core
import flax.errors
import jax
import numpy as np

from ntk_core.adapters import Caller


def _paths(tree) -> frozenset[str]:
    """The parameter paths of ``tree`` (``"['Dense_0']['kernel']"``), boxes removed."""
    leaves = jax.tree_util.tree_leaves_with_path(flax.core.meta.unbox(tree))
    return frozenset(jax.tree_util.keystr(path) for path, _ in leaves)


def _keys(mapping: Mapping) -> list:
    try:
        return sorted(mapping)
    except TypeError:  # keys of mixed types
        return list(mapping)


def _shown(paths, limit: int = 3) -> str:
    paths = sorted(paths)
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more


def _one_sample(x1):
    """An abstract sample of x1 (batch axis of size 1), for ``jax.eval_shape``."""

    def one(leaf):
        shape = tuple(np.shape(leaf))
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
        dtype = jax.dtypes.canonicalize_dtype(dtype)  # as JAX would run it (x64 off)
        return jax.ShapeDtypeStruct((1, *shape[1:]) if shape else shape, dtype)

    return jax.tree.map(one, x1)


def _sample_signature(x1):
    leaves, treedef = jax.tree.flatten(x1)
    shapes = tuple((tuple(np.shape(v))[1:], str(getattr(v, "dtype", type(v)))) for v in leaves)
    return treedef, shapes


def _hashable(key):
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _collections_phrase(missing: list[str]) -> tuple[str, str, str]:
    """(``"collection 'batch_stats' (BatchNorm's running statistics)"``, the names, the
    ``'batch_stats': ...`` entries) for messages."""
    names = ", ".join(map(repr, missing))
    plural = "s" if len(missing) > 1 else ""
    what = " (BatchNorm's running statistics)" if missing == ["batch_stats"] else ""
    entries = ", ".join(f"{c!r}: ..." for c in missing)
    return f"collection{plural} {names}{what}", names, entries


#: Fields of ``flax.training.train_state.TrainState`` that no Flax collection is called: a
#: dict holding ``params`` and one of these is a train state saved as a dict.
_TRAIN_STATE_FIELDS = frozenset({"step", "opt_state", "tx", "apply_fn"})


class VariablesReader:
    """``read(variables, x1, rngs) -> variables dict`` for one linen kernel function.

    ``init(rngs)`` returns ``x -> model.init(...)`` and ``apply(rngs)`` returns
    ``(variables, x) -> model.apply(...)`` with the call's method and model arguments;
    both run only under ``jax.eval_shape``. Results are cached per per-sample signature
    of x1, rng stream names and structure of the input, so a training loop's later
    calls cost a few tree flattenings.
    """

    def __init__(self, caller: Caller, init: Callable, apply: Callable):
        self._fn_name, self._order = caller.name, caller.order
        self._init = init
        self._apply = apply
        self._made: dict = {}  # (x1 per-sample signature, rngs structure) -> abstract variables
        self._forms: dict = {}  # (that, input structure) -> "variables" | "params"
        self._reads: dict = {}  # (that, collections held) -> collections read but lacking

    # -- what the model makes ------------------------------------------------------------
    def _made_for(self, x1, rngs):
        """The abstract variables ``model.init`` makes for x1, or ``None`` if it fails."""
        try:
            key = _hashable((_sample_signature(x1), jax.tree.structure(rngs)))
        except Exception:  # x1 of no tree structure at all: the engine says what is wrong
            return None, None
        if key is not None and key in self._made:
            return self._made[key], key
        made = None
        try:
            candidates = (_one_sample(x1), x1)
        except Exception:
            candidates = ()
        for x in candidates:  # one sample; the whole x1 for a model that needs its N
            try:
                made = flax.core.meta.unbox(jax.eval_shape(self._init(rngs), x))
                break
            except Exception:  # not initialisable on x: the model's failure comes later
                continue
        if key is not None:
            self._made[key] = made
        return made, key

    # -- reading -------------------------------------------------------------------------
    def __call__(self, variables, x1, rngs=None) -> dict:
        fn = self._fn_name
        state = None
        if isinstance(variables, Mapping):
            given = variables
        elif hasattr(variables, "params") and hasattr(variables, "apply_fn"):
            state, given = variables, variables.params
            if not isinstance(given, Mapping):
                raise TypeError(
                    f"{fn}: variables is a {type(state).__name__} (a train state) whose "
                    f".params is {type(given).__name__}, not a dict of parameters. Fix: pass "
                    f"a train state whose params are the model's 'params' collection "
                    f"(TrainState.create(apply_fn=model.apply, params=variables['params'], "
                    f"tx=tx)), or the variables dict returned by model.init(key, x)."
                )
        else:
            has_params = hasattr(variables, "params")
            hint = (
                f" ({type(variables).__name__} has .params but no .apply_fn, so it is not "
                f"read as a train state: pass variables.params)"
                if has_params
                else ""
            )
            raise TypeError(
                f"{fn}: variables must be the dict returned by model.init(...), got "
                f"{type(variables).__name__}; also accepted: its 'params' entry (a bare "
                f"params dict, e.g. state.params) or a train state (an object with .params "
                f"and .apply_fn, e.g. flax.training.train_state.TrainState){hint}. Fix: pass "
                f"model.init(key, x), its ['params'] entry, or the TrainState; the argument "
                f"order is {self._order}."
            )
        if state is None and "params" in given and _TRAIN_STATE_FIELDS & set(given):
            # a train state as a dict (e.g. restored by orbax without a target): read it as
            # the train state it was, its params and the collections it carries
            state, given = types.SimpleNamespace(**given), given["params"]
        if state is None and "params" in given:
            return dict(given)  # a variables dict: a collection it lacks is named by the check
        made, made_key = self._made_for(x1, rngs)
        form = "variables" if "params" in given else self._bare(given, made, made_key)
        read = dict(given) if form == "variables" else {"params": given}
        if made is None:  # not initialisable on x1: the model's check names the failure
            return read
        if state is not None:
            for c in made:
                if c not in read and getattr(state, c, None) is not None:
                    read[c] = getattr(state, c)
        lacking = [c for c in made if c not in read]
        if lacking:
            self._refuse_lacking(read, x1, rngs, lacking, made, made_key, state)
        return read

    def _bare(self, given: Mapping, made, made_key) -> str:
        """``"params"`` for a mapping without a ``"params"`` key that holds every parameter
        path ``model.init`` makes (or when the model cannot be initialised abstractly);
        a ValueError otherwise."""
        key = None
        if made_key is not None:
            try:
                key = _hashable((made_key, jax.tree.structure(given)))
            except Exception:
                key = None
        if made is None or (key is not None and key in self._forms):
            return "params"
        want = _paths(made.get("params", {}))
        if not (want and want <= _paths(given)):
            raise self._foreign(given, want)
        if key is not None:
            self._forms[key] = "params"
        return "params"

    def misread(self, variables: Mapping, x1, rngs, error: Exception) -> ValueError | None:
        """For a model that failed with ``variables`` (which has a ``"params"`` key): the
        ValueError for a bare params dict whose top-level layer is named ``params``, read
        as a variables dict; ``None`` if it is not one. Error path only."""
        made, _ = self._made_for(x1, rngs)
        if made is None:
            return None
        want = _paths(made.get("params", {}))
        inner = variables.get("params")
        if not want or not want <= _paths(variables):
            return None
        if isinstance(inner, Mapping) and want <= _paths(inner):
            return None  # a variables dict after all: another failure
        fn = self._fn_name
        reason = " ".join(str(error).split()).rstrip(".")
        return ValueError(
            f"{fn}: variables has a top-level 'params' key, so it was read as a variables "
            f"dict whose 'params' collection is variables['params'], but the model failed "
            f"with it ({type(error).__name__}: {reason}); it is this model's bare params "
            f"dict instead, whose top-level layer is named 'params' (it holds every "
            f"parameter model.init makes: {_shown(want)}). Flax's model.apply refuses the "
            f"variables of such a model ({{'params': {{'params': ...}}}} raises "
            f"ApplyScopeInvalidVariablesStructureError), so it cannot be applied as it is. "
            f"Fix: rename that layer (e.g. nn.Dense(..., name='dense_in')) and initialise "
            f"the model again."
        )

    def _foreign(self, given: Mapping, want: frozenset) -> ValueError:
        fn = self._fn_name
        keys = _keys(given)
        if not want:
            return ValueError(
                f"{fn}: variables has no 'params' collection (its keys: {keys}), and the "
                f"model's init makes no parameters to compare it with. Fix: pass the whole "
                f"variables dict returned by model.init(key, x), or wrap a bare parameter "
                f"dict as {{'params': params}}."
            )
        have = _paths(given)
        lacking = want - have
        return ValueError(
            f"{fn}: variables has no 'params' collection (its keys: {keys}) and is not this "
            f"model's params dict either: model.init(key, x1) makes {len(want)} parameter(s), "
            f"{len(lacking)} of which it lacks ({_shown(lacking)}); it holds "
            f"{_shown(have) or 'no arrays'}. Fix: pass this model's parameters: the variables "
            f"dict returned by model.init(key, x), its ['params'] entry (state.params), or "
            f"the TrainState; parameters of another model, or of this one with other layer "
            f"names, do not fit."
        )

    def _refuse_lacking(self, read, x1, rngs, lacking, made, made_key, state) -> None:
        """Raises if the model reads one of the collections ``lacking`` (an abstract apply
        without them fails with Flax's ``ScopeCollectionNotFound``); a collection that
        ``model.init`` makes but the model does not read in this mode is not needed."""
        key = _hashable((made_key, tuple(_keys(read))))
        if key is not None and key in self._reads:
            reads = self._reads[key]
        else:
            reads = False
            try:
                jax.eval_shape(self._apply(rngs), read, _one_sample(x1))
            except flax.errors.ScopeCollectionNotFound:
                reads = True
            except Exception:  # another failure: the model's check names it
                pass
            if key is not None:
                self._reads[key] = reads
        if not reads:
            return
        fn = self._fn_name
        phrase, names, entries = _collections_phrase(lacking)
        held = _keys(made)
        if state is None:
            raise ValueError(
                f"{fn}: variables is a bare params dict (the 'params' collection alone, as "
                f"variables['params'] or state.params hold it), but the model also reads the "
                f"{phrase}, which it lacks; model.init makes {held}. Fix: pass the whole "
                f"variables dict ({{'params': params, {entries}}}, e.g. from model.init(key, "
                f"x) and the training loop's updates), or the TrainState itself if it carries "
                f"them (a TrainState subclass with a field for each); the kernel holds "
                f"{names} fixed."
            )
        attrs = ", ".join(f".{c}" for c in lacking)
        fields = "; ".join(f"{c}: Any = None" for c in lacking)
        example = ", ".join(f"{c}=variables[{c!r}]" for c in lacking)
        raise ValueError(
            f"{fn}: variables is a {type(state).__name__} (a train state: its .params are "
            f"read), but the model also reads the {phrase}, which the state does not carry "
            f"(no attribute {attrs}, or None); model.init makes {held}. Fix: keep it in the "
            f"train state, e.g. class TrainState(train_state.TrainState): {fields}, created "
            f"with {example} and updated by the training step, or pass "
            f"{{'params': state.params, {entries}}}; the kernel holds {names} fixed."
        )
