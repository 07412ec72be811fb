"""benchmarks/torch_vs_plain.py on the tiny models (CPU): the project's engines, made by the workflow
(in a copy of the checkout), against the plain Transformers / timm implementations of the same math."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from quantstudy import artifacts, torch_vs_plain_measure as tvp_measure, torch_vs_plain_report as tvp_report
from quantstudy.devtools import copy_checkout

ROOT = Path(__file__).resolve().parent.parent
# One timed setting of each study of config/config.yaml: GPT-Neo has two graphs, DETR's 800 x 1067
# runs on the engine built at 800 x 800.
ONE_SETTING_PER_FAMILY = ["fnet-base/w512", "deberta-v3-base/w256", "xcit-nano/b1", "gpt-neo-125m/p256-c256",
                          "deformable-detr/800x1067"]
GRAPHS = {"gpt-neo-125m": ["prefill", "decode"]}


@pytest.fixture(scope="module")
def bench():
    from quantstudy import torch_vs_plain

    return torch_vs_plain


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A copy of the checkout for the workflow to make its engines in."""
    return copy_checkout(ROOT, tmp_path_factory.mktemp("torch_vs_plain") / "repo")


@pytest.fixture(scope="module")
def tiny_run(bench, checkout):
    out = checkout.parent / "out.json"
    doc = bench.main(["--tiny", "--settings", *ONE_SETTING_PER_FAMILY, "--workdir", str(checkout), "--cores", "2",
                      "--out", str(out), "--warmup", "1", "--rounds", "3", "--calls", "1", "--profile",
                      "--profile-calls", "1"])
    return doc, out


def test_the_project_engines_are_the_workflows_builds(tiny_run, checkout):
    """Each row's project engines are the builds the workflow made for the setting (its own or, for
    DETR's 800 x 1067, the engine built at 800 x 800 that serves it), each with its Snakemake log."""
    doc, _ = tiny_run
    for row in doc["rows"]:
        served = {"800x1067": "800x800"}.get(row["setting"], row["setting"])
        for v in (row["baseline"], row["candidate"]):
            build = checkout / "results" / row["study"] / "cpu-torch" / row["model"] / served / v / "build.json"
            made = artifacts.read_json(build, "build")
            assert made["status"] == "ok"
            assert (checkout / "logs" / row["study"] / "cpu-torch" / row["model"] / served / v / "build.log").exists()
            # The row names that build and the engine file it opened (on this CPU target: not compiled).
            opened = row["project_engines"][v]
            assert checkout / opened["build"] == build and "compiled_sha256" not in opened
            assert opened["engine_sha256"] == artifacts.sha256_file(checkout / made["graphs"][row["graph"]]["engine"])


def test_project_and_plain_compute_the_same_outputs(tiny_run):
    doc, _ = tiny_run
    assert [(r["model"], r["setting"], r["graph"]) for r in doc["rows"]] == [
        (m, st, g) for m, st in (s.split("/") for s in ONE_SETTING_PER_FAMILY) for g in GRAPHS.get(m, ["main"])]
    for row in doc["rows"]:
        assert row["status"] == "ok", row.get("error")
        chk, b, c = row["check"], row["baseline"], row["candidate"]
        assert chk["ok"], (row["model"], row["setting"], chk)
        # Every FP8 layer was checked on its own, each call of it.
        assert chk["fp8_layers"]["ok"] and chk["fp8_layers"]["layers"] == row["fp8_layers"][c]["project"]
        assert chk["fp8_layers"]["calls"] >= chk["fp8_layers"]["layers"] > 0
        assert row["fp8_layers"][c]["plain"] == row["fp8_layers"][c]["project"] > 0
        assert row["fp8_layers"][b] == {"project": 0, "plain": 0}
        assert all(ms > 0 for ms in row["ms"].values()) and len(row["ms"]) == 4
        assert set(row["profile"]) == set(row["ms"])
    fnet = doc["rows"][0]
    assert fnet["baseline"] == "fp16-hs"  # the 1/64 hidden scaling at 512 tokens, in both implementations
    # Eager on one CPU thread, Transformers' DeBERTa and the project's restatement run the same ops on the
    # same shapes: equal to the bit. Positional products in FP8 (the recipe's exclude_calls ignored)
    # would differ by 2e-4 here, below fp16 rounding and so within the tolerance.
    deberta = doc["rows"][1]
    assert [p["rel_l2"] for p in deberta["check"]["project_vs_plain"].values()] == [0.0, 0.0]


