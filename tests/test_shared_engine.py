"""One engine serving several settings (`engine:` in a study's settings).

Deformable DETR builds one dynamic-shape engine and times it at two image sizes. Here: the
config routes builds and checks that a setting fits the engine it names, and the real steps build
one engine of the tiny DETR (ONNX Runtime from its dynamic ONNX, and torch) at one size and time
it at another.
"""
from __future__ import annotations

import json

import pytest
import yaml

from helpers import ROOT
from quantstudy import audit_checks, config as qc, steps, steps_engines, steps_measure

from test_config import load, study_doc

FNET_SPEC = ROOT / "config/studies/fnet.yaml"
SQUARE = {"name": "96x96", "batch": 1, "shape": {"height": 96, "width": 96}, "quality": False}
WIDE = {"name": "96x128", "batch": 1, "shape": {"height": 96, "width": 128}, "quality": False}
FP16 = {"precision": "float16", "transforms": []}
TIMING = {"warmup": 1, "rounds": 2, "calls_per_round": 1}
TINY_QUERIES = 16  # config/architectures/tiny-deformable-detr.json


def shared_doc() -> dict:
    doc = study_doc()
    # fnet-large's settings as the study has them: the embedded default leaves out its b8-w512
    doc["models"]["fnet-large"]["settings"] = yaml.safe_load(FNET_SPEC.read_text())["models"]["fnet-large"]["settings"]
    doc["settings"]["b8-w512"]["engine"] = "w512"
    return doc


