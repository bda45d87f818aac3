"""A counter of XLA compilations for the tests that assert none happens again: a list
that grows by one entry per compilation (JAX's monitoring events, which also fire for a
program read from the persistent compilation cache)."""

from __future__ import annotations

import jax


def counter() -> list[str]:
    """The list, registered with JAX's monitoring once per call: create it once per module."""
    seen: list[str] = []

    def listener(name, secs, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            seen.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    return seen
