"""What the ``variables`` of the ``flax.linen`` entry points may be: ``model.init``'s dict
(used as it is), a bare params dict holding every parameter path ``model.init`` makes
(abstractly, on one sample of x1), or a train state (``.params`` and ``.apply_fn``; other
collections from its attributes). See docs/errors.md#flax-variables.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping

import flax.core
import flax.errors
import jax
import numpy as np

from ntk_core.adapters import Caller, bad

PARAMS = "params"  # the collection the kernels differentiate; the others are held fixed


def _paths(tree) -> frozenset[str]:
    leaves = jax.tree_util.tree_leaves_with_path(flax.core.meta.unbox(tree))
    return frozenset(jax.tree_util.keystr(path) for path, _ in leaves)


def _keys(mapping: Mapping) -> list:
    try:
        return sorted(mapping)
    except TypeError:  # keys of mixed types
        return list(mapping)


def shown(items: list, limit: int = 3) -> str:
    """The first ``limit`` of ``items``, and how many more."""
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def names(mapping: Mapping) -> str:
    """``mapping``'s keys as a list, the first four shown."""
    return "[" + shown([repr(k) for k in _keys(mapping)], 4) + "]"


def _another_model(given, made) -> bool:
    """Whether the params ``given`` look like another model's: top-level names (layers) of
    this model's ``made`` variables missing, and none of its other collections there (a
    variables dict without params is not another model's)."""
    ours = made.get(PARAMS) if isinstance(made, Mapping) else None
    if not isinstance(given, Mapping) or not isinstance(ours, Mapping) or not ours:
        return False
    return not set(ours) <= set(given) and not set(given) & (set(made) - {PARAMS})


def _one_sample(x1):

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


def _cache_key(make: Callable):
    """``make()`` if it runs and is hashable, else ``None`` (not cached)."""
    try:
        key = make()
        hash(key)
    except Exception:
        return None
    return key


#: ``TrainState`` fields no collection is called: with ``params``, a train state as a dict.
_TRAIN_STATE_FIELDS = frozenset({"step", "opt_state", "tx", "apply_fn"})


