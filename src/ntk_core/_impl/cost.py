"""Analytic cost model behind ``implementation="auto"``: FLOPs counted from the shapes of
one single-sample jaxpr (``vmap_axes=None``: the whole batch's, per sample; never XLA's
cost analysis, wrong or -1 on CPU and GPU), split by
what the reverse pass differentiates (:class:`PassCost`), and seconds at the backend's
:data:`RATES`. ``"auto"`` takes the fastest estimate that fits in one call
(:data:`JACOBIAN_MEMORY_BUDGET`; on a GPU or TPU half its memory where that is more),
else the implementation without features; with ``batch_size`` set, the fastest in the
blocked engine's tiles (:func:`tiled`). Formulas: :func:`estimate`."""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.extend.core import primitives as prims

from ntk_core._impl import jacobian as _jacobian
from ntk_core._impl.registry import AUTO, REGISTRY
from ntk_core._jax.jaxpr_walk import entries, is_literal, sub_jaxprs, sub_operands, values_written
from ntk_core._units import human_bytes

#: Bytes of an estimate's peak memory above which ``"auto"`` avoids it in one call on a CPU
#: (and on a GPU or TPU holding less than twice this; planner.one_call_limit).
JACOBIAN_MEMORY_BUDGET = 4 * 2**30


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one parameter leaf enters the kernel."""

    path: str  # e.g. "['Dense_0']['kernel']"
    size: int
    method: str  # "structured (1 matrix product)", "jacobian (fallback: <reason>)", "ntvp", ...
    structured: str = ""  # when another one runs: the structured method ("" unknown)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What an NTK call does: the implementation used, every estimate, each leaf."""

    implementation: str
    estimates: tuple  # CostEstimate for each implementation considered
    leaves: tuple[LeafPlan, ...]
    requested: str = ""  # the implementation option ("auto" when it chose)
    tiling: object = None  # with batch_size: the blocked engine's _blocked.Tiling
    whole_batch: object = None  # with vmap_axes=None and cotangent chunks: WholeBatch
    blocked: bool = False  # batch_size given: "auto" compared the tiled estimates
    # batch_size=None: the tiled estimate "auto" took (the kernel in tiles kept on the
    # device, a jax.Array as one call returns), else None
    in_tiles: CostEstimate | None = None
    weighed: tuple = ()  # "auto": the candidates it weighed (_cost.candidates)
    one_call_limit: int | None = None  # peak bytes "auto" runs in one call (None: the CPU's)

    def __str__(self) -> str:
        how = f" (chosen by implementation={AUTO!r})" if self.requested == AUTO else ""
        if self.in_tiles is not None:
            t = self.in_tiles
            how = (
                f" in tiles of {t.batch} samples kept on the device (chosen by "
                f"implementation={AUTO!r}: ~{t.seconds:.3g} s, the cheapest it weighed)"
            )
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
            mib, s = e.memory_bytes / 2**20, e.seconds
            limit = self.one_call_limit or JACOBIAN_MEMORY_BUDGET
            over = e.memory_bytes > limit and not self.blocked
            lines.append(
                f"  {e.implementation:<10} {e.flops:12.3e} FLOPs  {mib:10.1f} MiB  ~{s:.3g} s"
                + (f"  (over {human_bytes(limit)} in one call)" * over)
            )
            if e.tiled is not None:
                t = e.tiled
                lines.append(
                    f"    in tiles of {t.batch} samples {t.flops:12.3e} FLOPs  "
                    f"{t.memory_bytes / 2**20:10.1f} MiB  ~{t.seconds:.3g} s"
                )
        if self.weighed:
            said = [
                f"{e.implementation} {f'in tiles of {e.batch}' if e.batch else 'in one call'} "
                f"~{e.seconds:.3g} s"
                for e in sorted(self.weighed, key=lambda e: e.seconds)
            ]
            lines.append(f"  auto weighed (the cheapest taken): {', '.join(said)}")
        advice = None
        if not self.blocked and self.in_tiles is None:
            advice = tiles_advice(self.estimates, self.implementation)
        if advice is not None:
            lines.append(f"  {advice_text(self.estimates, self.implementation, advice)}")
        alternative = any(leaf.structured for leaf in self.leaves)
        head = f"  {'parameter leaf':<40} {'size':>10}  method"
        lines.append(head + ("     (implementation='structured' would use)" if alternative else ""))
        for leaf in self.leaves:
            line = f"  {leaf.path:<40} {leaf.size:>10}  {leaf.method}"
            lines.append(line + (f"  ({leaf.structured})" if leaf.structured else ""))
        lines += [f"  {part}" for part in (self.tiling, self.whole_batch) if part is not None]
        return "\n".join(lines)


