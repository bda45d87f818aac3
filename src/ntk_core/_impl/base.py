"""What an implementation is (:class:`Impl`) and the pieces their contractions share."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

#: The ``precision`` option as ``lax.Precision``, for the contractions' einsums.
PRECISION = {
    p.name.lower(): p for p in (lax.Precision.HIGHEST, lax.Precision.HIGH, lax.Precision.DEFAULT)
}

#: XLA options of the library's programs (features, tiles, mirror) on CPU: XLA's older
#: fusion emitters compile them in about half the time (LeNet N = 500 first call 2.91 ->
#: 1.85 s, warm within the run-to-run spread; benchmarks/README.md, first calls); LLVM at
#: -O1 (XLA's default: -O2) compiles faster still, warm calls within the spread (their
#: time is in library GEMMs and convolutions; 2026-12-06, 6 alternating runs with the
#: jaxpr proof of :mod:`ntk_core._jax.sample_axes`: MLP 784-1000-1 first call 0.28 ->
#: 0.24 s, LeNet N = 500 1.43 -> 1.39 s, ResNet-18 5.3-6.4 -> 4.8-5.2 s).
#: YNNPACK's reduce fusions off (jax 0.10.2's XLA: with them, a jitted float32 Jacobian of
#: a patch convolution followed by LayerNorm was 16 % off, and NTK-vector products of a
#: ViT 0.7 %, where float64 and op-by-op runs are exact; tests/core/test_cpu_fusions.py.
#: Warm, 2026-12-07, 2 alternating runs each, load 1.7: LeNet N = 500 0.97-0.99 s against
#: 1.04-1.07 s with them, a small ResNet 16 x 16 0.52-0.53 s against 0.49-0.50 s; first
#: calls the same). The value "" enables no YNNPACK fusion type
#: (XLA's flag syntax "-reduce" is not accepted as a compile option). Options this
#: XLA does not know are dropped (:func:`known_options`). ``EXACT_CPU_OPTIONS`` alone: for
#: programs otherwise compiled with XLA's defaults (sketches, Monte Carlo batches,
#: matrix-free NTK-vector products).
EXACT_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
CPU_OPTIONS = {
    "xla_cpu_use_fusion_emitters": False,
    "xla_backend_optimization_level": 1,
    **EXACT_CPU_OPTIONS,
}
#: For programs whose run time is negligible (the independence probe's batches of three
#: samples): no backend optimisation, compiled 2-4x faster (LeNet 0.24 -> 0.06 s).
QUICK_CPU_OPTIONS = CPU_OPTIONS | {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}
_JIT_TAKES_OPTIONS = "compiler_options" in inspect.signature(jax.jit).parameters


try:  # JAX has no public test of this (jax._src.core since 0.4)
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:  # another JAX: the arguments' tracers tell (the older behaviour)
    _trace_state_clean = None


def at_top_level() -> bool:
    """Whether no JAX transformation is tracing: under a user's ``jax.grad`` of a value the
    model closes over, every argument is concrete, yet only a top-level jit takes options."""
    return _trace_state_clean is None or bool(_trace_state_clean())


def _tunable() -> bool:
    """Whether this JAX's jit takes XLA options and the backend is the CPU."""
    return _JIT_TAKES_OPTIONS and jax.default_backend() == "cpu"


def tuned(options: dict) -> dict:
    """``jax.jit``'s keyword for XLA ``options`` on CPU (``{}`` elsewhere, or where jit
    takes none); only a top-level jit may be given them."""
    return {"compiler_options": known_options(options)} if _tunable() and at_top_level() else {}


@functools.cache
def _known(name: str, value) -> bool:
    try:
        jax.jit(lambda: 0, compiler_options={name: value}).lower().compile()
    except Exception:  # noqa: BLE001 - "No such compile option" (XLA's error types vary)
        return False
    return True


def known_options(options: dict) -> dict:
    """``options`` without those this JAX's XLA rejects (each tried once, on a trivial
    program, the first time it is asked for)."""
    return {k: v for k, v in options.items() if _known(k, v)}


#: While set (:func:`memory_checked`; per thread): ``check(name, stats)``, called with
#: XLA's memory analysis of each program a :func:`jit_tuned` function runs, before it runs.
_MEMORY_CHECK: contextvars.ContextVar = contextvars.ContextVar("memory_check", default=None)


