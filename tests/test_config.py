"""Bad configs are clear errors before any job runs."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from quantstudy import config as qc

from helpers import ROOT, dry_run_with_studies, study_doc


def load(doc: dict, tmp_path) -> qc.Study:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(doc))
    return qc.load_study(path)


def test_embedded_default_needs_no_lock():
    run = qc.load_run(yaml.safe_load((ROOT / "config/config.yaml").read_text()))
    assert {"fnet", "timm_xcit"} <= set(run.studies)


@pytest.mark.parametrize("name", ["b200.yaml", "b300.yaml", "h200.yaml"])
def test_cluster_configs_load_once_their_revisions_are_locked(name, tmp_path, monkeypatch):
    """The write-ups leave some revisions unpinned: until the lock step has resolved them a cluster
    config stops, naming each; with them in the lock it loads, every revision a full commit."""
    from quantstudy import lockfile

    from helpers import stand_in_lock

    run_doc = yaml.safe_load((ROOT / "config" / name).read_text())
    monkeypatch.setattr(lockfile, "LOCK_FILE", tmp_path / "revisions.lock.yaml")
    keys = stand_in_lock(lockfile.LOCK_FILE, [f"config/{name}"])
    run = qc.load_run(run_doc)
    assert "fnet" in run.studies
    pinned = [m.revision for s in run.studies.values() for m in s.models.values()]
    pinned += [d.revision for s in run.studies.values() for d in s.datasets.values()]
    assert all(lockfile.FULL.match(r) for r in pinned)
    if keys:
        lockfile.write({}, lockfile.LOCK_FILE)
        with pytest.raises(qc.ConfigError, match="unresolved revisions") as e:
            qc.load_run(run_doc)
        assert "python -m quantstudy.lock" in str(e.value)


@pytest.mark.parametrize("call", sorted(p.name for p in (ROOT / "config/realsize/calls").glob("*.yaml")))
def test_device_call_configs_load_over_the_h200_run(call, tmp_path, monkeypatch):
    """A device call's config file, layered over config/h200.yaml as Snakemake layers a second
    --configfile, gives a run that loads: a broken one would cost a device call to find out."""
    from snakemake.utils import update_config

    from quantstudy import lockfile

    from helpers import stand_in_lock

    run_doc = yaml.safe_load((ROOT / "config/h200.yaml").read_text())
    layer = yaml.safe_load((ROOT / "config/realsize/calls" / call).read_text())
    update_config(run_doc, layer)
    monkeypatch.setattr(lockfile, "LOCK_FILE", tmp_path / "revisions.lock.yaml")
    stand_in_lock(lockfile.LOCK_FILE, ["config/h200.yaml"])
    run = qc.load_run(run_doc)
    for name in layer.get("studies", {}):
        assert run.studies[name].model_settings(timed_only=True)
    if call == "h100.yaml":  # the same target, declaring the card a lent H100 is, the rest of it kept
        assert run.targets["h200-torch"] == qc.Target(name="h200-torch", backend="torch", device="cuda",
                                                      gpu="h100", compile=True)
    if call == "fnet-base-w128-repeats.yaml":
        fnet = run.studies["fnet"]
        assert list(fnet.model_settings(timed_only=True)) == [("fnet-base", "w128")] and fnet.repeats == 2


def test_real_study_names_the_write_up_revisions():
    study = qc.load_study("config/studies/fnet.yaml")
    assert study.models["fnet-base"].revision == "d89b6fad3cf5384848b783dc480f9685f49d008c"
    assert study.models["fnet-large"].revision == "8b66d3b6d2164befbab948ce455230659c700043"
    assert study.samples["calibration"].count == 544


@pytest.mark.parametrize("revision", ["main", "v1.0", "d89b6", "D89B6FAD3CF5384848B783DC480F9685F49D008C"])
def test_unpinned_checkpoint_revision(tmp_path, revision):
    doc = study_doc()
    doc["models"]["fnet-base"]["checkpoint"]["revision"] = revision
    with pytest.raises(qc.ConfigError, match=r"models\.fnet-base\.checkpoint\.revision: revision .* is not pinned"):
        load(doc, tmp_path)


def test_unpinned_dataset_revision(tmp_path):
    doc = study_doc()
    doc["datasets"]["stsb"]["revision"] = "refs/pr/1"
    with pytest.raises(qc.ConfigError, match=r"datasets\.stsb\.revision: .* not pinned"):
        load(doc, tmp_path)


def test_unknown_family(tmp_path):
    doc = study_doc()
    doc["family"] = "fnot"
    with pytest.raises(qc.ConfigError, match=r"unknown family 'fnot'; registered families: .*\bfnet\b"):
        load(doc, tmp_path)


def test_recipe_pattern_that_matches_no_layer(tmp_path):
    doc = study_doc()
    doc["recipe"]["quantize"].append("fnet.encoder.layer.*.attention.dense")
    with pytest.raises(qc.ConfigError, match=r"recipe pattern 'fnet.encoder.layer.\*.attention.dense' matches no layer of fnet-base"):
        load(doc, tmp_path)


@pytest.mark.parametrize("key", ["include", "exclude", "add"])
def test_a_variants_fp8_pattern_that_matches_no_layer(key, tmp_path):
    """A misspelt layer pattern in a variant would build another variant than the one meant (an exclude
    that excludes nothing builds the recipe again): every include, exclude and add pattern must match."""
    doc = study_doc()
    doc["variants"]["fp8-typo"] = {"precision": "float16",
                                   "transforms": [{"fp8": {key: ["fnet.encoder.layer.*.output.dense2"]}}]}
    with pytest.raises(qc.ConfigError, match=rf"variant 'fp8-typo': fp8 {key} pattern 'fnet.encoder.layer.\*.output.dense2' "
                                             r"matches no layer of fnet-base"):
        load(doc, tmp_path)


def test_variant_with_unknown_transform(tmp_path):
    doc = study_doc()
    doc["variants"]["fp8-smooth"] = {"precision": "float16", "transforms": [{"smoothquant": {}}]}
    with pytest.raises(qc.ConfigError, match=r"variant 'fp8-smooth' names unknown transform 'smoothquant'; "
                                             r"known transforms: fp32_dequantize, fp8, fp8_hidden_dft, hidden_scaling, "):
        load(doc, tmp_path)


def test_a_cluster_job_step_reads_the_config_without_torch(tmp_path):
    """Job steps re-read the Snakefile (load_run(against_code=False)): no torch, no model built.
    The main process's full load imports both, once: a rerun of a config that passed the same
    code finds its check recorded."""
    code = ("import sys, pathlib, yaml; import quantstudy.config as qc; qc.CODE_CHECKS = pathlib.Path(sys.argv[1]); "
            "qc.load_run(yaml.safe_load(open('config/config.yaml')), against_code=sys.argv[2] == 'full'); "
            "print('torch' in sys.modules, 'transformers.models.fnet.modeling_fnet' in sys.modules)")
    seen = [subprocess.run([sys.executable, "-c", code, str(tmp_path), load], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
            for load in ("job step", "full", "full")]
    assert seen == [["False", "False"], ["True", "True"], ["False", "False"]]
    run = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    # one recorded check per study
    assert len(list(tmp_path.iterdir())) == len(run["studies"])


def test_a_recorded_check_covers_only_its_own_config(tmp_path, monkeypatch):
    monkeypatch.setattr(qc, "CODE_CHECKS", tmp_path)
    load(study_doc(), tmp_path)
    doc = study_doc()
    doc["recipe"]["quantize"].append("fnet.encoder.layer.*.no_such_layer")
    with pytest.raises(qc.ConfigError, match="no_such_layer"):
        load(doc, tmp_path)


def test_tiny_revision_must_be_the_content_hash(tmp_path):
    doc = study_doc()
    doc["models"]["fnet-base"]["tiny"]["seed"] = 7
    with pytest.raises(qc.ConfigError, match=r"content hash of its spec: set revision to [0-9a-f]{40}"):
        load(doc, tmp_path)


def test_overrides_null_removes_a_key():
    merged = qc.deep_merge({"a": {"x": 1, "y": 2}, "b": 3}, {"a": {"x": None}, "b": 4})
    assert merged == {"a": {"y": 2}, "b": 4}


def test_snakemake_stops_before_any_job(tmp_path):
    """The same check through Snakemake: a non-zero exit, the sentence, and no job started."""
    doc = study_doc()
    doc["models"]["fnet-base"]["checkpoint"]["revision"] = "main"
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(doc))
    proc = dry_run_with_studies(tmp_path, {"fnet": {"spec": str(tmp_path / "study.yaml")}})
    assert proc.returncode != 0
    assert "revision 'main' is not pinned" in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


def test_a_decision_needs_a_per_row_quality_condition(tmp_path):
    """Its column is the study's main quality metric, the y axis of the speed-vs-quality plot."""
    doc = study_doc()
    doc["decision"]["conditions"] = [c for c in doc["decision"]["conditions"]
                                     if c["table"] == "speed" or c["reduce"] not in ("min", "max")]
    with pytest.raises(qc.ConfigError, match=r"decision has no per-row quality condition \(table: quality, reduce: min or max\)"):
        load(doc, tmp_path)