def _eqn_flops(eqn) -> float:
    """FLOPs of one matrix product or convolution (0 for anything else)."""
    out_size = sum(entries(v) for v in eqn.outvars)
    if eqn.primitive is prims.dot_general_p:
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        return 2.0 * out_size * math.prod(lhs_shape[d] for d in lhs_contract)
    if eqn.primitive is prims.conv_general_dilated_p:
        rhs_shape = eqn.invars[1].aval.shape
        rhs_spec = eqn.params["dimension_numbers"].rhs_spec
        return 2.0 * out_size * math.prod(rhs_shape[d] for d in rhs_spec[1:])
    return 0.0


def conv_channel_weight(eqn) -> float:
    """1 / (C_out^1.5 · C_in^0.6) for a convolution, else 0: its slowdown per FLOP is 1 +
    ``Rates.conv_channel_slowdown`` times this (XLA CPU, 2 cores: within 1.7x of the
    measured 39x for 1 -> 6 channels 5x5 down to 1.1x for 64 -> 64 3x3)."""
    if eqn.primitive is not prims.conv_general_dilated_p:
        return 0.0
    rhs_shape = eqn.invars[1].aval.shape
    out_dim, in_dim = eqn.params["dimension_numbers"].rhs_spec[:2]
    c_out = rhs_shape[out_dim]
    c_in = rhs_shape[in_dim] * eqn.params.get("feature_group_count", 1)
    return 1.0 / (max(c_out, 1) ** 1.5 * max(c_in, 1) ** 0.6)


#: FLOPs per kernel value (one sample, one cotangent: 2·H'·W' of a convolution) from which
#: a per-sample convolution kernel gradient's FLOP time covers writing its values.
CONV_VALUE_COVER_FLOPS = 128.0


def conv_value_shortfall(flops_per_value: float) -> float:
    """1 - F / :data:`CONV_VALUE_COVER_FLOPS`, at least 0: the share of a per-sample conv
    kernel value's write not hidden behind its gradient's FLOPs (F of them per value)."""
    return max(0.0, 1.0 - flops_per_value / CONV_VALUE_COVER_FLOPS)


@dataclasses.dataclass
class PassCost:
    """FLOPs of one single-sample forward pass and of one reverse pass (one cotangent):
    a product's operand on the parameters costs its forward FLOPs as an activation
    gradient (on the input too) or a weight gradient (on the parameters alone); any
    other operation 1 FLOP per output value forward, 2 in reverse on the parameters."""

    forward: float = 0.0
    grad_activations: float = 0.0
    grad_weights_dot: float = 0.0
    grad_weights_conv: float = 0.0
    # Kernel gradient FLOPs times the convolution's output values (its cotangent's size).
    grad_weights_conv_values: float = 0.0
    # Kernel values of the convolutions on the parameters alone, each weighted by how far
    # its gradient's FLOPs fall short of covering its write (conv_value_shortfall).
    conv_kernel_values_uncovered: float = 0.0
    grad_elementwise: float = 0.0
    # Convolution FLOPs times conv_channel_weight: forward, activation gradient.
    conv_forward_extra: float = 0.0
    conv_activation_extra: float = 0.0


