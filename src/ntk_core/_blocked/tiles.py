"""The blocked Gram engine: a kernel of any size in tiles, with bounded device memory.

With ``batch_size=B`` (or ``"auto"``) the engine (:mod:`ntk_core._kernel.engine`) hands its
call here, with the implementation's two phases and the tiling (:func:`tiling`, which
``plan()`` shows too). x1 is cut into row blocks and x2 into column blocks of B samples
(the last block of each is ragged); the Gram matrix is computed tile by tile with the
two phases of DESIGN.md:

1. features (per-sample Jacobians, structured features or model outputs) of each block,
   computed once per block and kept for every tile that needs them;
2. the contraction of a row block's features with a column block's: one tile.

NTK-vector products (``"ntvp"``) have no feature phase; each tile is computed from the
two blocks of inputs directly.

* ``x2=None``: only tiles (i, j) with j ≥ i are computed; tile (j, i) is the mirror of
  (i, j) (the x1 and x2 axes of each pair swapped), and each diagonal tile is made
  exactly symmetric, (K + Kᵀ)·½ (:func:`symmetrize`, inside the tile's program; also
  the one-call path's), so the result is exactly symmetric.
* ``diagonal_axes`` containing 0 (the per-sample batch diagonal): one tile per block,
  K(x1_i, x2_i) only, O(N) work.
* A ragged last block is padded to B samples by repeating its last sample (one compiled
  shape for every block); the padded rows are dropped. With ``vmap_axes=None`` the
  blocks are not padded (samples may interact) and each block is differentiated as its
  own batch; a model whose samples interact is refused, since blocks would change it.
* Each tile is checked for NaN/Inf on the device (one reduction) before it is stored.
* The result is written into a host ``numpy.ndarray`` (default) or, with
  ``store_on_device=True``, into a device array updated in place (donated buffer).
  The next tile is dispatched before the previous one is copied out, so the copy
  overlaps the computation.

Memory. With F the feature bytes per sample, W the working bytes per pair of samples
(the kernel entries of a pair times 2 + the number of contraction terms, an estimate of
the tile and its temporaries), B1 x B2 the tile and S the output bytes, the device
holds about

    F·(B1 + B2)  +  F·B2·c  +  2·W·B1·B2  (+ S with store_on_device=True)

where c is the number of cached column blocks: every block when the features of all
blocks fit in ``memory_budget`` (then each block's features are computed exactly once,
N1 + N2 samples in all, N1 when x2 is None), otherwise as many as fit. Then the column
blocks are processed in bands of c blocks and the row features are recomputed once per
band: feature work N2 + N1·(number of bands). The host holds the S-byte result (and the
inputs, which are sliced block by block).

``batch_size="auto"`` (:func:`auto_batch_size`) takes the largest B with
``2·F·B + W·B² ≤ memory_budget`` (``2·F·B + W·B`` on the batch diagonal; minus S with
``store_on_device=True``, but never less than a quarter of the budget), at least 1 and
at most ``max(N1, N2)``; with ``x2=None`` at most ``max(512, ceil(N / 8))`` as well (at
least 8 blocks, so that skipping the tiles below the diagonal saves most of the half it
can); then evened out over the blocks it gives (so that the last block is not mostly
padding).
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
from ntk_core._blocked.progress import progress_bar
from ntk_core._errors import NonFiniteError, bad
from ntk_core._impl.registry import PHASES
from ntk_core._kernel import checks as _checks
from ntk_core._kernel.layout import leaf_layouts, swap_perm
from ntk_core._kernel.options import AUTO_BATCH_SIZE, DEFAULT_MEMORY_BUDGET
from ntk_core._units import human_bytes


def default_memory_budget() -> int:
    """Half of the device allocator's byte limit where JAX reports one, else 1 GiB."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # backends without memory statistics
        stats = None
    limit = (stats or {}).get("bytes_limit")
    if limit:
        return int(limit) // 2
    return DEFAULT_MEMORY_BUDGET


