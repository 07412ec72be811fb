"""Splicing a rendered section into an existing README, and the number formats."""

from __future__ import annotations

import re

import pytest

from quantstudy import render, render_formats, render_view


def test_splice_replaces_only_the_marked_section():
    old = "# Family\n\nintro\n\n<!-- quantstudy:begin fnet -->\nold section\n<!-- quantstudy:end fnet -->\n\n## Other\nkept\n"
    new_section = "<!-- quantstudy:begin fnet -->\nnew section\n<!-- quantstudy:end fnet -->\n"
    out = render.splice(old, new_section, "fnet")
    assert out == "# Family\n\nintro\n\n<!-- quantstudy:begin fnet -->\nnew section\n<!-- quantstudy:end fnet -->\n\n## Other\nkept\n"
    assert render.splice(out, new_section, "fnet") == out  # idempotent


def test_splice_appends_when_there_is_no_section_and_leaves_other_studies():
    other = "<!-- quantstudy:begin gpt_neo -->\nx\n<!-- quantstudy:end gpt_neo -->\n"
    section = "<!-- quantstudy:begin fnet -->\ny\n<!-- quantstudy:end fnet -->\n"
    out = render.splice("# README\n\n" + other, section, "fnet")
    assert out.startswith("# README\n\n" + other) and out.endswith(section)


def test_ranges_and_formats():
    assert render_formats.span({"min": 1.031, "max": 1.109}, render_formats.times, "x") == "1.03x to 1.11x"
    assert render_formats.span({"min": 0.5, "max": 0.5}, render_formats.pct) == "50.00%"
    assert render_formats.span(None) == "not measured"
    assert render_formats.sci(5.9e-06) == "5.9e-06" and render_formats.sci(0.0095) == "0.0095"
    assert render_formats.value_range([1.0, None, float("nan"), 3.0]) == {"min": 1.0, "max": 3.0, "n": 2}


def test_a_relative_condition_renders_its_factor_and_the_variant():
    """A decision condition relative to another variant shows its threshold as a factor of that
    variant's value, beside the absolute ones (on the committed XCiT evidence's tables)."""
    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-build-once/xcit/results/timm_xcit/tables.json", "tables")
    tables["decision"]["conditions"].append(
        {"name": "KL at most 10 x fp16's", "column": "kl / fp16", "reduce": "max", "compare": "<=",
         "observed": {"min": 3.5, "max": 12.25, "n": 2}, "threshold": 10, "relative_to": "fp16", "pass": False,
         "note": ""})
    rows = [line for line in render.render_section(tables).splitlines() if line.startswith("- **not met: KL at most")]
    assert len(rows) == 1
    assert "`fp8`: 3.5 to 12.2 times. Needs at most 10.0 times the `fp16` engine's." in rows[0]


def test_a_failed_gpt_neo_variant_shows_its_error_text_in_the_variants_table():
    """The committed GPT-Neo evidence with one variant's build failed as TensorRT 11.4 fails FP8 out_proj
    (its timing and evaluation failed with it): that variant's row in the variants table names the
    failed file and the whole error; the other variants keep their numbers, and the speed-bar list
    is computed from the rows that were measured."""
    from quantstudy import aggregate_rows, artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-gpt-neo/gpt_neo/results/gpt_neo/tables.json", "tables")
    error = aggregate_rows.exception_text(
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in build\n    plan = builder.build()\n"
        "RuntimeError: TensorRT could not build the engine:\n"
        "Input 0's element type (fp8_e4m3) differs from input 1's element type (half)\n")
    for table in ("builds", "speed", "quality"):
        for row in tables[table]:
            if row["variant"] == "fp8-c_fc":
                row.update(status="failed", error=error if table == "builds" else "its build failed")
    lines = render.render_section(tables).splitlines()
    failed = [line for line in lines if line.startswith("| h200-torch | gpt-neo-125m, `p256-c256` | `fp8-c_fc` |")]
    assert len(failed) == 1
    assert ("failed: build.json: RuntimeError: TensorRT could not build the engine: Input 0's element type "
            "(fp8_e4m3) differs from input 1's element type (half)") in failed[0]
    assert failed[0].count("|") == 13  # the row keeps the table's 12 columns
    measured = [line for line in lines if line.startswith("| h200-torch | gpt-neo-125m, `p256-c256` | `fp8` |")]
    assert "failed" not in measured[0] and "62.0" in measured[0]


