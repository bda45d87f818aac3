"""The derived graph as one stax :class:`~ntk_core._infinite.layer.Rule`: each node's
kernel map is a rule of :mod:`ntk_core._infinite` (affine, the nonlinearities, pools,
Flatten, FanInSum, FanInConcat), evaluated in the graph's order on the pair's
:class:`~ntk_core._infinite.state.Kern`; the few maps stax has no layer for are here:

- a weight product scaled by a constant c, with entries of variance σ²/fan_in: stax's
  standard-parameterised affine rule with σw² = c²σ² and the NTK's fan-in term c²·fan_in
  (``s = (1/c², 1)``): c = 1 is ``parameterization="standard"`` and c = 1/√fan_in with
  σ² = fan_in (``W / √n``, W ~ N(0, 1)) its ``"ntk"``;
- a bias b·c with entries of variance σb²: Σ += c²σb², Θ += c² (a zero-initialised
  trainable bias, σb = 0, still adds c² to the NTK);
- a gain γ·c per channel (LayerNorm's scale) with E[γ²] = σ²: Σ' = c²σ²·Σ, Θ' = c²σ²·Θ
  + c²·Σ in expectation. Its own gradient c·y_c is one channel's value, not an average:
  a nonlinearity right after it sees Θ_c = c²σ²·Θ + κ·z_c z'_c (z = the gain's output,
  κ = 1/σ²), so its NTK is Σ̇·(Θ − κ·Σ) + κ·E[φ'(u)φ'(v)·u·v] (the NNGP of u·φ'(u): φ's
  own NNGP for ReLU-like φ, quadrature otherwise); a weight layer averages it to c²·Σ;
- a normalisation u·s(q) by a function of each sample's variance q at a position: Σ' =
  s(q1)·s(q2)·Σ, Θ' likewise (LayerNorm over the channels with s(q) = 1/√(q + ε));
- a constant scaling a·u: every covariance times a².
"""

from __future__ import annotations

import math
import types

from ntk_core._derived.graph import MONTE_CARLO, Kind
from ntk_core._derived.paths import caller
from ntk_core._errors import bad
from ntk_core._infinite import affine, spatial
from ntk_core._infinite.layer import Rule, named, repeated, settled
from ntk_core._infinite.state import pair_variances


def _add_bias(k, biases, priors):
    for leaf, c in biases:
        v = c * c * priors[leaf] ** 2
        k = k.replace(
            nngp=k.nngp + v,
            ntk=None if k.ntk is None else k.ntk + c * c,
            cov1=k.cov1 + v,
            cov2=None if k.cov2 is None else k.cov2 + v,
        )
    return k


def _affine(node, k, priors):
    info = node.info
    c = info.scale
    w2 = c * c * priors[info.leaf] ** 2
    layer = types.SimpleNamespace(
        W_std=math.sqrt(w2),
        b_std=None,
        parameterization="standard",
        s=(1 / (c * c), 1),
        out_dim=info.width,
        out_chan=info.width,
        **(info.conv or {}),
    )
    out = affine.conv(k, layer) if node.kind is Kind.Conv else affine.dense(k, layer)
    return _add_bias(out, info.biases, priors)


def _scaled(k, factor):
    f2 = factor * factor
    return k.map(lambda a, _: a * f2)


def _gain(node, k, priors):
    c = node.info.scale
    g2 = c * c * priors[node.info.leaf] ** 2
    out = k.map(lambda a, _: a * g2)
    return out.replace(ntk=None if k.ntk is None else g2 * k.ntk + c * c * k.nngp)


def _normalise(node, k):
    s = node.info.scale
    q11, q22, self1, self2 = pair_variances(k)
    return k.replace(
        nngp=k.nngp * s(q11) * s(q22),
        ntk=None if k.ntk is None else k.ntk * s(q11) * s(q22),
        cov1=k.cov1 * s(self1[0]) * s(self1[1]),
        cov2=None if k.cov2 is None else k.cov2 * s(self2[0]) * s(self2[1]),
    )


