"""The speed-vs-quality plot of one study, drawn from its tables.json (matplotlib, Agg, PNG).

Reads tables.json only, like render (no torch, no backend). x is the speed-up measured side by
side (baseline time / variant time, bars: the range over the paired rounds); y is the study's
main quality metric: the column of the first per-row quality condition of its decision rule
(table quality, reduce min or max), in the units the README prints it in, over the variant it is
relative to where the condition is relative (so its threshold is in the axis' units); the plot knows
no family. One panel per target; each variant has its own colour (fp32, fp16 and fp8 the same in
every study), each model and setting a marker, its shape named once in the legend; the candidate
is drawn filled, the other variants hollow. The region where the decision's speed and quality
thresholds are both met is shaded. fp32, the precision of the reference the quality is measured
against, is named under the panels with its x, not plotted. A measurement that failed or gave no
finite value is not placed on the axes: each panel names its failures in red, and the lines under
the panels give each one's error. Titles and notes wrap to the figure's width, and the left margin
is what the y label and ticks take.

    python -m quantstudy.plots results/<study>/tables.json [--out PNG]   # default: beside it
"""

from __future__ import annotations

import argparse
import io
import logging
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantstudy.artifacts import atomic_write, read_json
from quantstudy.config import main_quality_condition
from quantstudy.families.base import measured_against
from quantstudy import paths
from quantstudy.render_verdict import condition_units
from quantstudy.render_view import BLACKWELL_REASON, by_graph, not_timed_here, setting_words

log = logging.getLogger("quantstudy")

DPI = 200  # reads when printed: a 9 pt note is 25 pixels high
PANEL_INCHES = (4.6, 4.0)  # one target's panel
LEGEND_INCHES = 2.6  # the legends' column, right of the panels
NOTE_LINE_INCHES = 0.2
HEAD_INCHES = 0.9  # the title lines and the panel titles
FOOT_INCHES = 0.25  # below the x label, before the note
MARKERS = "osD^vP*Xph<>"
FAILED = "#d62728"  # matplotlib's C3: no variant gets it, so red means failed
SHIP = "#2ca02c"  # the shaded region where both thresholds are met
# The common variants keep one colour in every study; the study's other variants take the next
# colours in the order its config lists them, so no two variants of a plot share one (a hash of the
# name gave three GPT-Neo variants one light blue). No red (failed) or green (ship region). Every two
# colours here are at least 25 apart in CIELAB (matplotlib's tab20 pairs, 17 apart, read as one colour
# among GPT-Neo's 14 variants), and none is lighter than L* 75 (a hollow marker shows on white).
VARIANT_COLOURS = {"fp32": "#1f77b4", "fp16": "#555555", "fp8": "#ff7f0e"}
OTHER_COLOURS = ("#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#000080", "#808000", "#000000",
                 "#0000f2", "#f200f2", "#00592d", "#f20079", "#59003c", "#001e59")


def variant_colours(variants: list[str]) -> dict[str, str]:
    """{variant: colour} for a study's variants, in its config's order: each its own colour."""
    others = iter(OTHER_COLOURS)
    colours = {}
    for name in variants:
        colours[name] = VARIANT_COLOURS.get(name) or next(others, None)
        if colours[name] is None:
            raise ValueError(f"more variants than colours ({len(OTHER_COLOURS)} besides {', '.join(VARIANT_COLOURS)})")
    return colours


CHAR_INCHES = 0.6 / 72  # a DejaVu Sans character is at most about 0.6 em wide: wrap a line to fit the figure