def test_detr_counts_render_as_counts_beside_failed_rows():
    """The committed Deformable DETR H200 evidence, whose eager target's variants all failed: a column
    with a failed row holds floats in tables.json, and the per-part table still prints the measured
    rows' job and image counts as counts, and each failed row's error."""
    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-deformable-detr/deformable_detr/results/deformable_detr/tables.json",
                                 "tables")
    lines = render.render_section(tables).splitlines()
    fp16 = [line for line in lines if line.startswith("| h200-torch | deformable-detr, `800x800` | `fp16` |")]
    assert len(fp16) == 1 and "(2 jobs)" in fp16[0] and fp16[0].endswith("| 0 / 64 |")
    eager = [line for line in lines if line.startswith("| h200-eager | deformable-detr, `800x800` | `fp8-add-heads` |")]
    assert len(eager) == 1 and "failed: RuntimeError: Cannot copy between CPU and CUDA tensors" in eager[0]


def test_xcit_counts_render_as_counts_beside_failed_rows():
    """The committed XCiT questions evidence (H100), whose four calibration variants failed: their rows
    make the agreement counts floats in tables.json, and the quality table still prints counts."""
    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-xcit-questions/timm_xcit/results/timm_xcit/tables.json", "tables")
    assert any(r["status"] == "failed" for r in tables["quality"])
    section = render.render_section(tables)
    rows = [line for line in section.splitlines() if line.startswith("| xcit-nano, `b1` | h200-torch | fp8-per-channel |")]
    assert len(rows) == 2, rows  # its quality row and its non-finite scan row
    assert "(8 of 500 differ)" in rows[0] and "(40 of 1,500 differ)" in rows[0], rows[0]
    assert rows[1].endswith("| 0 / 500 | 0 / 1,500 | 0 / 26 | 0 |"), rows[1]
    assert not re.search(r"\d\.0 (of|/) \d", section)


def test_xcit_quality_table_gives_kl_where_the_run_measured_it():
    """The XCiT questions evidence predates the KL column and renders none; the same tables with a KL per
    set give it in each agreement cell and say what it is above the table."""
    import copy

    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-xcit-questions/timm_xcit/results/timm_xcit/tables.json", "tables")
    assert "KL" not in render.render_section(tables)
    with_kl = copy.deepcopy(tables)
    for r in with_kl["quality"]:
        if r["status"] == "ok":
            r["heldout.kl_mean"], r["extra_heldout.kl_mean"] = (1e-06, 2e-06) if r["variant"] == "fp16" else (0.000125, 0.0025)
    section = render.render_section(with_kl)
    row = next(line for line in section.splitlines() if line.startswith("| xcit-nano, `b1` | h200-torch | fp8-per-channel |"))
    assert "(8 of 500 differ; KL 1.3e-04)" in row and "(40 of 1,500 differ; KL 0.0025)" in row, row
    assert "KL: the mean over the set's images of KL(PyTorch fp32 || engine)" in section
    assert "| KL from PyTorch fp32, mean, held-out (500 images) | 1.0e-06 | 1.3e-04 |" in section  # fp16, fp8


def test_a_quality_only_run_names_the_baseline_it_evaluated():
    """The committed GPT-Neo questions evidence times no engine: the verdict's first sentence still names
    the baseline its quality conditions compare with, not an empty list."""
    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-gpt-neo-questions/gpt_neo/results/gpt_neo/tables.json", "tables")
    assert tables["speed"] == []
    first = next(line for line in render.render_section(tables).splitlines() if line.startswith("**Do not ship"))
    assert first.endswith("measured on NVIDIA H100 80GB HBM3 against fp16:"), first


