"""Empirical NTK / NNGP of Haiku models (``hk.Transformed``, ``hk.TransformedWithState``).

The adapter turns a transformed function into a pure ``apply3(params, x, aux)`` with
``aux = (state, rng)`` held fixed (the state the model returns is discarded), then
hands it to ``ntk_core``. The entry points and their docstrings are made by
``ntk_core._kernel.adapter.entry_point`` from :data:`ADAPTER`, this framework's words.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping

import haiku as hk
import jax

from ntk_core._kernel import adapter as _adapter
from ntk_core._kernel.adapter import (
    Adapter,
    Entry,
    Keyword,
    PureModel,
    build_kernel,
    check_apply_kwargs,
    entry_point,
    input_shape_mismatch,
)
from ntk_core._kernel.checks import adapter_model_failure


def _model_apply(transformed, apply_kwargs):
    with_state = isinstance(transformed, hk.TransformedWithState)
    takes_rng = "rng" in inspect.signature(transformed.apply).parameters

    def apply3(params, x, aux):
        state, rng = aux
        args = [params]
        if with_state:
            args.append(state)
        if takes_rng:
            args.append(rng)
        out = transformed.apply(*args, x, **apply_kwargs)
        return out[0] if with_state else out

    return apply3, with_state, takes_rng


_FLAX_COLLECTIONS = {"params", "batch_stats", "cache", "intermediates", "constants"}
_FLAX_LEAF_NAMES = {"kernel", "embedding"}  # Haiku's are w and embeddings


def _leaf_names(tree) -> set[str]:
    return {
        str(getattr(path[-1], "key", path[-1]))
        for path, _ in jax.tree_util.tree_leaves_with_path(tree)
        if path
    }


# Haiku raises a plain ValueError, with no attribute naming the entry, when apply asks
# for a parameter or a state entry it was not given. Comparing params and state with
# the trees of an abstract transformed.init does not replace reading the message: init
# often runs only with other model arguments (BatchNorm initialises in training mode
# only, while the kernel applies it in evaluation mode), and the message names the
# first entry the model asks for, an order no tree records. So the two wordings are
# read here, one function each, tested against Haiku (tests/haiku/test_wording.py).


def _haiku_wording(error: BaseException, pattern: str) -> tuple[str, str] | None:
    if not isinstance(error, ValueError):  # Haiku raises both as a ValueError
        return None
    m = re.search(pattern, str(error))
    return None if m is None else (m.group(1), m.group(2))


def haiku_missing_parameter(error: BaseException) -> tuple[str, str] | None:
    """``(name, module)`` of the parameter Haiku's ``get_parameter`` could not find in
    the params given to apply, from its ValueError ``"Unable to retrieve parameter 'w'
    for module 'linear' All parameters must be created as part of `init`."`` (dm-haiku
    0.0.17, ``haiku/_src/base.py``), else ``None``."""
    return _haiku_wording(error, r"Unable to retrieve parameter '([^']+)' for module '([^']+)'")


def haiku_missing_state(error: BaseException) -> tuple[str, str] | None:
    """``(name, module)`` of the state entry Haiku's ``get_state`` could not find in the
    state given to apply (an entry without an init function), from its ValueError
    ``"No value for 'average' in 'batch_norm/~/mean_ema', perhaps set an init
    function?"`` (dm-haiku 0.0.17, ``haiku/_src/base.py``), else ``None``."""
    return _haiku_wording(error, r"No value for '([^']+)' in '([^']+)'")


