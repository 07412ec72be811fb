"""The study's steps, one function per rule of the workflow, callable without Snakemake.

Each step reads the artifacts earlier steps wrote and writes its own; nothing is passed in
memory between steps. A step that measures a variant records a failure as its result.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from quantstudy import artifacts, hub
from quantstudy.artifacts import now, provenance, read_json, sha256_path, write_json

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


def _deterministic() -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: references and the fp32 DFT
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)


def _device() -> str:
    """Where the fp32 reference and the calibration run: the GPU if there is one (real-size models
    are too slow on a CPU), else the CPU. Recorded in their JSON."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _family(name: str):
    from quantstudy import families

    return families.get(name)


# --- fixtures and fetching --------------------------------------------------------------------

def local_hub(family: str, models: list[dict[str, Any]], datasets: list[dict[str, Any]], cache_dir: str,
              out: str, weights: str = "tiny-random-init") -> None:
    """Generate tiny checkpoints and datasets into the local HF cache, at their content-hash revisions.

    `models`: repo, revision, architecture (dict) and tiny spec; `datasets`: repo, revision, files, tiny spec.
    """
    from quantstudy import fixtures

    started = now()
    placed = []
    vocab = 0
    for m in models:
        files = _family(family).tiny_checkpoint_files(m["architecture"], m["tiny"])
        hub.place_in_cache(cache_dir, m["repo"], "model", m["revision"], files)
        placed.append({"repo": m["repo"], "repo_type": "model", "revision": m["revision"], "files": sorted(files)})
        vocab = max(vocab, m["architecture"]["vocab_size"])
        log.info("placed %s at %s", m["repo"], m["revision"])
    for d in datasets:
        files = fixtures.dataset_files(d["files"], d["tiny"], vocab or 512)
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
               "jsonl.gz": "json"}.get(suffix)
    if builder is None:
        raise ValueError(f"don't know how to read {paths[0]}")
    return datasets.load_dataset(builder, data_files=paths, split="train")


def fetch_dataset(name: str, samples_spec: dict[str, Any], dataset: dict[str, Any], family: str, cache_dir: str,
                  offline: bool, checkpoint_json: str, out: str, local_hub_json: str | None = None) -> None:
    """Draw the samples (seeded, within token bounds by the study's tokenizer) from a pinned dataset."""
    started = now()
    split = samples_spec["split"]
    snap = hub.snapshot(dataset["repo"], dataset["revision"], cache_dir, "dataset", [dataset["files"][split]], offline)
    rows = _load_split(snap, dataset["files"][split])
    log.info("%s %s: %d rows", dataset["repo"], split, len(rows))
    samples = []
    if samples_spec["kind"] == "passages":
        tokenizer = _family(family).tokenizer(read_json(checkpoint_json, "checkpoint")["snapshot"])
        order = list(range(len(rows)))
        random.Random(samples_spec.get("seed", 0)).shuffle(order)
        lo, hi = samples_spec.get("min_tokens", 1), samples_spec.get("max_tokens", 10**9)
        for i in order:
            text = rows[i]["text"].strip()
            if not text or text.startswith("="):  # WikiText headings and blank lines are not passages
                continue
            n = _family(family).count_tokens(tokenizer, text)
            if lo <= n <= hi:
                samples.append({"id": i, "text": text, "tokens": n, "sha256": _sha(text)})
            if len(samples) == samples_spec["count"]:
                break
    else:
        for i in range(min(samples_spec["count"], len(rows))):
            r = rows[i]
            score = r.get("score", r.get("label"))
            samples.append({"id": i, "sentence1": r["sentence1"], "sentence2": r["sentence2"], "score": float(score),
                            "sha256": _sha(r["sentence1"] + "\n" + r["sentence2"])})
    if len(samples) < samples_spec["count"]:
        log.warning("%s: only %d of %d samples qualify", name, len(samples), samples_spec["count"])
    write_json(out, "samples", {
        "dataset": dataset["repo"], "repo": dataset["repo"], "revision": dataset["revision"], "split": split,
        "kind": samples_spec["kind"], "samples": samples,
        "provenance": provenance("fetch_dataset", {"checkpoint": checkpoint_json}, {"samples": samples_spec,
                                 "dataset": dataset}, started)})


def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


# --- reference and calibration ----------------------------------------------------------------

def _sts_sentences(sts: dict[str, Any]) -> tuple[list[str], list[float]]:
    sentences = [s for p in sts["samples"] for s in (p["sentence1"], p["sentence2"])]
    return sentences, [p["score"] for p in sts["samples"]]