@contextlib.contextmanager
def memory_checked(check: Callable):
    """Within it, each :func:`jit_tuned` call outside a trace is compiled ahead of time
    (``lower(...).compile()``: the executable jit's cache then holds, so what runs is that
    one and nothing compiles twice) and ``check(fn name, compiled.memory_analysis())`` runs
    before it, which may raise (given the compiler's ``RESOURCE_EXHAUSTED`` error instead
    where compiling found it does not fit). The engine enters it on the first call of an input
    signature only: warm calls pay nothing."""
    token = _MEMORY_CHECK.set(check)
    try:
        yield
    finally:
        _MEMORY_CHECK.reset(token)


def jit_tuned(fn: Callable, options: dict = CPU_OPTIONS, **jit_kwargs) -> Callable:
    """``jax.jit(fn, **jit_kwargs)``, compiled with ``options`` (XLA's) on CPU when called
    outside a trace, and its compiled memory checked within :func:`memory_checked`. The
    backend is asked at each call, never here: these are built when ``ntk_core`` is
    imported, and asking would start JAX's backend then (XLA_FLAGS, the platform and
    ``jax.distributed.initialize`` set after the import would be ignored)."""
    plain = jax.jit(fn, **jit_kwargs)
    tuned_jit = []  # built at the first CPU call: the options XLA knows are asked then

    def call(*args, **kwargs):
        traced = any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(args))
        plain_here = traced or not at_top_level() or not _tunable()
        if not plain_here and not tuned_jit:
            tuned_jit.append(jax.jit(fn, compiler_options=known_options(options), **jit_kwargs))
        jitted = plain if plain_here else tuned_jit[0]
        check = _MEMORY_CHECK.get()
        if check is not None and not traced and at_top_level():
            check(fn.__name__, _memory_analysis(jitted, args, kwargs))
        return jitted(*args, **kwargs)

    return call


def _memory_analysis(jitted, args, kwargs):
    """XLA's ``memory_analysis()`` of ``jitted`` compiled for these arguments; None where
    the backend gives none; the compiler's error where it found that the program does not
    fit (XLA TPU compiles no program whose temporaries exceed the chip's memory:
    ``RESOURCE_EXHAUSTED``, seen on a TPU v5e)."""
    try:
        compiled = jitted.lower(*args, **kwargs).compile()
    except Exception as e:  # JAX's runtime error types move between versions
        if "RESOURCE_EXHAUSTED" in str(e):
            return e
        raise
    try:
        return compiled.memory_analysis()
    except (NotImplementedError, AttributeError):  # backends without the analysis
        return None


class StructureHooks(NamedTuple):
    """The structured analysis' hooks the planner calls (``analysis_for``,
    ``choose_modes``, ``method_labels``, ``late_modes`` of
    :mod:`ntk_core._structured.analysis`)."""

    analyse: Callable
    modes: Callable
    labels: Callable
    late: Callable


class Impl(NamedTuple):
    """One implementation: its two pure, module-level phases and its capabilities
    (``config``: the call's static :class:`~ntk_core._kernel.pipeline.Config`)."""

    name: str  # the implementation option ("nngp": selected by the kernel kind)
    title: str  # what messages call it
    # features(apply3, config, chunks) -> jitted features(params, x, aux); None: none
    features: Callable | None
    # contract(fa, fb, *, config) (fb None: Gram matrix of fa), or without features
    # contract(params, xa, xb, aux, *, apply3, config)
    contract: Callable
    separates_leaves: bool  # computes per-leaf kernels (ntk_per_leaf)
    whole_batch_as: str  # what computes it with vmap_axes=None
    cotangent_chunks: bool = False  # vmap_axes=None pulls cotangents back in chunks
    estimate: Callable | None = None  # estimate(cost.Call) -> (FLOPs, memory, seconds)
    analysis: StructureHooks | None = None  # runs on the structured analysis
    pair_terms: Callable = lambda config: 1  # kernel-sized temporaries per pair in a tile
    feature_bytes: Callable | None = None  # (config) -> one sample's features, bytes
    # model_failure(spec, checked, params, x1, x2, aux) -> the model's error, or None
    model_failure: Callable | None = None
    failure_message: Callable | None = None  # (fn_name, error) -> refusal message

    @property
    def uses_analysis(self) -> bool:
        return self.analysis is not None

    @property
    def needs_independence(self) -> bool:
        return self.whole_batch_as != self.name


def finish(per_leaf, config):
    """Per-output-leaf lists of per-leaf kernels -> the result pytree (summed unless
    ``"ntk_per_leaf"``)."""
    if config.kind == "ntk_per_leaf":
        by_leaf = [
            jax.tree.unflatten(config.out_tree, [terms[i] for terms in per_leaf])
            for i in range(config.params_tree.num_leaves)
        ]
        return jax.tree.unflatten(config.params_tree, by_leaf)
    return jax.tree.unflatten(config.out_tree, [functools.reduce(jnp.add, t) for t in per_leaf])