#: With x2=None, ``"auto"`` cuts N into at least this many blocks (tiles of at least
#: :data:`AUTO_MIN_BATCH` samples), so that skipping the tiles below the diagonal saves
#: most of the half it can: with k blocks (k + 1) / 2k of the pairs are computed.
AUTO_SYMMETRIC_BLOCKS = 8
AUTO_MIN_BATCH = 512


def auto_batch_size(
    n1, n2, feature_bytes, pair_bytes, budget, batch_diagonal, symmetric=False
) -> int:
    """The largest B with ``2·F·B + W·B² ≤ budget`` (``W·B`` on the batch diagonal).

    Args:
      n1, n2: samples of x1 and x2.
      feature_bytes: F, feature bytes per sample (0 for NTK-vector products).
      pair_bytes: W, working bytes per pair of samples (per sample on the diagonal).
      budget: bytes available (``memory_budget``, less the output when it is kept on
        the device).
      batch_diagonal: the per-sample diagonal K(x1_i, x2_i) only.
      symmetric: x2 is x1; B is then also at most
        ``max(AUTO_MIN_BATCH, ceil(N / AUTO_SYMMETRIC_BLOCKS))``.

    Returns:
      B, at least 1 and at most ``max(n1, n2)``, then evened out: the largest fitting
      B gives ``k = ceil(max(n1, n2) / B)`` blocks and ``ceil(max(n1, n2) / k)`` is
      returned, so that the last block is not mostly padding.
    """
    f, w, m = float(feature_bytes), float(max(pair_bytes, 1)), float(max(budget, 0))
    if batch_diagonal:
        b = m / (2 * f + w)
    else:
        b = (-2 * f + math.sqrt(4 * f * f + 4 * w * m)) / (2 * w)
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


def _all_finite(leaves):
    return functools.reduce(
        jnp.logical_and, [jnp.all(jnp.isfinite(v)) for v in leaves], jnp.asarray(True)
    )


def _symmetric_leaf(k, layout):
    """(K + Kᵀ)·½ with Kᵀ the kernel with the x1 and x2 axis of each pair swapped.

    Exactly symmetric: entry and mirror are both (a + b)·½, and float addition is
    commutative; the optimisation barriers keep XLA from fusing the computation of K
    into the sum or the halving into it (an FMA could round the two sides
    differently). (A select on an
    index mask would be exact too, but XLA constant-folds such masks very slowly.)
    """
    k = barrier(k)
    total = barrier(k + jnp.transpose(k, swap_perm(layout)))
    return total * jnp.asarray(0.5, k.dtype)


def symmetrize(kernel, config):
    """Θ(x, x) made exactly symmetric (no-op on the per-sample batch diagonal)."""
    if config.layouts[0].batch_diagonal:
        return kernel
    leaves, treedef = jax.tree.flatten(kernel)
    leaves = [
        _symmetric_leaf(k, layout) for k, layout in zip(leaves, leaf_layouts(config), strict=True)
    ]
    return jax.tree.unflatten(treedef, leaves)


def finish_tile(kernel):
    """The tile and its all-finite flag (one reduction on the device)."""
    return kernel, _all_finite(jax.tree.leaves(kernel))


