"""The speed-vs-quality plot of one study, drawn from its tables.json (matplotlib, Agg, PNG).

Reads tables.json only, like render (no torch, no backend). x is the speed-up measured side by
side (baseline time / variant time, bars: the range over the paired rounds); y is the study's
main quality metric: the column of the first per-row quality condition of its decision rule
(table quality, reduce min or max), in the units the README prints it in, so the plot knows no
family. One panel per target; each variant has one colour in every study, each model and setting a
marker; the candidate is drawn filled, the other variants hollow. The region where the decision's
speed and quality thresholds are both met is shaded. The x axis spans the candidate and the other
reduced-precision variants: an fp32 point beyond it is named on the panel's edge. A measurement
that failed or gave no finite value is not placed on the axes: each panel names its failures in
red, and the lines under the panels give each one's error.

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
from quantstudy.render import PLOT, by_graph, condition_units, shape_label

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
# One colour per variant name in every study: the common ones fixed, any other from the rest of
# the palette by a hash of its name (the same name, the same colour, in any study and run).
VARIANT_COLOURS = {"fp32": "#1f77b4", "fp16": "#555555", "fp8": "#ff7f0e"}
OTHER_COLOURS = ("#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#aec7e8", "#ffbb78")


def variant_colour(name: str) -> str:
    import zlib

    return VARIANT_COLOURS.get(name) or OTHER_COLOURS[zlib.crc32(name.encode()) % len(OTHER_COLOURS)]
NOTE_CHARS = 130  # a note line's length: an error is cut to it, a list wraps


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

    A (target, model, setting) with speed rows and no quality rows is a setting without a quality
    run (`quality: false`), one with quality rows and no speed rows a model that is not timed
    (`timing: false`): by design, so listed, not plotted; so is the engine the quality column is
    measured against (`quality_against`), which has no value in it. Failures are plotted."""
    column = main_quality_condition(tables["spec"]["decision"])["column"]
    reference = measured_against(column, tables["spec"].get("quality_against") or [])
    quality = {(r["target"], r["model"], r["setting"], r["variant"]): r for r in tables["quality"]}
    timed = {(r["target"], r["model"], r["setting"]) for r in tables["speed"]}
    out, speed_only, the_reference = [], [], []
    for (target, model, setting, graph), variants in by_graph(tables["speed"]).items():
        if not any((target, model, setting, v) in quality for v in variants):
            speed_only.append(f"{target}: {model}, {_setting_label(setting, tables['spec']['settings'])}")
            continue
        for variant, s in variants.items():
            q = quality.get((target, model, setting, variant), {"status": "not evaluated", "error": "no quality row"})
            if variant == reference and q.get("status") == "ok" and _finite(q.get(column)) is None:
                the_reference.append(f"{target}: {variant}, {model}, {_setting_label(setting, tables['spec']['settings'])}")
                continue
            x = _finite(s.get("x")) if s.get("status") == "ok" else None
            y = _finite(q.get(column)) if q.get("status") == "ok" else None
            problem = "; ".join(filter(None, (_why(s, "timing", x, "x"), _why(q, "quality", y, column))))
            has_x = x is not None
            out.append(Point(target, model, setting, graph, variant, x, _finite(s.get("x_min")) if has_x else None,
                             _finite(s.get("x_max")) if has_x else None, y, problem))
    quality_only = sorted({f"{t}: {m}, {_setting_label(s, tables['spec']['settings'])}" for t, m, s, _ in quality
                           if (t, m, s) not in timed})
    return out, {"speed only (no quality run at this setting)": sorted(set(speed_only)),
                 "quality only (not timed)": quality_only,
                 "the engine the y axis is measured against, so not on it": sorted(set(the_reference))}


def _setting_label(setting: str, settings: dict[str, Any]) -> str:
    """A setting as the README's tables label it: `512`, `batch 8 x 512`."""
    batch = settings[setting]["batch"]
    return f"{'batch ' + str(batch) + ' x ' if batch > 1 else ''}{shape_label(settings[setting])}"


def _series_label(p: Point, settings: dict[str, Any], several_graphs: bool) -> str:
    label = f"{p.model}, {_setting_label(p.setting, settings)}"
    return f"{label} ({p.graph})" if several_graphs else label


def _rows_label(cond: dict[str, Any], settings: dict[str, Any]) -> str:
    """The rows a condition covers, a setting with its shape (a tiny override may shrink it)."""
    rows = [f"setting {v}: {_setting_label(v, settings)}" if k == "setting" and v in settings else f"{k} {v}"
            for k, v in (cond.get("rows") or {}).items()]
    return f" ({', '.join(rows)})" if rows else ""


def _wrap(text: str) -> str:
    return textwrap.fill(text, 34, subsequent_indent="  ")