def test_the_study_is_typed_and_crosses_into_params_as_configured(tmp_path):
    """Rules read attributes of the typed study; what crosses into a rule's params (and every JSON's
    provenance) is the config as written, key order included, so that no recorded job looks changed."""
    from quantstudy.families.base import Setting

    doc = study_doc()
    doc["baseline"]["by_setting"] = {"w512": "fp32"}
    doc["timing"] = {"calls_per_round": 3, "warmup": 2, "rounds": 5, "repeats": 2}  # not in the schema's order
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))  # the file's order, not sorted
    study = qc.load_study(tmp_path / "study.yaml")
    assert (study.baseline.of("w512"), study.baseline.of("w128")) == ("fp32", doc["baseline"]["default"])
    assert list(study.timing.job_params().items()) == [("warmup", 2), ("rounds", 5), ("calls_per_round", 3)]
    assert study.timing.repeats == 2 and study.timing.min_effect == qc.MIN_EFFECT
    assert list(study.recipe.as_params()) == list(doc["recipe"]) and study.recipe.quantize == tuple(doc["recipe"]["quantize"])
    assert study.recipe.calibration_samples == qc.calibration_sample_sets(doc["recipe"])
    spec = study.samples["calibration"]
    assert spec.as_params() == doc["samples"]["calibration"] and spec.count == doc["samples"]["calibration"]["count"]
    assert study.sample_dataset("calibration").name == doc["samples"]["calibration"]["dataset"]
    assert all(isinstance(c, qc.Condition) for c in study.decision.conditions)
    setting = study.setting("b8-w512")
    assert Setting.from_params(setting.as_params()) == setting
    target = qc.Target("gpu", backend="torch", device="cuda", gpu="h200", builder={"x": 1})
    assert qc.Target.from_params(target.as_params()) == target and target.as_params()["target"] == "gpu"
    study.recipe.as_params()["quantize"].append("*")  # a step's copy: the study keeps its own
    assert study.recipe.as_params() == doc["recipe"]


