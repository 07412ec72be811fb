"""The steps before any variant: the reference model's outputs, and the calibration that gives the FP8
layers their scales (amax files), with read_amax, which every step that makes a variant reads them by."""

from __future__ import annotations

import logging
import traceback
from pathlib import Path
from typing import Any

from quantstudy import artifacts
from quantstudy.artifacts import now, provenance, read_json, sha256_path, write_json
from quantstudy.config import Recipe
from quantstudy.steps import (Progress, family_of, gpu_work, job_settings, read_samples, record_failure, samples_of,
                              setting_of, snapshot_of, work_device)
from quantstudy.study_values import calibration_label

log = logging.getLogger("quantstudy")


def reference(family: str, model: str, setting: dict[str, Any], metrics: dict[str, Any], seeds: dict[str, int],
              checkpoint_json: str, samples_jsons: dict[str, str], out_json: str, out_tensors: str,
              dtype: str = "float32") -> None:
    """The reference model's outputs (fp32, TF32 off, or the study's dtype) on the evaluation samples:
    what every variant is compared with, and the family's metric blocks of the reference itself."""
    import torch
    from safetensors.torch import save

    started = now()
    job_settings()
    device = work_device()
    with gpu_work(device):
        tensors, blocks = family_of(family).reference(snapshot_of(checkpoint_json), samples_of(samples_jsons, family),
                                                     setting_of(setting), metrics, seeds, device, getattr(torch, dtype))
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

    from quantstudy import calibration as qcal, quantization

    started = now()
    job_settings()
    fam, st, ckpt, rec = family_of(family), setting_of(setting), snapshot_of(checkpoint_json), Recipe.from_params(recipe)
    method = method or rec.method
    device = work_device()
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
    with gpu_work(device):
        module = fam.module(ckpt, graph, st).to(device, getattr(torch, dtype))
        batches = [{k: v.to(device) for k, v in b.items()} for b in fam.calibration_batches(ckpt, samples, st)]
        log.info("calibrating %s (%s, graph %s, %s) by %s on %d samples (%d batches)", model, st.name, graph, dtype,
                 method, len(samples), len(batches))
        progress = Progress("calibration batches", len(batches))
        if method == rec.method:
            amax = qcal.calibrate(module, batches, progress, method)
        else:
            try:
                amax, changed = qcal.calibrate_method(module, batches, method, progress)
            except Exception:
                record_failure("amax", "calibrate", out, ident, inputs, params, started, traceback.format_exc(),
                               {"calibration": {**calibration, "batches": len(batches)}})
                return
            calibration["changed_from_max"] = changed
    layers = quantization.select(sorted(amax), list(rec.quantize))
    report = qcal.outliers(amax, layers, rec.outlier_ratio)
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
