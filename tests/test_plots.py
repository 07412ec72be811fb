"""The speed-vs-quality plot, drawn by real matplotlib from a committed evidence run's tables."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from PIL import Image

from quantstudy import artifacts, plots

from helpers import ROOT, rewritten

EVIDENCE = ROOT / "results/h200-torch-issue9/results/deberta_v2/tables.json"  # one target, fp16 and fp8
GPT_NEO = ROOT / "results/h200-gpt-neo/gpt_neo/results/gpt_neo/tables.json"  # KL relative to fp16's, five variants
RED = (0xD6, 0x27, 0x28)  # plots.FAILED


def _tables_with(tmp_path, edit=None):
    """The evidence run's tables.json, edited, written as the aggregate rule writes it."""
    return rewritten(EVIDENCE, tmp_path / "tables.json", edit)


def _fail_fp8_quality_at_w256(doc):
    row = next(r for r in doc["quality"] if (r["model"], r["setting"], r["variant"]) == ("deberta-v3-base", "w256", "fp8"))
    keep = {k: row[k] for k in ("target", "model", "setting", "variant", "source", "gpu", "backend", "batch", "window")}
    doc["quality"][doc["quality"].index(row)] = keep | {"status": "failed", "error": "RuntimeError: evaluate crashed"}


def _red_pixels(path) -> int:
    rgb = np.asarray(Image.open(path).convert("RGB"))
    return int(np.all(rgb == RED, axis=-1).sum())


def test_a_failed_measurement_is_named_in_its_panel_and_under_it(tmp_path):
    out = tmp_path / "speed_quality.png"
    pts = plots.plot_file(_tables_with(tmp_path, _fail_fp8_quality_at_w256), out)
    # w128, w256, w512 x fp16, fp8; b32-w256 (no quality run) and the untimed MNLI model are listed, not points
    assert sorted((p.setting, p.variant) for p in pts) == [(s, v) for s in ("w128", "w256", "w512") for v in ("fp16", "fp8")]
    failed = [p for p in pts if p.problem]
    assert len(failed) == 1 and (failed[0].setting, failed[0].variant) == ("w256", "fp8")
    assert failed[0].y is None and failed[0].x is not None  # its speed was measured; it is named, not placed
    assert failed[0].problem == "quality failed: RuntimeError: evaluate crashed"
    ok = next(p for p in pts if (p.setting, p.variant) == ("w128", "fp8"))
    assert ok.y > 0.05 and ok.x_min <= ok.x <= ok.x_max  # features.mean: the decision's per-row quality column
    image = Image.open(out)
    image.load()  # decodes
    # one 4.6 x 4.0 in panel, the legend column, a title of two lines (the condition's name is long) with the
    # run's caveat and the panel's title above it, and three note lines below (the failure, speed only, quality
    # only), at 200 dpi: a 9 pt note is readable when printed
    head = 0.15 + 2 * 0.22 + 0.17 + 0.35
    assert image.format == "PNG" and image.size == (1440, round((head + 4.0 + 0.25 + 0.6 + 3 * 0.2) * 200))
    assert _red_pixels(out) > 200  # its name in the panel and its note line


def test_without_failures_nothing_is_red_and_the_png_is_the_same_each_time(tmp_path):
    tables = _tables_with(tmp_path)
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    pts = plots.plot_file(tables, first)
    plots.plot_file(tables, second)
    assert not any(p.problem for p in pts) and _red_pixels(first) == 0
    assert hashlib.sha256(first.read_bytes()).digest() == hashlib.sha256(second.read_bytes()).digest()
    assert b"Software" not in first.read_bytes()  # no matplotlib version stamp: same bytes on any install


COMMITTED_PLOTS = sorted(ROOT.glob("results/*/*/**/tables.json"))  # test_evidence's evidence runs


@pytest.mark.parametrize("tables", COMMITTED_PLOTS, ids=[str(p.relative_to(ROOT)) for p in COMMITTED_PLOTS])
def test_the_committed_evidence_plots_are_what_the_code_draws(tables, tmp_path):
    """Like their READMEs (test_evidence), the evidence runs' plots are redrawn from their tables. A
    tables.json of an older schema cannot be drawn by this code: it is skipped, saying so, and only
    where no plot was committed beside it (a plot there would go unchecked)."""
    committed = tables.with_name("speed_quality.png")
    version = json.loads(tables.read_text())["schema_version"]
    if version != artifacts.SCHEMA_VERSION:
        assert not committed.exists(), f"{committed.relative_to(ROOT)} is beside a schema {version} table: rerun it"
        pytest.skip(f"{tables.relative_to(ROOT)} is schema version {version}, this code draws {artifacts.SCHEMA_VERSION}")
    out = tmp_path / "speed_quality.png"
    plots.plot_file(tables, out)
    assert out.read_bytes() == committed.read_bytes(), f"redraw it: python -m quantstudy.plots {tables.relative_to(ROOT)}"


