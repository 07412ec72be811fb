"""The study's steps, one function per rule of the workflow, callable without Snakemake; here the harness
they share, and the steps that fetch: tiny fixtures, checkpoints and sample lists.

Each step reads the artifacts earlier steps wrote and writes its own; nothing is passed in
memory between steps. A step that measures a variant records a failure as its result
(record_result). The steps are the harness: they know backends, timing, files and provenance, and
reach the model only through the family contract (families/base.py), so no step names a family.
The other steps: steps_reference.py (the reference and calibration), steps_engines.py (export,
build and opening a build's engines), steps_measure.py (time, profile, gemm, evaluate).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

from quantstudy import artifacts, hub
from quantstudy.artifacts import now, provenance, read_json, write_json
from quantstudy.config import Target, on_its_card

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


def gpu_work(device: str):
    """A shared turn on the GPU (timing.device_lock) for a job's GPU work: never during a measurement."""
    from quantstudy import timing as qt

    return qt.device_lock(device, shared=True)


def work_device() -> str:
    """Where the fp32 reference and the calibration run: the GPU if there is one (real-size models
    are too slow on a CPU), else the CPU. Recorded in their JSON."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def family_of(name: str):
    from quantstudy import families

    return families.get(name)


def setting_of(setting: dict[str, Any]):
    """A setting as rules pass it (Setting.as_params) -> base.Setting."""
    from quantstudy.families.base import Setting

    return Setting.from_params(setting)


def snapshot_of(checkpoint_json: str) -> str:
    return read_json(checkpoint_json, "checkpoint")["snapshot"]


# --- fixtures and fetching --------------------------------------------------------------------


def local_hub(family: str, models: list[dict[str, Any]], datasets: list[dict[str, Any]], cache_dir: str,
              out: str, weights: str = "tiny-random-init") -> None:
    """Generate tiny checkpoints and datasets into the local HF cache, at their content-hash revisions.

    `models`: repo, revision, architecture (dict) and tiny spec; `datasets`: repo, revision, files, tiny spec.
    A dataset is generated for the first model's architecture (its tokenizer's vocabulary, say).
    """
    started = now()
    fam = family_of(family)
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


def load_split(snapshot: Path, pattern: str):
    """The rows of a dataset split: the files of a pinned snapshot that match `pattern`, read by `datasets`
    (a parquet row also names its file and its place there, `__url__` and `__index__`)."""
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
    rows = load_split(Path(snapshot), dataset["files"][split])
    log.info("%s %s: %d rows", dataset["repo"], split, len(rows))
    fam = family_of(family)
    # A detection dataset's declared box layout, which the family checks against every drawn image.
    spec = samples_spec | ({"box_format": dataset["box_format"]} if dataset.get("box_format") else {})
    return fam.draw_samples(rows, spec, fam.processor(snapshot_of(checkpoint_json)))


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
    for s, actual in zip(samples, family_of(family).content_sha256(samples)):
        if actual != s["sha256"]:
            raise artifacts.DamagedArtifact(path, f"sample {s['id']!r} records sha256 {s['sha256']}, its content "
                                                  f"hashes to {actual}: the list is not the one fetch_dataset drew")
    return samples


def samples_of(samples_jsons: dict[str, str], family: str) -> dict[str, list[dict[str, Any]]]:
    return {name: read_samples(path, family) for name, path in samples_jsons.items()}


# --- a step's record ------------------------------------------------------------------------

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


def record_result(kind: str, rule: str, out: str, ident: dict[str, Any], inputs: dict[str, Any], params: dict[str, Any],
                  measure, on_failure: dict[str, Any] | None = None) -> dict[str, Any]:
    """The one way a step writes what it measured: `measure()`'s fields as the ok record, or, if it
    raises, the failed record (record_failure). A failure is a result: it is written, never raised. Returns
    the record written. A job of a target (`params["target"]`) on a host without its card is no
    result: it raises WrongCard before measuring, and writes nothing."""
    if "target" in params:
        _require_card(Target.from_params(params["target"]))
    started = now()
    try:
        doc = {"status": "ok", **ident, **measure()}
    except Exception:
        return record_failure(kind, rule, out, ident, inputs, params, started, traceback.format_exc(), on_failure)
    write_json(out, kind, {**doc, "provenance": provenance(rule, inputs, params, started)})
    return doc


def record_failure(kind: str, rule: str, out: str, ident: dict[str, Any], inputs: dict[str, Any], params: dict[str, Any],
                   started: str, error: str, on_failure: dict[str, Any] | None = None) -> dict[str, Any]:
    """The failed record of a step: the whole traceback as its error (and `on_failure`'s fields)."""
    log.error("%s failed: %s", rule, error.strip().splitlines()[-1])
    doc = {"status": "failed", **ident, **(on_failure or {}), "error": error}
    write_json(out, kind, {**doc, "provenance": provenance(rule, inputs, params, started)})
    return doc