def test_the_json_is_an_artifact_and_the_tables_name_every_setting(bench, tiny_run):
    doc, out = tiny_run
    written = artifacts.read_json(out, "torch_vs_plain")
    assert [r["model"] for r in written["rows"]] == [r["model"] for r in doc["rows"]]
    table = tvp_report.summary_table(doc["rows"])
    for row in doc["rows"]:
        where = row["setting"] if row["graph"] == "main" else f"{row['setting']} {row['graph']}"
        assert f"| {row['family']} | {row['model']} | {where} |" in table
        assert "ok |" in table


def test_check_fails_a_plain_candidate_that_computes_the_baseline(bench):
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 64, generator=g)
    fp16 = ref + 1e-3 * torch.randn(4, 64, generator=g)
    fp8 = fp16 + 3e-2 * torch.randn(4, 64, generator=g)
    good = {"project fp16": {"y": fp16}, "plain fp16": {"y": fp16}, "project fp8": {"y": fp8},
            "plain fp8": {"y": fp8 + 1e-4 * torch.randn(4, 64, generator=g)}}
    assert tvp_measure.check(good, {"y": ref}, "fp16", "fp8")["ok"]
    lazy = {**good, "plain fp8": {"y": fp16}}
    assert not tvp_measure.check(lazy, {"y": ref}, "fp16", "fp8")["ok"]
    nan = {**good, "plain fp16": {"y": torch.full_like(fp16, float("nan"))}}
    assert not tvp_measure.check(nan, {"y": ref}, "fp16", "fp8")["ok"]


class _Wrap(torch.nn.Module):
    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": self.layer(x)}


def test_fp8_layers_agree_only_with_the_same_weights_and_scales(bench):
    from quantstudy.quantization import FP8Linear

    from quantstudy.plain import fp8 as plain_fp8

    g = torch.Generator().manual_seed(0)
    weight, bias, x = torch.randn(32, 64, generator=g), torch.randn(32, generator=g), torch.randn(4, 64, generator=g)
    project = _Wrap(FP8Linear(weight, bias, 3.0, float(weight.abs().max()), torch.float32, torch.float32))

    def plain_model(input_amax: float, w: torch.Tensor = weight) -> torch.nn.Module:
        return _Wrap(plain_fp8.FP8Linear(w, bias, input_amax, float(w.abs().max()), torch.float32, False))

    same = tvp_measure.fp8_layers_agree(project, plain_model(3.0), {"x": x})
    assert same["ok"] and same["calls"] == 1 and same["worst"]["rel_l2"] == 0.0
    assert not tvp_measure.fp8_layers_agree(project, plain_model(5.0), {"x": x})["ok"]  # another activation scale (not 2x: FP8 is a float)
    assert not tvp_measure.fp8_layers_agree(project, plain_model(3.0, 1.01 * weight), {"x": x})["ok"]  # another weight
    unquantized = tvp_measure.fp8_layers_agree(project, _Wrap(torch.nn.Linear(64, 32)), {"x": x})
    assert not unquantized["ok"] and unquantized["missing_in_plain"] == ["layer"]
    # A plain model one level down pairs its layers by the declared prefix, and only by it.
    below = _Wrap(plain_model(3.0))  # its FP8 layer is `layer.layer`
    assert tvp_measure.fp8_layers_agree(project, below, {"x": x}, prefix="layer.")["ok"]
    assert tvp_measure.fp8_layers_agree(project, below, {"x": x})["missing_in_plain"] == ["layer"]


def test_budget_stops_cleanly_before_a_setting_and_keeps_the_order_asked(bench, tmp_path, capsys):
    """Settings run in the order of the --settings patterns that match them (the most important first),
    then as config/config.yaml declares them; a spent budget starts nothing."""
    doc = bench.main(["--tiny", "--budget-s", "0", "--settings", "xcit-*/b1", "fnet-base/*", "--work",
                      str(tmp_path / "work"), "--out", str(tmp_path / "out.json")])
    assert doc["rows"] == []
    planned = [f"{r['model']}/{r['setting']}" for r in doc["not_run"]]
    assert planned == ["xcit-nano/b1", "fnet-base/w128", "fnet-base/w256", "fnet-base/w512", "fnet-base/b8-w512"]
    assert all("budget" in r["why"] for r in doc["not_run"])
    assert artifacts.read_json(tmp_path / "out.json", "torch_vs_plain")["not_run"] == doc["not_run"]
    assert "not run: xcit-nano/b1" in capsys.readouterr().out
    every = bench.main(["--tiny", "--budget-s", "0", "--work", str(tmp_path / "work")])["not_run"]
    assert [f"{r['model']}/{r['setting']}" for r in every[:5]] == [
        "fnet-base/w128", "fnet-base/w256", "fnet-base/w512", "fnet-base/b8-w512", "fnet-large/w256"]
    assert [f"{r['model']}/{r['setting']}" for r in every[-2:]] == ["deformable-detr/800x800", "deformable-detr/800x1067"]
    assert len(every) == 6 + 8 + 2 + 1 + 2  # every timed setting of the five studies


