"""Published vs reproduced: the write-ups' numbers as data (config/published/), checked when the
study is loaded, compared with this run's rows in aggregate and rendered in every study's README."""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml

from quantstudy import decision, render, render_formats
from quantstudy import config as qc
from quantstudy.published import compare_published

from helpers import ROOT

STUDIES = ("fnet", "deberta_v2", "timm_xcit")
# The committed H200 evidence (real-size random weights): real tables of all three studies, rendered
# here without running the DAG again.
EVIDENCE = {"fnet": "results/h200-torch/results/fnet/tables.json",
            "deberta_v2": "results/h200-torch-issue9/results/deberta_v2/tables.json",
            "timm_xcit": "results/h200-torch-issue9/results/timm_xcit/tables.json"}


def published_doc(study: str = "fnet") -> dict:
    return yaml.safe_load((ROOT / f"config/published/{study}.yaml").read_text())


def load_fnet_with(published: dict, tmp_path) -> qc.Study:
    """The embedded default's FNet study with its published numbers replaced by `published`."""
    path = tmp_path / "published.yaml"
    path.write_text(yaml.safe_dump(published, sort_keys=False))
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump({"published": str(path)}))
    return qc.load_study(ROOT / "config/studies/fnet.yaml", [ROOT / "config/tiny/fnet.yaml", override],
                         against_code=False)


@pytest.mark.parametrize("study", STUDIES)
def test_each_study_loads_with_its_published_numbers(study):
    s = qc.load_study(ROOT / f"config/studies/{study}.yaml", ROOT / f"config/tiny/{study}.yaml", against_code=False)
    published = qc.load_published(s.published)
    assert published["study"] == study and published["seed"].startswith(f"{study}__")
    entries = published["entries"]
    assert entries and all(e["source"]["row"] and e["source"]["title"] and e["tolerance"] for e in entries)


def test_a_row_key_that_names_no_model_of_the_study_is_an_error_at_load(tmp_path):
    doc = published_doc()
    speed = next(t for t in doc["tables"] if t["title"].startswith("Speed, TensorRT 11.4"))
    speed["rows"][0]["keys"]["model"] = "fnet-huge"
    with pytest.raises(qc.ConfigError) as e:
        load_fnet_with(doc, tmp_path)
    assert ("'Speed, TensorRT 11.4 (ms; x is fp16 time over FP8 time; at 512 fp16 is `fp16+hs`, the fp16 build of "
            "the family at 512 has the same speed but NaN)', row 'base, 512 | B200', column 'fp32': model 'fnet-huge' "
            "is no model of study fnet; its models: fnet-base, fnet-large") in str(e.value)


def test_a_target_no_run_config_gives_the_study_is_an_error(tmp_path):
    """b200-trt11.4-o1 exists on the B200 run, but FNet is built at level 3 only there."""
    doc = published_doc()
    doc["tables"][0]["rows"][0]["keys"]["target"] = "b200-trt11.4-o1"
    with pytest.raises(qc.ConfigError, match=r"target 'b200-trt11.4-o1' is no target of study fnet on "
                                             r"config/b200.yaml, config/b300.yaml; its targets: b200-trt11.4, "
                                             r"b200-trt11.1, b300-trt11.4"):
        load_fnet_with(doc, tmp_path)


@pytest.mark.parametrize("drop, message", [
    (lambda d: d["tables"][0]["rows"][0].pop("row"), "tables.0.rows.0: 'row' is a required property"),
    (lambda d: d["tables"][0].pop("section"), "tables.0: 'section' is a required property"),
    (lambda d: d.pop("seed"), "(top level): 'seed' is a required property"),
])
def test_a_missing_source_is_an_error(drop, message, tmp_path):
    doc = published_doc()
    drop(doc)
    with pytest.raises(qc.ConfigError) as e:
        load_fnet_with(doc, tmp_path)
    assert message in str(e.value)


