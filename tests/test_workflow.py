"""The workflow itself, through real Snakemake, on the tiny test config (.test/).

One run of the whole DAG, then: a failing variant is rendered as failed while the others
complete; a no-op rerun does nothing; changing one variant's params reruns only its chain.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from helpers import ROOT
from quantstudy.devtools import copy_checkout, forge_faster, planned_jobs, rewrite_json, snakemake

pytestmark = pytest.mark.workflow


@pytest.fixture(scope="module")
def workflow_copy(tmp_path_factory) -> Path:
    """A copy of the repository (tracked and new files) with the test config run once."""
    dest = copy_checkout(ROOT, tmp_path_factory.mktemp("wf") / "repo")
    proc = snakemake(dest, "--configfile", ".test/config.yaml")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dest


def test_failing_variant_is_rendered_and_the_others_complete(workflow_copy):
    variant_dir = workflow_copy / "results/fnet/cpu-torch/fnet-base/w512"
    broken = json.loads((variant_dir / "fp8-broken/build.json").read_text())
    assert broken["status"] == "failed" and "the fp8 transform selects no layer" in broken["error"]
    for name in ("timing", "quality", "kernels"):
        assert json.loads((variant_dir / f"fp8-broken/{name}.json").read_text())["status"] == "failed"
    for variant in ("fp16", "fp16-hs", "fp8", "fp8-no-output-dense"):
        assert json.loads((variant_dir / variant / "quality.json").read_text())["status"] == "ok"
    readme = (workflow_copy / "results/fnet/README.md").read_text()
    assert re.search(r"\| \[build\.json\]\(cpu-torch/fnet-base/w512/fp8-broken/build\.json\) \| cpu-torch \| "
                     r"fnet-base, `w512` \| fp8-broken \| .*selects no layer", readme)
    fp8_row = next(line for line in readme.splitlines() if line.startswith("| fnet-base, `w512` | cpu-torch | fp8 |"))
    assert "failed" not in fp8_row and "%" in fp8_row


def test_quality_is_also_measured_against_the_variant_the_study_names(workflow_copy):
    """.test/fnet.yaml: quality_against: [fp16-hs]. Every other variant's evaluation opens that engine too."""
    for target in ("cpu-torch", "cpu-onnxruntime"):
        fp8 = json.loads((workflow_copy / f"results/fnet/{target}/fnet-base/w512/fp8/quality.json").read_text())
        assert fp8["provenance"]["inputs"]["against_fp16-hs"]["path"].endswith(f"{target}/fnet-base/w512/fp16-hs/build.json")
        assert 0 < fp8["blocks"]["cls_vs_fp16-hs"]["relative_error"] < 1
        own = json.loads((workflow_copy / f"results/fnet/{target}/fnet-base/w512/fp16-hs/quality.json").read_text())
        assert "cls_vs_fp16-hs" not in own["blocks"]


def test_fp16_overflow_at_512_is_measured(workflow_copy):
    tables = json.loads((workflow_copy / "results/fnet/tables.json").read_text())
    issue = tables["references"][0]
    assert issue["window"] == 512 and issue["mixing_peak.max"] > issue["mixing_peak.fp16_max"]
    quality = {r["variant"]: r for r in tables["quality"]}
    assert quality["fp16"]["nonfinite.heldout"] == quality["fp16"]["nonfinite.heldout.of"] > 0
    assert quality["fp16-hs"]["nonfinite"] == 0


def _table_rows(readme: str, header: str) -> list[list[str]]:
    """The body rows of the README table whose header line starts with `header`, as cells."""
    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_each_setting_is_compared_with_its_own_baseline(workflow_copy):
    """At 512 tokens the baseline is fp16-hs (fp16 returns NaN there): the kernel table and the
    summary's baseline column use it, not the default fp16. (It was lost once the config's integer
    window keys became strings in tables.json.)"""
    from quantstudy import render_formats

    readme = (workflow_copy / "results/fnet/README.md").read_text()
    kernel_rows = _table_rows(readme, "| Model, window | Target | Variant | sequence-axis DFT")
    assert sorted((r[1], r[2]) for r in kernel_rows) == [(t, v) for t in ("cpu-onnxruntime", "cpu-torch")
                                                          for v in ("fp16-hs", "fp8")]
    tables = json.loads((workflow_copy / "results/fnet/tables.json").read_text())
    # fp16 returns NaN at 512 (no top-1 at all); the baseline column must show fp16-hs's.
    hs_top1 = render_formats.value_range(r["mlm.top1_agreement"] for r in tables["quality"] if r["variant"] == "fp16-hs")
    assert hs_top1 is not None
    summary = {r[0]: r for r in _table_rows(readme, "| At a glance | baseline |")}
    assert summary["Masked-LM top-1 agreement with PyTorch fp32"][1] == render_formats.span(hs_top1, render_formats.pct)


def test_a_failed_first_kernel_row_renders(workflow_copy):
    """The kernel table's columns come from the study, not from its first row, which may be a failure."""
    from quantstudy import render

    tables = json.loads((workflow_copy / "results/fnet/tables.json").read_text())
    first = tables["kernels"][0]
    tables["kernels"][0] = {k: first[k] for k in ("target", "model", "setting", "variant", "source")} | {
        "status": "failed", "error": "RuntimeError: profiler crashed"}
    section = render.render_section(tables)  # raised on a failed first row before
    assert "RuntimeError: profiler crashed" in section
    header = next(line for line in section.splitlines() if line.startswith("| Model, window | Target | Variant |")
                  and "total" in line)
    assert all(g in header for g in tables["kernel_groups"]) and tables["kernel_groups"]