def test_a_setting_whose_build_fails_is_a_failed_row_and_the_others_are_measured(bench, checkout):
    """The FNet study with .test/'s variant that fails to build as its candidate, beside XCiT: the
    workflow records the failed build, the benchmark's row for that setting says why, and the XCiT
    setting after it is measured."""
    broken = checkout / "config" / "broken-candidate.yaml"  # absolute: a relative path is the package's
    broken.write_text("candidate: fp8-broken\n")
    (checkout / "config" / "broken.yaml").write_text(
        "run: {name: broken, weights: tiny-random-init, note: a candidate that does not build}\n"
        "hf_cache: resources/hf-cache\noffline: true\nstudies:\n"
        "  fnet: {spec: config/studies/fnet.yaml,\n"
        f"         overrides: [config/tiny/fnet.yaml, .test/fnet.yaml, {broken}]}}\n"
        "  timm_xcit: {spec: config/studies/timm_xcit.yaml, overrides: config/tiny/timm_xcit.yaml}\n"
        "targets:\n  cpu-torch: {backend: torch, device: cpu}\n  cpu-onnxruntime: {backend: onnxruntime, device: cpu}\n")
    doc = bench.main(["--config", str(checkout / "config" / "broken.yaml"), "--settings", "fnet-base/w512",
                      "xcit-nano/b1", "--workdir", str(checkout), "--cores", "2", "--warmup", "1", "--rounds", "1",
                      "--calls", "1"])
    failed, measured = doc["rows"]
    assert (failed["setting"], failed["status"]) == ("w512", "failed")
    assert "build of fp8-broken failed" in failed["error"] and "selects no layer" in failed["error"]
    assert (measured["setting"], measured["status"], measured["check"]["ok"]) == ("b1", "ok", True)


def test_compile_workers_compile_the_engines_this_process_then_reads(bench, tmp_path, monkeypatch):
    # The tiny run with its CPU engines compiled, into an inductor cache of this test's own. The
    # project's two engines are compiled by their builds (workflow jobs, other processes), the two
    # plain ones by the workers: this process finds all four in caches (a project engine's in its
    # build's compiled program, a plain one's where its worker left it) and compiles nothing.
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    checkout = copy_checkout(ROOT, tmp_path / "repo")
    compiled = checkout / "config" / "compiled.yaml"
    text = (checkout / "config" / "config.yaml").read_text()
    assert "cpu-torch: {backend: torch, device: cpu}" in text
    compiled.write_text(text.replace("cpu-torch: {backend: torch, device: cpu}",
                                     "cpu-torch: {backend: torch, device: cpu, compile: true}"))
    before = dict(counters["inductor"])
    doc = bench.main(["--config", str(compiled), "--settings", "fnet-base/w128", "--compile-workers", "--workdir",
                      str(checkout), "--work", str(tmp_path / "work"), "--warmup", "1", "--rounds", "1", "--calls", "1"])
    assert [r["status"] for r in doc["rows"]] == ["ok"] and doc["rows"][0]["check"]["ok"]
    assert doc["target"]["compile"]
    row = doc["rows"][0]
    assert sorted(p.name for p in (tmp_path / "work" / "compile-workers").iterdir()) == sorted(
        f"fnet-base-w128-plain-{v}.log" for v in (row["baseline"], row["candidate"]))
    hits = counters["inductor"]["fxgraph_cache_hit"] - before.get("fxgraph_cache_hit", 0)
    misses = counters["inductor"]["fxgraph_cache_miss"] - before.get("fxgraph_cache_miss", 0)
    assert (hits, misses) == (4, 0)


H200_OUTPUT = ROOT / "results" / "h200-torch-vs-plain"
# The device calls after the fixes, in the order run (before/ is the first run, before them).
H200_CALLS = [H200_OUTPUT / "torch_vs_plain.json", *sorted((H200_OUTPUT / "calls").glob("*/torch_vs_plain.json"))]