def test_values_as_printed_kinds_with_tolerances_and_ranges_that_run_forward(tmp_path):
    doc = published_doc()
    doc["tables"][0]["rows"][0]["values"] = {"NaN passages of 300": 293}  # a YAML number loses "1.10"'s zero
    with pytest.raises(qc.ConfigError, match=r"values.NaN passages of 300: 293: expected one number exactly as the "
                                             r"write-up prints it, quoted"):
        load_fnet_with(doc, tmp_path)
    doc = published_doc()
    doc["tables"][0]["columns"]["NaN passages of 300"]["kind"] = "nan_count"
    doc["tables"][0]["rows"][1]["values"] = {"NaN passages of 300": ["300", "293"]}
    with pytest.raises(qc.ConfigError) as e:
        load_fnet_with(doc, tmp_path)
    assert "kind 'nan_count' has no tolerance" in str(e.value) and "the range 300 to 293 runs backwards" in str(e.value)


# --- the comparison, on a case worked out by hand ----------------------------------------------

HAND = {
    "study": "fnet", "seed": "fnet__004_36001eddca6567fe.txt", "weights": "checkpoint", "runs": ["config/b200.yaml"],
    "left_out": [],
    "tolerances": {"ms": {"relative": 0.05}, "x": {"absolute": 0.02}, "agree": {"absolute": 0.5},
                   "plan": {"relative": 0.02}, "cos": {"absolute": 0.01}},
    "tables": [
        {"section": "Results", "title": "Speed", "table": "speed", "keys": {"target": "b200-trt11.4", "model": "fnet-base"},
         "columns": {"FP8": {"column": "variant_ms", "units": "ms", "kind": "ms", "keys": {"variant": "fp8"}},
                     "x": {"column": "x", "units": "x", "kind": "x", "keys": {"variant": "fp8"}}},
         "rows": [{"row": "256", "keys": {"setting": "w256"}, "values": {"FP8": "0.752", "x": "1.05"}},
                  {"row": "512", "keys": {"setting": "w512"}, "values": {"FP8": "0.752", "x": "1.05"}},
                  {"row": "128", "keys": {"setting": "w128"}, "values": {"x": "1.11"}}]},
        {"section": "Results", "title": "Quality", "table": "quality",
         "keys": {"target": "b200-trt11.4", "model": "fnet-base", "variant": "fp8"},
         "columns": {"agree": {"column": "mlm.top1_agreement", "units": "%", "kind": "agree"},
                     "cos": {"column": "one_token.min", "units": "number", "kind": "cos"}},
         "rows": [{"row": "256", "keys": {"setting": "w256"}, "values": {"agree": "93.99"}},
                  {"row": "both", "keys": {"setting": ["w256", "w512"]}, "values": {"cos": ["0.944", "0.995"]}},
                  {"row": "B300", "keys": {"target": "b300-trt11.4", "setting": "w256"}, "values": {"agree": "94.14"}}]},
        {"section": "Results", "title": "Plan size", "table": "builds",
         "keys": {"target": "b200-trt11.4", "model": "fnet-base", "setting": "w512", "variant": "fp8"},
         "columns": {"FP8": {"column": "engine_bytes", "units": "MiB", "kind": "plan"}},
         "rows": [{"row": "base", "values": {"FP8": "108.0"}}]},
    ]}


def speed_row(setting, ms, x, status="ok"):
    return {"target": "b200-trt11.4", "model": "fnet-base", "setting": setting, "variant": "fp8", "graph": "main",
            "status": status, "variant_ms": ms, "x": x, "source": f"results/fnet/b200-trt11.4/fnet-base/{setting}/fp8/timing.json",
            "error": None if status == "ok" else "RuntimeError: engine build failed"}


def hand_tables():
    quality = [{"target": "b200-trt11.4", "model": "fnet-base", "setting": s, "variant": "fp8", "status": "ok",
                "mlm.top1_agreement": a, "one_token.min": c, "source": f"results/fnet/b200-trt11.4/fnet-base/{s}/fp8/quality.json"}
               for s, a, c in [("w256", 0.9351, 0.95), ("w512", 0.9, 0.99)]]
    builds = [{"target": "b200-trt11.4", "model": "fnet-base", "setting": "w512", "variant": "fp8", "status": "ok",
               "engine_bytes": 108 * 2**20 + 3 * 2**19, "source": "results/fnet/b200-trt11.4/fnet-base/w512/fp8/build.json"}]
    return {"speed": [speed_row("w256", 0.80, 1.0201), speed_row("w512", 0.78, 1.0671), speed_row("w128", None, None, "failed")],
            "quality": quality, "builds": builds, "kernels": [], "references": []}