def _mask(ids, tokenizer, fraction: float, seed: int):
    """Replace `fraction` of the body tokens of each row by [MASK] (seeded); returns ids and positions."""
    import torch

    g = torch.Generator().manual_seed(seed)
    masked, positions = ids.clone(), []
    special = {tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id}
    for row in range(ids.shape[0]):
        body = [j for j in range(ids.shape[1]) if int(ids[row, j]) not in special]
        k = max(1, round(fraction * len(body)))
        pick = sorted(body[j] for j in torch.randperm(len(body), generator=g)[:k].tolist())
        masked[row, pick] = tokenizer.mask_token_id
        positions += [(row, j) for j in pick]
    return masked, torch.tensor(positions, dtype=torch.int64)


def _features(fn: Callable, ids, batch: int):
    import torch

    with torch.no_grad():
        return torch.cat([fn(ids[i:i + batch]).float().cpu() for i in range(0, ids.shape[0], batch)])


def reference(family: str, model: str, setting: str, window: int, metrics: dict[str, Any], seed: int,
              checkpoint_json: str, heldout_json: str, sts_json: str, out_json: str, out_tensors: str) -> None:
    """PyTorch fp32 outputs (TF32 off) on the evaluation samples: what every variant is compared with."""
    import torch
    from safetensors.torch import save

    from quantstudy import metrics as qm

    started = now()
    _deterministic()
    fam = _family(family)
    ckpt = read_json(checkpoint_json, "checkpoint")["snapshot"]
    device = _device()
    ref, tok = fam.load_reference(ckpt).to(device), fam.tokenizer(ckpt)
    heldout = [s["text"] for s in read_json(heldout_json, "samples")["samples"]]
    sentences, gold = _sts_sentences(read_json(sts_json, "samples"))
    ids = fam.encode(tok, heldout, window)
    masked, positions = _mask(ids, tok, metrics["mask_fraction"], seed)
    last = lambda x: ref(input_ids=x.to(device), output_hidden_states=True).hidden_states[-1]
    log.info("reference %s %s: %d passages, %d masked tokens, %d STS sentences", model, setting, len(heldout),
             len(positions), len(sentences))
    masked_features = _features(last, masked, 8)
    sts_ids = fam.encode(tok, sentences, window)
    sts_cls = _features(last, sts_ids, 8)[:, 0]
    peaks = []
    progress = Progress("mixing peaks", ids.shape[0])
    for i in range(ids.shape[0]):
        peaks += fam.mixing_peaks(ref, ids[i:i + 1].to(device))
        progress(i + 1)
    tensors = {"heldout_ids": ids.to(torch.int32), "masked_ids": masked.to(torch.int32),
               "mask_positions": positions, "mlm_features": masked_features[positions[:, 0], positions[:, 1]].contiguous(),
               "heldout_cls": _features(last, ids, 8)[:, 0].contiguous(), "sts_ids": sts_ids.to(torch.int32),
               "sts_cls": sts_cls.contiguous()}
    artifacts.atomic_write(out_tensors, save(tensors))
    fp16_max = metrics["fp16_max"]
    write_json(out_json, "reference", {
        "model": model, "setting": setting, "window": window, "device": device,
        "tensors": {k: list(v.shape) for k, v in tensors.items()}, "tensors_sha256": sha256_path(out_tensors),
        "sts_spearman": qm.sts_spearman(sts_cls[0::2], sts_cls[1::2], gold),
        "mixing_peak": {"max": max(peaks), "per_passage": peaks, "fp16_max": fp16_max,
                        "passages_over_fp16_max": sum(p > fp16_max for p in peaks)},
        "provenance": provenance("reference", {"checkpoint": checkpoint_json, "heldout": heldout_json, "sts": sts_json},
                                 {"window": window, "metrics": metrics, "seed": seed}, started)})


def calibrate(family: str, model: str, window: int, recipe: dict[str, Any], checkpoint_json: str,
              samples_json: str, out: str) -> None:
    """Static activation amax per linear layer from ModelOpt max calibration at this window."""
    from quantstudy import quantization

    started = now()
    _deterministic()
    fam = _family(family)
    ckpt = read_json(checkpoint_json, "checkpoint")["snapshot"]
    device = _device()
    encoder = fam.feature_model(ckpt, window).to(device)
    texts = [s["text"] for s in read_json(samples_json, "samples")["samples"]]
    ids = fam.encode(fam.tokenizer(ckpt), texts, window).to(device)
    batches = [{"input_ids": ids[i:i + 8]} for i in range(0, ids.shape[0], 8)]
    log.info("calibrating %s at %d tokens on %d passages (%d batches)", model, window, len(texts), len(batches))
    amax = quantization.calibrate(encoder, batches, Progress("calibration batches", len(batches)))
    layers = quantization.select(sorted(amax), recipe["quantize"])
    report = quantization.outliers(amax, layers, recipe["outlier_ratio"])
    log.info("largest scale ratio to the median: %s; outliers: %s", report["largest_ratio"], report["layers"])
    write_json(out, "amax", {
        "model": model, "window": window, "device": device, "amax": amax, "recipe_layers": layers, "outliers": report,
        "calibration": {"config": recipe["activation_calibration"], "passages": len(texts), "framing": "[CLS] ... [SEP], padded"},
        "provenance": provenance("calibrate", {"checkpoint": checkpoint_json, "samples": samples_json},
                                 {"window": window, "recipe": recipe}, started)})


