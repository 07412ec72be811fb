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

from conftest import ROOT
from quantstudy.devtools import copy_checkout, planned_jobs, snakemake

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
    assert re.search(r"\| build\.json \| cpu-torch \| fnet-base, w512 \| fp8-broken \| .*selects no layer", readme)
    fp8_row = next(line for line in readme.splitlines() if line.startswith("| fnet-base, 512 | cpu-torch | fp8 |"))
    assert "failed" not in fp8_row and "%" in fp8_row


def test_quality_is_also_measured_against_the_variant_the_study_names(workflow_copy):
    """.test/fnet.yaml: quality_against: [fp16-hs]. Every other variant's evaluation opens that engine too."""
    for target in ("cpu-torch", "cpu-onnxruntime"):
        fp8 = json.loads((workflow_copy / f"results/fnet/{target}/fnet-base/w512/fp8/quality.json").read_text())
        assert fp8["provenance"]["inputs"]["against_fp16-hs"]["path"].endswith(f"{target}/fnet-base/w512/fp16-hs/build.json")
        assert 0 < fp8["blocks"]["vs_fp16-hs"]["cls"]["relative_error"] < 1
        own = json.loads((workflow_copy / f"results/fnet/{target}/fnet-base/w512/fp16-hs/quality.json").read_text())
        assert "vs_fp16-hs" not in own["blocks"]


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
    from quantstudy import render

    readme = (workflow_copy / "results/fnet/README.md").read_text()
    kernel_rows = _table_rows(readme, "| Model, window | Target | Variant | sequence-axis DFT")
    assert sorted((r[1], r[2]) for r in kernel_rows) == [(t, v) for t in ("cpu-onnxruntime", "cpu-torch")
                                                          for v in ("fp16-hs", "fp8")]
    tables = json.loads((workflow_copy / "results/fnet/tables.json").read_text())
    # fp16 returns NaN at 512 (no top-1 at all); the baseline column must show fp16-hs's.
    hs_top1 = render.value_range(r["mlm.top1_agreement"] for r in tables["quality"] if r["variant"] == "fp16-hs")
    assert hs_top1 is not None
    summary = {r[0]: r for r in _table_rows(readme, "| Item | baseline |")}
    assert summary["Masked-LM top-1 agreement with PyTorch fp32"][1] == render.span(hs_top1, render.pct)


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
    and 1 / ((1 - f) + f / g); the README's speed table shows that cell beside x."""
    from quantstudy import bound, render

    tables = json.loads((workflow_copy / "results/fnet/tables.json").read_text())
    rows = [r for r in tables["speed"] if r["variant"] == "fp8"]
    assert sorted(r["target"] for r in rows) == ["cpu-onnxruntime", "cpu-torch"]
    for r in rows:
        assert r["f_source"].endswith(f"{r['target']}/fnet-base/w512/fp16-hs/kernels.json")  # the baseline at 512
        assert r["g_source"].endswith(f"{r['target']}/fnet-base/w512/gemm.json")
        assert 0 < r["f"] < 1 and r["f_kind"] == "exact" and r["fp8_emulated"] is True
        assert r["bound"] == pytest.approx(bound.amdahl_bound(r["f"], r["g"]))
        assert r["at_limit"] == (r["x"] >= tables["bound"]["at_limit"] * r["bound"])
    assert {r["target"]: r["f_basis"] for r in rows} == {"cpu-torch": "by shape [M, K, N]",
                                                          "cpu-onnxruntime": "by module name"}
    fp16 = next(r for r in tables["speed"] if r["variant"] == "fp16" and r["target"] == "cpu-torch")
    assert fp16["bound"] is None and fp16["bound_note"] == "no FP8 layer"
    readme = (workflow_copy / "results/fnet/README.md").read_text()
    header = "| Model, window | Target | Baseline | fp32 |"
    assert "Amdahl bound of x" in next(line for line in readme.splitlines() if line.startswith(header))
    macros = render.environment().get_template("macros.md.j2").module
    table = {(r[1]): r for r in _table_rows(readme, header)}
    for r in rows:
        assert table[r["target"]][7] == str(macros.bound_cell(r)) and render.times(r["bound"]) in table[r["target"]][7]
    assert "Amdahl bound: 1 / ((1 - f) + f / g)" in readme


def test_noop_rerun_does_nothing(workflow_copy):
    proc = snakemake(workflow_copy, "-n", "--configfile", ".test/config.yaml")
    assert proc.returncode == 0
    assert planned_jobs(proc.stdout + proc.stderr) == []


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
    assert sorted(rule for rule, w in jobs if "variant" not in w) == ["aggregate", "all", "audit", "gemm", "render"]
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
        assert any("amax.json) changed since it was read" in p for p in problems)
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
    proc = _audit_cli(workflow_copy, "check", "results/fnet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # A number of the speed table, as the README shows it: the rows it can be, and each one's chain
    # down to the pinned checkpoint, with the job, machine and software of every step.
    tables = json.loads((workflow_copy / "results/fnet/tables.json").read_text())
    row = next(r for r in tables["speed"] if r["variant"] == "fp8" and r["status"] == "ok")
    shown = f"{row['variant_ms']:.3f}"
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
    assert f"first broken link: {engine}: changed since the job that read it recorded its sha256" in proc.stderr
    proc = _audit_cli(repo, "check", "results/fnet")
    assert proc.returncode == 1 and f"engine {engine} (graph main) is missing or not the file it built" in proc.stdout
    # A job that opens it refuses it, naming the build to redo.
    proc = snakemake(repo, "--configfile", ".test/config.yaml", "--forcerun", "time", "--keep-going", timing)
    doc = json.loads((repo / timing).read_text())
    assert doc["status"] == "failed" and f"the engine {engine} is not the one the build of fp8 made" in doc["error"]