@pytest.fixture
def hand_published(tmp_path):
    path = tmp_path / "published.yaml"
    path.write_text(yaml.safe_dump(HAND, sort_keys=False))
    return qc.load_published(path)


def test_difference_and_tolerance_by_hand(hand_published):
    rows = compare_published(hand_published, hand_tables(), "checkpoint", ["b200-trt11.4"])
    by = {(r["published_source"]["title"], r["published_source"]["row"], r["published_source"]["column"]): r for r in rows}
    # 0.80 ms against 0.752: +0.048, more than 5% of 0.752 (0.0376)
    r = by[("Speed", "256", "FP8")]
    assert r["status"] == "reproduced" and r["difference_min"] == pytest.approx(0.048) and r["beyond_tolerance"] is True
    # 0.78 ms: +0.028, within 0.0376
    assert by[("Speed", "512", "FP8")]["beyond_tolerance"] is False
    # x 1.0201 against 1.05: -0.0299, beyond 0.02; 1.0671: +0.0171, within
    assert by[("Speed", "256", "x")]["difference_max"] == pytest.approx(-0.0299) and by[("Speed", "256", "x")]["beyond_tolerance"]
    assert by[("Speed", "512", "x")]["beyond_tolerance"] is False
    # a failed row is a failure, with its error, never a number
    failed = by[("Speed", "128", "x")]
    assert failed["status"] == "failed here" and "engine build failed" in failed["reason"] and failed["beyond_tolerance"] is None
    # agreement in %: 0.9351 is 93.51, 0.48 points below 93.99, within 0.5
    r = by[("Quality", "256", "agree")]
    assert r["reproduced_min"] == pytest.approx(93.51) and r["difference_min"] == pytest.approx(-0.48) and not r["beyond_tolerance"]
    # a range over two rows: 0.95 and 0.99 against 0.944 to 0.995: +0.006 and -0.005, within 0.01
    r = by[("Quality", "both", "cos")]
    assert (r["reproduced_min"], r["reproduced_max"]) == (0.95, 0.99) and r["source"] is None
    assert r["difference_min"] == pytest.approx(0.006) and r["difference_max"] == pytest.approx(-0.005)
    assert r["beyond_tolerance"] is False and len(r["reproduced_from"]) == 2
    # bytes as MiB: 109.5 against 108.0, +1.5, within 2% of 108.0 (2.16)
    r = by[("Plan size", "base", "FP8")]
    assert r["reproduced_min"] == pytest.approx(109.5) and r["beyond_tolerance"] is False
    # a target this run does not have
    r = by[("Quality", "B300", "agree")]
    assert r["status"] == "not reproduced here" and r["reason"] == "target b300-trt11.4 is not in this run"
    # the audit finds a published number in its config file, a reproduced one in its row's JSON
    assert by[("Speed", "256", "FP8")]["source"] == speed_row("w256", 0, 0)["source"]
    assert by[("Speed", "256", "FP8")]["sources"]["published_min"] == hand_published["file"]


def test_a_run_on_other_weights_reproduces_nothing(hand_published):
    rows = compare_published(hand_published, hand_tables(), "tiny-random-init", ["b200-trt11.4"])
    assert {r["status"] for r in rows} == {"not reproduced here"}
    assert {r["reason"] for r in rows} == {"this run's weights are tiny-random-init, not the write-up's (checkpoint)"}


# --- rendering -----------------------------------------------------------------------------

def evidence_tables(study: str) -> dict:
    """A committed evidence run's tables, with this study's published numbers compared as aggregate does."""
    t = json.loads((ROOT / EVIDENCE[study]).read_text())
    t.setdefault("damaged", [])
    published = qc.load_published(f"config/published/{study}.yaml")
    t["published"] = compare_published(published, {k: t[k] for k in ("speed", "quality", "builds", "kernels", "references")},
                                       t["run"]["weights"], t["targets"])
    t["published_from"] = {k: published[k] for k in ("file", "seed", "weights", "runs", "tolerances", "differs", "left_out")}
    return t


def section_lines(readme: str) -> list[str]:
    start = readme.index("<details><summary>Published vs reproduced")
    return readme[start:readme.index("</details>", start)].splitlines()


