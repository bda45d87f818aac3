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
