"""The core's entry points; the options are described in :mod:`ntk_core._kernel.options`."""

from __future__ import annotations

from collections.abc import Callable

from ntk_core._errors import bad
from ntk_core._jax.caches import cached
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._kernel.caller import Caller, core
from ntk_core._kernel.checks import check_apply_fn, params_check
from ntk_core._kernel.engine import Engine
from ntk_core._kernel.function import SIGNATURE, KernelFunction
from ntk_core._kernel.model import from_apply_fn
from ntk_core._kernel.options import DEFAULTS, NTK_OPTION_NAMES, make_options
from ntk_core._kernel.pipeline import Kind, Spec


def ntk_fn(
    apply_fn: Callable,
    *,
    trace_axes=DEFAULTS.trace_axes,
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
    """Returns a jitted empirical NTK function ``kernel(params, x1, x2=None)``.

    Θ(x1, x2)[i, j, a, b] = Σ_p ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p, f = ``apply_fn(params, ·)``.
    Validated and compiled once per input signature: new params or inputs of the same
    shapes (a training loop) do not recompile.

    Args:
      apply_fn: ``apply_fn(params, x) -> outputs``; x a pytree of arrays with batch axis 0
        of size N, outputs a pytree of floating arrays ``(N, O...)``.
        Several per-sample inputs (ids, mask): x a tuple or dict of them, unpacked by apply_fn.
      trace_axes, diagonal_axes, vmap_axes, implementation, precision, wrt, batch_size,
        store_on_device, progress, memory_budget, out, resume, overwrite, devices: the
        options (:mod:`ntk_core._kernel.options`); ``wrt``: a parameter subset (path names
        or a predicate on key paths; P below is then the subset's size); ``batch_size=B``:
        B x B tiles (``"auto"``: B from ``memory_budget``); ``out``: into an ``.npy`` file
        (memory-mapped, read-only).

    Returns:
      a :class:`~ntk_core.KernelFunction` ``kernel(params, x1, x2=None)`` (``x2=None``: x1,
      Jacobians once, exactly symmetric) returning a ``jax.Array``; with a batch size a host
      ``numpy.ndarray`` (``jax.Array`` with ``store_on_device=True``). Per output leaf
      ``(N, O_1, ..., O_k)``, in its dtype: a traced axis is absent (averaged, as
      neural-tangents 0.6), a diagonal axis appears once, any other twice (x1's, x2's).
      Outputs ``(N, O)``: ``trace_axes=(-1,)`` -> ``(N1, N2)``; ``trace_axes=()`` ->
      ``(N1, N2, O, O)``; ``diagonal_axes=(-1,)`` -> ``(N1, N2, O)``; ``(0,)`` -> ``(N,)``.

    Raises:
      TypeError: ``apply_fn`` not callable, an option of the wrong type, integer params
        or outputs; ``wrt`` neither None, a callable nor path names.
      ValueError: a ``wrt`` selecting no parameter or naming one that does not exist;
        invalid option values, axes out of range, duplicated or both traced and
        diagonal; empty inputs, inconsistent batch sizes or per-sample shapes; the model
        failing on x1; a non-finite kernel (the message names the tile, the entry, causes);
        a call that cannot fit in memory (docs/errors.md#out-of-memory); integer ids in x1
        or x2 outside [-V, V) of a V-row table the model looks up (naming the input, the
        sample, the id; checked on every call, not under an outer ``jax.jit``:
        docs/errors.md#embedding-ids).
      NonFiniteError: NaN or Inf in x1 or x2 (naming the first such sample).

    Cost: ``"jacobian"``: (N1 + N2)·O reverse passes, memory (N1 + N2)·O·P, N1·N2·O'·P
    multiply-adds; ``"ntvp"``: N1·N2·O forward passes, memory O·P (:mod:`ntk_core._impl.cost`).
    Batched: the same work (half the pairs with x2=None), device memory
    F·(B1 + B2) + F·B2·c + 2·W·B1·B2 (:mod:`ntk_core._blocked.tiles`), the result on the host.

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> apply_fn = lambda w, x: jnp.tanh(x @ w)
      >>> kernel = ntk_core.ntk_fn(apply_fn, trace_axes=())
      >>> kernel(jnp.ones((3, 2)), jnp.ones((4, 3))).shape
      (4, 4, 2, 2)
      >>> tiled = ntk_core.ntk_fn(apply_fn, batch_size=2)  # 2 x 2 tiles, any N
      >>> k = tiled(jnp.ones((3, 2)), jnp.ones((5, 3)))
      >>> type(k).__name__, k.shape
      ('ndarray', (5, 5))

    References:
      Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Novak,
      Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
    """
    return _make(Kind.NTK, core(ntk_fn.__name__, built=True), apply_fn, locals())


def _make(kind: Kind, caller: Caller, apply_fn, options: dict) -> KernelFunction:
    """The kernel function of ``apply_fn`` for the public function ``caller``."""
    fn_name, kind = caller.name, Kind(kind)
    check_apply_fn(fn_name, apply_fn)
    opts = make_options(fn_name, **_options(options))
    check = params_check(fn_name, apply_fn)
    engine = Engine(Spec(fn_name, kind, from_apply_fn(apply_fn), opts, check, caller=caller))

    def bind(params, x1, unexpected):
        if unexpected:
            what = f"got the keyword argument(s) {', '.join(map(repr, sorted(unexpected)))}"
            fix = f"give options to {fn_name}(apply_fn, ...), model arguments through apply_fn"
            raise bad(TypeError, f"{fn_name}(...)(params, x1, x2)", what, fix)
        return params, None

    return KernelFunction(engine, bind, SIGNATURE)


def nngp_fn(
    apply_fn: Callable,
    *,
    trace_axes=DEFAULTS.trace_axes,
    diagonal_axes=DEFAULTS.diagonal_axes,
    vmap_axes=DEFAULTS.vmap_axes,
    precision=DEFAULTS.precision,
    batch_size=DEFAULTS.batch_size,
    store_on_device=DEFAULTS.store_on_device,
    progress=DEFAULTS.progress,
    memory_budget=DEFAULTS.memory_budget,
    out=DEFAULTS.out,
    resume=DEFAULTS.resume,
    overwrite=DEFAULTS.overwrite,
    devices=DEFAULTS.devices,
) -> KernelFunction:
    """Returns a jitted empirical NNGP function ``kernel(params, x1, x2=None)``.

    K(x1, x2)[i, j, a, b] = f_a(x1_i) · f_b(x2_j), in the layout of :func:`ntk_fn`.
    Arguments, options (no ``implementation``, no ``wrt``), return and errors as :func:`ntk_fn`.

    Cost: one forward pass on x1 and on x2, N1·N2·O' multiply-adds; batched, memory as
    :func:`ntk_fn` with F = O outputs per sample.

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> kernel = ntk_core.nngp_fn(lambda w, x: x @ w)
      >>> kernel(jnp.ones((3, 2)), jnp.ones((4, 3)))[0, 0]
      Array(9., dtype=float32)

    References:
      Lee et al., "Deep Neural Networks as Gaussian Processes", ICLR 2018.
    """
    return _make(Kind.NNGP, core(nngp_fn.__name__, built=True), apply_fn, locals())


def _get(kind, caller: Caller, apply_fn, options: dict) -> Callable:
    """``_make``, cached by ``(kind, caller, apply_fn, options)`` when hashable."""
    return cached((kind, caller, apply_fn, options), lambda: _make(kind, caller, apply_fn, options))


def _options(arguments: dict) -> dict:
    """The kernel options among a function's arguments."""
    return {k: v for k, v in arguments.items() if k in NTK_OPTION_NAMES}


def empirical_ntk(
    apply_fn: Callable,
    params,
    x1,
    x2=None,
    *,
    trace_axes=DEFAULTS.trace_axes,
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
    """Empirical NTK of ``apply_fn`` at ``params`` (pytree, total size P) between x1 (N1
    samples) and x2 (N2 samples; ``None``: x1).

    The one-call form of :func:`ntk_fn` (options, layout, errors, cost there), compiled
    once per ``(apply_fn, options)``.

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> k = ntk_core.empirical_ntk(lambda w, x: x @ w, jnp.ones((3, 2)), jnp.eye(3))
      >>> k.shape
      (3, 3)
      >>> k8 = ntk_core.empirical_ntk(lambda w, x: x @ w, jnp.ones((3, 2)), jnp.ones((37, 3)),
      ...                             batch_size=8)  # tiles of 8 x 8, the last ragged
      >>> k8.shape, float(k8[36, 0])
      ((37, 37), 3.0)
    """
    return _get(Kind.NTK, core(empirical_ntk.__name__), apply_fn, _options(locals()))(
        params, x1, x2
    )


def empirical_nngp(
    apply_fn: Callable,
    params,
    x1,
    x2=None,
    *,
    trace_axes=DEFAULTS.trace_axes,
    diagonal_axes=DEFAULTS.diagonal_axes,
    vmap_axes=DEFAULTS.vmap_axes,
    precision=DEFAULTS.precision,
    batch_size=DEFAULTS.batch_size,
    store_on_device=DEFAULTS.store_on_device,
    progress=DEFAULTS.progress,
    memory_budget=DEFAULTS.memory_budget,
    out=DEFAULTS.out,
    resume=DEFAULTS.resume,
    overwrite=DEFAULTS.overwrite,
    devices=DEFAULTS.devices,
):
    """Empirical NNGP kernel f(x1)·f(x2) of ``apply_fn`` at ``params``: the one-call
    form of :func:`nngp_fn`, arguments as :func:`empirical_ntk`.

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> ntk_core.empirical_nngp(lambda w, x: x @ w, jnp.ones((3, 2)), jnp.eye(3)).shape
      (3, 3)
    """
    return _get(Kind.NNGP, core(empirical_nngp.__name__), apply_fn, _options(locals()))(
        params, x1, x2
    )


def ntk_per_leaf_fn(
    apply_fn: Callable,
    *,
    trace_axes=DEFAULTS.trace_axes,
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
    """Returns a jitted function ``kernel(params, x1, x2=None)`` of the NTK split by leaf.

    Θ_l(x1, x2)[i, j, a, b] = Σ_{p in leaf l} ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p; Σ_l Θ_l is
    the NTK of :func:`ntk_fn`, whose arguments, options and errors it takes, except
    ``implementation="ntvp"`` (ValueError: it does not separate leaves); ``out`` only
    for params of one leaf.

    Returns:
      a :class:`~ntk_core.KernelFunction` returning a pytree shaped like ``params`` of
      kernels in the layout of :func:`ntk_fn`.

    Cost: as :func:`ntk_fn` (the per-leaf terms are what it sums), plus memory of L kernels.

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> f = lambda p, x: x @ p["w"] + p["b"]
      >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
      >>> k = ntk_core.ntk_per_leaf_fn(f)(params, jnp.eye(3))
      >>> k["b"].shape, float(k["w"][0, 0]), float(k["b"][0, 0])
      ((3, 3), 1.0, 1.0)
    """
    return _make(Kind.NTK_PER_LEAF, core(ntk_per_leaf_fn.__name__, built=True), apply_fn, locals())


def empirical_ntk_per_leaf(
    apply_fn: Callable,
    params,
    x1,
    x2=None,
    *,
    trace_axes=DEFAULTS.trace_axes,
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
    """The NTK split by parameter leaf: the one-call form of :func:`ntk_per_leaf_fn`,
    arguments as :func:`empirical_ntk`; its leaves sum to :func:`empirical_ntk`.

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> f = lambda p, x: x @ p["w"]
      >>> ntk_core.empirical_ntk_per_leaf(f, {"w": jnp.ones((3, 2))}, jnp.eye(3))["w"].shape
      (3, 3)
    """
    options = _options(locals())
    return _get(Kind.NTK_PER_LEAF, core(empirical_ntk_per_leaf.__name__), apply_fn, options)(
        params, x1, x2
    )


def plan(
    apply_fn: Callable,
    params,
    x1,
    x2=None,
    *,
    trace_axes=DEFAULTS.trace_axes,
    diagonal_axes=DEFAULTS.diagonal_axes,
    vmap_axes=DEFAULTS.vmap_axes,
    implementation=DEFAULTS.implementation,
    precision=DEFAULTS.precision,
    wrt=DEFAULTS.wrt,
    batch_size=DEFAULTS.batch_size,
    store_on_device=DEFAULTS.store_on_device,
    progress=DEFAULTS.progress,
    memory_budget=DEFAULTS.memory_budget,
):
    """What :func:`empirical_ntk` with these arguments would do, without computing it.

    Returns a ``Plan``: ``implementation`` (what ``"auto"`` chose), ``estimates`` (analytic
    FLOPs and feature bytes per implementation, for N1·N2 pairs; :mod:`ntk_core._impl.cost`),
    ``tiling`` with a ``batch_size``, and ``leaves``: per parameter leaf its path, size and
    method, e.g. ``"structured (k matrix products)"`` / ``(k convolutions)`` / ``(embedding
    gather)`` / ``(bias fused with its matrix product)`` / ``(elementwise scale|shift,
    per-sample Jacobian)``, or ``"jacobian (fallback: <reason>)"`` naming what stopped the
    rules and the user's line; ``leaf.structured``: what ``"structured"`` would use.
    ``print(plan)`` shows a table. Arguments and errors as :func:`empirical_ntk`.

    Cost: one abstract trace and the independence probe (two small forward passes).

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> p = ntk_core.plan(lambda w, x: x @ w["w"] + w["b"],
      ...                   {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}, jnp.ones((4, 3)))
      >>> p.implementation
      'structured'
      >>> for leaf in p.leaves:
      ...     print(leaf.path, leaf.size, leaf.method)
      ['b'] 2 structured (bias fused with its matrix product)
      ['w'] 6 structured (1 matrix product)
    """
    return _get(Kind.NTK, core(plan.__name__), apply_fn, _options(locals())).plan(params, x1, x2)


empirical_ntk = _checked_arguments(empirical_ntk)
empirical_nngp = _checked_arguments(empirical_nngp)
empirical_ntk_per_leaf = _checked_arguments(empirical_ntk_per_leaf)
ntk_fn = _checked_arguments(ntk_fn)
nngp_fn = _checked_arguments(nngp_fn)
ntk_per_leaf_fn = _checked_arguments(ntk_per_leaf_fn)
plan = _checked_arguments(plan)