@pytest.mark.parametrize("study", STUDIES)
def test_a_run_not_comparable_to_the_write_up_lists_every_number_of_it_in_a_fold_with_why(study):
    """Random-weight evidence reproduces no published number: one line says why and links the file that
    transcribes them (which exists); the fold under it lists each published number with the rows it is
    compared with in a run of the write-up's weights, and each number of the write-up left out, with why."""
    t = evidence_tables(study)
    readme = render.render_section(t)
    line = next(x for x in readme.splitlines() if x.startswith("**Published numbers:**"))
    assert (f"publishes {len(t['published'])} numbers this study measures ([`config/published/{study}.yaml`]"
            f"(../../config/published/{study}.yaml)); this run reproduces none of them: this run's weights are "
            "real-size-random-init, not the write-up's (checkpoint).") in line
    assert (ROOT / "results" / study / "../../config/published" / f"{study}.yaml").resolve().is_file()
    assert "Published vs reproduced" not in readme
    left_out = yaml.safe_load((ROOT / f"config/published/{study}.yaml").read_text())["left_out"]
    start = readme.index(f"<details><summary>The write-up's numbers: 0 of {len(t['published'])} reproduced, "
                         f"{len(left_out)} left out, each with why</summary>")
    fold = readme[start:readme.index("</details>", start)].splitlines()
    listed = [x for x in fold if x.startswith("| ") and x.count(" | ") == 3 and not x.startswith("| Published as")]
    assert len(listed) == len(t["published"])
    for r, x in zip(t["published"], listed):
        assert x.endswith(f"| {r['units']} | {' to '.join(r['printed'])} |")
    for item in left_out:
        assert f'| "{render_formats.cell_text(item["quote"])}" | {item["reason"]}: {render_formats.cell_text(item["why"])} |' in fold


def test_flagged_and_unreproduced_rows_are_marked():
    """The FNet evidence tables with two rows as a B200 checkpoint run would have them: one within the
    tolerance, one beyond it; every other number says why it is not reproduced here."""
    t = evidence_tables("fnet")
    t["run"] = {**t["run"], "weights": "checkpoint"}
    t["targets"] = {"b200-trt11.4": {**t["targets"]["h200-torch"], "name": "b200-trt11.4", "gpu": "b200"}}
    rows = [copy.deepcopy(next(r for r in t["speed"] if (r["model"], r["setting"], r["variant"]) == ("fnet-base", s, "fp8")))
            for s in ("w256", "w128")]
    rows[0].update(target="b200-trt11.4", x=1.0201)   # 1.05 published: -0.03, beyond 0.02
    rows[1].update(target="b200-trt11.4", x=1.1049)   # 1.11 published: -0.0051, within
    t["published"] = compare_published(qc.load_published("config/published/fnet.yaml"),
                                       {"speed": rows, "quality": [], "builds": [], "kernels": [], "references": []},
                                       "checkpoint", t["targets"])
    lines = section_lines(render.render_section(t))
    # x and FP8 ms of both rows: 0.535 ms against 0.466 and 0.403 against 0.371 are beyond 5% as well
    left_out = len(published_doc("fnet")["left_out"])
    assert lines[0] == (f"<details><summary>Published vs reproduced: 4 of {len(t['published'])} reproduced, "
                        f"3 beyond tolerance, {left_out} left out, each with why</summary>")
    section = render_formats.cell_text(next(r for r in t["published"] if r["column"] == "x")["published_source"]["section"])
    beyond = (f"| {section}: base, 256 \\| B200 / x | speed `x`: b200-trt11.4, fnet-base, w256, fp8 | x | 1.09 | 1.02 | "
              "-0.07 | **beyond tolerance** (±0.02) |")
    assert beyond in lines
    assert (f"| {section}: base, 128 \\| B200 / x | speed `x`: b200-trt11.4, fnet-base, w128, fp8 | x | 1.11 | 1.10 | "
            "-0.01 | within |") in lines
    assert (f"| {section}: base, 256 \\| B300 / x | speed `x`: b300-trt11.4, fnet-base, w256, fp8 | x | 1.08 | - | - | "
            "not reproduced here: target b300-trt11.4 is not in this run |") in lines
    assert any("not reproduced here: no row of target b200-trt11.4, model fnet-base, setting w512, variant fp8 in this run"
               in line for line in lines)


