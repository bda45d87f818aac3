"""The blocked Gram engine: x1 cut into row blocks and x2 into column blocks of B samples
(the last one padded by repeating its last sample, unless ``vmap_axes=None``), the kernel
computed tile by tile from each block's features (computed once per band of cached column
blocks), with x2=None only tiles j >= i (mirrored), each checked for NaN/Inf on the device.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ntk_core._blocked.barrier import barrier
from ntk_core._blocked.progress import NO_BAR, progress_bar
from ntk_core._errors import NonFiniteError, bad
from ntk_core._impl.registry import PHASES
from ntk_core._jax.memory import bytes_limit
from ntk_core._kernel import checks as _checks
from ntk_core._kernel.layout import leaf_layouts, swap_perm
from ntk_core._kernel.options import AUTO_BATCH_SIZE, DEFAULT_MEMORY_BUDGET
from ntk_core._units import human_bytes


def default_memory_budget() -> int:
    """Half of the device allocator's byte limit where JAX reports one, else 1 GiB."""
    limit = bytes_limit(jax.local_devices()[0])
    return limit // 2 if limit else DEFAULT_MEMORY_BUDGET


#: With x2=None, ``"auto"`` makes at least this many blocks of at least AUTO_MIN_BATCH samples
#: (with k blocks (k + 1) / 2k of the pairs are computed).
AUTO_SYMMETRIC_BLOCKS, AUTO_MIN_BATCH = 8, 512


