"""The kernel-function object every ``*_fn`` entry point returns."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from ntk_core._errors import bad
from ntk_core._kernel.options import KernelOptions

#: The core kernel functions' signature; the adapters' rename ``params`` and add keywords.
SIGNATURE = inspect.signature(lambda params, x1, x2=None: None)


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
        names = list(self.__signature__.parameters)[:3]  # e.g. params, x1, x2
        values = dict(zip(names, args, strict=False))
        twice = [n for n in names if n in kwargs and n in values]
        values |= {n: kwargs.pop(n) for n in names if n in kwargs}
        missing = [n for n in names[:2] if n not in values]
        if len(args) > 3 or twice or missing:
            got = f"; got the keyword argument(s) {', '.join(map(repr, sorted(kwargs)))}"
            if len(args) > 3:
                problem = f"{len(args)} positional arguments"
            elif twice:
                problem = f"got multiple values for argument {twice[0]!r}"
            else:
                problem = f"missing a required argument: {missing[0]!r}{got if kwargs else ''}"
            what = f"{problem} (expected positional arguments {', '.join(names)})"
            fix = f"call it as kernel{method}({names[0]}, x1, x2=None)"
            raise bad(TypeError, f"{self.name}(...){method}(...)", what, fix)
        return values[names[0]], values[names[1]], values.get(names[2]), kwargs

    def __repr__(self) -> str:
        o = self.options
        names = ["implementation", "trace_axes", "diagonal_axes", "vmap_axes", "batch_size"]
        extra = ("out", "resume", "overwrite", "devices")
        names += [n for n in extra if getattr(o, n) not in (None, False)]
        fields = "".join(f", {n}={getattr(o, n)!r}" for n in names)
        return f"KernelFunction({self.name}, kind={self.kind!r}{fields})"