# --- a threshold's basis quotes its write-up exactly ------------------------------------------

SEEDS = next((p for p in (ROOT.parent / "shared" / "seeds", ROOT / "shared" / "seeds") if p.is_dir()), None)
BASES = [(path.stem, c) for path in sorted((ROOT / "config/studies").glob("*.yaml"))
         for c in (yaml.safe_load(path.read_text()).get("decision") or {}).get("conditions", []) if c.get("basis")]
# A range the basis quotes, in x or %, and what follows it up to the next clause: its qualifiers.
QUOTED_RANGE = re.compile(r"(\d+(?:\.\d+)?)(x|%) to (\d+(?:\.\d+)?)\2([^,;()]*)")


def _qualified(entries: list[dict], qualifiers: str) -> list[dict]:
    """The published cells a range's qualifiers select: `on B200` by the row the write-up prints,
    `TensorRT 11.4` by its row, `level 1` by its column."""
    for gpu in re.findall(r"\bB[23]00\b", qualifiers):
        entries = [e for e in entries if gpu in e["source"]["row"].split(" | ")]
    for version in re.findall(r"TensorRT (\d+\.\d+)", qualifiers):
        entries = [e for e in entries if version in e["source"]["row"].split(" | ")]
    for level in re.findall(r"level \d", qualifiers):
        entries = [e for e in entries if level in e["source"]["column"]]
    return entries


@pytest.mark.parametrize("study, condition", BASES, ids=[f"{s}: {c['name']}" for s, c in BASES])
def test_a_basis_quotes_its_write_ups_numbers_exactly(study, condition):
    """Issue 41, item 4: a threshold's basis that quotes the write-up quotes it exactly. Each range it
    gives in x or % (with its qualifiers: GPU, TensorRT version, builder level) is the whole range of
    the cells the published transcription has of the condition's column, for one variant; each quoted
    sentence ('...') is in the write-up's text, word for word, where shared/seeds is at hand."""
    spec = yaml.safe_load((ROOT / f"config/studies/{study}.yaml").read_text())
    published = qc.load_published(ROOT / spec["published"])
    rows = condition.get("rows") or {}
    entries = [e for e in published["entries"] if e["column"] == condition["column"]
               and all(e.get(k) in (None, v) for k, v in rows.items() if k in qc.PUBLISHED_KEYS)]
    basis = condition["basis"]
    for low, unit, high, qualifiers in QUOTED_RANGE.findall(basis):
        cells = _qualified(entries, qualifiers)
        if not cells:  # a range of another column (a summary, a ratio): quoted from the text below
            continue
        ranges = {}
        for e in cells:
            ranges.setdefault(e["variant"], []).append(e["min"])
        assert (float(low), float(high)) in {(min(v), max(v)) for v in ranges.values()}, (
            f"{study}: the basis of {condition['name']!r} quotes {low}{unit} to {high}{unit}{qualifiers}, but the "
            f"write-up's cells of {condition['column']} there are " + "; ".join(
                f"{variant}: {', '.join(sorted(e['printed'][0] for e in cells if e['variant'] == variant))}"
                for variant in ranges))
    if SEEDS is None:
        return
    text = " ".join((SEEDS / published["seed"]).read_text().split())
    for quote in re.findall(r"(?<![\w])'([^']+)'(?![\w])", basis):
        assert " ".join(quote.split()) in text, f"{study}: {quote!r} is not in {published['seed']}"
    for low, unit, high, _ in QUOTED_RANGE.findall(basis):
        if not _qualified(entries, _):
            assert f"{low}{unit} to {high}{unit}" in text, (
                f"{study}: the basis quotes {low}{unit} to {high}{unit}, which is neither a range of the published "
                f"cells of {condition['column']} nor in {published['seed']}")