# --- engines ---------------------------------------------------------------------------------

def _failure(kind: str, out: str, ident: dict[str, Any], error: str, rule: str, inputs: dict, params: dict,
             started: str, **extra) -> None:
    log.error("%s failed: %s", rule, error.strip().splitlines()[-1] if error.strip() else error)
    write_json(out, kind, {"status": "failed", **ident, **extra, "error": error,
                           "provenance": provenance(rule, inputs, params, started)})


def _variant_model(family: str, checkpoint_dir: str, window: int, spec: dict, recipe: dict, amax_doc: dict | None):
    from quantstudy import quantization

    model = _family(family).feature_model(checkpoint_dir, window)
    return quantization.apply_variant(model, spec, recipe, amax_doc)


def export(ident: dict[str, Any], family: str, window: int, batch: int, spec: dict[str, Any], recipe: dict[str, Any],
           checkpoint_json: str, amax_json: str | None, out: str, opset: int | None = None) -> None:
    """Export one variant to ONNX (fp32, fp16, FP8 Q/DQ) at the setting's shape. A failure is recorded."""
    from quantstudy import export as qe

    started = now()
    inputs = {"checkpoint": checkpoint_json, **({"amax": amax_json} if amax_json else {})}
    params = {"spec": spec, "recipe": recipe, "window": window, "batch": batch, "opset": opset or qe.OPSET}
    try:
        _deterministic()
        amax_doc = read_json(amax_json, "amax") if amax_json else None
        ckpt = read_json(checkpoint_json, "checkpoint")["snapshot"]
        model, summary = _variant_model(family, ckpt, window, spec, recipe, amax_doc)
        info = qe.export(model, _timing_ids(family, checkpoint_json, window, batch), Path(out).parent,
                         opset or qe.OPSET)
        if sorted(info["fp8_layers"]) != summary["fp8_layers"]:
            raise RuntimeError(f"the ONNX has Q/DQ for {info['fp8_layers']}, the variant's FP8 layers are "
                               f"{summary['fp8_layers']}")
        log.info("exported %s: %s, %d bytes", ident, info["op_counts"], info["onnx_bytes"])
        write_json(out, "export", {"status": "ok", **ident, "spec": spec, **summary, **info,
                                   "onnx_sha256": sha256_path(info["onnx"]),
                                   "provenance": provenance("export", inputs, params, started)})
    except Exception:
        _failure("export", out, ident, traceback.format_exc(), "export", inputs, params, started, spec=spec)


def build(ident: dict[str, Any], family: str, target: dict[str, Any], window: int, batch: int, spec: dict[str, Any],
          recipe: dict[str, Any], checkpoint_json: str, amax_json: str | None, out: str,
          export_json: str | None = None) -> None:
    """Build one engine (variant x target). A build that raises is recorded as failed.

    The torch backend builds from the variant module; onnxruntime and tensorrt from the
    variant's exported ONNX (`export_json`).
    """
    from quantstudy import backends

    started = now()
    inputs = {"checkpoint": checkpoint_json, **({"amax": amax_json} if amax_json else {}),
              **({"export": export_json} if export_json else {})}
    params = {"spec": spec, "recipe": recipe, "target": target, "window": window, "batch": batch}
    try:
        _deterministic()
        amax_doc = read_json(amax_json, "amax") if amax_json else None
        backend = backends.get(target["backend"])
        if getattr(backend, "INPUT", "module") == "onnx":
            exported = read_json(export_json, "export")
            if exported["status"] != "ok":
                raise RuntimeError(f"the export of {ident['variant']} failed, so it cannot be built:\n"
                                   f"{exported['error']}")
            summary = {k: exported[k] for k in ("precision", "fp8_layers", "hidden_scale", "dequantize_dtype")}
            info = backend.build(exported["onnx"], Path(out).parent, target)
        else:
            ckpt = read_json(checkpoint_json, "checkpoint")["snapshot"]
            model, summary = _variant_model(family, ckpt, window, spec, recipe, amax_doc)
            info = backend.build(model, Path(out).parent)
        calibration = None
        if amax_doc:
            calibration = {"amax": {n: amax_doc["amax"][n] for n in summary["fp8_layers"]},
                           "outliers": amax_doc["outliers"]}
        log.info("built %s: %d FP8 layers, %d bytes", ident, len(summary["fp8_layers"]), info["engine_bytes"])
        write_json(out, "build", {"status": "ok", **ident, "spec": spec, **summary, **info,
                                  "calibration": calibration,
                                  "provenance": provenance("build", inputs, params, started)})
    except Exception:
        _failure("build", out, ident, traceback.format_exc(), "build", inputs, params, started, spec=spec)


