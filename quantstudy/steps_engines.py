"""The steps that make engines: a variant's ONNX export and its build (an engine per graph, for a target),
and open_engines, by which every measuring step opens a build's engines through the backend contract."""

from __future__ import annotations

import logging
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from quantstudy import artifacts, paths
from quantstudy.artifacts import now, read_json, sha256_path
from quantstudy.config import Target
from quantstudy.steps import family_of, job_settings, record_failure, record_result, setting_of, snapshot_of
from quantstudy.steps_reference import read_amax

if TYPE_CHECKING:  # for annotations only: a step imports backends (and torch) when it runs
    from quantstudy.backends import Runner

log = logging.getLogger("quantstudy")


def variant_modules(family: str, checkpoint_dir: str, setting, spec: dict, recipe: dict, amax_doc: dict | None,
                    graphs: Iterable[str]):
    """{graph: (variant module, summary)} of one variant at a setting."""
    from quantstudy import transforms

    fam = family_of(family)
    return {g: transforms.apply_variant(fam.module(checkpoint_dir, g, setting), spec, recipe, amax_doc,
                                        fam.transforms())
            for g in graphs}


def example_inputs(family: str, checkpoint_dir: str, graph: str, setting, precision: str) -> dict[str, Any]:
    """The family's example inputs of a graph at a setting, floating ones in the variant's precision:
    what an engine is built for, timed on and probed with."""
    from quantstudy import quantization

    return quantization.cast_inputs(family_of(family).example_inputs(checkpoint_dir, graph, setting), precision)


def _dynamic(graph) -> dict[str, dict[int, Any]]:
    return {name: dict(t.dynamic) for name, t in graph.inputs.items() if t.dynamic}


def _profile(graph) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) shapes of each dynamic input: the optimization profile an engine is built for."""
    def at(t, which):
        return tuple(getattr(t.dynamic[a], which) if a in t.dynamic else n for a, n in enumerate(t.shape))
    return {name: (at(t, "min"), at(t, "opt"), at(t, "max")) for name, t in graph.inputs.items() if t.dynamic}


def export(ident: dict[str, Any], family: str, setting: dict[str, Any], architecture: dict[str, Any],
           spec: dict[str, Any], recipe: dict[str, Any], checkpoint_json: str, amax_json: str | None, out: str,
           opset: int | None = None) -> None:
    """Export each graph of one variant to ONNX (fp32, fp16, FP8 Q/DQ). A failure is recorded."""
    from quantstudy import export as qe

    inputs = {"checkpoint": checkpoint_json, **({"amax": amax_json} if amax_json else {})}
    params = {"spec": spec, "recipe": recipe, "setting": setting, "opset": opset or qe.OPSET}

    def measure() -> dict[str, Any]:
        job_settings()
        amax_doc = read_amax(amax_json)
        fam, st, ckpt = family_of(family), setting_of(setting), snapshot_of(checkpoint_json)
        specs, graphs, summary = fam.graphs(st, architecture), {}, {}
        for name, (model, summary) in variant_modules(family, ckpt, st, spec, recipe, amax_doc, specs).items():
            info = qe.export(model, example_inputs(family, ckpt, name, st, spec["precision"]), paths.graph_dir(out, name),
                             opset or qe.OPSET, _dynamic(specs[name]))
            if sorted(info["fp8_layers"]) != summary["fp8_layers"]:
                raise RuntimeError(f"the {name} ONNX has Q/DQ for {info['fp8_layers']}, the variant's FP8 layers "
                                   f"are {summary['fp8_layers']}")
            graphs[name] = {**info, "onnx_sha256": sha256_path(info["onnx"])}
            log.info("exported %s %s: %s, %d bytes", ident, name, info["op_counts"], info["onnx_bytes"])
        return {"spec": spec, **summary, "graphs": graphs}

    record_result("export", "export", out, ident, inputs, params, measure, {"spec": spec})


def build(ident: dict[str, Any], family: str, target: dict[str, Any], setting: dict[str, Any],
          architecture: dict[str, Any], spec: dict[str, Any], recipe: dict[str, Any], checkpoint_json: str,
          amax_json: str | None, out: str, export_json: str | None = None,
          serves: list[dict[str, Any]] | None = None, rule: str = "build") -> None:
    """Build one engine per graph (variant x target), then its measurements record beside `out`
    (measurements.json, record.py), read from the engine and ONNX files. A build that raises, or whose
    record cannot be made, is recorded as failed, in both files. Both record `rule` as the one that made
    them: build, or rebuild for an evaluation job's own build (the script passes the rule Snakemake ran).

    A backend that builds from the module gets the variant module; one that builds from ONNX, the
    variant's exported ONNX (`export_json`). The engine is built for every setting whose jobs will
    open it (`serves`: this setting, then those whose `engine:` names it), and for no other shape.
    """
    from quantstudy import backends, record, transforms

    started = now()
    out_measurements = str(paths.beside(out, paths.MEASUREMENTS))
    inputs = {"checkpoint": checkpoint_json, **({"amax": amax_json} if amax_json else {}),
              **({"export": export_json} if export_json else {})}
    params = {"spec": spec, "recipe": recipe, "target": target, "setting": setting, "serves": serves}
    made: dict[str, Any] = {}  # what the measurements record needs besides the build record
    tgt = Target.from_params(target)

    def measure() -> dict[str, Any]:
        job_settings()
        transforms.refuse_block_scaled_engine(spec, tgt)
        amax_doc = read_amax(amax_json)
        backend = backends.get(tgt.backend)
        st, engines, ckpt = setting_of(setting), {}, snapshot_of(checkpoint_json)
        served = [setting_of(s) for s in serves or [setting]]
        graphs = family_of(family).graphs(st, architecture)

        def shapes(name: str):
            return backends.Shapes(tuple(example_inputs(family, ckpt, name, s, spec["precision"]) for s in served),
                                   _profile(graphs[name]))
        if backend.builds_from == "onnx":
            exported = made["export"] = read_json(export_json, "export")
            if exported["status"] != "ok":
                raise RuntimeError(f"the export of {ident['variant']} failed, so it cannot be built:\n"
                                   f"{exported['error']}")
            summary = {k: v for k, v in exported.items() if k not in _EXPORT_KEYS}
            for name, g in exported["graphs"].items():
                engines[name] = backend.build(g["onnx"], paths.graph_dir(out, name), tgt, shapes(name))
        else:
            modules = variant_modules(family, ckpt, st, spec, recipe, amax_doc, graphs)
            made["linear"] = {name: _linear_layers(model) for name, (model, _) in modules.items()}
            for name, (model, summary) in modules.items():
                engines[name] = backend.build(model, paths.graph_dir(out, name), tgt, shapes(name))
        for engine in engines.values():  # what every job that opens it checks, and the audit
            engine["engine_sha256"] = artifacts.sha256_file(engine["engine"])
            if "compiled" in engine:
                engine["compiled_sha256"] = artifacts.sha256_file(engine["compiled"])
        calibration = None
        if amax_doc:  # what opening the engine rebuilds its skeleton from: its FP8 and microscaled layers' amax
            calibration = {"amax": {n: amax_doc["amax"][n]
                                    for n in [*summary["fp8_layers"], *summary.get("microscaled_layers", [])]},
                           "outliers": amax_doc["outliers"]}
        engine_bytes = sum(e["engine_bytes"] for e in engines.values())
        log.info("built %s: %d FP8 layers, %d bytes", ident, len(summary["fp8_layers"]), engine_bytes)
        return {"spec": spec, **summary, "graphs": engines, "engine_bytes": engine_bytes, "calibration": calibration}

    doc = record_result("build", rule, out, ident, inputs, params, measure, {"spec": spec})
    if doc["status"] == "ok":
        try:
            record.measurements(ident, tgt, read_json(out, "build"), out, made.get("linear"), amax_json,
                                made.get("export"), export_json, out_measurements, started, rule)
            return
        except Exception:  # a build whose record cannot be made is a failed build
            doc = record_failure("build", rule, out, ident, inputs, params, started, traceback.format_exc(), {"spec": spec})
    record.failed(ident, doc["error"], out, out_measurements, started, rule)


def _linear_layers(model) -> list[str]:
    """The module names of a variant module's linear layers, FP8 or not."""
    import torch

    from quantstudy.quantization import FP8Linear

    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, FP8Linear))]


