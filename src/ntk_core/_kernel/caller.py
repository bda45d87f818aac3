"""The public function behind a kernel function or check, as its messages name it."""

from __future__ import annotations

import dataclasses
import inspect


@dataclasses.dataclass(frozen=True)
class Caller:
    """One public function, as its error messages name it.

    Attributes:
      name: the first words of every message (``"ntk_fn"``, ``"ntk_flax.kernel"``).
      order: its argument order (``"(params, x1, x2)"``, ``"(model, variables, x1, x2)"``).
      model: ``"apply_fn"`` (the core) or ``"the model"`` (the adapters).
      neural_tangents_order: neural-tangents' order of the same arguments (``"(x1, x2,
        params)"``), named in hints and recognised; ``""`` where it does not apply.
      package: ``"ntk_core"``, ``"ntk_flax"`` or ``"ntk_haiku"``.
      monte_carlo: the parameters come from the model's own init.
      built: the function it returns takes the arguments of ``order``.
    """

    name: str
    order: str
    model: str = "apply_fn"
    neural_tangents_order: str = ""
    package: str = "ntk_core"
    monte_carlo: bool = False
    built: bool = False


def core(name: str, *, built: bool = False, one_input: bool = False) -> Caller:
    """A core entry point of ``(params, x1, x2)``, or ``(params, x)`` with ``one_input``."""
    if one_input:
        return Caller(
            name, "(params, x)", neural_tangents_order="(f, x_train, params)", built=built
        )
    return Caller(name, "(params, x1, x2)", neural_tangents_order="(x1, x2, params)", built=built)


def adapter_caller(package: str, fn, kernel, *, built=False, monte_carlo=False) -> Caller:
    """``fn`` of the adapter ``package`` as its messages name it, with the positional
    arguments of the adapter's ``kernel`` (``built``: of the kernel function it returns;
    ``monte_carlo``: ``fn``'s own)."""
    params = inspect.signature(fn if monte_carlo else kernel).parameters.values()
    order = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD][built:]
    name, kw = f"{package}.{fn.__name__}", dict(monte_carlo=monte_carlo, built=built)
    return Caller(name, f"({', '.join(order)})", "the model", package=package, **kw)