def test_the_readme_shows_the_plot_and_the_report_holds_each_studys_results(workflow_copy, tmp_path):
    """The README links the plot beside it; `snakemake --report` builds one self-contained HTML
    with the plot, the README as a page (plot inline), tables.json and audit.json."""
    import base64

    study = workflow_copy / "results/fnet"
    assert "](speed_quality.png)" in (study / "README.md").read_text()
    plot = (study / "speed_quality.png").read_bytes()
    assert plot.startswith(b"\x89PNG")
    page = (study / "README.html").read_text()
    assert f'src="data:image/png;base64,{base64.b64encode(plot).decode()}"' in page and "<table>" in page
    report = tmp_path / "report.html"
    proc = snakemake(workflow_copy, "--configfile", ".test/config.yaml", "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    html = report.read_text()
    for name in ("speed_quality.png", "README.html", "tables.json", "audit.json"):
        data = base64.b64encode((study / name).read_bytes()).decode()
        assert data in html, f"{name} is not in the report"
    assert "FP8 quantization studies, from pinned checkpoint" in html  # the front page, report/workflow.rst
    decision = json.loads((study / "tables.json").read_text())["decision"]
    assert f"FNet: {'ship' if decision['ship'] else 'do not ship'} fp8" in html  # each study's decision on it


def test_gemm_rule_times_the_recipe_layers_at_the_models_shapes(workflow_copy):
    """gemm.json of the tiny FNet (2 layers, hidden 64, intermediate 256) at 512 tokens: each FP8
    variant's calls are its recipe layers at [M, K, N] = [512, 64, 256] and [512, 256, 64], timed as
    two shapes of two GEMMs each; the variant that selects no layer is its own recorded failure; on
    both CPU backends FP8 is emulated (no FP8 GEMM ran), and ONNX Runtime ran the Q/DQ graph."""
    from quantstudy import bound
    from quantstudy.artifacts import read_json

    up, down = [512, 64, 256], [512, 256, 64]
    recipe = {f"fnet.encoder.layer.{i}.{p}": d for i in (0, 1) for p, d in
              (("intermediate.dense", up), ("output.dense", down))}
    doc = read_json(workflow_copy / "results/fnet/cpu-torch/fnet-base/w512/gemm.json", "gemm")
    main = doc["graphs"]["main"]
    assert sorted(main["variants"]) == ["fp8", "fp8-broken", "fp8-no-output-dense"]
    assert {c["layer"]: c["dims"] for c in main["variants"]["fp8"]["calls"]} == recipe
    assert {c["layer"]: c["dims"] for c in main["variants"]["fp8-no-output-dense"]["calls"]} == {
        k: d for k, d in recipe.items() if "intermediate" in k}
    broken = main["variants"]["fp8-broken"]
    assert broken["status"] == "failed" and "selects no layer" in broken["error"]
    assert sorted((s["dims"], s["copies"]) for s in main["shapes"].values()) == [(up, 2), (down, 2)]
    assert all(s["emulated"] and s["fp8_gemm"] is None for s in main["shapes"].values())
    assert main["variants"]["fp8"]["g"] == pytest.approx(bound.gemm_speedup(main["shapes"], main["variants"]["fp8"]["calls"])["g"])
    ort = read_json(workflow_copy / "results/fnet/cpu-onnxruntime/fnet-base/w512/gemm.json", "gemm")
    assert sorted(ort["graphs"]["main"]["variants"]) == ["fp8"] and ort["backend"] == "onnxruntime"
    assert all(any("QuantizeLinear" in r["name"] for r in s["fp8_ran"]) for s in ort["graphs"]["main"]["shapes"].values())


def test_every_speed_row_carries_its_bound_and_the_readme_shows_it(workflow_copy):
    """tables.json: the candidate's rows have f (from the baseline's kernels.json), g (from gemm.json)
    and 1 / ((1 - f) + f / g), or, where that profile disagrees with the baseline's timing (measured on a
    shared CPU, it may), the bound withheld for that reason; the README's speed table shows that cell
    beside x."""
    from quantstudy import bound, render, render_formats

    tables = json.loads((workflow_copy / "results/fnet/tables.json").read_text())
    rows = [r for r in tables["speed"] if r["variant"] == "fp8"]
    assert sorted(r["target"] for r in rows) == ["cpu-onnxruntime", "cpu-torch"]
    profiles = {(k["target"], k["model"], k["setting"], k["variant"]): k for k in tables["kernels"]}
    for r in rows:
        assert r["g_source"].endswith(f"{r['target']}/fnet-base/w512/gemm.json")
        assert r["f_source"].endswith(f"{r['target']}/fnet-base/w512/fp16-hs/kernels.json")  # the baseline at 512
        baseline_profile = profiles[(r["target"], r["model"], r["setting"], "fp16-hs")]
        agrees = bound.profile_agrees(baseline_profile["total_ms"] / baseline_profile["timed_ms"])
        assert baseline_profile["profile_agrees"] is agrees
        if not agrees:
            assert r["bound"] is None and r["bound_note"].startswith("withheld: the baseline's profile totals")
            continue
        assert 0 < r["f"] < 1 and r["f_kind"] == "exact" and r["fp8_emulated"] is True
        assert r["bound"] == pytest.approx(bound.amdahl_bound(r["f"], r["g"]))
        assert r["at_limit"] == (r["x"] >= tables["bound"]["at_limit"] * r["bound"])
        assert r["f_basis"] == {"cpu-torch": "by shape [M, K, N]", "cpu-onnxruntime": "by module name"}[r["target"]]
    fp16 = next(r for r in tables["speed"] if r["variant"] == "fp16" and r["target"] == "cpu-torch")
    assert fp16["bound"] is None and fp16["bound_note"] == "no FP8 layer"
    readme = (workflow_copy / "results/fnet/README.md").read_text()
    header = "| Model, window | Target | Baseline |"
    columns = [c.strip() for c in next(line for line in readme.splitlines() if line.startswith(header)).strip("|").split("|")]
    at = columns.index("Amdahl bound of x")
    macros = render.environment().get_template("macros.md.j2").module
    table = {(r[1]): r for r in _table_rows(readme, header)}
    for r in rows:
        assert table[r["target"]][at] == str(macros.bound_cell(r))
        assert (render_formats.times(r["bound"]) if r["bound"] is not None else "withheld") in table[r["target"]][at]
    assert "](../../docs/reading-a-study.md#the-amdahl-bound)" in readme  # the formula, written once:
    assert "1 / ((1 - f) + f / g)" in (workflow_copy / "docs/reading-a-study.md").read_text()


def test_a_study_that_does_not_profile_says_so_in_every_bound_cell_and_the_kernel_fold(workflow_copy, monkeypatch):
    """The FNet tables made again as a `timing.profile: false` run makes them (no kernels.json, no gemm.json
    among the inputs): every speed row keeps its x, its bound is left out for that reason, not "no FP8
    layer", and the README says why it has no kernel table."""
    from quantstudy import aggregate, artifacts, render

    monkeypatch.chdir(workflow_copy)  # the recorded input paths are the workflow's, relative to it
    tables = json.loads(Path("results/fnet/tables.json").read_text())
    params = json.loads(json.dumps(tables["provenance"]["params"]))
    params["study"]["timing"]["profile"] = False
    inputs = aggregate.inputs_of(tables) | {"kernels": [], "gemms": []}
    remade = tables | artifacts.plain(aggregate.tables(inputs, **params))
    assert len(remade["speed"]) == len(tables["speed"]) and not remade["kernels"]
    assert [r["x"] for r in remade["speed"]] == [r["x"] for r in tables["speed"]]
    assert {r["bound_note"] for r in remade["speed"]} == {"not profiled in this run (timing.profile: false)"}
    assert {r["bound"] for r in remade["speed"]} == {None}
    section = render.render_section(remade)
    assert "No engine was profiled in this run (`timing.profile: false`)" in section
    assert "Kernel time per call" not in section
    assert "Kernel time per call" in render.render_section(tables)


def test_noop_rerun_does_nothing(workflow_copy):
    proc = snakemake(workflow_copy, "-n", "--configfile", ".test/config.yaml")
    assert proc.returncode == 0
    assert "Nothing to be done (all requested files are present and up to date)" in proc.stdout + proc.stderr
    assert planned_jobs(proc.stdout + proc.stderr) == []
    # The same parser on the same run with one rule forced lists that rule's job and what follows it.
    forced = snakemake(workflow_copy, "-n", "--configfile", ".test/config.yaml", "--forcerun", "render")
    assert sorted(rule for rule, _ in planned_jobs(forced.stdout + forced.stderr)) == ["all", "audit", "render"]


def test_changing_one_variant_reruns_only_its_chain(workflow_copy):
    config = yaml.safe_load((workflow_copy / ".test/config.yaml").read_text())
    (workflow_copy / ".test/change.yaml").write_text(yaml.safe_dump(
        {"variants": {"fp8-no-output-dense": {"transforms": [{"fp8": {"exclude": ["*.output.dense", "*.0.intermediate.dense"]}}]}}}))
    config["studies"]["fnet"]["overrides"].append(".test/change.yaml")
    (workflow_copy / ".test/changed.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake(workflow_copy, "-n", "--configfile", ".test/changed.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = planned_jobs(proc.stdout + proc.stderr)
    per_variant = [(rule, w["variant"]) for rule, w in jobs if "variant" in w]
    assert sorted(per_variant) == sorted((r, "fp8-no-output-dense") for r in ("build", "time", "profile", "evaluate"))
    # `all` is the target rule: it runs no code. The GEMMs of the FP8 variants of its target, model
    # and setting are timed again: the variant's FP8 layers changed.
    assert sorted(rule for rule, w in jobs if "variant" not in w) == ["aggregate", "all", "audit", "front_page", "gemm", "plot",
                                                                       "render"]
    assert [w for rule, w in jobs if rule == "gemm"] == [{"study": "fnet", "target": "cpu-torch", "model": "fnet-base",
                                                           "setting": "w512"}]


def test_audit_traces_the_readme_to_pinned_inputs(workflow_copy, monkeypatch):
    report = json.loads((workflow_copy / "results/fnet/audit.json").read_text())
    assert report["ok"] and report["readme_matches_tables"] and report["files_checked"] > 20

    from quantstudy.audit import check_chain

    monkeypatch.chdir(workflow_copy)
    amax = workflow_copy / "results/fnet/fnet-base/calib/w512/amax.json"
    original = amax.read_text()
    try:
        amax.write_text(original.replace('"input_amax": ', '"input_amax": 1', 1))
        problems = check_chain("results/fnet/tables.json")["problems"]
        assert any("(results/fnet/fnet-base/calib/w512/amax.json) changed since the job that read it" in p
                   for p in problems), problems
    finally:
        amax.write_text(original)


def test_a_truncated_amax_file_is_named_rendered_and_fails_the_audit(workflow_copy, tmp_path):
    """A damaged artifact is reported where it is read, with its path and how to remake it: the FP8
    builds that read it fail with that sentence, aggregate lists it, the README shows it, and the
    audit fails the run. The other variants' results stand."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    amax = repo / "results/fnet/fnet-base/calib/w512/amax.json"
    amax.write_text(amax.read_text()[:200])
    proc = snakemake(repo, "--configfile", ".test/config.yaml", "--keep-going")
    assert proc.returncode != 0
    log = (repo / "logs/fnet/audit.log").read_text()
    assert "an input could not be read: results/fnet/fnet-base/calib/w512/amax.json: not valid JSON" in log
    build = json.loads((repo / "results/fnet/cpu-torch/fnet-base/w512/fp8/build.json").read_text())
    assert build["status"] == "failed" and "amax.json: not valid JSON" in build["error"]
    assert "snakemake --force results/fnet/fnet-base/calib/w512/amax.json" in build["error"]
    tables = json.loads((repo / "results/fnet/tables.json").read_text())
    assert [d["source"] for d in tables["damaged"]] == ["results/fnet/fnet-base/calib/w512/amax.json"]
    readme = (repo / "results/fnet/README.md").read_text()
    assert "| `results/fnet/fnet-base/calib/w512/amax.json` | " in readme
    assert json.loads((repo / "results/fnet/cpu-torch/fnet-base/w512/fp16/build.json").read_text())["status"] == "ok"


def test_a_result_edited_then_rerun_is_refused_and_fails_the_audit(workflow_copy, tmp_path):
    """An edited value in a measurement JSON, then `snakemake` again: the digest its job wrote no
    longer matches, so aggregate refuses the file instead of rendering the edited number, the README
    lists it, and the audit fails the run naming it."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    quality = repo / "results/fnet/cpu-torch/fnet-base/w512/fp8/quality.json"
    text = quality.read_text()
    edited = re.sub(r'"kl_mean": [0-9.e-]+', '"kl_mean": 0.125', text, count=1)
    assert edited != text
    quality.write_text(edited)
    proc = snakemake(repo, "--configfile", ".test/config.yaml", "--keep-going")
    assert proc.returncode != 0
    source = "results/fnet/cpu-torch/fnet-base/w512/fp8/quality.json"
    assert f"{source}: does not match its content_sha256" in (repo / "logs/fnet/audit.log").read_text()
    tables = json.loads((repo / "results/fnet/tables.json").read_text())
    assert [d["source"] for d in tables["damaged"]] == [source]
    assert f"| `{source}` | " in (repo / "results/fnet/README.md").read_text()


def _audit_cli(repo: Path, *args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "quantstudy.audit", *args], cwd=repo, capture_output=True, text=True)


def test_the_audit_command_checks_a_study_and_prints_one_numbers_chain(workflow_copy):
    proc = _audit_cli(workflow_copy, "check", "results/fnet", "--configfile", ".test/config.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # A number of the speed table, as the README shows it: the rows it can be, and each one's chain
    # down to the pinned checkpoint, with the job, machine and software of every step.
    tables = json.loads((workflow_copy / "results/fnet/tables.json").read_text())
    row = next(r for r in tables["speed"] if r["variant"] == "fp8" and r["status"] == "ok")
    from quantstudy import render_formats

    shown = render_formats.ms(row["variant_ms"])
    assert shown in (workflow_copy / "results/fnet/README.md").read_text()
    proc = _audit_cli(workflow_copy, "chain", "results/fnet/README.md", shown)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"column variant_ms = {row['variant_ms']!r}, from {row['source']}" in proc.stdout
    assert "rule time, " in proc.stdout and "rule build, " in proc.stdout and "rule fetch_checkpoint, " in proc.stdout
    assert "pinned: quantstudy-tiny/fnet-base at " in proc.stdout


def test_the_chain_names_the_first_broken_link(workflow_copy, tmp_path):
    """An engine file changed after its build: the chain of a timing that read it says where."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    timing = "results/fnet/cpu-torch/fnet-base/w512/fp8/timing.json"
    build = json.loads((repo / "results/fnet/cpu-torch/fnet-base/w512/fp8/build.json").read_text())
    engine = build["graphs"]["main"]["engine"]
    (repo / engine).write_bytes((repo / engine).read_bytes() + b"\0")
    proc = _audit_cli(repo, "chain", timing)
    assert proc.returncode == 1
    broken = f"engine of graph main ({engine}) changed since the job that read it recorded its sha256"
    assert f"first broken link: results/fnet/cpu-torch/fnet-base/w512/fp8/build.json: {broken}" in proc.stderr
    proc = _audit_cli(repo, "check", "results/fnet", "--configfile", ".test/config.yaml")
    assert proc.returncode == 1 and broken in proc.stdout
    # A job that opens it refuses it, naming the build to redo.
    proc = snakemake(repo, "--configfile", ".test/config.yaml", "--forcerun", "time", "--keep-going", timing)
    doc = json.loads((repo / timing).read_text())
    assert doc["status"] == "failed" and f"{engine} is not the file the build of fp8 made" in doc["error"]


def test_reproduce_reruns_a_sample_of_the_measurements_and_they_agree(workflow_copy, tmp_path):
    """An untampered run: the re-executed evaluation gives every number of its quality.json bit for bit."""
    proc = _audit_cli(workflow_copy, "reproduce", "results/fnet", "--configfile", ".test/config.yaml",
                      "--evaluate", "1", "--time", "0", "--scratch", str(tmp_path / "scratch"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "scratch/reproduce.json").read_text())
    [job] = report["jobs"]
    assert job["rule"] == "evaluate" and job["ok"] and job["differences"] == []
    rerun = json.loads((tmp_path / "scratch" / job["path"]).read_text())
    recorded = json.loads((workflow_copy / job["path"]).read_text())
    assert rerun["provenance"]["started"] > recorded["provenance"]["finished"]  # it did run again
    assert "every re-executed job agrees with its record" in proc.stdout


def test_a_forged_result_with_its_digest_recomputed_is_caught_by_reproduce(workflow_copy, tmp_path):
    """A quality value, and a timing whose samples, ms and x were all forged consistently, with their
    digests recomputed, then `snakemake` again: every hash on the chain and every derived number agree
    (the audit passes), and re-executing the two jobs names the quality value, the ms and x."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    variant = "results/fnet/cpu-torch/fnet-base/w512/fp8"
    rewrite_json(repo / variant / "quality.json", lambda d: d["blocks"]["mlm"].update(top1_agreement=0.999))
    # 10 times faster: a 4x forgery sat inside the noise once (2026-12-06, a 2-core VM whose own speed moves
    # 1.5x, benchmarks/noise.py --drift); the smallest forgery caught is reproduce_noise.py's figure, not this test's
    rewrite_json(repo / variant / "timing.json", lambda d: forge_faster(d, 10))
    proc = snakemake(repo, "--configfile", ".test/config.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((repo / "results/fnet/audit.json").read_text())["ok"]
    proc = _audit_cli(repo, "reproduce", "results/fnet", "--configfile", ".test/config.yaml", "--jobs",
                      f"{variant}/quality.json", f"{variant}/timing.json", "--scratch", str(tmp_path / "scratch"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"DIFFERS evaluate: {variant}/quality.json" in proc.stdout
    assert "blocks.mlm.top1_agreement: recorded 0.999, reproduced" in proc.stdout
    assert f"DIFFERS time: {variant}/timing.json" in proc.stdout
    assert "graphs.main.x: recorded" in proc.stdout and "graphs.main.variant_ms.median_ms: recorded" in proc.stdout


def test_a_forged_x_or_table_cell_fails_the_audit_that_makes_it_again(workflow_copy, tmp_path):
    """Derived numbers are made again from what they derive from, with no tolerance read from the record:
    an x edited in a timing file (its digest recomputed, the workflow rerun) is not the ratio of its
    samples; a table cell and the decision edited in tables.json (digest recomputed, the README rendered
    from it) are not what its input files give."""
    import shutil

    from quantstudy.artifacts import read_json

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    timing = "results/fnet/cpu-torch/fnet-base/w512/fp8/timing.json"
    rewrite_json(repo / timing, lambda d: d["graphs"]["main"].update(x=5.0, x_min=4.0, x_max=6.0))
    proc = snakemake(repo, "--configfile", ".test/config.yaml", "--keep-going")
    assert proc.returncode != 0
    log = (repo / "logs/fnet/audit.log").read_text()
    assert f"{timing}: graph main's x is 5.0, but its round samples give" in log
    assert f"{timing}: graph main's x_max is 6.0" in log

    repo = tmp_path / "repo2"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    tables = read_json(repo / "results/fnet/tables.json", "tables")
    row = next(i for i, r in enumerate(tables["speed"]) if r["variant"] == "fp8" and r["status"] == "ok")
    recorded_x = tables["speed"][row]["x"]

    def forge_tables(d):
        d["speed"][row]["x"] = 1.5
        d["decision"]["ship"] = True
    rewrite_json(repo / "results/fnet/tables.json", forge_tables)
    proc = snakemake(repo, "--configfile", ".test/config.yaml", "--forcerun", "render", "--keep-going")
    assert proc.returncode != 0
    log = (repo / "logs/fnet/audit.log").read_text()
    assert "is not what the templates render" not in log  # the README was rendered from the forged tables
    assert f"results/fnet/tables.json: speed.{row}.x is 1.5, but its input files give {recorded_x!r}" in log
    assert "results/fnet/tables.json: decision.ship is True, but its input files give False" in log
    proc = _audit_cli(repo, "check", "results/fnet", "--configfile", ".test/config.yaml")
    assert proc.returncode == 1 and "decision.ship is True" in proc.stdout


def test_a_threshold_forged_in_the_recorded_arguments_fails_the_audit_against_the_config(workflow_copy, tmp_path,
                                                                                        monkeypatch):
    """tables.json made again with care from a study whose speed threshold was lowered (every cell and the
    decision what its input files give with that study, the digest recomputed, the README rendered from
    it): it agrees with itself, and the audit, which takes the arguments from the config files, names
    the threshold."""
    import shutil

    from quantstudy import aggregate, artifacts

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    monkeypatch.chdir(repo)  # the recorded input paths are the workflow's, relative to it
    params = json.loads(Path("results/fnet/tables.json").read_text())["provenance"]["params"]
    i, speed = next((i, c) for i, c in enumerate(params["study"]["decision"]["conditions"]) if c["table"] == "speed")
    configured = speed["threshold"]

    def lower_the_threshold(d):
        d["provenance"]["params"]["study"]["decision"]["conditions"][i]["threshold"] = 0.01
        d.update(artifacts.plain(aggregate.tables(aggregate.inputs_of(d), **d["provenance"]["params"])))
    rewrite_json(repo / "results/fnet/tables.json", lower_the_threshold)
    assert json.loads(Path("results/fnet/tables.json").read_text())["decision"]["conditions"][i]["pass"]
    proc = snakemake(repo, "--configfile", ".test/config.yaml", "--forcerun", "render", "--keep-going")
    assert proc.returncode != 0
    want = f"made with study.decision.conditions.{i}.threshold = 0.01, but the run config gives {configured!r}"
    assert want in (repo / "logs/fnet/audit.log").read_text()
    proc = _audit_cli(repo, "check", "results/fnet", "--configfile", ".test/config.yaml")
    assert proc.returncode == 1 and want.replace("the run config", ".test/config.yaml") in proc.stdout


def test_a_forged_sample_with_a_consistent_hash_fails_the_audit_that_draws_the_set_again(workflow_copy, tmp_path):
    """One held-out passage replaced, its sha256 made that of the new text with the family's own hash
    (so every job reads the list and agrees with it), the workflow rerun on it: drawing the set again
    from the pinned dataset's files gives the original passage, and the audit names the sample."""
    import shutil

    from quantstudy import families

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    heldout = "results/fnet/data/heldout.json"
    original = json.loads((repo / heldout).read_text())["samples"][2]

    def replace_passage(d):
        d["samples"][2]["text"] = "a passage the pinned dataset does not hold"
        [d["samples"][2]["sha256"]] = families.get("fnet").content_sha256([d["samples"][2]])
    rewrite_json(repo / heldout, replace_passage)
    proc = snakemake(repo, "--configfile", ".test/config.yaml", "--keep-going")
    assert proc.returncode != 0
    log = (repo / "logs/fnet/audit.log").read_text()
    assert (f"{heldout}: sample 2 is {original['id']!r} (sha256 ") in log
    assert "but drawing the set again from quantstudy-tiny/wikitext at " in log
    assert f"gives {original['id']!r} (sha256 {original['sha256'][:12]}) (1 of " in log


def test_a_probe_that_differs_between_timing_and_evaluation_fails_the_audit(workflow_copy, tmp_path):
    """TEST01: the timed and the evaluated engine are one file, and gave both jobs the same probe."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    variant = "results/fnet/cpu-torch/fnet-base/w512/fp8"
    timing = json.loads((repo / variant / "timing.json").read_text())
    quality = json.loads((repo / variant / "quality.json").read_text())
    assert timing["probe"] == quality["probe"] and timing["probe"]["main"]
    rewrite_json(repo / variant / "timing.json",
           lambda d: next(iter(d["probe"]["main"].values()))["values"].__setitem__(0, 1e3))
    proc = snakemake(repo, "--configfile", ".test/config.yaml", "--keep-going")
    assert proc.returncode != 0
    log = (repo / "logs/fnet/audit.log").read_text()
    assert (f"{variant}/timing.json and {variant}/quality.json got different answers from the engine of "
            f"{variant}/build.json") in log


def test_timing_and_evaluation_that_opened_different_compiled_programs_fail_the_audit(workflow_copy, tmp_path):
    """TEST01 for a compiled engine: the timing and the evaluation job name the compiled program they
    opened, and it must be one file (here the evaluation claims another)."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    variant = "results/fnet/cpu-torch/fnet-base/w512/fp8"
    rewrite_json(repo / variant / "quality.json", lambda d: d.update(compiled_sha256={"main": "0" * 64}))
    proc = snakemake(repo, "--configfile", ".test/config.yaml", "--keep-going")
    assert proc.returncode != 0
    log = (repo / "logs/fnet/audit.log").read_text()
    assert (f"{variant}/timing.json and {variant}/quality.json opened different compiled programs of "
            f"{variant}/build.json") in log


def test_a_timing_job_whose_opening_autotuned_again_fails_the_audit(workflow_copy, tmp_path):
    """No measurement job compiles or autotunes: a timing job that records its opening redid its build's
    work (Runner.open_redone) fails the audit, which names the build to rerun."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    variant = "results/fnet/cpu-torch/fnet-base/w512/fp8"
    assert json.loads((repo / variant / "timing.json").read_text())["open_redone"] == {"fp16-hs": {}, "fp8": {}}
    rewrite_json(repo / variant / "timing.json", lambda d: d.update(open_redone={"fp16-hs": {}, "fp8": {"main": {"autotuning": 2.5}}}))
    proc = snakemake(repo, "--configfile", ".test/config.yaml", "--keep-going")
    assert proc.returncode != 0
    assert (f"{variant}/timing.json: opening the fp8 main engine redid work its build should have done (autotuning "
            f"2.5 s): the build's compiled program lacks what this job ran; rerun it: snakemake --force "
            f"{variant}/build.json") in (repo / "logs/fnet/audit.log").read_text()


def test_a_tampered_revision_fails_the_audit(workflow_copy, tmp_path):
    """checkpoint.json made to say another revision, its digest recomputed: its snapshot and the
    study's pin both contradict it, whether or not the jobs after it are rerun."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    checkpoint = repo / "results/fnet/fnet-base/checkpoint.json"
    pinned = json.loads(checkpoint.read_text())["revision"]
    rewrite_json(checkpoint, lambda d: d.update(revision="0" * 40))
    proc = _audit_cli(repo, "check", "results/fnet", "--configfile", ".test/config.yaml")
    assert proc.returncode == 1
    assert f"says revision {'0' * 40}, but its snapshot is commit {pinned}" in proc.stdout
    assert (f"results/fnet/fnet-base/checkpoint.json: fetched quantstudy-tiny/fnet-base at {'0' * 40}, but the "
            f"study pins {pinned}") in proc.stdout


def test_the_readme_lists_the_published_numbers_none_reproduced_on_tiny_models(workflow_copy):
    """A tiny run reproduces none of the write-up's B200 / B300 numbers: one line says so and links the
    file that transcribes them; the fold under it lists each one with the rows it is compared with (no
    reproduced column); tables.json keeps each one, and the audit traces one to its file."""
    readme = (workflow_copy / "results/fnet/README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("**Published numbers:**"))
    assert ("this run reproduces none of them: this run's weights are tiny-random-init, not the write-up's "
            "(checkpoint). A run of `config/b200.yaml` or `config/b300.yaml` does.") in line
    assert "[`config/published/fnet.yaml`](../../config/published/fnet.yaml)" in line
    assert "Published vs reproduced" not in readme
    fold = readme[readme.index("<details><summary>The write-up's numbers: 0 of "):]
    fold = fold[:fold.index("</details>")]
    assert "base, 512 \\| B200 / fp32 | speed `variant_ms`: b200-trt11.4, fnet-base, w512, fp32 | ms | 2.838 |" in fold
    tables = json.loads((workflow_copy / "results/fnet/tables.json").read_text())
    assert tables["published_from"]["file"] == "config/published/fnet.yaml"
    assert {r["status"] for r in tables["published"]} == {"not reproduced here"}
    assert tables["provenance"]["inputs"]["published[0]"]["path"] == "config/published/fnet.yaml"
    proc = _audit_cli(workflow_copy, "chain", "results/fnet/tables.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "config/published/fnet.yaml" in proc.stdout
    from quantstudy import audit_number

    hit = next(h for h in audit_number.find_number(tables, "2.838") if h["table"] == "published")
    assert hit["row"] == "b200-trt11.4 | fnet-base, `w512` | `fp32` (published as base, 512 | B200 / fp32)"
    assert (hit["column"], hit["value"], hit["source"]) == ("published_min", 2.838, "config/published/fnet.yaml")


def test_editing_the_published_numbers_reruns_aggregate_plot_render_and_audit(workflow_copy):
    import os

    path = workflow_copy / "config/published/fnet.yaml"
    original, stat = path.read_text(), path.stat()
    try:
        path.write_text(original.replace('fp32: "2.838"', 'fp32: "2.839"', 1))
        proc = snakemake(workflow_copy, "-n", "--configfile", ".test/config.yaml")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sorted(rule for rule, _ in planned_jobs(proc.stdout + proc.stderr)) == ["aggregate", "all", "audit", "front_page",
                                                                                   "plot", "render"]
    finally:
        path.write_text(original)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_an_edited_readme_number_fails_the_audit(workflow_copy, tmp_path):
    """A number changed in the rendered README, then `snakemake` again: the README is no longer what
    the templates make of tables.json, and the audit (whose input it is) fails the run."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    from quantstudy import render_formats

    readme = repo / "results/fnet/README.md"
    tables = json.loads((repo / "results/fnet/tables.json").read_text())
    shown = render_formats.ms(next(r for r in tables["speed"] if r["variant"] == "fp8" and r["status"] == "ok")["variant_ms"])
    text = readme.read_text()
    assert shown in text
    readme.write_text(text.replace(shown, "0.001", 1))
    proc = snakemake(repo, "--configfile", ".test/config.yaml")
    assert proc.returncode != 0
    assert ("results/fnet/README.md is not what the templates render from results/fnet/tables.json"
            in (repo / "logs/fnet/audit.log").read_text())
    assert _audit_cli(repo, "check", "results/fnet", "--configfile", ".test/config.yaml").returncode == 1


def test_each_built_variant_has_a_measurements_record_read_from_its_files(workflow_copy):
    """measurements.json beside each build.json: the FP8 layers, their dtypes, the amax file's sha256, and
    for the ONNX target the opset and the Q/DQ ops counted in the exported graph; the README links each."""
    from quantstudy.artifacts import sha256_file

    w512 = workflow_copy / "results/fnet/{}/fnet-base/w512/{}"
    build = json.loads((Path(str(w512).format("cpu-onnxruntime", "fp8")) / "build.json").read_text())
    export = json.loads((workflow_copy / "results/fnet/fnet-base/w512/onnx/fp8/export.json").read_text())
    ort = json.loads((Path(str(w512).format("cpu-onnxruntime", "fp8")) / "measurements.json").read_text())
    assert ort["status"] == "ok" and ort["fp8_layers"] == {"count": len(build["fp8_layers"]),
                                                           "names": sorted(build["fp8_layers"])}
    assert ort["amax"]["path"] == build["provenance"]["inputs"]["amax"]["path"]
    assert ort["amax"]["sha256"] == sha256_file(workflow_copy / ort["amax"]["path"])
    graph, ops = ort["onnx"]["main"], export["graphs"]["main"]["op_counts"]
    assert graph["opset"] == 21 and graph["sha256"] == export["graphs"]["main"]["onnx_sha256"]
    assert graph["QuantizeLinear"] == {"count": ops["QuantizeLinear"], "output_types": {"float8_e4m3fn": ops["QuantizeLinear"]}}
    assert graph["DequantizeLinear"] == {"count": ops["DequantizeLinear"], "output_types": {"float16": ops["DequantizeLinear"]}}
    fp8 = ort["graphs"]["main"]["layers"]["fp8_linear"]
    assert fp8 == {"layers": len(build["fp8_layers"]), "weight": ["float8_e4m3fn"], "activation": ["float8_e4m3fn"],
                   "dequantized_to": ["float16"]}
    assert ort["builder"]["graph_optimization_level"] == "ORT_ENABLE_ALL" and ort["builder"]["intra_op_num_threads"] == 1

    torch_fp8 = json.loads((Path(str(w512).format("cpu-torch", "fp8")) / "measurements.json").read_text())
    assert torch_fp8["onnx"] == "not exported" and torch_fp8["fp8_path"].startswith("fake-quant")
    assert torch_fp8["graphs"]["main"]["layers"]["fp8_linear"]["weight"] == ["float8_e4m3fn"]
    assert torch_fp8["builder"] == {"device": "cpu", "torch_compile": False, "compiled_program": "none",
                                    "cuda_graph": False}
    fp16 = json.loads((Path(str(w512).format("cpu-torch", "fp16-hs")) / "measurements.json").read_text())
    assert fp16["amax"] == "none" and fp16["fp8_layers"] == {"count": 0, "names": "none"} and fp16["fp8_path"] == "none"
    assert fp16["graphs"]["main"]["layers"]["linear"]["weight"] == ["float16"]
    broken = json.loads((Path(str(w512).format("cpu-torch", "fp8-broken")) / "measurements.json").read_text())
    assert broken["status"] == "failed" and "selects no layer" in broken["error"]

    readme = (workflow_copy / "results/fnet/README.md").read_text()
    row = next(line for line in readme.splitlines()
               if line.startswith("| cpu-onnxruntime | fnet-base, `w512` | fp8 |") and "measurements.json" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == str(len(build["fp8_layers"])) and cells[7] == "21"
    assert cells[8] == f"{ops['QuantizeLinear']} / {ops['DequantizeLinear']}"
    link = re.search(r"\]\(([^)]+)\)", cells[9]).group(1)
    assert link == "cpu-onnxruntime/fnet-base/w512/fp8/measurements.json"
    assert (workflow_copy / "results/fnet" / link).is_file()


def test_sample_lists_are_linked_with_their_counts_and_in_a_quality_numbers_chain(workflow_copy):
    from quantstudy.artifacts import sha256_file

    readme = (workflow_copy / "results/fnet/README.md").read_text()
    for name, used_for in (("calibration", "calibration"), ("heldout", "evaluation"), ("sts", "evaluation")):
        samples = json.loads((workflow_copy / f"results/fnet/data/{name}.json").read_text())["samples"]
        row = next(line for line in readme.splitlines() if line.startswith(f"| [`data/{name}.json`](data/{name}.json) |"))
        assert f"| {used_for} | {len(samples)} |" in row
        assert sha256_file(workflow_copy / f"results/fnet/data/{name}.json") in row
    quality = "results/fnet/cpu-torch/fnet-base/w512/fp8/quality.json"
    recorded = json.loads((workflow_copy / quality).read_text())["provenance"]["inputs"]["heldout"]
    assert recorded == {"path": "results/fnet/data/heldout.json",
                        "sha256": sha256_file(workflow_copy / "results/fnet/data/heldout.json")}
    proc = _audit_cli(workflow_copy, "chain", quality)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == "results/fnet/data/heldout.json")
    assert "rule fetch_dataset, " in lines[at + 1]


def _edit_an_id(text: str) -> str:
    """A user's edit: one sample's id changed in place."""
    return re.sub(r'"id": (\d+),', lambda m: f'"id": {int(m.group(1)) + 1000},', text, count=1)


def _rewrite_a_hash(text: str) -> str:
    """One sample's sha256 changed and the file written again the way its job writes it (its digest then
    matches): a list that looks whole, and that only the per-sample check can tell from the drawn one."""
    from quantstudy import artifacts

    doc = json.loads(text)
    doc["samples"][0]["sha256"] = "0" * 64
    doc[artifacts.DIGEST] = artifacts.content_digest(doc)
    return json.dumps(doc, indent=1) + "\n"


@pytest.mark.parametrize("tamper, refusal", [
    (_edit_an_id, "results/fnet/data/heldout.json: does not match its content_sha256"),
    (_rewrite_a_hash, "results/fnet/data/heldout.json: sample"),
])
def test_a_sample_list_tampered_then_rerun_is_refused_and_the_audit_names_it(workflow_copy, tmp_path, tamper, refusal):
    """A sample list changed after a finished run, then `snakemake` again: the jobs that read it refuse it
    with the reason, and the audit fails naming the list as the link that changed under the quality
    numbers. (Before each job recomputed every sample's hash, a rewritten hash passed: the rerun
    recomputed everything from the edited list and the audit came out clean.)"""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    heldout = repo / "results/fnet/data/heldout.json"
    text = heldout.read_text()
    heldout.write_text(tamper(text))
    assert heldout.read_text() != text
    proc = snakemake(repo, "--configfile", ".test/config.yaml", "--keep-going")
    assert proc.returncode != 0
    assert refusal in (repo / "logs/fnet/fnet-base/w512/reference.log").read_text()
    proc = _audit_cli(repo, "check", "results/fnet", "--configfile", ".test/config.yaml")
    assert proc.returncode == 1
    assert ("results/fnet/cpu-torch/fnet-base/w512/fp8/quality.json: input heldout (results/fnet/data/heldout.json) "
            "changed since the job that read it recorded its sha256") in proc.stdout


def _job_intervals(repo: Path) -> list[tuple[str, str, object, object]]:
    """(rule, artifact, started, finished) of every job that wrote a JSON of the fnet study, from its provenance."""
    from datetime import datetime

    jobs = []
    for path in sorted((repo / "results/fnet").rglob("*.json")):
        prov = json.loads(path.read_text()).get("provenance") if path.name != "tables.json" else None
        if prov and prov.get("rule") not in (None, "aggregate", "audit"):
            jobs.append((prov["rule"], str(path.relative_to(repo)), datetime.fromisoformat(prov["started"]),
                         datetime.fromisoformat(prov["finished"])))
    return jobs


def _measuring_intervals(repo: Path) -> list[tuple[str, object, object]]:
    """(artifact, started, finished) of every measurement (`measuring` in a timing, kernels or gemm JSON)."""
    from datetime import datetime

    spans = []
    for path in sorted((repo / "results/fnet").rglob("*.json")):
        doc = json.loads(path.read_text())
        measuring = doc.get("measuring") if isinstance(doc, dict) else None
        for m in measuring if isinstance(measuring, list) else [measuring] if measuring else []:
            spans.append((str(path.relative_to(repo)), datetime.fromisoformat(m["started"]),
                          datetime.fromisoformat(m["finished"])))
    return sorted(spans, key=lambda s: s[1])


def test_measurements_never_overlap_while_other_jobs_run_in_parallel(workflow_copy):
    """A CPU measurement takes the cores alone (timing.device_lock): no two measurements ran at once, and
    no other job ran while one measured (each holds the cores shared for its whole run); jobs did run
    side by side (--cores 2), measurement jobs among them while neither measured."""
    import itertools

    spans = _measuring_intervals(workflow_copy)
    # 7 variant x target pairs (.test/fnet.yaml), each timed and profiled (fp8-broken's build fails: it is not
    # measured); the GEMMs of both targets
    assert len({path for path, _, _ in spans}) == 14
    for a, b in zip(spans, spans[1:]):
        assert a[2] <= b[1], f"{a[0]} ({a[1]} to {a[2]}) overlaps {b[0]} ({b[1]} to {b[2]})"
    others = [j for j in _job_intervals(workflow_copy) if j[0] not in ("time", "profile", "gemm")]
    for path, start, end in spans:
        beside = [j[1] for j in others if j[2] < end and start < j[3]]
        assert not beside, f"{path} measured from {start} to {end} while {beside} ran"
    jobs = _job_intervals(workflow_copy)
    overlapping = [(a[1], b[1]) for a, b in itertools.combinations(jobs, 2) if a[2] < b[3] and b[2] < a[3]]
    assert overlapping, "no two jobs ran at once: the run shows nothing about the turns"


def test_repeats_time_each_variant_in_separate_jobs_and_render_their_spread(workflow_copy, tmp_path):
    """`--config timing_repeats=2` over the run above: one more timing job per timed variant (the
    first ones are kept), each its own job; tables.json and the README show x across the two."""
    import shutil
    import statistics

    from quantstudy import render_formats

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    args = ("--configfile", ".test/config.yaml", "--config", "timing_repeats=2")
    proc = snakemake(repo, "-n", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = planned_jobs(proc.stdout + proc.stderr)
    timed = sorted((w["target"], w["variant"]) for rule, w in jobs if rule == "time")
    assert len(timed) == 7 and {w["repeat"] for rule, w in jobs if rule == "time"} == {"-r2"}
    assert sorted(rule for rule, _ in jobs if rule != "time") == ["aggregate", "all", "audit", "front_page", "plot", "render"]
    proc = snakemake(repo, *args)
    assert proc.returncode == 0, proc.stderr[-4000:]

    tables = json.loads((repo / "results/fnet/tables.json").read_text())
    assert tables["spec"]["timing"]["repeats"] == 2
    measuring = [s for s in _measuring_intervals(repo) if s[0].endswith(("/timing.json", "/timing-r2.json"))]
    assert len(measuring) == 12  # 7 variants, 2 jobs each; fp8-broken's build failed, so it measured nothing
    assert all(a[2] <= b[1] for a, b in zip(measuring, measuring[1:]))
    ok_rows = [r for r in tables["speed"] if r["status"] == "ok"]
    assert len(ok_rows) == 6 and [r["source"] for r in tables["speed"] if r["status"] != "ok"] == [
        f"results/fnet/cpu-torch/fnet-base/w512/fp8-broken/{name}" for name in ("timing.json", "timing-r2.json")]
    for row in ok_rows:
        docs = [json.loads((repo / s).read_text()) for s in row["timing_sources"]]
        assert [d["repeat"] for d in docs] == [d["provenance"]["params"]["repeat"] for d in docs] == [1, 2]
        assert docs[0]["provenance"]["started"] != docs[1]["provenance"]["started"]
        xs = [d["graphs"]["main"]["x"] for d in docs]
        assert row["repeats"] == 2 and row["x_by_repeat"] == xs and row["x"] == statistics.median(xs)
        assert row["x_jobs_spread"] == (max(xs) - min(xs)) / statistics.median(xs)

    readme = (repo / "results/fnet/README.md").read_text()
    fp8 = [r for r in ok_rows if r["variant"] == "fp8"]
    spread = render_formats.value_range(r["x_jobs_spread"] for r in fp8)
    assert f"Across timing jobs, fp8's x moved by {render_formats.span(spread, render_formats.pct)}" in readme
    assert "spread of x across timing jobs was not measured" not in readme
    for r in fp8:
        assert (f"| {render_formats.times(r['x_jobs_min'])} to {render_formats.times(r['x_jobs_max'])} "
                f"({render_formats.pct(r['x_jobs_spread'])}) |") in readme
    assert json.loads((repo / "results/fnet/audit.json").read_text())["ok"]


def test_rebuild_evaluates_job_two_on_its_own_build_and_the_readme_says_build_to_build(workflow_copy, tmp_path):
    """`evaluation: {repeats: 2, rebuild: true}` over the run above: one rebuild job per evaluated engine
    (rebuild-r2/, its own engine folders) and one more evaluation job that opens it; the timing and the
    first evaluation keep the first build; the README calls the range across builds; the audit passes and
    `audit chain` traces a number of such a row."""
    import shutil

    from quantstudy import families, paths
    from quantstudy.config import quality_columns

    repo = tmp_path / "repo"
    shutil.copytree(workflow_copy, repo, symlinks=True)
    (repo / "rebuild.yaml").write_text("evaluation: {repeats: 2, rebuild: true}\n")
    run = yaml.safe_load((repo / ".test/config.yaml").read_text())
    run["studies"]["fnet"]["overrides"].append("rebuild.yaml")
    (repo / "rebuild-config.yaml").write_text(yaml.safe_dump(run))
    args = ("--configfile", "rebuild-config.yaml")
    proc = snakemake(repo, "-n", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = planned_jobs(proc.stdout + proc.stderr)
    rebuilt = sorted((w["target"], w["variant"]) for rule, w in jobs if rule == "rebuild")
    assert sorted((w["target"], w["variant"]) for rule, w in jobs if rule == "evaluate") == rebuilt
    assert len(rebuilt) == 9 and {w["repeat"] for rule, w in jobs if rule in ("rebuild", "evaluate")} == {"-r2"}
    assert sorted(rule for rule, _ in jobs if rule not in ("rebuild", "evaluate")) == [
        "aggregate", "all", "audit", "front_page", "plot", "render"]
    proc = snakemake(repo, *args)
    assert proc.returncode == 0, proc.stderr[-4000:]

    tables = json.loads((repo / "results/fnet/tables.json").read_text())
    assert tables["spec"]["evaluation"] == {"repeats": 2, "rebuild": True}
    ok = [r for r in tables["quality"] if r["status"] == "ok"]
    assert len(ok) == 7
    for row in ok:
        first = row["source"].replace("/quality.json", "/build.json")
        rebuild = paths.REBUILD.format(**{k: row[k] for k in paths.VARIANT_FIELDS}, study="fnet", repeat="-r2")
        assert row["quality_builds"] == [first, rebuild] and rebuild == first.replace("/build.json", "/rebuild-r2/build.json")
        q1, q2 = (json.loads((repo / s).read_text()) for s in row["quality_sources"])
        assert q1["provenance"]["inputs"]["build"]["path"] == first and q2["provenance"]["inputs"]["build"]["path"] == rebuild
        if row["variant"] != "fp16-hs":  # quality_against: the second job compares with fp16-hs's second build
            assert q2["provenance"]["inputs"]["against_fp16-hs"]["path"].endswith("/fp16-hs/rebuild-r2/build.json")
        b1, b2 = (json.loads((repo / p).read_text()) for p in (first, rebuild))
        engines = [Path(b["graphs"]["main"]["engine"]) for b in (b1, b2)]
        assert engines[0].parent.parent == Path(first).parent and engines[1].parent.parent == Path(rebuild).parent
        assert all((repo / e).is_file() for e in engines) and not (repo / engines[0]).samefile(repo / engines[1])
        assert b2["provenance"]["started"] > b1["provenance"]["finished"]
        assert (repo / rebuild).parent.joinpath("measurements.json").is_file()
        timing = repo / row["source"].replace("/quality.json", "/timing.json")
        if timing.exists():
            assert json.loads(timing.read_text())["provenance"]["inputs"]["build"]["path"] == first
    columns = {k for row in tables["quality"] for k in row}
    declared = families.get("fnet").quality_columns(["heldout", "sts"], ["fp16-hs"])
    assert "quality_builds" in columns and columns - quality_columns(declared) == {"window"}

    readme = (repo / "results/fnet/README.md").read_text()
    assert "- Quality across builds: 7 engines were each built and evaluated 2 times, every evaluation job on its own build" in readme
    assert "build to build" in readme and "not the re-evaluation of one engine" in readme
    assert json.loads((repo / "results/fnet/audit.json").read_text())["ok"]
    proc = _audit_cli(repo, "check", "results/fnet", "--configfile", "rebuild-config.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # A number of a rebuilt row: its chain goes down to the first build it came from, every hash matching.
    fp8 = next(r for r in ok if r["target"] == "cpu-torch" and r["variant"] == "fp8")
    shown = re.findall(r"\[([^\]]+)\]\(cpu-torch/fnet-base/w512/fp8/quality\.json\)", readme)
    assert shown
    proc = _audit_cli(repo, "chain", "results/fnet/README.md", shown[0])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"from {fp8['source']}" in proc.stdout and "results/fnet/cpu-torch/fnet-base/w512/fp8/build.json" in proc.stdout


def test_the_speed_table_has_only_the_columns_a_decision_may_name(workflow_copy):
    """config.SPEED_COLUMNS is what the config check lets a decision condition name: a column aggregate
    adds must be listed there, or a condition on it would be refused."""
    from quantstudy.config import SPEED_COLUMNS

    tables = json.loads((workflow_copy / "results/fnet/tables.json").read_text())
    columns = {k for row in tables["speed"] for k in row}
    assert {"x", "x_min", "variant_ms", "bound", "g", "status"} <= columns
    assert columns - SPEED_COLUMNS == {"window"}  # the study's one shape key


def test_the_quality_table_has_the_columns_the_family_declares(workflow_copy):
    """config.quality_columns(FNet's declaration) is what a quality condition may name: every column of a
    run's quality table is one of them, and each declared metric is there."""
    from quantstudy import families
    from quantstudy.config import QUALITY_ROW_COLUMNS, quality_columns

    tables = json.loads((workflow_copy / "results/fnet/tables.json").read_text())
    columns = {k for row in tables["quality"] for k in row}
    declared = families.get("fnet").quality_columns(["heldout", "sts"], ["fp16-hs"])
    assert columns - quality_columns(declared) == {"window"}
    own = {f"{b}.{m}" for b, metrics in declared.blocks.items() for m in metrics}
    # quality_builds: only where evaluation jobs opened separate builds (test_rebuild_evaluates_job_two_...)
    assert own | {"cls_vs_fp16-hs.relative_error", "nonfinite.batch", "reference.sts.spearman"} | (
        QUALITY_ROW_COLUMNS - {"quality_builds"}) <= columns


def test_x_is_the_baseline_time_over_the_variant_time_in_every_row(workflow_copy):
    """x > 1 means the variant is faster: in each timing file x is the median of the baseline's rounds
    over the median of the variant's (computed here), and each speed row keeps that direction."""
    import statistics

    tables = json.loads((workflow_copy / "results/fnet/tables.json").read_text())
    rows = [r for r in tables["speed"] if r["status"] == "ok"]
    assert len(rows) >= 6
    for r in rows:
        timing = json.loads((workflow_copy / r["source"]).read_text())["graphs"][r["graph"]]
        base, var = timing["baseline_ms"]["samples_ms"], timing["variant_ms"]["samples_ms"]
        assert timing["x"] == pytest.approx(statistics.median(base) / statistics.median(var), rel=1e-12)
        assert r["x"] == pytest.approx(r["baseline_ms"] / r["variant_ms"], rel=1e-12)
        assert r["baseline_ms"] == pytest.approx(statistics.median(base), rel=1e-12)
        if r["variant"] == r["baseline"]:
            assert r["x"] == 1.0


def _chromium() -> str | None:
    import shutil

    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(not _chromium(), reason="no headless Chromium (apt-get install chromium)")
def test_the_readme_page_renders_in_a_browser_with_its_plot_and_no_dead_link(workflow_copy, tmp_path):
    """Each study's README page (the report's) opened in headless Chromium, as a reader sees it: the
    plot has loaded (the candidate's orange and the shaded ship region are on the screenshot), the
    verdict is at the top, the folds are closed, and every link of the page points at a file it carries
    (clicks: test_browser)."""
    import subprocess

    import numpy as np
    from PIL import Image

    from quantstudy import plots

    page = workflow_copy / "results/fnet/README.html"
    shot = tmp_path / "fnet.png"
    browser = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--allow-file-access-from-files"]
    subprocess.run([*browser, "--window-size=1280,2200", f"--screenshot={shot}", page.as_uri()], check=True,
                   capture_output=True, timeout=120)
    rgb = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    orange = np.array([int(plots.VARIANT_COLOURS["fp8"][i:i + 2], 16) for i in (1, 3, 5)])
    assert (np.abs(rgb - orange).max(axis=-1) <= 12).sum() > 200, "the plot did not load: no fp8 point on the page"
    dom = subprocess.run([*browser, "--dump-dom", page.as_uri()], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    body = dom[dom.index("<body"):]
    assert body.index("Do not ship") < body.index("<img") < body.index("<details")
    assert "<details open" not in body
    links = re.findall(r'<a href="([^"]*)"', body)
    ids = set(re.findall(r' id="([^"]+)"', body))
    assert links and all(href[1:] in ids for href in links), [h for h in links if h[1:] not in ids]


def report_in_a_browser(report: Path, run_name: str, decisions: dict[str, str]) -> None:
    """The report as a reader at 1400 x 1000 sees it: the run's name and each study's decision on the front
    page without scrolling, then each README page (shown as the report shows it: its app's view of the
    page's data: URI in its frame) with its verdict and plot."""
    import time

    from quantstudy.devtools import Browser

    with Browser(_chromium(), 1400, 1000) as browser:
        browser.open(report.as_uri())
        blocks = browser.js("""[...document.querySelectorAll('#app p, #app li')].map(e => {
            const r = e.getBoundingClientRect(); return {top: r.top, bottom: r.bottom, text: e.textContent}; })""")
        for wanted in [f"Run {run_name} ", *(f"{title}: {d}" for title, d in decisions.items())]:
            found = [b for b in blocks if wanted in b["text"]]
            assert found, f"{wanted!r} is not on the front page"
            assert all(0 <= b["top"] and b["bottom"] <= 1000 for b in found), (wanted, found)
        pages = browser.js("Object.keys(results).filter(k => results[k].mime_type === 'text/html')")
        assert len(pages) == len(decisions), pages
        for page in pages:
            browser.js(f"app.setView({{content: 'html', contentPath: results[{json.dumps(page)}].data_uri}})")
            shown = None
            for _ in range(100):  # the frame is drawn by React, then loads: ask until it has loaded
                frames = [f for f in browser.frames() if f["url"].startswith("data:text/html")]
                try:
                    shown = frames and browser.js("""document.readyState === 'complete' && {
                        heading: (document.querySelector('h2') || {}).textContent || null,
                        plot: [...document.images].some(i => i.complete && i.naturalWidth > 500)}""",
                                                  frame=frames[-1]["id"])
                except RuntimeError:  # the frame went away while asked (React drew it again)
                    shown = None
                if shown:
                    break
                time.sleep(0.1)
            assert shown, f"{page}: the report's frame never finished loading"
            assert shown["heading"] and shown["heading"].startswith("FP8 quantization study:"), (page, shown)
            assert shown["plot"], f"{page}: the plot did not load in the report's frame"


@pytest.mark.skipif(not _chromium(), reason="no headless Chromium (apt-get install chromium)")
def test_the_report_shows_the_run_kind_and_decisions_first_and_every_readme_page(workflow_copy, tmp_path):
    """`snakemake --report` in headless Chromium: the front page's run kind and decisions are visible
    without scrolling at 1400 x 1000 (the report centred a tall front page, cutting its top off), and
    every study's README page renders in the report's frame (a page past 2 MiB as a data: URI is blank)."""
    report = tmp_path / "report.html"
    proc = snakemake(workflow_copy, "--configfile", ".test/config.yaml", "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = yaml.safe_load((workflow_copy / ".test/config.yaml").read_text())["run"]
    decisions = {}
    for tables in sorted((workflow_copy / "results").glob("*/tables.json")):
        t = json.loads(tables.read_text())
        decisions[t["title"]] = f"{'ship' if t['decision']['ship'] else 'do not ship'} {t['decision']['candidate']}"
    report_in_a_browser(report, run["name"], decisions)


def test_every_rendered_readme_has_whole_tables_and_no_dead_link(workflow_copy):
    """Each study README of the run, as a reader clicks through it: every relative link opens a file
    (a number's JSON, a sample list, the plot, the docs page), and every table row has its header's cells."""
    from quantstudy.devtools import dead_links, malformed_tables

    readmes = sorted(p.with_name("README.md") for p in (workflow_copy / "results").glob("*/tables.json"))
    assert readmes
    for readme in readmes:
        assert dead_links(readme) == [], readme
        assert malformed_tables(readme.read_text()) == [], readme
        assert "](../../docs/reading-a-study.md" in readme.read_text()


def test_each_readme_opens_with_one_verdict_line_per_condition_and_stays_short(workflow_copy):
    """The decision first: one line per condition of tables.json's decision, met or not, before the plot;
    the part outside the folds within two screens' worth of Markdown lines (FNet's was 507 in all)."""
    from quantstudy.devtools import lines_outside_folds

    for readme in sorted(p.with_name("README.md") for p in (workflow_copy / "results").glob("*/tables.json")):
        text = readme.read_text()
        decision = json.loads((readme.parent / "tables.json").read_text())["decision"]
        verdict = [line for line in text[:text.index("![")].splitlines() if line.startswith("- **")]
        words = {"met": "met", "not met": "not met", "within the noise": "within the noise of this run"}
        assert [line.split(":")[0] for line in verdict] == [f"- **{words[c['resolved']]}" for c in decision["conditions"]], readme
        assert lines_outside_folds(text) <= 130, (readme, lines_outside_folds(text))


def test_a_cpu_run_says_nothing_of_tensorrt_outside_the_write_ups_quotes(workflow_copy):
    """The embedded default runs torch and ONNX Runtime on a CPU: TensorRT (its builder levels, its fused
    kernels) appears only in the folds that quote the write-up (what it measured and this run did not; its
    numbers beside this run's, with their notes), never as this run's finding."""
    import re

    quoting = r"(From the write-up, not measured here|The write-up's numbers|Published vs reproduced)"
    for readme in sorted(p.with_name("README.md") for p in (workflow_copy / "results").glob("*/tables.json")):
        text = readme.read_text()
        outside = re.sub(rf"<details><summary>{quoting}.*?</details>", "", text, flags=re.S)
        assert "TensorRT" not in outside and "optimization level" not in outside, readme


def test_a_variants_own_calibration_method_has_its_amax_file_or_its_recorded_failure(workflow_copy):
    """.test/fnet.yaml: fp8-percentile-99 is calibrated by ModelOpt's percentile into amax-percentile-99.json,
    beside the recipe's amax.json, and built from it; fp8-entropy's method does not apply to FP8: its amax
    file is a failed record with the reason, its build fails with it, and the README says so."""
    calib = workflow_copy / "results/fnet/fnet-base/calib/w512"
    by_max = json.loads((calib / "amax.json").read_text())
    percentile = json.loads((calib / "amax-percentile-99.json").read_text())
    assert percentile["status"] == "ok" and percentile["calibration"]["method"] == {"method": "percentile", "percentile": 99}
    layers = percentile["recipe_layers"]
    assert set(percentile["calibration"]["changed_from_max"]["input_amax"]) >= set(layers)
    assert all(percentile["amax"][n]["input_amax"] < by_max["amax"][n]["input_amax"] for n in layers)
    variant = workflow_copy / "results/fnet/cpu-torch/fnet-base/w512/fp8-percentile-99"
    build = json.loads((variant / "build.json").read_text())
    assert build["status"] == "ok" and build["provenance"]["inputs"]["amax"]["path"].endswith("amax-percentile-99.json")
    assert json.loads((variant / "quality.json").read_text())["status"] == "ok"
    assert not (variant / "timing.json").exists()  # quality only

    entropy = json.loads((calib / "amax-entropy.json").read_text())
    assert entropy["status"] == "failed" and "NotApplicable" in entropy["error"]
    build = json.loads((workflow_copy / "results/fnet/cpu-torch/fnet-base/w512/fp8-entropy/build.json").read_text())
    assert build["status"] == "failed" and "calibration entropy failed" in build["error"]
    readme = (workflow_copy / "results/fnet/README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("| Variants' own calibration methods |"))
    assert re.search(r"`percentile-99` \(fnet-base `w512`\): for `fp8-percentile-99`; it moved the input amax of "
                     r"(\d+) and the weight amax of 0 of the \1 recipe layers", line)
    assert "`entropy` (fnet-base `w512`): **failed**: NotApplicable: ModelOpt 0.47's histogram calibrator" in line


def test_the_write_ups_revisit_conditions_are_checked_under_its_quote(workflow_copy):
    """config/studies/fnet.yaml's revisit: the faster DFT cannot be measured here; the recipe that keeps top-1
    near fp16 is checked on fp8 and every variant with its own calibration method (.test/fnet.yaml has two)."""
    readme = (workflow_copy / "results/fnet/README.md").read_text()
    lines = readme.splitlines()
    quote = next(i for i, line in enumerate(lines) if line.startswith("- When to revisit, the write-up's:"))
    dft, recipe = lines[quote + 1], lines[quote + 2]
    assert dft.startswith('  - **not measurable in this run**: "A faster sequence-axis DFT')
    assert re.match(r'  - \*\*(met|not met|within the noise of this run)\*\*: "a recipe that keeps masked-LM top-1', recipe)
    assert re.search(r"`fp8` [\d.]+%.*; `fp8-percentile-99` [\d.]+%.*; `fp8-entropy` not measured \(failed: ", recipe)