def _psi_rule(form, deg):
    """The quadrature rule of ψ(u) = φ'(u)·u (E[φ'(u)φ'(v)·u·v] is its NNGP), built
    outside any trace (stax checks that ψ is elementwise by running it)."""
    import jax

    from ntk_core._infinite import layers as stax  # the layers, not the public face

    fn = form.fn

    def psi(u):
        return jax.jvp(fn, (u,), (jax.numpy.ones_like(u),))[1] * u

    psi.__name__ = "dphi_times_u"
    return stax.ElementwiseNumerical(psi, deg).kernel_fn.rule


def _after_gain(node, k, kappa, rule, psi_rule):
    """A nonlinearity whose input's NTK holds κ·z·z' of each channel's own value."""
    form = node.info.form
    deterministic = k.replace(ntk=k.ntk - kappa * k.nngp) if k.ntk is not None else k
    out = rule.transform(deterministic)
    if k.ntk is None:
        return out
    if form.homogeneous:
        cross = out.nngp  # φ'(u)·u = φ(u)
    else:
        cross = psi_rule.transform(k).nngp
    return out.replace(ntk=out.ntk + kappa * cross)


def _needs(kind, full):
    if kind in (Kind.SumPool, Kind.GlobalSumPool):
        return True
    return full and kind is not Kind.Flatten


#: Layers a scanned run may hold (a gain's κ, pools and branches are never repeated here).
_REPEATABLE = (Kind.Dense, Kind.Conv, Kind.Bias, Kind.Nonlinearity, Kind.Scale)


def _signature(node, priors):
    """What a node's kernel map depends on (equal signatures: the same maths), or None
    where it is not compared: its leaves by their priors, a nonlinearity by its closed
    form's name and values (quadrature forms are not compared)."""
    info = node.info
    if node.kind not in _REPEATABLE:
        return None
    biases = tuple((c, priors[leaf]) for leaf, c in getattr(info, "biases", ()))
    if node.kind in (Kind.Dense, Kind.Conv):
        conv = tuple(sorted((k, repr(v)) for k, v in (info.conv or {}).items()))
        return (node.kind, info.scale, priors[info.leaf], info.width, conv, biases, node.shape)
    if node.kind is Kind.Nonlinearity:
        form = info.form
        if not form.closed:
            return None
        from ntk_core._derived import phi  # the values that identified the form

        return (node.kind, form.name, phi.values_key(form.fn), node.shape)
    return (node.kind, getattr(info, "factor", None), biases, node.shape)


def _runs(nodes, live, priors, users) -> dict:
    """{first node's index: (period, count)}: a chain of nodes (each the only user of the
    one before) whose signatures repeat with a period of at most 4, at least 3 times (C3's
    13 x [Dense, Erf], a 21-layer CNN): one scanned step, as ``stax.serial`` runs
    ``[Dense(...), Relu()] * n``, instead of an unrolled program that XLA CPU fuses
    across layers (a 21-layer CNN: 130x slower warm)."""
    sig = [_signature(n, priors) if n.id in live else None for n in nodes]
    runs, i = {}, 1
    while i < len(nodes):
        best = (1, 1)
        for p in range(1, 5):
            block = sig[i : i + p]
            if len(block) < p or None in block or not _chained(nodes, i, p, users):
                break
            count = 1
            while sig[i + count * p : i + (count + 1) * p] == block and _chained(
                nodes, i + count * p, p, users
            ):
                count += 1
            if p * count > best[0] * best[1]:
                best = (p, count)
        if best[1] >= 3:
            runs[i] = best
            i += best[0] * best[1]
        else:
            i += 1
    return runs


def _chained(nodes, start, p, users) -> bool:
    """Whether nodes[start:start + p] each take the node before as their one input, and
    each but the block's last has no other user."""
    for j in range(start, start + p):
        if j >= len(nodes) or nodes[j].inputs != (nodes[j - 1].id,) or users[nodes[j - 1].id] != 1:
            return False
    return True


