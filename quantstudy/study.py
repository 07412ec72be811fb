"""The typed study model: a run, its targets and studies (Run, Study), over the frozen values each study is
made of (study_values.py), built once at load by config.py after checks.py has checked them. Rules and
steps read their attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quantstudy import paths
from quantstudy.families.base import Setting
from quantstudy.study_values import Baseline, Dataset, Decision, Model, Recipe, SampleSpec, Target, Timing, Variant


@dataclass(frozen=True)
class Study:
    """One study, built and checked once at load (load_study): what the rules and steps read."""

    name: str
    family: str
    title: str
    models: dict[str, Model]
    settings: dict[str, Setting]
    datasets: dict[str, Dataset]
    samples: dict[str, SampleSpec]
    variants: dict[str, Variant]
    recipe: Recipe
    baseline: Baseline
    candidate: str  # the variant the decision is about
    timing: Timing
    decision: Decision
    # The family's own parameters stay dicts: their keys are the family's, not the study model's (each family
    # declares and checks them: its metrics schema, its `seeds`), and they reach its functions as rule params.
    metrics: dict[str, Any]  # the family's metric parameters, checked against its schema at load
    seeds: dict[str, int]  # each seed the family draws with, by name
    evaluation_samples: tuple[str, ...]  # the sample sets every evaluation and reference job measures
    # the variants whose engines every other variant's evaluation is also compared with
    quality_against: tuple[str, ...] = ()
    reference_dtype: str = "float32"  # the dtype the PyTorch reference runs in
    evaluation_repeats: int = 1  # separate evaluation jobs per engine (`evaluation.repeats`)
    evaluation_rebuild: bool = False  # evaluation job r >= 2 opens its own build (`evaluation.rebuild`)
    calibrate_by: tuple[str, ...] | None = None  # the shape keys an amax file depends on (None: all)
    # setting -> the setting whose dynamic-shape engine it runs on (its `engine:`); absent: its own
    setting_engines: dict[str, str] = field(default_factory=dict)

    # target -> {"settings": [...], "variants": [...]} (a missing key: all); empty: every target, all of it
    targets: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    published: str | None = None  # config/published/<study>.yaml, checked against the study when loaded
    # The study as configured (defaults filled in, revisions locked): what tables.json records of it and
    # the audit compares (Run.aggregate_arguments); nothing else reads it.
    document: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def repeats(self) -> int:
        """Separate timing jobs per timed variant (`timing.repeats`, the run's where it sets one)."""
        return self.timing.repeats

    def sample_dataset(self, name: str) -> Dataset:
        """The dataset that sample set `name` is drawn from."""
        return self.datasets[self.samples[name].dataset]

    def setting(self, name: str) -> Setting:
        return self.settings[name]

    def baselines(self) -> dict[str, str]:
        return {s: self.baseline.of(s) for s in self.settings}

    def local_hub_models(self) -> list[dict[str, Any]]:
        """The models the local_hub rule generates (those with a tiny spec), as its params."""
        return [{"repo": m.repo, "revision": m.revision, "architecture": m.architecture, "tiny": m.tiny}
                for m in self.models.values() if m.tiny]

    def local_hub_datasets(self) -> list[dict[str, Any]]:
        """The datasets the local_hub rule generates (those with a tiny spec), as its params."""
        return [{"repo": d.repo, "revision": d.revision, "files": d.files, "tiny": tiny_dataset_spec(d)["tiny"]}
                for d in self.datasets.values() if d.tiny]

    @property
    def has_local_hub(self) -> bool:
        """Whether the study generates anything into the local hub (its local_hub rule runs)."""
        return bool(self.local_hub_models() or self.local_hub_datasets())

    def model_settings(self, quality_only: bool = False, timed_only: bool = False):
        for model in self.models.values():
            if timed_only and not model.timed:
                continue
            for s in model.settings:
                if not quality_only or self.settings[s].quality:
                    yield model.name, s

    def engines(self, run_targets, quality_only: bool = False, timed_only: bool = False):
        """(target, model, setting, variant) of every engine the study measures on the run's targets
        (`quality_only`: that it evaluates; `timed_only`: that it times and profiles). `run_targets`: the
        run's {name: Target}, or target names (then each counts as no Blackwell GPU)."""
        for t in run_targets:
            if self.targets and t not in self.targets:
                continue
            only = self.targets.get(t) or {}
            gpu = getattr(run_targets[t], "gpu", "cpu") if isinstance(run_targets, dict) else "cpu"
            for m, s in self.model_settings(quality_only, timed_only):
                if s in only.get("settings", [s]):
                    for v in self.variants:
                        timed = self.variants[v].timed_on(gpu)
                        # not an engine of a variant this target does not time at a setting without quality
                        if v in only.get("variants", [v]) and (timed or not timed_only) and (timed or self.settings[s].quality):
                            yield t, m, s, v

    def engine_setting(self, setting: str) -> str:
        """The setting whose engines this one is timed and evaluated on: itself, or the one its
        `engine:` names (one dynamic-shape engine serving several settings)."""
        return self.setting_engines.get(setting, setting)

    def build_json(self, target: str, model: str, setting: str, variant: str) -> str:
        """The build record (paths.BUILD) of the engine a variant is timed and evaluated on at `setting`:
        built at that setting, or at the one whose dynamic-shape engine serves it (`engine:`)."""
        return paths.BUILD.format(study=self.name, target=target, model=model, setting=self.engine_setting(setting),
                                  variant=variant)

    def evaluated_build_json(self, target: str, model: str, setting: str, variant: str, repeat: int) -> str:
        """The build record of the engine a variant's evaluation job `repeat` opens: the one it is timed on
        (build_json), or with `evaluation.rebuild` its own separate build for job 2 on (paths.REBUILD)."""
        if repeat == 1 or not self.evaluation_rebuild:
            return self.build_json(target, model, setting, variant)
        return paths.REBUILD.format(study=self.name, target=target, model=model, setting=self.engine_setting(setting),
                                    variant=variant, repeat=paths.repeat_suffix(repeat))

    def served_settings(self, target: str, model: str, setting: str, variant: str) -> list[str]:
        """The settings whose jobs open the engine built at `setting`: itself first, then those whose
        `engine:` names it. The engine is built for each of their shapes."""
        served = [s for t, m, s, v in self.engines([target])
                  if (m, v) == (model, variant) and self.engine_setting(s) == setting]
        return list(dict.fromkeys([setting, *served]))

    def builds(self, run_targets):
        """(target, model, setting, variant) of every engine built: those the study measures, each
        shared engine once, under the setting that builds it."""
        return list(dict.fromkeys((t, m, self.engine_setting(s), v) for t, m, s, v in self.engines(run_targets)))

    def calibration_setting(self, model: str, setting: str) -> str:
        """The setting whose amax file this one uses: the model's first quality setting that agrees
        on the shape keys calibration depends on (`calibrate_by`, default all of them; never the
        batch). A model with a KV cache may calibrate by prefill alone, a shared dynamic engine by none."""
        return calibration_setting_of(self.calibrate_by, setting, self.settings, self.models[model].settings)

    def calibration_settings(self, model: str) -> list[str]:
        return sorted({self.calibration_setting(model, s) for s in self.models[model].settings})

    def calibration_method(self, label: str) -> dict[str, Any]:
        """The method an amax file is calibrated by: the recipe's for "", else the variant's that `label` names."""
        if not label:
            return self.recipe.method
        return next(v.calibration for v in self.variants.values() if v.calibration_label == label)

    def calibration_labels(self, run_targets) -> list[str]:
        """The amax files each calibration setting has on the run's targets: "" (the recipe's), then one per
        method a measured variant names."""
        measured = dict.fromkeys(v for *_, v in self.engines(run_targets))
        return ["", *dict.fromkeys(self.variants[v].calibration_label for v in measured
                                   if self.variants[v].calibration_label)]


@dataclass(frozen=True)
class Run:
    name: str
    weights: str
    hf_cache: str
    offline: bool
    studies: dict[str, Study]
    targets: dict[str, Target]
    note: str = ""

    def study_targets(self, study: Study) -> list[str]:
        """The run's targets a study uses (its `targets:`, or all of them)."""
        return [t for t in self.targets if not study.targets or t in study.targets]

    def aggregate_arguments(self, name: str) -> dict[str, Any]:
        """What rule aggregate makes a study's tables.json from, beside its input files: the study as
        configured, its baselines, the run, its targets. The audit compares tables.json's record of them
        with these (a threshold edited in the record, and the decision with it, would agree with itself)."""
        study = self.studies[name]
        return {"study": study.document, "baselines": study.baselines(),
                "run": {"name": self.name, "weights": self.weights, "note": self.note},
                "targets": {t: vars(self.targets[t]) for t in self.study_targets(study)}}


def tiny_dataset_spec(dataset: Dataset) -> dict[str, Any]:
    """What a tiny dataset's content depends on; a detection dataset is generated in its declared box format."""
    tiny = dataset.tiny if dataset.box_format is None else {**dataset.tiny, "box_format": dataset.box_format}
    return {"files": dataset.files, "tiny": tiny}


# What a revisit check's `variants` may name beside variants (as configured: dicts): every variant of a kind,
# whichever of them this run has.
REVISIT_SELECTORS = {
    "calibration_methods": lambda v: bool(v.get("calibration")),  # a variant's own calibration method
    "microscaled": lambda v: any("microscaling" in t for t in v.get("transforms") or []),  # NVFP4, MXFP8
}


def calibration_setting_of(calibrate_by, setting: str, settings: dict[str, Setting], model_settings) -> str | None:
    """The first of `model_settings` that is a quality setting agreeing with `setting` on the shape keys
    an amax file depends on (`calibrate_by`, None: all of them); None if there is none."""
    shape = settings[setting].shape
    keys = list(shape) if calibrate_by is None else calibrate_by
    for s in model_settings:
        if s in settings and settings[s].quality and all(settings[s].shape.get(k) == shape.get(k) for k in keys):
            return s
    return None