@pytest.mark.parametrize("out", H200_CALLS, ids=[str(p.parent.relative_to(ROOT)) for p in H200_CALLS])
def test_the_committed_h200_output_is_an_artifact_and_its_markdown_prints_its_rows(bench, out):
    """results/h200-torch-vs-plain/: each call's JSON is a valid artifact of the current schema, the
    markdown beside it is what the script prints from those rows, and every row's outputs agree. A call
    stopped by its device call's limit (no `wall_s`: the script never reached its end) has no summary."""
    doc = artifacts.read_json(out, "torch_vs_plain")
    printed = out.with_suffix(".md").read_text()
    assert (tvp_report.summary_table(doc["rows"]) in printed) == ("wall_s" in doc)
    for row in doc["rows"]:
        assert tvp_report.row_table(row) in printed
        assert row["status"] == "ok" and row["check"]["ok"] and row["check"]["fp8_layers"]["ok"]


def test_the_committed_h200_summary_is_the_summary_of_its_calls(bench, capsys, monkeypatch):
    """summary.md is what --summary prints over the calls' outputs (from the repository root), the
    later call's row of a setting timed twice."""
    monkeypatch.chdir(ROOT)
    result = bench.main(["--summary", *[str(p.relative_to(ROOT)) for p in H200_CALLS]])
    assert tvp_report.summary_table(result["rows"]) in (H200_OUTPUT / "summary.md").read_text()
    printed = capsys.readouterr().out
    assert printed == (H200_OUTPUT / "summary.md").read_text()
    # deberta-v3-base w256 was timed in the first call, in calls/3 and again in calls/20: the latest
    # run's row, whatever order the files come in (calls/20 sorts before calls/3).
    backwards = bench.main(["--summary", *[str(p.relative_to(ROOT)) for p in reversed(H200_CALLS)]])
    assert backwards["rows"] == result["rows"]
    again = [r for r in result["rows"] if (r["model"], r["setting"]) == ("deberta-v3-base", "w256")]
    timed = artifacts.read_json(H200_OUTPUT / "calls" / "20-deberta-base" / "torch_vs_plain.json", "torch_vs_plain")
    assert again == [r for r in timed["rows"] if (r["model"], r["setting"]) == ("deberta-v3-base", "w256")]
    # ... and the summary names that call as the row's source, with its start and workflow commit (its
    # working tree had changes: the commit's mark says so).
    assert timed["provenance"]["workflow_commit"] == "8c1ac7c8bcfcd963caf6c30d5b2a4f5c13ee23ef-dirty"
    assert (f"| deberta-v3-base/w256 | {(H200_OUTPUT / 'calls' / '20-deberta-base').relative_to(ROOT)} | "
            f"{timed['provenance']['started']} | 8c1ac7c8bcfc-dirty | NVIDIA H200 |") in printed
    # A row timed on another card names it: Deformable DETR 800x1067 was last timed on an H100.
    assert ("| deformable-detr/800x1067 | results/h200-torch-vs-plain/calls/21-detr-800x1067-h100 | "
            "2026-12-05T15:37:27.311+00:00 | 3036efdc8322 | NVIDIA H100 80GB HBM3 |") in printed
    # Issue 27's done-when: every timed setting of the config has a row, each within 3% of plain or
    # faster, and each from a call on the workflow's own builds (call 14 on; calls 1 to 13 compiled
    # the project's engines in the benchmark itself).
    assert result["missing"] == [] and result["over_margin"] == [] and len(result["rows"]) == 23
    sources = re.findall(r"^\| [^|]+ \| (results/h200-torch-vs-plain\S*) \|", printed, re.M)
    assert len(sources) == 23
    calls = [re.fullmatch(r"results/h200-torch-vs-plain/calls/(\d+)-[^/]+", s) for s in sources]
    assert all(call and int(call[1]) >= 14 for call in calls), sources


def test_the_summary_of_outputs_names_the_timed_settings_none_of_them_has(bench, tiny_run, capsys):
    doc, out = tiny_run
    result = bench.main(["--tiny", "--summary", str(out), str(out)])
    key = lambda r: (r["model"], r["setting"], r["graph"])
    assert [key(r) for r in result["rows"]] == [key(r) for r in doc["rows"]]
    ran = {f"{r['model']}/{r['setting']}" for r in doc["rows"]}
    assert result["missing"] and not ran & set(result["missing"])
    assert "fnet-base/w128" in result["missing"]
    assert result["uncovered"] == {}  # every registered family: studies and engine studies
    printed = capsys.readouterr().out
    assert "Not covered" not in printed
    assert tvp_report.summary_table(doc["rows"]) in printed