def test_a_condition_on_a_setting_names_it_with_this_runs_values():
    """A decision condition limited to a setting names it, and the settings line under the verdict gives
    that setting's own values (the tiny run's w256 is a 64-token window), never a typed label; a condition
    on no setting shows its name alone."""
    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-build-once/xcit/results/timm_xcit/tables.json", "tables")
    tables["spec"]["settings"]["w256"] = {"window": 64, "batch": 1}
    tables["decision"]["conditions"] = [
        {"name": "speed-up at the manifest window (every row)", "table": "speed", "column": "x", "reduce": "min",
         "compare": ">=",
         "observed": {"min": 0.9, "max": 1.2, "n": 2}, "threshold": 1.1, "pass": False, "note": "",
         "rows": {"setting": "w256"}},
        {"name": "non-finite outputs", "column": "nonfinite", "reduce": "sum", "compare": "==", "observed": 0,
         "threshold": 0, "pass": True, "note": "", "rows": {}}]
    rows = [line for line in render.render_section(tables).splitlines() if line.startswith("- **")]
    assert rows[0].startswith("- **not met: speed-up at the manifest window (every row) (setting `w256`).** "
                              "`fp8`: 0.90x to 1.20x")
    settings = next(x for x in render.render_section(tables).splitlines() if x.startswith("Settings, "))
    assert "`w256`: window 64, batch 1" in settings
    assert "Needs at least 1.10x." in rows[0]
    assert rows[1].startswith("- **met: non-finite outputs.** `fp8`: 0. Needs exactly 0.")


def test_the_verdict_gives_each_conditions_baseline_samples_and_threshold_basis():
    """FNet's case: top-1 agreement >= 0.99 fails fp8 and the baseline as well. The verdict line says so,
    with each one's own values, the row and sample counts, the units the tables use, and where the
    threshold comes from. Whether the baseline misses the bar is the baseline's own pass: a baseline
    that misses a bar the candidate meets is said to, one that meets a bar the candidate misses is not."""
    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-build-once/xcit/results/timm_xcit/tables.json", "tables")
    heldout = next(s for s in tables["samples"] if s["name"] == "heldout")
    basis = "the write-up's: 'above 99%'"
    tables["decision"]["conditions"] = [
        {"name": "top-1 agreement (every row)", "table": "quality", "column": "heldout.top1_agreement",
         "reduce": "min", "compare": ">=", "observed": {"min": 0.9889, "max": 0.9968, "n": 6}, "n": 6,
         "threshold": 0.99, "pass": False, "note": "", "rows": {}, "units": "percent", "samples": ["heldout"],
         "basis": basis, "baseline": {"variants": ["fp16"], "observed": {"min": 0.9871, "max": 0.9912, "n": 6},
                                      "n": 6, "pass": False}},
        {"name": "non-finite outputs", "table": "quality", "column": "nonfinite", "reduce": "sum", "compare": "==",
         "observed": 0, "n": 6, "threshold": 0, "pass": True, "note": "", "rows": {}, "basis": "set by this study",
         "baseline": {"variants": ["fp16"], "observed": 3, "n": 6, "pass": False}},
        {"name": "cosine (every row)", "table": "quality", "column": "heldout.cosine_min", "reduce": "min",
         "compare": ">=", "observed": {"min": 0.9962, "max": 0.9981, "n": 6}, "n": 6, "threshold": 0.997,
         "pass": False, "note": "", "rows": {}, "units": "percent", "basis": "set by this study",
         "baseline": {"variants": ["fp16"], "observed": {"min": 0.9991, "max": 0.9997, "n": 6}, "n": 6, "pass": True}}]
    section = render.render_section(tables)
    top1, nonfinite, cosine = [line for line in section.splitlines() if line.startswith("- **")]
    assert top1 == (f"- **not met: top-1 agreement (every row).** `fp8`: 98.89% to 99.68% over 6 rows of "
                    f"{heldout['count']:,} images (heldout); the baseline (`fp16`) on the same rule: 98.71% to 99.12%, "
                    f"**which misses the bar as well**. Needs at least 99.00% on every row. *Threshold: {basis}.*")
    assert "`fp8`: 0 over 6 rows; the baseline (`fp16`) on the same rule: 3, **which misses the bar as well**." \
        in nonfinite
    assert "the baseline (`fp16`) on the same rule: 99.91% to 99.97%. Needs at least 99.70%" in cosine
    assert "misses the bar" not in cosine
    assert "it fails 2 of the 3 conditions" in section