# What an export JSON says of itself, not of the variant: a build does not copy these.
_EXPORT_KEYS = {"schema", "schema_version", "status", "provenance", "graphs", "spec", "model", "setting", "variant"}
# The files of a built graph that every job opening it checks, with where build.json records their sha256.
_ENGINE_FILES = {"engine": "engine_sha256", "compiled": "compiled_sha256"}


def open_engines(family: str, build_doc: dict[str, Any], recipe: dict, checkpoint_json: str, setting,
                 target: Target, graphs: list[str] | None = None) -> dict[str, Runner]:
    """A built variant's engines, opened through the backend contract as runners ({graph: runner}) at
    the setting's example inputs. Each engine's files must be those the build wrote (sha256)."""
    from quantstudy import backends

    if build_doc["status"] != "ok":
        raise RuntimeError(f"the build of {build_doc['variant']} failed, so it cannot be measured")
    ckpt = snapshot_of(checkpoint_json)
    backend = backends.get(target.backend)
    names = [g for g in build_doc["graphs"] if graphs is None or g in graphs]
    skeletons = {}
    if backend.builds_from == "module":  # an ONNX engine carries its own structure
        skeletons = {g: m for g, (m, _) in variant_modules(family, ckpt, setting, build_doc["spec"], recipe,
                                                            build_doc.get("calibration"), names).items()}
    for g in names:
        for key, digest in _ENGINE_FILES.items():
            path = build_doc["graphs"][g].get(key)
            if path and artifacts.sha256_file(path) != build_doc["graphs"][g][digest]:
                raise RuntimeError(f"{path} is not the file the build of {build_doc['variant']} made (its sha256 "
                                   f"differs from the build's); rebuild it: "
                                   f"{artifacts.rerun_command(paths.build_of_engine(Path(path).parent))}")
    precision = build_doc["spec"]["precision"]
    examples = {g: example_inputs(family, ckpt, g, setting, precision) for g in names}
    for g in names:  # a torch engine runs the shapes it was built for, and no other
        built = build_doc["graphs"][g].get("shapes")
        wanted = {k: list(v.shape) for k, v in examples[g].items()}
        if built is not None and wanted not in built:
            raise RuntimeError(f"the {g} engine of {build_doc['variant']} was built for {built}, not for setting "
                               f"{setting.name}'s {wanted}: its build must serve that setting (`engine:`)")
    return {g: backend.open(Path(build_doc["graphs"][g]["engine"]).parent, examples[g], target, skeletons.get(g))
            for g in names}
