"""The per-sample independence probe behind ``vmap_axes=0``: the model on two batches
sharing their first sample; that sample's outputs must agree (catches BatchNorm in
training mode, batch means). Two small forward passes per input signature."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ntk_core._errors import bad, one_line
from ntk_core._impl.base import QUICK_CPU_OPTIONS, jit_tuned
from ntk_core._kernel import checks as _checks


def _head(leaf, k: int) -> np.ndarray:
    """The first ``k`` samples, indexed on the host (no per-shape compilation)."""
    if (
        isinstance(leaf, jax.Array)
        and not isinstance(leaf, jax.core.Tracer)  # np.asarray refuses it: no probe
        and any(d.platform != "cpu" for d in leaf.devices())
    ):
        leaf = leaf[:k]  # only k samples cross to the host
    return np.asarray(leaf)[:k]


def _samples(x, k: int) -> list:
    """The first ``k`` samples of ``x``, each a batch of one."""
    x = jax.tree.map(lambda leaf: _head(leaf, k), x)
    n = jax.tree.leaves(x)[0].shape[0]
    return [jax.tree.map(lambda leaf, i=i: leaf[i : i + 1], x) for i in range(n)]


def _batches(x1, x2):
    """Two batches of three samples sharing the first (two would hide a batch
    standardisation), the others transformed affinely (or other samples for integer
    inputs); None when too few samples."""
    samples = _samples(x1, 4)
    if x2 is not None and len(samples) < 4:
        samples += _samples(x2, 4 - len(samples))

    def affine(v, a, b):
        return jax.tree.map(lambda leaf: (a * leaf + b).astype(leaf.dtype), v)

    if all(jnp.issubdtype(v.dtype, jnp.inexact) for v in jax.tree.leaves(samples[0])):
        s0 = samples[0]
        others = samples[1:3]  # padded with transformed copies of s0 when N < 3
        others += [affine(s0, a, b) for a, b in ((0.7, -0.3), (1.3, 0.2))[len(others) :]]
        s1, s2 = others
        return (s0, s1, s2), (s0, affine(s1, -1.5, 0.5), affine(s2, -1.5, 0.5))
    if len(samples) >= 4:
        s0, s1, s2, s3 = samples[:4]
        return (s0, s1, s2), (s0, s3, s2)
    if len(samples) == 3:  # integer inputs, three samples: two-sample batches
        s0, s1, s2 = samples
        return (s0, s1), (s0, s2)
    return None


def samples_interact(apply3, params, x1, x2, aux, fn_name: str, rtol: float = 1e-4) -> bool:
    """Whether sample 0's output changes with its batch; False when abstract or too few."""
    try:
        batches = _batches(x1, x2)
        if batches is None:
            return False

        def stack(samples):
            return jax.tree.map(lambda *leaves: np.concatenate(leaves), *samples)

        run = jit_tuned(apply3, QUICK_CPU_OPTIONS)
        try:
            out_b, out_c = (jax.tree.leaves(run(params, stack(b), aux)) for b in batches)
        except jax.errors.UnexpectedTracerError as error:
            raise _checks.leaked_tracer_error(fn_name, error) from error
        except (TypeError, ValueError, IndexError) as error:
            what = f"the model fails on a batch of {len(batches[0])} samples: {one_line(error)}"
            fix = "keep the batch axis for any N (vmap_axes=0 checks small batches)"
            raise bad(ValueError, fn_name, what, fix, see="samples-interact") from error
        for b, c in zip(out_b, out_c, strict=True):
            b0, c0 = np.asarray(b, np.float64)[:1], np.asarray(c, np.float64)[:1]
            scale = max(np.abs(b0).max(initial=0.0), np.abs(c0).max(initial=0.0), 1e-30)
            if not np.all(np.isfinite(b0)) or not np.all(np.isfinite(c0)):
                return False  # non-finite inputs are reported elsewhere
            if np.abs(b0 - c0).max(initial=0.0) > rtol * scale:
                return True
        return False
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return False