def _foreign_params(fn_name, params, state, error) -> ValueError | None:
    """The ValueError for params or state that are not this transform's (Haiku cannot
    find a parameter or state entry the model asks for), naming what they hold;
    ``None`` for other errors. Flax variables get the ntk_flax fix."""
    wanted = haiku_missing_parameter(error)
    if wanted is None:
        wanted_state = haiku_missing_state(error)
        if wanted_state is None or not isinstance(state, Mapping):
            return None
        name, module = wanted_state
        held = sorted(map(str, state))
        return ValueError(
            f"{fn_name}: the model asks for state {name!r} of module {module!r}, which "
            f"state does not hold (its modules: {_shown(held)}). Fix: pass the state "
            f"returned together with these params, params, state = transformed.init(key, "
            f"x) (state of another model, or an empty one, does not fit)."
        )
    if not isinstance(params, Mapping):
        return None
    name, module = wanted
    held = sorted(map(str, params))
    subject = f"params does not hold (its modules: {_shown(held)})"
    in_state = isinstance(state, Mapping) and isinstance(state.get(module), Mapping)
    if (in_state and name in state[module]) or (params is state and state is not None):
        fix = (
            "state holds it, so params and state look swapped (or state was passed as "
            "params): pass params, state = transformed.init(key, x) as (transformed, params, "
            "x, state=state)"
        )
    elif module in params and isinstance(params[module], Mapping):
        inside = sorted(map(str, params[module]))
        subject = f"params does not hold (module {module!r} holds only {inside})"
        fix = (
            "pass the params returned by transformed.init(key, x) unchanged; a parameter "
            "of this module was removed or renamed"
        )
    elif "params" in params and set(map(str, params)) <= _FLAX_COLLECTIONS:
        fix = (
            "params looks like a Flax variables dict ({'params': ...}): use "
            "ntk_flax.kernel(model, variables, x) for a Flax model, or pass the params "
            "returned by transformed.init(key, x) for this Haiku model"
        )
    elif not all(isinstance(v, Mapping) for v in params.values()):
        fix = (
            "Haiku params map module names to dicts of arrays ({'linear': {'w': ..., "
            "'b': ...}}), and these map names straight to arrays (Flax's "
            "variables['params'] of a single layer?): pass the params returned by "
            "transformed.init(key, x), or use ntk_flax.kernel for a Flax model"
        )
    elif _leaf_names(params) & _FLAX_LEAF_NAMES and not _leaf_names(params) & {"w", "b"}:
        fix = (
            f"params look like Flax parameters (leaves named "
            f"{sorted(_leaf_names(params) & _FLAX_LEAF_NAMES)}; Haiku names them w, b, "
            f"...): use ntk_flax.kernel(model, variables, x) for a Flax model, or pass the "
            f"params returned by transformed.init(key, x) for this Haiku model"
        )
    else:
        fix = (
            "pass the params returned by this transform's init, params = "
            "transformed.init(key, x) (params of another model, or of this model under "
            "another hk.transform with different module names, do not fit)"
        )
    return ValueError(
        f"{fn_name}: the model asks for parameter {name!r} of module {module!r}, which "
        f"{subject}. Fix: {fix}."
    )


def _shown(names: list[str]) -> list[str]:
    return names if len(names) <= 6 else names[:6] + [f"... ({len(names)} in all)"]


def _make(entry: Entry, transformed, options: dict, *, apply_kwargs=None):
    """The kernel function of ``transformed`` for ``entry`` (``make`` of
    :data:`ADAPTER`)."""
    caller = ADAPTER.caller(entry)
    fn_name = caller.name
    if not isinstance(transformed, (hk.Transformed, hk.TransformedWithState)):
        raise TypeError(
            f"{fn_name}: expected an hk.Transformed or hk.TransformedWithState (the result of "
            f"hk.transform / hk.transform_with_state), got {type(transformed).__name__}. "
            f"Fix: wrap your forward function with hk.transform(f)."
        )
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, "{'is_training': False}")
    apply3, with_state, takes_rng = _model_apply(transformed, apply_kwargs)

    def init_params(x):
        out = transformed.init(jax.random.PRNGKey(0), x, **apply_kwargs)
        return out[0] if with_state else out

    def failure(params, x1, aux) -> Exception | None:
        """The model's error on x1 (one abstract trace), ``None`` if it runs."""
        try:
            jax.eval_shape(lambda p, x, a: apply3(p, x, a), params, x1, aux)
        except Exception as e:
            return e
        return None

    def check(params, x1, x2, aux):
        error = failure(params, x1, aux)
        if error is None:
            return
        state, rng = aux
        if takes_rng and rng is None:  # does it fail for want of a key? run it with one
            error = failure(params, x1, (state, jax.random.PRNGKey(0)))
            if error is None:
                raise ValueError(
                    f"{fn_name}: the model needs a random key (e.g. dropout) but rng=None. "
                    f"Fix: pass rng=jax.random.PRNGKey(0) (the same key for every sample), "
                    f"or make the model deterministic."
                ) from None
        if isinstance(error, ValueError):
            raise (
                _foreign_params(fn_name, params, state, error)
                or input_shape_mismatch(
                    fn_name,
                    "params",
                    params,
                    init_params,
                    x1,
                    "params = transformed.init(key, x1)",
                )
                or adapter_model_failure(caller, "params", error)
            ) from error
        raise _foreign_params(fn_name, params, state, error) or adapter_model_failure(
            caller, "params", error
        ) from error

    def to_core(params, state=None, rng=None):
        """``(params, (state, rng))`` for the core, after checking them against the
        transform."""
        call = "params=params, state=state"
        check_state_and_rng(fn_name, with_state, takes_rng, state, rng, call)
        if not isinstance(params, Mapping):
            raise TypeError(
                f"{fn_name}: params must be the dict returned by transformed.init, got "
                f"{type(params).__name__}. Fix: pass params = transformed.init(key, x); the "
                f"argument order is (transformed, params, x1, x2)."
            )

        def is_integer(leaf) -> bool:
            return hasattr(leaf, "dtype") and jax.numpy.issubdtype(leaf.dtype, jax.numpy.integer)

        if any(map(is_integer, jax.tree.leaves(params))):  # paths only for the message
            integer = [
                jax.tree_util.keystr(path)
                for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                if is_integer(leaf)
            ]
            raise TypeError(
                f"{fn_name}: params holds integer arrays ({', '.join(integer[:3])}), as Haiku "
                f"state does (e.g. a BatchNorm or EMA counter), and params are differentiated. "
                f"Fix: pass both values of params, state = transformed.init(key, x) in their "
                f"places: (transformed, params, x, state=state)."
            )
        return params, (state, rng)

    pure = PureModel(
        apply3,
        to_core,
        call_keywords=("state", "rng"),
        check=check,
        eval_hint="apply_kwargs={'is_training': False}",
    )
    return build_kernel(caller, entry.kind, pure, options)


