"""The public entry point behind a kernel function or a check, as its messages need it.

A :class:`Caller` is made once where each public function is defined: by the core's
entry points (:func:`core`; the Monte Carlo kernels write theirs out) and by the
adapters, through :mod:`ntk_core.adapters`. The checks read its fields; nothing reads
meaning from the function's name.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Caller:
    """One public function, as its error messages name it.

    Attributes:
      name: the public name, the first words of every message (``"ntk_fn"``,
        ``"ntk_flax.kernel"``).
      order: its argument order, in messages (``"(params, x1, x2)"``,
        ``"(model, variables, x1, x2)"``, ``"(variables, x1, x2)"`` for the function
        ``ntk_flax.kernel_fn`` returns, ``"(params, x)"``).
      model: what the caller gave as the model: ``"apply_fn"`` (the core) or
        ``"the model"`` (the adapters).
      neural_tangents_order: neural-tangents' order of the same arguments, which users
        of neural-tangents pass by habit (``"(x1, x2, params)"``,
        ``"(f, x_train, params)"``): named in the argument-order hints, and recognised
        without a trace (``_checks.in_neural_tangents_order``).
        ``""`` where neural-tangents' order does not apply (the adapters, the Monte
        Carlo kernels).
      package: ``"ntk_core"``, ``"ntk_flax"`` or ``"ntk_haiku"``.
      monte_carlo: a Monte Carlo entry point: the parameters come from the model's own
        init, so no message asks for the caller's parameters.
      built: the function a build entry point (``ntk_fn``, ``kernel_fn``) returns is
        what takes the arguments of ``order``.
    """

    name: str
    order: str
    model: str = "apply_fn"
    neural_tangents_order: str = ""
    package: str = "ntk_core"
    monte_carlo: bool = False
    built: bool = False


def core(name: str, *, built: bool = False, one_input: bool = False) -> Caller:
    """A core entry point of ``apply_fn``: kernels of ``(params, x1, x2)``, or with
    ``one_input`` the matrix-free functions of ``(params, x)`` (NTK-vector products,
    spectra), each with neural-tangents' order of the same arguments."""
    if one_input:
        return Caller(
            name, "(params, x)", neural_tangents_order="(f, x_train, params)", built=built
        )
    return Caller(name, "(params, x1, x2)", neural_tangents_order="(x1, x2, params)", built=built)
