"""The kernel-function object every ``*_fn`` entry point returns."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

from ntk_core._kernel.arguments import binding_error
from ntk_core._kernel.options import KernelOptions

#: The core kernel functions' signature; the adapters' rename ``params`` and add keywords.
SIGNATURE = inspect.signature(lambda params, x1, x2=None: None)
#: The other keywords of a call, left to the builder's ``bind``.
_OTHERS = inspect.Parameter("keywords", inspect.Parameter.VAR_KEYWORD)
#: The options every ``repr`` shows.
_SHOWN = ("implementation", "trace_axes", "diagonal_axes", "vmap_axes", "batch_size")


class KernelFunction:
    """An empirical kernel function: call it for a kernel, ask it what it will do.

    Returned by :func:`ntk_core.ntk_fn`, :func:`ntk_core.nngp_fn`,
    :func:`ntk_core.ntk_per_leaf_fn` and the adapters' ``*_fn``; its arguments are its
    builder's (``inspect.signature(kernel)``), e.g. ``kernel(params, x1, x2=None)``.
    A call returns the kernel of x1 (N1 samples) and x2 (N2; None: x1, exactly symmetric)
    in the layout of :func:`ntk_core.ntk_fn`. Inputs are validated and the implementation
    chosen once per input signature; later calls reuse the compiled programs.

    Attributes:
      name: the builder (``"ntk_fn"``, ``"ntk_flax.kernel_fn"``, ...); kind: ``"ntk"``,
      ``"ntk_per_leaf"`` or ``"nngp"``; options: the validated options.

    Raises:
      the errors of the function that built it.

    Example:
      >>> import jax.numpy as jnp
      >>> import ntk_core
      >>> kernel = ntk_core.ntk_fn(lambda w, x: jnp.tanh(x @ w))
      >>> kernel(jnp.ones((3, 2)), jnp.ones((4, 3))).shape  # (N1, N2)
      (4, 4)
      >>> kernel.implementation_for(jnp.ones((3, 2)), jnp.ones((4, 3)))
      'structured'
      >>> kernel
      KernelFunction(ntk_fn, kind='ntk', implementation='auto', trace_axes=(-1,), ...)
    """

    def __init__(self, engine, bind: Callable, signature: inspect.Signature):
        """``bind(first, x1, keywords) -> (params, aux)``; ``signature``: what it shows."""
        self._engine = engine
        self._bind = bind
        self.__signature__ = signature

    @property
    def name(self) -> str:
        return self._engine.spec.fn_name

    @property
    def kind(self) -> str:
        return self._engine.spec.kind.value

    @property
    def options(self) -> KernelOptions:
        return self._engine.spec.options

    def __call__(self, *args, **kwargs):
        first, x1, x2, keywords = self._arguments(args, kwargs, "")
        params, aux = self._bind(first, x1, keywords)
        return self._engine(params, x1, x2, aux)

    def plan(self, *args, **kwargs):
        """What a call with these arguments does: the ``Plan`` of :func:`ntk_core.plan`."""
        first, x1, x2, keywords = self._arguments(args, kwargs, ".plan")
        params, aux = self._bind(first, x1, keywords)
        return self._engine.plan(params, x1, x2, aux)

    def implementation_for(self, *args, **kwargs) -> str:
        """The implementation a call with these arguments uses (``"jacobian"``, ``"ntvp"``,
        ``"structured"`` or ``"nngp"``)."""
        first, x1, x2, keywords = self._arguments(args, kwargs, ".implementation_for")
        params, aux = self._bind(first, x1, keywords)
        return self._engine.implementation_for(params, x1, x2, aux)

    def _arguments(self, args: tuple, kwargs: dict, method: str):
        """``(first, x1, x2, other keywords)`` from a call, by position or name."""
        head = list(self.__signature__.parameters.values())[:3]  # e.g. params, x1, x2=None
        names = [p.name for p in head]
        try:
            bound = inspect.Signature([*head, _OTHERS]).bind(*args, **kwargs)
        except TypeError as e:  # too many positional arguments, x1 missing, ...
            other = sorted(set(kwargs) - set(names))
            got = f"; got the keyword argument(s) {', '.join(map(repr, other))}" if other else ""
            fix = f"call it as kernel{method}({names[0]}, x1, x2=None)"
            raise binding_error(f"{self.name}(...){method}(...)", f"{e}{got}", names, fix) from None
        values = bound.arguments
        return values[names[0]], values[names[1]], values.get(names[2]), bound.kwargs

    def __repr__(self) -> str:
        o = self.options  # the main options, then any other away from its default
        changed = [f.name for f in dataclasses.fields(o) if getattr(o, f.name) != f.default]
        names = [*_SHOWN, *(n for n in changed if n not in _SHOWN)]
        fields = "".join(f", {n}={getattr(o, n)!r}" for n in names)
        return f"KernelFunction({self.name}, kind={self.kind!r}{fields})"
