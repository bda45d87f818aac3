"""Analytic cost model behind ``implementation="auto"``.

FLOPs are counted from the shapes in the jaxpr of one single-sample forward pass
(``dot_general`` and ``conv_general_dilated`` exactly, every other primitive as one
operation per output element), never from XLA's cost analysis, which reports wrong or
-1 FLOPs on CPU and GPU. The reverse pass is split by what it differentiates
(:class:`PassCost`): activation gradients, per-sample weight gradients of matrix
products and of convolutions, elementwise work. ``"structured"`` needs the cotangents
at each use (activation gradients) but not the weight gradients of its structured
leaves, which is where it saves; per leaf it takes the cheaper of its Gram form
Σ_{u,v} 2·A_u·A_v·(C + O'·K) (or 2·(A_u·A_v·(C + O·K) + O'·A·K) when that order is
cheaper; a gather's token match counts C = 1, plus ``_structured.GRAM_VALUE_FLOPS`` per
value its memory-bound einsums write when A_u·A_v > 1) and its explicit form 2·O'·C·K
(``_structured.choose_modes``, the choice the computation makes; elementwise scales
and shifts, C = 1, always take the explicit form). The formulas are in
:func:`estimate`.

Each estimate also has a time in seconds (:func:`estimate`): FLOPs at the backend's
matrix-product rate, per-sample convolution kernel gradients (which XLA runs as grouped
convolutions, far below that rate on CPU) slowed by a measured factor, plus the bytes
of features written at its memory bandwidth (:data:`RATES`), plus
``_jacobian.EINSUM_PASS_FLOPS`` per kernel value for each separate contraction einsum.
``"auto"`` takes the fastest estimate among those whose features fit in
:data:`JACOBIAN_MEMORY_BUDGET` bytes (``"ntvp"`` if none does).
"""

from __future__ import annotations

import dataclasses
import math

import jax

from ntk_core._impl import jacobian as _jacobian
from ntk_core._impl.registry import AUTO, REGISTRY
from ntk_core._jax.jaxpr_walk import entries, is_literal, sub_jaxprs, sub_operands, values_written
from ntk_core._units import human_bytes as human_bytes

#: Bytes of per-sample Jacobians above which ``"auto"`` avoids ``"jacobian"``.
JACOBIAN_MEMORY_BUDGET = 4 * 2**30
#: What ``"auto"`` takes when no estimate fits :data:`JACOBIAN_MEMORY_BUDGET`: the
#: implementation without features (``"ntvp"``).


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one parameter leaf enters the kernel."""

    path: str  # e.g. "['Dense_0']['kernel']"
    size: int
    method: str  # "structured (1 matrix product)", "jacobian (fallback: <reason>)", "ntvp", ...
    #: When another implementation runs (``method`` "jacobian" or "ntvp"): the method
    #: ``implementation="structured"`` would use for this leaf ("" when not estimated).
    structured: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What an NTK call does: the implementation used, every estimate, each leaf."""

    implementation: str
    estimates: tuple  # CostEstimate for each implementation considered
    leaves: tuple[LeafPlan, ...]
    requested: str = ""  # the implementation option ("auto" when it chose)
    #: With ``batch_size`` set: the blocked engine's tiles (``_blocked.Tiling``: the
    #: block sizes ``batch_size="auto"`` picks, the tile count, the budget).
    tiling: object = None
    #: With ``vmap_axes=None`` and the Jacobian contraction: its :class:`WholeBatch`
    #: (output cotangents per chunk, chunks, bytes).
    whole_batch: object = None

    def __str__(self) -> str:
        how = f" (chosen by implementation={AUTO!r})" if self.requested == AUTO else ""
        requested = REGISTRY.get(self.requested)  # None: "auto"
        if requested is not None and self.implementation != requested.name:
            how = (  # it needs per-sample independence (Impl.whole_batch_as)
                f" (implementation={requested.name!r} with vmap_axes=None: the whole batch "
                f"is differentiated, there is no per-sample structure to use)"
            )
        lines = [
            f"implementation: {self.implementation}{how}",
            "  estimates (FLOPs, peak memory, warm run time; compilation excluded):",
        ]
        for e in self.estimates:
            mib = e.memory_bytes / 2**20
            lines.append(
                f"  {e.implementation:<10} {e.flops:12.3e} FLOPs  {mib:10.1f} MiB"
                f"  ~{e.seconds:.3g} s"
            )
        alternative = any(leaf.structured for leaf in self.leaves)
        head = f"  {'parameter leaf':<40} {'size':>10}  method"
        lines.append(head + ("     (implementation='structured' would use)" if alternative else ""))
        for leaf in self.leaves:
            line = f"  {leaf.path:<40} {leaf.size:>10}  {leaf.method}"
            lines.append(line + (f"  ({leaf.structured})" if leaf.structured else ""))
        if self.tiling is not None:
            lines.append(f"  {self.tiling}")
        if self.whole_batch is not None:
            lines.append(f"  {self.whole_batch}")
        return "\n".join(lines)