def test_detrs_held_out_metrics_say_wherever_compared_that_they_are_not_on_the_write_ups_pixels():
    """Issue 41, item 6: DETR's held-out images are a seeded shuffle, resized without keeping their aspect;
    the write-up's were taken at a fixed stride. Its published file says so (`differs`), and the README
    says it beside every published AP and correlation, under the published numbers, and in the verdict
    of the AP-drop condition, on the committed H200 evidence with its published numbers compared as
    aggregate compares them: once as the run is (weights that reproduce nothing), once as a run of the
    write-up's weights whose every row is compared."""
    path = ROOT / "results/h200-deformable-detr/run-2026-12-05/results/deformable_detr/tables.json"
    published = qc.load_published("config/published/deformable_detr.yaml")
    doc = yaml.safe_load((ROOT / "config/published/deformable_detr.yaml").read_text())
    [differs] = doc["differs"]
    assert {"heldout.ap", "heldout_vs_fp16.ap_drop"} <= set(differs["columns"])
    how = " ".join(differs["how"].split())
    assert "seeded shuffle" in how and "aspect ratio" in how and '"at a fixed stride"' in how
    for weights in ("real-size-random-init", "checkpoint"):
        t = json.loads(path.read_text())
        t["run"]["weights"] = weights
        t["published"] = compare_published(
            published, {k: t[k] for k in ("speed", "quality", "builds", "kernels", "references")}, weights,
            t["targets"])
        t["published_from"] = {
            k: published[k] for k in ("file", "seed", "weights", "runs", "tolerances", "differs")}
        held_out = [r for r in t["published"] if r["column"].startswith("heldout")]
        assert len(held_out) >= 11 and all(r["differs"] == [differs["how"]] for r in held_out)
        assert not [r for r in t["published"] if r["differs"] and r not in held_out]
        lines = render.render_section(t).splitlines()
        flagged = [line for line in lines if line.startswith("**Measured otherwise than the write-up** ")]
        assert len(flagged) == 1 and flagged[0].endswith(how)
        drop = next(line for line in lines if line.startswith("- **") and "COCO AP drop" in line)
        assert drop.endswith(f"**Not the write-up's measurement:** {how}")
        assert not [line for line in lines if line.startswith("- **") and "speedup" in line and "Not the write-up" in line]
        table = [line for line in lines if line.startswith("| Validation (the PR description): ")]
        if table:  # the run of the write-up's weights: each held-out number's row is marked
            ap_rows = [line for line in table if "/ AP" in line or "logit correlation" in line]
            assert ap_rows and all("(**measured otherwise**: below)" in line for line in ap_rows)
            assert not [line for line in table if "(**measured otherwise**" in line and " ms " in line]


def test_a_differs_column_that_nothing_compares_is_an_error_at_load(tmp_path):
    published = published_doc()
    published["differs"] = [{"columns": ["mlm.top1_agreemnt"], "how": "a typo flags nothing"}]
    with pytest.raises(qc.ConfigError, match="differs names column 'mlm.top1_agreemnt', which no published number"):
        load_fnet_with(published, tmp_path)


ALL_STUDIES = ("fnet", "deberta_v2", "timm_xcit", "gpt_neo", "deformable_detr")
# The write-up numbers issue 41 found neither transcribed nor listed as left out (items 2 and 3).
UNLISTED_IN_ISSUE_41 = {
    "deformable_detr": ["9.7", "8.0", "0.04", "0.11", "0.5", "7.4", "16.2", "1%", "3%", "0.01", "0.409", "0.073",
                        "0.984", "0.986", "0.974", "0.975", "0.19", "0.21", "2.1", "4.3", "5.5",
                        "1.0",  # the heads' "AP -1.0 point", compared as a drop of 1.0 point
                        "0.4639", "0.4637"],
    "gpt_neo": ["0.0913", "0.98", "1.01", "22"],
    "deberta_v2": ["14", "58", "26", "118", "+0.35"],
}


@pytest.mark.parametrize("study", ALL_STUDIES)
def test_every_number_of_a_write_up_is_compared_or_left_out_with_why_under_one_policy(study):
    """Issue 41, items 2 and 3: one policy for the write-ups' numbers in all five studies. A number is
    compared wherever it names a column; one given without its target is compared with every row it can
    be (never dropped for that); anything else is in `left_out`, quoted as printed, with one of the
    schema's reasons and why. The numbers the issue found unlisted are each transcribed or quoted."""
    doc = published_doc(study)
    published = qc.load_published(ROOT / f"config/published/{study}.yaml")
    assert doc["left_out"], f"{study}: left_out lists nothing"
    for item in doc["left_out"]:
        assert not re.search(r"no target|target is not given|not say which target", item["why"]), item
    printed = {v for e in published["entries"] for v in e["printed"]}
    quoted = " ".join(item["quote"] for item in doc["left_out"])
    for number in UNLISTED_IN_ISSUE_41.get(study, []):
        assert number in printed or re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", quoted), (
            f"{study}: the write-up's {number} is neither transcribed nor left out")
    if SEEDS is not None:
        text = " ".join((SEEDS / published["seed"]).read_text().replace("`", "").split())
        for item in doc["left_out"]:
            assert " ".join(item["quote"].replace("`", "").split()) in text, f"{study}: {item['quote']!r} is not the write-up's"


