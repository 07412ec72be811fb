"""NVFP4 and MXFP8 variants (`microscaling` transform, `timed: blackwell`) through the study model, the
build and evaluate steps, and the README: quality anywhere, speed on Blackwell targets only, a width the
block does not divide a recorded failure, and the write-up's "not tried" item measured only where it ran."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import yaml

from quantstudy import config as qc, render, render_formats, render_view, steps, steps_engines, steps_measure, steps_reference, transforms

from helpers import CPU_TORCH, FNET_SETTING, ROOT, ident

NVFP4 = {"precision": "float16", "transforms": [{"microscaling": {"format": "nvfp4"}}]}
B200 = {"backend": "tensorrt", "device": "cuda", "gpu": "b200", "version": "11.4"}


def questions_run(targets: dict | None = None) -> qc.Run:
    """The embedded default with config/questions.yaml layered over it, as Snakemake merges the two
    --configfile's (and `targets` added to the run's)."""
    run = qc.deep_merge(yaml.safe_load((ROOT / "config/config.yaml").read_text()),
                        yaml.safe_load((ROOT / "config/questions.yaml").read_text()))
    run["targets"].update(targets or {})
    return qc.load_run(run, against_code=False)


def test_a_microscaled_variant_reads_the_amax_and_is_evaluated_not_timed_off_blackwell():
    run = questions_run()
    for study in run.studies.values():
        for v in ("nvfp4", "mxfp8"):
            variant = study.variants[v]
            assert variant.timed == "blackwell" and variant.precision == study.variants[study.candidate].precision
            assert all(variant.needs_amax(study.setting(s)) for s in study.settings)
        evaluated = {(t, v) for t, _, _, v in study.engines(run.targets, quality_only=True)}
        timed = {(t, v) for t, _, _, v in study.engines(run.targets, timed_only=True)}
        assert {("cpu-torch", "nvfp4"), ("cpu-torch", "mxfp8")} <= evaluated, study.name
        assert not {v for _, v in timed} & {"nvfp4", "mxfp8"}, study.name
        # kept off the ONNX target, whose graph has no block-scaled form
        assert not {v for t, v in evaluated if t == "cpu-onnxruntime"} & {"nvfp4", "mxfp8"}
        # and never built at a setting that nothing measures them at (speed only, `quality: false`)
        assert all(study.settings[s].quality for _, _, s, v in study.builds(run.targets) if v in ("nvfp4", "mxfp8"))


def test_a_blackwell_target_times_a_microscaled_variant_and_no_other_target_does():
    run = questions_run({"b200-trt11.4": B200})
    fnet = dataclasses.replace(run.studies["fnet"], targets={**run.studies["fnet"].targets, "b200-trt11.4": {}})
    timed = {(t, v) for t, _, _, v in fnet.engines(run.targets, timed_only=True)}
    assert ("b200-trt11.4", "nvfp4") in timed and ("b200-trt11.4", "mxfp8") in timed
    assert ("cpu-torch", "nvfp4") not in timed and ("cpu-torch", "fp8") in timed


@pytest.fixture(scope="module")
def calibrated(tiny_inputs, tmp_path_factory):
    """The tiny FNet's reference at 64 tokens and its amax file, made by the steps."""
    out, study = tmp_path_factory.mktemp("micro"), tiny_inputs["study"]
    checkpoint = str(tiny_inputs["checkpoint"])
    samples = {name: str(tiny_inputs["samples"][name]) for name in study.evaluation_samples}
    steps_reference.reference("fnet", "fnet-base", FNET_SETTING, study.metrics, study.seeds, checkpoint, samples,
                              str(out / "reference.json"), str(out / "reference.safetensors"))
    steps_reference.calibrate("fnet", "fnet-base", FNET_SETTING, study.models["fnet-base"].architecture, study.recipe.as_params(),
                              checkpoint, str(tiny_inputs["calibration"]), str(out / "amax.json"))
    return {"out": out, "study": study, "checkpoint": checkpoint, "samples": samples, "amax": str(out / "amax.json")}