def _eqn_flops(eqn) -> float:
    """FLOPs of one matrix product or convolution (0 for anything else)."""
    name = eqn.primitive.name
    out_size = sum(entries(v) for v in eqn.outvars)
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        return 2.0 * out_size * math.prod(lhs_shape[d] for d in lhs_contract)
    if name == "conv_general_dilated":
        rhs_shape = eqn.invars[1].aval.shape
        rhs_spec = eqn.params["dimension_numbers"].rhs_spec
        return 2.0 * out_size * math.prod(rhs_shape[d] for d in rhs_spec[1:])
    return 0.0


def conv_channel_weight(eqn) -> float:
    """1 / (C_out^1.5 · C_in^0.6) for a convolution (0 for anything else): the shape
    of its slowdown per FLOP against a large matrix product,
    ``Rates.conv_channel_slowdown`` times this, plus one. XLA CPU runs convolutions
    with few channels far below its matrix-product rate; measured (2 cores, jax
    0.10.2; NHWC, SAME, batch 32-500; C_in -> C_out, kernel: slowdown): 1 -> 6, 5x5:
    39x; 6 -> 16, 5x5: 4x; 3 -> 16, 3x3: 8x; 16 -> 16, 3x3: 1.6x; 1 -> 64, 3x3:
    2.1x; 32 -> 32 and 64 -> 64, 3x3: 1.1-1.2x. The fit 1 + 550 / (C_out^1.5 ·
    C_in^0.6) is within 1.7x of each (16 -> 16: 2.6x against 1.6x). Measured in one run
    beside another job, as ratios to that run's matrix-product rate."""
    if eqn.primitive.name != "conv_general_dilated":
        return 0.0
    rhs_shape = eqn.invars[1].aval.shape
    out_dim, in_dim = eqn.params["dimension_numbers"].rhs_spec[:2]
    c_out = rhs_shape[out_dim]
    c_in = rhs_shape[in_dim] * eqn.params.get("feature_group_count", 1)
    return 1.0 / (max(c_out, 1) ** 1.5 * max(c_in, 1) ** 0.6)


@dataclasses.dataclass
class PassCost:
    """FLOPs of one single-sample forward pass and of one reverse pass (one output
    cotangent) split by what the reverse pass differentiates.

    A matrix product or convolution operand that depends on the parameters gets a
    gradient: an *activation* gradient when it depends on the input too, a per-sample
    *weight* gradient when it depends on the parameters alone (the reverse-pass FLOPs of
    each equal the forward FLOPs of the product). Every other operation counts one FLOP
    per output value forward and two in the reverse pass when it depends on the
    parameters.
    """

    forward: float = 0.0
    grad_activations: float = 0.0
    grad_weights_dot: float = 0.0
    grad_weights_conv: float = 0.0
    grad_elementwise: float = 0.0
    #: Convolutions' FLOPs weighted by their few-channel slowdown less one
    #: (:func:`conv_channel_weight`): forward, and in the activation gradient.
    conv_forward_extra: float = 0.0
    conv_activation_extra: float = 0.0

    def add(self, other: PassCost, times: float = 1.0) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + times * getattr(other, f.name))