def test_snakemake_lint_finds_nothing(tmp_path):
    """Every rule names its software environment, and no lint of Snakemake's applies."""
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--lint", "--snakefile", str(ROOT / "Snakefile"),
                           "--directory", str(tmp_path), "--configfile", str(ROOT / "config/config.yaml")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Lints for" not in proc.stdout + proc.stderr
    assert "Congratulations, your workflow is in a good condition!" in proc.stdout + proc.stderr


def test_quality_against_names_a_variant_every_target_builds(tmp_path):
    doc = study_doc()
    doc["quality_against"] = ["fp17"]
    with pytest.raises(qc.ConfigError, match="quality_against names unknown variant 'fp17'"):
        load(doc, tmp_path)
    doc["quality_against"] = ["fp32"]  # the embedded default's ONNX Runtime target builds fp16 and fp8 only
    with pytest.raises(qc.ConfigError, match="targets.cpu-onnxruntime.variants leaves out 'fp32', which quality_against names"):
        load(doc, tmp_path)


def test_reference_dtype_is_one_the_reference_can_run_in(tmp_path):
    doc = study_doc()
    doc["reference_dtype"] = "int8"
    with pytest.raises(qc.ConfigError, match="int8"):
        load(doc, tmp_path)


def test_a_quality_only_model_is_built_and_evaluated_but_not_timed(tmp_path):
    doc = study_doc()
    doc["models"]["fnet-large"]["timing"] = False
    doc["models"]["fnet-large"]["settings"] = ["w256"]
    study = load(doc, tmp_path)
    targets = ["cpu-torch"]
    assert {m for _, m, _, _ in study.engines(targets, timed_only=True)} == {"fnet-base"}
    assert {m for _, m, _, _ in study.engines(targets, quality_only=True)} == {"fnet-base", "fnet-large"}
    assert {m for _, m, _, _ in study.builds(targets)} == {"fnet-base", "fnet-large"}


