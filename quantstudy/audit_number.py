"""One number's chain: the cells of tables.json that a README shows as a number (`find_number`,
`shown_hits`), and how a derived one is made from the cells and files it comes from. The audit's
command (`python -m quantstudy.audit chain README.md NUMBER`) prints them with the chain behind each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TABLES = ("speed", "quality", "builds", "records", "kernels", "references", "calibration", "samples", "published")


def find_number(tables: dict[str, Any], text: str) -> list[dict[str, Any]]:
    """The table cells of tables.json that the README shows as `text`, in any of the number formats
    the templates use: {table, row label, column, value, source}. A row's `sources` name the file of
    a column that is not the row's (a published number: its config/published file)."""
    from quantstudy import render_formats

    # render_formats.like prints a published number's neighbours in its notation: fixed or e, any precision.
    formats = (render_formats.ms, render_formats.times, render_formats.pct, render_formats.sci, render_formats.num,
               render_formats.count,
               *(lambda v, d=d: f"{v:.{d}f}" for d in range(7)), *(lambda v, d=d: f"{v:.{d}e}" for d in range(4)),
               *(lambda v, d=d: f"{100 * v:.{d}f}%" for d in range(3)))  # render_formats.pct_of: a sample's precision
    text = text.strip().lstrip("+")  # a difference is shown signed
    want = text.rstrip("x%").replace(",", "") if not text.endswith("%") else text
    hits = []
    for table in TABLES:
        for row in tables.get(table) or []:
            for column, value in row.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                shown = set()
                for f in formats:
                    try:
                        shown.add(f(value).replace(",", ""))
                    except (TypeError, ValueError):
                        pass
                if want in shown:
                    label = row_label(row)
                    if row.get("published_source"):
                        label += " (published as {row} / {column})".format(**row["published_source"])
                    how, others = arithmetic(tables[table], row, column)
                    hits.append({"table": table, "row": label, "column": column, "value": value,
                                 "source": (row.get("sources") or {}).get(column, row.get("source")),
                                 "also_from": others, "where": (table, tables[table].index(row), column),
                                 "arithmetic": how})
    for i, c in enumerate((tables.get("decision") or {}).get("conditions", [])):
        observed = c.get("observed")
        for end, value in (observed.items() if isinstance(observed, dict) else [("value", observed)]):
            if end == "n" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if want in {f(value).replace(",", "") for f in formats if _formats(f, value)}:
                how, sources = _observed_arithmetic(tables, c, end, value)
                hits.append({"table": "decision", "row": f"condition {c['name']!r}", "column": f"observed {end}",
                             "value": value, "source": None, "sources_of": sources,
                             # a scalar observed value (a count) is the condition's own key, not a dict's
                             "where": ("decision", "conditions", i, "observed", *([end] if isinstance(observed, dict) else [])),
                             "arithmetic": how})
    return hits


def _formats(f, value) -> bool:
    try:
        f(value)
        return True
    except (TypeError, ValueError):
        return False


def row_label(row: dict[str, Any]) -> str:
    """A row as the README's tables name it: target | model, `setting` | `variant` (and its graph)."""
    head = " | ".join(x for x in (row.get("target"), ", ".join(
        [row["model"]] * bool(row.get("model")) + [f"`{row['setting']}`"] * bool(row.get("setting")))) if x)
    graph = row.get("graph") if row.get("graph") not in (None, "", "main") else None
    return head + (f" | `{row['variant']}`" if row.get("variant") else "") + (f" | {graph}" if graph else "")


# Columns aggregate derives from two others of the same row: x is the baseline's time over the variant's.
DERIVED = {"x": ("baseline_ms", "variant_ms")}


def arithmetic(rows: list[dict[str, Any]], row: dict[str, Any], column: str) -> tuple[str | None, list[str]]:
    """How a derived cell is made, with the values it is made of, and the other files they come from: x
    from its row's times (`x = baseline_ms / variant_ms = 2.767 / 5.682 = 0.487`); a ratio to another
    variant (`wikitext.kl_mean / fp16`, decision.with_ratio) from that variant's row on the same key. A
    measured cell: (None, [])."""
    from quantstudy import render_formats

    if column.endswith((".jobs_min", ".jobs_max")) and len(row.get("quality_sources") or []) > 1:
        # A metric's range across evaluation jobs (aggregate_rows.across_evaluations): every job's file, and
        # where each job opened its own build (`evaluation.rebuild`), that build.
        metric, _, end = column.rpartition(".jobs_")
        files, builds = row["quality_sources"], row.get("quality_builds")
        opened = (" each on its own build (" + ", ".join(builds) + "): build to build" if builds
                  else " of one engine")
        return (f"{column} = the {'least' if end == 'min' else 'most'} {metric} of {len(files)} evaluation jobs,"
                f"{opened}", [f for f in files if f != row.get("source")])
    if column in DERIVED and all(row.get(c) is not None for c in DERIVED[column]):
        a, b = DERIVED[column]
        return f"{column} = {a} / {b} = {render_formats.ms(row[a])} / {render_formats.ms(row[b])} = {row[a] / row[b]:.3f}", []
    base, _, other = column.partition(" / ")
    theirs = next((r for r in rows if other and r.get("variant") == other and r.get("status", "ok") == "ok"
                   and all(r.get(k) == row.get(k) for k in ("target", "model", "setting", "graph"))), None)
    if theirs is None or row.get(base) is None or not theirs.get(base):
        return None, []
    return (f"{column} = {render_formats.sci(row[base])} / {other}'s {render_formats.sci(theirs[base])} ({theirs['source']}) = "
            f"{row[base] / theirs[base]:.4g}", [theirs["source"]])


