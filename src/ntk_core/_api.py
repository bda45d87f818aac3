"""Public entry points: ``empirical_ntk``, ``empirical_nngp``, ``ntk_fn``, ``nngp_fn``.

The options (``trace_axes``, ``diagonal_axes``, ``vmap_axes``, ``implementation``,
``precision``, and the blocked engine's ``batch_size``, ``store_on_device``,
``progress``, ``memory_budget``) are described once in :mod:`ntk_core._kernel.options`; every
docstring here points there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from ntk_core._errors import bad
from ntk_core._jax import caches as _caches
from ntk_core._kernel.arguments import _checked_arguments
from ntk_core._kernel.caller import Caller, core
from ntk_core._kernel.checks import check_apply_fn, params_check
from ntk_core._kernel.engine import Engine
from ntk_core._kernel.function import KernelFunction
from ntk_core._kernel.model import from_apply_fn
from ntk_core._kernel.options import DEFAULTS, NTK_OPTION_NAMES, make_options
from ntk_core._kernel.pipeline import Spec

# The public functions of this module, as their messages name them (ntk_core._kernel.caller).
_NTK_FN = core("ntk_fn", built=True)
_NNGP_FN = core("nngp_fn", built=True)
_NTK_PER_LEAF_FN = core("ntk_per_leaf_fn", built=True)
_EMPIRICAL_NTK = core("empirical_ntk")
_EMPIRICAL_NNGP = core("empirical_nngp")
_EMPIRICAL_NTK_PER_LEAF = core("empirical_ntk_per_leaf")
_PLAN = core("plan")

_LAYOUT_DOC = """Returns (for each output leaf of shape ``(N, O_1, ..., O_k)``; a pytree of kernels
    with the output's structure when the output is a pytree) an array of the output's
    dtype whose axes follow the output axes in order: a traced axis is absent, a
    diagonal axis appears once, any other axis twice (x1's then x2's). For outputs
    ``(N, O)``: ``trace_axes=(-1,)`` gives ``(N1, N2)``; ``trace_axes=()`` gives
    ``(N1, N2, O, O)``; ``trace_axes=(), diagonal_axes=(-1,)`` gives ``(N1, N2, O)``;
    ``diagonal_axes=(0,)`` gives ``(N,)``. Traced axes are averaged (divided by their
    size), exactly as neural-tangents 0.6 does.
"""


def _with_layout(fn):
    if fn.__doc__:  # None under python -OO
        fn.__doc__ = fn.__doc__.replace("{layout}", _LAYOUT_DOC.strip())
    return fn


@_with_layout
def ntk_fn(
    apply_fn: Callable,
    *,
    trace_axes=DEFAULTS.trace_axes,
    diagonal_axes=DEFAULTS.diagonal_axes,
    vmap_axes=DEFAULTS.vmap_axes,
    implementation=DEFAULTS.implementation,
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
    """Returns a jitted empirical NTK function ``kernel(params, x1, x2=None)``.

        Θ(x1, x2)[i, j, a, b] = Σ_p ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p, with
        f = ``apply_fn(params, ·)``, reduced over ``trace_axes`` and ``diagonal_axes``.

        The returned callable validates its inputs once per distinct signature (pytree
        structures, shapes, dtypes) and compiles once: calling it again with new ``params``
        or inputs of the same shapes (a training loop) does not recompile.

        Args:
          apply_fn: ``apply_fn(params, x) -> outputs``; ``x`` is a pytree of arrays with
            batch axis 0 of size N, outputs a pytree of floating arrays ``(N, O...)``.
          trace_axes, diagonal_axes, vmap_axes, implementation, precision: see
            :mod:`ntk_core._kernel.options` (defaults ``(-1,)``, ``()``, ``0``, ``"auto"``,
            ``"highest"``).
          batch_size, store_on_device, progress, memory_budget: the blocked engine, see
            :mod:`ntk_core._kernel.options` (defaults ``None``: one call, ``False``, ``None``,
            ``None``). ``batch_size=B`` computes the Gram matrix in tiles of B x B samples
            with features computed once per block (:mod:`ntk_core._blocked.tiles`);
            ``batch_size="auto"`` sizes B from ``memory_budget`` bytes.
          out, resume, overwrite: with a ``batch_size``, the Gram matrix written tile by
            tile into the ``.npy`` file ``out`` (returned memory-mapped, read-only), and
            an interrupted run finished with ``resume=True``; see
            :mod:`ntk_core._kernel.options` and :mod:`ntk_core._blocked.store` (defaults ``None``,
            ``False``, ``False``).
          devices: with a ``batch_size``, the devices whose tiles are computed side by
            side (default ``None``: all local devices; see :mod:`ntk_core._kernel.options`).

        Returns:
          a :class:`~ntk_core.KernelFunction` ``kernel(params, x1, x2=None)`` (with
          ``kernel.plan(...)`` and ``kernel.implementation_for(...)``); ``x2=None``
          means x2 is x1 (the Jacobians are computed once, only tiles on and above
          the diagonal when batched, and the result is exactly symmetric). A
          ``jax.Array`` with ``batch_size=None``; with a batch size, a
          ``numpy.ndarray`` on the host (a ``jax.Array`` with
          ``store_on_device=True``), of the same shape and dtype.

    {layout}

        Raises:
          TypeError: ``apply_fn`` not callable, option of the wrong type, integer params or
            outputs.
          ValueError: invalid option values (the message lists the valid ones), axes out of
            range, duplicated or both traced and diagonal; inputs with no samples, with
            inconsistent batch sizes or per-sample shapes; the model failing on x1; NaN
            or Inf in x1 or x2 (the message names the first such sample); a kernel that
            comes out non-finite from finite inputs (the message names the tile and the
            first entry, and the likely causes).

        Cost: ``"jacobian"``: (N1 + N2)·O reverse passes, memory (N1 + N2)·O·P, and
        N1·N2·O'·P multiply-adds; ``"ntvp"``: N1·N2·O forward-mode passes, memory O·P
        (see :mod:`ntk_core._impl.cost`). Batched: the same work (about half the pairs when
        x2 is None), device memory F·(B1 + B2) + F·B2·c + 2·W·B1·B2 for features of
        the blocks in use and kept, and one tile (:mod:`ntk_core._blocked.tiles`), and the
        N1·N2·O'-entry result on the host. Checks: one reduction per input leaf and per
        result tile for NaN/Inf.

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
    return _make("ntk", _NTK_FN, apply_fn, locals())


def _make(kind: str, caller: Caller, apply_fn, options: dict) -> KernelFunction:
    """The kernel function of ``apply_fn`` for the public function ``caller``."""
    fn_name = caller.name
    check_apply_fn(fn_name, apply_fn)
    opts = make_options(fn_name, **{k: v for k, v in options.items() if k != "apply_fn"})
    check = params_check(fn_name, apply_fn)
    engine = Engine(Spec(fn_name, kind, from_apply_fn(apply_fn), opts, check, caller=caller))

    def bind(params, x1, unexpected):
        if unexpected:
            what = f"got the keyword argument(s) {', '.join(map(repr, sorted(unexpected)))}"
            fix = f"give options to {fn_name}(apply_fn, ...), model arguments through apply_fn"
            raise bad(TypeError, f"{fn_name}(...)(params, x1, x2)", what, fix)
        return params, None

    return KernelFunction(engine, bind, _CORE_SIGNATURE)


def _core_kernel(params, x1, x2=None):
    """The signature of the core's kernel functions."""


_CORE_SIGNATURE = inspect.signature(_core_kernel)


@_with_layout
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

        K(x1, x2)[i, j, a, b] = f_a(x1_i) · f_b(x2_j), reduced over ``trace_axes`` and
        ``diagonal_axes`` exactly as the NTK (same layout, same normalisation).

        Args:
          apply_fn: ``apply_fn(params, x) -> outputs`` as in :func:`ntk_fn`.
          trace_axes, diagonal_axes, vmap_axes, precision: see :mod:`ntk_core._kernel.options`.
            One forward pass on each batch is enough whatever ``vmap_axes`` says.
          batch_size, store_on_device, progress, memory_budget, out, resume, overwrite,
            devices: the blocked engine, as in :func:`ntk_fn` (the features of a block are its
            outputs).

        Returns:
          a :class:`~ntk_core.KernelFunction` ``kernel(params, x1, x2=None)``.

    {layout}

        Raises:
          TypeError, ValueError: as :func:`ntk_fn`.

        Cost: one forward pass on x1 and on x2, and N1·N2·O' multiply-adds; batched,
        memory as :func:`ntk_fn` with F = O output values per sample.

        Example:
          >>> import jax.numpy as jnp
          >>> import ntk_core
          >>> kernel = ntk_core.nngp_fn(lambda w, x: x @ w)
          >>> kernel(jnp.ones((3, 2)), jnp.ones((4, 3)))[0, 0]
          Array(9., dtype=float32)

        References:
          Lee et al., "Deep Neural Networks as Gaussian Processes", ICLR 2018.
    """
    return _make("nngp", _NNGP_FN, apply_fn, locals())


@_caches.lru_cache(maxsize=64)
def _cached(kind, caller: Caller, apply_fn, items: tuple) -> Callable:
    return _make(kind, caller, apply_fn, dict(items))


def _get(kind, caller: Caller, apply_fn, options: dict) -> Callable:
    """``_make`` with an LRU cache keyed by ``(apply_fn, options)`` when hashable."""
    items = tuple(sorted(options.items()))
    try:
        hash((apply_fn, items))
    except TypeError:
        return _make(kind, caller, apply_fn, options)
    return _cached(kind, caller, apply_fn, items)


def _options(arguments: dict) -> dict:
    """The kernel options among a function's arguments, lists frozen to tuples."""
    return {
        k: tuple(v) if isinstance(v, list) else v
        for k, v in arguments.items()
        if k in NTK_OPTION_NAMES
    }


@_with_layout
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
    batch_size=DEFAULTS.batch_size,
    store_on_device=DEFAULTS.store_on_device,
    progress=DEFAULTS.progress,
    memory_budget=DEFAULTS.memory_budget,
    out=DEFAULTS.out,
    resume=DEFAULTS.resume,
    overwrite=DEFAULTS.overwrite,
    devices=DEFAULTS.devices,
):
    """Empirical NTK of ``apply_fn`` at ``params`` between x1 and x2 (x1 if None).

    The one-call form of :func:`ntk_fn`: the compiled function is cached per
    ``(apply_fn, options)``, so repeated calls with the same ``apply_fn`` object and
    shapes do not recompile.

    Args:
      apply_fn: ``apply_fn(params, x)``.
      params: pytree of floating arrays (total size P).
      x1: pytree of arrays with batch axis 0 of size N1.
      x2: ``None`` (x2 is x1) or a pytree like x1 with N2 samples.
      trace_axes, diagonal_axes, vmap_axes, implementation, precision: see
        :mod:`ntk_core._kernel.options`.
      batch_size, store_on_device, progress, memory_budget, out, resume, overwrite,
        devices: the blocked engine, as in :func:`ntk_fn`.

    {layout}

    Raises:
      TypeError, ValueError: as :func:`ntk_fn`.

    Cost: as :func:`ntk_fn` (per implementation, in passes over the model and memory in
    N1, N2, O, P), plus one cache look-up.

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

    References:
      Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Novak,
      Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
    """
    return _get("ntk", _EMPIRICAL_NTK, apply_fn, _options(locals()))(params, x1, x2)


