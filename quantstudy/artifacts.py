"""Reading and writing the workflow's JSON artifacts: schema check, provenance, atomic write."""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import os
import platform
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA_DIR = Path(__file__).parent / "schemas"
# 2: the family contract (named graphs, metric blocks, settings with shapes, data-driven decisions).
# 3: every artifact carries the digest of its own content (`content_sha256`), checked on every read.
SCHEMA_VERSION = 3
DIGEST = "content_sha256"
_SOFTWARE = ("torch", "transformers", "nvidia-modelopt", "onnx", "onnxruntime", "tensorrt",
             "huggingface_hub", "datasets", "numpy", "pandas", "snakemake")


def load_schema(kind: str) -> dict:
    """The JSON schema of one artifact kind, with the shared provenance definition."""
    schema = json.loads((SCHEMA_DIR / f"{kind}.json").read_text())
    schema.setdefault("$defs", {})["provenance"] = json.loads((SCHEMA_DIR / "provenance.json").read_text())
    return schema


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_path(path: str | Path) -> str:
    """sha256 of a file, or of a folder as the hash of its sorted (relative path, file hash) list."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path).as_posix()}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")  # whether two jobs overlapped shows


def software_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _SOFTWARE:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {"machine": platform.machine(), "cpu": platform.processor() or platform.machine(),
                            "cpu_model": cpu_model(), "cpus": os.cpu_count(), "host": platform.node()}
    try:
        import torch
        # The vector instructions torch's CPU kernels dispatch to: on AVX2 alone a float16 GEMM is emulated,
        # 10 to 30 times slower than float32 (measured 2026-12-07), so CPU timings of two hosts compare only at one ISA.
        info["cpu_isa"] = torch.backends.cpu.get_cpu_capability()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
            info["cuda"] = torch.version.cuda
            info["gpu_system"] = gpu_system(str(torch.cuda.get_device_properties(0).uuid))
    except ImportError:
        pass
    return info


def cpu_model() -> str | None:
    """The CPU's model name as Linux reports it (/proc/cpuinfo); None elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def gpu_name(hardware_doc: dict[str, Any]) -> str | None:
    """The GPU a job ran on, as its provenance's `hardware` records it: the driver's name, else torch's;
    None for a job that saw no GPU."""
    return hardware_doc.get("gpu_system", {}).get("name") or hardware_doc.get("gpu")


def device_name(hardware_doc: dict[str, Any]) -> str:
    """The device a job ran on, as its provenance's `hardware` records it: its GPU (gpu_name), else `CPU`
    with the vector ISA its torch kernels used where recorded (`CPU with AVX2`)."""
    isa = hardware_doc.get("cpu_isa")
    return gpu_name(hardware_doc) or (f"CPU with {isa}" if isa else "CPU")