def pass_cost(jaxpr, depends: list[tuple[bool, bool]]) -> PassCost:
    """:class:`PassCost` of ``jaxpr`` whose inputs depend on (parameters, input) as
    ``depends`` says. Sub-jaxprs (``_jaxpr_walk.sub_jaxprs``) are followed with their
    equation's operands (``_jaxpr_walk.sub_operands``; where they do not map one to one,
    every input depends on what any operand does), the costliest one counted (a
    ``cond``'s branches), ``length`` times for a ``scan``'s body."""
    cost = PassCost()
    flags: dict = dict(zip(jaxpr.invars, depends, strict=True))

    def get(v):
        return (False, False) if is_literal(v) else flags.get(v, (False, False))

    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        on_p = any(f[0] for f in ins)
        on_x = any(f[1] for f in ins)
        name = eqn.primitive.name
        product = _eqn_flops(eqn)
        subs = list(sub_jaxprs(eqn))
        if product:
            cost.forward += product
            extra = product * conv_channel_weight(eqn)
            cost.conv_forward_extra += extra
            for dep_p, dep_x in ins[:2]:
                if dep_p and dep_x:
                    cost.grad_activations += product
                    cost.conv_activation_extra += extra
                elif dep_p and name == "conv_general_dilated":
                    cost.grad_weights_conv += product
                elif dep_p:
                    cost.grad_weights_dot += product
        elif subs:
            repeat = eqn.params.get("length", 1) if name == "scan" else 1
            worst = None
            for sub in subs:
                operands = sub_operands(eqn, sub)
                if operands is None:
                    inner = pass_cost(sub, [(on_p, on_x)] * len(sub.invars))
                else:
                    inner = pass_cost(sub, [get(v) for v in operands])
                if worst is None or inner.forward > worst.forward:
                    worst = inner
            cost.add(worst, repeat)
        else:
            size = sum(entries(v) for v in eqn.outvars)
            cost.forward += size
            if on_p:
                cost.grad_elementwise += 2.0 * size
        for v in eqn.outvars:
            flags[v] = (on_p, on_x)
    return cost


