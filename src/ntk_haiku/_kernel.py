"""Empirical NTK / NNGP of Haiku models (``hk.Transformed``, ``hk.TransformedWithState``).

The adapter turns a transformed function into a pure ``apply3(params, x, aux)`` with
``aux = (state, rng)`` held fixed (the state the model returns is discarded), then
hands it to ``ntk_core``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping

import haiku as hk
import jax

from ntk_core._adapter import (
    BuildCache,
    bound_kernel,
    check_apply_kwargs,
    freeze,
    input_shape_mismatch,
    kernel_function,
)
from ntk_core._api import _checked_arguments
from ntk_core._checks import adapter_model_failure


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


def _foreign_params(fn_name, params, state, error) -> ValueError | None:
    """The ValueError for params or state that are not this transform's (Haiku cannot
    find a parameter or state entry the model asks for), naming what they hold;
    ``None`` for other errors. Flax variables get the ntk_flax fix."""
    text = str(error)
    wanted = re.search(r"Unable to retrieve parameter '([^']+)' for module '([^']+)'", text)
    if wanted is None:
        wanted_state = re.search(r"No value for '([^']+)' in '([^']+)'", text)
        if wanted_state is None or not isinstance(state, Mapping):
            return None
        name, module = wanted_state.groups()
        held = sorted(map(str, state))
        return ValueError(
            f"{fn_name}: the model asks for state {name!r} of module {module!r}, which "
            f"state does not hold (its modules: {_shown(held)}). Fix: pass the state "
            f"returned together with these params, params, state = transformed.init(key, "
            f"x) (state of another model, or an empty one, does not fit)."
        )
    if not isinstance(params, Mapping):
        return None
    name, module = wanted.groups()
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


def _make(fn_name, kind, transformed, apply_kwargs, options):
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

    def check(params, x1, x2, aux):
        try:
            jax.eval_shape(lambda p, x, a: apply3(p, x, a), params, x1, aux)
        except ValueError as e:
            if "PRNGKey" not in str(e):
                raise (
                    _foreign_params(fn_name, params, aux[0], e)
                    or input_shape_mismatch(
                        fn_name,
                        "params",
                        params,
                        init_params,
                        x1,
                        "params = transformed.init(key, x1)",
                    )
                    or adapter_model_failure(fn_name, "params", e)
                ) from e
            raise ValueError(
                f"{fn_name}: the model needs a random key (e.g. dropout) but rng=None. Fix: "
                f"pass rng=jax.random.PRNGKey(0) (the same key for every sample), or make the "
                f"model deterministic."
            ) from None
        except Exception as e:
            raise _foreign_params(fn_name, params, aux[0], e) or adapter_model_failure(
                fn_name, "params", e
            ) from e

    kernel = kernel_function(
        fn_name, kind, apply3, options, check, hint="apply_kwargs={'is_training': False}"
    )

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

    return bound_kernel(fn_name, kernel, to_core, ("state", "rng"))


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


def kernel_fn(transformed, *, apply_kwargs=None, **options) -> Callable:
    """Jitted empirical NTK of a Haiku model, reusable with new params and state.

    Returns ``kernel(params, x1, x2=None, *, state=None, rng=None)``. Only ``params`` is
    differentiated; ``state`` (required for ``hk.TransformedWithState``) and ``rng`` are
    held fixed, and the state the model returns is discarded.

    Args:
      transformed: ``hk.Transformed`` (with or without apply rng) or
        ``hk.TransformedWithState``.
      apply_kwargs: extra keyword arguments of the forward function, e.g.
        ``{"is_training": False}``.
      **options: ``trace_axes``, ``diagonal_axes``, ``vmap_axes``, ``implementation``,
        ``precision`` as in :func:`ntk_core.ntk_fn`, and the blocked engine's
        ``batch_size``, ``store_on_device``, ``progress``, ``memory_budget`` (a Gram
        matrix of any size in tiles; a host ``numpy.ndarray`` by default when batched).

    Returns:
      ``kernel(params, x1, x2=None, *, state=None, rng=None)`` in the layout of
      :func:`ntk_core.empirical_ntk`: ``(N1, N2)`` for ``(N, O)`` outputs by default,
      ``(N1, N2, O, O)`` with ``trace_axes=()``. ``kernel.implementation_for(params, x1, x2=None,
      *, state=None, rng=None)`` tells which implementation such a call uses (what
      ``"auto"`` chose); ``kernel.plan(...)``, with the same arguments, describes it per
      parameter leaf (see :func:`plan`).

    Raises:
      TypeError: not a transformed function; an unknown option; params not a dict.
      ValueError: missing or unexpected state; rng given to a transform that takes none;
        a model needing an rng without one; a model whose samples interact (BatchNorm
        with ``is_training=True``) with ``vmap_axes=0``; the model failing on x1; and
        every error of :func:`ntk_core.ntk_fn`.

    Cost: as :func:`ntk_core.ntk_fn`, plus, once per input shape, two small forward
    passes that check per-sample independence.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import ntk_haiku
      >>> net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x)))
      >>> x = jnp.ones((4, 2))
      >>> kernel = ntk_haiku.kernel_fn(net, trace_axes=())
      >>> kernel(net.init(jax.random.PRNGKey(0), x), x).shape  # (N1, N2, O, O)
      (4, 4, 3, 3)

    References:
      Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Novak,
      Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
    """
    return _make("ntk_haiku.kernel_fn", "ntk", transformed, apply_kwargs, options)


def nngp_fn(transformed, *, apply_kwargs=None, **options) -> Callable:
    """Jitted empirical NNGP kernel of a Haiku model; see :func:`kernel_fn`.

    Returns ``kernel(params, x1, x2=None, *, state=None, rng=None)`` giving f(x1)·f(x2)
    in the layout of :func:`ntk_core.empirical_nngp`: ``(N1, N2)`` for ``(N, O)`` outputs
    by default, ``(N1, N2, O, O)`` with ``trace_axes=()``, in the outputs' dtype.

    Args:
      transformed, apply_kwargs: as :func:`kernel_fn`.
      **options: ``trace_axes``, ``diagonal_axes``, ``vmap_axes``, ``precision``,
        ``batch_size``, ``store_on_device``, ``progress``, ``memory_budget``, as in
        :func:`ntk_core.nngp_fn`.

    Raises:
      As :func:`kernel_fn`; TypeError for ``implementation=`` (an NNGP has none).

    Cost: one forward pass per sample and N1·N2·O'·O multiply-adds.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import ntk_haiku
      >>> net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x)))
      >>> x = jnp.ones((4, 2))
      >>> ntk_haiku.nngp_fn(net)(net.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)

    References:
      Lee et al., "Deep Neural Networks as Gaussian Processes", ICLR 2018.
    """
    return _make("ntk_haiku.nngp_fn", "nngp", transformed, apply_kwargs, options)


def kernel(transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options):
    """Empirical NTK of a Haiku model between x1 and x2 (x1 if None).

    Θ(x1, x2)[i, j, a, b] = Σ_p ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p, in the layout of
    :func:`ntk_core.empirical_ntk` (``(N1, N2)`` for ``(N, O)`` outputs by default,
    traced axes averaged).

    Args:
      transformed: ``hk.Transformed`` or ``hk.TransformedWithState``.
      params: the params returned by ``transformed.init``.
      x1: array or pytree of arrays, batch axis 0 of size N1.
      x2: ``None`` (x2 is x1) or like x1 with N2 samples.
      state: the state of an ``hk.TransformedWithState`` (required there).
      rng: a PRNG key for models that need one, the same for every sample.
      apply_kwargs, **options: see :func:`kernel_fn`.

    Returns:
      The kernel, float32 by default.

    Raises:
      See :func:`kernel_fn`.

    Cost: as :func:`kernel_fn` (compiled once per transform, options and input shapes,
    and cached).

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import ntk_haiku
      >>> net = hk.transform(lambda x: hk.Linear(3)(x))
      >>> x = jnp.ones((4, 2))
      >>> ntk_haiku.kernel(net, net.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)

    References:
      Novak, Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel",
      ICML 2022.
    """
    fn = _cached("ntk_haiku.kernel", "ntk", transformed, apply_kwargs, options)
    return fn(params, x1, x2, state=state, rng=rng)


def nngp(transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options):
    """Empirical NNGP kernel f(x1)·f(x2) of a Haiku model; see :func:`kernel`.

    Args:
      transformed, params, x1 (N1 samples), x2 (N2 samples or ``None``), state, rng,
      apply_kwargs: as :func:`kernel`.
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
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import ntk_haiku
      >>> net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x)))
      >>> x = jnp.ones((4, 2))
      >>> ntk_haiku.nngp(net, net.init(jax.random.PRNGKey(0), x), x, trace_axes=()).shape
      (4, 4, 3, 3)

    References:
      Lee et al., "Deep Neural Networks as Gaussian Processes", ICLR 2018.
    """
    fn = _cached("ntk_haiku.nngp", "nngp", transformed, apply_kwargs, options)
    return fn(params, x1, x2, state=state, rng=rng)


def kernel_per_leaf_fn(transformed, *, apply_kwargs=None, **options) -> Callable:
    """Jitted empirical NTK of a Haiku model, split by parameter leaf.

    Returns ``kernel(params, x1, x2=None, *, state=None, rng=None)`` giving a dict shaped
    like ``params`` (``{"linear": {"w": K, "b": K}, ...}``) whose leaves Θ_l are kernels
    in the layout of :func:`kernel` (``(N1, N2)`` by default, ``(N1, N2, O, O)`` with
    ``trace_axes=()``), with Σ_l Θ_l = Θ (see
    :func:`ntk_core.ntk_per_leaf_fn`). Shows which layers drive the kernel.

    Args:
      transformed, apply_kwargs: see :func:`kernel_fn`.
      **options: as :func:`kernel_fn`; ``implementation`` is ``"auto"``,
        ``"jacobian"`` or ``"structured"`` (NTK-vector products do not separate the
        leaves).

    Raises:
      As :func:`kernel_fn`, and ValueError for ``implementation="ntvp"``.

    Cost: as :func:`kernel_fn` with the same implementation (the per-leaf terms are what
    it sums), plus the memory of L kernels instead of one.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import ntk_haiku
      >>> net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x)))
      >>> x = jnp.ones((4, 2))
      >>> k = ntk_haiku.kernel_per_leaf_fn(net)(net.init(jax.random.PRNGKey(0), x), x)
      >>> k["linear"]["w"].shape
      (4, 4)

    References:
      Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Novak,
      Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
    """
    return _make("ntk_haiku.kernel_per_leaf_fn", "ntk_per_leaf", transformed, apply_kwargs, options)


def kernel_per_leaf(
    transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options
):
    """Empirical NTK of a Haiku model split by parameter leaf.

    Θ_l(x1, x2)[i, j, a, b] = Σ_{p in leaf l} ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p for each
    leaf l of ``params``; the leaves sum to :func:`kernel`.

    Args:
      transformed, params, x1, x2, state, rng, apply_kwargs: see :func:`kernel`.
      **options: see :func:`kernel_per_leaf_fn`.

    Returns:
      A dict shaped like ``params`` of kernels, each in the layout and dtype of
      :func:`kernel` (``(N1, N2)`` by default, ``(N1, N2, O, O)`` with
      ``trace_axes=()``).

    Raises:
      See :func:`kernel_per_leaf_fn`.

    Cost: as :func:`kernel_per_leaf_fn` (compiled once and cached).

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import ntk_haiku
      >>> net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x)))
      >>> x = jnp.ones((4, 2))
      >>> k = ntk_haiku.kernel_per_leaf(net, net.init(jax.random.PRNGKey(0), x), x)
      >>> sorted(k["linear"]), k["linear"]["w"].shape, float(k["linear"]["b"][0, 0])
      (['b', 'w'], (4, 4), 1.0)

    References:
      Novak, Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel",
      ICML 2022.
    """
    fn = _cached("ntk_haiku.kernel_per_leaf", "ntk_per_leaf", transformed, apply_kwargs, options)
    return fn(params, x1, x2, state=state, rng=rng)


def plan(transformed, params, x1, x2=None, *, state=None, rng=None, apply_kwargs=None, **options):
    """What :func:`kernel` with these arguments would do, without computing it.

    Returns the ``Plan`` of :func:`ntk_core.plan`: ``implementation`` (what ``"auto"``
    chose), ``estimates`` (analytic FLOPs and feature bytes of each implementation
    considered) and ``leaves``, one per leaf of ``params`` with its path
    (``"['linear']['w']"``), size P_l and method (e.g. ``"structured (1 matrix
    product)"`` or ``"jacobian (fallback: <reason>)"``). ``print(plan)`` shows a table.
    The estimates count N1·N2 pairs (N1 on the batch diagonal) of x1 with N1 samples
    and x2 with N2 (or ``None``).

    Args:
      transformed, params, x1, x2, state, rng, apply_kwargs, **options: as
      :func:`kernel`.

    Raises:
      As :func:`kernel_fn`.

    Cost: one abstract trace of the model and the independence probe (two small forward
    passes); no kernel is computed.

    Example:
      >>> import haiku as hk, jax, jax.numpy as jnp
      >>> import ntk_haiku
      >>> net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(x)))
      >>> x = jnp.ones((4, 2))
      >>> p = ntk_haiku.plan(net, net.init(jax.random.PRNGKey(0), x), x)
      >>> for leaf in p.leaves:
      ...     print(leaf.path, leaf.size, leaf.method)
      ['linear']['b'] 3 structured (bias fused with its matrix product)
      ['linear']['w'] 6 structured (1 matrix product)

    References:
      Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Novak,
      Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
    """
    fn = _cached("ntk_haiku.plan", "ntk", transformed, apply_kwargs, options)
    return fn.plan(params, x1, x2, state=state, rng=rng)


_CACHE = BuildCache()


def _cached(fn_name, kind, transformed, apply_kwargs, options):
    """Reuses the compiled kernel function of an equal earlier call."""
    key = (fn_name, transformed, freeze(apply_kwargs), freeze(options))
    return _CACHE.get(key, lambda: _make(fn_name, kind, transformed, apply_kwargs, options))


# Python's own binding errors (a missing x1, too many positional arguments) get the
# public name and the fix.
kernel_fn = _checked_arguments(kernel_fn, "ntk_haiku.kernel_fn")
nngp_fn = _checked_arguments(nngp_fn, "ntk_haiku.nngp_fn")
kernel = _checked_arguments(kernel, "ntk_haiku.kernel")
nngp = _checked_arguments(nngp, "ntk_haiku.nngp")
kernel_per_leaf_fn = _checked_arguments(kernel_per_leaf_fn, "ntk_haiku.kernel_per_leaf_fn")
kernel_per_leaf = _checked_arguments(kernel_per_leaf, "ntk_haiku.kernel_per_leaf")
plan = _checked_arguments(plan, "ntk_haiku.plan")
