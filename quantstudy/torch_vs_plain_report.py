"""torch_vs_plain's rows as markdown: a table per row (with its kernel profile), the summary table
of all of them, and the rows past the issue's bar (MARGIN).
"""

from __future__ import annotations

from typing import Any

# The bar: each engine of the project at most 3% slower than plain torch.
MARGIN = 1.03


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _x(s: dict[str, float]) -> str:
    return f"{s['x']:.3f} ({s['x_min']:.3f} to {s['x_max']:.3f})"


def _rel(d: dict[str, Any]) -> str:
    return f"non-finite ({d['nonfinite']})" if d["rel_l2"] is None else f"{d['rel_l2']:.2e}"


def setting_and_graph(row: dict[str, Any]) -> str:
    """The row's setting, and its graph where the family has several (prefill, decode)."""
    graph = row.get("graph", "main")
    return row["setting"] if graph == "main" else f"{row['setting']} {graph}"


def _shape(row: dict[str, Any]) -> str:
    return ", ".join([f"batch {row['batch']}"] + [f"{k} {v}" for k, v in row["shape"].items()])


def row_table(row: dict[str, Any]) -> str:
    head = f"### {row['family']}: {row['model']} {setting_and_graph(row)} ({_shape(row)})\n"
    if row["status"] != "ok":
        return head + f"\n{row['status']}: {row['error'].strip().splitlines()[-1]}\n"
    b, c, chk = row["baseline"], row["candidate"], row["check"]
    lines = [head, "| engine | project ms | plain ms | project / plain (paired rounds) | "
                   "outputs, project vs plain (rel. L2) |", "|---|---|---|---|---|"]
    for v in (b, c):
        lines.append(f"| {v} | {_ms(row['ms'][f'project {v}'])} | {_ms(row['ms'][f'plain {v}'])} | "
                     f"{_x(row['ratio'][v])} | {_rel(chk['project_vs_plain'][v])} |")
    lines.append(f"| x = {b} / {c} | {_x(row['x']['project'])} | {_x(row['x']['plain'])} | | |")
    apart, tol = chk["candidate_vs_baseline"], chk["tolerance_rel_l2"] or {}
    lines[-3] = lines[-3].rstrip(" |") + f" (tolerance {tol[b]:.2e}) |" if tol else lines[-3]
    lines[-2] = lines[-2].rstrip(" |") + f" (below {tol[c]:.2e}: FP8 against fp16) |" if tol else lines[-2]
    lw = chk["fp8_layers"]
    lines += ["", f"Outputs ({chk['output']}) {'agree' if chk['ok'] else 'DIFFER'}. FP8 layers one by one (the "
                  f"project layer's input into the plain layer): {lw['calls']} calls of {lw['layers']} layers, largest "
                  f"rel. L2 {_rel(lw['worst'])} (tolerance {lw['tolerance_rel_l2']:.1e})"
                  + (f", missing in plain: {', '.join(lw['missing_in_plain'][:3])}" if lw["missing_in_plain"] else "")
                  + f". fp16 rounding (project {b} "
                  f"against the fp32 graph module): {_rel(chk['fp16_rounding'])}; {c} against {b}: project "
                  f"{_rel(apart['project'])}, plain {_rel(apart['plain'])}. FP8 GEMMs per forward: project "
                  f"{row['fp8_gemm_calls_per_forward']['project']:g}, plain {row['fp8_gemm_calls_per_forward']['plain']:g}. "
                  f"FP8 layers: project {row['fp8_layers'][c]['project']}, plain {row['fp8_layers'][c]['plain']}. "
                  f"Timing: {row['timing']['rounds']} rounds of {row['timing']['calls_per_round']} calls. "
                  f"Seconds: {', '.join(f'{k} {v}' for k, v in row['seconds'].items())}."]
    if "profile" in row:
        lines.append(profile_table(row))
    return "\n".join(lines) + "\n"


def profile_table(row: dict[str, Any], top: int = 12) -> str:
    prof = row["profile"]
    names = list(prof)
    groups = list(dict.fromkeys(g for p in prof.values() for g in p["groups_ms"]))
    lines = ["", f"Kernel time per call, ms (count per call), {prof[names[0]]['profiled']}:", "",
             "| group | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for g in groups:
        cells = [f"{p['groups_ms'].get(g, 0):.4f} ({p.get('groups_count', {}).get(g, 0):g})" for p in prof.values()]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines.append("| total | " + " | ".join(f"{p['total_ms']:.4f}" for p in prof.values()) + " |")
    for name, p in prof.items():
        lines += ["", f"Top kernels, {name}:", "", "| ms | count | group | kernel |", "|---|---|---|---|"]
        lines += [f"| {k['ms']:.4f} | {k.get('count', 0):g} | {k['group']} | `{k['name'][:90]}` |"
                  for k in p["top_kernels"][:top]]
    return "\n".join(lines)


def summary_table(rows: list[dict[str, Any]]) -> str:
    lines = ["## torch backend against plain torch", "",
             "| family | model | setting | project fp16 ms | plain fp16 ms | ratio | project FP8 ms | plain FP8 ms | "
             "ratio | x project | x plain | outputs |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['family']} | {r['model']} | {setting_and_graph(r)} | {r['status']} |" + " |" * 8)
            continue
        b, c = r["baseline"], r["candidate"]
        lines.append(f"| {r['family']} | {r['model']} | {setting_and_graph(r)} | {_ms(r['ms'][f'project {b}'])} | "
                     f"{_ms(r['ms'][f'plain {b}'])} | {r['ratio'][b]['x']:.3f} | {_ms(r['ms'][f'project {c}'])} | "
                     f"{_ms(r['ms'][f'plain {c}'])} | {r['ratio'][c]['x']:.3f} | {r['x']['project']['x']:.3f} | "
                     f"{r['x']['plain']['x']:.3f} | {'ok' if r['check']['ok'] else 'DIFFER'} |")
    return "\n".join(lines) + "\n"


def over_margin(rows: list[dict[str, Any]]) -> list[str]:
    """The rows that fail the issue's bar: failed, outputs differing, or an engine slower than plain by
    more than MARGIN."""
    return [f"{r['model']}/{setting_and_graph(r)}" for r in rows
            if r["status"] != "ok" or not r["check"]["ok"] or max(v["x"] for v in r["ratio"].values()) > MARGIN]