@functools.partial(jax.jit, static_argnames=("rows", "cols", "perm"), donate_argnums=0)
def _place(out, tile, r0, c0, *, rows, cols, perm):
    """``out`` with ``tile[:rows, :cols]`` (axes permuted by ``perm``) written at (r0, c0)."""
    tile = tile[:rows] if cols is None else tile[:rows, :cols]
    if perm is not None:
        tile = jnp.transpose(tile, perm)
    starts = (r0,) if cols is None else (r0, c0)
    starts = starts + (0,) * (out.ndim - len(starts))
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
        leaves, treedef = jax.tree.flatten(tile)
        rows, cols = r1 - r0, None if self.batch_diagonal else c1 - c0
        if self.leaves is None:
            self.treedef = treedef
            self.leaves = []
            for t in leaves:
                lead = (self.n1,) if self.batch_diagonal else (self.n1, self.n2)
                shape = lead + t.shape[len(lead) :]
                if self.on_device:
                    self.leaves.append(jnp.zeros(shape, t.dtype, device=self.device))
                else:
                    self.leaves.append(np.empty(shape, t.dtype))
        for k, (t, perm) in enumerate(zip(leaves, self.perms, strict=True)):
            if self.on_device:
                out = _place(self.leaves[k], t, r0, c0, rows=rows, cols=cols, perm=None)
                if mirror:
                    out = _place(out, t, c0, r0, rows=rows, cols=cols, perm=perm)
                self.leaves[k] = out
                continue
            a = np.asarray(t)
            if self.batch_diagonal:
                self.leaves[k][r0:r1] = a[:rows]
                continue
            a = a[:rows, :cols]
            self.leaves[k][r0:r1, c0:c1] = a
            if mirror:
                self.leaves[k][c0:c1, r0:r1] = np.transpose(a, perm)

    def result(self):
        return jax.tree.unflatten(self.treedef, self.leaves)


def nonfinite_tile_error(fn, tile, r0, r1, c0, c1, batch_diagonal):
    where = ""
    for leaf in jax.tree.leaves(tile):
        a = np.asarray(leaf)
        a = a[: r1 - r0] if batch_diagonal else a[: r1 - r0, : c1 - c0]
        found = np.argwhere(~np.isfinite(a))
        if len(found):
            i = r0 + int(found[0][0])
            j = i if batch_diagonal else c0 + int(found[0][1])
            where = f", first at x1 sample {i} and x2 sample {j}"
            break
    cols = "" if batch_diagonal else f" and x2 samples {c0}..{c1 - 1}"
    what = f"the kernel came out non-finite (NaN or Inf) in the tile of x1 samples {r0}..{r1 - 1}"
    fix = "check the model's outputs and gradients there, rescale, or compute in float64"
    return bad(NonFiniteError, fn, what + cols + where, fix, see="non-finite-kernel")