def test_a_condition_no_row_measured_says_not_measured_without_rows_or_rounds():
    """A quality-only run (no engine timed): the speed condition reads "not measured", not "not measured
    over 0 rows, each the median of 21 rounds", which describes timings that never ran."""
    from quantstudy import artifacts

    from helpers import ROOT

    untimed = render.render_section(artifacts.read_json(
        ROOT / "results/h200-xcit-questions/timm_xcit/results/timm_xcit/tables.json", "tables"))
    timed = render.render_section(artifacts.read_json(
        ROOT / "results/h200-build-once/xcit/results/timm_xcit/tables.json", "tables"))
    speed = next(line for line in untimed.splitlines() if line.startswith("- **not met: speedup"))
    assert "`fp8`: not measured. Needs at least 1.10x (no rows)." in speed
    assert "`fp8`: 0.96x to 0.97x, each the median of 21 rounds of 50 calls. Needs" in timed
    # Its speed section: a sentence, not a table of headers only.
    header = "| Model, setting | Target | Baseline |"
    assert "### Speed\n\nNo engine was timed in this run" in untimed
    assert header not in untimed and header in timed


def test_a_percentage_carries_the_precision_its_samples_support():
    assert render_formats.pct_of(1.0, 16) == "100%" and render_formats.pct_of(15 / 16, 16) == "94%"
    assert render_formats.pct_of(0.9975, 400) == "99.8%" and render_formats.pct_of(0.9985, 2000) == "99.85%"
    assert render_formats.pct_of(0.5, None) == "50.00%"
    assert render_formats.mib(310_000) == "0.296" and render_formats.mib(71_000_000) == "67.7" and render_formats.pct0(-0.2749) == "-27%"


def test_each_setting_has_one_label_and_its_shape_once():
    """The tiny override shrinks DeBERTa's settings (w256 is a 64-token window there, b32-w256 batch 8 x 64):
    every table, link, verdict and the audit's chain name a setting by its name, and the settings line under
    the verdict gives its shape once, from this run's values; no label made of values ("64", "batch 8 x 64")
    stands for a setting anywhere else, and no row says 256 tokens."""
    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-torch-issue9/results/deberta_v2/tables.json", "tables")
    shrunk = {"w128": (1, 32), "w256": (1, 64), "w512": (1, 128), "b32-w256": (8, 64)}
    for name, (batch, window) in shrunk.items():
        if name in tables["spec"]["settings"]:
            tables["spec"]["settings"][name].update(batch=batch, window=window)
    section = render.render_section(tables)
    [settings] = [line for line in section.splitlines() if line.startswith("Settings, ")]
    for name, (batch, window) in shrunk.items():
        assert section.count(f"window {window}, batch {batch}") == 1 and f"`{name}`: window {window}, batch {batch}" in settings
    rows = [line for line in section.splitlines() if line.startswith("| deberta-v3-base")]
    assert rows and all(re.match(r"\| deberta-v3-base(-mnli)?, `(w128|w256|w512|b32-w256)` \|", line) for line in rows), rows
    assert "batch 8 x" not in section and "deberta-v3-base, 64 |" not in section and "deberta-v3-base, 256 |" not in section


EVIDENCE_BY_FAMILY = {
    "fnet": "results/h200-torch-repeats/results/fnet/tables.json",
    "deberta_v2": "results/h200-torch-issue9/results/deberta_v2/tables.json",
    "timm_xcit": "results/h200-build-once/xcit/results/timm_xcit/tables.json",
    "gpt_neo": "results/h200-gpt-neo/gpt_neo/results/gpt_neo/tables.json",
    "deformable_detr": "results/h200-deformable-detr/deformable_detr/results/deformable_detr/tables.json",
}