def build_rule(graph, priors, deg: int, name: str) -> Rule:
    """The Rule computing ``graph``'s output kernel, priors ``{leaf: std}``."""
    from ntk_core._infinite import layer as stax  # FanInSum, FanInConcat

    nodes = graph.nodes
    live = {graph.output}
    for node in reversed(nodes):
        if node.id in live:
            live |= set(node.inputs)
    layers, psi_rules = {}, {}
    for node in nodes:
        if node.kind is Kind.Nonlinearity:
            layers[node.id] = node.info.form.make(deg).kernel_fn.rule
            after_gain = nodes[node.inputs[0]].kind in (Kind.Gain, Kind.Bias, Kind.Scale)
            if after_gain and not node.info.form.homogeneous:
                psi_rules[node.id] = _psi_rule(node.info.form, deg)
        elif node.kind in (Kind.FanInSum, Kind.FanInConcat):
            fan_in = stax.FanInSum if node.kind is Kind.FanInSum else stax.FanInConcat
            layers[node.id] = fan_in().kernel_fn.rule

    def one(node, ins):
        kind, info = node.kind, node.info
        if kind in (Kind.Dense, Kind.Conv):
            return _affine(node, ins[0], priors)
        if kind is Kind.Bias:
            return _add_bias(ins[0], info.biases, priors)
        if kind is Kind.Gain:
            return _gain(node, ins[0], priors)
        if kind is Kind.Scale:
            return _scaled(ins[0], info.factor)
        if kind is Kind.Normalise:
            return _normalise(node, ins[0])
        if kind is Kind.Nonlinearity:
            return layers[node.id].transform(ins[0])
        if kind in (Kind.FanInSum, Kind.FanInConcat):
            return layers[node.id].transform(tuple(ins))
        if kind is Kind.SumPool:
            return spatial.pool(
                ins[0], types.SimpleNamespace(normalize_edges=False, **vars(info)), False
            )
        if kind is Kind.GlobalSumPool:
            return spatial.global_pool(ins[0], False)
        if kind is Kind.Flatten:
            return spatial.flatten(ins[0])
        raise AssertionError(kind)  # every kind the walk makes is above

    users = {n.id: 0 for n in nodes}
    users[graph.output] = 1
    for node in nodes:
        if node.id in live:
            for i in node.inputs:
                users[i] += 1
    runs = _runs(nodes, live, priors, users)

    def transform(kern):
        values = {0: kern}
        # node -> κ: its NTK holds κ·z_c·z'_c of its own channel (after a gain); NaN where
        # the values are shifted by a random bias (or the gain is zero): no rule follows
        own = {}
        skip = 0
        for index, node in enumerate(nodes[1:], 1):
            if index < skip or node.id not in live:
                continue
            if index in runs and node.inputs[0] not in own:
                period, count = runs[index]
                block = nodes[index : index + period]

                def step(k, block=block):
                    for b in block:
                        k = named(one(b, [k]), f"{b.kind.name} at {b.source}")
                    return k

                last = nodes[index + period * count - 1]
                values[last.id] = settled(repeated(step, count, values[node.inputs[0]]))
                skip = index + period * count
                continue
            ins = [values[i] for i in node.inputs]
            kappa = own.get(node.inputs[0]) if node.inputs else None
            after_gain = node.kind is Kind.Nonlinearity and kappa is not None
            if after_gain and math.isnan(kappa):
                what = f"the nonlinearity at {node.source} follows a gain shifted by a random bias"
                fix = "put a Dense layer between them, or " + MONTE_CARLO
                raise bad(ValueError, caller(), f"{what} (or a zero gain): no rule here", fix)
            if after_gain:
                out = _after_gain(node, ins[0], kappa, layers[node.id], psi_rules.get(node.id))
            else:
                out = one(node, ins)
            values[node.id] = settled(named(out, f"{node.kind.name} at {node.source}"))
            if node.kind is Kind.Gain:
                g2 = node.info.scale**2 * priors[node.info.leaf] ** 2
                own[node.id] = node.info.scale**2 / g2 if g2 else math.nan
            elif kappa is not None and node.kind is Kind.Scale:
                own[node.id] = kappa if math.isnan(kappa) else kappa / node.info.factor**2
            elif kappa is not None and node.kind is Kind.Bias:
                zero = all(priors[leaf] == 0 for leaf, _ in node.info.biases)
                own[node.id] = kappa if zero else math.nan  # z + 0: the same values
        return values[graph.output]

    def needs(full):
        need = {graph.output: full}
        for node in reversed(nodes):
            if node.id not in need:
                continue
            inner = _needs(node.kind, need[node.id])
            for i in node.inputs:
                need[i] = need.get(i, False) or inner
        return need.get(0, False)

    return Rule(name, transform, needs)