@_with_layout
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
    """Empirical NNGP kernel f(x1)·f(x2) of ``apply_fn`` at ``params``.

    The one-call form of :func:`nngp_fn` (compiled function cached per
    ``(apply_fn, options)``).

    Args:
      apply_fn, params, x1 (N1 samples), x2 (N2 samples or ``None``), and the options
      (``batch_size`` etc.): as :func:`empirical_ntk` (no ``implementation``).

    {layout}

    Raises:
      TypeError, ValueError: as :func:`nngp_fn`.

    Cost: as :func:`nngp_fn`: one forward pass on x1 and on x2, N1·N2·O' multiply-adds.

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> ntk_core.empirical_nngp(lambda w, x: x @ w, jnp.ones((3, 2)), jnp.eye(3)).shape
      (3, 3)

    References:
      Lee et al., "Deep Neural Networks as Gaussian Processes", ICLR 2018.
    """
    return _get("nngp", _EMPIRICAL_NNGP, apply_fn, _options(locals()))(params, x1, x2)


def ntk_per_leaf_fn(
    apply_fn: Callable,
    *,
    trace_axes=DEFAULTS.trace_axes,
    diagonal_axes=DEFAULTS.diagonal_axes,
    vmap_axes=DEFAULTS.vmap_axes,
    implementation=DEFAULTS.implementation,
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
    """Returns a jitted function ``kernel(params, x1, x2=None)`` of the NTK split by leaf.

    Θ_l(x1, x2)[i, j, a, b] = Σ_{p in leaf l} ∂f_a(x1_i)/∂θ_p · ∂f_b(x2_j)/∂θ_p, so
    that Σ_l Θ_l = Θ, the NTK of :func:`ntk_fn`. Shows which layers drive the kernel.

    Args:
      apply_fn: ``apply_fn(params, x)``, as in :func:`ntk_fn`.
      trace_axes, diagonal_axes, vmap_axes, precision: see :mod:`ntk_core._kernel.options`.
      implementation: ``"auto"``, ``"jacobian"`` or ``"structured"`` (NTK-vector
        products do not separate the leaves).
      batch_size, store_on_device, progress, memory_budget: the blocked engine, as in
        :func:`ntk_fn` (every leaf's kernel is assembled tile by tile); ``out`` only
        where the result is one array (params of one leaf).

    Returns:
      a :class:`~ntk_core.KernelFunction` ``kernel(params, x1, x2=None)`` returning a
      pytree shaped like ``params`` whose leaves are kernels in the layout of
      :func:`ntk_fn` (``(N1, N2)`` by default; pytrees of kernels when the output is a
      pytree).

    Raises:
      TypeError, ValueError: as :func:`ntk_fn`, and ``implementation="ntvp"``.

    Cost: as :func:`ntk_fn` with the same implementation (the per-leaf terms are what
    it sums), plus the memory of L kernels instead of one.

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> f = lambda p, x: x @ p["w"] + p["b"]
      >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
      >>> k = ntk_core.ntk_per_leaf_fn(f)(params, jnp.eye(3))
      >>> k["b"].shape, float(k["w"][0, 0]), float(k["b"][0, 0])
      ((3, 3), 1.0, 1.0)

    References:
      Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Novak,
      Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
    """
    return _make("ntk_per_leaf", _NTK_PER_LEAF_FN, apply_fn, locals())


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
    batch_size=DEFAULTS.batch_size,
    store_on_device=DEFAULTS.store_on_device,
    progress=DEFAULTS.progress,
    memory_budget=DEFAULTS.memory_budget,
    out=DEFAULTS.out,
    resume=DEFAULTS.resume,
    overwrite=DEFAULTS.overwrite,
    devices=DEFAULTS.devices,
):
    """The NTK split by parameter leaf: a pytree shaped like ``params`` of kernels.

    The one-call form of :func:`ntk_per_leaf_fn` (compiled function cached per
    ``(apply_fn, options)``); its leaves sum to :func:`empirical_ntk`.

    Args:
      apply_fn, params (total size P), x1 (N1 samples), x2 (N2 samples or ``None``), and
      the options (``batch_size`` etc.): as :func:`empirical_ntk`.

    Returns:
      A pytree shaped like ``params`` of kernels in the layout of :func:`empirical_ntk`
      (``(N1, N2)`` by default).

    Raises:
      TypeError, ValueError: as :func:`ntk_per_leaf_fn`.

    Cost: as :func:`ntk_per_leaf_fn`.

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> f = lambda p, x: x @ p["w"]
      >>> ntk_core.empirical_ntk_per_leaf(f, {"w": jnp.ones((3, 2))}, jnp.eye(3))["w"].shape
      (3, 3)

    References:
      Jacot, Gabriel, Hongler, "Neural Tangent Kernel", NeurIPS 2018; Novak,
      Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel", ICML 2022.
    """
    options = _options(locals())
    return _get("ntk_per_leaf", _EMPIRICAL_NTK_PER_LEAF, apply_fn, options)(params, x1, x2)


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
    batch_size=DEFAULTS.batch_size,
    store_on_device=DEFAULTS.store_on_device,
    progress=DEFAULTS.progress,
    memory_budget=DEFAULTS.memory_budget,
):
    """What :func:`empirical_ntk` with these arguments would do, without computing it.

    Returns a ``Plan`` with ``implementation`` (what ``"auto"`` chose, or the one asked
    for), ``estimates`` (analytic FLOPs and feature memory in bytes of each
    implementation considered, from the shapes; see :mod:`ntk_core._impl.cost`) and
    ``leaves``: for each parameter leaf its path, size P_l and method: ``"structured
    (k matrix products)"``, ``"structured (k convolutions)"``, ``"structured (embedding
    gather)"``, ``"structured (bias fused with its matrix product)"`` (or ``... its
    convolution``), ``"structured (elementwise scale, per-sample Jacobian)"`` (``x *
    s``: LayerNorm / BatchNorm scales), ``"structured (elementwise shift, per-sample
    Jacobian)"`` (``x + b`` not fused with a product: LayerNorm / BatchNorm biases), with
    ``", per-sample Jacobian"`` when the leaf's Jacobian is formed from its recorded
    inputs and cotangents because that is cheaper than the Gram form for these shapes;
    ``"jacobian (fallback: <reason>)"`` for a leaf no rule covers, the reason naming
    what stopped the rules (e.g. ``used by tanh, which no rule covers`` for a parameter
    inside a nonlinearity, ``the kernel of a grouped or depthwise convolution``, ``cast
    to a lower precision (float32 -> bfloat16, ...)``, ``used inside a loop (scan)``,
    ``not used by the model``) and, where JAX recorded it, the user's line that did
    (``...; at model.py:12, in MLP.__call__``); ``"jacobian"`` or ``"ntvp"`` when
    another implementation runs,
    with ``leaf.structured`` the method ``"structured"`` would use for that leaf (``""``
    with ``vmap_axes=None``, where it cannot run). ``print(plan)`` shows a table.
    Arguments as :func:`empirical_ntk` (x1 with N1 samples, x2 with N2 or ``None``); the
    estimates count N1·N2 pairs (N1 on the batch diagonal).

    Args:
      apply_fn, params, x1, x2, trace_axes, diagonal_axes, vmap_axes, implementation,
      precision: as :func:`empirical_ntk`.
      batch_size, store_on_device, progress, memory_budget: the blocked engine, as
        :func:`empirical_ntk`; with a ``batch_size`` the plan shows its tiles
        (``plan.tiling``: block sizes, tile count, memory budget).

    Returns:
      A ``Plan`` (see above); ``str(plan)`` is its table.

    Raises:
      TypeError, ValueError: as :func:`ntk_fn`.

    Cost: one abstract trace of the model and the independence probe (two small forward
    passes); no kernel is computed.

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

    References:
      Novak, Sohl-Dickstein, Schoenholz, "Fast Finite Width Neural Tangent Kernel",
      ICML 2022 (the implementations and their costs).
    """
    return _get("ntk", _PLAN, apply_fn, _options(locals())).plan(params, x1, x2)


empirical_ntk = _checked_arguments(empirical_ntk)
empirical_nngp = _checked_arguments(empirical_nngp)
empirical_ntk_per_leaf = _checked_arguments(empirical_ntk_per_leaf)
ntk_fn = _checked_arguments(ntk_fn)
nngp_fn = _checked_arguments(nngp_fn)
ntk_per_leaf_fn = _checked_arguments(ntk_per_leaf_fn)
plan = _checked_arguments(plan)
