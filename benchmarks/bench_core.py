"""Times ntk_core's implementations and a naive vmap(jacrev) + einsum baseline.

For each case of ``cases.py`` and each of ``structured``, ``jacobian``, ``ntvp``,
``auto`` and ``naive`` (the usual hand-written recipe), one worker process measures
trace+lower, compile and warm run separately (``.lower()``, ``.compile()``, blocking
until ready) and its peak resident memory (see ``harness.py``). The Gram matrix of one
set of N inputs is computed (``x2=None``), float32. A measurement whose analytic
estimate (``ntk_core.plan``) passes ``--max-est-s`` or ``--max-est-gib`` is skipped and
reported with its estimate. Also measured in the same run: the float32 matmul rate,
and from it the FLOP floor of each case (``plan``'s FLOPs of ``"structured"`` divided
by that rate). Writes the case data for ``bench_neural_tangents.py`` (``--data-dir``)
and ``results_core.json``; ``report.py`` turns the results into tables. Never a test.

    PYTHONPATH=src python benchmarks/bench_core.py                    # every case
    PYTHONPATH=src python benchmarks/bench_core.py --cases mlp1 lenet --n 200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cases  # noqa: E402
import flax.linen as nn  # noqa: E402
import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ntk_core  # noqa: E402
import ntk_flax  # noqa: E402

IMPLEMENTATIONS = ("structured", "jacobian", "ntvp", "auto", "naive")
DEFAULT_DATA_DIR = "/tmp/ntk-jax-bench"
#: neural-tangents' Jacobian contraction held 9.9 GB for 3.1 GB of per-sample Jacobians
#: (N·O·P float32) in the issue's reference (MLP 784-1000-1, N=1000): its memory is
#: estimated as 3 x N·O·P·4 bytes.
NT_JACOBIAN_MEMORY = 3.0


# -- the Flax side of the cases ------------------------------------------------------------


class ResBlock(nn.Module):
    features: int
    stride: int

    @nn.compact
    def __call__(self, x):
        s = (self.stride, self.stride)
        y = nn.Conv(self.features, (3, 3), strides=s, use_bias=False)(x)
        y = nn.relu(nn.BatchNorm(use_running_average=True)(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = nn.BatchNorm(use_running_average=True)(y)
        if self.stride != 1 or x.shape[-1] != self.features:
            x = nn.Conv(self.features, (1, 1), strides=s, use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=True)(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """ResNet-style CNN with BatchNorm in eval mode and 10 logits (twin: ``cases.resnet``)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(16, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=True)(x))
        for features, stride in cases.RESNET_BLOCKS:
            x = ResBlock(features, stride)(x)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class ResNet18(nn.Module):
    """ResNet-18 in ``hk.nets.ResNet18``'s layout, 10 logits (twin: ``cases.resnet18``)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(64, (7, 7), strides=(2, 2), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=True)(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for features, stride in cases.RESNET18_BLOCKS:
            x = ResBlock(features, stride)(x)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class TokenModel(nn.Module):
    """The test zoo's ``TokenModel`` (``tests/zoo.py``), restated here because importing
    the zoo initialises all its models; :func:`prepare` checks both give the same logits."""

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(cases.TOKEN_VOCAB, 8)(tokens)
        h = h + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(h, h)
        h = nn.LayerNorm()(h)
        return nn.Dense(3)(nn.gelu(h))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: attention and a GELU MLP, each residual."""

    @nn.compact
    def __call__(self, h):
        heads = cases.VIT_HEADS
        h = h + nn.MultiHeadDotProductAttention(num_heads=heads)(nn.LayerNorm()(h))
        z = nn.gelu(nn.Dense(cases.VIT_HIDDEN)(nn.LayerNorm()(h)))
        return h + nn.Dense(h.shape[-1])(z)


class ViT(nn.Module):
    """A small vision transformer, 10 logits (twin: ``cases.vit``)."""

    @nn.compact
    def __call__(self, x):
        patch, width = (cases.VIT_PATCH,) * 2, cases.VIT_WIDTH
        h = nn.Conv(width, patch, strides=patch, name="embed")(x)
        h = h.reshape(h.shape[0], -1, width)
        init = nn.initializers.normal(0.02)
        h = h + self.param("positions", init, h.shape[1:])
        for _ in range(cases.VIT_BLOCKS):
            h = Block()(h)
        return nn.Dense(10, name="head")(jnp.mean(nn.LayerNorm(name="norm")(h), axis=1))