def test_an_nvfp4_engine_opens_with_its_calibrated_scales_and_is_evaluated(calibrated):
    """Built by the build step on cpu-torch from the amax file, then opened by the evaluate step, which rebuilds
    its skeleton from the build's record: the NVFP4 layers' activation amax must be in it."""
    c, out = calibrated, calibrated["out"]
    recipe = c["study"].recipe.as_params()
    steps_engines.build(ident("nvfp4"), "fnet", CPU_TORCH, FNET_SETTING, {}, NVFP4, recipe, c["checkpoint"], c["amax"],
                        str(out / "nvfp4" / "build.json"))
    build = json.loads((out / "nvfp4" / "build.json").read_text())
    assert build["status"] == "ok", build.get("error")
    assert build["microscaled_layers"] and build["fp8_layers"] == []
    assert set(build["calibration"]["amax"]) == set(build["microscaled_layers"])
    steps_measure.evaluate(ident("nvfp4"), "fnet", CPU_TORCH, FNET_SETTING, recipe, c["study"].metrics, c["study"].seeds,
                           c["checkpoint"], str(out / "nvfp4" / "build.json"), str(out / "reference.json"),
                           str(out / "reference.safetensors"), c["samples"], str(out / "nvfp4" / "quality.json"))
    quality = json.loads((out / "nvfp4" / "quality.json").read_text())
    assert quality["status"] == "ok", quality.get("error")
    # NVFP4 moves the features off the fp32 reference, by much more than nothing and less than everything
    assert 1e-4 < quality["blocks"]["cls"]["relative_error"] < 1


def test_a_microscaled_variants_export_is_a_recorded_failure_with_the_reason(calibrated):
    """The ONNX a TensorRT or ONNX Runtime target builds from has no block-scaled form here: the export step
    records why, rather than write a graph whose fake-quant ops an engine would time as NVFP4."""
    c, out = calibrated, calibrated["out"] / "onnx-nvfp4" / "export.json"
    steps_engines.export({k: v for k, v in ident("nvfp4").items() if k != "target"}, "fnet", FNET_SETTING, {}, NVFP4,
                         c["study"].recipe.as_params(), c["checkpoint"], c["amax"], str(out))
    doc = json.loads(out.read_text())
    assert doc["status"] == "failed" and "NVFP4 layers have no ONNX form here" in doc["error"]


def test_a_width_the_block_does_not_divide_is_the_variants_recorded_failure(tiny_inputs, tmp_path):
    """A tiny FNet 40 wide: its intermediate.dense layers take 40 inputs, no multiple of NVFP4's block of 16
    (output.dense takes 80, which is). The build step writes a failed build.json naming those layers."""
    arch = {**qc.load_architecture("tiny-fnet-base"), "hidden_size": 40, "intermediate_size": 80}
    repo, revision, cache = "quantstudy-tiny/fnet-40", "4" * 40, str(tmp_path / "hf-cache")
    steps.local_hub("fnet", [{"repo": repo, "revision": revision, "architecture": arch, "tiny": {"seed": 0}}], [],
                    cache, str(tmp_path / "local_hub.json"))
    checkpoint = str(tmp_path / "checkpoint.json")
    steps.fetch_checkpoint(repo, revision, cache, True, "tiny-random-init", checkpoint)
    recipe = tiny_inputs["study"].recipe.as_params()
    steps_reference.calibrate("fnet", "fnet-40", FNET_SETTING, arch, recipe, checkpoint, str(tiny_inputs["calibration"]),
                              str(tmp_path / "amax.json"))
    out = tmp_path / "nvfp4" / "build.json"
    steps_engines.build(ident("nvfp4", "fnet-40"), "fnet", CPU_TORCH, FNET_SETTING, arch, NVFP4, recipe, checkpoint,
                        str(tmp_path / "amax.json"), str(out))
    doc = json.loads(out.read_text())
    assert doc["status"] == "failed"
    assert "nvfp4 scales blocks of 16" in doc["error"] and "fnet.encoder.layer.0.intermediate.dense (40)" in doc["error"]
    assert "output.dense" not in doc["error"].splitlines()[-1]
    record = json.loads((tmp_path / "nvfp4" / "measurements.json").read_text())
    assert record["status"] == "failed"