class VariablesReader:
    """``read(variables, x1, rngs) -> variables dict``; ``init(rngs)`` and ``apply(rngs)``
    give ``model.init`` / ``model.apply`` (run under ``jax.eval_shape``), cached per
    per-sample signature of x1, rng streams and structure of the input."""

    def __init__(self, caller: Caller, init: Callable, apply: Callable):
        self._fn_name, self._order = caller.name, caller.order
        self._init, self._apply = init, apply
        self._made: dict = {}  # (x1 per-sample signature, rngs structure) -> abstract variables
        self._bare_ok: set = set()  # (that, input structure) of bare params dicts read
        self._reads: dict = {}  # (that, collections held) -> collections read but lacking

    def _made_for(self, x1, rngs):
        """The abstract variables ``model.init`` makes for x1, or ``None`` if it fails."""
        try:
            signature = (_sample_signature(x1), jax.tree.structure(rngs))
        except Exception:  # x1 of no tree structure at all: the engine says what is wrong
            return None, None
        key = _cache_key(lambda: signature)
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

    def __call__(self, variables, x1, rngs=None) -> dict:
        fn = self._fn_name
        state = None
        if isinstance(variables, Mapping):
            given = variables
        elif hasattr(variables, "params") and hasattr(variables, "apply_fn"):
            state, given = variables, variables.params
            if not isinstance(given, Mapping):
                what = (
                    f"variables is a {type(state).__name__} whose .params is {type(given).__name__}"
                )
                raise bad(TypeError, fn, what + ", not a dict", "create it with a params dict")
        else:
            hint = " (it has .params but no .apply_fn)" if hasattr(variables, "params") else ""
            what = "variables must be the dict returned by model.init(...), its ['params'] or a "
            what += f"train state, got {type(variables).__name__}{hint}"
            raise bad(TypeError, fn, what, f"pass one; the argument order is {self._order}")
        if state is None and PARAMS in given and _TRAIN_STATE_FIELDS & set(given):
            # a train state as a dict (e.g. restored by orbax without a target): read it as
            # the train state it was, its params and the collections it carries
            state, given = types.SimpleNamespace(**given), given[PARAMS]
        if state is None and PARAMS in given:
            return dict(given)  # a variables dict: a collection it lacks is named by the check
        made, made_key = self._made_for(x1, rngs)
        if PARAMS in given:
            read = dict(given)
        else:
            self._check_bare(given, made, made_key, state)
            read = {PARAMS: given}
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

    def _check_bare(self, given: Mapping, made, made_key, state=None) -> None:
        """Refuses a bare params dict (``state``'s, where one was given) lacking a parameter
        path ``model.init`` makes."""
        key = (
            None if made_key is None else _cache_key(lambda: (made_key, jax.tree.structure(given)))
        )
        if made is None or key in self._bare_ok:  # key None is never added
            return
        want = _paths(made.get(PARAMS, {}))
        if not (want and want <= _paths(given)):
            raise self._foreign(given, want, made, state)
        if key is not None:
            self._bare_ok.add(key)

    def misread(self, variables: Mapping, x1, rngs, error: Exception) -> ValueError | None:
        """The error of variables the model failed on (``error``) that are this model's bare
        params dict, whose top-level layer is named ``params``, or another model's variables
        dict; None for any other failure."""
        made, _ = self._made_for(x1, rngs)
        if made is None:
            return None
        want = _paths(made.get(PARAMS, {}))
        inner = variables.get(PARAMS)
        failed = f" (the model failed with {type(error).__name__})"
        ours = want and want <= _paths(variables)  # this model's bare params, read as variables
        if ours and not (isinstance(inner, Mapping) and want <= _paths(inner)):
            what = "variables is this model's bare params dict, whose top-level layer is named "
            return self._refused(what + f"'params'{failed}", "rename that layer")
        if _another_model(inner, made):  # a variables dict of another model
            return self._refused(*_another("variables['params'] looks", inner, made, failed))
        return None  # this model's variables dict: another failure

    def _foreign(self, given: Mapping, want: frozenset, made, state) -> ValueError:
        """The error of a bare params dict (``state``'s .params, where not None) that is not
        this model's: another model's, one lacking parameters, or a model without any."""
        if not want:
            what = f"the model has no parameters (model.init makes none; variables: {_keys(given)})"
            fix = "give the model a layer with parameters: the NTK differentiates by them"
            return self._refused(what, fix)
        # a dict restored as a train state (orbax without a target) is read as a namespace
        as_dict = isinstance(state, types.SimpleNamespace)
        held = "a train state dict" if as_dict else f"a {type(state).__name__}"
        if _another_model(given, made):
            subject = (
                "variables looks" if state is None else f"variables is {held} whose .params look"
            )
            return self._refused(*_another(subject, given, made))
        lacking = sorted(want - _paths(given))
        n = f"{len(lacking)} of the {len(want)} parameters model.init makes ({shown(lacking)})"
        what = f"variables has no 'params' collection (keys {_keys(given)}) and lacks {n}"
        if state is not None:
            what = f"variables is {held} whose .params lack {n}"
        return self._refused(what, f"pass {_OURS}")

    def _refuse_lacking(self, read, x1, rngs, lacking, made_key, state) -> None:
        """Raises if the model reads a collection in ``lacking`` (abstract apply without them)."""
        key = _cache_key(lambda: (made_key, tuple(_keys(read))))
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
        what = f"variables is {what} without the collection(s) {lacking}, which the model reads"
        raise self._refused(what, f"pass {entries(lacking)} or a TrainState that carries them")

    def _refused(self, what: str, fix: str) -> ValueError:
        """The ValueError of variables this model cannot read (docs/errors.md#flax-variables)."""
        return bad(ValueError, self._fn_name, what, fix, see="flax-variables")


_OURS = "this model's model.init(key, x), its ['params'] or its TrainState"


def _another(subject: str, given: Mapping, made: Mapping, note: str = "") -> tuple[str, str]:
    """``(what, fix)`` of params that look like another model's (:func:`_another_model`)."""
    what = f"{subject} like the parameters of another model: top-level names {names(given)}, "
    what += f"where model.init makes {names(made[PARAMS])} for this one{note}"
    return what, f"pass the model they belong to, or {_OURS}"


def entries(collections: list) -> str:  # {'params': ..., 'batch_stats': ...}
    return "{" + ", ".join(f"{c!r}: ..." for c in [PARAMS, *collections]) + "}"
