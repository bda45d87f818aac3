"""Empirical NTK / NNGP of ``flax.linen`` models (and ``flax.nnx`` ones, see ``_nnx``).

The adapter turns ``(model, variables)`` into a pure ``apply3(params, x, aux)`` where
``params = variables["params"]`` is differentiated and every other collection
(``batch_stats``, ...) travels in ``aux``, held fixed; then it hands it to ``ntk_core``.
``variables`` may also be a bare params dict or a train state (``_variables``).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.core
import flax.errors
import flax.linen as nn
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
from ntk_core._checks import adapter_model_failure, is_nnx_module
from ntk_flax import _nnx
from ntk_flax._variables import VariablesReader

_MUTABLE = flax.core.DenyList(["params"])


def _refuse_apply_arguments(fn_name: str, apply_kwargs: dict) -> None:
    """``model.apply``'s own keywords (``mutable``, ``rngs``, ``method``) in
    ``apply_kwargs``: the adapter passes those itself."""
    monte_carlo = fn_name.endswith("monte_carlo_kernels")
    source = "as model.init makes them" if monte_carlo else "as given in variables"
    if "mutable" in apply_kwargs:
        raise TypeError(
            f"{fn_name}: apply_kwargs['mutable'] = {apply_kwargs['mutable']!r} is not "
            f"supported: the kernel applies the model itself as a pure function of its "
            f"'params' collection, with the other collections (batch_stats, ...) held fixed "
            f"{source} and never updated. Fix: drop 'mutable' from apply_kwargs and apply "
            f"the model in evaluation mode (e.g. apply_kwargs={{'train': False}}, or "
            f"BatchNorm(use_running_average=True)), which uses those fixed statistics; "
            f"for the kernel of training mode, "
            f"where each batch is normalised by its own statistics, pass the model's "
            f"training switch with vmap_axes=None (e.g. apply_kwargs={{'train': True}}, "
            f"vmap_axes=None; the updated statistics are discarded)."
        )
    if "rngs" in apply_kwargs:
        call = (
            "kernel(variables, x" if fn_name.endswith("_fn") else f"{fn_name}(model, variables, x"
        )
        fix = (
            "run the model deterministically (e.g. apply_kwargs={'train': False}); the "
            "Monte Carlo kernels take no rngs"
            if monte_carlo
            else f"pass rngs= to the kernel call itself, e.g. {call}, rngs={{'dropout': key}}) "
            f"(the same key for every sample)"
        )
        raise TypeError(
            f"{fn_name}: apply_kwargs holds 'rngs', an argument of model.apply that the "
            f"kernel passes itself. Fix: drop it from apply_kwargs and {fix}."
        )
    if "method" in apply_kwargs:
        raise TypeError(
            f"{fn_name}: apply_kwargs holds 'method', an argument of model.apply that the "
            f"kernel passes itself. Fix: pass method={apply_kwargs['method']!r} to {fn_name} "
            f"instead of inside apply_kwargs."
        )


def _init_fn(model, method, apply_kwargs, rngs):
    """``x -> model.init(...)`` with the call's model arguments (for diagnoses under
    ``jax.eval_shape``: nothing is computed)."""

    def init(x):
        key = jax.random.PRNGKey(0)
        streams = {"params": key, "dropout": key, **(rngs or {})}
        return model.init(streams, x, method=method, **apply_kwargs)

    return init


def _missing_collections(fn_name: str, variables, init, x1) -> ValueError:
    """The ValueError for variables lacking a collection the model reads (Flax's
    ``ScopeCollectionNotFound``), naming the collections ``model.init`` makes that
    variables lacks."""
    held = sorted(variables)
    try:
        made = sorted(jax.eval_shape(init, x1))
    except Exception:  # the model cannot be initialised on x1: say what is known
        made = []
    missing = [c for c in made if c not in variables and c != "intermediates"]
    if not missing:
        return ValueError(
            f"{fn_name}: the model reads a variable collection that variables lacks (Flax's "
            f"ScopeCollectionNotFound); variables holds {held}. Fix: pass the whole "
            f"variables dict returned by model.init(key, x) (every collection, not only "
            f"'params')."
        )
    names = ", ".join(map(repr, missing))
    plural = "s" if len(missing) > 1 else ""
    what = " (BatchNorm's running statistics)" if missing == ["batch_stats"] else ""
    example = ", ".join(f"'{c}': state.{c}" for c in missing)
    return ValueError(
        f"{fn_name}: variables lacks the collection{plural} {names}{what}, which the model "
        f"reads; variables holds {held}, model.init makes {made}. Fix: pass the whole "
        f"variables dict returned by model.init(key, x), or add the collection{plural}: "
        f"{{'params': ..., {', '.join(f'{c!r}: ...' for c in missing)}}} (e.g. "
        f"{{'params': state.params, {example}}} from a TrainState that carries them); the "
        f"kernel holds {names} fixed."
    )


def _model_apply(model, method, apply_kwargs):
    def apply3(params, x, aux):
        rest, rngs = aux
        out, _ = model.apply(
            {"params": params, **rest},
            x,
            method=method,
            rngs=rngs,
            mutable=_MUTABLE,
            **apply_kwargs,
        )
        return out

    return apply3


def _make(fn_name, kind, model, method, apply_kwargs, options):
    if is_nnx_module(model):  # flax.nnx: the module's own state, split per call
        return _nnx.make(fn_name, kind, model, method, apply_kwargs, options)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{fn_name}: model must be a flax.linen.Module or a flax.nnx.Module, got "
            f"{type(model).__name__}. Fix: pass the module instance (e.g. MyModel()); the "
            f"argument order is (model, variables, x1, x2); for a plain function use "
            f"ntk_core.empirical_ntk."
        )
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, "{'train': False}")
    _refuse_apply_arguments(fn_name, apply_kwargs)
    apply3 = _model_apply(model, method, apply_kwargs)
    vmap_axes = options.get("vmap_axes", 0)
    read = VariablesReader(
        fn_name,
        lambda rngs: _init_fn(model, method, apply_kwargs, rngs),
        lambda rngs: lambda v, x: model.apply(v, x, method=method, rngs=rngs, **apply_kwargs),
    )

    def check(params, x1, x2, aux):
        rest, rngs = aux
        variables = {"params": params, **rest}
        try:
            jax.eval_shape(
                lambda v, x: model.apply(v, x, method=method, rngs=rngs, **apply_kwargs),
                variables,
                x1,
            )
        except flax.errors.InvalidRngError as e:
            rngs = (
                ""  # Monte Carlo kernels take no rngs
                if fn_name.endswith("monte_carlo_kernels")
                else ", or pass rngs={'dropout': key}; with rngs every sample sees the same key"
            )
            raise ValueError(
                f"{fn_name}: the model needs a random key ({e}). Fix: run it "
                f"deterministically (e.g. apply_kwargs={{'train': False}} or "
                f"deterministic=True){rngs}."
            ) from None
        except flax.errors.ModifyScopeVariableError as e:
            if vmap_axes is not None:
                raise ValueError(
                    f"{fn_name}: the model updates its variables when applied ({e}), e.g. "
                    f"BatchNorm in training mode, whose samples interact; per-sample "
                    f"independence (vmap_axes=0) would be wrong. Fix: apply it in evaluation "
                    f"mode (e.g. apply_kwargs={{'train': False}} or "
                    f"use_running_average=True), or pass vmap_axes=None to differentiate "
                    f"the whole batch (updated statistics are discarded)."
                ) from None
        except flax.errors.ScopeCollectionNotFound as e:
            raise (
                read.misread(variables, x1, rngs, e)
                or _missing_collections(
                    fn_name, variables, _init_fn(model, method, apply_kwargs, rngs), x1
                )
            ) from None
        except flax.errors.ScopeParamShapeError as e:
            init = _init_fn(model, method, apply_kwargs, rngs)
            mismatch = input_shape_mismatch(
                fn_name,
                "variables",
                params,
                lambda x: init(x)["params"],
                x1,
                "variables = model.init(key, x1)",
            )
            raise (mismatch or adapter_model_failure(fn_name, "variables", e)) from None
        except Exception as e:
            raise (
                read.misread(variables, x1, rngs, e)
                or adapter_model_failure(fn_name, "variables", e)
            ) from e

    kernel = kernel_function(
        fn_name,
        kind,
        apply3,
        options,
        check,
        hint="use_running_average=True / apply_kwargs={'train': False}",
    )

    def to_core(variables, x1, rngs=None):
        """``(params, (other collections, rngs))`` for the core from what ``variables``
        is (see ``_variables``): a variables dict, a bare params dict or a train state."""
        variables = read(variables, x1, rngs)
        rest = {k: v for k, v in variables.items() if k != "params"}
        return variables["params"], (rest, rngs)

    return bound_kernel(fn_name, kernel, to_core, ("rngs",), with_x1=True)


def kernel_fn(
    model: nn.Module, *, method: str | Callable | None = None, apply_kwargs=None, **options
) -> Callable:
    """Jitted empirical NTK of a ``flax.linen`` model, reusable across training steps.

    Returns ``kernel(variables, x1, x2=None, *, rngs=None)``. ``variables`` is what a
    Flax training loop holds (see ``variables`` in :func:`kernel`): the dict returned by
    ``model.init``, a bare params dict (``variables["params"]``, ``state.params``) or a
    ``TrainState``. Only the ``params`` collection is differentiated, the others
    (``batch_stats``, ...) are held fixed and never mutated. New variables of the same
    shapes (each training step) do not recompile.

    A ``flax.nnx`` module holds its own state: pass ``variables=None`` to use its
    ``nnx.Param`` variables as they are at each call (after in-place optimizer updates),
    or a state of the same structure (``nnx.state(model, nnx.Param)``, e.g. of another
    step); its other state (BatchNorm statistics, RNG state) is held fixed. Call
    ``model.eval()`` first for BatchNorm and Dropout in evaluation mode; switching the
    mode recompiles once.

    Args:
      model: a ``flax.linen.Module`` or a ``flax.nnx.Module``.
      method: passed to ``model.apply`` (a method name or function; for nnx, a method
        name); default ``__call__``.
      apply_kwargs: extra keyword arguments of the model, e.g. ``{"train": False}``.
      **options: ``trace_axes``, ``diagonal_axes``, ``vmap_axes``, ``implementation``,
        ``precision`` as in :func:`ntk_core.ntk_fn`, and the blocked engine's
        ``batch_size``, ``store_on_device``, ``progress``, ``memory_budget`` (a Gram
        matrix of any size in tiles; a host ``numpy.ndarray`` by default when batched).

    Returns:
      ``kernel(variables, x1, x2=None, *, rngs=None)`` giving the kernel in the layout of
      :func:`ntk_core.empirical_ntk`: ``(N1, N2)`` for ``(N, O)`` outputs by default.
      ``kernel.implementation_for(variables, x1, x2=None)`` tells which implementation
      such a call uses (what ``"auto"`` chose); ``kernel.plan(variables, x1, x2=None)``
      describes it per parameter leaf (see :func:`plan`).

    Raises:
      TypeError: ``model`` not a linen or nnx Module; an unknown option; ``variables``
        neither a dict nor a train state (or a train state whose ``.params`` is not a
        dict); ``rngs`` for an nnx module; an nnx ``method`` it does not have.
      ValueError: ``variables`` a dict without ``params`` that does not hold this
        model's parameters (for nnx: not of its ``nnx.Param`` state's structure); a
        bare params dict or train state without a collection the model reads
        (``batch_stats``), or a variables dict without it; a bare params dict whose
        top-level layer is named ``params`` (Flax cannot apply such a model); a model
        needing an rng (dropout) without ``rngs``; a model whose samples interact
        (BatchNorm in training mode) with ``vmap_axes=0``; the model failing on x1; and
        every error of :func:`ntk_core.ntk_fn`.

    Cost: as :func:`ntk_core.ntk_fn`, plus, once per input shape, two small forward
    passes that check per-sample independence; for a bare params dict or a train state,
    one abstract ``model.init`` (no computation) per per-sample input shape.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import ntk_flax
      >>> model = nn.Dense(3)
      >>> x = jnp.ones((4, 2))
      >>> kernel = ntk_flax.kernel_fn(model, trace_axes=())
      >>> kernel(model.init(jax.random.PRNGKey(0), x), x).shape  # (N1, N2, O, O)
      (4, 4, 3, 3)

    References:
      Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Novak,
      Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
    """
    return _make("ntk_flax.kernel_fn", "ntk", model, method, apply_kwargs, options)


def nngp_fn(
    model: nn.Module, *, method: str | Callable | None = None, apply_kwargs=None, **options
) -> Callable:
    """Jitted empirical NNGP kernel of a ``flax.linen`` model; see :func:`kernel_fn`.

    Returns ``kernel(variables, x1, x2=None, *, rngs=None)`` giving f(x1)·f(x2) in the
    layout of :func:`ntk_core.empirical_nngp`: ``(N1, N2)`` for ``(N, O)`` outputs by
    default, ``(N1, N2, O, O)`` with ``trace_axes=()``, in the outputs' dtype.

    Args:
      model, method, apply_kwargs: as :func:`kernel_fn`.
      **options: ``trace_axes``, ``diagonal_axes``, ``vmap_axes``, ``precision``,
        ``batch_size``, ``store_on_device``, ``progress``, ``memory_budget``, as in
        :func:`ntk_core.nngp_fn`.

    Raises:
      As :func:`kernel_fn`; TypeError for ``implementation=`` (an NNGP has none).

    Cost: one forward pass per sample and N1·N2·O'·O multiply-adds.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import ntk_flax
      >>> model = nn.Dense(3)
      >>> x = jnp.ones((4, 2))
      >>> ntk_flax.nngp_fn(model)(model.init(jax.random.PRNGKey(0), x), x).shape
      (4, 4)

    References:
      Lee et al., "Deep Neural Networks as Gaussian Processes", ICLR 2018.
    """
    return _make("ntk_flax.nngp_fn", "nngp", model, method, apply_kwargs, options)


def kernel(
    model: nn.Module,
    variables,
    x1,
    x2=None,
    *,
    method: str | Callable | None = None,
    apply_kwargs=None,
    rngs=None,
    **options,
):
    """Empirical NTK of a ``flax.linen`` model between x1 and x2 (x1 if None).

    Θ(x1, x2)[i, j, a, b] = Σ_p ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p over the ``params``
    collection, in the layout of :func:`ntk_core.empirical_ntk` (``(N1, N2)`` for
    ``(N, O)`` outputs with the default ``trace_axes=(-1,)``, traced axes averaged).

    Args:
      model: a ``flax.linen.Module`` or a ``flax.nnx.Module`` (see :func:`kernel_fn`).
      variables: what a Flax training loop holds, one of

        * the variables dict returned by ``model.init``, ``{"params": ...,
          "batch_stats": ...}`` (any mapping with a ``"params"`` key): ``params`` is
          differentiated, the other collections are held fixed;
        * a bare params dict, the ``params`` collection alone (``variables["params"]``,
          ``state.params``; a mapping without a ``"params"`` key), used as
          ``{"params": params}``. It must hold every parameter that ``model.init``
          makes on one sample of x1 (checked with an abstract init, nothing
          computed); parameters of another model are refused, and so is a bare params
          dict of a model that also reads another collection (BatchNorm's
          ``batch_stats``): pass the variables dict or a train state carrying it;
        * a train state: any object with ``.params`` and ``.apply_fn``, e.g.
          ``flax.training.train_state.TrainState`` or a subclass. Read:
          ``state.params`` (a bare params dict, or a variables dict), and for each
          other collection that ``model.init`` makes and ``state.params`` lacks, the
          state's attribute of that name if it is not ``None`` (``state.batch_stats``
          of a subclass with a ``batch_stats`` field). Nothing else is read: not
          ``step``, ``tx`` or ``opt_state``, and not ``apply_fn`` (``model`` is
          applied).

        For an nnx module: ``None`` (its own ``nnx.Param`` state) or such a state.
      x1: array or pytree of arrays, batch axis 0 of size N1.
      x2: ``None`` (x2 is x1) or like x1 with N2 samples.
      method, apply_kwargs, **options: see :func:`kernel_fn`.
      rngs: random keys for ``model.apply`` (e.g. ``{"dropout": key}``), the same for
        every sample.

    Returns:
      The kernel, float32 by default: ``(N1, N2)``, ``(N1, N2, O, O)`` with
      ``trace_axes=()``, ``(N,)`` with ``diagonal_axes=(0,)``.

    Raises:
      See :func:`kernel_fn`.

    Cost: as :func:`kernel_fn` (compiled once per model, options and input shapes, and
    cached).

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import ntk_flax
      >>> model = nn.Dense(3)
      >>> x = jnp.ones((4, 2))
      >>> variables = model.init(jax.random.PRNGKey(0), x)
      >>> ntk_flax.kernel(model, variables, x).shape
      (4, 4)
      >>> k = ntk_flax.kernel(model, variables["params"], x)  # or state.params, or state
      >>> bool((k == ntk_flax.kernel(model, variables, x)).all())
      True

    References:
      Novak, Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel",
      ICML 2022.
    """
    fn = _cached("ntk_flax.kernel", "ntk", model, method, apply_kwargs, options)
    return fn(variables, x1, x2, rngs=rngs)


def nngp(
    model: nn.Module,
    variables,
    x1,
    x2=None,
    *,
    method: str | Callable | None = None,
    apply_kwargs=None,
    rngs=None,
    **options,
):
    """Empirical NNGP kernel f(x1)·f(x2) of a ``flax.linen`` model; see :func:`kernel`.

    Args:
      model, variables, x1 (N1 samples), x2 (N2 samples or ``None``), method,
      apply_kwargs, rngs: as :func:`kernel`.
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
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import ntk_flax
      >>> model = nn.Dense(3)
      >>> x = jnp.ones((4, 2))
      >>> ntk_flax.nngp(model, model.init(jax.random.PRNGKey(0), x), x, trace_axes=()).shape
      (4, 4, 3, 3)

    References:
      Lee et al., "Deep Neural Networks as Gaussian Processes", ICLR 2018.
    """
    fn = _cached("ntk_flax.nngp", "nngp", model, method, apply_kwargs, options)
    return fn(variables, x1, x2, rngs=rngs)


def kernel_per_leaf_fn(
    model: nn.Module, *, method: str | Callable | None = None, apply_kwargs=None, **options
) -> Callable:
    """Jitted empirical NTK of a Flax model, split by parameter leaf.

    Returns ``kernel(variables, x1, x2=None, *, rngs=None)`` (``variables`` as in
    :func:`kernel`) giving a dict shaped like the ``params`` collection
    (``{"Dense_0": {"kernel": K, "bias": K}, ...}``; for an nnx
    module, an ``nnx.State`` shaped like its ``nnx.Param`` state) whose leaves Θ_l are
    kernels in the layout of :func:`kernel` (``(N1, N2)`` by default, ``(N1, N2, O, O)``
    with ``trace_axes=()``), with Σ_l Θ_l = Θ (see :func:`ntk_core.ntk_per_leaf_fn`).
    Shows which layers drive the kernel.

    Args:
      model, method, apply_kwargs: see :func:`kernel_fn`.
      **options: as :func:`kernel_fn`; ``implementation`` is ``"auto"``,
        ``"jacobian"`` or ``"structured"`` (NTK-vector products do not separate the
        leaves).

    Raises:
      As :func:`kernel_fn`, and ValueError for ``implementation="ntvp"``.

    Cost: as :func:`kernel_fn` with the same implementation (the per-leaf terms are what
    it sums), plus the memory of L kernels instead of one.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import ntk_flax
      >>> model = nn.Dense(3)
      >>> x = jnp.ones((4, 2))
      >>> k = ntk_flax.kernel_per_leaf_fn(model)(model.init(jax.random.PRNGKey(0), x), x)
      >>> k["kernel"].shape
      (4, 4)

    References:
      Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Novak,
      Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
    """
    return _make(
        "ntk_flax.kernel_per_leaf_fn", "ntk_per_leaf", model, method, apply_kwargs, options
    )


def kernel_per_leaf(
    model: nn.Module,
    variables,
    x1,
    x2=None,
    *,
    method: str | Callable | None = None,
    apply_kwargs=None,
    rngs=None,
    **options,
):
    """Empirical NTK of a ``flax.linen`` model split by parameter leaf.

    Θ_l(x1, x2)[i, j, a, b] = Σ_{p in leaf l} ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p for each
    leaf l of the ``params`` collection; the leaves sum to :func:`kernel`.

    Args:
      model, variables, x1, x2, method, apply_kwargs, rngs: see :func:`kernel`.
      **options: see :func:`kernel_per_leaf_fn`.

    Returns:
      A dict shaped like the ``params`` collection (an ``nnx.State`` for an nnx module)
      of kernels, each in the layout and dtype of :func:`kernel` (``(N1, N2)`` by
      default, ``(N1, N2, O, O)`` with ``trace_axes=()``).

    Raises:
      See :func:`kernel_per_leaf_fn`.

    Cost: as :func:`kernel_per_leaf_fn` (compiled once and cached).

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import ntk_flax
      >>> model = nn.Dense(3)
      >>> x = jnp.ones((4, 2))
      >>> k = ntk_flax.kernel_per_leaf(model, model.init(jax.random.PRNGKey(0), x), x)
      >>> sorted(k), k["kernel"].shape, float(k["bias"][0, 0])
      (['bias', 'kernel'], (4, 4), 1.0)

    References:
      Novak, Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel",
      ICML 2022.
    """
    fn = _cached("ntk_flax.kernel_per_leaf", "ntk_per_leaf", model, method, apply_kwargs, options)
    return fn(variables, x1, x2, rngs=rngs)


def plan(
    model: nn.Module,
    variables,
    x1,
    x2=None,
    *,
    method: str | Callable | None = None,
    apply_kwargs=None,
    rngs=None,
    **options,
):
    """What :func:`kernel` with these arguments would do, without computing it.

    Returns the ``Plan`` of :func:`ntk_core.plan` for the ``params`` collection:
    ``implementation`` (what ``"auto"`` chose), ``estimates`` (analytic FLOPs and
    feature bytes of each implementation considered) and ``leaves``, one per parameter
    leaf with its path (``"['Dense_0']['kernel']"``), size P_l and method (e.g.
    ``"structured (1 matrix product)"`` or ``"jacobian (fallback: <reason>)"``).
    ``print(plan)`` shows a table. The estimates count N1·N2 pairs (N1 on the batch
    diagonal) of x1 with N1 samples and x2 with N2 (or ``None``).

    Args:
      model, variables, x1, x2, method, apply_kwargs, rngs, **options: as
      :func:`kernel`.

    Raises:
      As :func:`kernel_fn`.

    Cost: one abstract trace of the model and the independence probe (two small forward
    passes); no kernel is computed.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import ntk_flax
      >>> model = nn.Dense(3)
      >>> x = jnp.ones((4, 2))
      >>> p = ntk_flax.plan(model, model.init(jax.random.PRNGKey(0), x), x)
      >>> for leaf in p.leaves:
      ...     print(leaf.path, leaf.size, leaf.method)
      ['bias'] 3 structured (bias fused with its matrix product)
      ['kernel'] 6 structured (1 matrix product)

    References:
      Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Novak,
      Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
    """
    fn = _cached("ntk_flax.plan", "ntk", model, method, apply_kwargs, options)
    return fn.plan(variables, x1, x2, rngs=rngs)


_CACHE = BuildCache()


def _cached(fn_name, kind, model, method, apply_kwargs, options):
    """Reuses the compiled kernel function of an equal earlier call."""
    key = (fn_name, model, method, freeze(apply_kwargs), freeze(options))
    return _CACHE.get(key, lambda: _make(fn_name, kind, model, method, apply_kwargs, options))


# Python's own binding errors (a missing x1, too many positional arguments) get the
# public name and the fix.
kernel_fn = _checked_arguments(kernel_fn, "ntk_flax.kernel_fn")
nngp_fn = _checked_arguments(nngp_fn, "ntk_flax.nngp_fn")
kernel = _checked_arguments(kernel, "ntk_flax.kernel")
nngp = _checked_arguments(nngp, "ntk_flax.nngp")
kernel_per_leaf_fn = _checked_arguments(kernel_per_leaf_fn, "ntk_flax.kernel_per_leaf_fn")
kernel_per_leaf = _checked_arguments(kernel_per_leaf, "ntk_flax.kernel_per_leaf")
plan = _checked_arguments(plan, "ntk_flax.plan")
