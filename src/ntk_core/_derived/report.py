"""The derived graph as text: one line per layer with its rule, prior and source line."""

from __future__ import annotations

from ntk_core._derived.graph import Kind


def _biases(biases, names, priors) -> str:
    scaled = lambda c: f" scaled by {c:g}" if c != 1 else ""  # noqa: E731
    return "; ".join(f"bias {names[b]}: b_std={priors[b]:g}{scaled(c)}" for b, c in biases)


def _layer(node, names, priors, deg) -> str:
    info, kind = node.info, node.kind
    if kind in (Kind.Dense, Kind.Conv):
        c, std = info.scale, priors[info.leaf]
        text = (
            f"{names[info.leaf]}: W_std={std:g} (σw² = {c * c * std * std:g}), "
            f"fan_in {info.fan_in}, width {info.width_in} -> {info.width}"
        )
        text += f", scaled by {c:g}" if c != 1 else ""
        text += "".join(f", {key} {value}" for key, value in (info.conv or {}).items())
        biases = _biases(info.biases, names, priors)
        return f"{text}; {biases}" if biases else text
    if kind is Kind.Bias:
        return _biases(info.biases, names, priors)
    if kind is Kind.Gain:
        return f"{names[info.leaf]}: W_std={priors[info.leaf]:g} (mean square)"
    if kind is Kind.Nonlinearity:
        rule = "closed form" if info.form.closed else f"quadrature, deg={deg}"
        return f"{info.form.name} ({rule}; from {', '.join(info.prims) or 'the chain'})"
    if kind is Kind.Scale:
        return f"times {info.factor:g}"
    if kind is Kind.Normalise:
        return "u·s(q): channel mean and variance at infinite width (LayerNorm)"
    return ", ".join(f"{key} {value}" for key, value in vars(info).items())  # SumPool's window


def describe(graph, priors, deg) -> str:
    lines = [
        f"derived infinite-width network ({len(graph.nodes)} layers, output: layer "
        f"{graph.output}); kernel rules of ntk_core.stax:"
    ]
    for node in graph.nodes:
        inputs = ", ".join(map(str, node.inputs)) or "x"
        text = f"  {node.id:>3} {node.kind.name:<13} <- {inputs:<6} {tuple(node.shape[1:])}"
        text += f"  {_layer(node, graph.names, priors, deg)}".rstrip()
        text += f"  [{node.source}]" if node.source else ""
        text += f"  (looked through: {', '.join(node.looked)})" if node.looked else ""
        lines.append(text)
    return "\n".join(lines)
