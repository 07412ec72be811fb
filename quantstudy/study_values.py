"""The frozen values a study is made of: its models, datasets, sample sets, recipe, baseline, decision and
timing, its variants and the targets they run on. config.py builds them once at load (after checks.py has
checked them) and study.py's Study and Run hold them; a value that crosses into a rule's params converts in
one place (as_params / from_params).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from quantstudy.families.base import Setting


@dataclass(frozen=True)
class Model:
    name: str
    repo: str
    revision: str
    architecture_name: str
    architecture: dict[str, Any]
    settings: tuple[str, ...]
    tiny: dict[str, Any] | None = None
    timed: bool = True  # False: quality only (`timing: false`), no time or profile jobs


@dataclass(frozen=True)
class Configured:
    """A value of the study config that crosses into a rule's params: `entry` is its config entry as
    written (after defaults and the lock), which a rule passes and provenance records. Kept as written,
    key order included: Snakemake reruns a job whose params' repr changes, and every JSON records them."""

    entry: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, kw_only=True)

    def as_params(self) -> dict[str, Any]:
        """The config entry as plain values: a rule's params."""
        return copy.deepcopy(self.entry)


@dataclass(frozen=True)
class Dataset(Configured):
    name: str
    repo: str
    revision: str
    files: dict[str, str]
    tiny: dict[str, Any] | None = None
    box_format: str | None = None  # a detection dataset's layout of its boxes (metrics.BOX_FORMATS)


@dataclass(frozen=True)
class SampleSpec(Configured):
    """A sample set (`samples.<name>`): drawn from a split of a dataset by the family's rule. The family's
    own draw options (min_tokens, offset ...) stay in `entry`, which the family reads."""

    name: str
    dataset: str
    split: str
    kind: str
    count: int
    seed: int | None = None

    @classmethod
    def from_params(cls, name: str, params: dict[str, Any]) -> "SampleSpec":
        return cls(name, params["dataset"], params["split"], params["kind"], params["count"], params.get("seed"),
                   entry=dict(params))


@dataclass(frozen=True)
class Recipe(Configured):
    """The FP8 recipe (`recipe`): the layers it quantizes and how their scales are calibrated."""

    quantize: tuple[str, ...]
    weight_scale: str
    activation_calibration: dict[str, Any]
    dequantize_dtype: str
    outlier_ratio: float
    exclude_calls: tuple[str, ...] = ()

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "Recipe":
        return cls(tuple(params["quantize"]), params["weight_scale"], dict(params["activation_calibration"]),
                   params["dequantize_dtype"], params["outlier_ratio"], tuple(params.get("exclude_calls", ())),
                   entry=dict(params))

    @property
    def calibration_samples(self) -> list[str]:
        """The sample sets it calibrates on, in order (`activation_calibration.samples`: one or a list)."""
        return calibration_sample_sets(self.entry)

    @property
    def method(self) -> dict[str, Any]:
        """Its calibration method as a variant names one (`{"method": "max"}`)."""
        return {"method": self.activation_calibration["algorithm"]}

    @property
    def calibration_dtype(self) -> str:
        """The dtype the module is calibrated in (default float32; bf16 where the write-up calibrated the bf16 model)."""
        return self.activation_calibration.get("dtype", "float32")


@dataclass(frozen=True)
class Baseline:
    """The variant a setting's speed-ups are measured against: `default`, or its `by_setting` entry."""

    default: str
    by_setting: dict[str, str] = field(default_factory=dict)

    def of(self, setting: str) -> str:
        """The one place a setting's baseline is decided."""
        return self.by_setting.get(setting, self.default)


@dataclass(frozen=True)
class Condition:
    """One condition of the decision: `reduce` of `column` over the candidate's rows of `table`,
    compared with `threshold` (config/schemas/study.schema.yaml says what each key means)."""

    name: str
    table: str
    column: str
    reduce: str
    compare: str
    threshold: float
    basis: str
    rows: dict[str, Any] = field(default_factory=dict)
    units: str | None = None
    samples: tuple[str, ...] = ()
    n: str | None = None
    relative_to: str | None = None

    @classmethod
    def from_config(cls, c: dict[str, Any]) -> "Condition":
        return cls(c["name"], c["table"], c["column"], c["reduce"], c["compare"], c["threshold"], c["basis"],
                   dict(c.get("rows") or {}), c.get("units"), tuple(c.get("samples", ())), c.get("n"),
                   c.get("relative_to"))


@dataclass(frozen=True)
class Decision:
    """FP8 ships only if every condition holds on the candidate's rows."""

    conditions: tuple[Condition, ...]