def check_state_and_rng(fn_name, with_state, takes_rng, state, rng, call) -> None:
    """Refuses a ``state`` / ``rng`` the transform does not take, or a missing state;
    ``call`` shows how the caller passes params and state in the fix."""
    if with_state and state is None:
        raise ValueError(
            f"{fn_name}: this hk.TransformedWithState needs its state. Fix: pass "
            f"state=state, the second value returned by transformed.init(key, x)."
        )
    if with_state and not isinstance(state, Mapping):
        raise TypeError(
            f"{fn_name}: state must be the mapping returned by transformed.init(key, x) "
            f"(its second value), got {type(state).__name__}. Fix: pass params, state = "
            f"transformed.init(key, x) as {call}."
        )
    if not with_state and state is not None:
        raise ValueError(
            f"{fn_name}: state was given but the model is a plain hk.Transformed without "
            f"state. Fix: drop state=, or use hk.transform_with_state."
        )
    if rng is not None and not takes_rng:
        raise ValueError(
            f"{fn_name}: rng was given but the model was built with hk.without_apply_rng "
            f"and takes none. Fix: drop rng=."
        )


#: Haiku's words for the entry points (see ``ntk_core._kernel.adapter.Adapter``).
ADAPTER = Adapter(
    package="ntk_haiku",
    module=__name__,
    model="transformed",
    params="params",
    keywords=(
        Keyword(
            "state",
            "the state of an ``hk.TransformedWithState`` (required there).",
            per_call=True,
        ),
        Keyword(
            "rng", "a PRNG key for models that need one, the same for every sample.", per_call=True
        ),
        Keyword(
            "apply_kwargs",
            'extra keyword arguments of the forward function, e.g. ``{"is_training": False}``.',
        ),
    ),
    make=_make,
    words={
        "a_model": "a Haiku model",
        "model_doc": (
            "``hk.Transformed`` (with or without apply rng) or\n  ``hk.TransformedWithState``."
        ),
        "params_doc": "the params returned by ``transformed.init``.",
        "held_fixed": inspect.cleandoc(
            """
            Only ``params`` is differentiated; ``state`` (required for
            ``hk.TransformedWithState``) and ``rng`` are held fixed, and the state the model
            returns is discarded. New params and state of the same shapes do not recompile.
            """
        ),
        "differentiated": "``params``",
        "per_leaf_tree": '``params`` (``{"linear": {"w": K, "b": K}, ...}``)',
        "leaf_path": "['linear']['w']",
        "raises": inspect.cleandoc(
            """
            TypeError: not a transformed function; an unknown option; params not a dict.
            ValueError: missing or unexpected state; rng given to a transform that takes none;
              a model needing an rng without one; a model whose samples interact (BatchNorm
              with ``is_training=True``) with ``vmap_axes=0``; the model failing on x1; and
              every error of :func:`ntk_core.ntk_fn`.
            """
        ),
        "extra_cost": "",
        "example_setup": inspect.cleandoc(
            """
            >>> import haiku as hk, jax, jax.numpy as jnp
            >>> import ntk_haiku
            >>> net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x)))
            >>> x = jnp.ones((4, 2))
            """
        ),
        "example_model": "net",
        "example_init": "net.init(jax.random.PRNGKey(0), x)",
        "example_layer": "['linear']",
        "example_w": "w",
        "example_b": "b",
        "more_kernel_examples": "",
    },
)

kernel_fn = entry_point(ADAPTER, _adapter.KERNEL_FN)
nngp_fn = entry_point(ADAPTER, _adapter.NNGP_FN)
kernel = entry_point(ADAPTER, _adapter.KERNEL)
nngp = entry_point(ADAPTER, _adapter.NNGP)
kernel_per_leaf_fn = entry_point(ADAPTER, _adapter.KERNEL_PER_LEAF_FN)
kernel_per_leaf = entry_point(ADAPTER, _adapter.KERNEL_PER_LEAF)
plan = entry_point(ADAPTER, _adapter.PLAN)