def _drawn(fig) -> dict:
    """What the figure's one panel shows, read from its artists: each point (x, y) with its face and edge
    colour and its round-range bar's ends, and the straight lines across the panel by line style."""
    import matplotlib.colors as mcolors

    [ax] = [a for a in fig.axes if a.containers]
    points = {}
    for c in ax.containers:  # an errorbar: (data line, caps, bar collections)
        line, _, (bars,) = c.lines
        [[x0, _], [x1, _]] = bars.get_segments()[0].tolist()
        face = line.get_markerfacecolor()
        points[(float(line.get_xdata()[0]), float(line.get_ydata()[0]))] = {
            "face": face if face == "none" else mcolors.to_hex(face), "edge": mcolors.to_hex(line.get_markeredgecolor()),
            "bar": (x0, x1)}
    lines = {line.get_linestyle(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines
             if line.get_linestyle() in ("--", ":", "-")}
    return {"points": points, "lines": lines}


def _expected_points(doc: dict, scale: float) -> dict:
    """Each evidence row's point as the tables give it: x and its round range from the speed row, y the
    quality row's features.mean (x `scale`); fp8 (the candidate) filled orange, fp16 hollow grey."""
    quality = {(r["model"], r["setting"], r["variant"]): r["features.mean"] for r in doc["quality"]}
    colour = {"fp8": ("#ff7f0e", "#ff7f0e"), "fp16": ("none", "#555555")}
    return {(r["x"], quality[r["model"], r["setting"], r["variant"]] * scale): {
        "face": colour[r["variant"]][0], "edge": colour[r["variant"]][1], "bar": (r["x_min"], r["x_max"])}
        for r in doc["speed"] if (r["model"], r["setting"], r["variant"]) in quality}


def test_the_plot_draws_each_row_at_its_values_with_its_variants_colour_and_the_thresholds():
    """The DeBERTa evidence: six points, (x, features.mean) of fp16 and fp8 at three windows, each with
    its rounds' range; the speed threshold (x >= 1.1) dashed, the quality one (<= 0.01) dotted, x = 1 solid.
    In percent (the condition's `units`), y and the quality threshold are 100 times the tables' values."""
    doc = json.loads(EVIDENCE.read_text())
    fig, _ = plots.figure(doc)
    drawn = _drawn(fig)
    assert len(drawn["points"]) == 6 and drawn["points"] == _expected_points(doc, 1.0)
    assert drawn["lines"] == {"-": ([1.0, 1.0], [0, 1]), "--": ([1.1, 1.1], [0, 1]), ":": ([0, 1], [0.01, 0.01])}

    condition = next(c for c in doc["spec"]["decision"]["conditions"] if c["column"] == "features.mean")
    condition["units"] = "percent"
    drawn = _drawn(plots.figure(doc)[0])
    assert drawn["points"] == _expected_points(doc, 100.0)
    assert drawn["lines"][":"] == ([0, 1], [1.0, 1.0])


def _cielab(colour: str) -> tuple[float, float, float]:
    """sRGB hex to CIELAB (D65), the textbook formulas."""
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
              for c in (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))]
    xyz = [sum(m * c for m, c in zip(row, linear)) / white for row, white in zip(
        ((0.4124, 0.3576, 0.1805), (0.2126, 0.7152, 0.0722), (0.0193, 0.1192, 0.9505)), (0.95047, 1.0, 1.08883))]
    f = [v ** (1 / 3) if v > 0.008856 else 7.787 * v + 16 / 116 for v in xyz]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def test_no_two_plot_colours_look_alike_and_none_fades_on_white():
    """Every variant colour, the failed red and the ship green: each two at least 25 apart in CIELAB
    (tab20's light and dark pairs, 17 apart, read as one colour among GPT-Neo's 14 variants), and none
    above L* 75, where a hollow marker fades into the white."""
    import itertools
    import math

    colours = [*plots.VARIANT_COLOURS.values(), *plots.OTHER_COLOURS, plots.FAILED, plots.SHIP]
    closest = min((math.dist(_cielab(a), _cielab(b)), a, b) for a, b in itertools.combinations(colours, 2))
    assert closest[0] >= 25, closest
    assert max(_cielab(c)[0] for c in colours) <= 75