def test_a_layer_called_at_a_declared_site_is_microscaled_there_unless_the_recipe_keeps_the_site_out(tmp_path):
    """DeBERTa's query_proj and key_proj also project the relative position embeddings (call site
    `relative_positions`, which its recipe's exclude_calls keeps in fp16): the nvfp4 variant runs those
    products on the work-precision weight, bit for bit fp16's, and its hidden rows in NVFP4; with
    `exclude_calls: []` the positional products are microscaled as well."""
    import torch

    from quantstudy import families
    from quantstudy.families.base import Setting
    from quantstudy.families.deberta_v2_model import POSITIONS

    from helpers import observed_amax, tiny_checkpoint

    fam, setting = families.get("deberta_v2"), Setting("b1-w24", 1, {"window": 24})
    ckpt = tiny_checkpoint(fam, "tiny-deberta-v3-base", tmp_path)
    inputs = fam.example_inputs(ckpt, "main", setting)
    amax = observed_amax(fam.module(ckpt, "main", setting), [inputs])
    recipe = {"quantize": ["deberta.encoder.layer.*.attention.self.*_proj"], "dequantize_dtype": "float16",
              "exclude_calls": [POSITIONS]}
    calls: dict[str, list] = {}

    def run(spec, kind):
        model, summary = transforms.apply_variant(fam.module(ckpt, "main", setting), spec, recipe, amax)
        for name, m in model.named_modules():
            if name.endswith(("layer.0.attention.self.query_proj", "layer.0.attention.self.query_proj.work_precision")):
                m.register_forward_hook(lambda m, i, o, name=name: calls.setdefault(f"{kind} {name}", []).append(o))
        with torch.no_grad():
            model(**inputs)
        return summary

    run({"precision": "float16", "transforms": []}, "fp16")
    summary = run(NVFP4, "nvfp4")
    run({"precision": "float16", "transforms": [{"microscaling": {"format": "nvfp4", "exclude_calls": []}}]}, "every")
    q = "deberta.encoder.layer.0.attention.self.query_proj"
    assert summary["unquantized_calls"][q] == [POSITIONS]
    hidden, positional = calls[f"fp16 {q}"]
    assert torch.equal(calls[f"nvfp4 {q}.work_precision"][0], positional)
    assert not torch.allclose(calls[f"nvfp4 {q}"][0], hidden, atol=1e-3)
    assert not torch.allclose(calls[f"every {q}"][1], positional, atol=1e-3)


def test_a_blackwell_target_records_that_no_backend_builds_a_block_scaled_engine():
    b200 = qc.Target("b200-trt11.4", **B200)
    with pytest.raises(NotImplementedError, match="no backend implements an NVFP4 engine yet: target b200-trt11.4"):
        transforms.refuse_block_scaled_engine(NVFP4, b200)
    transforms.refuse_block_scaled_engine(NVFP4, qc.Target.from_params(CPU_TORCH))  # quality, by fake-quant
    transforms.refuse_block_scaled_engine({"precision": "float16", "transforms": [{"fp8": {}}]}, b200)


# --- the README ------------------------------------------------------------------------------

GPT_NEO = ROOT / "results/h200-gpt-neo/gpt_neo/results/gpt_neo/tables.json"


def with_microscaled(tables: dict, ran: bool = True) -> dict:
    """The committed GPT-Neo evidence (one h200-torch target) with `nvfp4` and `mxfp8` in its study as
    `timed: blackwell`; where they `ran`, a build and a quality row each, copied from fp8's with a KL twice
    (nvfp4) and 1.1 times (mxfp8) fp8's."""
    tables = copy.deepcopy(tables)
    for v in ("nvfp4", "mxfp8"):
        tables["spec"]["variants"][v] = {"precision": "float16", "timed": "blackwell",
                                         "transforms": [{"microscaling": {"format": v}}]}
    if ran:
        for v, factor in (("nvfp4", 2.0), ("mxfp8", 1.1)):
            for table in ("builds", "quality", "records"):
                for row in [r for r in tables[table] if r["variant"] == "fp8"]:
                    new = {**row, "variant": v, "source": row["source"].replace("/fp8/", f"/{v}/")}
                    if table == "quality":  # the evidence's rows predate the `... / fp16` column
                        new["wikitext.kl_mean"] = row["wikitext.kl_mean"] * factor
                    if table == "builds":
                        new.update(fp8_layers=0, microscaled_layers=48, microscaling_format=v)
                    if table == "records":
                        new.update(fp8_layers=0)  # its other linear layers are the fp8 build's
                    tables[table].append(new)
    return tables


def test_the_readme_says_a_microscaled_variants_speed_needs_a_blackwell_gpu_and_why():
    from quantstudy import artifacts

    tables = with_microscaled(artifacts.read_json(GPT_NEO, "tables"))
    section = render.render_section(tables)
    reason = "NVFP4 / MXFP8 GEMMs run on Blackwell tensor cores, sm_100+; this run's targets are `h200-torch` (H200)"
    assert f"`nvfp4`, `mxfp8`: speed **needs a Blackwell GPU** ({reason})" in section
    speed_rows = [line for line in section.splitlines()  # a row per graph, with the other variants' column
                  if line.startswith("| gpt-neo-125m, `p256-c256` (") and "fp8-c_fc: [" in line]
    assert len(speed_rows) == 2 and all(line.rstrip(" |").endswith("nvfp4: needs a Blackwell GPU; mxfp8: needs a Blackwell GPU")
                              for line in speed_rows), speed_rows
    variant_rows = [line for line in section.splitlines() if line.startswith("| h200-torch | gpt-neo-125m, `p256-c256` | `nvfp4` |")]
    assert len(variant_rows) == 1 and variant_rows[0].count("needs a Blackwell GPU") == 2  # x decode, x prefill
    # the recipe fold's as-built table counts its microscaled layers
    built = [line for line in section.splitlines() if line.startswith("| h200-torch | gpt-neo-125m, `p256-c256` (decode) | nvfp4 |")]
    assert len(built) == 1 and "and 48 NVFP4 fake-quant |" in built[0], built
    # nor where the variant is not built (a target that leaves it out, like the embedded default's ONNX one)
    left_out = copy.deepcopy(tables)
    left_out["builds"] = [b for b in left_out["builds"] if b["variant"] != "mxfp8"]
    assert "mxfp8: needs a Blackwell GPU" not in render.render_section(left_out)
    # on a Blackwell target the variant is timed: no such words
    for target in tables["targets"].values():
        target["gpu"] = "b200"
    assert "needs a Blackwell GPU" not in render.render_section(tables)


