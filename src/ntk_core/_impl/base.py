"""What an implementation is: :class:`Impl`, a typed bundle of pure functions and of
what it can do (as optax's ``GradientTransformation``), one per module
(:mod:`ntk_core._impl.registry` lists them), and the pieces their contractions share."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

#: The ``precision`` option as ``lax.Precision``, for the contractions' einsums.
PRECISION = {
    "highest": lax.Precision.HIGHEST,
    "high": lax.Precision.HIGH,
    "default": lax.Precision.DEFAULT,
}


class StructureHooks(NamedTuple):
    """What the planner asks of the structured analysis, given by the implementation
    that runs on it: ``analyse(apply3, params, x_one, aux, fuse_bias, precision=)``
    (:func:`ntk_core._structured.analysis.analysis_for`), ``modes(analysis, o_pair,
    o_out)`` (Gram or explicit per leaf group) and ``labels(analysis, modes)`` (each
    leaf's method, for ``plan()``)."""

    analyse: Callable
    modes: Callable
    labels: Callable


class Impl(NamedTuple):
    """One implementation of the kernel: its two phases and its capabilities.

    ``config`` below is the call's :class:`~ntk_core._kernel.pipeline.Config` (static,
    hashable); the functions are pure and module-level, so that their compilations are
    shared by every kernel function of the same model and configuration.

    Attributes:
      name: the ``implementation`` option that selects it (``"nngp"``: the NNGP's
        outputs, selected by the kernel kind).
      title: what the messages call it, e.g. ``"NTK-vector products"``.
      features: ``features(apply3, config, chunks)`` -> the jitted first phase
        ``features(params, x, aux)`` (per-sample features of a block, batch axis 0),
        or None for an implementation without features; ``chunks``: a dict the phase
        may cache its chunk sizes in. None: no features, the tiles start from the inputs.
      contract: the second phase, traced inside the jitted tile. With features:
        ``contract(fa, fb, *, config)`` -> the kernel pytree of a row block's features
        ``fa`` and a column block's ``fb`` (None: the Gram matrix of ``fa``). Without:
        ``contract(params, xa, xb, aux, *, apply3, config)``, from the inputs.
      separates_leaves: computes per-parameter-leaf kernels (``ntk_per_leaf``).
      whole_batch_as: the implementation that computes it with ``vmap_axes=None``: its
        own name, or another's when it needs samples to be independent.
      cotangent_chunks: with ``vmap_axes=None`` it pulls the output cotangents back in
        chunks of the whole-batch memory model (``plan()`` shows them).
      estimate: ``estimate(call) -> CostEstimate`` (:class:`ntk_core._impl.cost.Call`):
        its analytic cost, for ``"auto"`` and ``plan()``.
      analysis: the :class:`StructureHooks` of an implementation that runs on the
        structured analysis (its per-leaf modes are planned), else None.
      pair_terms: ``pair_terms(config)`` -> the kernel-sized temporaries a tile holds
        per pair of samples (the blocked engine's working bytes), or None for one
        without features (the tile and the outputs' O x O products).
      model_failure: ``model_failure(spec, checked, params, x1, x2, aux)`` -> the
        exception the model raises when traced inside this implementation's
        transformations (on one sample; nothing runs), or None; the field is None
        when every model that validates can run.
      failure_message: ``failure_message(fn_name, error)`` -> the message refusing
        the explicit choice of this implementation after ``model_failure``.
    """

    name: str
    title: str
    features: Callable | None
    contract: Callable
    separates_leaves: bool
    whole_batch_as: str
    cotangent_chunks: bool = False
    estimate: Callable | None = None
    analysis: StructureHooks | None = None
    pair_terms: Callable = lambda config: 1
    model_failure: Callable | None = None
    failure_message: Callable | None = None

    @property
    def uses_analysis(self) -> bool:
        """Runs on the structured analysis (its per-leaf modes are planned)."""
        return self.analysis is not None

    @property
    def needs_independence(self) -> bool:
        """Needs per-sample independence (``vmap_axes=0``) to be itself."""
        return self.whole_batch_as != self.name


def finish(per_leaf, config):
    """Per output leaf lists of per-parameter-leaf kernels -> the result pytree (per
    parameter leaf for ``"ntk_per_leaf"``, summed otherwise)."""
    if config.kind == "ntk_per_leaf":
        by_leaf = [
            jax.tree.unflatten(config.out_tree, [terms[i] for terms in per_leaf])
            for i in range(config.params_tree.num_leaves)
        ]
        return jax.tree.unflatten(config.params_tree, by_leaf)
    return jax.tree.unflatten(config.out_tree, [functools.reduce(jnp.add, t) for t in per_leaf])