def test_gpt_neos_per_variant_kl_ratios_are_compared_with_the_write_ups():
    """Issue 41, item 2: the write-up's "c_fc only, KL 8 times the floor" and "each kind alone adds 8 to 22
    times the fp16 KL" sit beside this run's: aggregate gives every quality row its KL over the fp16
    engine's on the same row (with_ratio), and the published file compares those ratios; c_proj alone is
    a variant, beside q/k/v and c_fc. On the committed GPT-Neo evidence as a B200 checkpoint run would
    have it."""
    import pandas as pd

    t = json.loads((ROOT / "results/h200-gpt-neo/gpt_neo/results/gpt_neo/tables.json").read_text())
    quality = pd.DataFrame(t["quality"])
    floor = {r["setting"]: r["wikitext.kl_mean"] for r in t["quality"] if r["variant"] == "fp16"}
    rows = decision.with_ratio(quality, "wikitext.kl_mean", "fp16")
    for r in rows.to_dict("records"):
        assert r["wikitext.kl_mean / fp16"] == pytest.approx(r["wikitext.kl_mean"] / floor[r["setting"]])
    study = qc.load_study(ROOT / "config/studies/gpt_neo.yaml", [ROOT / "config/tiny/gpt_neo.yaml"], against_code=False)
    alone = {name: dict(v.transforms).get("fp8", {}).get("include") for name, v in study.variants.items()}
    assert alone["fp8-c_proj"] == ["transformer.h.*.mlp.c_proj"] and alone["fp8-c_fc"] == ["transformer.h.*.mlp.c_fc"]

    records = rows.assign(target="b200-trt11.4").to_dict("records")
    published = qc.load_published("config/published/gpt_neo.yaml")
    compared = compare_published(published, {"speed": [], "quality": records, "builds": [], "kernels": [],
                                             "references": []}, "checkpoint", ["b200-trt11.4"])
    c_fc = next(r for r in compared if r["column"] == "wikitext.kl_mean / fp16" and r["variant"] == "fp8-c_fc")
    assert c_fc["status"] == "not reproduced here" and "b300-trt11.4" in c_fc["reason"]  # every target of the write-up
    only_b200 = copy.deepcopy(published)
    for e in only_b200["entries"]:
        if e["column"] == "wikitext.kl_mean / fp16":
            e["target"] = "b200-trt11.4"
    compared = compare_published(only_b200, {"speed": [], "quality": records, "builds": [], "kernels": [],
                                             "references": []}, "checkpoint", ["b200-trt11.4"])
    c_fc = next(r for r in compared if r["column"] == "wikitext.kl_mean / fp16" and r["variant"] == "fp8-c_fc")
    ours = next(r for r in t["quality"] if r["variant"] == "fp8-c_fc")["wikitext.kl_mean"] / floor["p256-c256"]
    assert c_fc["status"] == "reproduced" and c_fc["reproduced_min"] == pytest.approx(ours)
    assert c_fc["difference_min"] == pytest.approx(ours - 8)