def test_a_shared_engine_is_built_once_under_its_own_setting(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text(json.dumps(shared_doc()))
    study = qc.load_study(path, against_code=False)
    assert study.engine_setting("b8-w512") == "w512" and study.engine_setting("w512") == "w512"
    measured = {(m, s) for _, m, s, _ in study.engines(["cpu-torch"])}
    built = {(m, s) for _, m, s, _ in study.builds(["cpu-torch"])}
    assert ("fnet-base", "b8-w512") in measured and ("fnet-base", "b8-w512") not in built
    assert built == measured - {("fnet-base", "b8-w512"), ("fnet-large", "b8-w512")}
    assert study.setting("b8-w512").shape == {"window": 512}  # `engine` is not a shape key
    # Its build is built for every setting it serves, its own first; another setting's build for itself alone.
    assert study.served_settings("cpu-torch", "fnet-base", "w512", "fp8") == ["w512", "b8-w512"]
    assert study.served_settings("cpu-torch", "fnet-base", "w128", "fp8") == ["w128"]


def test_a_setting_must_fit_the_engine_it_names(tmp_path):
    # FNet's graphs are static: batch 8 does not run on a batch-1 engine.
    with pytest.raises(qc.ConfigError, match=r"setting 'b8-w512' cannot run on the engine of 'w512' \(fnet-base, "
                                             r"graph main\): input_ids axis 0 is 8, the engine takes 1"):
        load(shared_doc(), tmp_path)


@pytest.mark.parametrize("engine, problem", [
    ("w999", "setting 'b8-w512': engine names unknown setting 'w999'"),
    ("w128", "model 'fnet-large' has setting 'b8-w512' but not 'w128', whose engines it is timed on"),
])
def test_an_engine_setting_must_exist_on_every_model(engine, problem, tmp_path):
    doc = shared_doc()
    doc["settings"]["b8-w512"]["engine"] = engine
    with pytest.raises(qc.ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        load(doc, tmp_path)


def test_an_engine_setting_builds_its_own_engine(tmp_path):
    doc = shared_doc()
    doc["settings"]["w512"]["engine"] = "w256"
    with pytest.raises(qc.ConfigError, match="engine 'w512' is timed on another setting's engine itself"):
        load(doc, tmp_path)


@pytest.fixture(scope="module")
def detr_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("detr")
    arch, tiny = qc.load_architecture("tiny-deformable-detr"), {"seed": 0}
    revision = qc.tiny_revision({"architecture": arch, "tiny": tiny})
    model = {"repo": "quantstudy-tiny/deformable-detr", "revision": revision, "architecture": arch, "tiny": tiny}
    steps.local_hub("deformable_detr", [model], [], str(out / "hf-cache"), str(out / "local_hub.json"))
    steps.fetch_checkpoint(model["repo"], revision, str(out / "hf-cache"), True, "tiny-random-init",
                           str(out / "checkpoint.json"))
    return out / "checkpoint.json", arch


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_one_dynamic_engine_is_timed_at_two_sizes(backend, detr_checkpoint, tmp_path):
    checkpoint, arch = detr_checkpoint
    target = {"target": f"cpu-{backend}", "backend": backend, "device": "cpu",
              **({"builder": {"intra_op_num_threads": 1}} if backend == "onnxruntime" else {})}
    recipe = {"quantize": [], "dequantize_dtype": "float16"}
    ident = {"model": "tiny", "setting": SQUARE["name"], "variant": "fp16"}
    export_json = None
    if backend == "onnxruntime":
        export_json = str(tmp_path / "onnx" / "export.json")
        steps_engines.export(ident, "deformable_detr", SQUARE, arch, FP16, recipe, str(checkpoint), None, export_json)
        assert json.loads(open(export_json).read())["status"] == "ok"
    build = tmp_path / "engine" / "build.json"
    steps_engines.build({"target": target["target"], **ident}, "deformable_detr", target, SQUARE, arch, FP16, recipe,
                        str(checkpoint), None, str(build), export_json, serves=[SQUARE, WIDE])
    assert json.loads(build.read_text())["status"] == "ok", json.loads(build.read_text()).get("error")
    if backend == "torch":  # built for both sizes, and for no other
        assert json.loads(build.read_text())["graphs"]["main"]["shapes"] == [
            {"pixel_values": [1, 3, 96, 96]}, {"pixel_values": [1, 3, 96, 128]}]
    probes = []
    for setting in (SQUARE, WIDE):
        out = tmp_path / setting["name"] / "timing.json"
        steps_measure.time({"target": target["target"], **ident, "setting": setting["name"]}, "deformable_detr", target,
                           setting, recipe, TIMING, str(checkpoint), str(build), str(build), str(out))
        doc = json.loads(out.read_text())
        assert doc["status"] == "ok", doc.get("error")
        assert doc["shape"] == setting["shape"] and doc["setting"] == setting["name"]
        probes.append(doc["probe"])
    # Each job probes the engine on its own setting's inputs: the probes differ, so the audit compares
    # probes of the jobs of one setting only (test_audit.py).
    assert [p["main"]["pred_boxes"]["shape"] for p in probes] == [[1, TINY_QUERIES, 4]] * 2
    assert audit_checks.probes_differ(probes[0], probes[1]) is not None


def test_the_dag_builds_a_shared_engine_once_and_times_it_at_both_sizes(tmp_path):
    """The rules (snakemake -n): one export and one build per variant at the engine's setting, a
    time job per setting, each reading that build."""
    from helpers import ROOT
    from quantstudy.devtools import planned_jobs, snakemake
    from test_contract import CASES

    arch = qc.load_architecture("tiny-deformable-detr")
    doc = {**study_doc(), "study": "detr_shared", "family": "deformable_detr", "title": "Deformable DETR (DAG test)",
           "models": {"detr": {"checkpoint": {"repo": "quantstudy-tiny/deformable-detr",
                                              "revision": qc.tiny_revision({"architecture": arch, "tiny": {"seed": 0}})},
                               "architecture": "tiny-deformable-detr", "settings": ["96x96", "96x128"],
                               "tiny": {"seed": 0}}},
           "settings": {"96x96": {"batch": 1, "height": 96, "width": 96},
                        "96x128": {"batch": 1, "height": 96, "width": 128, "quality": False, "engine": "96x96"}},
           "calibrate_by": [], "baseline": {"default": "fp16"}, "candidate": "fp8", "targets": {},
           "metrics": {"score_threshold": 0.5, "match_iou": 0.5, "ap_resamples": 50}, "seeds": {},  # the family's own
           "variants": {"fp16": {"precision": "float16"},
                        "fp8": {"precision": "float16", "transforms": [{"fp8": {}}]}}}
    doc["recipe"] = {**doc["recipe"], "quantize": CASES["deformable_detr"].quantize}
    doc.pop("published")  # FNet's write-up numbers: this study has none
    doc.pop("revisit")  # FNet's "revisit when" names FNet's conditions
    # FNet's speed condition, and a quality condition on a column a detector's evaluation writes
    doc["decision"] = {"conditions": [
        next(c for c in doc["decision"]["conditions"] if c["table"] == "speed"),
        {"name": "held-out COCO AP", "table": "quality", "column": "heldout.ap", "reduce": "min", "compare": ">=",
         "threshold": 0, "basis": "set by this test"}]}
    (tmp_path / "study.yaml").write_text(json.dumps(doc))
    (tmp_path / "config.yaml").write_text(json.dumps({
        "run": {"name": "dag-test", "weights": "tiny-random-init"}, "hf_cache": "resources/hf-cache", "offline": True,
        "studies": {"detr_shared": {"spec": str(tmp_path / "study.yaml")}},
        "targets": {"cpu-onnxruntime": {"backend": "onnxruntime", "device": "cpu"}}}))
    base = "results/detr_shared/cpu-onnxruntime/detr"
    proc = snakemake(ROOT, *[f"{base}/{s}/{v}/timing.json" for s in ("96x96", "96x128") for v in ("fp16", "fp8")],
                     "-n", "--configfile", str(tmp_path / "config.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    jobs = planned_jobs(proc.stdout)
    per_rule = {rule: sorted((w["setting"], w["variant"]) for r, w in jobs if r == rule)
                for rule in ("export", "build", "time")}
    assert per_rule["export"] == per_rule["build"] == [("96x96", "fp16"), ("96x96", "fp8")]
    assert per_rule["time"] == [("96x128", "fp16"), ("96x128", "fp8"), ("96x96", "fp16"), ("96x96", "fp8")]
    wide_fp8 = proc.stdout.split(f"output: {base}/96x128/fp8/timing.json")[0].rsplit("input:", 1)[1]
    assert f"{base}/96x96/fp8/build.json" in wide_fp8 and f"{base}/96x96/fp16/build.json" in wide_fp8


def test_a_torch_engine_is_refused_at_a_setting_its_build_does_not_serve(detr_checkpoint, tmp_path):
    """Built for 96 x 96 alone, the engine is not opened at 96 x 128: the time job records why."""
    checkpoint, arch = detr_checkpoint
    target = {"target": "cpu-torch", "backend": "torch", "device": "cpu"}
    recipe = {"quantize": [], "dequantize_dtype": "float16"}
    ident = {"target": "cpu-torch", "model": "tiny", "setting": SQUARE["name"], "variant": "fp16"}
    build = tmp_path / "engine" / "build.json"
    steps_engines.build(ident, "deformable_detr", target, SQUARE, arch, FP16, recipe, str(checkpoint), None, str(build))
    out = tmp_path / "timing.json"
    steps_measure.time({**ident, "setting": WIDE["name"]}, "deformable_detr", target, WIDE, recipe, TIMING, str(checkpoint),
                       str(build), str(build), str(out))
    doc = json.loads(out.read_text())
    assert doc["status"] == "failed"
    assert "built for [{'pixel_values': [1, 3, 96, 96]}], not for setting 96x128's" in doc["error"]
