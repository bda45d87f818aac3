"""The library's caches (each bounded: LRU or FIFO of 64 entries), registered so that
:func:`clear_caches` empties them all."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

_CLEARERS: list[Callable[[], None]] = []


def register(clear: Callable[[], None]) -> None:
    """Adds ``clear()`` to what :func:`clear_caches` calls."""
    _CLEARERS.append(clear)


def lru_cache(maxsize: int):
    """``functools.lru_cache(maxsize)`` whose cache :func:`clear_caches` empties."""

    def decorate(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        register(cached.cache_clear)
        return cached

    return decorate


def freeze(value):
    """A hashable stand-in for nested dicts, lists and tuples (arrays stay unhashable: no
    cache; not even by identity: on CPU ``jax.device_put`` may share a numpy buffer that
    the user changes in place)."""
    if isinstance(value, dict):
        return (dict, tuple(sorted((k, freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(freeze(v) for v in value))
    return value


_BUILT: dict = {}  # the one-call entry points' kernel functions, first in first out
register(_BUILT.clear)


def cached(key, build: Callable, size: int = 64):
    """``build()``, or what it returned for an equal ``key`` (FIFO of ``size``, emptied by
    :func:`clear_caches`). The key: the public function's name, the model and every
    argument the build reads; dicts, lists, tuples compared by value; unhashable: no cache."""
    key = freeze(key)
    try:
        hash(key)
    except TypeError:
        return build()
    fn = _BUILT.get(key)
    if fn is None:
        if len(_BUILT) >= size:
            _BUILT.pop(next(iter(_BUILT)))
        fn = _BUILT[key] = build()
    return fn


def clear_caches() -> None:
    """Empties every cache of ``ntk_core``, ``ntk_flax`` and ``ntk_haiku`` (built kernel
    functions, held strongly until evicted) and calls :func:`jax.clear_caches`, so nothing
    of this library keeps a model, its closed-over arrays or its programs alive.

    Cost: O(cached entries); later first calls trace and compile again.

    Example:
      >>> import gc, weakref
      >>> import jax.numpy as jnp, ntk_core
      >>> def f(w, x):
      ...     return jnp.tanh(x @ w)
      >>> _ = ntk_core.empirical_ntk(f, jnp.ones((3, 2)), jnp.ones((4, 3)))  # (N1, N2)
      >>> alive = weakref.ref(f)
      >>> del f
      >>> ntk_core.clear_caches()
      >>> _ = gc.collect()
      >>> alive() is None
      True
    """
    for clear in list(_CLEARERS):
        clear()
    jax.clear_caches()
