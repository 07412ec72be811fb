"""The family contract: what a model family gives the study steps, and nothing more.

The steps are the harness (timing, profiling, evaluation loops, provenance, tables); a family
is the sample library plus the model. It never sees a timer, a backend or a JSON file, and
the steps never name a family. Everything crosses as plain values and named tensor dicts:

    samples    list of dicts, each with an `id` and the `sha256` of its content
    inputs     {input name: tensor}, batch first
    outputs    {output name: tensor}, batch first; what `module(...)(**inputs)` returns
    blocks     {block: {metric: number or None}}: what `reference` and `evaluate` report

A setting is a name, a batch and a shape the family validates (a window; an image height and
width; a prefill and a cache length). A graph is one engine of a variant at a setting (`main`,
or `prefill` and `decode`), with its inputs by name, dtype and shape and the sizes that are
dynamic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

Inputs = dict[str, Any]  # {name: torch.Tensor}; Any keeps this module free of torch
Blocks = dict[str, dict[str, Any]]


def seeded_rows(rows: int, spec: Mapping[str, Any]) -> list[int]:
    """A samples spec's row indices of a split of `rows` rows: every row in one order shuffled with
    `seed`, then [offset, offset + count) of it. Sets drawn with the same seed and non-overlapping
    offsets are disjoint (a study's calibration and held-out sets)."""
    order = list(range(rows))
    random.Random(spec.get("seed", 0)).shuffle(order)
    offset = spec.get("offset", 0)
    return order[offset:offset + spec["count"]]


@dataclass(frozen=True)
class Setting:
    """What one row of the study measures: a batch and a family-validated shape."""

    name: str
    batch: int
    shape: Mapping[str, int]
    quality: bool = True  # False: timing and profile only (no reference, no evaluate)

    def __getitem__(self, key: str) -> int:
        return self.shape[key]

    def as_params(self) -> dict[str, Any]:
        """The setting as plain values: a rule's params, so that a changed shape reruns its jobs."""
        return {"name": self.name, "batch": self.batch, "shape": dict(self.shape), "quality": self.quality}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "Setting":
        """A setting as a rule passes it (as_params)."""
        return cls(params["name"], params["batch"], params["shape"], params.get("quality", True))


@dataclass(frozen=True)
class Dim:
    """A dynamic size of a graph input: its name and the min / opt / max an engine is built for."""

    name: str
    min: int
    opt: int
    max: int


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # torch dtype name: "int64", "float32" (a floating input is cast to the variant's precision)
    shape: tuple[int, ...]  # the example's (opt) shape
    dynamic: Mapping[int, Dim] = field(default_factory=dict)  # axis -> size range


@dataclass(frozen=True)
class Graph:
    """One engine of a variant: its named inputs and outputs."""

    name: str
    inputs: Mapping[str, TensorSpec]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class Evaluation:
    """A family's measurement of one engine: metric blocks and non-finite counts per sample set."""

    blocks: Blocks
    nonfinite: dict[str, dict[str, Any]]  # sample set -> {"bad": rows, "of": rows, ...}

    @property
    def total_nonfinite(self) -> int:
        return sum(int(v["bad"]) for v in self.nonfinite.values())


@dataclass(frozen=True)
class QualityColumns:
    """The metric names a family's `reference` and `evaluate` write for a study: its quality table's
    own columns, declared so that a decision condition naming one that is not there stops the run."""

    blocks: dict[str, tuple[str, ...]]  # evaluate's blocks: block -> scalar metric names
    nonfinite: tuple[str, ...]  # the sample sets evaluate's non-finite scan counts
    reference: dict[str, tuple[str, ...]]  # reference's blocks


def against_block(block: str, variant: str) -> str:
    """The quality block of `block`'s metrics measured against the engine of `variant`
    (`quality_against`): `heldout_vs_fp16`. No variant is measured against itself."""
    return f"{block}_vs_{variant}"


def measured_against(column: str, against: list[str]) -> str | None:
    """The `quality_against` variant a quality column is measured against (`heldout_vs_fp16.ap_drop`:
    fp16), or None: that variant's own rows have no value in the column, by design."""
    block = column.split(".")[0]
    return next((v for v in against if block.endswith(against_block("", v))), None)


def metrics_schema(properties: dict[str, Any]) -> dict[str, Any]:
    """A family's `metrics` schema: an object with exactly these keys, each required."""
    return {"type": "object", "additionalProperties": False, "required": list(properties), "properties": properties}


COUNT = {"type": "integer", "minimum": 1}
SHARE = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
POSITIVE = {"type": "number", "exclusiveMinimum": 0}


# A runner as the family sees it: run(inputs, what="", graph="main", whole=False, on_device=False) ->
# outputs, on the CPU. The harness feeds any number of rows in the engine's batch (`whole`: all rows in
# one call); `on_device` leaves the outputs on the engine's device, for metrics computed there.
Run = Callable[..., dict[str, Any]]


@runtime_checkable
class Family(Protocol):
    """A model family. Implementations live in `quantstudy/families/<name>.py`, `@register`ed."""

    name: str
    kernel_groups: list[str]  # the write-up's kernel-time groups, in its table's order
    # The study config's `metrics` block (a JSON schema: every key the family reads, none it does not)
    # and `seeds` (every name the family reads; each is required), checked when a study is loaded.
    metrics_schema: dict[str, Any]
    seeds: tuple[str, ...]
    regions: dict[str, str]  # record_function region -> kernel group (eager torch profiles)

    # --- configuration and loading ---------------------------------------------------------
    def hf_config(self, architecture: dict[str, Any]) -> Any: ...

    def load_reference(self, checkpoint: str | Path, dtype: Any) -> Any:
        """The study's reference model (Transformers or timm) at `checkpoint`, in `dtype`, eval mode."""

    def processor(self, checkpoint: str | Path) -> Any:
        """Tokenizer or image processor of the checkpoint."""

    def quantizable_layers(self, architecture: dict[str, Any]) -> list[str]:
        """Names of the layers a recipe may select (built on the meta device)."""

    def check_setting(self, setting: Setting) -> list[str]:
        """Problems with a setting's shape, as sentences (empty: valid)."""

    # --- embedded default -----------------------------------------------------------------
    def tiny_checkpoint_files(self, architecture: dict[str, Any], tiny: dict[str, Any]) -> dict[str, bytes]: ...

    def tiny_dataset_files(self, files: dict[str, str], tiny: dict[str, Any],
                           architecture: dict[str, Any]) -> dict[str, bytes]:
        """A tiny dataset's files (one per split pattern), for a model of `architecture`."""

    # --- samples and inputs ----------------------------------------------------------------
    def draw_samples(self, rows: Any, spec: dict[str, Any], processor: Any) -> list[dict[str, Any]]:
        """Seeded samples from a dataset split (a `datasets.Dataset`), each with `id` and `sha256`."""

    def content_sha256(self, samples: list[dict[str, Any]]) -> list[str]:
        """The sha256 of the content a job uses of each sample (its text, its pair, its image's bytes): what
        `draw_samples` records as its `sha256`, recomputed by every job that reads a sample list."""

    def calibration_batches(self, checkpoint: str | Path, samples: list[dict[str, Any]],
                            setting: Setting) -> list[Inputs]: ...

    def graphs(self, setting: Setting, architecture: dict[str, Any]) -> dict[str, Graph]:
        """The engines a variant has at a setting (the architecture gives e.g. a KV cache's shapes)."""

    def module(self, checkpoint: str | Path, graph: str, setting: Setting) -> Any:
        """The fp32 module of a graph: `forward(**inputs) -> {output: tensor}`. Variants are made from it."""

    def example_inputs(self, checkpoint: str | Path, graph: str, setting: Setting) -> Inputs:
        """Inputs of the setting's shape and batch: what timing replays and export traces."""

    # --- measurements ----------------------------------------------------------------------
    def reference(self, checkpoint: str | Path, samples: dict[str, list[dict[str, Any]]], setting: Setting,
                  metrics: dict[str, Any], seeds: dict[str, int], device: str,
                  dtype: Any) -> tuple[dict[str, Any], Blocks]:
        """Reference outputs (tensors kept for `evaluate`) and the reference's own metric blocks, of
        the reference model in the study's `reference_dtype` (fp32; bf16 for GPT-Neo)."""

    def evaluate(self, checkpoint: str | Path, run: Run, reference: dict[str, Any], samples: dict[str, list],
                 setting: Setting, metrics: dict[str, Any], seeds: dict[str, int], device: str,
                 against: Mapping[str, Run]) -> Evaluation:
        """Quality of an engine (`run`) against the reference tensors, and the non-finite scan;
        `against` holds the engines of the variants the study's `quality_against` names (same target
        and setting), to compare with as the write-up does (Deformable DETR: against fp16)."""

    def quality_columns(self, evaluation_samples: list[str], against: list[str]) -> QualityColumns:
        """What `reference` and `evaluate` write, for a study with these evaluation sample lists and
        these `quality_against` variants (checked against a real evaluation in the family's tests)."""

    def kernel_group(self, region: str | None, name: str, device: str, op: dict[str, Any] | None,
                     setting: Setting) -> str:
        """The write-up's group of a profiled CPU op or GPU kernel (see timing.kernel_profile)."""

    def transforms(self) -> dict[str, Callable[[Any, dict[str, Any]], dict[str, Any]]]:
        """The family's own variant transforms: name -> fn(model, params) -> summary entries."""
