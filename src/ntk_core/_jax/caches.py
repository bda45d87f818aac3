"""The library's caches, and one switch to empty them: :func:`clear_caches`.

Every cache here is bounded: built kernel functions and wrapped ``apply_fn``\\ s in LRU
caches of 64 entries (:func:`lru_cache`), the adapters' one-call kernel functions in a
FIFO cache of 64 (:func:`ntk_core.adapters.cached`). They hold users' functions (and
through them closed-over arrays) until evicted; :func:`clear_caches` drops them all,
together with JAX's own compiled programs, so that a long session can free a model it
no longer uses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

_CLEARERS: list[Callable[[], None]] = []


def register(clear: Callable[[], None]) -> None:
    """Adds ``clear`` (a function of no arguments) to what :func:`clear_caches` calls."""
    _CLEARERS.append(clear)


def lru_cache(maxsize: int):
    """``functools.lru_cache(maxsize)`` whose cache :func:`clear_caches` empties."""

    def decorate(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        register(cached.cache_clear)
        return cached

    return decorate


def clear_caches() -> None:
    """Empties every cache of ``ntk_core``, ``ntk_flax`` and ``ntk_haiku`` and JAX's.

    The library caches built kernel functions (keyed by the ``apply_fn`` or model and
    the options), so that repeated one-call functions such as
    :func:`ntk_core.empirical_ntk` reuse compiled programs; each cache is bounded (64
    entries) and holds the functions it was given strongly until evicted. This
    drops them all and calls :func:`jax.clear_caches` (JAX's compiled programs and
    traces), so nothing of this library keeps a model, its closed-over arrays or its
    programs alive. The next call of each kernel function traces and compiles again.

    Args:
      none.

    Returns:
      ``None``.

    Raises:
      nothing.

    Cost: O(number of cached entries); later first calls pay tracing and compilation
    again (N1-independent).

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

    References:
      JAX's ``jax.clear_caches`` documentation.
    """
    for clear in list(_CLEARERS):
        clear()
    jax.clear_caches()