@dataclasses.dataclass(frozen=True)
class WholeBatch:
    """Memory of differentiating the whole batch at once (``vmap_axes=None``): the
    forward pass's residuals (V_batch values), and what each output cotangent's
    reverse pass adds (cotangents of the live values, about V_batch / 2, and one
    gradient of the P parameters). The Jacobian contraction pulls ``chunk``
    cotangents back at a time."""

    residual_bytes: int
    cotangent_bytes: int
    chunk: int
    cotangents: int

    @property
    def peak_bytes(self) -> int:
        return self.residual_bytes + self.chunk * self.cotangent_bytes

    def __str__(self) -> str:
        pieces = -(-self.cotangents // self.chunk)
        return (
            f"whole batch (vmap_axes=None): {self.cotangents} output cotangents pulled "
            f"back {self.chunk} at a time ({pieces} chunks; residuals "
            f"{human_bytes(self.residual_bytes)}, {human_bytes(self.cotangent_bytes)} per "
            f"cotangent)"
        )


def whole_batch(
    jaxpr, n_params: int, cotangents: int, itemsize: int, budget: int, jac_bytes: int, scale=1.0
):
    """The :class:`WholeBatch` of a batch's jaxpr (its values times ``scale``, for a
    batch of another size): ``chunk`` = the cotangents whose reverse passes fit in
    ``budget`` beside the residuals and the Jacobian (``jac_bytes``), at least 1 and at
    most all ``cotangents`` (N·O)."""
    values = int(values_written(jaxpr) * scale)
    residual = values * itemsize
    # Half the forward values per cotangent: a reverse pass holds the live ones only
    # (Conv-64 net, 32 inputs: 401 MB measured at the chunk the full count gave 1013 MB).
    per_cotangent = (values // 2 + n_params) * itemsize
    room = budget - residual - jac_bytes
    chunk = int(min(cotangents, max(1, room // max(per_cotangent, 1))))
    return WholeBatch(residual, per_cotangent, chunk, cotangents)


@dataclasses.dataclass(frozen=True)
class Rates:
    """What the time estimates assume of a backend.

    ``flops_per_s``: dense matrix-product rate; ``bytes_per_s``: memory bandwidth;
    ``conv_weight_grad_slowdown``: how much slower than ``flops_per_s`` per-sample
    gradients of convolution kernels run under ``vmap`` (XLA lowers them to grouped
    convolutions); ``conv_channel_slowdown``: the few-channel slowdown of convolutions
    (:func:`conv_channel_weight`); ``conv_weight_grad_loop_slowdown``: a whole
    batch's convolution kernel gradients inside an XLA loop;
    ``explicit_jacobian_slowdown``: the explicit per-sample Jacobians of
    ``"structured"``.
    """

    flops_per_s: float
    bytes_per_s: float
    conv_weight_grad_slowdown: float
    conv_channel_slowdown: float = 0.0
    #: How much slower than ``flops_per_s`` a whole batch's reverse pass runs the
    #: gradient of a convolution's kernel inside an XLA loop (``lax.map``: the column
    #: loop of ``"ntvp"`` with ``vmap_axes=None``).
    conv_weight_grad_loop_slowdown: float = 1.0
    #: How much slower than ``flops_per_s`` the explicit per-sample Jacobians of
    #: ``"structured"`` (recorded inputs times cotangents, contracted over the A
    #: positions: small batched products) run.
    explicit_jacobian_slowdown: float = 1.0


#: CPU: float32 matrix products measured at 115-125 GFLOP/s on the 2-core CI CPU (jax
#: 0.10.2). 10 GB/s is an assumed bandwidth (host copies of tiles measured 3-6 GB/s,
#: so feature bytes are if anything undercounted). Per-sample convolution kernel
#: gradients: 30-150x slower per FLOP than matrix products, derived from the measured
#: feature-phase times of ``"jacobian"`` and ``"structured"`` on the ResNet-style CNN and
#: LeNet (load 1-4) and their counted FLOPs; the whole batch's reverse passes vmapped
#: over 64 cotangents (``"jacobian"``, ``vmap_axes=None``, the issue-17 conv net) ran
#: their kernel gradients at 1/41 of the 2000x2000 matrix product's rate in the same
#: run (14.1 ms per cotangent against 4.1 ms for one reverse pass alone, load 2); 40
#: (was 20, the conservative end, which put that case at 1.9-3.2x). GPU: nominal
#: figures of a data-centre GPU (not measured by this project; only their ratios matter
#: to the choice; no loop penalty assumed). A whole batch's reverse pass inside an XLA
#: loop: the issue-17 conv net (Conv 64 3x3 on 32 inputs 28x28x1, one output cotangent,
#: 29 MFLOP of kernel gradient) took 2.6 ms alone and 27.8 ms per step of ``lax.map``
#: (load 0.2-0.7; its JVP 1.4 and 1.3 ms: forward mode is not slowed), 1/115 of the
#: matrix-product rate; the blocked whole-batch Jacobian measured 8x in a loop against
#: alone earlier (benchmarks/README.md, ``vmap_axes=None``). 100: the conservative end. Explicit
#: per-sample Jacobians (``"ca,oak->cok"`` per sample, in batches of a few MiB of
#: patches): the nine convolutions of the ResNet-style CNN at N = 128, O = 10 (32 GFLOP,
#: A = 64-1024, C = 16-576, K = 16-64) ran at 36 GFLOP/s against 84 for the 2000x2000
#: matrix product in the same run (load 2.5-3.3; 8-70 GFLOP/s by shape): 2.4x slower.
RATES = {
    "cpu": Rates(
        flops_per_s=1.2e11,
        bytes_per_s=1.0e10,
        conv_weight_grad_slowdown=40.0,
        conv_channel_slowdown=550.0,
        conv_weight_grad_loop_slowdown=100.0,
        explicit_jacobian_slowdown=2.4,
    ),
    "gpu": Rates(
        flops_per_s=5.0e13,
        bytes_per_s=3.0e12,
        conv_weight_grad_slowdown=2.0,
        conv_weight_grad_loop_slowdown=2.0,
    ),
}


def rates_for(backend: str | None = None) -> Rates:
    """The :data:`RATES` of ``backend`` (default: JAX's default backend)."""
    backend = backend or jax.default_backend()
    return RATES["cpu"] if backend == "cpu" else RATES["gpu"]


@dataclasses.dataclass(frozen=True)
class CostEstimate:
    """Estimated FLOPs, peak memory (bytes: features, the kernel, the passes in
    flight) and time (seconds) of one implementation for one call; ``seconds`` is what
    ``"auto"`` minimises (see :func:`estimate`)."""

    implementation: str
    flops: float
    memory_bytes: float
    seconds: float = 0.0


def estimate(
    single_fn,
    params,
    x_one,
    aux,
    *,
    n1,
    n2,
    pairs,
    out_sizes,
    pair_sizes,
    symmetric,
    analysis,
    triangle=None,
    whole_batch=None,
    jaxpr=None,
    kernel_sizes=None,
):
    """Cost estimates of ``"jacobian"``, ``"ntvp"`` and ``"structured"`` for one call.

    With the single-sample costs of :class:`PassCost` (F forward; per output cotangent
    G_a activation gradients, G_w = G_wd + G_wc weight gradients of matrix products and
    convolutions, G_e elementwise), O outputs per sample, O' kernel entries per pair, P
    parameters (P_fb of them in fallback leaves) and n = N1 (+ N2 unless symmetric):

    * ``"jacobian"``: n·(F + O·(G_a + G_w + G_e)) + 2·pairs·O'·P FLOPs;
    * ``"ntvp"``: N2·(F + O·(G_a + G_w + G_e)) + pairs·O·(G_a + G_w + G_e) (each pair's
      JVP: its tangent costs about one reverse pass; XLA hoists the primal; with
      ``whole_batch``, the reverse passes' convolution kernel gradients run in the
      column loop at ``conv_weight_grad_loop_slowdown``);
    * ``"structured"``: n·(F + O·(G_a + G_e + G_w·P_fb/P)) + the per-sample work of each
      leaf's form + pairs·(2·O'·P_fb + Σ leaf pair costs).

    Seconds: FLOPs / ``flops_per_s``, with per-sample convolution kernel gradients
    ``conv_weight_grad_slowdown`` times slower, the explicit Jacobians' products of
    ``"structured"`` ``explicit_jacobian_slowdown`` times slower and
    ``_jacobian.EINSUM_PASS_FLOPS`` per kernel value and separate contraction einsum
    (narrow Jacobians are merged into one), plus the feature bytes written and read /
    ``bytes_per_s`` (:func:`rates_for`).

    Args:
      single_fn: ``f(params, x_i, aux)`` on one sample.
      x_one: one sample (ShapeDtypeStructs are fine).
      pairs: pairs of samples in the kernel (N1·N2, or N on the batch diagonal).
      out_sizes: output entries per sample, per output leaf.
      pair_sizes: kernel entries per pair of samples (or per sample on the batch
        diagonal), per output leaf.
      symmetric: x2 is x1 (features computed once).
      analysis: the structured analysis of ``single_fn`` (``_structured.Analysis``).
      triangle: ``k(n, feature_bytes)``, the blocks of the engine's triangular
        contraction of a symmetric Gram matrix (None: not symmetric): ``"jacobian"``
        and ``"structured"`` contract (k + 1) / 2k of the pairs; ``"ntvp"`` (no
        features) all of them.
      kernel_sizes: kernel values per pair of samples, per output leaf (None: taken
        as ``pair_sizes``, which counts a traced output axis's entries as it sums
        them: O' = O for ``trace_axes=(-1,)`` where the kernel holds 1 value per pair).
      jaxpr: ``single_fn``'s closed jaxpr on ``x_one``, when the caller has it (None:
        traced here).
      whole_batch: the :class:`WholeBatch` of ``vmap_axes=None`` (None: per sample).
        Each output cotangent's reverse pass then runs over the whole batch, N times
        the work of one sample's (N·O of them: N²·O per-sample reverse passes), and
        its memory is added to ``"jacobian"``'s (residuals and the cotangents in
        flight) and ``"ntvp"``'s (residuals and one cotangent).

    Returns:
      Estimates for ``"jacobian"``, ``"ntvp"`` and ``"structured"``.
    """
    closed = jaxpr if jaxpr is not None else jax.make_jaxpr(single_fn)(params, x_one, aux)
    param_leaves = jax.tree.leaves(params)
    n_p, n_x = len(param_leaves), len(jax.tree.leaves(x_one))
    depends = [(True, False)] * n_p + [(False, True)] * n_x
    depends += [(False, False)] * (len(closed.jaxpr.invars) - len(depends))
    pc = pass_cost(closed.jaxpr, depends)
    rates = rates_for()
    leaf_sizes = [math.prod(p.shape) for p in param_leaves]
    itemsize = max((jax.numpy.dtype(p.dtype).itemsize for p in param_leaves), default=4)
    out_total = sum(out_sizes)
    o_pair = sum(pair_sizes)
    # Memory beside the features: the kernel (twice for a Gram matrix: its
    # symmetrisation writes a second copy; its values per pair are ``kernel_sizes``,
    # not O', which counts a traced axis's products) and the per-sample passes in
    # flight (vmapped forward and reverse passes: about (O + 1)·V/2 live values per
    # sample; "structured" computes its features one chunk of samples at a time,
    # :func:`feature_chunk`). Calibrated on the benchmark cases
    # (benchmarks/plan_accuracy.py: within 2x of the execution's measured peak, the
    # first call's with its programs loaded from the compilation cache).
    values = values_written(closed.jaxpr)
    entries_pair = o_pair if kernel_sizes is None else sum(kernel_sizes)
    call = Call(
        n1=n1,
        n2=n2,
        all_pairs=pairs,
        symmetric=symmetric,
        triangle=triangle,
        whole_batch=whole_batch,
        analysis=analysis,
        pc=pc,
        forward=max(pc.forward, 1.0),
        rates=rates,
        leaf_sizes=leaf_sizes,
        n_params=sum(leaf_sizes),
        itemsize=itemsize,
        out_sizes=out_sizes,
        out_total=out_total,
        o_pair=o_pair,
        n_jac=n1 if symmetric else n1 + n2,
        grad_w=pc.grad_weights_dot + pc.grad_weights_conv,
        values=values,
        kernel_bytes=pairs * entries_pair * itemsize * (2 if symmetric else 1),
        passes_bytes=(out_total + 1) * values * itemsize // 2,
        fwd_x=rates.conv_channel_slowdown * pc.conv_forward_extra,
        act_x=rates.conv_channel_slowdown * pc.conv_activation_extra,
        # Separate contraction einsums: narrow Jacobians are merged into one
        # (_jacobian.merge).
        merge_limit=_jacobian.merge_limit(max(n1, n2), out_total, o_pair),
    )
    return tuple(impl.estimate(call) for impl in REGISTRY.values())


@dataclasses.dataclass(frozen=True)
class Call:
    """What every implementation's estimate reads (:func:`estimate`): the call's sizes,
    the single-sample :class:`PassCost` ``pc`` and the backend's :class:`Rates`."""

    n1: int
    n2: int
    all_pairs: int
    symmetric: bool
    triangle: object
    whole_batch: object
    analysis: object
    pc: PassCost
    forward: float  # F, at least 1
    rates: Rates
    leaf_sizes: list
    n_params: int
    itemsize: int
    out_sizes: list
    out_total: int  # O
    o_pair: int  # O'
    n_jac: int  # samples whose features are formed: N1 (+ N2 unless symmetric)
    grad_w: float
    values: int  # values written by one sample's forward pass
    kernel_bytes: float
    passes_bytes: int
    fwd_x: float
    act_x: float
    merge_limit: int

    @property
    def reverse(self) -> float:
        pc = self.pc
        return pc.grad_activations + self.grad_w + pc.grad_elementwise

    def contracted(self, feature_bytes) -> float:
        """Pairs the feature methods contract (the triangle, where it applies)."""
        k = 1 if self.triangle is None else self.triangle(self.n1, feature_bytes)
        return self.all_pairs * (k + 1) / (2 * k)

    def seconds(self, flops, slow_flops, nbytes, passes, passed_pairs, channel_flops=0.0):
        """Time: FLOPs at the matrix-product rate, plus the slow ones, the einsum
        passes and the bytes (see :func:`estimate`)."""
        rates = self.rates
        slow = rates.conv_weight_grad_slowdown - 1.0
        extra = (
            slow * slow_flops + passes * passed_pairs * self.o_pair * _jacobian.EINSUM_PASS_FLOPS
        )
        extra += channel_flops
        return (flops + extra) / rates.flops_per_s + nbytes / rates.bytes_per_s


def jacobian_estimate(c: Call) -> CostEstimate:
    """``"jacobian"``: n·(F + O·(G_a + G_w + G_e)) + 2·pairs·O'·P FLOPs."""
    # Samples each output cotangent's reverse pass traverses, summed over the samples
    # whose Jacobians are formed: one each per sample, the whole batch with vmap_axes=None.
    n1, n2, whole_batch = c.n1, c.n2, c.whole_batch
    reversed_jac = c.n_jac if whole_batch is None else n1 * n1 + (0 if c.symmetric else n2 * n2)
    batch_bytes_jac = 0 if whole_batch is None else whole_batch.peak_bytes
    jac_bytes = c.n_jac * c.out_total * c.n_params * c.itemsize
    jac_pairs = c.contracted(jac_bytes)
    jac_flops = (
        c.n_jac * c.forward
        + reversed_jac * c.out_total * c.reverse
        + 2.0 * jac_pairs * c.o_pair * c.n_params
    )
    return CostEstimate(
        "jacobian",
        jac_flops,
        float(
            1.5 * jac_bytes  # the Jacobians, and (wide leaves) the contraction's copy
            + c.kernel_bytes
            + (c.n_jac * c.passes_bytes if whole_batch is None else batch_bytes_jac)
        ),
        c.seconds(
            jac_flops,
            reversed_jac * c.out_total * c.pc.grad_weights_conv,
            2 * jac_bytes,
            _jacobian.einsum_count(c.leaf_sizes, c.merge_limit),
            jac_pairs,
            c.n_jac * c.fwd_x + reversed_jac * c.out_total * c.act_x,
        ),
    )


def ntvp_estimate(c: Call) -> CostEstimate:
    """``"ntvp"``: N2·(F + O·(G_a + G_w + G_e)) + pairs·O·(G_a + G_w + G_e)."""
    n1, n2, whole_batch, pc = c.n1, c.n2, c.whole_batch, c.pc
    out_total, all_pairs, itemsize = c.out_total, c.all_pairs, c.itemsize
    reversed_ntvp = n2 if whole_batch is None else n2 * n2
    # Each column's JVP over x1 (per sample, vmapped: the forward values of the x1
    # batch). Over the whole batch: the residuals of x2's forward pass, then per
    # column one cotangent's reverse pass and one JVP over x1, one after the other in
    # the loop's body; forward mode keeps a value only to its last use, about as many
    # live as the reverse pass's cotangents (WholeBatch: half the batch's values), so
    # the peak holds one of the two transients, not both.
    batch_bytes_ntvp = (
        n1 * c.values * itemsize
        if whole_batch is None
        else whole_batch.residual_bytes + whole_batch.cotangent_bytes
    )
    # Per pair and output: one JVP over x1's sample, whose primal XLA hoists out of the
    # loop over columns; its tangent costs about one reverse pass (each product with a
    # parameter-dependent operand once).
    # Per sample (vmap_axes=0), the reverse passes and the JVPs (vmapped over the O
    # tangents) take kernel gradients of convolutions as grouped convolutions. Over the
    # whole batch, the JVP's tangent convolves with one kernel (no grouping) and each
    # cotangent's reverse pass runs inside the column loop (lax.map), where XLA CPU
    # runs the kernel gradient conv_weight_grad_loop_slowdown times slower.
    if whole_batch is None:
        ntvp_grouped, ntvp_loop = reversed_ntvp + all_pairs, 0.0
    else:
        loop_slow = c.rates.conv_weight_grad_loop_slowdown - 1.0
        ntvp_grouped = 0
        ntvp_loop = loop_slow * reversed_ntvp * out_total * pc.grad_weights_conv
    reverse = c.reverse
    ntvp_flops = (
        n2 * c.forward + reversed_ntvp * out_total * reverse + all_pairs * out_total * reverse
    )
    return CostEstimate(
        "ntvp",
        ntvp_flops,
        float(
            out_total * c.n_params * itemsize
            + n1 * out_total * max(c.out_sizes) * itemsize
            + batch_bytes_ntvp
            + c.kernel_bytes
        ),
        c.seconds(
            ntvp_flops,
            ntvp_grouped * out_total * pc.grad_weights_conv,
            0.0,
            out_total,
            all_pairs,
            n2 * c.fwd_x + (reversed_ntvp * c.act_x + all_pairs * c.fwd_x) * out_total + ntvp_loop,
        ),
    )


def choose(estimates, blocked: bool = False) -> str:
    """The fastest estimate in seconds whose memory fits the budget (else ``"ntvp"``).

    ``blocked``: the call runs in the blocked engine (``batch_size``), which keeps the
    device memory of every implementation within ``memory_budget`` by its tile size
    (the kernel goes to the host or a file), so the fastest is chosen whatever the
    one-call memory estimate says: at N = 30 000 that estimate (the 3.6 GB kernel and
    its symmetrised copy) fits no implementation, and falling back to NTK-vector
    products, N²·O forward passes, would take days.
    """
    if blocked:
        return min(estimates, key=lambda e: e.seconds).implementation
    fitting = [e for e in estimates if e.memory_bytes <= JACOBIAN_MEMORY_BUDGET]
    if not fitting:
        return next(name for name, impl in REGISTRY.items() if impl.features is None)
    return min(fitting, key=lambda e: e.seconds).implementation