def _notes(pts: list[Point], by_design: dict[str, list[str]], settings: dict[str, Any], several: bool) -> list[str]:
    lines = []
    for p in pts:
        if p.problem:
            text = f"x  {p.target}: {_series_label(p, settings, several)}, {p.variant}: {p.problem}"
            lines.append(text if len(text) <= NOTE_CHARS else text[:NOTE_CHARS - 3] + "...")  # whole in the README
    for kind, keys in by_design.items():
        if keys:
            lines += textwrap.wrap(f"{kind}: {'; '.join(keys)}", NOTE_CHARS, subsequent_indent="    ")
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
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    spec, settings = tables["spec"], tables["spec"]["settings"]
    conditions = spec["decision"]["conditions"]
    qcond, scond = main_quality_condition(spec["decision"]), speed_condition(conditions)
    scale = 100.0 if condition_units(qcond).startswith("percent") else 1.0  # the README's units
    unit = " (%)" if scale == 100.0 else ""
    pts, by_design = points(tables)
    targets = [t for t in tables["targets"] if any(p.target == t for p in pts)] or list(tables["targets"])[:1]
    several = len({p.graph for p in pts if p.graph}) > 1
    candidate = spec["candidate"]
    variants = [v for v in spec["variants"] if any(p.variant == v for p in pts)]
    series = list(dict.fromkeys(_series_label(p, settings, several) for p in pts))
    marker = {s: MARKERS[i % len(MARKERS)] for i, s in enumerate(series)}
    x_lo, x_hi = _x_limits(pts, [scond["threshold"]] if scond else [])
    off_axis = {t: [p for p in pts if p.target == t and p.x is not None and p.y is not None and not x_lo <= p.x <= x_hi]
                for t in targets}  # named under the panels, not drawn off scale
    notes = _notes(pts, by_design, settings, several) + [
        line for t, beyond in off_axis.items() if beyond for line in textwrap.wrap(
            f"{t}, beyond the x axis: " + "; ".join(f"{p.variant} {_series_label(p, settings, several)} x {p.x:.2f}"
                                                    for p in beyond), NOTE_CHARS, subsequent_indent="    ")]

    width = PANEL_INCHES[0] * len(targets) + LEGEND_INCHES
    panel_bottom = FOOT_INCHES + NOTE_LINE_INCHES * len(notes) + 0.6  # the x label sits in this margin
    height = HEAD_INCHES + PANEL_INCHES[1] + panel_bottom
    fig = Figure(figsize=(width, height), dpi=DPI)
    fig.subplots_adjust(left=0.95 / width, right=1 - (LEGEND_INCHES + 0.1) / width,
                        bottom=panel_bottom / height, top=1 - HEAD_INCHES / height, wspace=0.08)
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
            c = variant_colour(p.variant)
            ax.errorbar([p.x], [p.y * scale], xerr=err, fmt=marker[_series_label(p, settings, several)],
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
                f"{p.variant} {_series_label(p, settings, several)}" for p in failed),
                transform=ax.transAxes, ha="left", va="top", fontsize=7, color=FAILED)
        tg = tables["targets"][target]
        ax.set_title(f"{target}: {tg['backend']}{' ' + tg['version'] if tg.get('version') else ''} "
                     f"on {tg.get('gpu') or tg.get('device')}", fontsize=10)
        ax.set_xlabel("speed-up x = baseline time / variant time\n(median; bars: range over the rounds)", fontsize=9)
        ax.grid(True, which="major", color="0.92", zorder=0)
        ax.tick_params(labelsize=8)
    axes[0].set_ylabel(_wrap(f"{qcond['name']}{unit}") + f"\n({'higher' if higher_better else 'lower'} is better)",
                       fontsize=9)

    handles = [Line2D([], [], ls="none", marker="o", mfc=variant_colour(v) if v == candidate else "none",
                      mec=variant_colour(v), mew=1.3, label=f"{v} (candidate)" if v == candidate else v) for v in variants]
    handles += [Line2D([], [], ls="none", marker=marker[s], mfc="none", mec="0.2", mew=1.2, label=s) for s in series]
    handles.append(Patch(color=SHIP, alpha=0.25, label="ship region: both thresholds met"))
    handles.append(Line2D([], [], color="0.3", ls=":", lw=1.2, label=_wrap(
        f"{qcond['name']} {qcond['compare']} {q_threshold:g}{unit}{_rows_label(qcond, settings)}")))
    if scond:
        handles.append(Line2D([], [], color="0.3", ls="--", lw=1,
                              label=_wrap(f"x {scond['compare']} {scond['threshold']}{_rows_label(scond, settings)}")))
    handles.append(Line2D([], [], color="0.55", lw=0.8, label="x = 1 (baseline speed)"))
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(1 - LEGEND_INCHES / width, 1 - HEAD_INCHES / height),
               fontsize=8, frameon=False, title="colour: variant\nmarker: model, setting", title_fontsize=8,
               alignment="left")
    run = tables["run"]
    fig.text(0.01, 1 - 0.1 / height, f"{tables['title']}: speed-up against {qcond['name']}", fontsize=11, va="top")
    if run["weights"] != "checkpoint":
        fig.text(0.01, 1 - 0.36 / height, f"{run['weights']} run {run['name']}: these numbers do not describe "
                 "the real checkpoints", fontsize=8, va="top", color="0.3")
    for i, line in enumerate(notes):
        fig.text(0.01, (FOOT_INCHES + NOTE_LINE_INCHES * (len(notes) - 1 - i)) / height, line, fontsize=9,
                 color=FAILED if line.startswith("x  ") else "0.25")
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
    plot_file(args.tables, args.out or Path(args.tables).with_name(PLOT))


if __name__ == "__main__":
    main()
