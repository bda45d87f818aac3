"""Parameter leaf names: the one rule shared by ``infinite_kernel_fn``'s priors and the
adapters (``ntk_core.adapters.leaf_path_names``), so that a per-leaf ``W_std=`` written for
a Flax, Haiku or equinox model names the same leaves the core sees."""

from __future__ import annotations

import contextlib

import jax

#: The public function the derivation's messages name by default.
FN = "ntk_core.infinite_kernel_fn"
_CALLERS = [FN]


def caller() -> str:
    """The public function the derivation's messages name: ``ntk_core.infinite_kernel_fn``,
    or the adapter's (``ntk_flax.infinite_kernel_fn``, ...) while it derives (:func:`naming`)."""
    return _CALLERS[-1]


@contextlib.contextmanager
def naming(name: str):
    """Messages raised inside the block name ``name``."""
    _CALLERS.append(name)
    try:
        yield
    finally:
        _CALLERS.pop()


def _part(key) -> str:
    tu = jax.tree_util
    if isinstance(key, tu.DictKey):
        return str(key.key)
    if isinstance(key, tu.GetAttrKey):
        return key.name
    if isinstance(key, tu.SequenceKey):
        return str(key.idx)
    if isinstance(key, tu.FlattenedIndexKey):
        return str(key.key)
    return str(key)  # a custom key type: its own text


def leaf_path_names(params) -> list[str]:
    """The name of each leaf of ``params``, in the order of ``jax.tree_util.tree_leaves``:
    its key path joined by ``"/"`` (a dict key as ``str(key)``, an attribute by its name, a
    sequence index as its number), e.g. ``{"dense": {"w": w}, "out": [b]}`` gives
    ``["dense/w", "out/0"]``. The keys of ``infinite_kernel_fn``'s per-leaf priors."""
    with_path, _ = jax.tree_util.tree_flatten_with_path(params)
    return ["/".join(_part(k) for k in path) for path, _ in with_path]