def test_a_quality_only_model_cannot_have_a_timing_only_setting(tmp_path):
    doc = study_doc()
    doc["models"]["fnet-large"]["timing"] = False
    doc["models"]["fnet-large"]["settings"] = ["w256", "b8-w512"]
    with pytest.raises(qc.ConfigError, match=r"model 'fnet-large' has timing: false, so its setting 'b8-w512' "
                                             r"\(quality: false\) would measure nothing"):
        load(doc, tmp_path)


def test_a_relative_condition_must_name_a_variant(tmp_path):
    doc = study_doc()
    doc["decision"]["conditions"].append({"name": "top-1 within 1.01 x fp16's", "table": "quality",
                                          "column": "mlm.top1_agreement", "relative_to": "fp61", "reduce": "min",
                                          "compare": ">=", "threshold": 0.99,
                                          "basis": "a test"})
    with pytest.raises(qc.ConfigError, match=r"decision.conditions\[\d+\].relative_to names unknown variant 'fp61'"):
        load(doc, tmp_path)
    doc["decision"]["conditions"][-1]["relative_to"] = "fp16"
    load(doc, tmp_path)


def test_a_quality_only_variant_is_built_and_evaluated_but_plans_no_timing_jobs(tmp_path):
    """`timed: false` on GPT-Neo's fp8-c_fc: the dry run plans its build and evaluate on every target that
    has it, and no time or profile job; the gemm job does not time its GEMMs. The candidate cannot be
    quality-only."""
    from quantstudy.devtools import planned_jobs

    override = tmp_path / "quality-only.yaml"
    override.write_text("variants:\n  fp8-c_fc: {timed: false}\n")
    doc = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    entry = {**doc["studies"]["gpt_neo"], "overrides": [doc["studies"]["gpt_neo"]["overrides"], str(override)]}
    study = qc.load_study(entry["spec"], entry["overrides"])
    assert not study.variants["fp8-c_fc"].timed and study.variants["fp8"].timed
    assert ("cpu-torch", "gpt-neo-125m", "p256-c256", "fp8-c_fc") not in list(study.engines(["cpu-torch"], timed_only=True))
    assert ("cpu-torch", "gpt-neo-125m", "p256-c256", "fp8-c_fc") in list(study.engines(["cpu-torch"], quality_only=True))
    for inputs in ("config", "templates", "docs"):  # what the aggregate and render jobs read from the checkout
        (tmp_path / inputs).symlink_to(ROOT / inputs)
    proc = dry_run_with_studies(tmp_path, {"gpt_neo": entry})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = [(rule, w) for rule, w in planned_jobs(proc.stdout) if w.get("variant") == "fp8-c_fc"]
    assert sorted({rule for rule, _ in jobs}) == ["build", "evaluate"]
    assert {rule for rule, w in planned_jobs(proc.stdout) if w.get("variant") == "fp8"} >= {"build", "evaluate", "time",
                                                                                             "profile"}
    override.write_text("variants:\n  fp8: {timed: false}\n")
    with pytest.raises(qc.ConfigError, match="candidate names 'fp8', a quality-only variant"):
        qc.load_study(entry["spec"], entry["overrides"])