def test_the_not_tried_item_reads_measured_here_only_where_the_variant_ran():
    from quantstudy import artifacts

    evidence = artifacts.read_json(GPT_NEO, "tables")
    item = lambda section: next(x for x in section.splitlines() if x.startswith("- NVFP4, not tried by the write-up"))  # noqa: E731
    assert item(render.render_section(evidence)).endswith("Not built or measured here either.")
    not_run = item(render.render_section(with_microscaled(evidence, ran=False)))
    assert not_run.endswith("Not built or measured here either.") and "Measured here" not in not_run
    ran = with_microscaled(evidence)
    line = item(render.render_section(ran))
    kl = {r["variant"]: r["wikitext.kl_mean"] for r in ran["quality"]}
    fp8 = [kl["fp8"] / kl["fp16"]]
    assert "Not built or measured here either" not in line
    assert (f"**Measured here** as `nvfp4`: next-token KL against PyTorch bf16, over the `fp16` engine's: "
            f"{render_formats.num(2 * fp8[0], 1)} times over 1 row (`fp8`: {render_formats.num(fp8[0], 1)} times); speed needs a "
            "Blackwell GPU (not timed on `h200-torch`).") in line
    assert "**Measured here** as `mxfp8`" in line
    # a variant whose every step failed is tried, and nothing of it is claimed
    for table in ("builds", "quality"):
        for r in ran[table]:
            if r["variant"] == "nvfp4":
                r.update(status="failed", error="Traceback ...\nValueError: nvfp4 scales blocks of 16 ...")
    line = item(render.render_section(ran))
    assert "**Tried here** as `nvfp4`, and nothing of it was measured; 2 failed steps (first: ValueError: nvfp4" in line


def test_the_plot_lists_the_variants_whose_speed_needs_a_blackwell_gpu():
    from quantstudy import artifacts, plots

    pts, by_design = plots.points(with_microscaled(artifacts.read_json(GPT_NEO, "tables")))
    assert not {p.variant for p in pts} & {"nvfp4", "mxfp8"}
    assert by_design[f"quality only, speed needs a Blackwell GPU ({render_view.BLACKWELL_REASON})"] == ["h200-torch: nvfp4, mxfp8"]


def test_a_builds_row_counts_its_microscaled_layers_only_where_it_has_some():
    from quantstudy import aggregate_rows

    doc = {"engine_bytes": 10, "fp8_layers": [], "precision": "float16", "graphs": {"main": {"engine_bytes": 10}}}
    row, = aggregate_rows.build_rows({**doc, "microscaled_layers": ["a", "b"], "microscaling_format": "mxfp8"})
    assert row["microscaled_layers"] == 2 and row["microscaling_format"] == "mxfp8" and row["fp8_layers"] == 0
    row, = aggregate_rows.build_rows(doc)  # the main job's tables keep their columns
    assert "microscaled_layers" not in row


def test_a_plot_colours_the_variants_it_draws_however_many_quality_only_ones_the_study_has():
    """The questions overlays give GPT-Neo 20 variants besides fp16 and fp8, more than the plot's 14 other
    colours; the quality-only ones (calibration methods, nvfp4, mxfp8) are not drawn and take none."""
    from quantstudy import artifacts, plots

    tables = with_microscaled(artifacts.read_json(GPT_NEO, "tables"))
    for i in range(12):
        tables["spec"]["variants"][f"fp8-method-{i}"] = {"precision": "float16", "timed": False,
                                                         "transforms": [{"fp8": {}}]}
    assert len(tables["spec"]["variants"]) - 2 > len(plots.OTHER_COLOURS)
    plots.figure(tables)