@pytest.mark.parametrize("family", sorted(EVIDENCE_BY_FAMILY))
def test_failed_rows_keep_every_table_whole(family):
    """Each family's committed evidence with its candidate's first speed, quality and kernel rows failed:
    every table row of the README still has its header's cells, and the error text is shown."""
    from quantstudy import artifacts
    from quantstudy.devtools import malformed_tables

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / EVIDENCE_BY_FAMILY[family], "tables")
    assert malformed_tables(render.render_section(tables)) == []
    cand = tables["spec"]["candidate"]
    for table in ("speed", "quality", "kernels"):
        row = next(r for r in tables[table] if r["variant"] == cand)
        keep = {k: row[k] for k in ("target", "model", "setting", "variant", "source", "gpu", "backend", "batch")
                if k in row}
        tables[table][tables[table].index(row)] = keep | {"status": "failed", "error": "RuntimeError: <boom> | x"}
    section = render.render_section(tables)
    assert malformed_tables(section) == []
    assert "RuntimeError: &lt;boom&gt; \\| x" in section


def test_a_threshold_is_printed_as_configured_beside_values_at_their_samples_precision():
    """MNLI agreement on 24 pairs prints as 100% (one pair is 4 points), but its threshold 0.995 stays
    99.50%: rounding it to the sample's precision would print a bar of 100%."""
    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-build-once/xcit/results/timm_xcit/tables.json", "tables")
    heldout = next(s for s in tables["samples"] if s["name"] == "heldout")
    heldout["count"] = 24
    tables["decision"]["conditions"] = [
        {"name": "agreement", "table": "quality", "column": "heldout.top1_agreement", "reduce": "min", "compare": ">=",
         "observed": {"min": 1.0, "max": 1.0, "n": 1}, "n": 1, "threshold": 0.995, "pass": True, "note": "",
         "rows": {}, "units": "percent_of_samples", "samples": ["heldout"], "basis": "b", "baseline": None}]
    line = next(x for x in render.render_section(tables).splitlines() if x.startswith("- **met: agreement"))
    assert "`fp8`: 100% over 1 row of 24 images (heldout). Needs at least 99.50%." in line


def test_a_variants_transform_parameters_read_as_words_not_json():
    assert render_formats.params_text({"factor": 64, "when": {"window": [512]}}) == "factor 64, when window 512"
    assert render_formats.params_text({"exclude": ["*.output.dense", "*.qkv"]}) == "exclude *.output.dense / *.qkv"


def test_a_range_in_words_names_its_unit_once():
    assert render_formats.span({"min": 48.1, "max": 48.7}, lambda v: render_formats.num(v, 1), " times") == "48.1 to 48.7 times"
    assert render_formats.span({"min": 48.1, "max": 48.1}, lambda v: render_formats.num(v, 1), " times") == "48.1 times"


def test_a_bound_with_no_f_says_so_instead_of_an_empty_sentence():
    """The embedded default's CPU rows have a bound cell (why it is withheld) and no f: the sentence on
    how f was found must not read "f was found ."."""
    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-torch-repeats/results/fnet/tables.json", "tables")
    assert "f was found on `h200-torch` by shape [M, K, N]." in render.render_section(tables)
    tables["bound"]["f_bases"] = {"h200-torch": []}
    section = render.render_section(tables)
    assert "f was found" not in section
    assert "([how it is computed](../../docs/reading-a-study.md#the-amdahl-bound)); no row has one: its cell says why." in section


