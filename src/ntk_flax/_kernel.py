"""Empirical NTK / NNGP of ``flax.linen`` models (and ``flax.nnx`` ones, see ``_nnx``).

The adapter turns ``(model, variables)`` into a pure ``apply3(params, x, aux)`` where
``params = variables["params"]`` is differentiated and every other collection
(``batch_stats``, ...) travels in ``aux``, held fixed; then it hands it to ``ntk_core``.
``variables`` may also be a bare params dict or a train state (``_variables``). The
entry points and their docstrings are made by ``ntk_core._kernel.adapter.entry_point`` from
:data:`ADAPTER`, this framework's words.
"""

from __future__ import annotations

import inspect

import flax.core
import flax.errors
import flax.linen as nn
import jax

from ntk_core._kernel import adapter as _adapter
from ntk_core._kernel.adapter import (
    Adapter,
    Entry,
    Form,
    Keyword,
    PureModel,
    build_kernel,
    check_apply_kwargs,
    entry_point,
    input_shape_mismatch,
)
from ntk_core._kernel.checks import adapter_model_failure, is_nnx_module
from ntk_flax import _nnx
from ntk_flax._variables import VariablesReader

_MUTABLE = flax.core.DenyList(["params"])


def _refuse_apply_arguments(fn_name: str, entry: Entry, apply_kwargs: dict) -> None:
    """``model.apply``'s own keywords (``mutable``, ``rngs``, ``method``) in
    ``apply_kwargs``: the adapter passes those itself."""
    monte_carlo = entry.form is Form.MONTE_CARLO
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
            "kernel(variables, x" if entry.form is Form.BUILD else f"{fn_name}(model, variables, x"
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


