"""Markdown tables from ``results_core.json`` (and ``results_neural_tangents.json``).

    python benchmarks/report.py [--core results_core.json] [--nt results_neural_tangents.json]

Prints: the machine of each run; per case ours (trace+lower, compile, warm run, peak
RSS, ratio to the FLOP floor, what ``"auto"`` chose) with the skipped measurements and
their estimates; neural-tangents side by side with the ratios ours / theirs; and the
issue's targets, each marked met, not met or not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
GB = 1e9
OURS = ("structured", "jacobian", "ntvp", "auto", "naive")
NAMES = {"naive": "naive vmap(jacrev)+einsum"}
NT = ("jacobian", "ntvp", "structured")
NT_NAMES = {
    "jacobian": "Jacobian contraction",
    "ntvp": "NTK-vector products",
    "structured": "structured derivatives",
}


def _load(path):
    if path and os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    return None


def _ok(m):
    return isinstance(m, dict) and "run_s" in m


def _mem(m):
    added = (m["peak_rss_bytes"] - m["baseline_rss_bytes"]) / GB
    return f"{m['peak_rss_bytes'] / GB:.2f} ({added:.2f})"


def _machine(label, meta):
    rate = meta["matmul_flops_per_s"] / 1e9
    return (
        f"{label}: jax {meta['jax']} on {meta['device']}, {meta['cpu_count']} CPUs, "
        f"{meta['date_utc']} UTC, load average (1/5/15 min) {meta['loadavg_1_5_15']} at the "
        f"start and {meta['loadavg_end']} at the end, 2000x2000 float32 matmul "
        f"{rate:.0f} GFLOP/s (best of start and end), {meta['wall_s']:.0f} s in all."
    )


def ours_table(core):
    lines = [
        "| case | N | implementation | trace+lower s | compile s | warm run s | x floor | "
        "peak RSS GB (added) | load 1 min |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in core["results"]:
        floor = _floor(row)
        for impl in OURS:
            m = row.get(impl)
            if m is None:
                continue
            name = NAMES.get(impl, impl)
            if impl == "auto":
                name += f" → {m.get('auto_chose', row['estimates'].get('auto_chose', '?'))}"
            head = f"| {row['title']} | {row['N']} | {name} |"
            if _ok(m):
                ratio = f"{m['run_s'] / floor:.1f}" if floor else "-"
                lines.append(
                    f"{head} {m['trace_lower_s']:.2f} | {m['compile_s']:.2f} | "
                    f"{m['run_s']:.3f} | {ratio} | {_mem(m)} | {m['loadavg_after'][0]} |"
                )
            else:
                why = m.get("skipped") and f"skipped: {m['skipped']}" or m.get("error")
                lines.append(f"{head} {why} | | | | | |")
    return "\n".join(lines)


def _floor(row):
    est = row["estimates"].get("ours", {}).get("structured")
    return est["flops"] / row["rate"] if est else None


def floor_table(core):
    lines = [
        "| case | N | structured FLOPs (plan) | FLOP floor s | auto chose | P |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in core["results"]:
        est = row["estimates"]
        if "ours" not in est:
            continue
        flops = est["ours"]["structured"]["flops"]
        lines.append(
            f"| {row['title']} | {row['N']} | {flops:.3e} | {flops / row['rate']:.4f} | "
            f"{est['auto_chose']} | {est['n_params']} |"
        )
    return "\n".join(lines)


def nt_table(core, nt):
    theirs = {(r["case"], r["N"]): r for r in nt["results"]}
    lines = [
        "| case | N | neural-tangents implementation | NT warm run s | NT peak RSS GB (added) "
        "| ours warm run s | ours / NT time | ours peak RSS GB | kernels agree (rel.) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in core["results"]:
        other = theirs.get((row["case"], row["N"]))
        if other is None:
            continue
        for impl in NT:
            m, ours = other.get(impl), row.get(impl)
            head = f"| {row['title']} | {row['N']} | {NT_NAMES[impl]} |"
            if m is None:
                lines.append(f"{head} not run | | | | | |")
                continue
            if not _ok(m):
                why = m.get("skipped") and f"skipped: {m['skipped']}" or m.get("error")
                lines.append(f"{head} {why} | | | | | |")
                continue
            if _ok(ours):
                diff = abs(ours["checksum"]["norm"] - m["checksum"]["norm"]) / m["checksum"]["norm"]
                lines.append(
                    f"{head} {m['run_s']:.3f} | {_mem(m)} | {ours['run_s']:.3f} | "
                    f"{ours['run_s'] / m['run_s']:.3f} | {_mem(ours)} | {diff:.1e} |"
                )
            else:
                lines.append(f"{head} {m['run_s']:.3f} | {_mem(m)} | not measured | | | |")
    return "\n".join(lines)


def cases_n(key):
    import cases

    return cases.CASES[key].n


def targets(core, nt):
    """The issue's targets, each met / not met / not measured, with the figures."""
    rows = {r["case"]: r for r in core["results"] if r["N"] == cases_n(r["case"])}
    theirs = {r["case"]: r for r in nt["results"]} if nt else {}
    out = []

    def verdict(ok):
        return "**met**" if ok else "**not met**"

    for key in ("mlp1", "lenet"):
        r, t = rows.get(key), theirs.get(key, {}).get("structured")
        if r and _ok(r.get("structured")) and _ok(t):
            ratio = r["structured"]["run_s"] / t["run_s"]
            out.append(
                f"- structured ≤ 0.5 x neural-tangents structured, {r['title']}: "
                f"{r['structured']['run_s']:.3f} s vs {t['run_s']:.3f} s = {ratio:.2f} x: "
                f"{verdict(ratio <= 0.5)}"
            )
        else:
            out.append(f"- structured ≤ 0.5 x neural-tangents structured, {key}: not measured")
    r = rows.get("mlp1")
    if r and _ok(r.get("structured")) and _floor(r):
        ratio = r["structured"]["run_s"] / _floor(r)
        out.append(
            f"- structured within 2 x of the FLOP floor, {r['title']}: {ratio:.2f} x: "
            f"{verdict(ratio <= 2)}"
        )
    for r in core["results"]:
        s, j = r.get("structured"), r.get("jacobian")
        title = f"{r['title']}, N={r['N']}"
        if _ok(s) and _ok(j):
            t_ratio = s["run_s"] / j["run_s"]
            m_ok = s["peak_rss_bytes"] <= j["peak_rss_bytes"]
            out.append(
                f"- structured ≤ 1.2 x jacobian and peak memory no higher, {title}: "
                f"{t_ratio:.2f} x, {s['peak_rss_bytes'] / GB:.2f} vs "
                f"{j['peak_rss_bytes'] / GB:.2f} GB: {verdict(t_ratio <= 1.2 and m_ok)}"
            )
        elif _ok(s):
            out.append(
                f"- structured ≤ 1.2 x jacobian, {title}: jacobian not measured "
                f"({j.get('skipped') or j.get('error') if j else 'not run'})"
            )
        timed = {i: r[i]["run_s"] for i in ("structured", "jacobian", "ntvp") if _ok(r.get(i))}
        a = r.get("auto")
        if _ok(a) and timed:
            best = min(timed, key=timed.get)
            ratio = a["run_s"] / timed[best]
            chose = a.get("auto_chose")
            note = ""
            if chose == best and ratio > 1.2:
                note = f" (the same computation as {best}: the difference is load noise)"
            out.append(
                f"- auto within 1.2 x of the fastest, {r['title']}, N={r['N']}: auto → {chose} "
                f"{a['run_s']:.3f} s, fastest measured {best} {timed[best]:.3f} s = {ratio:.2f} x: "
                f"{verdict(ratio <= 1.2)}; auto chose the fastest measured: "
                f"{'yes' if chose == best else 'no'}{note}"
            )
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--core",
        nargs="+",
        default=[os.path.join(HERE, "results_core.json")],
        help="results of bench_core.py (several runs, e.g. a full one and one at smaller N)",
    )
    parser.add_argument("--nt", default=os.path.join(HERE, "results_neural_tangents.json"))
    args = parser.parse_args(argv)
    runs, nt = [_load(p) for p in args.core], _load(args.nt)
    for run in runs:
        print(_machine("ntk_core", run["meta"]))
        for row in run["results"]:
            row["rate"] = run["meta"]["matmul_flops_per_s"]
    if nt:
        print()
        print(_machine(f"neural-tangents {nt['meta']['neural_tangents']}", nt["meta"]))
    core = {"results": [row for run in runs for row in run["results"]]}
    for row in core["results"]:
        if "plan_error" in row["estimates"]:
            why = row["estimates"]["plan_error"]
            print(f"\n{row['title']}: no estimates, nothing skipped ({why})")
    print("\n" + ours_table(core))
    print('\nFLOP floor (plan\'s FLOPs of "structured" / the matmul rate):\n')
    print(floor_table(core))
    if nt:
        print("\n" + nt_table(core, nt))
    print("\nTargets of issue 3:\n")
    print(targets(core, nt))


if __name__ == "__main__":
    main()