def test_a_study_that_does_not_profile_plans_timing_jobs_and_no_profile_or_gemm_job(tmp_path):
    """`timing.profile: false` (a short GPU call): every timed variant keeps its time job; no profile job and
    no gemm job is planned, and the aggregate reads none of their files."""
    from quantstudy.devtools import planned_jobs

    override = tmp_path / "no-profile.yaml"
    override.write_text("timing: {profile: false}\n")
    doc = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    entry = {**doc["studies"]["gpt_neo"], "overrides": [doc["studies"]["gpt_neo"]["overrides"], str(override)]}
    assert qc.load_study(entry["spec"], entry["overrides"]).timing.profile is False
    assert qc.load_study(entry["spec"], entry["overrides"][:1]).timing.profile is True
    for inputs in ("config", "templates", "docs"):  # what the aggregate and render jobs read from the checkout
        (tmp_path / inputs).symlink_to(ROOT / inputs)
    proc = dry_run_with_studies(tmp_path, {"gpt_neo": entry})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rules = [rule for rule, _ in planned_jobs(proc.stdout)]
    timed = {w["variant"] for rule, w in planned_jobs(proc.stdout) if rule == "time"}
    assert {"fp8", "fp16", "fp8-c_fc"} <= timed
    assert "profile" not in rules and "gemm" not in rules and "aggregate" in rules
    override.write_text("timing: {profile: 'no'}\n")
    with pytest.raises(qc.ConfigError, match=r"timing\.profile: 'no' is not of type 'boolean'"):
        qc.load_study(entry["spec"], entry["overrides"])


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(column="zzz"), "column 'zzz' is no column of the speed table; its columns: at_limit, backend"),
    (lambda c: c.update(column="x_mni"), "column 'x_mni' is no column of the speed table; did you mean x_min"),
    (lambda c: c.update(rows={"bacth": 1}), "rows filter 'bacth' is no column of the speed table; did you mean batch"),
    (lambda c: c.update(rows={"setting": "w1024"}), "rows names setting 'w1024', which the study has none of; "
                                                    "its settings: "),
    (lambda c: c.update(samples=["heldot"]), "samples names 'heldot', which the study has no sample list of; "
                                             "its sample lists: "),
    (lambda c: c.pop("basis"), "'basis' is a required property"),
])
def test_a_decision_condition_that_names_nothing_stops_the_run(edit, message, tmp_path):
    """A misspelt column or row filter finds no rows, which the decision would count as not met."""
    doc = study_doc()
    speed = next(c for c in doc["decision"]["conditions"] if c["table"] == "speed")
    edit(speed)
    with pytest.raises(qc.ConfigError, match=re.escape(message)):
        load(doc, tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["samples"]["heldout"].update(dataset="wikitxt"), "samples 'heldout' name unknown dataset 'wikitxt'"),
    (lambda d: d["samples"]["heldout"].update(split="tset"), "samples 'heldout': dataset 'wikitext' has no split 'tset'"),
    (lambda d: d.update(evaluation_samples=["heldout", "stss"]), "evaluation_samples names 'stss', no entry of samples"),
    (lambda d: d["recipe"]["activation_calibration"].update(samples="calibraton"),
     "recipe.activation_calibration.samples names 'calibraton', no entry of samples"),
    (lambda d: d["models"]["fnet-base"].update(settings=["w128", "w521"]), "model 'fnet-base' names unknown setting 'w521'"),
    (lambda d: d.update(candidate="fp8-hs"), "candidate names unknown variant 'fp8-hs'"),
    (lambda d: d["baseline"].update(default="fp61"), "baseline.default names unknown variant 'fp61'"),
    (lambda d: d["baseline"]["by_setting"].update({"w521": "fp16"}), "baseline.by_setting names unknown setting 'w521'"),
    (lambda d: d["baseline"]["by_setting"].update(w512="fp16-sh"), "baseline.by_setting.w512 names unknown variant 'fp16-sh'"),
    (lambda d: d["variants"]["fp8"].update(timed=False), "candidate names 'fp8', a quality-only variant"),
    (lambda d: d["variants"]["fp8"].update(timed="blackwell"),
     "candidate names 'fp8', a variant timed on Blackwell targets only (timed: blackwell): it must be timed"),
    (lambda d: d["variants"].update(nvfp4={"precision": "float16", "transforms": [{"microscaling": {"format": "nvfp4"}}]}),
     "variant 'nvfp4' is microscaled (NVFP4 / MXFP8), whose GEMMs run on Blackwell tensor cores (sm_100+) only: "
     "give it `timed: blackwell`"),
    (lambda d: d["variants"].update(nvfp4={"precision": "float16", "timed": "blackwell",
                                           "transforms": [{"microscaling": {"format": "nvfp5"}}]}),
     "variant 'nvfp4': microscaling format 'nvfp5' is not one of nvfp4, mxfp8"),
    (lambda d: d["targets"]["cpu-onnxruntime"].update(settings=["w821"]),
     "targets.cpu-onnxruntime.settings names unknown setting 'w821'"),
    (lambda d: d["targets"]["cpu-onnxruntime"].update(variants=["fp16", "fp8", "fp9"]),
     "targets.cpu-onnxruntime.variants names unknown variant 'fp9'"),
    (lambda d: d["targets"]["cpu-onnxruntime"].update(variants=["fp8"]),
     "targets.cpu-onnxruntime.variants leaves out 'fp16', the baseline of setting 'w128'"),
    (lambda d: d["models"]["fnet-base"].update(architecture="tiny-fnet-bsae"), "unknown architecture 'tiny-fnet-bsae'"),
])
def test_each_kind_of_name_in_a_study_must_name_something_that_exists(edit, message, tmp_path):
    """Datasets, splits, sample lists, settings, variants (candidate, baselines, per target) and
    architectures: a misspelt one stops the run with a sentence that names it."""
    doc = study_doc()
    edit(doc)
    with pytest.raises(qc.ConfigError, match=re.escape(message)):
        load(doc, tmp_path)