def _make(entry: Entry, model, options: dict, *, method=None, apply_kwargs=None):
    """The kernel function of a linen or nnx ``model`` for ``entry`` (``make`` of
    :data:`ADAPTER`)."""
    caller = ADAPTER.caller(entry)
    fn_name = caller.name
    if is_nnx_module(model):  # flax.nnx: the module's own state, split per call
        return _nnx.make(caller, entry.kind, model, method, apply_kwargs, options)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{fn_name}: model must be a flax.linen.Module or a flax.nnx.Module, got "
            f"{type(model).__name__}. Fix: pass the module instance (e.g. MyModel()); the "
            f"argument order is (model, variables, x1, x2); for a plain function use "
            f"ntk_core.empirical_ntk."
        )
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, "{'train': False}")
    _refuse_apply_arguments(fn_name, entry, apply_kwargs)
    apply3 = _model_apply(model, method, apply_kwargs)
    vmap_axes = options.get("vmap_axes", 0)
    read = VariablesReader(
        caller,
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
                if entry.form is Form.MONTE_CARLO
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
            raise (mismatch or adapter_model_failure(caller, "variables", e)) from None
        except Exception as e:
            raise (
                read.misread(variables, x1, rngs, e)
                or adapter_model_failure(caller, "variables", e)
            ) from e

    def to_core(variables, x1, rngs=None):
        """``(params, (other collections, rngs))`` for the core from what ``variables``
        is (see ``_variables``): a variables dict, a bare params dict or a train state."""
        variables = read(variables, x1, rngs)
        rest = {k: v for k, v in variables.items() if k != "params"}
        return variables["params"], (rest, rngs)

    pure = PureModel(
        apply3,
        to_core,
        call_keywords=("rngs",),
        check=check,
        eval_hint="use_running_average=True / apply_kwargs={'train': False}",
        to_core_reads_x1=True,
    )
    return build_kernel(caller, entry.kind, pure, options)


#: Flax's words for the entry points (see ``ntk_core._kernel.adapter.Adapter``).
ADAPTER = Adapter(
    package="ntk_flax",
    module=__name__,
    model="model",
    model_annotation="nn.Module",
    params="variables",
    keywords=(
        Keyword(
            "method",
            "passed to ``model.apply`` (a method name or function; for nnx, a method "
            "name); default ``__call__``.",
            annotation="str | Callable | None",
        ),
        Keyword("apply_kwargs", 'extra keyword arguments of the model, e.g. ``{"train": False}``.'),
        Keyword(
            "rngs",
            'random keys for ``model.apply`` (e.g. ``{"dropout": key}``), the same for every '
            "sample.",
            per_call=True,
        ),
    ),
    make=_make,
    words={
        "a_model": "a Flax model",
        "model_doc": "a ``flax.linen.Module`` or a ``flax.nnx.Module``.",
        "params_doc": inspect.cleandoc(
            """
            what a Flax training loop holds, one of

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
            """
        ),
        "held_fixed": inspect.cleandoc(
            """
            ``variables`` is what a Flax training loop holds (see ``variables`` in
            :func:`kernel`): the dict returned by ``model.init``, a bare params dict
            (``variables["params"]``, ``state.params``) or a ``TrainState``. Only the
            ``params`` collection is differentiated, the others (``batch_stats``, ...) are
            held fixed and never mutated. New variables of the same shapes (each training
            step) do not recompile.

            A ``flax.nnx`` module holds its own state: pass ``variables=None`` to use its
            ``nnx.Param`` variables as they are at each call (after in-place optimizer
            updates), or a state of the same structure (``nnx.state(model, nnx.Param)``,
            e.g. of another step); its other state (BatchNorm statistics, RNG state) is
            held fixed. Call ``model.eval()`` first for BatchNorm and Dropout in evaluation
            mode; switching the mode recompiles once.
            """
        ),
        "differentiated": "the ``params`` collection",
        "per_leaf_tree": (
            'the ``params`` collection\n(``{"Dense_0": {"kernel": K, "bias": K}, ...}``; for an '
            "nnx module, an\n``nnx.State`` shaped like its ``nnx.Param`` state)"
        ),
        "leaf_path": "['Dense_0']['kernel']",
        "raises": inspect.cleandoc(
            """
            TypeError: ``model`` not a linen or nnx Module; an unknown option; ``variables``
              neither a dict nor a train state (or a train state whose ``.params`` is not a
              dict); ``rngs`` for an nnx module; an nnx ``method`` it does not have.
            ValueError: ``variables`` a dict without ``params`` that does not hold this
              model's parameters (for nnx: not of its ``nnx.Param`` state's structure); a
              bare params dict or train state without a collection the model reads
              (``batch_stats``), or a variables dict without it; a bare params dict whose
              top-level layer is named ``params`` (Flax cannot apply such a model); a model
              needing an rng (dropout) without ``rngs``; a model whose samples interact
              (BatchNorm in training mode) with ``vmap_axes=0``; the model failing on x1;
              and every error of :func:`ntk_core.ntk_fn`.
            """
        ),
        "extra_cost": (
            "; for a bare params dict or a train state,\none abstract ``model.init`` (no "
            "computation) per per-sample input shape"
        ),
        "example_setup": inspect.cleandoc(
            """
            >>> import flax.linen as nn, jax, jax.numpy as jnp
            >>> import ntk_flax
            >>> model = nn.Dense(3)
            >>> x = jnp.ones((4, 2))
            """
        ),
        "example_model": "model",
        "example_init": "model.init(jax.random.PRNGKey(0), x)",
        "example_layer": "",
        "example_w": "kernel",
        "example_b": "bias",
        "more_kernel_examples": inspect.cleandoc(
            """
            >>> k = ntk_flax.kernel(model, variables["params"], x)  # or state.params, or state
            >>> bool((k == ntk_flax.kernel(model, variables, x)).all())
            True
            """
        ),
    },
)

kernel_fn = entry_point(ADAPTER, _adapter.KERNEL_FN)
nngp_fn = entry_point(ADAPTER, _adapter.NNGP_FN)
kernel = entry_point(ADAPTER, _adapter.KERNEL)
nngp = entry_point(ADAPTER, _adapter.NNGP)
kernel_per_leaf_fn = entry_point(ADAPTER, _adapter.KERNEL_PER_LEAF_FN)
kernel_per_leaf = entry_point(ADAPTER, _adapter.KERNEL_PER_LEAF)
plan = entry_point(ADAPTER, _adapter.PLAN)