@dataclass(frozen=True)
class Timing:
    """How a study times (`timing`): each job's warm-up, rounds and calls per round, how many separate
    jobs per timed variant (`repeats`), the smallest change that counts (`min_effect`: x and ms, shares),
    and whether each timed engine is profiled and its GEMMs timed alone (`profile`)."""

    warmup: int
    rounds: int
    calls_per_round: int
    repeats: int
    min_effect: dict[str, float]
    min_round_ms: float | None = None
    profile: bool = True

    def job_params(self) -> dict[str, Any]:
        """How each timing job times, as a rule's params: not `repeats` (raising it adds jobs, reruns none)."""
        rounds = {"warmup": self.warmup, "rounds": self.rounds, "calls_per_round": self.calls_per_round}
        return rounds if self.min_round_ms is None else {**rounds, "min_round_ms": self.min_round_ms}


# The GPUs (a target's `gpu:`) whose tensor cores run NVFP4 and MXFP8 GEMMs (Blackwell, sm_100+): the only
# targets a block-scaled variant (`timed: blackwell`) is timed on.
BLACKWELL = ("b200", "b300")


def timed_on(timed: bool | str, gpu: str) -> bool:
    """Whether a variant whose config says `timed` is timed on a target with this `gpu:`."""
    return timed is True or (timed == "blackwell" and gpu.lower() in BLACKWELL)


@dataclass(frozen=True)
class Variant:
    name: str
    precision: str
    transforms: tuple[tuple[str, dict[str, Any]], ...] = ()
    # False: a quality-only variant (built and evaluated; no time, profile or gemm job measures it);
    # "blackwell": timed on Blackwell targets (BLACKWELL) only, quality-only on every other.
    timed: bool | str = True
    # Its own calibration method (`calibration: {method: mse}`); None: the recipe's.
    calibration: dict[str, Any] | None = None

    def timed_on(self, gpu: str) -> bool:
        """Whether a target with this `gpu:` times the variant."""
        return timed_on(self.timed, gpu)

    @property
    def calibration_label(self) -> str:
        """What names its amax file (paths.calibration_suffix): "" for the recipe's method."""
        return calibration_label(self.calibration) if self.calibration else ""

    def transforms_at(self, setting: Setting) -> list[tuple[str, dict[str, Any]]]:
        """The transforms that apply at this setting: `when: {window: [512]}` limits a transform
        to the settings whose shape has one of those values."""
        return [(name, {k: v for k, v in params.items() if k != "when"}) for name, params in self.transforms
                if all(setting.shape.get(k) in values for k, values in params.get("when", {}).items())]

    def spec(self, setting: Setting) -> dict[str, Any]:
        """What the build of this variant at this setting depends on: a rule's params."""
        return {"precision": self.precision,
                "transforms": [{name: params} for name, params in self.transforms_at(setting)]}

    def has_fp8(self, setting: Setting) -> bool:
        return any(name == "fp8" for name, _ in self.transforms_at(setting))

    def needs_amax(self, setting: Setting) -> bool:
        """Whether its build reads the amax file: FP8 layers' scales, or NVFP4's per-tensor activation scale."""
        return any(name in ("fp8", "microscaling") for name, _ in self.transforms_at(setting))


def is_card(gpu: str, name: str) -> bool:
    """Whether a GPU named `name` (torch.cuda.get_device_name, e.g. "NVIDIA H200") is the card a target
    declares (`gpu: h200`): that word in the name, so "NVIDIA H100 80GB HBM3" is no h200."""
    return re.search(rf"(?<![a-z0-9]){re.escape(gpu.lower())}(?![a-z0-9])", name.lower()) is not None


def on_its_card(target: Target, gpu_name: str | None) -> bool:
    """Whether a job of `target` may record numbers on the GPU named `gpu_name` (None: the job sees
    none): a CPU target anywhere, a GPU target on the card it declares (`gpu:`), since its README
    says they are that card's. The audit asks it of every recorded job; each job before it starts."""
    return target.device == "cpu" or (gpu_name is not None and is_card(target.gpu, gpu_name))


@dataclass(frozen=True)
class Target:
    name: str
    backend: str
    device: str
    gpu: str = "cpu"
    version: str = ""
    env: str = ""
    compile: bool = False
    builder: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "Target":
        """A target as rules pass it (plain values under `target`: its name, so that Snakemake sees a change)."""
        return cls(**{"name": params["target"], **{k: v for k, v in params.items() if k != "target"}})

    def as_params(self) -> dict[str, Any]:
        """The target as plain values: a rule's params (from_params reads them back)."""
        return {"target": self.name, **vars(self)}


def calibration_label(method: dict[str, Any]) -> str:
    """A calibration method's name in paths: the method, then its parameters' values in key order
    (`{method: percentile, percentile: 99.9}` -> "percentile-99.9")."""
    return "-".join([method["method"], *(str(method[k]) for k in sorted(method) if k != "method")])


def calibration_sample_sets(recipe: dict[str, Any]) -> list[str]:
    """The sample sets a recipe calibrates on, in order: `activation_calibration.samples` names one or a list."""
    names = recipe["activation_calibration"]["samples"]
    return [names] if isinstance(names, str) else list(names)
