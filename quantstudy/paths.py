"""Where the workflow keeps every artifact: each path spelled once, here.

Each pattern is a path under results/ with Snakemake's wildcards ({study}, {model}, {setting},
{target}, {variant}, {samples}, {repeat}): a rule names it as its output or input as it is, and
code fills it in with `.format(...)`. Nothing else in the package, the rules or the benchmarks
spells where an artifact lives; what finds a file beside another (a build's measurements record,
a study's README beside its tables) asks `beside` or `in_folder` with the pattern. The files inside
one graph's folder (graph_dir: its ONNX, its engine) are named by export and by its backend.

This module imports nothing of the package: the rules, the steps, config, the audit and the
comparison harness all import it.
"""

from __future__ import annotations

import string
from pathlib import Path

RESULTS = "results"
# Where the workflow keeps a setting's and a variant's files, under results/, logs/ and benchmarks/.
SETTING_KEY = "{study}/{target}/{model}/{setting}"
VARIANT_KEY = f"{SETTING_KEY}/{{variant}}"
STUDY_DIR = f"{RESULTS}/{{study}}"
SETTING_DIR = f"{RESULTS}/{SETTING_KEY}"
VARIANT_DIR = f"{RESULTS}/{VARIANT_KEY}"
EXPORT_DIR = f"{STUDY_DIR}/{{model}}/{{setting}}/onnx/{{variant}}"

# Pinned inputs: the local hub of the tiny fixtures, a model's checkpoint, a sample list.
LOCAL_HUB = f"{STUDY_DIR}/local_hub.json"
CHECKPOINT = f"{STUDY_DIR}/{{model}}/checkpoint.json"
SAMPLES = f"{STUDY_DIR}/data/{{samples}}.json"
# The reference model's outputs at a setting, and a calibration setting's static scales: {calibration}
# is "" for the recipe's method (amax.json), "-<method>[-<value>...]" for a variant's own (calibration_suffix).
REFERENCE = f"{STUDY_DIR}/{{model}}/{{setting}}/reference.json"
REFERENCE_TENSORS = f"{STUDY_DIR}/{{model}}/{{setting}}/reference.safetensors"
AMAX = f"{STUDY_DIR}/{{model}}/calib/{{setting}}/amax{{calibration}}.json"
# Per variant: its ONNX export (each graph's folder beside it), its build (each graph's engine folder
# beside it, see graph_dir), the build's measurements record, and what each measurement job wrote.
# {repeat} is "" for a variant's first job, "-r2", "-r3" ... for its repeats (repeat_suffix).
EXPORT = f"{EXPORT_DIR}/export.json"
BUILD = f"{VARIANT_DIR}/build.json"
MEASUREMENTS = f"{VARIANT_DIR}/measurements.json"
TIMING = f"{VARIANT_DIR}/timing{{repeat}}.json"
KERNELS = f"{VARIANT_DIR}/kernels.json"
QUALITY = f"{VARIANT_DIR}/quality{{repeat}}.json"
# A separate build of a variant's engine for its evaluation job {repeat} (-r2, ...; `evaluation.rebuild`):
# its build.json, measurements record and engine folders, as the first build's, in a folder of their own.
REBUILD_DIR = f"{VARIANT_DIR}/rebuild{{repeat}}"
REBUILD = f"{REBUILD_DIR}/build.json"
REBUILD_MEASUREMENTS = f"{REBUILD_DIR}/measurements.json"
# Per target, model and setting: the FP8 variants' GEMMs alone.
GEMM = f"{SETTING_DIR}/gemm.json"
# Per study: its tables, plot, README section (and its page), audit; and the run's front page.
TABLES = f"{STUDY_DIR}/tables.json"
PLOT = f"{STUDY_DIR}/speed_quality.png"
README = f"{STUDY_DIR}/README.md"
README_PAGE = f"{STUDY_DIR}/README.html"
AUDIT = f"{STUDY_DIR}/audit.json"
DECISIONS = f"{RESULTS}/decisions.rst"
# The report of a study's re-execution (quantstudy.reproduce), in its scratch folder.
REPRODUCE = "reproduce.json"

VARIANT_FIELDS = ("target", "model", "setting", "variant")


def repeat_suffix(repeat: int) -> str:
    """The {repeat} of a variant's n-th timing or evaluation job: the first keeps the name a run without
    repeats has (timing.json), then timing-r2.json, ..."""
    return "" if repeat == 1 else f"-r{repeat}"


def calibration_suffix(label: str) -> str:
    """The {calibration} of an amax file: "" for the recipe's method, "-<label>" for a variant's own."""
    return f"-{label}" if label else ""


def repeat_number(suffix: str) -> int:
    """The job number a {repeat} wildcard names: 1 for "", n for "-rn"."""
    return int(suffix.removeprefix("-r")) if suffix else 1


def name_of(pattern: str) -> str:
    """A pattern's file name (its last part; wildcards in it stay)."""
    return Path(pattern).name


def in_folder(folder: str | Path, pattern: str) -> Path:
    """The file of `pattern` in `folder`: a study's tables.json in a study folder given anywhere."""
    return Path(folder) / name_of(pattern)


def beside(path: str | Path, pattern: str) -> Path:
    """The file of `pattern` in the folder of `path`: the measurements record beside a build.json."""
    return in_folder(Path(path).parent, pattern)


def graph_dir(artifact: str | Path, graph: str) -> Path:
    """The folder of one graph beside a variant's export.json (its ONNX) or build.json (its engine)."""
    return Path(artifact).parent / graph


def build_of_engine(engine_dir: str | Path) -> Path:
    """The build.json that made the engine in `engine_dir` (graph_dir's inverse)."""
    return beside(engine_dir, BUILD)


def variant_of(path: str | Path) -> dict[str, str]:
    """What the layout says of a per-variant artifact (VARIANT_DIR/x.json): its target, model, setting
    and variant, for a file too damaged to say it itself."""
    return dict(zip(VARIANT_FIELDS, Path(path).parts[-5:-1]))


def setting_of(path: str | Path) -> tuple[str, ...]:
    """(target, model, setting) of a per-setting artifact (SETTING_DIR/x.json), from the layout."""
    return tuple(Path(path).parts[-4:-1])


def glob(results: str | Path, pattern: str, **keys: str) -> list[Path]:
    """The files of `pattern` in a results folder (results/, or an evidence run's copy of it), sorted: each
    wildcard in `keys` filled in, every other one matching anything."""
    fields = {f for _, f, _, _ in string.Formatter().parse(pattern) if f}
    relative = Path(pattern.format(**{f: keys.get(f, "*") for f in fields})).relative_to(RESULTS)
    return sorted(p for p in Path(results).glob(str(relative)) if p.is_file())