def test_a_registered_family_without_a_study_in_the_run_is_named_with_the_reason(bench):
    import yaml

    from quantstudy import config

    doc = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    assert bench.uncovered(config.load_run(doc)) == {}
    studies = {k: v for k, v in doc["studies"].items() if k != "deformable_detr"}
    without = bench.uncovered(config.load_run({**doc, "studies": studies}))
    assert set(without) == {"deformable_detr"}
    assert without["deformable_detr"].startswith("no study in the run config")


def test_a_device_calls_config_layer_declares_the_card_it_runs_on(bench, tmp_path, monkeypatch):
    """`--config config/h200.yaml config/realsize/calls/h100.yaml` is the run the workflow makes of the same
    two --configfile: its torch target declares the H100, and a host without one stops before any build."""
    from quantstudy import lockfile

    from helpers import stand_in_lock

    if torch.cuda.is_available():
        pytest.skip("the refusal is checked on a host without a GPU")
    monkeypatch.setattr(lockfile, "LOCK_FILE", tmp_path / "revisions.lock.yaml")
    stand_in_lock(lockfile.LOCK_FILE, ["config/h200.yaml"])
    run = bench.load_run([ROOT / "config/h200.yaml", ROOT / "config/realsize/calls/h100.yaml"])
    assert run.targets["h200-torch"].gpu == "h100"
    with pytest.raises(SystemExit, match="target h200-torch declares gpu h100, but this host has no GPU"):
        bench.torch_target(run)


def test_plain_gpt_neo_computes_the_project_prefill_and_decode(bench, tmp_path):
    """Plain GPT-Neo (Transformers' forward over its StaticCache) against the project's prefill and
    decode graphs, fp16 and FP8, on a tiny model whose local window spans the cache: the outputs pass
    the benchmark's check (FP8 layers one by one), the decode writes the new token into the cache it
    was given, and a cache longer than the window (where Transformers masks local layers wrongly) is
    refused."""
    from quantstudy import plain
    from quantstudy.plain import gpt_neo as plain_gpt_neo

    from quantstudy import config, families, quantization, transforms
    from quantstudy.families import base

    from helpers import observed_amax

    fam = families.get("gpt_neo")
    arch = {**config.load_architecture("tiny-gpt-neo-125m"), "window_size": 16}
    for name, data in fam.tiny_checkpoint_files(arch, {"seed": 0}).items():
        (tmp_path / name).write_bytes(data)
    st = base.Setting("p12-c16", 1, {"prefill": 12, "cache": 16})
    recipe = {"quantize": [f"transformer.h.*.{p}" for p in ("attn.attention.q_proj", "attn.attention.k_proj",
                                                             "attn.attention.v_proj", "mlp.c_fc", "mlp.c_proj")],
              "dequantize_dtype": "float16"}
    amax = observed_amax(fam.module(tmp_path, "prefill", st), [fam.example_inputs(tmp_path, "prefill", st)])
    specs = {"fp16": {"precision": "float16", "transforms": []},
             "fp8": {"precision": "float16", "transforms": [{"fp8": {}}]}}
    for graph in ("prefill", "decode"):
        example = quantization.cast_inputs(fam.example_inputs(tmp_path, graph, st), "float16")
        outputs, engines = {}, {}
        for v, spec in specs.items():
            project, summary = transforms.apply_variant(fam.module(tmp_path, graph, st), spec, recipe, amax)
            fp8 = {n: amax["amax"][n] for n in summary["fp8_layers"]}
            variant = plain.Variant(v, "float16", {}, fp8, "float16", {})
            engines[v] = plain_gpt_neo.model(tmp_path, st, variant, "cpu", graph)
            given = {k: t.clone() for k, t in example.items()}
            with torch.no_grad():
                outputs[f"project {v}"], outputs[f"plain {v}"] = project(**example), engines[v](**given)
            if graph == "decode":  # the plain decode's caches are the buffers it was given, written in place
                assert outputs[f"plain {v}"]["present_key_0"].data_ptr() == given["past_key_0"].data_ptr()
                torch.testing.assert_close(outputs[f"plain {v}"]["present_key_0"],
                                           outputs[f"project {v}"]["present_key_0"])
            engines[f"project {v}"] = project
        layers = tvp_measure.fp8_layers_agree(engines["project fp8"], engines["fp8"], example, plain.layer_prefix("gpt_neo"))
        result = tvp_measure.check(outputs, tvp_measure.fp32_outputs("gpt_neo", str(tmp_path), st, graph, example, "cpu"),
                             "fp16", "fp8", layers)
        assert result["ok"], result
        assert layers["layers"] == arch["num_layers"] * 5 and not layers["missing_in_plain"]
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    for name, data in fam.tiny_checkpoint_files({**arch, "window_size": 8}, {"seed": 0}).items():
        (narrow / name).write_bytes(data)
    with pytest.raises(ValueError, match="longer than the local window 8"):
        plain_gpt_neo.model(narrow, st, plain.Variant("fp16", "float16", {}, {}, "float16", {}), "cpu", "decode")


