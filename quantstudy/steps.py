"""The study's steps, one function per rule of the workflow, callable without Snakemake.

Each step reads the artifacts earlier steps wrote and writes its own; nothing is passed in
memory between steps. A step that measures a variant records a failure as its result. The
steps are the harness: they know backends, timing, files and provenance, and reach the model
only through the family contract (families/base.py), so no step names a family.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from quantstudy import artifacts, hub, paths
from quantstudy.artifacts import now, provenance, read_json, sha256_path, write_json
from quantstudy.config import Recipe, Target, on_its_card
from quantstudy.study import calibration_label
from quantstudy.timing import measures_speed

if TYPE_CHECKING:  # for annotations only: a step imports backends (and torch) when it runs
    from quantstudy.backends import Runner

log = logging.getLogger("quantstudy")


@contextlib.contextmanager
def logged(log_file: str | Path | None):
    """Send the package's log lines (progress included) to the rule's log file and stderr."""
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setLevel(logging.WARNING)  # progress goes to the log file; the terminal gets problems
    handlers: list[logging.Handler] = [terminal]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file, mode="w"))
    for h in handlers:
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        for h in handlers:
            log.removeHandler(h)
            h.close()


class Progress:
    """Log lines for long loops: about every 10% (and the last), with the elapsed time."""

    def __init__(self, what: str, total: int):
        import time

        self.what, self.total, self._time, self.start = what, total, time.perf_counter, time.perf_counter()
        self.every = max(1, total // 10)

    def __call__(self, done: int, total: int | None = None) -> None:
        if done % self.every == 0 or done == (total or self.total):
            log.info("%s: %d/%d (%.1f s)", self.what, done, total or self.total, self._time() - self.start)


def job_settings() -> None:
    """The process settings every workflow job runs under (a benchmark that stands for a job sets them too)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: references and the fp32 DFT
    torch.backends.cudnn.allow_tf32 = False
    # Only cuDNN engines that cuDNN marks deterministic: every job that opens one build must get one
    # answer (the audit's probes). Not enough on its own: 6 processes that opened one compiled tiny
    # detector engine (fp32) on an H200 at once still got 4 answers with it, 5 without; inductor's
    # deterministic option, a compile option of every torch engine (torch_backend.INDUCTOR_OPTIONS),
    # brought them to 1 (benchmarks/compile_determinism.py; its results are in the H200 evidence).
    torch.backends.cudnn.deterministic = True
    torch.manual_seed(0)
    if not torch.cuda.is_available():
        # One intra-op thread on a CPU-only host: jobs run side by side on few cores, and a reduction
        # then sums in one order on any host (the Slurm test compares two runs' numbers bit for bit).
        torch.set_num_threads(1)


def _gpu_work(device: str):
    """A shared turn on the GPU (timing.device_lock) for a job's GPU work: never during a measurement."""
    from quantstudy import timing as qt

    return qt.device_lock(device, shared=True)


