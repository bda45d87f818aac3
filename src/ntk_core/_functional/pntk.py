"""The pseudo-NTK (pNTK): the NTK of the outputs' sum over √O, an N1 x N2 kernel at the cost
of one output (Mohamadi, Bae, Sutherland, "A Fast, Well-Founded Approximation to the
Empirical Neural Tangent Kernel", ICML 2023)."""

from __future__ import annotations

from collections.abc import Callable

from ntk_core._api import _get, _make
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._kernel.caller import core
from ntk_core._kernel.checks import check_apply_fn
from ntk_core._kernel.function import KernelFunction
from ntk_core._kernel.model import flat_outputs
from ntk_core._kernel.options import DEFAULTS
from ntk_core._kernel.pipeline import Kind


def pntk_fn(
    apply_fn: Callable,
    *,
    diagonal_axes=DEFAULTS.diagonal_axes,
    vmap_axes=DEFAULTS.vmap_axes,
    implementation=DEFAULTS.implementation,
    precision=DEFAULTS.precision,
    wrt=DEFAULTS.wrt,
    batch_size=DEFAULTS.batch_size,
    store_on_device=DEFAULTS.store_on_device,
    progress=DEFAULTS.progress,
    memory_budget=DEFAULTS.memory_budget,
    out=DEFAULTS.out,
    resume=DEFAULTS.resume,
    overwrite=DEFAULTS.overwrite,
    devices=DEFAULTS.devices,
) -> KernelFunction:
    """Returns a jitted pseudo-NTK function ``kernel(params, x1, x2=None)``.

    pNTK(x1, x2)[i, j] = (1/O) Σ_a Σ_b Θ(x1, x2)[i, j, a, b]: the NTK of g = Σ_a f_a / √O,
    f = ``apply_fn(params, ·)`` with O outputs per sample (all output leaves, flattened).
    Against the traced eNTK (``trace_axes=(-1,)``, the mean (1/O) Σ_a Θ[i, j, a, a]) it adds
    the off-diagonal blocks (1/O) Σ_(a≠b) Θ[i, j, a, b], which vanish for wide networks at
    initialisation; ``Θ[i, j, a, b] ≈ δ_ab · pNTK[i, j]`` is the approximation the paper
    bounds. On the suite's MLP 5-32-3 (N = 6) the two differ by 2.4 % of max |pNTK|
    (tests/core/test_pntk.py).

    Args and options: as :func:`ntk_core.ntk_fn` but without ``trace_axes`` (the output of
    g is one number per sample); ``diagonal_axes=(0,)`` gives the ``(N,)`` diagonal.

    Returns: ``(N1, N2)`` (``(N1,)`` with ``diagonal_axes=(0,)``), the dtype of the outputs.
    Raises: as :func:`ntk_core.ntk_fn`.
    Cost: that of an NTK with O = 1: an O-fold cut of the Jacobian work and of the
    kernel's memory against ``trace_axes=()`` (N1·N2 instead of N1·N2·O²).

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> kernel = ntk_core.pntk_fn(lambda w, x: x @ w)     # O = 2 outputs per sample
      >>> kernel(jnp.ones((3, 2)), jnp.eye(3)).round(4).tolist()  # Θ[i, j, a, b] = δ_ij δ_ab
      [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]

    References: Mohamadi, Bae, Sutherland, ICML 2023 (arXiv:2206.12543).
    """
    options = {k: v for k, v in locals().items() if k != "apply_fn"} | {"trace_axes": ()}
    return _make(Kind.NTK, core(pntk_fn.__name__, built=True), _of(pntk_fn, apply_fn), options)


def _of(entry: Callable, apply_fn: Callable) -> Callable:
    check_apply_fn(entry.__name__, apply_fn)
    return flat_outputs(apply_fn, summed=True)


def empirical_pntk(
    apply_fn: Callable,
    params,
    x1,
    x2=None,
    *,
    diagonal_axes=DEFAULTS.diagonal_axes,
    vmap_axes=DEFAULTS.vmap_axes,
    implementation=DEFAULTS.implementation,
    precision=DEFAULTS.precision,
    wrt=DEFAULTS.wrt,
    batch_size=DEFAULTS.batch_size,
    store_on_device=DEFAULTS.store_on_device,
    progress=DEFAULTS.progress,
    memory_budget=DEFAULTS.memory_budget,
    out=DEFAULTS.out,
    resume=DEFAULTS.resume,
    overwrite=DEFAULTS.overwrite,
    devices=DEFAULTS.devices,
):
    """The one-call form of :func:`pntk_fn` (definition, layout, errors, cost there):
    ``(N1, N2)`` pseudo-NTK of ``apply_fn`` at ``params`` between x1 and x2 (``None``: x1).

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> k = ntk_core.empirical_pntk(lambda w, x: x @ w, jnp.ones((3, 2)), jnp.ones((2, 3)))
      >>> k.round(4).tolist()                               # (1/2)·Σ_ab δ_ab·(x_i · x_j)
      [[3.0, 3.0], [3.0, 3.0]]
    """
    options = {k: v for k, v in locals().items() if k not in ("apply_fn", "params", "x1", "x2")}
    options.update(trace_axes=())
    caller = core(empirical_pntk.__name__)
    return _get(Kind.NTK, caller, _of(empirical_pntk, apply_fn), options)(params, x1, x2)


pntk_fn = _checked_arguments(pntk_fn)
empirical_pntk = _checked_arguments(empirical_pntk)