def test_detr_gemm_rows_count_only_what_they_cover():
    """Deformable DETR's GEMM sentence names how many rows it covers out of those profiled for both the
    baseline and the candidate, not "every target and size" when a disagreeing profile was left out."""
    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-deformable-detr/run-2026-12-05/results/deformable_detr/tables.json",
                                 "tables")
    line = next(x for x in render.render_section(tables).splitlines() if x.startswith("- GEMM time per call"))
    assert "(all 3 rows profiled for both)" in line
    next(k for k in tables["kernels"] if k["target"] == "h200-eager" and k["variant"] == "fp8")["profile_agrees"] = False
    line = next(x for x in render.render_section(tables).splitlines() if x.startswith("- GEMM time per call"))
    assert "(2 of the 3 rows profiled for both; the others' profiles disagree)" in line
    for k in tables["kernels"]:
        k["profile_agrees"] = False
    line = next(x for x in render.render_section(tables).splitlines() if x.startswith("- GEMM time saved against"))
    assert line.endswith(": none of the 3 rows profiled for both the baseline and fp8 has profiles that agree with their timing.")


def test_xcit_gemm_share_is_each_targets_own():
    """XCiT's 'why' gives the FP8 GEMMs' share of profiled time per target: a second target's profile
    (ONNX Runtime's, say) is never quoted as the study's, and a target whose profile disagrees with its
    timing is named as left out."""
    import copy

    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-build-once/xcit/results/timm_xcit/tables.json", "tables")
    tables["targets"]["cpu-onnxruntime"] = {"backend": "onnxruntime", "device": "cpu", "version": None}
    for k in [k for k in tables["kernels"] if k["variant"] == "fp8" and k["batch"] == 1]:
        other = copy.deepcopy(k) | {"target": "cpu-onnxruntime", "total_ms": 10.0}
        other["groups_ms"] = {"FP8 GEMMs": 5.0, "other": 5.0}
        tables["kernels"].append(other)

    def why():
        return next(x for x in render.render_section(tables).splitlines() if x.startswith("At batch 1 the FP8 GEMMs"))

    assert ("24% to 25% on `h200-torch` (torch); 50% on `cpu-onnxruntime` (onnxruntime); the rest is work outside "
            "the FP8 GEMMs.") in why()
    for k in tables["kernels"]:
        if k["target"] == "cpu-onnxruntime":
            k["profile_agrees"] = False
    assert why().endswith("24% to 25% on `h200-torch` (torch); the rest is work outside the FP8 GEMMs. Each target's "
                          "share is its own profile's; left out: `cpu-onnxruntime` (its profile disagrees with its timing).")


def test_the_front_page_names_the_run_kind_before_its_decisions(tmp_path):
    """The report's front page says which run decided (a smoke run on tiny random-init models decides
    nothing about the real checkpoints) before one line per study: its decision and the conditions it
    misses, with what was measured and what was needed."""
    from quantstudy import artifacts

    from helpers import ROOT

    paths = [ROOT / "results/h200-gpt-neo/gpt_neo/results/gpt_neo/tables.json",
             ROOT / "results/h200-build-once/xcit/results/timm_xcit/tables.json"]
    out = tmp_path / "decisions.rst"
    render.front_page(paths, out)
    lines = out.read_text().splitlines()
    run = artifacts.read_json(paths[0], "tables")["run"]
    note = run["note"].replace("_", "\\_")  # reStructuredText: xcit\_nano, not an emphasis
    assert lines[0] == f"**Run {run['name']} ({run['weights']} weights). {note}**"
    studies = [line for line in lines if line.startswith("- **")]
    assert len(studies) == 2 and studies[0].startswith("- **GPT-Neo: do not ship fp8** (2 of 4 conditions not met: ")
    assert "next-token KL against PyTorch bf16 (every row), 62.0 times, needs at most 5.0 times the fp16 engine's" in studies[0]