def _device() -> str:
    """Where the fp32 reference and the calibration run: the GPU if there is one (real-size models
    are too slow on a CPU), else the CPU. Recorded in their JSON."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _family(name: str):
    from quantstudy import families

    return families.get(name)


def _setting(setting: dict[str, Any]):
    """A setting as rules pass it (Setting.as_params) -> base.Setting."""
    from quantstudy.families.base import Setting

    return Setting.from_params(setting)


def _snapshot(checkpoint_json: str) -> str:
    return read_json(checkpoint_json, "checkpoint")["snapshot"]


# --- fixtures and fetching --------------------------------------------------------------------

def local_hub(family: str, models: list[dict[str, Any]], datasets: list[dict[str, Any]], cache_dir: str,
              out: str, weights: str = "tiny-random-init") -> None:
    """Generate tiny checkpoints and datasets into the local HF cache, at their content-hash revisions.

    `models`: repo, revision, architecture (dict) and tiny spec; `datasets`: repo, revision, files, tiny spec.
    A dataset is generated for the first model's architecture (its tokenizer's vocabulary, say).
    """
    started = now()
    fam = _family(family)
    placed = []
    for m in models:
        files = fam.tiny_checkpoint_files(m["architecture"], m["tiny"])
        hub.place_in_cache(cache_dir, m["repo"], "model", m["revision"], files)
        placed.append({"repo": m["repo"], "repo_type": "model", "revision": m["revision"], "files": sorted(files)})
        log.info("placed %s at %s", m["repo"], m["revision"])
    for d in datasets:
        files = fam.tiny_dataset_files(d["files"], d["tiny"], models[0]["architecture"] if models else {})
        hub.place_in_cache(cache_dir, d["repo"], "dataset", d["revision"], files)
        placed.append({"repo": d["repo"], "repo_type": "dataset", "revision": d["revision"], "files": sorted(files)})
        log.info("placed dataset %s at %s", d["repo"], d["revision"])
    write_json(out, "local_hub", {"weights": weights, "placed": placed,
                                  "provenance": provenance("local_hub", params={"models": models, "datasets": datasets},
                                                           started=started)})


def fetch_checkpoint(repo: str, revision: str, cache_dir: str, offline: bool, weights: str, out: str,
                     local_hub_json: str | None = None) -> None:
    started = now()
    path = hub.snapshot(repo, revision, cache_dir, "model", hub.CHECKPOINT_FILES, offline)
    files = {p.relative_to(path).as_posix(): artifacts.sha256_file(p) for p in sorted(path.rglob("*")) if p.is_file()}
    log.info("%s at %s: %d files in %s", repo, revision, len(files), path)
    write_json(out, "checkpoint", {
        "repo": repo, "revision": revision, "snapshot": str(path.resolve()), "files": files, "weights": weights,
        "provenance": provenance("fetch_checkpoint", {"local_hub": local_hub_json} if local_hub_json else {},
                                 {"repo": repo, "revision": revision}, started)})


def _load_split(snapshot: Path, pattern: str):
    import datasets

    paths = sorted(str(p) for p in snapshot.glob(pattern) if p.is_file())
    if not paths:
        raise FileNotFoundError(f"no file matches {pattern!r} in {snapshot}")
    suffix = Path(paths[0]).name.split(".", 1)[-1]
    builder = {"parquet": "parquet", "csv": "csv", "csv.gz": "csv", "json": "json", "jsonl": "json",
               "jsonl.gz": "json", "tar": "webdataset"}.get(suffix)
    if builder is None:
        raise ValueError(f"don't know how to read {paths[0]}")
    if builder == "parquet":
        # Each row with its file and its place there, as a WebDataset row comes with its shard
        # (__url__): a sample of large content (an image) can point at it in the pinned snapshot.
        parts = [datasets.load_dataset(builder, data_files=[p], split="train") for p in paths]
        return datasets.concatenate_datasets([d.add_column("__url__", [p] * len(d)).add_column(
            "__index__", list(range(len(d)))) for p, d in zip(paths, parts)])
    return datasets.load_dataset(builder, data_files=paths, split="train")


def fetch_dataset(name: str, samples_spec: dict[str, Any], dataset: dict[str, Any], family: str, cache_dir: str,
                  offline: bool, checkpoint_json: str, out: str, local_hub_json: str | None = None) -> None:
    """Draw the samples (the family's rule, seeded) from a split of a pinned dataset; record the
    snapshot and the sha256 of each file of the split, so that the audit can draw them again."""
    started = now()
    split = samples_spec["split"]
    snap = hub.snapshot(dataset["repo"], dataset["revision"], cache_dir, "dataset", [dataset["files"][split]], offline)
    samples = draw_samples(samples_spec, dataset, family, snap, checkpoint_json)
    if len(samples) < samples_spec["count"]:
        log.warning("%s: only %d of %d samples qualify", name, len(samples), samples_spec["count"])
    files = {p.relative_to(snap).as_posix(): artifacts.sha256_file(p)
             for p in sorted(snap.glob(dataset["files"][split])) if p.is_file()}
    write_json(out, "samples", {
        "dataset": dataset["repo"], "repo": dataset["repo"], "revision": dataset["revision"], "split": split,
        "kind": samples_spec["kind"], "snapshot": str(Path(snap).resolve()), "files": files, "samples": samples,
        "provenance": provenance("fetch_dataset", {"checkpoint": checkpoint_json}, {"samples": samples_spec,
                                 "dataset": dataset}, started)})


def draw_samples(samples_spec: dict[str, Any], dataset: dict[str, Any], family: str, snapshot: str | Path,
                 checkpoint_json: str) -> list[dict[str, Any]]:
    """One sample set drawn by the family's rule (seeded) from its split's files in a dataset snapshot:
    what fetch_dataset records, and what the audit draws again to check that record."""
    split = samples_spec["split"]
    rows = _load_split(Path(snapshot), dataset["files"][split])
    log.info("%s %s: %d rows", dataset["repo"], split, len(rows))
    fam = _family(family)
    # A detection dataset's declared box layout, which the family checks against every drawn image.
    spec = samples_spec | ({"box_format": dataset["box_format"]} if dataset.get("box_format") else {})
    return fam.draw_samples(rows, spec, fam.processor(_snapshot(checkpoint_json)))


def read_samples(path: str | Path, family: str) -> list[dict[str, Any]]:
    """A sample list as every job that uses it reads it: the file as fetch_dataset wrote it (its digest),
    each id once, and each sample's sha256 that of the content the job will use (the family recomputes
    it: a text, a pair, an image's bytes in the pinned snapshot). Anything else raises DamagedArtifact."""
    samples = read_json(path, "samples")["samples"]
    seen: set = set()
    for s in samples:
        if s["id"] in seen:
            raise artifacts.DamagedArtifact(path, f"lists sample {s['id']!r} twice")
        seen.add(s["id"])
    for s, actual in zip(samples, _family(family).content_sha256(samples)):
        if actual != s["sha256"]:
            raise artifacts.DamagedArtifact(path, f"sample {s['id']!r} records sha256 {s['sha256']}, its content "
                                                  f"hashes to {actual}: the list is not the one fetch_dataset drew")
    return samples


def _samples(samples_jsons: dict[str, str], family: str) -> dict[str, list[dict[str, Any]]]:
    return {name: read_samples(path, family) for name, path in samples_jsons.items()}


# --- reference and calibration ----------------------------------------------------------------

def reference(family: str, model: str, setting: dict[str, Any], metrics: dict[str, Any], seeds: dict[str, int],
              checkpoint_json: str, samples_jsons: dict[str, str], out_json: str, out_tensors: str,
              dtype: str = "float32") -> None:
    """The reference model's outputs (fp32, TF32 off, or the study's dtype) on the evaluation samples:
    what every variant is compared with, and the family's metric blocks of the reference itself."""
    import torch
    from safetensors.torch import save

    started = now()
    job_settings()
    device = _device()
    with _gpu_work(device):
        tensors, blocks = _family(family).reference(_snapshot(checkpoint_json), _samples(samples_jsons, family),
                                                    _setting(setting), metrics, seeds, device, getattr(torch, dtype))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    artifacts.atomic_write(out_tensors, save(tensors))
    write_json(out_json, "reference", {
        "model": model, "setting": setting["name"], "device": device, "dtype": dtype,
        "tensors": {k: list(v.shape) for k, v in tensors.items()}, "tensors_sha256": sha256_path(out_tensors),
        "blocks": blocks,
        "provenance": provenance("reference", {"checkpoint": checkpoint_json, **samples_jsons},
                                 {"setting": setting, "metrics": metrics, "seeds": seeds, "dtype": dtype}, started)})


def calibrate(family: str, model: str, setting: dict[str, Any], architecture: dict[str, Any], recipe: dict[str, Any],
              checkpoint_json: str, samples_json: str | list[str], out: str, method: dict[str, Any] | None = None) -> None:
    """Static activation amax per linear layer by a ModelOpt calibration method (`method`: the recipe's, or
    a variant's own) at this setting's shape, on the family's calibration batches through its first graph.
    Several sample files (a recipe's list of sample sets) are calibrated on as one list, in order.

    A variant's own method that fails (one ModelOpt does not apply to FP8) is a result: its failed record
    says why, and the builds of the variants that name it fail with that reason. The recipe's own method
    failing stops the run: every FP8 variant needs it."""
    import torch

    from quantstudy import quantization

    started = now()
    job_settings()
    fam, st, ckpt, rec = _family(family), _setting(setting), _snapshot(checkpoint_json), Recipe.from_params(recipe)
    method = method or rec.method
    device = _device()
    graph = next(iter(fam.graphs(st, architecture)))
    sample_files = [samples_json] if isinstance(samples_json, (str, Path)) else list(samples_json)
    inputs = {"checkpoint": checkpoint_json,
              **{f"samples[{i}]" if len(sample_files) > 1 else "samples": p for i, p in enumerate(sample_files)}}
    params = {"setting": setting, "recipe": recipe, "method": method}
    samples = [s for p in sample_files for s in read_samples(p, family)]
    # The module in the calibration's dtype (default fp32; bf16 where the write-up calibrated the bf16 model).
    dtype = rec.calibration_dtype
    calibration = {"config": rec.activation_calibration, "method": method, "samples": len(samples)}
    ident = {"model": model, "setting": st.name, "graph": graph, "device": device, "dtype": dtype}
    with _gpu_work(device):
        module = fam.module(ckpt, graph, st).to(device, getattr(torch, dtype))
        batches = [{k: v.to(device) for k, v in b.items()} for b in fam.calibration_batches(ckpt, samples, st)]
        log.info("calibrating %s (%s, graph %s, %s) by %s on %d samples (%d batches)", model, st.name, graph, dtype,
                 method, len(samples), len(batches))
        progress = Progress("calibration batches", len(batches))
        if method == rec.method:
            amax = quantization.calibrate(module, batches, progress, method)
        else:
            try:
                amax, changed = quantization.calibrate_method(module, batches, method, progress)
            except Exception:
                _failed("amax", "calibrate", out, ident, inputs, params, started, traceback.format_exc(),
                        {"calibration": {**calibration, "batches": len(batches)}})
                return
            calibration["changed_from_max"] = changed
    layers = quantization.select(sorted(amax), list(rec.quantize))
    report = quantization.outliers(amax, layers, rec.outlier_ratio)
    log.info("largest scale ratio to the median: %s; outliers: %s", report["largest_ratio"], report["layers"])
    write_json(out, "amax", {
        "status": "ok", **ident, "shape": dict(st.shape), "amax": amax, "recipe_layers": layers, "outliers": report,
        "calibration": {**calibration, "batches": len(batches)},
        "provenance": provenance("calibrate", inputs, params, started)})


class CalibrationFailed(RuntimeError):
    """A variant's amax file is a failed calibration: its builds fail with the calibration's reason."""


def read_amax(path: str | None) -> dict[str, Any] | None:
    """The amax record a variant's layers are scaled by (None: the variant has no FP8 layers); a failed
    calibration raises CalibrationFailed with its reason, so that the variant's build records it."""
    if path is None:
        return None
    doc = read_json(path, "amax")
    if doc.get("status", "ok") == "failed":
        raise CalibrationFailed(f"calibration {calibration_label(doc['calibration']['method'])} failed ({path}): "
                                f"{artifacts.error_summary(doc['error'])}")
    return doc


# --- engines ---------------------------------------------------------------------------------

class WrongCard(RuntimeError):
    """A job of a GPU target on a host without the card the target declares: not a result to record."""


def _require_card(target: Target) -> None:
    """Stop a job of a GPU target before it builds or opens anything on a host without the card the
    target declares: the README would call its numbers that card's (the audit fails them afterwards)."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if not on_its_card(target, gpu):
        raise WrongCard(f"target {target.name} declares gpu {target.gpu}, but this job runs on {gpu or 'no GPU'}: "
                        f"run it on an {target.gpu}, or declare the card this host has in a run config layer "
                        "(a second --configfile, such as config/realsize/calls/h100.yaml)")


def _record(kind: str, rule: str, out: str, ident: dict[str, Any], inputs: dict[str, Any], params: dict[str, Any],
            measure, on_failure: dict[str, Any] | None = None) -> dict[str, Any]:
    """The one way a step writes what it measured: `measure()`'s fields as the ok record, or, if it
    raises, the failed record (_failed). A failure is a result: it is written, never raised. Returns
    the record written. A job of a target (`params["target"]`) on a host without its card is no
    result: it raises WrongCard before measuring, and writes nothing."""
    if "target" in params:
        _require_card(Target.from_params(params["target"]))
    started = now()
    try:
        doc = {"status": "ok", **ident, **measure()}
    except Exception:
        return _failed(kind, rule, out, ident, inputs, params, started, traceback.format_exc(), on_failure)
    write_json(out, kind, {**doc, "provenance": provenance(rule, inputs, params, started)})
    return doc


def _failed(kind: str, rule: str, out: str, ident: dict[str, Any], inputs: dict[str, Any], params: dict[str, Any],
            started: str, error: str, on_failure: dict[str, Any] | None = None) -> dict[str, Any]:
    """The failed record of a step: the whole traceback as its error (and `on_failure`'s fields)."""
    log.error("%s failed: %s", rule, error.strip().splitlines()[-1])
    doc = {"status": "failed", **ident, **(on_failure or {}), "error": error}
    write_json(out, kind, {**doc, "provenance": provenance(rule, inputs, params, started)})
    return doc


def _variant_modules(family: str, checkpoint_dir: str, setting, spec: dict, recipe: dict, amax_doc: dict | None,
                     graphs: Iterable[str]):
    """{graph: (variant module, summary)} of one variant at a setting."""
    from quantstudy import quantization

    fam = _family(family)
    return {g: quantization.apply_variant(fam.module(checkpoint_dir, g, setting), spec, recipe, amax_doc,
                                          fam.transforms())
            for g in graphs}


def example_inputs(family: str, checkpoint_dir: str, graph: str, setting, precision: str) -> dict[str, Any]:
    """The family's example inputs of a graph at a setting, floating ones in the variant's precision:
    what an engine is built for, timed on and probed with."""
    from quantstudy import quantization

    return quantization.cast_inputs(_family(family).example_inputs(checkpoint_dir, graph, setting), precision)


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
        fam, st, ckpt = _family(family), _setting(setting), _snapshot(checkpoint_json)
        specs, graphs, summary = fam.graphs(st, architecture), {}, {}
        for name, (model, summary) in _variant_modules(family, ckpt, st, spec, recipe, amax_doc, specs).items():
            info = qe.export(model, example_inputs(family, ckpt, name, st, spec["precision"]), paths.graph_dir(out, name),
                             opset or qe.OPSET, _dynamic(specs[name]))
            if sorted(info["fp8_layers"]) != summary["fp8_layers"]:
                raise RuntimeError(f"the {name} ONNX has Q/DQ for {info['fp8_layers']}, the variant's FP8 layers "
                                   f"are {summary['fp8_layers']}")
            graphs[name] = {**info, "onnx_sha256": sha256_path(info["onnx"])}
            log.info("exported %s %s: %s, %d bytes", ident, name, info["op_counts"], info["onnx_bytes"])
        return {"spec": spec, **summary, "graphs": graphs}

    _record("export", "export", out, ident, inputs, params, measure, {"spec": spec})


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
    from quantstudy import backends, quantization, record

    started = now()
    out_measurements = str(paths.beside(out, paths.MEASUREMENTS))
    inputs = {"checkpoint": checkpoint_json, **({"amax": amax_json} if amax_json else {}),
              **({"export": export_json} if export_json else {})}
    params = {"spec": spec, "recipe": recipe, "target": target, "setting": setting, "serves": serves}
    made: dict[str, Any] = {}  # what the measurements record needs besides the build record
    tgt = Target.from_params(target)

    def measure() -> dict[str, Any]:
        job_settings()
        quantization.refuse_block_scaled_engine(spec, tgt)
        amax_doc = read_amax(amax_json)
        backend = backends.get(tgt.backend)
        st, engines, ckpt = _setting(setting), {}, _snapshot(checkpoint_json)
        served = [_setting(s) for s in serves or [setting]]
        graphs = _family(family).graphs(st, architecture)

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
            modules = _variant_modules(family, ckpt, st, spec, recipe, amax_doc, graphs)
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

    doc = _record("build", rule, out, ident, inputs, params, measure, {"spec": spec})
    if doc["status"] == "ok":
        try:
            record.measurements(ident, tgt, read_json(out, "build"), out, made.get("linear"), amax_json,
                                made.get("export"), export_json, out_measurements, started, rule)
            return
        except Exception:  # a build whose record cannot be made is a failed build
            doc = _failed("build", rule, out, ident, inputs, params, started, traceback.format_exc(), {"spec": spec})
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
    ckpt = _snapshot(checkpoint_json)
    backend = backends.get(target.backend)
    names = [g for g in build_doc["graphs"] if graphs is None or g in graphs]
    skeletons = {}
    if backend.builds_from == "module":  # an ONNX engine carries its own structure
        skeletons = {g: m for g, (m, _) in _variant_modules(family, ckpt, setting, build_doc["spec"], recipe,
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


def _opened(runners: dict[str, Runner]) -> dict[str, float]:
    """{graph: seconds} it took to open each engine that a job opened from a compiled program."""
    return {g: round(r.open_seconds, 3) for g, r in runners.items() if r.open_seconds is not None}


def _redone(runners: dict[str, Runner]) -> dict[str, dict[str, float]]:
    """{graph: {kind: seconds}} of the work opening each engine redid that its build should have done
    (Runner.open_redone; the audit's redone_problems)."""
    return {g: {k: round(v, 3) for k, v in r.open_redone.items()} for g, r in runners.items() if r.open_redone}


def _probe(family: str, build_doc: dict[str, Any], checkpoint_json: str, setting, runners: dict[str, Runner]
           ) -> dict[str, Any]:
    """TEST01's probe: each graph's outputs on the setting's seeded example inputs, in brief (shape,
    non-finite count, L2 norm and 64 evenly spaced values of each output), so that the audit can
    check that the timing job and the evaluation job got the same answer from the same engine."""
    import torch

    precision, ckpt, probe = build_doc["spec"]["precision"], _snapshot(checkpoint_json), {}
    for g, runner in runners.items():
        with torch.no_grad():
            outs = runner(example_inputs(family, ckpt, g, setting, precision))
        probe[g] = {}
        for name, t in outs.items():
            flat = t.detach().float().cpu().flatten()
            picks = torch.linspace(0, flat.numel() - 1, min(64, flat.numel())).long()
            finite = flat[torch.isfinite(flat)]
            probe[g][name] = {"shape": list(t.shape), "nonfinite": int(flat.numel() - finite.numel()),
                              "l2": float(finite.double().norm()),
                              "values": [v if math.isfinite(v) else None for v in flat[picks].tolist()]}
    return probe


def _engine_digests(build_doc: dict[str, Any]) -> dict[str, Any]:
    """What a job measured, by sha256 (TEST01: the timed and the evaluated engine are one file):
    `engine_sha256` {graph: sha256} and, for a compiled engine, `compiled_sha256` {graph: sha256}."""
    graphs = build_doc["graphs"].items()
    digests: dict[str, Any] = {"engine_sha256": {g: e["engine_sha256"] for g, e in graphs}}
    if any("compiled_sha256" in e for _, e in graphs):
        digests["compiled_sha256"] = {g: e["compiled_sha256"] for g, e in graphs}
    return digests


@measures_speed
def time(ident: dict[str, Any], family: str, target: dict[str, Any], setting: dict[str, Any], recipe: dict,
         timing: dict[str, int], checkpoint_json: str, build_json: str, baseline_build_json: str, out: str,
         repeat: int = 1) -> None:
    """Time each graph of the variant and of its baseline side by side (one process, interleaved rounds).
    `repeat`: which of the variant's separate timing jobs this is (1, 2, ...)."""
    from quantstudy import timing as qt

    inputs = {"checkpoint": checkpoint_json, "build": build_json, "baseline_build": baseline_build_json}
    params = {"target": target, "timing": timing, "setting": setting, "repeat": repeat}
    variant_doc, base_doc = read_json(build_json, "build"), read_json(baseline_build_json, "build")
    baseline = base_doc["variant"]

    def measure() -> dict[str, Any]:
        job_settings()
        st, tgt = _setting(setting), Target.from_params(target)
        # {variant: its runners}: the variant's engines, and its baseline's (the same ones for the baseline itself)
        with _gpu_work(tgt.device):
            runners = {doc["variant"]: open_engines(family, doc, recipe, checkpoint_json, st, tgt)
                       for doc in {d["variant"]: d for d in (variant_doc, base_doc)}.values()}
        graphs = {}
        with qt.measuring(tgt.device) as measuring:  # one turn for every graph
            for g in runners[ident["variant"]]:
                pair = {name: r[g] for name, r in runners.items()}
                result = qt.time_interleaved(pair, timing["warmup"], timing["rounds"], timing["calls_per_round"],
                                             lambda line: log.info("%s %s", g, line), timing.get("min_round_ms", 0.0))
                # Proof of FP8: the kernels the variant's FP8 GEMM ops launch (a short profile, after timing).
                fp8 = qt.fp8_proof(pair[ident["variant"]])
                log.info("%s FP8 GEMMs: %s", g, fp8)
                v, b = result[ident["variant"]], result[baseline]
                graphs[g] = {"variant_ms": v, "baseline_ms": b, **qt.speedup(b["samples_ms"], v["samples_ms"]), "fp8": fp8}
        with _gpu_work(tgt.device):
            probe = _probe(family, variant_doc, checkpoint_json, st, runners[ident["variant"]])
        return {"repeat": repeat, "baseline": baseline, "batch": st.batch, "shape": dict(st.shape), "graphs": graphs,
                **_engine_digests(variant_doc), "open_seconds": {v: _opened(r) for v, r in runners.items()},
                "open_redone": {v: _redone(r) for v, r in runners.items()}, "probe": probe, "measuring": measuring}

    _record("timing", "time", out, ident, inputs, params, measure, {"baseline": baseline, "repeat": repeat})


@measures_speed
def profile(ident: dict[str, Any], family: str, target: dict[str, Any], setting: dict[str, Any], recipe: dict,
            calls: int, checkpoint_json: str, build_json: str, out: str) -> None:
    """Kernel (GPU) or op (CPU) time per call of each graph, in the family's kernel groups."""
    from quantstudy import backends, quantization, timing as qt

    inputs = {"checkpoint": checkpoint_json, "build": build_json}
    params = {"target": target, "calls": calls, "setting": setting}

    def measure() -> dict[str, Any]:
        job_settings()  # as in the build: inductor's CPU code depends on the thread count
        fam, st, tgt = _family(family), _setting(setting), Target.from_params(target)
        build_doc = read_json(build_json, "build")
        with _gpu_work(tgt.device):
            runners = open_engines(family, build_doc, recipe, checkpoint_json, st, tgt)
        regions = set(fam.regions) | {quantization.FP8_REGION}
        classify = functools.partial(fam.kernel_group, setting=st)
        with qt.measuring(tgt.device) as measuring:  # one turn for every graph
            graphs = {g: backends.get(tgt.backend).profile(runner, calls, classify, regions) for g, runner in runners.items()}
        return {"groups": fam.kernel_groups, "graphs": graphs, **_engine_digests(build_doc),
                "open_seconds": _opened(runners), "open_redone": _redone(runners), "measuring": measuring}

    _record("kernels", "profile", out, ident, inputs, params, measure)


@measures_speed
def gemm(ident: dict[str, Any], family: str, target: dict[str, Any], setting: dict[str, Any],
         architecture: dict[str, Any], specs: dict[str, dict[str, Any]], recipe: dict[str, Any],
         timing: dict[str, int], checkpoint_json: str, amax_json: str, out: str) -> None:
    """g of the Amdahl bound: each FP8 variant's GEMM calls at this setting (`specs`: variant -> spec),
    found by running its module on the setting's example inputs, then fp16 against FP8 at each
    distinct shape on the target's backend (gemm.py), and per variant g = its summed fp16 GEMM time
    over its summed FP8 GEMM time."""
    from quantstudy import bound, gemm as qg

    inputs = {"checkpoint": checkpoint_json, "amax": amax_json}
    params = {"specs": specs, "recipe": recipe, "target": target, "timing": timing, "setting": setting}

    def measure() -> dict[str, Any]:
        job_settings()
        amax_doc = read_amax(amax_json)
        fam, st, ckpt, tgt = _family(family), _setting(setting), _snapshot(checkpoint_json), Target.from_params(target)
        graphs, measuring = {}, []
        for g in fam.graphs(st, architecture):
            calls, variants = {}, {}
            for variant, spec in specs.items():
                try:  # a variant that cannot be made (its build fails the same way) is its own failure
                    model, _ = _variant_modules(family, ckpt, st, spec, recipe, amax_doc, [g])[g]
                except Exception:
                    variants[variant] = {"status": "failed", "error": traceback.format_exc(), "calls": []}
                    log.error("%s %s: %s", g, variant, variants[variant]["error"].strip().splitlines()[-1])
                    continue
                with _gpu_work(tgt.device):
                    calls[variant] = qg.recipe_calls(model.to(tgt.device), {
                        k: v.to(tgt.device) for k, v in example_inputs(family, ckpt, g, st, spec["precision"]).items()})
                log.info("%s %s: %d FP8 GEMM calls", g, variant, len(calls[variant]))
            shapes = qg.time_calls(calls, {v: s["precision"] for v, s in specs.items()}, tgt, timing,
                                   lambda line: log.info("%s %s", g, line), spans=measuring)
            for variant, cs in calls.items():
                listed = [{"layer": c["layer"], "dims": c["dims"], "shape": qg.shape_key(c)} for c in cs]
                if not listed:  # no FP8 layer runs in this graph: nothing for FP8 to change
                    variants[variant] = {"status": "ok", "calls": [], "fp16_ms": 0.0, "fp8_ms": 0.0, "g": None,
                                         "emulated": None}
                    continue
                variants[variant] = {"status": "ok", "calls": listed, **bound.gemm_speedup(shapes, listed),
                                     "emulated": any(shapes[c["shape"]]["emulated"] for c in listed)}
                log.info("%s %s: g = %.3f", g, variant, variants[variant]["g"])
            graphs[g] = {"shapes": shapes, "variants": variants}
        return {"backend": tgt.backend, "batch": st.batch, "shape": dict(st.shape), "graphs": graphs,
                "definition": qg.DEFINITION, "measuring": measuring}

    _record("gemm", "gemm", out, ident, inputs, params, measure)


def _batched_run(runners: dict[str, Runner], batch: int):
    """The family's view of the engines: run(inputs, what, graph, whole) -> outputs gathered on the CPU.
    Rows go to the engine `batch` at a time (`whole`: all in one call, which the engine itself runs in
    chunks of the batch it was built for); a call that names `what` logs its progress."""
    import torch

    def run(inputs: dict[str, Any], what: str = "", graph: str = "main", whole: bool = False) -> dict[str, Any]:
        runner = runners[graph]
        rows = next(iter(inputs.values())).shape[0]
        step = rows if whole else batch
        progress, outs = Progress(what, rows) if what else None, []
        for i in range(0, rows, step):
            outs.append({k: v.cpu() for k, v in runner({k: v[i:i + step] for k, v in inputs.items()}).items()})
            if progress:
                progress(min(i + step, rows))
        return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
    return run


def evaluate(ident: dict[str, Any], family: str, target: dict[str, Any], setting: dict[str, Any], recipe: dict,
             metrics: dict[str, Any], seeds: dict[str, int], checkpoint_json: str, build_json: str,
             reference_json: str, reference_tensors: str, samples_jsons: dict[str, str], out: str,
             against_builds: dict[str, str] | None = None, repeat: int = 1) -> None:
    """The family's quality metrics of the engine against the reference and against the engines
    of `against_builds` (variant -> build.json, same target and setting), and its non-finite scan;
    `repeat`: which of the engine's evaluation jobs this is (evaluation.repeats)."""
    import torch
    from safetensors.torch import load_file

    against_builds = against_builds or {}
    inputs = {"checkpoint": checkpoint_json, "build": build_json, "reference": reference_json,
              "reference_tensors": reference_tensors, **samples_jsons,
              **{f"against_{v}": p for v, p in against_builds.items()}}
    params = {"target": target, "metrics": metrics, "seeds": seeds, "setting": setting, "repeat": repeat}

    def measure() -> dict[str, Any]:
        job_settings()
        st, tgt = _setting(setting), Target.from_params(target)
        build_doc = read_json(build_json, "build")
        with _gpu_work(tgt.device), torch.no_grad():
            runners = open_engines(family, build_doc, recipe, checkpoint_json, st, tgt)
            against = {v: _batched_run(open_engines(family, read_json(p, "build"), recipe, checkpoint_json, st, tgt),
                                       st.batch) for v, p in against_builds.items()}
            result = _family(family).evaluate(_snapshot(checkpoint_json), _batched_run(runners, st.batch),
                                              load_file(reference_tensors), _samples(samples_jsons, family), st, metrics,
                                              seeds, tgt.device, against)
            log.info("%s; non-finite %d", result.blocks, result.total_nonfinite)
            probe = _probe(family, build_doc, checkpoint_json, st, runners)
        return {"repeat": repeat, "blocks": result.blocks, **_engine_digests(build_doc), "open_seconds": _opened(runners),
                "open_redone": _redone(runners), "probe": probe, "nonfinite": {**result.nonfinite, "total_bad": result.total_nonfinite}}

    _record("quality", "evaluate", out, ident, inputs, params, measure, {"repeat": repeat})