def pass_cost(jaxpr, depends: list[tuple[bool, bool]]) -> PassCost:
    """:class:`PassCost` of ``jaxpr`` with inputs on (parameters, input) per ``depends``;
    of sub-jaxprs the costliest counts, ``length`` times for a scan."""
    cost = PassCost()
    flags: dict = dict(zip(jaxpr.invars, depends, strict=True))

    def get(v):
        return (False, False) if is_literal(v) else flags.get(v, (False, False))

    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        on_p = any(f[0] for f in ins)
        on_x = any(f[1] for f in ins)
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
                elif dep_p and eqn.primitive is prims.conv_general_dilated_p:
                    cost.grad_weights_conv += product
                    cost.grad_weights_conv_values += product * entries(eqn.outvars[0])
                    kernel = entries(eqn.invars[1])
                    cost.conv_kernel_values_uncovered += kernel * conv_value_shortfall(
                        product / max(kernel, 1)
                    )
                elif dep_p:
                    cost.grad_weights_dot += product
        elif subs:
            repeat = eqn.params.get("length", 1) if eqn.primitive is prims.scan_p else 1
            worst = None
            for sub in subs:
                operands = sub_operands(eqn, sub)
                if operands is None:
                    inner = pass_cost(sub, [(on_p, on_x)] * len(sub.invars))
                else:
                    inner = pass_cost(sub, [get(v) for v in operands])
                if worst is None or inner.forward > worst.forward:
                    worst = inner
            for f in dataclasses.fields(cost):  # the costliest, ``repeat`` times
                setattr(cost, f.name, getattr(cost, f.name) + repeat * getattr(worst, f.name))
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
    """Memory of differentiating the whole batch (``vmap_axes=None``): the residuals, and
    per output cotangent about V_batch / 2 + P values; ``chunk`` pulled back at a time."""

    residual_bytes: int
    cotangent_bytes: int
    chunk: int
    cotangents: int

    @property
    def peak_bytes(self) -> int:
        return self.residual_bytes + self.chunk * self.cotangent_bytes

    def __str__(self) -> str:
        pieces = -(-self.cotangents // self.chunk)
        res, per = human_bytes(self.residual_bytes), human_bytes(self.cotangent_bytes)
        return (
            f"whole batch (vmap_axes=None): {self.cotangents} output cotangents pulled back "
            f"{self.chunk} at a time ({pieces} chunks; residuals {res}, {per} per cotangent)"
        )


def whole_batch(
    jaxpr, n_params: int, cotangents: int, itemsize: int, budget: int, jac_bytes: int, scale=1.0
):
    """The :class:`WholeBatch` of a batch's jaxpr (values times ``scale``): ``chunk`` the
    cotangents that fit ``budget`` beside the residuals and ``jac_bytes``, in [1, N·O]."""
    values = int(values_written(jaxpr) * scale)
    residual = values * itemsize
    # Half the forward values per cotangent: only the live ones (Conv-64 net: measured).
    per_cotangent = (values // 2 + n_params) * itemsize
    room = budget - residual - jac_bytes
    chunk = int(min(cotangents, max(1, room // max(per_cotangent, 1))))
    return WholeBatch(residual, per_cotangent, chunk, cotangents)


@dataclasses.dataclass(frozen=True)
class Rates:
    """What the time estimates assume of a backend; slowdowns are against ``flops_per_s``."""

    flops_per_s: float  # dense matrix-product rate
    bytes_per_s: float  # memory bandwidth
    conv_weight_grad_slowdown: float  # other conv kernel gradients (below)
    conv_channel_slowdown: float = 0.0  # few channels (conv_channel_weight)
    # Per-sample kernel gradients vmapped over a batch (Call.vmap_conv_slowdown): this
    # slowdown, plus 1 per conv_vmap_grad_bytes of the batch's convolution cotangents,
    # at most conv_vmap_grad_max_slowdown.
    conv_vmap_grad_slowdown: float = 1.0
    conv_vmap_grad_bytes: float = math.inf
    conv_vmap_grad_max_slowdown: float = math.inf
    conv_weight_grad_loop_slowdown: float = 1.0  # whole-batch kernel gradients in a loop
    explicit_jacobian_slowdown: float = 1.0  # explicit Jacobians of "structured"
    # FLOP-equivalents per value of "jacobian"'s per-sample Jacobians beyond their bytes
    # at bytes_per_s: the weight gradients' batched outer products into fresh buffers.
    jacobian_value_flops: float = 0.0
    # More per value of a per-sample convolution kernel's Jacobian, times its
    # conv_value_shortfall (few output positions: the write is not hidden by the FLOPs).
    conv_jacobian_value_flops: float = 0.0
    # In one call, "structured" forms a per-sample Jacobian in the contraction where its
    # inputs and cotangents are smaller (_structured.analysis.LATE).
    late_jacobians: bool = True


#: CPU: measured on the 2-core CI CPU (jax 0.10.2): matrix products 115-125 GFLOP/s;
#: bandwidth assumed; conv kernel gradients of NTK-vector products, of "structured"'s
#: fallbacks and of whole-batch Jacobians 40x slower (the issue-17 conv net ran them at
#: 1/41); in a loop 1/115 (100); explicit Jacobians 2.4x slower (ResNet-style CNN).
#: "jacobian"'s per-sample kernel gradients
#: vmapped over N samples and O = 10 cotangents (2026-12-05, one process, at 1.2e11 FLOP/s;
#: cotangent bytes ws = N·O·H'·W'·C_out·4; N = 8 / 32 / 128): 1 -> 64 28x28 3x3 9.0 / 24.6
#: / 28.9 (ws 16 / 64 / 257 MB); 3 -> 16 16x16 3x3 7.9 / 11.0 / 26.9 (1.3 / 5.2 / 21 MB);
#: 16 -> 32 8x8 3x3 7.9 / 7.0 / 12.4; 3 -> 6 32x32 5x5 8.7 / 9.0 / 27.5; 6 -> 16 16x16 5x5
#: 6.5 / 7.4 / 14.8; 16 -> 16 16x16 3x3 6.2 / 7.3 / 18.4; 64 -> 64 8x8 3x3 7.8 / 11.2 /
#: 21.7; 16 -> 16 16x16 1x1 8.9 / 11.8 / 33.3: the cotangents' size matters most (in
#: cache ~7x, out of it ~28x; at 21 MB the shapes spread 14.8-33.3); min(28, 7 + ws / 2 MB)
#: is within 0.53-1.67x of all 24. Per-sample Jacobian values (vmap of jacrev: each
#: weight gradient an outer product written to a new buffer) cost 4.6-5.3 ns each at
#: this matmul rate, not the 0.8 ns of their 8 bytes at 10 GB/s (2026-12-07, load 8,
#: timings scaled by the 2048² matmul's 59 / 120 GFLOP/s: MLP 784-1000-1 N = 300 and
#: 100, 3136-256-10 N = 12 and 48, 784-512-512-10 N = 24; 9.3-10.7 ns measured): 490
#: FLOP-equivalents each on top (benchmarks/README.md, plan accuracy). A per-sample
#: conv kernel's Jacobian values cost 8.5-9.6 ns each where the convolution has few
#: output positions (2026-12-07, load 3, scaled as above; vmap(jacrev) of N = 8, O = 10,
#: one 3x3 C -> C convolution on S x S: C = 128 S = 2 and 4, C = 64 S = 8; FLOPs cover the
#: write from 2·S² ≈ 128 on: 33 ns at S = 16, 225 ns at 32): 550 more FLOP-equivalents
#: each times conv_value_shortfall (hk.nets.ResNet18 on 32x32, most of its 11.2 M
#: parameters in 3x3 kernels on 2x2 and 1x1 positions: N = 4 + 2 3.6 -> 6.5 s, measured
#: 7.5 s; N = 8 + 4 7.2 -> 13.1 s, the issue's trial 15.3 s).
#:
#: TPU (one v5e chip, jax 0.10.2, float32 at HIGHEST; issue 51's warm times, derived in
#: benchmarks/README.md "auto_choice.py"): 2.0e13 FLOP/s, the MLP 784-1000-1 N = 10 000
#: structured kernel's 5.7e11 FLOP in 28.9 ms (64 % of the 30.7 TFLOP/s 8192² HIGHEST
#: matmul); 8.1e11 B/s, the chip's nominal HBM bandwidth (not measured), so a per-sample
#: Jacobian value costs its bytes alone (no jacobian_value_flops: none measured); few-
#: channel convolutions 4000 (LeNet N = 500, one output: 5.0 ms measured, 0.31 ms by
#: FLOPs alone; its forward pass alone took 29 ms with 10 logits); explicit Jacobians 8x
#: (ResNet-18 224², structured, 117 ms with 8 outputs; 36 ms by FLOPs at 10); per-sample
#: conv kernel gradients vmapped 16x (ResNet-18 224², 8 x 8, "jacobian" in one tile:
#: 465 ms measured 2026-12-07 (accelerator_bench.py), 64 ms estimated at 2x, so "auto"
#: took it over structured's 120 ms); the other conv kernel-gradient slowdowns (2x) are
#: the GPU's assumption, unmeasured. The ViT's "jacobian" in tiles of 3: 2.12 s measured,
#: 3.3 s estimated. With them plan()
#: is 1.0-1.7x below the measured ViT (ntvp), ResNet-18, LeNet and MLP; a 16 x 16 FCN's
#: 1.65 ms is 11x its estimate (per-program launch costs are not modelled).
#: GPU: uncalibrated, nominal data-centre figures (A100-class float32 tensor-core rate
#: and HBM bandwidth); only their ratios decide, and none was measured on a GPU.
#: Late Jacobians: on the TPU the ViT's structured features took 4 GB, not 16 GB, and ran
#: in one call (0.27 s traced, against 2.1 s in tiles untraced), ResNet-18 224² 99 ms
#: against 114 ms; on the CPU a ViT at N = 16 took 4.0 s against 6.4 s but the CNN of
#: auto_choice.py (N = 32) 0.300 s against 0.265 s (2026-12-07), so a CPU keeps them in
#: the features; GPUs take them for the memory (unmeasured).
RATES = {
    "cpu": Rates(
        flops_per_s=1.2e11,
        bytes_per_s=1.0e10,
        conv_weight_grad_slowdown=40.0,
        conv_channel_slowdown=550.0,
        conv_vmap_grad_slowdown=7.0,
        conv_vmap_grad_bytes=2e6,
        conv_vmap_grad_max_slowdown=28.0,
        conv_weight_grad_loop_slowdown=100.0,
        explicit_jacobian_slowdown=2.4,
        jacobian_value_flops=490.0,
        conv_jacobian_value_flops=550.0,
        late_jacobians=False,
    ),
    "tpu": Rates(
        flops_per_s=2.0e13,
        bytes_per_s=8.1e11,
        conv_weight_grad_slowdown=2.0,
        conv_channel_slowdown=4000.0,
        conv_vmap_grad_slowdown=16.0,
        conv_weight_grad_loop_slowdown=2.0,
        explicit_jacobian_slowdown=8.0,
    ),
    "gpu": Rates(
        flops_per_s=5.0e13,
        bytes_per_s=3.0e12,
        conv_weight_grad_slowdown=2.0,
        conv_vmap_grad_slowdown=2.0,
        conv_weight_grad_loop_slowdown=2.0,
    ),
}


def rates_for(backend: str | None = None) -> Rates:
    """The :data:`RATES` of ``backend`` (default JAX's): "cpu", "tpu", else (CUDA, ROCm,
    any other) "gpu"."""
    platform = backend or jax.default_backend()
    return RATES[platform if platform in ("cpu", "tpu") else "gpu"]


@dataclasses.dataclass(frozen=True)
class CostEstimate:
    """Estimated FLOPs, peak memory (bytes) and seconds (what ``"auto"`` minimises);
    ``tiled``: the same implementation in the blocked engine's tiles (an estimate whose
    ``batch`` is its block size), where it has features and a tile budget was given."""

    implementation: str
    flops: float
    memory_bytes: float
    seconds: float = 0.0
    tiled: CostEstimate | None = None
    batch: int = 0  # tiles of this many samples (0: one call)


def estimate(
    closed,
    params,
    x_one,
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
    kernel_sizes=None,
    batch=1,
    tiles=None,
):
    """Each implementation's :class:`CostEstimate` for one call (its ``Impl.estimate``) of
    the model whose jaxpr on one sample ``x_one`` is ``closed``; with ``whole_batch``
    (``vmap_axes=None``) only those that need no per-sample independence, and ``closed``
    may be the jaxpr of a whole batch of ``batch`` samples (``x_one`` then that batch):
    its FLOPs and values count per sample as its totals / ``batch``.

    With F forward FLOPs, per cotangent G_a activation, G_w weight and G_e elementwise
    gradient FLOPs (:class:`PassCost`), O outputs per sample, O' kernel entries per pair
    (``pair_sizes``), P parameters and n = N1 (+ N2 unless ``symmetric``): ``"jacobian"``
    n·(F + O·G) + 2·pairs·O'·P; ``"ntvp"`` N2·(F + O·G) + pairs·O·G; ``"structured"``
    n·(F + O·(G_a + G_e + G_w·P_fb/P)) + per-leaf forms. Seconds: FLOPs at
    :class:`Rates`, slow kinds slowed, ``_jacobian.EINSUM_PASS_FLOPS`` per kernel value
    and einsum, feature bytes at ``bytes_per_s``. ``triangle(n, bytes)``: the blocks of
    a Gram matrix's triangular contraction; ``kernel_sizes``: kernel values per pair
    (default ``pair_sizes``); ``whole_batch``: the :class:`WholeBatch` of ``vmap_axes=None``;
    ``tiles``: ``(budget, block(F, W), batch_diagonal)``, the blocked engine's memory budget,
    its block size for F feature bytes per sample and W bytes per pair, and whether the
    kernel is the per-sample batch diagonal: each estimate with features
    then carries its ``tiled`` alternative (:func:`tiled`).
    """
    param_leaves = jax.tree.leaves(params)
    n_p, n_x = len(param_leaves), len(jax.tree.leaves(x_one))
    depends = [(True, False)] * n_p + [(False, True)] * n_x
    depends += [(False, False)] * (len(closed.jaxpr.invars) - len(depends))
    pc = per_sample(pass_cost(closed.jaxpr, depends), batch)
    rates = rates_for()
    leaf_sizes = [math.prod(p.shape) for p in param_leaves]
    itemsize = max((jax.numpy.dtype(p.dtype).itemsize for p in param_leaves), default=4)
    out_total = sum(out_sizes)
    o_pair = sum(pair_sizes)
    # Memory beside the features: the kernel (twice for a Gram matrix) and the passes
    # in flight, (O + 1)·V/2 values per sample (within 2x, benchmarks/plan_accuracy.py).
    values = values_written(closed.jaxpr) // batch
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
        merge_limit=_jacobian.merge_limit(max(n1, n2), out_total, o_pair),
    )
    found = []
    for impl in REGISTRY.values():
        if whole_batch is not None and impl.needs_independence:
            continue
        in_tiles = None
        if tiles is not None and whole_batch is None and impl.features is not None:
            in_tiles = tiled(impl, call, *tiles)
        found.append(CostEstimate(impl.name, *impl.estimate(call), tiled=in_tiles))
    return tuple(found)


def tiled(impl, call: Call, budget: int, block, batch_diagonal: bool) -> CostEstimate:
    """``impl``'s estimate in the blocked engine's tiles (``_blocked.tiles.compute``): blocks
    of B = ``block(F, W)`` samples, F one sample's features and passes (its estimate for
    one sample and no pairs), W the kernel's bytes per pair three times (the tile, its
    mirror, a temporary). Features are computed once per block while the column blocks'
    fit the budget beside a tile, else the row blocks' once per band of columns; with
    x2=None only the k·(k + 1)/2 tiles j >= i are contracted; memory: 2·F·B + W·B²."""
    one = dataclasses.replace(call, n1=1, n2=1, all_pairs=0, n_jac=1, kernel_bytes=0, late=False)
    feature = impl.estimate(one)[1]
    pairs = max(call.all_pairs, 1)
    per_pair = 3.0 * call.kernel_bytes / pairs / (2 if call.symmetric else 1)
    b = max(1, int(block(feature, per_pair)))
    n1, n2, symmetric = call.n1, call.n2, call.symmetric
    k1 = -(-n1 // b)
    k2 = k1 if symmetric else -(-n2 // b)
    # Column blocks whose features stay beside a tile (the engine's band width).
    room = budget - 2.0 * per_pair * b * b
    capacity = int(room // (feature * b)) if feature > 0 else k2 + 1
    width = k2 if capacity >= k2 + (0 if symmetric else 1) else max(1, capacity - 1)
    bands = -(-k2 // width)
    if batch_diagonal:  # tile i pairs block i of x1 with block i of x2
        computed = call.n_jac
    elif symmetric:  # the row blocks of later bands recomputed
        computed = n1 + (bands - 1) * n1 // 2
    else:
        computed = n2 + bands * n1
    blocks = k1 if symmetric else 1  # x2=None: the tiles j >= i

    def triangle(n, nbytes):
        return blocks

    in_tiles = dataclasses.replace(
        call,
        n1=min(b, n1),
        n2=min(b, n2),
        n_jac=computed,
        triangle=triangle if symmetric else None,
        kernel_bytes=0,
        late=False,
    )
    flops, _, seconds = impl.estimate(in_tiles)
    # At most the one call's (one tile holding every sample is that call).
    memory = min(2.0 * feature * b + per_pair * b * b, impl.estimate(call)[1])
    return CostEstimate(impl.name, flops, memory, seconds, batch=b)


def advice_text(estimates, chosen: str, advice: CostEstimate) -> str:
    """What :func:`tiles_advice` found, as plan() and the warning of ``"auto"`` say it."""
    seconds = next(e.seconds for e in estimates if e.implementation == chosen)
    return (
        f"in tiles (batch_size='auto'), {advice.implementation!r} is estimated at "
        f"~{advice.seconds:.3g} s ({seconds / advice.seconds:.3g}x faster than "
        f"{chosen!r} in one call, ~{seconds:.3g} s)"
    )


#: ``"auto"`` in one call tells of a tiled alternative estimated this many times faster.
TILES_ADVICE_RATIO = 2.0


def tiles_advice(estimates, chosen: str) -> CostEstimate | None:
    """The fastest tiled alternative (:attr:`CostEstimate.tiled`) estimated at least
    :data:`TILES_ADVICE_RATIO` times faster than ``chosen`` in one call, else None."""
    seconds = next(e.seconds for e in estimates if e.implementation == chosen)
    alternatives = [e.tiled for e in estimates if e.tiled is not None]
    best = min(alternatives, key=lambda e: e.seconds, default=None)
    if best is None or best.seconds * TILES_ADVICE_RATIO > seconds:
        return None
    return best


def per_sample(cost: PassCost, batch: int) -> PassCost:
    """A whole batch's :class:`PassCost` per sample: each term / ``batch``, and the
    convolutions' FLOPs times output values (a product of two batch-sized counts) /
    ``batch``²."""
    if batch == 1:
        return cost
    scaled = {f.name: getattr(cost, f.name) / batch for f in dataclasses.fields(cost)}
    scaled["grad_weights_conv_values"] = cost.grad_weights_conv_values / batch**2
    return PassCost(**scaled)


@dataclasses.dataclass(frozen=True)
class Call:
    """What every implementation's estimate reads: sizes, :class:`PassCost`, :class:`Rates`."""

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
    late: bool = True  # one call: Jacobians formed late where rates allow (False: tiles)

    @property
    def reverse(self) -> float:
        pc = self.pc
        return pc.grad_activations + self.grad_w + pc.grad_elementwise

    def contracted(self, feature_bytes) -> float:
        k = 1 if self.triangle is None else self.triangle(self.n1, feature_bytes)
        return self.all_pairs * (k + 1) / (2 * k)

    def seconds(
        self, flops, slow_flops, nbytes, passes, passed_pairs, channel_flops=0.0, vmap_batch=0
    ):
        """Seconds of ``flops``; ``slow_flops`` (conv kernel gradients) at the grouped
        slowdown, or with ``vmap_batch`` samples vmapped at :meth:`vmap_conv_slowdown`."""
        rates = self.rates
        slowdown = rates.conv_weight_grad_slowdown
        if vmap_batch:
            slowdown = self.vmap_conv_slowdown(vmap_batch)
        extra = (slowdown - 1.0) * slow_flops
        extra += passes * passed_pairs * self.o_pair * _jacobian.EINSUM_PASS_FLOPS
        extra += channel_flops
        return (flops + extra) / rates.flops_per_s + nbytes / rates.bytes_per_s

    def vmap_conv_slowdown(self, batch: int) -> float:
        """Per-FLOP slowdown of per-sample conv kernel gradients vmapped over ``batch``
        samples and O cotangents: ``conv_vmap_grad_slowdown`` plus the cotangents' bytes
        (batch·O·outputs, FLOP-weighted over the convolutions) per ``conv_vmap_grad_bytes``,
        at most ``conv_vmap_grad_max_slowdown`` (the cotangents out of cache)."""
        pc, rates = self.pc, self.rates
        outputs = pc.grad_weights_conv_values / max(pc.grad_weights_conv, 1.0)
        cotangent_bytes = batch * self.out_total * outputs * self.itemsize
        slowdown = rates.conv_vmap_grad_slowdown + cotangent_bytes / rates.conv_vmap_grad_bytes
        return min(slowdown, rates.conv_vmap_grad_max_slowdown)


def jacobian_estimate(c: Call) -> tuple[float, float, float]:
    """``"jacobian"``: n·(F + O·(G_a + G_w + G_e)) + 2·pairs·O'·P FLOPs."""
    # Samples each cotangent's reverse pass traverses (the batch with vmap_axes=None).
    n1, n2, whole_batch = c.n1, c.n2, c.whole_batch
    reversed_jac = c.n_jac if whole_batch is None else n1 * n1 + (0 if c.symmetric else n2 * n2)
    jac_bytes = c.n_jac * c.out_total * c.n_params * c.itemsize
    jac_pairs = c.contracted(jac_bytes)
    jac_flops = (
        c.n_jac * c.forward
        + reversed_jac * c.out_total * c.reverse
        + 2.0 * jac_pairs * c.o_pair * c.n_params
    )
    passes = c.n_jac * c.passes_bytes if whole_batch is None else whole_batch.peak_bytes
    # The Jacobians, and (wide leaves) the contraction's copy.
    memory = float(1.5 * jac_bytes + c.kernel_bytes + passes)
    slow = reversed_jac * c.out_total * c.pc.grad_weights_conv
    einsums = _jacobian.einsum_count(c.leaf_sizes, c.merge_limit)
    channel = c.n_jac * c.fwd_x + reversed_jac * c.out_total * c.act_x
    channel += c.rates.jacobian_value_flops * jac_bytes / c.itemsize  # the values written
    if whole_batch is None:  # per-sample conv kernels of few positions: their writes
        uncovered = c.n_jac * c.out_total * c.pc.conv_kernel_values_uncovered
        channel += c.rates.conv_jacobian_value_flops * uncovered
    # Per sample: x1's and x2's Jacobians, each batch vmapped in one program.
    batch = 0 if whole_batch is not None else (n1 if c.symmetric else max(n1, n2))
    seconds = c.seconds(jac_flops, slow, 2 * jac_bytes, einsums, jac_pairs, channel, batch)
    return jac_flops, memory, seconds


def ntvp_estimate(c: Call) -> tuple[float, float, float]:
    """``"ntvp"``: N2·(F + O·(G_a + G_w + G_e)) + pairs·O·(G_a + G_w + G_e)."""
    n1, n2, whole_batch, pc = c.n1, c.n2, c.whole_batch, c.pc
    out_total, all_pairs, itemsize = c.out_total, c.all_pairs, c.itemsize
    # Per column a JVP over x1; over the whole batch, the residuals plus one transient.
    # A JVP's tangent costs about one reverse pass. Conv kernel gradients are grouped
    # per sample; over the whole batch they run in the column loop (loop slowdown).
    if whole_batch is None:
        reversed_ntvp = n2
        # The JVP over x1 of O tangents at once holds (O + 1)·V/6 values per sample
        # (no residuals: about a sixth of what the pass writes is live); plan / measured
        # peak 0.68-0.69 on the equinox CNNs (O = 10), 1.0 on MLP 784-1000-1 (O = 1).
        batch_bytes_ntvp = n1 * c.passes_bytes / 3
        ntvp_grouped, ntvp_loop = reversed_ntvp + all_pairs, 0.0
    else:
        reversed_ntvp = n2 * n2
        batch_bytes_ntvp = whole_batch.residual_bytes + whole_batch.cotangent_bytes
        loop_slow = c.rates.conv_weight_grad_loop_slowdown - 1.0
        ntvp_grouped = 0
        ntvp_loop = loop_slow * reversed_ntvp * out_total * pc.grad_weights_conv
    reverse = c.reverse
    ntvp_flops = (
        n2 * c.forward + reversed_ntvp * out_total * reverse + all_pairs * out_total * reverse
    )
    outs_bytes = n1 * out_total * max(c.out_sizes) * itemsize
    memory = float(
        out_total * c.n_params * itemsize + outs_bytes + batch_bytes_ntvp + c.kernel_bytes
    )
    slow = ntvp_grouped * out_total * pc.grad_weights_conv
    channel = n2 * c.fwd_x + (reversed_ntvp * c.act_x + all_pairs * c.fwd_x) * out_total + ntvp_loop
    seconds = c.seconds(ntvp_flops, slow, 0.0, out_total, all_pairs, channel)
    return ntvp_flops, memory, seconds


def candidates(
    estimates, blocked: bool = False, tiles: bool = False, limit: int | None = None
) -> list[CostEstimate]:
    """What ``"auto"`` weighs. ``blocked`` (``batch_size`` given: tiles bound the memory):
    each implementation in tiles (its ``tiled`` estimate where it has one). Else each one
    in one call whose peak fits ``limit`` bytes (None: :data:`JACOBIAN_MEMORY_BUDGET`);
    with ``tiles`` (the call may go to tiles kept on the device: outside a trace, per
    sample) also the tiled form of each one whose one call does not fit, and of one that
    fits where that form is estimated :data:`TILES_ADVICE_RATIO` times faster than every
    one-call candidate (smaller gains stay in one call: the tiles' host loop is not in
    the estimates)."""
    if blocked:
        return [e.tiled or e for e in estimates]
    limit = JACOBIAN_MEMORY_BUDGET if limit is None else limit
    one_call = [e for e in estimates if e.memory_bytes <= limit]
    if not tiles:
        return one_call
    fits = {e.implementation for e in one_call}
    best = min((e.seconds for e in one_call), default=math.inf)
    tiled = [
        e.tiled
        for e in estimates
        if e.tiled is not None
        and (e.implementation not in fits or e.tiled.seconds * TILES_ADVICE_RATIO <= best)
    ]
    return one_call + tiled


def choice(
    estimates, blocked: bool = False, tiles: bool = False, limit: int | None = None
) -> CostEstimate | None:
    """The cheapest of :func:`candidates` (a tiled one has ``batch > 0``; one call wins a
    tie), or None where none is (nothing fits in one call and tiles are not allowed)."""
    found = candidates(estimates, blocked, tiles, limit)
    return min(found, key=lambda e: (e.seconds, e.batch > 0), default=None)


def featureless() -> str:
    """The implementation without features: what ``"auto"`` takes where nothing fits."""
    return next(name for name, impl in REGISTRY.items() if impl.features is None)


def choose(estimates, blocked: bool = False, tiles: bool = False) -> str:
    """The implementation of :func:`choice` (else :func:`featureless`)."""
    found = choice(estimates, blocked, tiles)
    return featureless() if found is None else found.implementation