def _runner(family: str, build_doc: dict[str, Any], recipe: dict, checkpoint_json: str, window: int,
            target: dict[str, Any], example_ids):
    """Open a built engine as a runner at the example's input shape."""
    from quantstudy import backends

    if build_doc["status"] != "ok":
        raise RuntimeError(f"the build of {build_doc['variant']} failed, so it cannot be measured")
    backend = backends.get(target["backend"])
    skeleton = None
    if getattr(backend, "INPUT", "module") == "module":  # an ONNX engine carries its own structure
        ckpt = read_json(checkpoint_json, "checkpoint")["snapshot"]
        skeleton, _ = _variant_model(family, ckpt, window, build_doc["spec"], recipe, build_doc.get("calibration"))
    return backend.open(Path(build_doc["engine"]).parent, example_ids, target, skeleton)


def _timing_ids(family: str, checkpoint_json: str, window: int, batch: int):
    fam = _family(family)
    ckpt = read_json(checkpoint_json, "checkpoint")["snapshot"]
    tok = fam.tokenizer(ckpt)
    return fam.stress_inputs(tok, window, batch, seed=0)["input_ids"][:1].repeat(batch, 1)


def time(ident: dict[str, Any], family: str, target: dict[str, Any], window: int, batch: int, recipe: dict,
         timing: dict[str, int], checkpoint_json: str, build_json: str, baseline_build_json: str, out: str) -> None:
    """Time the variant and its baseline side by side (one process, interleaved rounds)."""
    from quantstudy import timing as qt

    started = now()
    inputs = {"checkpoint": checkpoint_json, "build": build_json, "baseline_build": baseline_build_json}
    params = {"target": target, "timing": timing, "window": window, "batch": batch}
    variant_doc, base_doc = read_json(build_json, "build"), read_json(baseline_build_json, "build")
    baseline = base_doc["variant"]
    try:
        _deterministic()
        ids = _timing_ids(family, checkpoint_json, window, batch)
        runners = {doc["variant"]: _runner(family, doc, recipe, checkpoint_json, window, target, ids)
                   for doc in (variant_doc, base_doc)}
        with qt.device_lock(target["device"]):
            result = qt.time_interleaved(runners, timing["warmup"], timing["rounds"], timing["calls_per_round"],
                                         lambda line: log.info(line))
            # Proof of FP8: the kernels the variant's FP8 GEMM ops launch (a short profile, after timing).
            fp8 = qt.fp8_proof(runners[ident["variant"]])
        log.info("FP8 GEMMs: %s", fp8)
        v, b = result[ident["variant"]], result[baseline]
        write_json(out, "timing", {"status": "ok", **ident, "baseline": baseline, "batch": batch, "window": window,
                                   "variant_ms": v, "baseline_ms": b, **qt.speedup(b["samples_ms"], v["samples_ms"]),
                                   "fp8": fp8, "provenance": provenance("time", inputs, params, started)})
    except Exception:
        _failure("timing", out, ident, traceback.format_exc(), "time", inputs, params, started, baseline=baseline)


def profile(ident: dict[str, Any], family: str, target: dict[str, Any], window: int, batch: int, recipe: dict,
            calls: int, checkpoint_json: str, build_json: str, out: str) -> None:
    """Kernel (GPU) or op (CPU) time per call, in the family's kernel groups."""
    from quantstudy import quantization, timing as qt

    started = now()
    inputs = {"checkpoint": checkpoint_json, "build": build_json}
    params = {"target": target, "calls": calls, "window": window, "batch": batch}
    try:
        fam = _family(family)
        runner = _runner(family, read_json(build_json, "build"), recipe, checkpoint_json, window, target,
                         _timing_ids(family, checkpoint_json, window, batch))
        regions = set(fam.regions) | {quantization.FP8_REGION}
        classify = functools.partial(fam.kernel_group, window=window)
        with qt.device_lock(target["device"]):
            if hasattr(runner, "kernel_profile"):  # the backend's own profiler (ONNX Runtime, TensorRT)
                result = runner.kernel_profile(calls, classify, quantization.FP8_REGION)
            else:
                result = qt.kernel_profile(runner, calls, classify, regions)
        write_json(out, "kernels", {"status": "ok", **ident, "groups": fam.kernel_groups, **result,
                                    "provenance": provenance("profile", inputs, params, started)})
    except Exception:
        _failure("kernels", out, ident, traceback.format_exc(), "profile", inputs, params, started)