def test_each_variant_has_its_own_colour_and_the_ship_region_is_shaded(tmp_path):
    """fp8 is orange and fp16 grey in any study, and no two variants of a study share a colour (a hash of
    the name gave three of GPT-Neo's one light blue); the region where both thresholds are met is shaded;
    the x axis spans the reduced-precision points, not fp32's."""
    gpt_neo = json.loads(GPT_NEO.read_text())["spec"]["variants"]
    colours = plots.variant_colours([*gpt_neo, "fp32", "fp8-no-output-dense", "fp8-add-heads", "fp16-hs"])
    assert len(colours) == 14
    assert colours["fp8"] == "#ff7f0e" and colours["fp16"] == "#555555" and colours["fp32"] == "#1f77b4"
    assert len(set(colours.values())) == len(colours) and not {plots.FAILED, plots.SHIP} & set(colours.values())
    out = tmp_path / "speed_quality.png"
    plots.plot_file(_tables_with(tmp_path), out)
    rgb = np.asarray(Image.open(out).convert("RGB")).astype(int)
    shade = np.array([int(plots.SHIP[i:i + 2], 16) for i in (1, 3, 5)]) * 0.12 + 255 * 0.88  # alpha 0.12 on white
    assert (np.abs(rgb - shade).max(axis=-1) <= 3).sum() > 1000
    fp32 = plots.Point("t", "m", "s", None, "fp32", 6.4, 6.0, 6.8, 1.0)
    fp8 = plots.Point("t", "m", "s", None, "fp8", 0.9, 0.8, 1.0, 1.0)
    lo, hi = plots._x_limits([fp32, fp8], [1.15])
    assert lo < 0.8 and 1.15 < hi < 2


def test_the_engine_the_quality_column_is_measured_against_is_listed_not_failed():
    """Deformable DETR's y is the AP drop against the fp16 engine (`quality_against: [fp16]`); fp16
    has no drop against itself, which is by design, not a failure or a non-finite output."""
    tables = ROOT / "results/h200-deformable-detr/run-2026-12-05/results/deformable_detr/tables.json"
    pts, by_design = plots.points(json.loads(tables.read_text()))
    assert pts and not any(p.problem for p in pts) and "fp16" not in {p.variant for p in pts}
    assert by_design["the engine the y axis is measured against, so not on it"] == [
        "h200-eager: fp16, deformable-detr, 800x800", "h200-torch: fp16, deformable-detr, 800x1067",
        "h200-torch: fp16, deformable-detr, 800x800"]
    assert "fp32" not in {p.variant for p in pts}  # the reference's precision: named, not in the ship region
    assert by_design["fp32, the reference's precision (not a candidate), not plotted"] == [
        "h200-torch: deformable-detr, 800x1067, x 0.45", "h200-torch: deformable-detr, 800x800, x 0.44"]


def test_a_missing_quality_value_says_whether_the_outputs_were_non_finite(tmp_path):
    def blank_fp8_at_w256(nonfinite):
        def edit(doc):
            row = next(r for r in doc["quality"]
                       if (r["model"], r["setting"], r["variant"]) == ("deberta-v3-base", "w256", "fp8"))
            row.update({"features.mean": None, "nonfinite": nonfinite})
        return edit

    name = "token feature relative error, mean over held-out texts (every row)"  # the condition's, not its column
    for nonfinite, problem in ((3, f"{name} not finite (3 non-finite outputs)"), (0, f"no finite {name} recorded")):
        pts, _ = plots.points(json.loads(_tables_with(tmp_path, blank_fp8_at_w256(nonfinite)).read_text()))
        assert [p.problem for p in pts if p.problem] == [problem]


def test_a_relative_quality_condition_is_drawn_in_its_own_units():
    """GPT-Neo's bar is KL at most 5 times the fp16 engine's on the same row: y is each variant's KL over
    fp16's (fp8 is 62 times it, far above the bar), not the absolute KL that put every variant under 5."""
    tables = json.loads(GPT_NEO.read_text())
    kl = {(r["variant"]): r["wikitext.kl_mean"] for r in tables["quality"]}  # one row per variant here
    pts, by_design = plots.points(tables)
    fp8 = [p for p in pts if p.variant == "fp8"]
    assert len(fp8) == 2  # prefill and decode
    assert all(p.y == pytest.approx(kl["fp8"] / kl["fp16"]) for p in fp8) and all(p.y > 5 for p in fp8)
    assert "fp16" not in {p.variant for p in pts}
    assert by_design["the engine the y axis is measured against, so not on it"] == ["h200-torch: fp16, gpt-neo-125m, p256-c256"]


def test_every_text_of_each_evidence_plot_is_inside_the_figure():
    """Titles, notes, axis labels and the legend are drawn inside the image: DeBERTa's title and note ran
    past its right edge, DETR's y label past its left."""
    from matplotlib.text import Text

    for tables in (EVIDENCE, GPT_NEO, ROOT / "results/h200-deformable-detr/run-2026-12-05/results/deformable_detr/tables.json",
                   ROOT / "results/h200-torch-repeats/results/fnet/tables.json"):
        doc = json.loads(tables.read_text())
        doc["bound"] = doc.get("bound")
        # a long error and wide y ticks: the worst a note and the y axis meet
        row = next(r for r in doc["quality"] if r["variant"] == doc["spec"]["candidate"])
        row.update(status="failed", error="RuntimeError: " + "a long error message " * 12)
        fig, _ = plots.figure(doc)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        width, height = fig.bbox.width, fig.bbox.height
        for text in fig.findobj(Text):
            if not text.get_visible() or not text.get_text().strip():
                continue
            box = text.get_window_extent(renderer)
            assert box.x0 >= 0 and box.x1 <= width and box.y0 >= 0 and box.y1 <= height, (tables.parent.name, text.get_text())