def speed_condition(conditions: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The decision's first condition on the speed-up x, drawn as the speed threshold."""
    return next((c for c in conditions if c["table"] == "speed" and c["column"] == "x"), None)


@dataclass(frozen=True)
class Point:
    """One variant at one (target, model, setting, graph), as plotted. x or y is None where the
    measurement failed or is not finite; `problem` then says which and why."""
    target: str
    model: str
    setting: str
    graph: str | None
    variant: str
    x: float | None
    x_min: float | None
    x_max: float | None
    y: float | None
    problem: str = ""


def _finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _why(row: dict[str, Any], what: str, value: float | None, column: str) -> str:
    if row.get("status") != "ok":
        return f"{what} {row.get('status')}: {row.get('error') or 'no error recorded'}"
    if value is not None:
        return ""
    bad = row.get("nonfinite")  # tables.json writes a NaN as null: the count tells which it was
    return f"{column} not finite ({bad} non-finite outputs)" if bad else f"no finite {column} recorded"


def points(tables: dict[str, Any]) -> tuple[list[Point], dict[str, list[str]]]:
    """Every variant measured for both speed and quality, and what was measured for one only.

    y is the main quality condition's column, over the `relative_to` variant's on the same row where
    the condition is relative (GPT-Neo: KL over the fp16 engine's), so that its threshold is in the
    axis' units. A (target, model, setting) with speed rows and no quality rows is a setting without a
    quality run (`quality: false`), one with quality rows and no speed rows a model that is not timed
    (`timing: false`): by design, so listed, not plotted; so is the engine the quality column is
    measured against (`quality_against`, `relative_to`), and fp32, the precision of the reference
    every quality column is measured against, not a candidate; and a variant timed on Blackwell targets only
    (`timed: blackwell`), which has quality rows and no speed rows on the others. Failures are plotted."""
    qcond = main_quality_condition(tables["spec"]["decision"])
    column, over = qcond["column"], qcond.get("relative_to")
    reference = over or measured_against(column, tables["spec"].get("quality_against") or [])
    quality = {(r["target"], r["model"], r["setting"], r["variant"]): r for r in tables["quality"]}
    label = _quality_label(qcond)
    timed = {(r["target"], r["model"], r["setting"]) for r in tables["speed"]}
    out, speed_only, the_reference, full_precision = [], [], [], []
    for (target, model, setting, graph), variants in by_graph(tables["speed"]).items():
        if not any((target, model, setting, v) in quality for v in variants):
            speed_only.append(f"{target}: {model}, {setting}")
            continue
        for variant, s in variants.items():
            q = quality.get((target, model, setting, variant), {"status": "not evaluated", "error": "no quality row"})
            if variant == reference and q.get("status") == "ok" and (over or _finite(q.get(column)) is None):
                the_reference.append(f"{target}: {variant}, {model}, {setting}")
                continue
            x = _finite(s.get("x")) if s.get("status") == "ok" else None
            if variant == "fp32":
                full_precision.append(f"{target}: {model}, {setting}{f' ({graph})' if graph not in (None, 'main') else ''}"
                                      f", x {'-' if x is None else f'{x:.2f}'}")
                continue
            y = _finite(q.get(column)) if q.get("status") == "ok" else None
            if y is not None and over:
                base = quality.get((target, model, setting, over), {})
                y = y / base[column] if base.get("status") == "ok" and _finite(base.get(column)) else None
                if y is None:
                    q = {"status": "not comparable", "error": f"no {over} value on this row to divide by"}
            problem = "; ".join(filter(None, (_why(s, "timing", x, "x"), _why(q, "quality", y, label))))
            has_x = x is not None
            out.append(Point(target, model, setting, graph, variant, x, _finite(s.get("x_min")) if has_x else None,
                             _finite(s.get("x_max")) if has_x else None, y, problem))
    quality_only = sorted({f"{t}: {m}, {s}" for t, m, s, _ in quality if (t, m, s) not in timed})
    untimed = not_timed_here(tables)
    evaluated = {(t, v) for t, _, _, v in quality}
    blackwell_only = [f"{t}: {', '.join(v for v in vs if (t, v) in evaluated)}" for t, vs in untimed.items()
                      if any((t, v) in evaluated for v in vs)]
    return out, {"speed only (no quality run at this setting)": sorted(set(speed_only)),
                 "quality only (not timed)": quality_only,
                 f"quality only, speed needs a Blackwell GPU ({BLACKWELL_REASON})": blackwell_only,
                 "the engine the y axis is measured against, so not on it": sorted(set(the_reference)),
                 "fp32, the reference's precision (not a candidate), not plotted": sorted(set(full_precision))}


def _quality_label(qcond: dict[str, Any]) -> str:
    """The y axis' quantity in words: the condition's name, over the variant it is relative to."""
    return f"{qcond['name']}, over the {qcond['relative_to']} engine's" if qcond.get("relative_to") else qcond["name"]


def _series_label(p: Point, several_graphs: bool) -> str:
    """A model and setting as the README names them: `gpt-neo-125m, p256-c256 (decode)`."""
    label = f"{p.model}, {p.setting}"
    return f"{label} ({p.graph})" if several_graphs else label


def _rows_label(cond: dict[str, Any]) -> str:
    """The rows a condition covers: `(setting w256)`, `(graph decode)`."""
    rows = [f"{k} {v}" for k, v in (cond.get("rows") or {}).items()]
    return f" ({', '.join(rows)})" if rows else ""


def _wrap(text: str) -> str:
    return textwrap.fill(text, 34, subsequent_indent="  ")


def _notes(pts: list[Point], by_design: dict[str, list[str]], several: bool, chars: int) -> list[str]:
    lines = []
    for p in pts:
        if p.problem:
            text = f"x  {p.target}: {_series_label(p, several)}, {p.variant}: {p.problem}"
            lines.append(text if len(text) <= chars else text[:chars - 3] + "...")  # whole in the README
    for kind, keys in by_design.items():
        if keys:
            lines += textwrap.wrap(f"{kind}: {'; '.join(keys)}", chars, subsequent_indent="    ")
    return lines


def _x_limits(pts: list[Point], thresholds: list[float]) -> tuple[float, float]:
    """The x span: every non-fp32 point with its round range, 1 and the speed threshold, with a margin.
    fp32 (x up to 6 against fp16) would crowd the reduced-precision points around 1."""
    xs = [v for p in pts if p.variant != "fp32" and p.x is not None for v in (p.x, p.x_min, p.x_max) if v is not None]
    xs += [1.0, *thresholds]
    lo, hi = min(xs), max(xs)
    pad = 0.08 * (hi - lo or 1.0)
    return lo - pad, hi + pad


def figure(tables: dict[str, Any]):
    """The study's speed-vs-quality figure and the points it shows."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    spec, settings = tables["spec"], tables["spec"]["settings"]
    conditions = spec["decision"]["conditions"]
    qcond, scond = main_quality_condition(spec["decision"]), speed_condition(conditions)
    over = qcond.get("relative_to")
    scale = 100.0 if not over and condition_units(qcond).startswith("percent") else 1.0  # the README's units
    unit = " (%)" if scale == 100.0 else " (times)" if over else ""
    pts, by_design = points(tables)
    targets = [t for t in tables["targets"] if any(p.target == t for p in pts)] or list(tables["targets"])[:1]
    several = len({p.graph for p in pts if p.graph}) > 1
    candidate = spec["candidate"]
    variants = [v for v in spec["variants"] if any(p.variant == v for p in pts)]
    # Every timed variant, drawn or not, as before (a study's colours stay put when a row fails), and any other
    # that is drawn: a quality-only variant (calibration methods, NVFP4 off Blackwell) takes none.
    colour = variant_colours([v for v, s in spec["variants"].items() if v in variants or s.get("timed", True) is True])
    series = {_series_label(p, several): p.setting for p in pts}  # each series' setting
    marker = {s: MARKERS[i % len(MARKERS)] for i, s in enumerate(series)}
    x_lo, x_hi = _x_limits(pts, [scond["threshold"]] if scond else [])
    off_axis = {t: [p for p in pts if p.target == t and p.x is not None and p.y is not None and not x_lo <= p.x <= x_hi]
                for t in targets}  # named under the panels, not drawn off scale

    width = PANEL_INCHES[0] * len(targets) + LEGEND_INCHES
    chars = int((width - 0.2) / (9 * CHAR_INCHES))  # a 9 pt line across the figure
    notes = _notes(pts, by_design, several, chars) + [
        line for t, beyond in off_axis.items() if beyond for line in textwrap.wrap(
            f"{t}, beyond the x axis: " + "; ".join(f"{p.variant} {_series_label(p, several)} x {p.x:.2f}"
                                                    for p in beyond), chars, subsequent_indent="    ")]
    label = _quality_label(qcond)
    title = textwrap.wrap(f"{tables['title']}: speed-up against {label}", int((width - 0.2) / (11 * CHAR_INCHES)))
    run = tables["run"]
    caveat = textwrap.wrap(f"{run['weights']} run {run['name']}: these numbers do not describe the real checkpoints",
                           int((width - 0.2) / (8 * CHAR_INCHES))) if run["weights"] != "checkpoint" else []
    head = 0.15 + 0.22 * len(title) + 0.17 * len(caveat) + HEAD_INCHES - 0.55  # the panel titles below them
    panel_bottom = FOOT_INCHES + NOTE_LINE_INCHES * len(notes) + 0.6  # the x label sits in this margin
    height = head + PANEL_INCHES[1] + panel_bottom
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)  # to measure the drawn labels
    axes = fig.subplots(1, len(targets), sharey=True, squeeze=False)[0]

    ys = [p.y * scale for p in pts if p.y is not None]
    log_y = bool(ys) and min(ys) > 0 and max(ys) / min(ys) >= 100  # errors spanning decades (fp32 to fp8)
    higher_better = qcond["compare"] in (">=", ">")
    q_threshold = qcond["threshold"] * scale
    for ax, target in zip(axes, targets):
        mine = [p for p in pts if p.target == target]
        for p in mine:
            if p.x is None or p.y is None or p in off_axis[target]:
                continue
            # clamped: an x outside its rounds' range (a median of jobs, or an edited file) still plots
            err = ([[max(0.0, p.x - p.x_min)], [max(0.0, p.x_max - p.x)]]
                   if p.x_min is not None and p.x_max is not None else None)
            c = colour[p.variant]
            ax.errorbar([p.x], [p.y * scale], xerr=err, fmt=marker[_series_label(p, several)],
                        ms=8 if p.variant == candidate else 6, mfc=c if p.variant == candidate else "none", mec=c,
                        ecolor=c, elinewidth=0.8, capsize=2, mew=1.3, zorder=4 if p.variant == candidate else 3)
        ax.set_xlim(x_lo, x_hi)
        if log_y:
            ax.set_yscale("log")
        ax.margins(y=0.12)
        ax.axvline(1.0, color="0.55", lw=0.8, zorder=1)
        if scond:
            ax.axvline(scond["threshold"], color="0.3", ls="--", lw=1, zorder=2)
        ax.axhline(q_threshold, color="0.3", ls=":", lw=1.2, zorder=2)
        # The ship region, where a point meets both thresholds: shaded under the points.
        y_lo, y_hi = ax.get_ylim()
        if scale == 100.0:  # a percentage: no axis beyond 0% or 100%
            y_lo, y_hi = max(y_lo, 0.0), min(y_hi, 100.0 + 0.02 * (y_hi - y_lo))
        x_from = scond["threshold"] if scond else x_lo
        ax.fill_between([x_from, x_hi], *((q_threshold, y_hi) if higher_better else (y_lo, q_threshold)),
                        color=SHIP, alpha=0.12, lw=0, zorder=0)
        ax.set_ylim(y_lo, y_hi)
        failed = [p for p in mine if p.problem]
        if failed:  # failures keep no place on the axes: named in the panel, their errors below
            ax.text(0.02, 0.98, "failed, not plotted:\n" + "\n".join(
                f"{p.variant} {_series_label(p, several)}" for p in failed),
                transform=ax.transAxes, ha="left", va="top", fontsize=7, color=FAILED)
        tg = tables["targets"][target]
        ax.set_title(f"{target}: {tg['backend']}{' ' + tg['version'] if tg.get('version') else ''} "
                     f"on {tg.get('gpu') or tg.get('device')}", fontsize=10)
        ax.set_xlabel("speed-up x = baseline time / variant time\n(median; bars: range over the rounds)", fontsize=9)
        ax.grid(True, which="major", color="0.92", zorder=0)
        ax.tick_params(labelsize=8)
    axes[0].set_ylabel(_wrap(f"{label}{unit}") + f"\n({'higher' if higher_better else 'lower'} is better)",
                       fontsize=9)

    handles = [Line2D([], [], ls="none", marker="o", mfc=colour[v] if v == candidate else "none",
                      mec=colour[v], mew=1.3, label=f"{v} (candidate)" if v == candidate else v) for v in variants]
    # Each setting's shape, once: beside its name in the legend.
    handles += [Line2D([], [], ls="none", marker=marker[s], mfc="none", mec="0.2", mew=1.2,
                       label=_wrap(f"{s}: {setting_words(settings[setting])}")) for s, setting in series.items()]
    handles.append(Patch(color=SHIP, alpha=0.25, label="ship region: both thresholds met"))
    handles.append(Line2D([], [], color="0.3", ls=":", lw=1.2, label=_wrap(
        f"{qcond['name']} {qcond['compare']} {q_threshold:g}{' times the ' + over + ' engine' + chr(39) + 's' if over else unit}"
        f"{_rows_label(qcond)}")))
    if scond:
        handles.append(Line2D([], [], color="0.3", ls="--", lw=1,
                              label=_wrap(f"x {scond['compare']} {scond['threshold']}{_rows_label(scond)}")))
    handles.append(Line2D([], [], color="0.55", lw=0.8, label="x = 1 (baseline speed)"))
    legend = fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(1 - LEGEND_INCHES / width, 1 - head / height),
                        fontsize=8, frameon=False, title="colour: variant\nmarker: model, setting", title_fontsize=8,
                        alignment="left")
    for i, line in enumerate(title):
        fig.text(0.01, 1 - (0.1 + 0.22 * i) / height, line, fontsize=11, va="top")
    for i, line in enumerate(caveat):
        fig.text(0.01, 1 - (0.14 + 0.22 * len(title) + 0.17 * i) / height, line, fontsize=8, va="top", color="0.3")
    for i, line in enumerate(notes):
        fig.text(0.01, (FOOT_INCHES + NOTE_LINE_INCHES * (len(notes) - 1 - i)) / height, line, fontsize=9,
                 color=FAILED if line.startswith("x  ") else "0.25")
    # The y label and its ticks inside the figure: the left margin is what they take (DETR's wide ticks).
    fig.subplots_adjust(left=0.95 / width, right=1 - (LEGEND_INCHES + 0.1) / width, bottom=panel_bottom / height,
                        top=1 - head / height, wspace=0.08)
    renderer = fig.canvas.get_renderer()
    left = axes[0].get_tightbbox(renderer).x0 / DPI  # inches from the figure's left edge
    if left < 0.08:
        fig.subplots_adjust(left=(0.95 + 0.08 - left) / width)
    legend.set_in_layout(False)
    return fig, pts


def png(fig) -> bytes:
    """The figure as PNG bytes, the same bytes for the same tables (no software or time stamp)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def plot_file(tables_json: str | Path, out: str | Path) -> list[Point]:
    """Draw a study's tables.json to `out` (PNG, written atomically); the points it shows."""
    tables = read_json(tables_json, "tables")
    fig, pts = figure(tables)
    atomic_write(out, png(fig))
    log.info("%d points, %d of them failed or not finite", len(pts), sum(bool(p.problem) for p in pts))
    return pts


def main() -> None:
    parser = argparse.ArgumentParser(description="Draw a study's speed-vs-quality plot from its tables.json.")
    parser.add_argument("tables", help="results/<study>/tables.json")
    parser.add_argument("--out", help="the PNG to write (default: speed_quality.png beside tables.json)")
    args = parser.parse_args()
    plot_file(args.tables, args.out or paths.beside(args.tables, paths.PLOT))


if __name__ == "__main__":
    main()