def test_a_run_config_names_its_studies_and_targets_as_they_are(tmp_path):
    """A study entry whose spec is another study, and a study that names a target the run lacks."""
    run = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    run["studies"] = {"fnet": run["studies"]["timm_xcit"]}
    with pytest.raises(qc.ConfigError, match="config names study 'fnet' but config/studies/timm_xcit.yaml is study 'timm_xcit'"):
        qc.load_run(run, against_code=False)
    run = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    del run["targets"]["cpu-onnxruntime"]
    with pytest.raises(qc.ConfigError, match=re.escape("study 'fnet' names targets ['cpu-onnxruntime'] that the run "
                                                       "does not define")):
        qc.load_run(run, against_code=False)


def test_a_gpu_target_names_its_card():
    """A cuda target without `gpu:` is refused before any job: the README names the card, the audit checks it."""
    run = yaml.safe_load((ROOT / "config/h200.yaml").read_text())
    del run["targets"]["h200-torch"]["gpu"]
    with pytest.raises(qc.ConfigError, match=re.escape("targets.h200-torch: 'gpu' is a required property")):
        qc.load_run(run, against_code=False)
    run["targets"]["h200-torch"]["gpu"] = "H200 SXM"
    with pytest.raises(qc.ConfigError, match=re.escape("targets.h200-torch.gpu: 'H200 SXM' does not match")):
        qc.load_run(run, against_code=False)