def _observed_arithmetic(tables: dict[str, Any], c: dict[str, Any], end: str, value: float) -> tuple[str, list[str]]:
    """Where a decision's observed value comes from: the rows of its table whose value of its column it
    is (the min or max over the condition's rows), each with its file; a column relative to another
    variant (`kl / fp16`) with its division."""
    from quantstudy import render_formats

    declared = {d["name"]: d for d in (tables.get("spec") or {}).get("decision", {}).get("conditions", [])}
    c = {**declared.get(c["name"], {}), **c}  # a tables.json before decide() copied its table
    column, rows = c["column"], tables.get(c.get("table") or "", [])
    over = {k: v for k, v in (c.get("rows") or {}).items()}
    candidate = (tables.get("decision") or {}).get("candidate") or (tables.get("spec") or {}).get("candidate")
    mine = [r for r in rows if r.get("variant") == candidate and r.get("status", "ok") == "ok"
            and all(r.get(k) == v for k, v in over.items())]
    found, sources = [], []
    for r in mine:
        if " / " in column:
            base_col, other = column.split(" / ", 1)
            theirs = next((o for o in rows if o.get("variant") == other and o.get("status", "ok") == "ok"
                           and all(o.get(k) == r.get(k) for k in ("target", "model", "setting", "graph"))), None)
            if theirs is None or not theirs.get(base_col) or r.get(base_col) is None:
                continue
            got = r[base_col] / theirs[base_col]
            how = (f"{base_col} {render_formats.sci(r[base_col])} ({r['source']}) / {other}'s {render_formats.sci(theirs[base_col])} "
                   f"({theirs['source']}) = {got:.4g}")
            pair = [r["source"], theirs["source"]]
        elif isinstance(r.get(column), (int, float)):
            got, how, pair = r[column], f"{column} = {r[column]!r} ({r['source']})", [r["source"]]
        else:
            continue
        if abs(got - value) <= 1e-9 * max(1.0, abs(value)):
            found.append(f"{row_label(r)}: {how}")
            sources += pair
    reduce = {"min": "smallest", "max": "largest"}.get(end, end)
    return (f"the {reduce} of `{column}` over the condition's {len(mine)} rows of the {c.get('table')} table"
            + (": " + "; ".join(found) if found else ""), sources)


def shown_hits(tables: dict[str, Any], readme: str | Path, text: str, hits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The hits the README shows: a cell is shown as `text` where changing its value, and only it, changes
    how many times the page (rendered from tables.json as the README was) prints `text`. A cell that
    merely formats to the same digits (a round range the page never prints) is not."""
    import copy
    import re

    from quantstudy import render

    pattern = re.compile(r"(?<![\d.])" + re.escape(text.strip().lstrip("+")) + r"(?![\d])")
    before = len(pattern.findall(render.render_section(tables, readme)))

    def changes_the_page(group: list[dict[str, Any]]) -> bool:
        changed = copy.deepcopy(tables)
        for h in group:
            *path, last = h["where"]
            holder = changed
            for key in path:
                holder = holder[key]
            value = holder[last]
            holder[last] = value + 7 if isinstance(value, int) else value * 1.37 + 0.0137
        try:
            return len(pattern.findall(render.render_section(changed, readme))) < before
        except Exception:  # noqa: BLE001 - a cell the page cannot render without is one it uses
            return True

    shown = [h for h in hits if changes_the_page([h])]
    # Cells printed together as one number (a range whose two ends are equal): each alone changes nothing.
    # Of such a group, those the page needs: without changing one of them, the rest no longer change it.
    for value in dict.fromkeys(h["value"] for h in hits):
        group = [h for h in hits if h["value"] == value and h not in shown]
        if len(group) > 1 and not any(h["value"] == value for h in shown) and changes_the_page(group):
            needed = [h for h in group if not changes_the_page([g for g in group if g is not h])]
            shown += needed or group
    return [h for h in hits if h in shown]
