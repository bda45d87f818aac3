"""What the ``variables`` argument of the ``flax.linen`` entry points may be.

(a) the dict ``model.init`` returns (a mapping with a ``"params"`` key), used as it is;
(b) a bare params dict (``variables["params"]``, ``state.params``): a mapping holding
    every parameter path ``model.init`` makes (``jax.eval_shape`` on one abstract
    sample of x1, once per per-sample signature), used as ``{"params": params}``;
(c) a train state (``.params`` and ``.apply_fn``, e.g. ``TrainState``): its params as
    in (a) or (b), plus each other collection ``model.init`` makes from the attribute of
    that name (``state.batch_stats``). Nothing else is read.

A model that cannot be initialised abstractly on x1 gets the mapping as params, and its
own error on x1 is reported. See docs/errors.md#flax-variables.
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
                message = (
                    f"{fn}: variables is a {type(state).__name__} whose .params is "
                    f"{type(given).__name__}, not a dict. Fix: create the train state with "
                    f"params=variables['params']."
                )
                raise TypeError(message)
        else:
            hint = " (it has .params but no .apply_fn)" if hasattr(variables, "params") else ""
            message = (
                f"{fn}: variables must be the dict returned by model.init(...), its ['params'] "
                f"or a train state, got {type(variables).__name__}{hint}. Fix: pass one of "
                f"those; the argument order is {self._order}."
            )
            raise TypeError(message)
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
            self._refuse_lacking(read, x1, rngs, lacking, made_key, state)
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
        return ValueError(
            f"{self._fn_name}: variables is this model's bare params dict, whose top-level "
            f"layer is named 'params' (the model failed with {type(error).__name__}). Fix: "
            f"rename that layer (e.g. name='dense_in'). See docs/errors.md#flax-variables."
        )

    def _foreign(self, given: Mapping, want: frozenset) -> ValueError:
        lacking = sorted(want - _paths(given))
        return ValueError(
            f"{self._fn_name}: variables has no 'params' collection (keys {_keys(given)}) and "
            f"lacks {len(lacking)} of the {len(want)} parameters model.init makes "
            f"({_shown(lacking) or 'none: init makes no parameters'}). Fix: pass this model's "
            f"model.init(key, x), its ['params'] entry or its TrainState."
        )

    def _refuse_lacking(self, read, x1, rngs, lacking, made_key, state) -> None:
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
        what = "a bare params dict" if state is None else f"a {type(state).__name__}"
        entries = ", ".join(f"{c!r}: ..." for c in lacking)
        message = (
            f"{self._fn_name}: variables is {what} without the collection(s) {lacking}, which "
            f"the model reads. Fix: pass {{'params': ..., {entries}}} or a TrainState that "
            f"carries them. See docs/errors.md#flax-variables."
        )
        raise ValueError(message)