class BertBlock(nn.Module):
    """A post-LayerNorm BERT block: attention over the non-padding tokens, exact-GELU MLP."""

    @nn.compact
    def __call__(self, h, mask):
        a = nn.MultiHeadDotProductAttention(num_heads=cases.BERT_HEADS)(h, mask=mask)
        h = nn.LayerNorm(epsilon=1e-6)(h + a)
        z = nn.gelu(nn.Dense(cases.BERT_HIDDEN)(h), approximate=False)
        return nn.LayerNorm(epsilon=1e-6)(h + nn.Dense(h.shape[-1])(z))


class Bert(nn.Module):
    """BERT-tiny's shape on integer tokens, 2 logits from the pooled [CLS] token (twin:
    ``cases.bert``)."""

    @nn.compact
    def __call__(self, t):
        width = cases.BERT_WIDTH
        h = nn.Embed(cases.BERT_VOCAB, width, name="words")(t)
        init = nn.initializers.normal(0.02)
        h = nn.LayerNorm(epsilon=1e-6)(h + self.param("positions", init, (t.shape[-1], width)))
        mask = (t != 0)[:, None, None, :]  # (N, heads, queries, keys): keys that are words
        for _ in range(cases.BERT_LAYERS):
            h = BertBlock()(h, mask)
        pooled = nn.tanh(nn.Dense(width, name="pooler")(h[:, 0]))
        return nn.Dense(2, name="classifier")(pooled)


def _zoo_token_model():
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import zoo

    return zoo.TokenModel()


def flax_module(case):
    """The Flax module of a case (``None`` for the MLPs, which are plain JAX)."""
    if case.model == "lenet":
        return ntk_flax.LeNet(out_features=1)
    if case.model == "resnet":
        return ResNet()
    if case.model == "resnet18":
        return ResNet18()
    if case.model == "tokens":
        return TokenModel()
    if case.model == "vit":
        return ViT()
    if case.model == "bert":
        return Bert()
    return None


def init_variables(case):
    """Variables in Flax's layout: Flax ``init`` (MLP: scaled normal weights, small
    biases); BatchNorm running statistics set away from 0 and 1."""
    rng = np.random.default_rng(0)
    module = flax_module(case)
    if module is None:
        params = {}
        for i, (a, b) in enumerate(zip(case.widths[:-1], case.widths[1:], strict=True)):
            params[f"Dense_{i}"] = {
                "kernel": rng.standard_normal((a, b), dtype=np.float32) / np.sqrt(a),
                "bias": 0.1 * rng.standard_normal(b, dtype=np.float32),
            }
        return {"params": params}
    x = jnp.asarray(cases.make_inputs(case, 2))
    variables = jax.tree_util.tree_map(np.asarray, module.init(jax.random.PRNGKey(0), x))
    if "batch_stats" in variables:
        variables["batch_stats"] = jax.tree_util.tree_map_with_path(
            lambda path, v: (
                rng.uniform(0.5, 1.5, v.shape)
                if path[-1].key == "var"
                else 0.1 * rng.standard_normal(v.shape)
            ).astype(np.float32),
            variables["batch_stats"],
        )
    return variables


def apply_fn(case, variables):
    """``apply(params, x)``: the Flax module's apply (the plain twin for the MLPs), other
    collections closed over."""
    module = flax_module(case)
    _, rest = cases.split_variables(variables)
    if module is None:
        return lambda p, x: cases.mlp({"params": p, **rest}, x)
    return lambda p, x: module.apply({"params": p, **rest}, x)


