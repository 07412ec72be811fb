"""Splicing a rendered section into an existing README, and the number formats."""

from __future__ import annotations

from quantstudy import render


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
    assert render.span({"min": 1.031, "max": 1.109}, render.times, "x") == "1.03x to 1.11x"
    assert render.span({"min": 0.5, "max": 0.5}, render.pct) == "50.00%"
    assert render.span(None) == "not measured"
    assert render.sci(5.9e-06) == "5.9e-06" and render.sci(0.0095) == "0.0095"
    assert render.value_range([1.0, None, float("nan"), 3.0]) == {"min": 1.0, "max": 3.0, "n": 2}


def test_a_relative_condition_renders_its_factor_and_the_variant():
    """A decision condition relative to another variant shows its threshold as a factor of that
    variant's value, beside the absolute ones (on the committed XCiT evidence's tables)."""
    from quantstudy import artifacts

    from conftest import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-build-once/xcit/results/timm_xcit/tables.json", "tables")
    tables["decision"]["conditions"].append(
        {"name": "KL at most 10 x fp16's", "column": "kl / fp16", "reduce": "max", "compare": "<=",
         "observed": {"min": 3.5, "max": 12.25, "n": 2}, "threshold": 10, "relative_to": "fp16", "pass": False,
         "note": ""})
    rows = [line for line in render.render_section(tables).splitlines() if line.startswith("| KL at most")]
    assert rows == ["| KL at most 10 x fp16's | 3.5000 to 12.2500 | 10 x fp16's | no |"]


def test_a_failed_gpt_neo_variant_shows_its_error_text_in_the_variants_table():
    """The committed GPT-Neo evidence with one variant's build failed as TensorRT 11.4 fails FP8 out_proj
    (its timing and evaluation failed with it): that variant's row in the variants table names the
    failed file and the whole error; the other variants keep their numbers, and the speed-bar list
    is computed from the rows that were measured."""
    from quantstudy import aggregate, artifacts

    from conftest import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-gpt-neo/gpt_neo/results/gpt_neo/tables.json", "tables")
    error = aggregate.exception_text(
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in build\n    plan = builder.build()\n"
        "RuntimeError: TensorRT could not build the engine:\n"
        "Input 0's element type (fp8_e4m3) differs from input 1's element type (half)\n")
    for table in ("builds", "speed", "quality"):
        for row in tables[table]:
            if row["variant"] == "fp8-c_fc":
                row.update(status="failed", error=error if table == "builds" else "its build failed")
    lines = render.render_section(tables).splitlines()
    failed = [line for line in lines if line.startswith("| h200-torch | gpt-neo-125m, 256 x 256 | `fp8-c_fc` |")]
    assert len(failed) == 1
    assert ("failed: build.json: RuntimeError: TensorRT could not build the engine: Input 0's element type "
            "(fp8_e4m3) differs from input 1's element type (half)") in failed[0]
    assert failed[0].count("|") == 13  # the row keeps the table's 12 columns
    measured = [line for line in lines if line.startswith("| h200-torch | gpt-neo-125m, 256 x 256 | `fp8` |")]
    assert "failed" not in measured[0] and "62.0" in measured[0]


def test_detr_counts_render_as_counts_beside_failed_rows():
    """The committed Deformable DETR H200 evidence, whose eager target's variants all failed: a column
    with a failed row holds floats in tables.json, and the per-part table still prints the measured
    rows' job and image counts as counts, and each failed row's error."""
    from quantstudy import artifacts

    from conftest import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-deformable-detr/deformable_detr/results/deformable_detr/tables.json",
                                 "tables")
    lines = render.render_section(tables).splitlines()
    fp16 = [line for line in lines if line.startswith("| h200-torch | deformable-detr, 800 x 800 | `fp16` |")]
    assert len(fp16) == 1 and "(2 jobs)" in fp16[0] and fp16[0].endswith("| 0 / 64 |")
    eager = [line for line in lines if line.startswith("| h200-eager | deformable-detr, 800 x 800 | `fp8-add-heads` |")]
    assert len(eager) == 1 and "failed: RuntimeError: Cannot copy between CPU and CUDA tensors" in eager[0]


def test_a_condition_on_a_setting_names_it_with_this_runs_values():
    """A decision condition limited to a setting shows that setting's own values (the tiny run's w256 is a
    64-token window), never a typed label; a condition on no setting shows its name alone."""
    from quantstudy import artifacts

    from conftest import ROOT

    tables = artifacts.read_json(ROOT / "results/h200-build-once/xcit/results/timm_xcit/tables.json", "tables")
    tables["spec"]["settings"]["w256"] = {"window": 64, "batch": 1}
    tables["decision"]["conditions"] = [
        {"name": "speed-up at the manifest window (every row)", "column": "x", "reduce": "min", "compare": ">=",
         "observed": {"min": 0.9, "max": 1.2, "n": 2}, "threshold": 1.1, "pass": False, "note": "",
         "rows": {"setting": "w256"}},
        {"name": "non-finite outputs", "column": "nonfinite", "reduce": "sum", "compare": "==", "observed": 0,
         "threshold": 0, "pass": True, "note": "", "rows": {}}]
    rows = [line for line in render.render_section(tables).splitlines()
            if line.startswith(("| speed-up at the manifest", "| non-finite outputs |"))]
    assert rows == ["| speed-up at the manifest window (every row) (setting `w256`: window 64, batch 1) | 0.9000 to "
                    "1.2000 | 1.1 | no |", "| non-finite outputs | 0 | 0 | yes |"]