def test_detrs_per_part_results_are_compared_with_the_matching_variants_rows():
    """Issue 41, item 2 (its DETR part): the write-up's per-part results sit beside this run's rows of the
    variants that put the same part into FP8, by the one policy: the heads' "AP -1.0 point" is compared with
    fp8-add-heads's AP drop against fp16 on every target (in points), the per-part job's fp16 / recipe AP with
    fp16's and fp8's; the decoder pair's "non-finite output" gives no count (a bound), and says which row has
    this run's. On the committed H200 evidence: as the run is (other weights: each number with the rows it
    is compared with), and as a checkpoint run of the write-up's three targets would have it."""
    path = ROOT / "results/h200-deformable-detr/run-2026-12-05/results/deformable_detr/tables.json"
    published = qc.load_published("config/published/deformable_detr.yaml")
    doc = published_doc("deformable_detr")
    heads = [e for e in published["entries"] if e["variant"] == "fp8-add-heads"]
    assert [(e["column"], e["units"], e["printed"], e["tolerance"]) for e in heads] == [
        ("heldout_vs_fp16.ap_drop", "%", ["1.0"], {"absolute": 0.2})]
    assert "AP -1.0 point" in heads[0]["note"] and "AP -1.0 point" in heads[0]["source"]["title"]
    [pair] = [item for item in doc["left_out"] if "decoder pair" in item["quote"]]
    assert pair["reason"] == "a bound, not a value" and "fp8-add-decoder-sampling's non-finite images" in pair["why"]
    assert not [item for item in doc["left_out"] if "heads" in item["quote"]]  # compared, so not left out

    t = json.loads(path.read_text())
    # The evidence's random-init AP drops are 0: fp8-add-heads's set by hand to 0.0085 (0.85 points, 0.15 below
    # the write-up's 1.0, within its 0.2); its per-part variants ran on h200-eager, as each of the write-up's targets.
    ours = 0.0085
    for r in t["quality"]:
        if r["variant"] == "fp8-add-heads" and r["status"] == "ok":
            r["heldout_vs_fp16.ap_drop"] = ours
    targets = ["b200-trt11.4", "b300-trt11.4", "b200-trt11.1"]
    for weights, rows, run_targets in (
            ("real-size-random-init", t["quality"], t["targets"]),
            ("checkpoint", [{**r, "target": tg} for tg in targets for r in t["quality"] if r["target"] == "h200-eager"],
             targets)):
        tables = {k: t[k] for k in ("speed", "builds", "kernels", "references")} | {"quality": rows}
        compared = compare_published(published, tables, weights, run_targets)
        [row] = [r for r in compared if r["variant"] == "fp8-add-heads"]
        view = {**t, "run": {**t["run"], "weights": weights}, "published": compared,
                "published_from": {k: published[k] for k in ("file", "seed", "weights", "runs", "tolerances", "differs",
                                                             "left_out")}}
        lines = render.render_section(view).splitlines()
        [shown] = [line for line in lines if "/ AP drop in points" in line]
        assert ("quality `heldout_vs_fp16.ap_drop`: b200-trt11.4 / b300-trt11.4 / b200-trt11.1, deformable-detr, "
                "800x800, fp8-add-heads | % | 1.0 |") in shown and "(**measured otherwise**: below)" in shown
        [bound] = [line for line in lines if line.startswith('| "the decoder pair in FP8 gives non-finite output" |')]
        assert "| a bound, not a value: " in bound and "fp8-add-decoder-sampling" in bound
        # and beside the per-part table, with this run's value or why there is none
        [beside] = [line for line in lines if line.startswith("The write-up's per-part results beside these rows")]
        assert "AP drop in points of `fp8-add-heads` 1.0" in beside and "AP recipe, 72 of `fp8` 0.4637" in beside
        assert "`fp8-add-decoder-sampling`'s non-finite images above are this run's" in beside
        if weights != "checkpoint":
            assert row["status"] == "not reproduced here" and row["reason"].startswith("this run's weights are real-size")
            assert beside.endswith(f"none reproduced here: {row['reason']}. The write-up's \"the decoder pair in FP8 "
                                   "gives non-finite output\" gives no count: `fp8-add-decoder-sampling`'s non-finite "
                                   "images above are this run's.")
            continue
        assert "AP drop in points of `fp8-add-heads` 1.0 (this run 0.85)" in beside and "reproduced here:" not in beside
        assert row["status"] == "reproduced", row["reason"]
        assert row["reproduced_min"] == row["reproduced_max"] == pytest.approx(0.85)
        assert row["difference_min"] == pytest.approx(-0.15) and row["beyond_tolerance"] is False
        assert shown.endswith("| 1.0 | 0.85 | -0.15 | within |"), shown
        # the per-part job's fp16 and recipe AP, beside fp16's and fp8's on b200-trt11.4
        per_part = [line for line in lines if line.startswith("| The review (the README's per-part table")]
        assert len(per_part) == 2 and all(" | - | - | " not in line for line in per_part)