def test_a_baselines_ms_beside_a_variants_is_the_pair_its_x_came_from():
    """The speed table's other variants and fp32 show each variant's ms over the baseline ms of its own
    job, with the x of the two (GPT-Neo's H200 evidence: fp8-c_fc's prefill, timed beside fp16)."""
    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-gpt-neo/gpt_neo/results/gpt_neo/tables.json", "tables")
    section = render.render_section(tables)
    assert "other variants: ms / their baseline ms (x) |" in section
    row = next(r for r in tables["speed"] if r["variant"] == "fp8-c_fc" and r["graph"] == "prefill")
    candidate = next(r for r in tables["speed"] if r["variant"] == "fp8" and r["graph"] == "prefill")
    assert row["baseline_ms"] != candidate["baseline_ms"]  # two jobs, two times of the one baseline engine
    assert f"fp8-c_fc: [{row['variant_ms']:.3f}](" in section and f") / [{row['baseline_ms']:.3f}](" in section
    assert f"({row['x']:.2f}x)" in section


def test_a_condition_straddling_its_threshold_is_rendered_within_the_noise():
    """The verdict names it so, with its interval and what would resolve it, and the decision line says the
    verdict rests on it (the committed XCiT evidence, one condition's interval made to straddle its bar)."""
    from quantstudy import artifacts

    from helpers import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-build-once/xcit/results/timm_xcit/tables.json", "tables")
    c = tables["decision"]["conditions"][1]
    c.update(resolved="within the noise", interval={"min": 0.93, "max": 0.99}, interval_kind="Wilson",
             to_resolve="2400 samples a row")
    tables["decision"]["within_noise"] = [c["name"]]
    section = render.render_section(tables)
    assert f"- **within the noise of this run: {c['name']}" in section
    assert "; interval 0.9300 to 0.9900 (Wilson, 95% interval). Needs at least 0.9500." in section
    assert "this run cannot resolve it; about 2400 samples a row would." in section
    assert f"The verdict rests on 1 condition within the noise of this run ({c['name']})" in section
    # the others keep their met / not met
    assert f"- **{'met' if tables['decision']['conditions'][0]['pass'] else 'not met'}: " in section


def test_gpt_neos_method_names_the_dtype_its_reference_files_record():
    """Issue 41, item 1: GPT-Neo's reference runs in bf16 (the write-up's "GPTNeoForCausalLM in bf16").
    The committed evidence's reference.json files record the dtype they ran in; the rows aggregate makes
    of them carry it, and the Method and the quality table name it, never a default of float32. The
    spec aggregate copies carries the study's reference_dtype too."""
    import json
    from pathlib import Path

    import yaml

    from quantstudy import aggregate, aggregate_rows, artifacts, config as qc

    from helpers import ROOT

    evidence = ROOT / "results/h200-gpt-neo/gpt_neo"
    tables = artifacts.read_json(evidence / "results/gpt_neo/tables.json", "tables")
    paths = sorted(str(p) for p in evidence.glob("results/gpt_neo/*/*/reference.json"))
    recorded = {json.loads(Path(p).read_text())["dtype"] for p in paths}
    assert recorded == {"bfloat16"}
    settings = {name: qc.shape_of(s) for name, s in tables["spec"]["settings"].items()}
    tables["references"] = aggregate_rows.reference_rows(paths, settings, [])
    lines = render.render_section(tables).splitlines()
    method = [line for line in lines if line.startswith("- Reference: Transformers `GPTNeoForCausalLM`")]
    assert len(method) == 1 and " in bfloat16 (eager attention)" in method[0]
    assert not [line for line in lines if re.search(r"PyTorch (float32|fp32)\b", line)]
    assert [line for line in lines if line.startswith("| WikiText-2 perplexity (PyTorch bfloat16: ")]

    configured = yaml.safe_load((ROOT / "config/studies/gpt_neo.yaml").read_text())["reference_dtype"]
    study = qc.load_study(ROOT / "config/studies/gpt_neo.yaml", [ROOT / "config/tiny/gpt_neo.yaml"], against_code=False).document
    assert aggregate.spec_of(study)["reference_dtype"] == configured == "bfloat16"