@pytest.mark.parametrize("gpu, name, same", [
    ("h200", "NVIDIA H200", True), ("h200", "NVIDIA H200 NVL", True), ("b200", "NVIDIA B200", True),
    ("h200", "NVIDIA H100 80GB HBM3", False), ("h100", "NVIDIA H100 80GB HBM3", True),
    ("b200", "NVIDIA GB200", False), ("h20", "NVIDIA H200", False), ("h200", "no GPU", False),
])
def test_a_target_knows_its_card_by_the_word_in_the_gpus_name(gpu, name, same):
    assert qc.is_card(gpu, name) is same


@pytest.mark.parametrize("device, gpu, ran_on, may", [
    ("cpu", "cpu", None, True), ("cpu", "cpu", "NVIDIA H100 80GB HBM3", True),  # a CPU target's job anywhere
    ("cuda", "h200", "NVIDIA H200", True), ("cuda", "h100", "NVIDIA H100 80GB HBM3", True),
    ("cuda", "h200", "NVIDIA H100 80GB HBM3", False), ("cuda", "h200", None, False),
    ("cuda", "cpu", "NVIDIA H100 80GB HBM3", False),  # a GPU target that declares no card
])
def test_a_gpu_targets_job_may_record_numbers_only_on_the_card_it_declares(device, gpu, ran_on, may):
    target = qc.Target(name="t", backend="torch", device=device, gpu=gpu)
    assert qc.on_its_card(target, ran_on) is may


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(column="mlm.top1_agrement"), "column 'mlm.top1_agrement' is no column of the quality table; "
                                                     "did you mean mlm.top1_agreement"),
    (lambda c: c.update(column="nonfinite.stres"), "did you mean nonfinite.stress"),
    (lambda c: c.update(column="cls_vs_fp16.relative_error"), "column 'cls_vs_fp16.relative_error' is no column"),
    (lambda c: c.update(rows={"checkpoint.head": True}), "rows filter 'checkpoint.head' is no column of the quality table"),
])
def test_a_quality_condition_names_a_column_the_familys_evaluation_writes(edit, message, tmp_path):
    """The quality table's columns are the family's metrics (Family.quality_columns): a misspelt one
    would find no rows and count as not met."""
    doc = study_doc()
    edit(next(c for c in doc["decision"]["conditions"] if c["table"] == "quality"))
    with pytest.raises(qc.ConfigError, match=re.escape(message)):
        load(doc, tmp_path)


def test_a_quality_condition_may_name_the_comparison_with_a_quality_against_variant(tmp_path):
    """cls_vs_fp16.* exists only where the study evaluates against fp16 (quality_against: [fp16])."""
    doc = study_doc()
    condition = next(c for c in doc["decision"]["conditions"] if c["table"] == "quality")
    condition.update(column="cls_vs_fp16.relative_error", reduce="max", compare="<=", threshold=0.1)
    doc["quality_against"] = ["fp16"]
    assert load(doc, tmp_path).quality_against == ("fp16",)


