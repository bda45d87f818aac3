"""``apply_fn(params, x, mask_constant=c)``: the finite network on masked inputs, with
neural-tangents' semantics, so that its empirical and Monte Carlo kernels converge to the
masked ``kernel_fn``.

Entries of x equal to ``c`` (NaN matches NaN) are masked. Between layers an activation
travels as :class:`Masked` (its value and a boolean mask broadcastable to it, the channel
axis last, of size 1 or the channels'); every layer reads its input with the masked
entries set to 0, and its ``mask_fn`` gives its output's mask (a Dense or Conv: masked
where every channel is; a strided window: its centre's; a global pool: where every
position is). The public call returns the output with its masked entries set to 0
(neural-tangents returns a ``MaskedArray``; ``stax.unmask_fn`` of it is ours).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp


class Masked:
    """An activation inside a masked ``apply_fn``: ``value`` and ``mask`` (True where
    masked, broadcastable to ``value``). Private: never returned to users."""

    __slots__ = ("mask", "value")

    def __init__(self, value, mask):
        self.value, self.mask = value, mask


def _has(x) -> bool:
    return isinstance(x, Masked) or (isinstance(x, (tuple, list)) and any(map(_has, x)))


def _zero(value, mask):
    return jnp.where(mask, jnp.zeros((), value.dtype), value)


def to_masked(x, constant):
    """x (an array, or a tuple of them for branches) as :class:`Masked` by ``constant``."""
    if isinstance(x, Masked):
        return x
    if isinstance(x, (tuple, list)):
        return type(x)(to_masked(v, constant) for v in x)
    x = jnp.asarray(x)
    c = jnp.asarray(constant)  # may be traced: one program for every constant
    hit = jnp.where(jnp.isnan(c), jnp.isnan(x), x == c)
    return Masked(_zero(x, hit), hit)


def unmasked(out):
    """The public result: masked entries set to 0 (neural-tangents' ``unmask_fn``)."""
    if isinstance(out, Masked):
        return _zero(out.value, jnp.broadcast_to(out.mask, out.value.shape))
    if isinstance(out, (tuple, list)):
        return type(out)(unmasked(v) for v in out)
    return out


def public(apply: Callable) -> Callable:
    """The public ``apply_fn(params, x, *, mask_constant=None, **kwargs)`` of ``apply``,
    which passes :class:`Masked` activations through (a combinator's, or :func:`leaf`'s)."""

    def apply_fn(params, x, *, mask_constant=None, **kwargs):
        if mask_constant is None:
            return apply(params, x, **kwargs)
        return unmasked(apply(params, to_masked(x, mask_constant), **kwargs))

    return apply_fn


def _split(x):
    if isinstance(x, Masked):
        return _zero(x.value, x.mask), x.mask
    pairs = [_split(v) for v in x]
    return type(x)(p[0] for p in pairs), type(x)(p[1] for p in pairs)


def _join(y, mask):
    if isinstance(y, (tuple, list)):
        return type(y)(_join(v, m) for v, m in zip(y, mask, strict=True))
    return Masked(y, mask)


def leaf(apply: Callable, mask_fn: Callable | None = None) -> Callable:
    """The public ``apply_fn`` of a layer: ``apply(params, x, **kwargs)`` gets the input
    with its masked entries at 0 and, when masked, ``mask=`` (the input's mask, for the
    layers whose output depends on it: averages, attention, LayerNorm);
    ``mask_fn(mask, x) -> mask`` the output's (None: the input's)."""

    def inner(params, x, **kwargs):
        if not _has(x):
            return apply(params, x, **kwargs)
        values, mask = _split(x)
        y = apply(params, values, mask=mask, **kwargs)
        return _join(y, mask if mask_fn is None else mask_fn(mask, values))

    return public(inner)


# ----- mask_fns -----


def channels_all(mask, x):
    """Masked where every channel is (a Dense, Conv or attention output's positions)."""
    del x
    return jnp.all(mask, axis=-1, keepdims=True)


def positions_all(mask, x):
    """(N, C): masked where every position is (a global pool)."""
    del x
    return jnp.all(mask, axis=tuple(range(1, mask.ndim - 1)))


def flattened(mask, x):
    """(N, prod(S)·C): each entry's mask (Flatten)."""
    return jnp.broadcast_to(mask, x.shape).reshape(x.shape[0], -1)


def all_of(masks, xs):
    """FanInSum: masked where every branch is."""
    del xs
    out = masks[0]
    for m in masks[1:]:
        out = out & m
    return out


def concatenated(masks, xs):
    """FanInConcat: each branch's mask over its channels."""
    return jnp.concatenate(
        [jnp.broadcast_to(m, x.shape) for m, x in zip(masks, xs, strict=True)], axis=-1
    )


def masked_mean(x, mask, axes, keepdims=False):
    """neural-tangents' masked mean over ``axes``: the sum (masked entries are 0) over the
    count of unmasked entries (at least 1)."""
    seen = jnp.sum(~jnp.broadcast_to(mask, x.shape), axis=axes, keepdims=True)
    mean = jnp.sum(x, axis=axes, keepdims=True) / jnp.maximum(seen, 1).astype(x.dtype)
    return mean if keepdims else jnp.squeeze(mean, axes)