def devices(docs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The devices a set of jobs ran on, as their JSONs' provenance records them: [{device, jobs}],
    most jobs first. What a README says a run ran on, never a config's note."""
    counts = Counter(device_name((doc.get("provenance") or {}).get("hardware") or {}) for doc in docs)
    return [{"device": d, "jobs": n} for d, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def gpu_system(uuid: str | None = None) -> dict[str, Any]:
    """The job's GPU as the driver describes it (`nvidia-smi -q -x`): model, driver, CUDA, clocks
    now and at most, power limit, and the clock event (throttle) reasons active at this moment.
    Where nvidia-smi is missing or fails, the reason instead."""
    try:
        xml = subprocess.run(["nvidia-smi", "-q", "-x"], capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": f"nvidia-smi: {e}"}
    return parse_nvidia_smi(xml, uuid)


def parse_nvidia_smi(xml: str, uuid: str | None = None) -> dict[str, Any]:
    """The fields of gpu_system from nvidia-smi's XML, for the GPU whose UUID ends with `uuid`
    (torch gives it without the GPU- prefix), else the first one."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(xml)
    gpus = root.findall("gpu")
    gpu = next((g for g in gpus if uuid and (g.findtext("uuid") or "").endswith(uuid)), gpus[0] if gpus else None)
    if gpu is None:
        return {"error": "nvidia-smi lists no GPU"}
    text = lambda path: (gpu.findtext(path) or "").strip() or None
    # Renamed from clocks_throttle_reasons to clocks_event_reasons in newer drivers.
    reasons = gpu.find("clocks_event_reasons")
    if reasons is None:
        reasons = gpu.find("clocks_throttle_reasons")
    active = sorted(r.tag.removeprefix("clocks_event_reason_").removeprefix("clocks_throttle_reason_")
                    for r in (reasons if reasons is not None else []) if (r.text or "").strip() == "Active")
    return {"name": text("product_name"), "uuid": text("uuid"), "driver": root.findtext("driver_version"),
            "cuda_driver": root.findtext("cuda_version"),
            "clocks_mhz": {k: text(f"clocks/{k}_clock") for k in ("graphics", "sm", "mem")},
            "max_clocks_mhz": {k: text(f"max_clocks/{k}_clock") for k in ("graphics", "sm", "mem")},
            "power_limit": text("gpu_power_readings/current_power_limit") or text("power_readings/power_limit"),
            "temperature": text("temperature/gpu_temp"), "clock_event_reasons_active": active,
            "persistence_mode": text("persistence_mode"), "compute_mode": text("compute_mode")}


def workflow_commit() -> str:
    """The git commit of the workflow, with '-dirty' when the work tree has uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(rule: str, inputs: dict[str, str | Path] | None = None, params: dict | None = None,
               started: str | None = None) -> dict[str, Any]:
    """The provenance block every artifact carries: where its inputs, code and machine came from."""
    return {
        "rule": rule,
        "inputs": {name: {"path": str(p), "sha256": sha256_path(p)} for name, p in (inputs or {}).items()},
        "params": params or {},
        "software": software_versions(),
        "hardware": hardware(),
        "workflow_commit": workflow_commit(),
        "started": started or now(),
        "finished": now(),
    }


def error_summary(error: str) -> str:
    """A failed record's reason in one line: its traceback's last, the exception's module path dropped
    ("NotApplicable: ...", not "quantstudy.calibration.NotApplicable: ...")."""
    name, sep, reason = error.strip().splitlines()[-1].partition(": ")
    return f"{name.rpartition('.')[2]}{sep}{reason}"


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write a file so that readers see either the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


@contextlib.contextmanager
def file_lock(path: str | Path, mode: int = fcntl.LOCK_EX):
    """Hold an flock on `path` (created if missing): LOCK_EX alone, LOCK_SH with other sharers."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_json(path: str | Path, kind: str, doc: dict[str, Any]) -> None:
    """Validate `doc` against the schema of `kind` and write it atomically (temp file, then rename)."""
    doc = {"schema": kind, "schema_version": SCHEMA_VERSION, **doc}
    jsonschema.validate(doc, load_schema(kind))
    doc = plain(doc)
    doc[DIGEST] = content_digest(doc)
    atomic_write(path, json.dumps(doc, indent=1, sort_keys=False, allow_nan=False) + "\n")


def plain(doc: Any) -> Any:
    """A document in plain JSON values, as write_json stores it and a reader sees it."""
    return json.loads(json.dumps(doc, allow_nan=False, default=_jsonable))


def leaves(doc: Any, prefix: str = "", skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """{dotted path: value} of every scalar in a JSON document, keys in `skip` left out at any depth."""
    if isinstance(doc, dict):
        return {k: v for key, value in doc.items() if key not in skip
                for k, v in leaves(value, f"{prefix}{key}.", skip).items()} or {prefix.rstrip("."): {}}
    if isinstance(doc, list):
        return {k: v for i, value in enumerate(doc) for k, v in leaves(value, f"{prefix}{i}.", skip).items()} or \
            {prefix.rstrip("."): []}
    return {prefix.rstrip("."): doc}


def content_digest(doc: dict[str, Any]) -> str:
    """sha256 of an artifact's canonical JSON (sorted keys, no spaces), its own digest left out:
    written by the job that made the artifact and checked by every reader, so that a value edited
    afterwards is refused on read, whether or not the workflow runs again."""
    body = {k: v for k, v in doc.items() if k != DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()).hexdigest()


def rerun_command(path: str | Path) -> str:
    """The command that makes one artifact again: its path forced, whichever rule writes it. Not
    `--forcerun <rule>`: an evaluation job's rebuild (rebuild-r2/build.json) is rule rebuild's, not
    build's, and a rule name reruns every job of that rule, not the one file."""
    return f"snakemake --force {path}"


class DamagedArtifact(ValueError):
    """An artifact that cannot be read as what it should be: the path, what is wrong, how to remake it."""

    def __init__(self, path: str | Path, problem: str):
        self.path, self.problem = str(path), problem
        super().__init__(f"{path}: {problem}; rerun the job that writes it: {rerun_command(path)}")


def read_json(path: str | Path, kind: str | None = None) -> dict[str, Any]:
    """An artifact, checked: valid JSON, its content digest, of `kind`, of this schema version, valid
    by its schema. Anything else raises DamagedArtifact, which names the file."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise DamagedArtifact(path, f"not valid JSON ({e}), a truncated or edited file") from None
    if isinstance(doc, dict) and "schema" in doc and doc.get("schema_version") == SCHEMA_VERSION:
        if DIGEST not in doc:
            raise DamagedArtifact(path, f"has no {DIGEST}, the digest its job writes: it was not written by that job")
        if doc[DIGEST] != content_digest(doc):
            raise DamagedArtifact(path, f"does not match its {DIGEST}: its content was edited after the job wrote it")
    if kind is not None:
        if not isinstance(doc, dict) or doc.get("schema") != kind:
            found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
            raise DamagedArtifact(path, f"holds a {found!r} artifact, expected {kind!r}")
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise DamagedArtifact(path, f"is a {kind} artifact of schema version {doc.get('schema_version')}, "
                                        f"this code reads version {SCHEMA_VERSION}")
        try:
            jsonschema.validate(doc, load_schema(kind))
        except jsonschema.ValidationError as e:
            where = "/".join(map(str, e.absolute_path)) or "the top level"
            raise DamagedArtifact(path, f"fails the {kind} schema at {where}: {e.message}") from None
    return doc


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