def test_quality_against_for_a_family_that_compares_with_no_other_engine_stops_the_run(tmp_path):
    """DeBERTa's evaluation has no comparison with another engine: quality_against would only open engines."""
    path = tmp_path / "override.yaml"
    path.write_text("quality_against: [fp16]\n")
    with pytest.raises(qc.ConfigError, match="the deberta_v2 family's evaluation compares with no other engine"):
        qc.load_study(ROOT / "config/studies/deberta_v2.yaml", [ROOT / "config/tiny/deberta_v2.yaml", path])


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["metrics"].update(mask_fracton=0.15), "metrics: Additional properties are not allowed ('mask_fracton' "
                                                       "was unexpected) (the fnet family's metrics)"),
    (lambda d: d["metrics"].pop("stress_inputs"), "metrics: 'stress_inputs' is a required property"),
    (lambda d: d["metrics"]["quality_bar"].update(max_cls_relative_l2="4%"), "metrics.quality_bar.max_cls_relative_l2: "
                                                                            "'4%' is not of type 'number'"),
    (lambda d: d["seeds"].pop("stress"), "seeds.stress is required: the fnet family draws with it"),
    (lambda d: d["seeds"].update(strees=0), "seeds.strees is no seed the fnet family uses; its seeds: masking, stress"),
])
def test_metrics_and_seeds_are_checked_against_the_familys_declaration(edit, message, tmp_path):
    """A misspelt metric would be ignored and a missing seed read as a default: both stop the run."""
    doc = study_doc()
    edit(doc)
    with pytest.raises(qc.ConfigError, match=re.escape(message)):
        load(doc, tmp_path)


@pytest.mark.parametrize("calibration, message", [
    ({"method": "max"}, r"variant 'fp8-own': calibration \{'method': 'max'\} is the recipe's own method; leave it out"),
    ({"method": "percentile", "percentile": 99}, r"variant 'fp8-own' names a calibration method but quantizes nothing"),
])
def test_a_variants_calibration_method_must_change_something(calibration, message, tmp_path):
    doc = study_doc()
    transforms = [] if calibration["method"] == "percentile" else [{"fp8": {}}]
    doc["variants"]["fp8-own"] = {"precision": "float16", "transforms": transforms, "calibration": calibration}
    with pytest.raises(qc.ConfigError, match=message):
        load(doc, tmp_path)


def test_a_variants_calibration_method_is_one_modelopt_has(tmp_path):
    """The schema's list of methods is the code's (calibration.CALIBRATION_METHODS)."""
    from quantstudy import calibration

    schema = yaml.safe_load((ROOT / "config/schemas/study.schema.yaml").read_text())
    listed = schema["properties"]["variants"]["additionalProperties"]["properties"]["calibration"]["properties"]["method"]
    assert tuple(listed["enum"]) == calibration.CALIBRATION_METHODS
    doc = study_doc()
    doc["variants"]["fp8-own"] = {"precision": "float16", "transforms": [{"fp8": {}}], "calibration": {"method": "minmax"}}
    with pytest.raises(qc.ConfigError, match="minmax"):
        load(doc, tmp_path)


def test_a_calibration_method_names_its_amax_file():
    from quantstudy import paths
    from quantstudy.study_values import calibration_label

    assert calibration_label({"method": "percentile", "percentile": 99.9}) == "percentile-99.9"
    assert calibration_label({"alpha": 0.5, "method": "smoothquant"}) == "smoothquant-0.5"
    assert paths.AMAX.format(study="s", model="m", setting="w", calibration=paths.calibration_suffix("mse")) \
        == "results/s/m/calib/w/amax-mse.json"
    assert paths.AMAX.format(study="s", model="m", setting="w", calibration=paths.calibration_suffix("")) \
        == "results/s/m/calib/w/amax.json"


@pytest.mark.parametrize("params, message", [
    ({"weight_scale": "per_channel"}, r"variant 'fp8-rows': fp8 has no parameter 'weight_scale'; its parameters: include"),
    ({"activation_scales": "per_row"}, r"variant 'fp8-rows': fp8 activation_scales 'per_row' is not one of static, per_token"),
])
def test_the_fp8_transforms_parameters_are_checked(params, message, tmp_path):
    """A misspelt granularity would build the per-tensor recipe again under another name."""
    doc = study_doc()
    doc["variants"]["fp8-rows"] = {"precision": "float16", "transforms": [{"fp8": params}]}
    with pytest.raises(qc.ConfigError, match=message):
        load(doc, tmp_path)
