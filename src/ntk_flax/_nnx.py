"""Empirical NTK / NNGP of ``flax.nnx`` modules (used by ``ntk_flax``'s entry points).

An nnx module holds its own state. Each call splits the module as it is at that moment
(``nnx.split(model, nnx.Param, ...)``): the ``nnx.Param`` variables are differentiated
(or the ``variables`` the caller passes in their place, e.g. from an optimizer step),
and everything else (BatchNorm statistics, RNG state) together with the graph
definition travels in ``aux``, held fixed. ``model.eval()`` / ``model.train()`` change
the graph definition, so the next call compiles for the new mode.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from ntk_core._adapter import bound_kernel, check_apply_kwargs, kernel_function
from ntk_core._checks import adapter_model_failure


def _method(fn_name: str, model, method) -> str:
    if method is None:
        return "__call__"
    if not isinstance(method, str) or not callable(getattr(model, method, None)):
        raise TypeError(
            f"{fn_name}: method must name a method of the nnx module "
            f"{type(model).__name__}, got {method!r}. Fix: pass its name, e.g. "
            f"method='features', or leave method=None for __call__."
        )
    return method


def _training_mode(fn_name: str, model) -> None:
    """Refuses Dropout (rate > 0) and BatchNorm in training mode: dropout would draw a
    mask per sample from the module's RNG state (the kernel of a random function), and
    BatchNorm would normalise by batch statistics it also mutates."""
    iterate = getattr(nnx, "iter_modules", None)  # flax >= 0.12; before, a method
    modules = iterate(model) if iterate is not None else model.iter_modules()
    found = []
    for path, module in modules:
        name = "/".join(map(str, path)) or "(root)"
        if isinstance(module, nnx.Dropout) and module.rate > 0 and not module.deterministic:
            found.append(f"Dropout at {name}")
        if isinstance(module, nnx.BatchNorm) and not module.use_running_average:
            found.append(f"BatchNorm at {name}")
    if found:
        fix = (
            "call .eval() on the module in the function that builds it (m = Model(rngs="
            "rngs); m.eval(); return m)"
            if fn_name.endswith("monte_carlo_kernels")
            else "put the module in evaluation mode (e.g. model.eval()), or build those "
            "layers with deterministic=True / use_running_average=True"
        )
        raise ValueError(
            f"{fn_name}: the nnx module is in training mode ({', '.join(found[:3])}"
            f"{', ...' if len(found) > 3 else ''}): Dropout would draw a different mask for "
            f"each sample from the module's RNG state, and BatchNorm would normalise by the "
            f"batch's statistics, so there is no fixed function whose kernel to compute. "
            f"Fix: {fix}."
        )


def make(fn_name: str, kind: str, model, method, apply_kwargs, options) -> Callable:
    """The kernel function ``call(variables, x1, x2=None, *, rngs=None)`` of an nnx
    module; ``variables`` is ``None`` (the module's own ``nnx.Param`` state now) or a
    state of the same structure."""
    apply_kwargs = check_apply_kwargs(fn_name, apply_kwargs, "{'deterministic': True}")
    name = _method(fn_name, model, method)

    def apply3(params, x, aux):
        graphdef, rest = aux
        return getattr(nnx.merge(graphdef, params, rest), name)(x, **apply_kwargs)

    def check(params, x1, x2, aux):
        try:
            jax.eval_shape(apply3, params, x1, aux)
        except Exception as e:
            raise adapter_model_failure(fn_name, "variables", e) from e

    kernel = kernel_function(fn_name, kind, apply3, options, check, hint="model.eval()")

    def to_core(variables, rngs=None):
        if rngs is not None:
            raise TypeError(
                f"{fn_name}: rngs was given, but an nnx module carries its own nnx.Rngs. "
                f"Fix: drop rngs= (call model.eval() for deterministic dropout)."
            )
        _training_mode(fn_name, model)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if variables is not None:
            if jax.tree.structure(variables) != jax.tree.structure(params):
                raise ValueError(
                    f"{fn_name}: variables do not have the structure of the module's "
                    f"nnx.Param state ({len(jax.tree.leaves(variables))} leaves against "
                    f"{len(jax.tree.leaves(params))}). Fix: pass variables=None for the "
                    f"module's own parameters, or nnx.state(model, nnx.Param) (e.g. of "
                    f"another step of the same model)."
                )
            params = variables
        return params, (graphdef, rest)

    call = bound_kernel(fn_name, kernel, to_core, ("rngs",))

    def of_state(params, rest, x1, x2=None):
        """The kernel of the module with ``params`` and other state ``rest`` (states
        of a module built like this one), for the Monte Carlo kernels."""
        _training_mode(fn_name, model)
        return kernel(params, x1, x2, (nnx.split(model, nnx.Param, ...)[0], rest))

    call.of_state = of_state
    return call
