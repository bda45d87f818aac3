"""A layer: neural-tangents' triple ``(init_fn, apply_fn, kernel_fn)`` and the combinators.

``init_fn(key, input_shape) -> (output_shape, params)`` and ``apply_fn(params, x)``
define the finite network (our empirical and Monte Carlo kernels run on it);
``kernel_fn`` (:class:`~ntk_core._infinite.kernel_fn.KernelFn`) holds the layer's
:class:`Rule`, the map of the kernel state (:class:`~.state.Kern`) at infinite width.
Branches carry tuples of states: FanOut makes them, ``parallel`` maps them, FanInSum and
FanInConcat join them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ntk_core._blocked.barrier import barrier
from ntk_core._errors import bad, check_int
from ntk_core._infinite import fused_conv, masking
from ntk_core._infinite.state import Kern, joined_masks


def _same(need):
    return need


@dataclasses.dataclass(frozen=True, eq=False)
class Rule:
    """How a layer maps the kernel state: ``transform(Kern | tuple) -> Kern | tuple``;
    ``needs(full_out) -> full_in``: whether the layer's input must hold the full spatial
    covariance, given whether its output must (a bool, or a tuple per branch); ``name``:
    the layer with its arguments (messages and the ``out=`` file's fingerprint)."""

    name: str
    transform: Callable[[Any], Any]
    needs: Callable[[Any], Any] = _same
    branches: bool = False  # its input may be a tuple of branches (parallel, FanIn*, Identity)
    # the layer's exact arguments where they alone fix its maths (Dense, Conv, the closed-form
    # nonlinearities), else None: equal keys repeat as one scanned step in ``serial``
    key: Any = None
    parts: tuple = ()  # a serial's layers' rules (a repeated block's fused path reads them)
    repeats: tuple | None = None  # repeat(layer, n): (its rules, n), as parts


class Layer(NamedTuple):
    """``(init_fn, apply_fn, kernel_fn)``; unpacks as neural-tangents' layers do."""

    init_fn: Callable
    apply_fn: Callable
    kernel_fn: Any  # KernelFn


#: What wraps a layer's rule into its public ``kernel_fn``: ``kernel_fn.KernelFn``, which
#: registers itself when ``ntk_core._infinite`` is imported (as implementations register in
#: ``_impl``), so that the layers' maths is not stacked on the blocked engine it calls.
CALL: dict[str, Callable] = {}


def make_layer(
    rule: Rule, init_fn: Callable, apply_fn: Callable, mask_fn=None, passes_masks=False
) -> Layer:
    """The triple; ``apply_fn`` takes neural-tangents' ``mask_constant`` (:mod:`.masking`):
    a combinator's (``passes_masks``) passes masked activations through to its layers, a
    layer's reads its input's masks and gives its output's by ``mask_fn`` (None: same)."""
    if passes_masks:
        apply_fn = masking.public(apply_fn)
    else:
        apply_fn = masking.leaf(apply_fn, mask_fn)
    return Layer(init_fn, apply_fn, CALL["kernel_fn"](rule))


def rule_of(fn: str, value, position: str) -> Rule:
    """The :class:`Rule` of a layer triple; TypeError for anything else."""
    kernel_fn = value[2] if isinstance(value, tuple) and len(value) == 3 else None
    rule = getattr(kernel_fn, "rule", None)
    if not isinstance(rule, Rule):
        got = f"{type(value).__name__}" + (f" of {len(value)}" if isinstance(value, tuple) else "")
        what = (
            f"{position} must be a layer of ntk_core.stax (init_fn, apply_fn, kernel_fn), got {got}"
        )
        fix = "build every layer with ntk_core.stax (Dense, Relu, serial, ...)"
        raise bad(TypeError, fn, what, fix)
    return rule


def stateless(apply: Callable[[Any], Any]):
    """(init_fn, apply_fn) of a layer without parameters applying ``apply(x)``."""

    def init_fn(key, input_shape):
        del key
        return tuple(
            jax.eval_shape(apply, jax.ShapeDtypeStruct(input_shape, jnp.float32)).shape
        ), ()

    def apply_fn(params, x, **kwargs):
        del params, kwargs
        return apply(x)

    return init_fn, apply_fn


def named(kern: Kern | tuple, name: str):
    """``kern`` marked as made by ``name`` (every branch of a tuple)."""
    if isinstance(kern, tuple):
        return tuple(named(k, name) for k in kern)
    return kern.replace(source=name, inputs=None)


def settled(kern):
    """``kern`` with its arrays behind an optimisation barrier: XLA may not fuse a layer
    into the next one's reads. Without it XLA CPU recomputes a nonlinearity's closed form in
    every shifted read of the following convolution (a 21-layer ReLU CNN, N = 64: 48 s
    warm unrolled against 3 s with the layers in a scan, whose steps it cannot fuse)."""
    if isinstance(kern, tuple):
        return tuple(settled(k) for k in kern)
    arrays = {f: getattr(kern, f) for f in _ARRAYS if getattr(kern, f) is not None}
    return kern.replace(**dict(zip(arrays, barrier(tuple(arrays.values())), strict=True)))


def _chain(rules, kern):
    for rule in rules:
        kern = named(apply(rule, kern), rule.name)
    return kern


def apply(rule: Rule, kern):
    """``rule.transform(kern)``; ValueError for branches reaching a one-input layer."""
    if isinstance(kern, tuple) and not rule.branches:
        what = f"{rule.name} got {len(kern)} branches (after FanOut)"
        fix = (
            "put parallel(...) after FanOut and join the branches with FanInSum() or FanInConcat()"
        )
        raise bad(ValueError, "kernel_fn", what, fix)
    return rule.transform(kern)


def _run(rules, start: int, longest_period: int = 4) -> tuple[int, int]:
    """(period p, count c): ``rules[start:start + p]`` is repeated c times in a row, the
    same layer objects (``[Dense(...), Relu()] * 20`` repeats its two objects) or layers
    of equal ``key`` (``[Conv(...) for _ in range(20)]``: without it 200x slower warm on
    XLA CPU, a 21-layer CNN at N = 64); the longest such run, the shortest period among
    equals."""
    best = (1, 1)
    for p in range(1, longest_period + 1):
        block = rules[start : start + p]
        if len(block) < p:
            break
        count = 1
        while start + (count + 1) * p <= len(rules) and all(
            _same_layer(a, b)
            for a, b in zip(rules[start + count * p : start + (count + 1) * p], block, strict=True)
        ):
            count += 1
        if p * count > best[0] * best[1]:
            best = (p, count)
    return best


def _same_layer(a: Rule, b: Rule) -> bool:
    return a is b or (a.key is not None and a.key == b.key)


def serial(*layers) -> Layer:
    """Layers in sequence (neural-tangents' ``stax.serial``): ``init_fn`` and ``apply_fn``
    chain the finite layers, ``kernel_fn`` composes their kernel maps. Consecutive
    repeats of the same layer objects (``[Dense(...), Relu()] * 20``) run as one
    ``lax.scan`` step. Raises TypeError for anything that is not a stax layer."""
    rules = [rule_of("stax.serial", v, f"layer {i}") for i, v in enumerate(layers)]

    def transform(kern):
        # on a TPU, a CNN-GAP from the inputs in one kernel per pair (fused_conv.network)
        fused = fused_conv.network(rules, kern)
        kern, i = fused if fused is not None else (kern, 0)
        while i < len(rules):
            period, count = _run(rules, i)
            if count >= 3:  # e.g. [Dense, Erf] * 13: one scanned step to compile and run
                block = rules[i : i + period]
                kern = repeated(lambda k, block=block: _chain(block, k), count, kern, block)
                i += period * count
            else:
                kern = settled(named(apply(rules[i], kern), rules[i].name))
                i += 1
        return kern

    def needs(full):
        for rule in reversed(rules):
            full = rule.needs(full)
        return full

    def init_fn(key, input_shape):
        params = []
        for (init, _, _), k in zip(
            layers, jax.random.split(key, max(len(layers), 1)), strict=False
        ):
            input_shape, p = init(k, input_shape)
            params.append(p)
        return input_shape, tuple(params)

    def apply_fn(params, x, **kwargs):
        rngs = _split_rng(kwargs, len(layers))
        for (_, apply, _), p, rng in zip(layers, params, rngs, strict=True):
            x = apply(p, x, **rng)
        return x

    name = "serial(" + ", ".join(r.name for r in rules) + ")"
    branches = not rules or rules[0].branches
    keys = tuple(r.key for r in rules)
    key = None if None in keys else ("serial", *keys)  # [serial(Conv, Relu) for _ in ...]
    rule = Rule(name, transform, needs, branches, key, tuple(rules))
    return make_layer(rule, init_fn, apply_fn, passes_masks=True)


def _split_rng(kwargs, n):
    rng = kwargs.get("rng")
    if rng is None:
        return [kwargs] * n
    return [{**kwargs, "rng": k} for k in jax.random.split(rng, n)]


def parallel(*layers) -> Layer:
    """Each layer on its own branch of a tuple of inputs (neural-tangents' ``parallel``)."""
    rules = [rule_of("stax.parallel", v, f"layer {i}") for i, v in enumerate(layers)]

    def transform(kerns):
        if not isinstance(kerns, tuple) or len(kerns) != len(rules):
            got = f"{len(kerns)} branches" if isinstance(kerns, tuple) else "one input"
            what = f"parallel of {len(rules)} layers got {got}"
            raise bad(ValueError, "kernel_fn", what, f"put FanOut({len(rules)}) before it")
        return tuple(r.transform(k) for r, k in zip(rules, kerns, strict=True))

    def needs(full):
        fulls = full if isinstance(full, tuple) else (full,) * len(rules)
        return tuple(r.needs(f) for r, f in zip(rules, fulls, strict=True))

    def init_fn(key, input_shapes):
        keys = jax.random.split(key, max(len(layers), 1))
        done = [v[0](k, s) for v, k, s in zip(layers, keys, input_shapes, strict=False)]
        return tuple(d[0] for d in done), tuple(d[1] for d in done)

    def apply_fn(params, xs, **kwargs):
        rngs = _split_rng(kwargs, len(layers))
        return tuple(v[1](p, x, **r) for v, p, x, r in zip(layers, params, xs, rngs, strict=True))

    name = "parallel(" + ", ".join(r.name for r in rules) + ")"
    rule = Rule(name, transform, needs, branches=True)
    return make_layer(rule, init_fn, apply_fn, passes_masks=True)


def FanOut(num: int) -> Layer:
    """``num`` copies of the input, one per branch."""
    num = check_int("stax.FanOut", "num", num, "pass e.g. FanOut(2)")

    def needs(full):
        return any(full) if isinstance(full, tuple) else full

    def init_fn(key, input_shape):
        return (input_shape,) * num, ()

    def apply_fn(params, x, **kwargs):
        return (x,) * num

    rule = Rule(f"FanOut({num})", lambda k: (k,) * num, needs)
    return make_layer(rule, init_fn, apply_fn, lambda mask, x: (mask,) * num)


def _branches(fn: str, kerns) -> tuple:
    if not isinstance(kerns, tuple):
        what = f"{fn} needs branches, got one input"
        fix = "put FanOut(n) and parallel(...) before it"
        raise bad(ValueError, "kernel_fn", what, fix)
    return kerns


def FanInSum() -> Layer:
    """The sum of the branches: Σ = Σ_b Σ_b, Θ = Σ_b Θ_b (independent branches: each has
    its own weights, and a branch without weights is uncorrelated with one with them)."""

    def transform(kerns):
        kerns = _branches("FanInSum", kerns)
        channels = {k.channels for k in kerns}
        if len(channels) > 1:
            what = f"FanInSum's branches have different widths {sorted(channels)}"
            fix = "give every branch the same out_dim / out_chan, or use FanInConcat"
            raise bad(ValueError, "kernel_fn", what, fix)
        return _join(kerns, [1.0] * len(kerns), kerns[0].channels)

    def init_fn(key, input_shapes):
        return input_shapes[0], ()

    def apply_fn(params, xs, **kwargs):
        return sum(xs[1:], xs[0])

    rule = Rule("FanInSum()", transform, branches=True)
    return make_layer(rule, init_fn, apply_fn, masking.all_of)


def FanInConcat(axis: int = -1) -> Layer:
    """The branches concatenated along the channel axis: the kernels averaged with the
    branches' widths as weights. Not Gaussian in the sense a nonlinearity needs: channels
    of different branches have different covariances (a Dense layer must follow)."""
    if axis != -1:
        what = f"FanInConcat concatenates along the channel axis -1, got axis={axis!r}"
        raise bad(ValueError, "stax.FanInConcat", what, "pass axis=-1 (the channel axis)")

    def transform(kerns):
        kerns = _branches("FanInConcat", kerns)
        total = sum(k.channels for k in kerns)
        joined = _join(kerns, [k.channels / total for k in kerns], total, per_channel=True)
        return joined.replace(gaussian=False)

    def init_fn(key, input_shapes):
        first = input_shapes[0]
        return first[:-1] + (sum(s[-1] for s in input_shapes),), ()

    def apply_fn(params, xs, **kwargs):
        return jnp.concatenate(xs, axis=-1)

    rule = Rule("FanInConcat()", transform, branches=True)
    return make_layer(rule, init_fn, apply_fn, masking.concatenated)


def _join(kerns, weights, channels, per_channel=False) -> Kern:
    first = kerns[0]
    for k in kerns[1:]:
        if k.spatial != first.spatial or k.diagonal != first.diagonal:
            what = f"branches of different spatial shapes {first.spatial} and {k.spatial}"
            fix = "make every branch keep the same spatial shape"
            raise bad(ValueError, "kernel_fn", what, fix)

    def total(arrays):
        return (
            None if arrays[0] is None else sum(w * a for w, a in zip(weights, arrays, strict=True))
        )

    return first.replace(
        nngp=total([k.nngp for k in kerns]),
        ntk=total([k.ntk for k in kerns]),
        cov1=total([k.cov1 for k in kerns]),
        cov2=total([k.cov2 for k in kerns]),
        gaussian=all(k.gaussian for k in kerns),
        channels=channels,
        is_input=all(k.is_input for k in kerns),
        # the output's axis order of the majority (neural-tangents' rule; a tie: natural)
        reversed=sum(k.reversed for k in kerns) > len(kerns) / 2,
        # masked where every branch is, as neural-tangents (each branch's kernel is already
        # 0 at its own masked positions); concatenated channels keep their branch's
        masks=joined_masks([k.masks for k in kerns], per_channel),
    )


def Identity() -> Layer:
    """The input unchanged."""
    return make_layer(Rule("Identity()", lambda k: k, branches=True), *stateless(lambda x: x))


def repeat(layer: Layer, n: int) -> Layer:
    """``layer`` applied ``n`` times, each with its own parameters: ``serial(layer, ...,
    layer)``; the kernel is computed in a ``lax.scan`` when the layer keeps the kernel's
    shape, so deep repeats compile once."""
    n = check_int("stax.repeat", "n", n, "pass e.g. repeat(block, 3)", low=0)
    rule = rule_of("stax.repeat", layer, "layer")
    chain = serial(*([layer] * n))  # the finite network

    def transform(kern):
        return repeated(lambda k: named(apply(rule, k), rule.name), n, kern, rule.parts or (rule,))

    def needs(full):
        for _ in range(n):
            full = rule.needs(full)
        return full

    rule_n = Rule(
        f"repeat({rule.name}, {n})", transform, needs, rule.branches, repeats=((rule,), n)
    )
    return make_layer(rule_n, chain.init_fn, chain.apply_fn, passes_masks=True)


_ARRAYS = ("nngp", "ntk", "cov1", "cov2")


def repeated(step, n: int, kern, block=()):
    """``step`` applied ``n`` times to ``kern``: in a ``lax.scan`` when a step keeps the
    state's shapes and flags (traced once more to compare; XLA drops the unused result),
    else unrolled. ``block``: the step's layers' rules, when known: on a TPU a [ReLU, Conv]
    block with all pairs of positions runs fused (:mod:`.fused_conv`)."""
    if n == 0:
        return kern
    fused = fused_conv.plan(tuple(r.key for r in block), n, kern) if block else None
    if fused is not None:
        return fused_conv.run(fused, n, kern, block[-1].name)
    first = settled(step(kern))
    if n == 1:
        return first
    second = step(first)
    if not _scannable(first, second):
        for _ in range(n - 1):
            first = settled(step(first))
        return first

    def body(arrays, _):
        out = step(first.replace(**dict(zip(_ARRAYS, arrays, strict=True))))
        return tuple(getattr(out, f) for f in _ARRAYS), None

    arrays, _ = jax.lax.scan(body, tuple(getattr(first, f) for f in _ARRAYS), None, length=n - 1)
    # the output's axis order flips with each convolution (layout only, not the maths)
    flips = second.reversed != first.reversed and (n - 1) % 2 == 1
    out = first.replace(**dict(zip(_ARRAYS, arrays, strict=True)))
    return out.replace(reversed=first.reversed != flips)


def _scannable(before, after) -> bool:
    """Whether a layer maps ``before`` to a state of the same shapes and flags (so that
    applying it again is the same program)."""
    if not isinstance(before, Kern) or not isinstance(after, Kern):
        return False
    for f in dataclasses.fields(Kern):
        a, b = getattr(before, f.name), getattr(after, f.name)
        if f.name in _ARRAYS:
            if (a is None) != (b is None) or (
                a is not None and (a.shape, a.dtype) != (b.shape, b.dtype)
            ):
                return False
        elif f.name == "inputs":  # the network's inputs, not the state's
            continue
        elif f.name == "offset":  # a Gram tile's shift (maybe traced): kept by every layer
            if (a is None) != (b is None):
                return False
        elif a != b and f.name != "reversed":  # the output's axis order alone: no maths
            return False
    return True