def naive_ntk(apply, trace_axes):
    """The usual hand-written recipe: per-sample Jacobians by ``vmap(jacrev)``, flattened
    and contracted by one einsum over parameters, traced axes averaged."""

    def kernel(params, x):
        def single(p, xi):
            return apply(p, xi[None])[0]

        out_ndim = jax.eval_shape(single, params, x[0]).ndim
        jac = jax.vmap(jax.jacrev(single), (None, 0))(params, x)
        flat = jnp.concatenate(
            [a.reshape(a.shape[: 1 + out_ndim] + (-1,)) for a in jax.tree_util.tree_leaves(jac)],
            axis=-1,
        )
        traced = {a % (out_ndim + 1) for a in trace_axes}
        lhs, rhs, out = "i", "j", "ij"
        for axis in range(1, out_ndim + 1):
            a, b = chr(ord("a") + axis), chr(ord("A") + axis)
            lhs += a
            rhs += a if axis in traced else b
            out += "" if axis in traced else a + b
        k = jnp.einsum(f"{lhs}z,{rhs}z->{out}", flat, flat, precision="highest")
        return k / math.prod(flat.shape[a] for a in traced)

    return jax.jit(kernel)


# -- estimates -------------------------------------------------------------------------------


def _forward_values(jaxpr) -> int:
    """Values every equation of a jaxpr produces (sub-jaxprs included)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _forward_values(inner)
    return total


def estimates(case, variables, x):
    """Cost estimates (FLOPs, bytes) per measurement, ours and neural-tangents'.

    ``ntk_core.plan`` gives FLOPs and feature memory of ``jacobian``, ``ntvp`` and
    ``structured``; to each memory the kernel itself (N²·O'·4 bytes) is added. The
    naive baseline is estimated as ``jacobian``; ``auto`` as what it chose.
    neural-tangents: structured derivatives as ours; Jacobian contraction with
    :data:`NT_JACOBIAN_MEMORY` x N·O·P·4 bytes; its
    NTK-vector products vmap a JVP over all N² pairs at once, so their memory is
    estimated as N² x (values of one single-sample forward pass) x 4 bytes.
    """
    params, _ = cases.split_variables(variables)
    apply = apply_fn(case, variables)
    try:
        return _estimates(case, apply, params, x)
    except Exception as e:  # an ntk_core whose plan() differs: measure, without skips
        return {"plan_error": f"{type(e).__name__}: {e}"}


def _estimates(case, apply, params, x):
    info = {}
    plan = ntk_core.plan(apply, params, x, None, trace_axes=case.trace_axes)
    sized = ntk_core.plan(
        apply, params, x, None, trace_axes=case.trace_axes, implementation="structured"
    )
    out = jax.eval_shape(apply, params, x[:1])
    out_size = math.prod(out.shape[1:])
    o_pair = out_size**2 // math.prod(out.shape[a] for a in case.trace_axes)
    kernel_bytes = len(x) ** 2 * o_pair * 4
    ours = {
        e.implementation: {"flops": e.flops, "memory_bytes": e.memory_bytes + kernel_bytes}
        for e in plan.estimates
    }
    ours["naive"] = dict(ours["jacobian"])
    ours["auto"] = dict(ours[plan.implementation])
    info["auto_chose"] = plan.implementation
    info["ours"] = ours
    info["structured_leaves"] = [[str(v.path), v.size, v.method] for v in sized.leaves]
    single = jax.make_jaxpr(lambda p, xi: apply(p, xi[None]))(params, x[0])
    values = _forward_values(single.jaxpr)
    jac = ours["jacobian"]
    info["nt"] = {
        "jacobian": {
            "flops": jac["flops"],
            "memory_bytes": NT_JACOBIAN_MEMORY * len(x) * out_size * cases.n_params(params) * 4.0,
        },
        "structured": dict(ours["structured"]),
        "ntvp": {"flops": ours["ntvp"]["flops"], "memory_bytes": len(x) ** 2 * values * 4.0},
    }
    info["n_params"] = cases.n_params(params)
    return info


# -- the worker ------------------------------------------------------------------------------


def measure(spec):
    case = cases.CASES[spec["case"]]
    variables, x, _ = cases.load_case(spec["data_dir"], case, spec["n"])
    params, _ = cases.split_variables(variables)
    apply = apply_fn(case, variables)
    impl = spec["implementation"]
    if impl == "naive":
        fn = naive_ntk(apply, case.trace_axes)
    else:
        kf = ntk_core.ntk_fn(apply, trace_axes=case.trace_axes, implementation=impl)
        fn = jax.jit(lambda p, a: kf(p, a))
    result = harness.time_jitted(fn, (params, x))
    if impl == "auto" and hasattr(kf, "implementation_for"):
        result["auto_chose"] = kf.implementation_for(params, x)
    return result


# -- the driver ------------------------------------------------------------------------------


def prepare(case, n, data_dir):
    """Builds the case, checks the plain twin against the Flax model, writes the data."""
    variables = init_variables(case)
    x = jnp.asarray(cases.make_inputs(case, n))
    apply = apply_fn(case, variables)
    params, _ = cases.split_variables(variables)
    ours = np.asarray(apply(params, x[:8]), np.float64)
    twin = np.asarray(cases.plain_apply(case)(variables, x[:8]), np.float64)
    rel = float(np.abs(ours - twin).max() / np.abs(ours).max())
    if case.model == "tokens":
        zoo = np.asarray(_zoo_token_model().apply(variables, x[:8]), np.float64)
        rel = max(rel, float(np.abs(ours - zoo).max() / np.abs(ours).max()))
    if rel > 1e-4:
        raise RuntimeError(f"{case.key}: twins differ from the Flax model by {rel}")
    meta = {"case": case.key, "n": n, "twin_max_rel_diff": rel, **estimates(case, variables, x)}
    cases.save_case(data_dir, case, n, variables, x, meta)
    return meta


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(cases.CASES), choices=list(cases.CASES))
    parser.add_argument("--n", type=int, help="N for every case (default: each case's own)")
    parser.add_argument(
        "--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS
    )
    parser.add_argument(
        "--max-est-s",
        type=float,
        default=15.0,
        help="skip a measurement whose estimated FLOPs take longer than this at the "
        "measured matmul rate (real runs take several times longer)",
    )
    parser.add_argument("--max-est-gib", type=float, default=6.0, help="skip above this memory")
    parser.add_argument("--kill-gib", type=float, default=12.0, help="kill a worker above this RSS")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="kill a worker after this")
    parser.add_argument(
        "--dry-run", action="store_true", help="write the data, print estimates and skips only"
    )
    parser.add_argument(
        "--skip-rate-gflops",
        type=float,
        help="FLOP/s (in GFLOP/s) that --max-est-s assumes (default: the matmul rate "
        "measured at the start; pin it to make the skips independent of the load)",
    )
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default=os.path.join(HERE, "results_core.json"))
    args = parser.parse_args(argv)

    meta = harness.machine()
    meta["ntk_core"] = getattr(ntk_core, "__version__", "?")
    meta["matmul_flops_per_s_start"] = harness.matmul_rate()
    rate = meta["matmul_flops_per_s_start"]
    skip_rate = args.skip_rate_gflops * 1e9 if args.skip_rate_gflops else rate
    meta["limits"] = {
        **{k: getattr(args, k) for k in ("max_est_s", "max_est_gib", "kill_gib", "timeout_s")},
        "skip_rate_flops_per_s": skip_rate,
    }
    print(f"{meta}", flush=True)
    results = []
    started = time.time()
    for key in args.cases:
        case = cases.CASES[key]
        n = args.n or case.n
        info = prepare(case, n, args.data_dir)
        row = {"case": key, "title": case.title, "N": n, "trace_axes": list(case.trace_axes)}
        row["estimates"] = info
        for impl in args.implementations:
            estimate = info.get("ours", {}).get(impl)
            reason = harness.skip_reason(
                estimate, skip_rate, args.max_est_s, args.max_est_gib * harness.GIB
            )
            if reason:
                row[impl] = {"skipped": reason, "loadavg": harness.load()}
            elif args.dry_run:
                row[impl] = {"would_run": estimate}
            else:
                spec = {"case": key, "n": n, "implementation": impl, "data_dir": args.data_dir}
                row[impl] = harness.run_worker(
                    __file__,
                    spec,
                    timeout_s=args.timeout_s,
                    kill_bytes=args.kill_gib * harness.GIB,
                )
            print(f"{key} N={n} {impl}: {json.dumps(row[impl])[:300]}", flush=True)
        results.append(row)
    meta["matmul_flops_per_s_end"] = harness.matmul_rate()
    meta["matmul_flops_per_s"] = max(rate, meta["matmul_flops_per_s_end"])
    meta["loadavg_end"] = harness.load()
    meta["wall_s"] = time.time() - started
    if args.dry_run:
        return
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1)
    print(f"wrote {args.out} ({meta['wall_s']:.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        harness.worker_main(measure)
    else:
        main()