def test_plain_deformable_detr_computes_the_project_engine(bench, tmp_path):
    """Plain Deformable DETR (Transformers' forward as it is) against the project's detector engine,
    fp16 and FP8, on the tiny model: the outputs pass the benchmark's check, the recipe's layers
    agree one by one."""
    from quantstudy import plain
    from quantstudy.plain import deformable_detr as plain_detr

    from quantstudy import config, families, quantization, transforms
    from quantstudy.families import base

    from helpers import observed_amax

    fam = families.get("deformable_detr")
    for name, data in fam.tiny_checkpoint_files(config.load_architecture("tiny-deformable-detr"), {"seed": 0}).items():
        (tmp_path / name).write_bytes(data)
    st = base.Setting("96x128", 1, {"height": 96, "width": 128})
    recipe = {"quantize": ["model.encoder.layers.*.self_attn.value_proj", "model.encoder.layers.*.self_attn.output_proj",
                           "model.encoder.layers.*.mlp.fc?", "model.decoder.layers.*.self_attn.?_proj",
                           "model.decoder.layers.*.encoder_attn.value_proj",
                           "model.decoder.layers.*.encoder_attn.output_proj", "model.decoder.layers.*.mlp.fc?"],
              "dequantize_dtype": "float16"}
    example = fam.example_inputs(tmp_path, "main", st)
    amax = observed_amax(fam.module(tmp_path, "main", st), [example])
    example = quantization.cast_inputs(example, "float16")
    outputs, models = {}, {}
    for v, spec in {"fp16": {"precision": "float16", "transforms": []},
                    "fp8": {"precision": "float16", "transforms": [{"fp8": {}}]}}.items():
        models[f"project {v}"], summary = transforms.apply_variant(fam.module(tmp_path, "main", st), spec, recipe, amax)
        fp8 = {n: amax["amax"][n] for n in summary["fp8_layers"]}
        variant = plain.Variant(v, "float16", {}, fp8, "float16", {})
        models[f"plain {v}"] = plain_detr.model(tmp_path, st, variant, "cpu", "main")
        with torch.no_grad():
            outputs[f"project {v}"], outputs[f"plain {v}"] = models[f"project {v}"](**example), models[f"plain {v}"](**example)
    layers = tvp_measure.fp8_layers_agree(models["project fp8"], models["plain fp8"], example, plain.layer_prefix("deformable_detr"))
    result = tvp_measure.check(outputs, tvp_measure.fp32_outputs("deformable_detr", str(tmp_path), st, "main", example, "cpu"),
                         "fp16", "fp8", layers)
    assert result["ok"], result
    assert layers["layers"] == len(summary["fp8_layers"]) > 0 and not layers["missing_in_plain"]


def test_rows_past_the_3_percent_margin_are_named(bench):
    """The summary's verdict: a row is over the issue's bar when either engine is slower than plain by more
    than 3%, its outputs differ, or it failed; a row at exactly 1.03 passes."""
    def row(setting, fp16, fp8, ok=True, status="ok"):
        return {"model": "m", "setting": setting, "status": status, "check": {"ok": ok},
                "ratio": {"fp16": {"x": fp16}, "fp8": {"x": fp8}}}

    rows = [row("at", 1.03, 0.9), row("fp8-slow", 1.0, 1.031), row("fp16-slow", 1.04, 1.0),
            row("differ", 1.0, 1.0, False), row("failed", 1.0, 1.0, status="failed")]
    assert tvp_report.over_margin(rows) == ["m/fp8-slow", "m/fp16-slow", "m/differ", "m/failed"]