def auto_batch_size(n1, n2, feature_bytes, pair_bytes, budget, batch_diagonal, symmetric=False):
    """The largest B in [1, N] with ``2·F·B + W·B² ≤ budget`` (``2·F·B + W·B`` on the batch
    diagonal), F feature bytes per sample, W working bytes per pair (the tile and its
    temporaries), N = max(n1, n2); with ``symmetric`` (x2=None) at most
    ``max(AUTO_MIN_BATCH, ceil(N / AUTO_SYMMETRIC_BLOCKS))``. Then evened out:
    ``ceil(N / k)`` for the k blocks it gives. The device then holds about
    ``F·(B1 + B2) + F·B2·c + 2·W·B1·B2`` (c cached column blocks; + the output with
    ``store_on_device``)."""
    f, w, m = float(feature_bytes), float(max(pair_bytes, 1)), float(max(budget, 0))
    b = m / (2 * f + w) if batch_diagonal else (-2 * f + math.sqrt(4 * f * f + 4 * w * m)) / (2 * w)
    n = max(n1, n2)
    b = int(max(1, min(math.floor(b), n)))
    if symmetric and not batch_diagonal:
        b = min(b, max(AUTO_MIN_BATCH, -(-n // AUTO_SYMMETRIC_BLOCKS)))
    return -(-n // -(-n // b))


def _n_samples(x) -> int:
    return int(np.shape(jax.tree.leaves(x)[0])[0])


def _take(x, start: int, stop: int, size: int):
    """Samples ``start:stop`` of every leaf, padded to ``size`` by repeating the last."""
    if stop - start == size:
        return jax.tree.map(lambda v: v[start:stop], x)
    idx = np.minimum(np.arange(start, start + size), stop - 1)
    return jax.tree.map(lambda v: v[idx], x)


def _blocks(n: int, b: int) -> list[tuple[int, int]]:
    return [(s, min(s + b, n)) for s in range(0, n, b)]


def _symmetric_leaf(k, layout):
    """(K + Kᵀ)·½, Kᵀ with each pair's x1 and x2 axes swapped. Exact only when K is an
    input of the program (``_impl.phases._MIRROR`` runs it alone): fused with the
    contraction, XLA may round K[i, j] and K[j, i] differently; the barriers keep the
    halving from becoming an FMA of the sum."""
    k = barrier(k)
    total = barrier(k + jnp.transpose(k, swap_perm(layout)))
    return total * jnp.asarray(0.5, k.dtype)


def symmetrize(kernel, config):
    """Θ(x, x) made exactly symmetric (no-op on the per-sample batch diagonal)."""
    if config.layouts[0].batch_diagonal:
        return kernel
    leaves, treedef = jax.tree.flatten(kernel)
    pairs = zip(leaves, leaf_layouts(config), strict=True)
    return jax.tree.unflatten(treedef, [_symmetric_leaf(k, layout) for k, layout in pairs])


#: Kernels up to this size on a CPU device are mirrored by numpy, the same (K + Kᵀ)·½
#: without compiling a program per shape (0.03-0.05 s of a first call; numpy's ~1 ms per
#: 4 MB is the compiled program's run time).
HOST_MIRROR_BYTES = 2**26


def mirror(kernel, config, compiled):
    """:func:`symmetrize` by numpy for small concrete kernels on CPU, else ``compiled``."""
    leaves, treedef = jax.tree.flatten(kernel)
    on_host = not config.layouts[0].batch_diagonal and all(
        not isinstance(v, jax.core.Tracer)
        and v.nbytes <= HOST_MIRROR_BYTES
        and all(d.platform == "cpu" for d in v.devices())
        for v in leaves
    )
    if not on_host:
        return compiled(kernel, config=config)
    out = []
    for v, layout in zip(leaves, leaf_layouts(config), strict=True):
        k = np.asarray(v)
        half = np.asarray(0.5, k.dtype)
        out.append(jax.device_put((k + np.transpose(k, swap_perm(layout))) * half, v.sharding))
    return jax.tree.unflatten(treedef, out)


def finish_tile(kernel):
    """The tile and its all-finite flag (reduced on the device)."""
    flags = [jnp.all(jnp.isfinite(v)) for v in jax.tree.leaves(kernel)]
    return kernel, functools.reduce(jnp.logical_and, flags, jnp.asarray(True))


@functools.partial(jax.jit, static_argnames=("rows", "cols", "perm"), donate_argnums=0)
def _place(out, tile, r0, c0, *, rows, cols, perm):
    """``out`` with ``tile[:rows, :cols]`` (axes permuted by ``perm``) written at (r0, c0)."""
    tile = tile[:rows] if cols is None else tile[:rows, :cols]
    if perm is not None:
        tile = jnp.transpose(tile, perm)
    starts = ((r0,) if cols is None else (r0, c0)) + (0,) * (out.ndim - (1 if cols is None else 2))
    return lax.dynamic_update_slice(out, tile.astype(out.dtype), starts)


@dataclasses.dataclass
class _Output:
    """The result being assembled, leaf by leaf, on the host or on the device."""

    n1: int
    n2: int
    batch_diagonal: bool
    on_device: bool
    perms: list
    device: object = None  # with on_device: where (None: the default device)
    leaves: list | None = None
    treedef: object = None

    def put(self, tile, r0, r1, c0, c1, mirror: bool) -> None:
        leaves, self.treedef = jax.tree.flatten(tile)
        rows, cols = r1 - r0, None if self.batch_diagonal else c1 - c0
        if self.leaves is None:
            lead = (self.n1,) if self.batch_diagonal else (self.n1, self.n2)
            shapes = [lead + t.shape[len(lead) :] for t in leaves]
            make = functools.partial(jnp.zeros, device=self.device) if self.on_device else np.empty
            self.leaves = [make(s, t.dtype) for s, t in zip(shapes, leaves, strict=True)]
        for k, (t, perm) in enumerate(zip(leaves, self.perms, strict=True)):
            if self.on_device:
                out = _place(self.leaves[k], t, r0, c0, rows=rows, cols=cols, perm=None)
                if mirror:
                    out = _place(out, t, c0, r0, rows=rows, cols=cols, perm=perm)
                self.leaves[k] = out
            elif self.batch_diagonal:
                self.leaves[k][r0:r1] = np.asarray(t)[:rows]
            else:
                a = np.asarray(t)[:rows, :cols]
                self.leaves[k][r0:r1, c0:c1] = a
                if mirror:
                    self.leaves[k][c0:c1, r0:r1] = np.transpose(a, perm)

    def result(self):
        return jax.tree.unflatten(self.treedef, self.leaves)


#: The fix of a kernel that came out non-finite (NaN or Inf).
CHECK_THE_MODEL = "check the model's outputs and gradients there, rescale, or compute in float64"


def non_finite(fn: str, what: str, fix: str = CHECK_THE_MODEL) -> NonFiniteError:
    """NonFiniteError: ``what`` came out non-finite; ``fix``; see its section of the docs."""
    return bad(NonFiniteError, fn, what, fix, see="non-finite-kernel")


def nonfinite_tile_error(fn, tile, r0, r1, c0, c1, batch_diagonal):
    what = f"the kernel came out non-finite (NaN or Inf) in the tile of x1 samples {r0}..{r1 - 1}"
    what += "" if batch_diagonal else f" and x2 samples {c0}..{c1 - 1}"
    for leaf in jax.tree.leaves(tile):
        a = np.asarray(leaf)[: r1 - r0]
        found = np.argwhere(~np.isfinite(a if batch_diagonal else a[:, : c1 - c0]))
        if len(found):
            i = r0 + int(found[0][0])
            j = i if batch_diagonal else c0 + int(found[0][1])
            what += f", first at x1 sample {i} and x2 sample {j}"
            break
    return non_finite(fn, what)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How the blocked engine cuts a call: blocks of ``b1`` x ``b2`` samples, ``tiles``
    tiles, within ``budget`` bytes (``available`` of them for features and tiles), from
    F and W (:func:`auto_batch_size`); ``pair_kernels``: each kernel leaf's shape and dtype
    for one pair; ``devices``: those computing tiles ((None,): the default one);
    ``out_bytes``: the whole result's."""

    b1: int
    b2: int
    tiles: int
    budget: int
    feature_bytes: int
    pair_bytes: float
    requested: object  # the batch_size option (an int or "auto")
    available: int = 0
    pair_kernels: tuple = ()
    devices: tuple = (None,)
    out_bytes: int = 0  # the whole result's

    @property
    def smallest_bytes(self) -> int:
        """Bytes of a tile of 1 x 1 samples: 2·F + W, :func:`auto_batch_size` at B = 1."""
        return 2 * self.feature_bytes + math.ceil(self.pair_bytes)

    def __str__(self) -> str:
        spread = f" on {len(self.devices)} devices" if len(self.devices) > 1 else ""
        return (
            f"blocked engine: batch_size={self.requested!r} -> tiles of {self.b1} x {self.b2} "
            f"samples, {self.tiles} tiles{spread} (memory_budget {human_bytes(self.budget)}; "
            f"features {self.feature_bytes} B per sample, {self.pair_bytes:.0f} B per pair)"
        )


def _nbytes(tree) -> int:
    return sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(tree))


def tiling(implementation, config, options, params, x1, x2, aux) -> Tiling:
    """The :class:`Tiling` of a call with ``options``' batching, from abstract evaluation
    of one sample's features and tile of ``implementation`` (nothing runs)."""
    n1, same = _n_samples(x1), x2 is None
    n2 = n1 if same else _n_samples(x2)
    batch_diagonal = config.layouts[0].batch_diagonal
    budget = options.memory_budget or default_memory_budget()
    features = implementation.features  # None for "ntvp"
    # One sample; with vmap_axes=None the whole x1 (rows need not be samples), per sample.
    m = 1 if config.vmap_axes is not None else n1
    one = jax.tree.map(lambda v: jax.ShapeDtypeStruct((m,) + np.shape(v)[1:], v.dtype), x1)
    f_one = None if features is None else jax.eval_shape(features, params, one, aux)

    def one_tile(p, f, a, x):
        return implementation.tile(p, f, f, a, x, x, False)[0]

    kernel_leaves = jax.tree.leaves(jax.eval_shape(one_tile, params, f_one, aux, one))
    if m > 1:  # per sample and per pair: the leading N (diagonal) or N x N axes to 1
        f_one = jax.tree.map(lambda v: jax.ShapeDtypeStruct((1, v.size // m), v.dtype), f_one)
        lead = 1 if batch_diagonal else 2
        kernel_leaves = [
            jax.ShapeDtypeStruct((1,) * lead + v.shape[lead:], v.dtype) for v in kernel_leaves
        ]
    kernel_bytes = _nbytes(kernel_leaves)
    # W, working bytes per pair: the implementation's kernel-sized terms per pair
    n_out, terms = config.out_tree.num_leaves, PHASES[config.implementation].pair_terms(config)
    if terms is None:  # no features: the tile and the outputs' O x O products
        squares = sum(math.prod(s.shape[1:]) ** 2 for s in config.shapes1)
        pair_bytes = kernel_bytes + kernel_leaves[0].dtype.itemsize * squares
    else:
        pair_bytes = kernel_bytes * (2 + terms * n_out) / n_out if n_out else kernel_bytes
    out_bytes = kernel_bytes * (n1 if batch_diagonal else n1 * n2)
    # A result kept on the device comes out of the budget, leaving at least a quarter.
    available = max(budget - (out_bytes if options.store_on_device else 0), budget // 4)
    b = options.batch_size
    if b == AUTO_BATCH_SIZE:
        b = auto_batch_size(n1, n2, _nbytes(f_one), pair_bytes, available, batch_diagonal, same)
    b1, b2 = min(b, n1), min(b, n2)  # n2 = n1 on the batch diagonal and with x2=None
    k1, k2 = len(_blocks(n1, b1)), len(_blocks(n2, b2))
    tiles = k1 if batch_diagonal else (k1 * (k1 + 1) // 2 if same else k1 * k2)
    pair_kernels = tuple(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in kernel_leaves)
    devices = options.devices
    if devices is None:  # every local device; the default one for a result kept there
        local = tuple(jax.local_devices())
        devices = (None,) if options.store_on_device or len(local) == 1 else local
    sizes = (b1, b2, tiles, budget, _nbytes(f_one), pair_bytes, options.batch_size, available)
    return Tiling(*sizes, pair_kernels, devices, out_bytes)


def compute(implementation, config, cut: Tiling, options, fn: str, params, x1, x2, aux, store=None):
    """The kernel of x1 and x2 (x2 None: x1's Gram matrix) in the tiles of ``cut``: a host
    array per leaf (a ``jax.Array`` with ``store_on_device``; the memory map of ``store``,
    an :class:`~ntk_core._blocked.store.NpyStore`, whose done tiles are skipped). Raises
    NonFiniteError for NaN/Inf, naming the first non-finite input sample or entry."""
    n1, same = _n_samples(x1), x2 is None
    n2 = n1 if same else _n_samples(x2)
    batch_diagonal = config.layouts[0].batch_diagonal
    features = implementation.features  # None for "ntvp"
    b1, b2, pad = cut.b1, cut.b2, config.vmap_axes is not None
    rows = _blocks(n1, b1)
    cols = rows if same else _blocks(n2, b2)
    xc = x1 if same else x2
    # Tiles of row block i on device i mod D; features of column block j computed on device
    # j mod D and copied where needed.
    devices = cut.devices
    n_dev = len(devices)

    def on(d, value):
        return value if devices == (None,) else jax.device_put(value, devices[d])

    @functools.cache
    def model(d):
        return on(d, params), on(d, aux)

    def block(x, blocks, k, size, d):
        start, stop = blocks[k]
        return on(d, _take(x, start, stop, size if pad else stop - start))

    def feats(x, d):
        p, a = model(d)
        return features(p, x, a)

    def tile(fa, fb, xa, xb, same_block, d):
        p, a = model(d)
        return implementation.tile(p, fa, fb, a, xa, xb, same_block)

    perms = [swap_perm(layout) for layout in leaf_layouts(config)]
    out = store or _Output(n1, n2, batch_diagonal, options.store_on_device, perms, devices[0])
    share = None if store is None else store.share()  # the tiles this process computes

    def todo(r0, c0) -> bool:
        return share is None or (r0, c0) in share

    def tasks():
        """Dispatches each tile; yields (tile, finite flag, r0, r1, c0, c1, mirror)."""
        if batch_diagonal:
            for i, (r0, r1) in enumerate(rows):
                if todo(r0, r0):
                    d = i % n_dev
                    xa = block(x1, rows, i, b1, d)
                    xb = None if same else block(x2, rows, i, b1, d)
                    fa = None if features is None else feats(xa, d)
                    fb = None if features is None or same else feats(xb, d)
                    yield (*tile(fa, fb, xa, xb, same, d), r0, r1, r0, r1, False)
            return
        if features is None:
            for i, (r0, r1) in enumerate(rows):
                d = i % n_dev
                xa = block(x1, rows, i, b1, d)
                for j in range(i if same else 0, len(cols)):
                    if todo(r0, cols[j][0]):
                        diag = same and j == i
                        xb = None if diag else block(xc, cols, j, b2, d)
                        t = tile(None, None, xa, xb, diag, d)
                        yield (*t, r0, r1, *cols[j], same and not diag)
            return
        block_bytes = cut.feature_bytes * max(b1, b2)
        room = cut.available - 2 * cut.pair_bytes * b1 * b2
        capacity = int(room // block_bytes) if block_bytes else len(cols) + len(rows)
        n_kept = len(cols) + (0 if same else 1)  # every column block and one row block
        width = len(cols) if capacity >= n_kept else max(1, capacity - 1)
        for start in range(0, len(cols), width):
            band = range(start, min(start + width, len(cols)))
            kept: dict = {}

            def column(j, d, kept=kept):
                """Column block j's features on device d (computed on device j mod D)."""
                home = j % n_dev
                if (j, home) not in kept:
                    kept[j, home] = feats(block(xc, cols, j, b2, home), home)
                if (j, d) not in kept:
                    kept[j, d] = on(d, kept[j, home])
                return kept[j, d]

            for i, (r0, r1) in enumerate(rows):
                d = i % n_dev
                js = [j for j in band if (not same or j >= i) and todo(r0, cols[j][0])]
                if js:
                    fa = column(i, d) if same and i in band else feats(block(x1, rows, i, b1, d), d)
                for j in js:
                    diag = same and j == i
                    fb = None if diag else column(j, d)
                    yield (*tile(fa, fb, None, None, diag, d), r0, r1, *cols[j], same and not diag)
            del kept

    bar = progress_bar(fn, options.progress, cut.tiles, unit="tile") or NO_BAR
    if store is not None and store.done:
        bar.update(len(store.done))  # tiles of the interrupted runs

    def finalize(task):
        kernel, finite, r0, r1, c0, c1, mirror = task
        if not bool(finite):
            _checks.check_finite_inputs(fn, x1, x2, params)  # the non-finite input, named
            raise nonfinite_tile_error(fn, kernel, r0, r1, c0, c1, batch_diagonal)
        out.put(kernel, r0, r1, c0, c1, mirror)
        bar.update()

    try:
        # The next tile (one per device) is dispatched before the oldest is copied out,
        # so the copies overlap the computation and the devices run side by side.
        pending: collections.deque = collections.deque()
        for task in tasks():
            pending.append(task)
            if len(pending) > n_dev:
                finalize(pending.popleft())
        while pending:
            finalize(pending.popleft())
    finally:
        bar.close()
    return out.result()