class _Progress:
    """A tqdm bar over tiles, or nothing (:func:`ntk_core._blocked.progress.show_progress`
    decides)."""

    def __init__(self, fn, total, progress):
        self.bar = progress_bar(fn, progress, total, unit="tile")

    def update(self, k: int = 1):
        if self.bar is not None:
            self.bar.update(k)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _pair_bytes(config, kernel_bytes: float, out_sizes, itemsize) -> float:
    """W: working bytes per pair of samples (the tile and its temporaries, estimated):
    the implementation's kernel-sized terms per pair (``Impl.pair_terms``)."""
    n_out = config.out_tree.num_leaves
    terms = PHASES[config.implementation].pair_terms(config)
    if terms is None:  # no features: the tile and the outputs' O x O products
        return kernel_bytes + itemsize * sum(o * o for o in out_sizes)
    return kernel_bytes * (2 + terms * n_out) / n_out if n_out else kernel_bytes


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How the blocked engine cuts a call: blocks of ``b1`` rows and ``b2`` columns,
    ``tiles`` tiles computed, within ``budget`` bytes, from ``feature_bytes`` (F) per
    sample and ``pair_bytes`` (W) per pair (:func:`auto_batch_size`)."""

    b1: int
    b2: int
    tiles: int
    budget: int
    feature_bytes: int
    pair_bytes: float
    requested: object  # the batch_size option (an int or "auto")
    available: int = 0  # bytes for features and tiles (the budget less a kept output)
    #: Each kernel leaf of a tile of one pair: its shape (1, 1, ...) or (1, ...) on the
    #: batch diagonal, and dtype.
    pair_kernels: tuple = ()
    devices: tuple = (None,)  # the devices computing tiles ((None,): the default one)

    def __str__(self) -> str:
        budget = human_bytes(self.budget)
        spread = f" on {len(self.devices)} devices" if len(self.devices) > 1 else ""
        return (
            f"blocked engine: batch_size={self.requested!r} -> tiles of {self.b1} x "
            f"{self.b2} samples, {self.tiles} tiles{spread} (memory_budget {budget}; "
            f"features {self.feature_bytes} B per sample, {self.pair_bytes:.0f} B per pair)"
        )


def tiling(implementation, config, options, params, x1, x2, aux) -> Tiling:
    """The :class:`Tiling` of a call with ``options``' batching (``batch_size``,
    ``memory_budget``, ``store_on_device``), from abstract evaluation of one sample's
    features and tile of ``implementation`` (an
    :class:`~ntk_core._kernel.pipeline.Implementation`; nothing runs)."""
    n1 = _n_samples(x1)
    same = x2 is None
    n2 = n1 if same else _n_samples(x2)
    batch_diagonal = config.layouts[0].batch_diagonal
    budget = options.memory_budget or default_memory_budget()
    features = implementation.features  # None for "ntvp"
    one = jax.tree.map(lambda v: jax.ShapeDtypeStruct((1,) + np.shape(v)[1:], v.dtype), x1)
    f_one = None if features is None else jax.eval_shape(features, params, one, aux)
    feature_bytes = (
        0 if f_one is None else sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(f_one))
    )
    tile_one = jax.eval_shape(
        lambda p, f, a, x: implementation.tile(p, f, f, a, x, x, False)[0],
        params,
        f_one,
        aux,
        one,
    )
    kernel_leaves = jax.tree.leaves(tile_one)
    kernel_bytes = sum(v.size * v.dtype.itemsize for v in kernel_leaves)
    itemsize = kernel_leaves[0].dtype.itemsize
    out_sizes = [math.prod(s.shape[1:]) for s in config.shapes1]
    pair_bytes = _pair_bytes(config, kernel_bytes, out_sizes, itemsize)
    out_bytes = kernel_bytes * (n1 if batch_diagonal else n1 * n2)
    # The result on the device comes out of the budget, but at least a quarter of it is
    # left for features and tiles (a result larger than the budget is the caller's call).
    available = max(budget - (out_bytes if options.store_on_device else 0), budget // 4)
    b = options.batch_size
    if b == AUTO_BATCH_SIZE:
        b = auto_batch_size(
            n1, n2, feature_bytes, pair_bytes, available, batch_diagonal, symmetric=same
        )
    b1, b2 = min(b, n1), min(b, n2)
    if batch_diagonal or same:
        b1 = b2 = min(b, n1)
    k1, k2 = len(_blocks(n1, b1)), len(_blocks(n2, b2))
    tiles = k1 if batch_diagonal else (k1 * (k1 + 1) // 2 if same else k1 * k2)
    pair_kernels = tuple(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in kernel_leaves)
    devices = options.devices
    if devices is None:  # every local device; the default one for a result kept there
        local = tuple(jax.local_devices())
        devices = (None,) if options.store_on_device or len(local) == 1 else local
    return Tiling(
        b1,
        b2,
        tiles,
        budget,
        feature_bytes,
        pair_bytes,
        options.batch_size,
        available,
        pair_kernels,
        devices,
    )


def compute(implementation, config, cut: Tiling, options, fn: str, params, x1, x2, aux, store=None):
    """The kernel of x1 and x2 (x2 None: x1's Gram matrix) in the tiles of ``cut``.

    Args:
      implementation: the two phases (:class:`~ntk_core._kernel.pipeline.Implementation`).
      config: the call's :class:`~ntk_core._kernel.pipeline.Config` (layouts, output tree).
      cut: the blocks (:func:`tiling`).
      options: ``store_on_device`` and ``progress`` are read.
      fn: the public function's name, for messages and the progress bar.
      params, x1, x2, aux: the call's arguments.
      store: where the tiles go instead of a host or device array: an
        :class:`ntk_core._blocked.store.NpyStore` (``out=``), whose finished tiles (an
        interrupted run's) are skipped.

    Returns:
      the kernel, a host ``numpy.ndarray`` (a ``jax.Array`` with
      ``store_on_device=True``; the store's read-only memory map with ``store``) per
      leaf.

    Raises:
      ValueError: a tile with NaN or Inf (naming the first non-finite input sample,
        or the tile and its first non-finite entry).
    """
    n1 = _n_samples(x1)
    same = x2 is None
    n2 = n1 if same else _n_samples(x2)
    batch_diagonal = config.layouts[0].batch_diagonal
    features = implementation.features  # None for "ntvp"
    b1, b2 = cut.b1, cut.b2
    pad = config.vmap_axes is not None
    rows = _blocks(n1, b1)
    cols = rows if same else _blocks(n2, b2)

    # Tiles spread over the devices: the tiles of row block i on device i mod D, the
    # features of column block j computed on device j mod D and copied where needed.
    devices = cut.devices
    n_dev = len(devices)
    placed: dict = {}

    def on(d, value):
        """``value`` on device ``d`` (as given on the default device)."""
        return value if devices == (None,) else jax.device_put(value, devices[d])

    def model(d):
        """(params, aux) on device ``d``."""
        if d not in placed:
            placed[d] = (on(d, params), on(d, aux))
        return placed[d]

    def block(x, blocks, k, size, d=0):
        start, stop = blocks[k]
        return on(d, _take(x, start, stop, size if pad else stop - start))

    def feats(x, d):
        p, a = model(d)
        return features(p, x, a)

    def tile(fa, fb, xa, xb, same_block, d=0):
        p, a = model(d)
        return implementation.tile(p, fa, fb, a, xa, xb, same_block)

    out = store or _Output(
        n1,
        n2,
        batch_diagonal,
        options.store_on_device,
        [swap_perm(layout) for layout in leaf_layouts(config)],
        devices[0],
    )

    share = None  # with a store: the tiles this process computes (not done, its share)
    if store is not None:
        if batch_diagonal:
            tiles = [(r0, r0) for r0, _ in rows]
        else:
            tiles = [
                (rows[i][0], cols[j][0])
                for i in range(len(rows))
                for j in range(i if same else 0, len(cols))
            ]
        share = store.share(tiles)

    def todo(r0, c0) -> bool:
        return share is None or (r0, c0) in share

    def tasks():
        """Dispatches each tile; yields (tile, finite flag, r0, r1, c0, c1, mirror)."""
        if batch_diagonal:
            for i, (r0, r1) in enumerate(rows):
                if not todo(r0, r0):
                    continue
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
                    c0, c1 = cols[j]
                    if not todo(r0, c0):
                        continue
                    if same and j == i:
                        yield (*tile(None, None, xa, None, True, d), r0, r1, c0, c1, False)
                        continue
                    xb = block(x1 if same else x2, cols, j, b2, d)
                    yield (*tile(None, None, xa, xb, False, d), r0, r1, c0, c1, same)
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
                if (j, d) not in kept:
                    home = j % n_dev
                    if (j, home) not in kept:
                        x = block(x1 if same else x2, cols, j, b2, home)
                        kept[j, home] = feats(x, home)
                    if d != home:
                        kept[j, d] = on(d, kept[j, home])
                return kept[j, d]

            for i, (r0, r1) in enumerate(rows):
                js = [j for j in band if (not same or j >= i) and todo(r0, cols[j][0])]
                if not js:
                    continue
                d = i % n_dev
                if same and i in band:
                    fa = column(i, d)
                else:
                    fa = feats(block(x1, rows, i, b1, d), d)
                for j in js:
                    c0, c1 = cols[j]
                    if same and j == i:
                        yield (*tile(fa, None, None, None, True, d), r0, r1, c0, c1, False)
                    else:
                        fb = column(j, d)
                        yield (*tile(fa, fb, None, None, False, d), r0, r1, c0, c1, same)
            del kept

    bar = _Progress(fn, cut.tiles, options.progress)
    if store is not None and store.done:
        bar.update(len(store.done))  # tiles of the interrupted runs

    def finalize(task):
        kernel, finite, r0, r1, c0, c1, mirror = task
        if not bool(finite):
            _checks.check_finite_inputs(fn, x1, x2)  # a non-finite input sample, named
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