def test_a_runs_banner_names_the_device_its_jobs_record_not_its_configs_note():
    """Issue 41, item 11: the committed XCiT run of 2026-12-05 ran under config/h200.yaml, whose note said
    "on one H200", on an H100. The banner and the verdict name the card the jobs' JSONs record (tables
    written before aggregate kept `devices` read it from the files kept beside the README) and say that
    the note names a card no job ran on; a run's note in config names no card."""
    import json
    from pathlib import Path

    import yaml

    from quantstudy import artifacts

    from helpers import ROOT

    folder = ROOT / "results/h200-build-once/xcit-h100/results/timm_xcit"
    timings = sorted(folder.glob("h200-torch/*/*/*/timing.json"))
    recorded = {json.loads(p.read_text())["provenance"]["hardware"]["gpu_system"]["name"] for p in timings}
    assert recorded == {"NVIDIA H100 80GB HBM3"} and len(timings) == 8
    tables = artifacts.read_json(folder / "tables.json", "tables")
    assert "on one H200" in tables["run"]["note"] and "devices" not in tables

    def banner_and_verdict(lines):
        return (next(line for line in lines if line.startswith("> **")),
                next(line for line in lines if line.startswith("**Do not ship") or line.startswith("**Ship")))

    lines = render.render_section(tables, folder / "README.md").splitlines()
    banner, verdict = banner_and_verdict(lines)
    assert lines[lines.index(banner) + 1] == ""  # the quote ends with its line
    assert banner.startswith("> **real-size-random-init run `h200-torch`, on NVIDIA H100 80GB HBM3 (")
    assert banner.endswith("**The note names H200, but no job of this run ran on it.**")
    assert "measured on NVIDIA H100 80GB HBM3 against fp16" in verdict

    # Tables that record their devices (aggregate counts them from the jobs' JSONs) need no file beside them.
    docs = [json.loads(p.read_text()) for p in timings]
    assert artifacts.devices(docs) == [{"device": "NVIDIA H100 80GB HBM3", "jobs": 8}]
    tables["devices"] = [{"device": "NVIDIA H100 80GB HBM3", "jobs": 8}]
    banner, verdict = banner_and_verdict(render.render_section(tables).splitlines())
    assert banner.startswith("> **real-size-random-init run `h200-torch`, on NVIDIA H100 80GB HBM3 (8 jobs), as its "
                             "jobs' provenance records.**")
    assert "measured on NVIDIA H100 80GB HBM3 against fp16" in verdict
    # The same run on the H200 it was meant for: no contradiction to flag.
    tables["devices"] = [{"device": "NVIDIA H200", "jobs": 8}]
    banner, _ = banner_and_verdict(render.render_section(tables).splitlines())
    assert "on NVIDIA H200 (8 jobs)" in banner and "The note names" not in banner

    for run_config in sorted(Path(ROOT / "config").glob("*.yaml")):
        note = (yaml.safe_load(run_config.read_text()).get("run") or {}).get("note") or ""
        assert not render_view.CARD.findall(note), f"{run_config.name}'s note names a card: {render_view.CARD.findall(note)}"


def test_the_front_page_names_the_devices_the_jobs_record_once_per_run(tmp_path):
    """The report's front page line of a run names the devices its studies' jobs record, by name (not a
    count per study), so a run whose studies all ran on one card has one line."""
    import json

    from quantstudy import artifacts

    from helpers import ROOT

    paths = []
    for i, study in enumerate(("results/h200-gpt-neo/gpt_neo/results/gpt_neo", "results/h200-build-once/xcit/results/timm_xcit")):
        doc = json.loads((ROOT / study / "tables.json").read_text())
        doc["devices"] = [{"device": "NVIDIA H100 80GB HBM3", "jobs": 10 + i}]
        doc["run"] = {**doc["run"], "note": "A note that names no card."}
        body = {k: v for k, v in doc.items() if k not in ("schema", "schema_version", "content_sha256")}
        artifacts.write_json(tmp_path / f"{i}.json", "tables", body)
        paths.append(tmp_path / f"{i}.json")
    out = tmp_path / "decisions.rst"
    render.front_page(paths, out)
    lines = out.read_text().splitlines()
    assert lines[0] == "**Run h200-torch (real-size-random-init weights, on NVIDIA H100 80GB HBM3). A note that names no card.**"
    assert lines[1] == ""
