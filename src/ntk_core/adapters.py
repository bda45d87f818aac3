"""The public seam for framework adapters (``ntk_flax``, ``ntk_haiku``, ``ntk_equinox``).

An adapter turns a model into a pure ``apply3(params, x, aux)`` (``aux`` held fixed),
describes it as a :class:`PureModel` and calls :func:`build_kernel`; its ``**options``
pass through unread (documented in :func:`ntk_core.ntk_fn`). A :class:`Caller` names its
public function and argument order for the core's messages.
"""

from __future__ import annotations

from collections.abc import Callable

from ntk_core._analysis import matrix_free as _matrix_free
from ntk_core._derived.adapter_priors import Deferred as DeferredInfinite
from ntk_core._derived.adapter_priors import Prior as Prior
from ntk_core._derived.adapter_priors import truncated_normal_moments as truncated_normal_moments
from ntk_core._derived.paths import leaf_path_names as leaf_path_names
from ntk_core._errors import bad as bad
from ntk_core._functional import sketch as _sketch
from ntk_core._functional.linearize import _Point
from ntk_core._functional.linearize import check_degree as check_degree
from ntk_core._functional.linearize import expansion as expansion
from ntk_core._jax.caches import cached as cached
from ntk_core._jax.caches import register as register_cache
from ntk_core._kernel.adapter import PureModel as PureModel
from ntk_core._kernel.adapter import build_kernel as build_kernel
from ntk_core._kernel.adapter import check_apply_kwargs as check_apply_kwargs
from ntk_core._kernel.adapter import entry_kind as entry_kind
from ntk_core._kernel.adapter import input_shape_mismatch as input_shape_mismatch
from ntk_core._kernel.adapter import keyed as keyed
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._kernel.caller import Caller as Caller
from ntk_core._kernel.caller import adapter_caller as adapter_caller
from ntk_core._kernel.checks import adapter_model_failure as adapter_model_failure
from ntk_core._kernel.checks import is_nnx_module as is_nnx_module
from ntk_core._kernel.inputs import binds as binds
from ntk_core._kernel.inputs import check_inputs_option as check_inputs_option
from ntk_core._kernel.inputs import inputs_failure as inputs_failure
from ntk_core._kernel.inputs import spread_inputs as spread_inputs
from ntk_core._monte_carlo.kernels import check_init_kwargs, check_inputs, check_samples
from ntk_core._monte_carlo.kernels import initialiser as checked_init
from ntk_core._monte_carlo.kernels import sample_mean as monte_carlo_mean

__all__ = (
    "Caller", "PureModel", "adapter_caller", "adapter_model_failure", "bad", "binds",
    "build_kernel", "cached", "check_apply_kwargs", "check_degree", "check_inputs_option",
    "check_like", "check_monte_carlo", "checked_arguments", "checked_init", "entry_kind",
    "expansion", "input_shape_mismatch", "inputs_failure", "is_nnx_module", "keyed",
    "leaf_path_names", "matrix_free", "monte_carlo_mean", "register_cache", "sketch",
    "spread_inputs", "DeferredInfinite", "Prior", "truncated_normal_moments",
)  # fmt: skip


def checked_arguments(name: str) -> Callable:
    """Decorator: Python's binding errors of the public function ``name`` become a
    TypeError naming it, the valid options and the fix; the signature is unchanged."""
    return lambda fn: _checked_arguments(fn, name)


def check_monte_carlo(
    caller: Caller, x1, x2, key, n_samples, batch_size_samples, options, own=(), init_kwargs=None
) -> dict | None:
    """The Monte Carlo kernels' argument checks: one PRNG ``key``, positive ``n_samples`` and
    ``batch_size_samples``, known ``options`` (``own`` names offered as fixes), x1/x2
    batches; returns ``init_kwargs`` as a dict (``None`` stays ``None``)."""
    check_samples(caller, key, n_samples, batch_size_samples, options, own)
    check_inputs(caller.name, x1, x2)
    return check_init_kwargs(caller.name, init_kwargs)


def check_like(fn_name: str, params, reference, name: str, reference_name: str) -> None:
    """Refuses ``params`` whose tree, leaf shapes or dtypes differ from ``reference``'s
    (TypeError / ValueError naming ``fn_name``, ``name`` and ``reference_name``)."""
    _Point(fn_name, reference, reference_name, reference_name).tangent(params, name)


def matrix_free(statistic: str, kernel, first, x, keywords=None, **arguments):
    """The matrix-free statistic ``statistic`` of Θ(x, x) (``"ntk_trace"``,
    ``"ntk_frobenius_sq"``, ``"ntk_effective_rank"``, ``"ntk_kernel_alignment"``: as
    :mod:`ntk_core.spectrum`'s, same results, errors naming ``kernel.name``) of the model
    of ``kernel``, a kernel function of kind ``"ntk"`` from :func:`build_kernel` (the entry
    point's ``**options``: ``precision``, ``batch_size``, ``wrt``, ``implementation`` for the
    trace; others refused), as ``kernel(first, x, **keywords)`` sees it. ``arguments``: the
    statistic's own, ``key``, ``m``, ``steps``, ``y`` (None: the core's default)."""
    return _matrix_free.of_kernel(statistic, kernel, first, x, keywords or {}, arguments)


def sketch(kernel, *, k: int, key):
    """The sketched eNTK (:func:`ntk_core.ntk_sketch_fn`: definition, variance, cost) of the
    model of ``kernel``, a kernel function of kind ``"ntk"`` from :func:`build_kernel` (the
    entry point's ``**options``: ``trace_axes``, ``batch_size``, ``precision``, ``wrt``;
    others refused; errors naming ``kernel.name``), as its calls see it. Returns
    ``features(first, x, **keywords) -> Φ``, with the kernel function's first argument and
    keywords, whose ``.estimate(first, x1, x2=None, **keywords)`` is the
    :class:`ntk_core.NTKSketch` of :func:`ntk_core.empirical_ntk_sketch`. The same ``key``
    and ``k``: the same map as the core's of the model's ``apply3``."""
    return _sketch.of_kernel(kernel, k, key)