def evaluate(ident: dict[str, Any], family: str, target: dict[str, Any], window: int, batch: int, recipe: dict,
             metrics: dict[str, Any], seeds: dict[str, int], checkpoint_json: str, build_json: str,
             reference_json: str, reference_tensors: str, sts_json: str, out: str) -> None:
    """Quality against the reference, and the non-finite scan (held-out, STS, stress inputs, a batch of 8)."""
    import torch
    from safetensors.torch import load_file

    from quantstudy import metrics as qm

    started = now()
    inputs = {"checkpoint": checkpoint_json, "build": build_json, "reference": reference_json,
              "reference_tensors": reference_tensors, "sts": sts_json}
    params = {"target": target, "metrics": metrics, "seeds": seeds, "window": window, "batch": batch}
    try:
        _deterministic()
        fam = _family(family)
        ckpt = read_json(checkpoint_json, "checkpoint")["snapshot"]
        ref_model, tok = fam.load_reference(ckpt), fam.tokenizer(ckpt)
        ref = load_file(reference_tensors)
        runner = _runner(family, read_json(build_json, "build"), recipe, checkpoint_json, window, target,
                         ref["heldout_ids"][:batch].long())

        def run(ids: torch.Tensor, what: str) -> torch.Tensor:
            progress, outs = Progress(what, ids.shape[0]), []
            for i in range(0, ids.shape[0], batch):
                outs.append(runner(ids[i:i + batch].long()).float().cpu())
                progress(min(i + batch, ids.shape[0]))
            return torch.cat(outs)

        masked = run(ref["masked_ids"], "masked held-out passages")
        pos = ref["mask_positions"]
        device = target["device"]  # the MLM head over every masked token is a large GEMM
        ref_model.to(device)
        with torch.no_grad():
            mlm = qm.mlm_agreement(fam.mlm_logits(ref_model, ref["mlm_features"].to(device)),
                                   fam.mlm_logits(ref_model, masked[pos[:, 0], pos[:, 1]].to(device)))
        heldout = run(ref["heldout_ids"], "held-out passages")
        sts = run(ref["sts_ids"], "STS sentences")
        gold = [p["score"] for p in read_json(sts_json, "samples")["samples"]]
        cls = qm.cls_agreement(ref["heldout_cls"], heldout[:, 0])
        n_bar = metrics["quality_bar"]["sts_sentences"]
        bar = qm.quality_bar(ref["sts_cls"][:n_bar], sts[:n_bar, 0], metrics["quality_bar"]["max_cls_relative_l2"])
        stress = fam.stress_inputs(tok, window, metrics["stress_inputs"], seeds.get("stress", 0))
        stress_out = run(stress["input_ids"], "stress inputs")
        with torch.no_grad():
            big = runner(ref["heldout_ids"][:metrics["nonfinite_batch"]].long()).float().cpu()
        bad = lambda x: int((~qm.finite_rows(x)).sum())
        nonfinite = {"heldout": {"bad": bad(heldout), "of": heldout.shape[0]},
                     "masked_heldout": {"bad": bad(masked), "of": masked.shape[0]},
                     "sts_sentences": {"bad": bad(sts), "of": sts.shape[0]},
                     "stress": {"bad": bad(stress_out), "of": stress_out.shape[0], "kinds": sorted(set(stress["kinds"]))},
                     "batch": {"bad": bad(big), "of": big.shape[0]}}
        nonfinite["total_bad"] = sum(v["bad"] for v in nonfinite.values() if isinstance(v, dict))
        log.info("mlm %s, cls %s, non-finite %s", mlm, cls, nonfinite["total_bad"])
        write_json(out, "quality", {
            "status": "ok", **ident, "window": window, "mlm": mlm, "cls": cls,
            "sts_spearman": qm.sts_spearman(sts[0::2, 0], sts[1::2, 0], gold), "quality_bar": bar,
            "nonfinite": nonfinite, "provenance": provenance("evaluate", inputs, params, started)})
    except Exception:
        _failure("quality", out, ident, traceback.format_exc(), "evaluate", inputs, params, started)
