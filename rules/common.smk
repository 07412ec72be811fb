# Validate the config once, into typed objects; input functions are one-liners over them.
import sys

sys.path.insert(0, workflow.basedir)  # the study package lives beside the Snakefile

from quantstudy import backend_traits, paths
from quantstudy.config import load_run

# Raises ConfigError, a readable sentence, before any job runs. A cluster job re-reads this
# file twice (sbatch step, then srun step); the checks against the code import torch and cost
# seconds per read, and the main process has already made them.
RUN = load_run(config, against_code=workflow.is_main_process)


wildcard_constraints:
    study=r"[a-z0-9_]+",
    model=r"[A-Za-z0-9_.-]+",
    setting=r"[A-Za-z0-9_.-]+",
    target=r"[A-Za-z0-9_.-]+",
    variant=r"[A-Za-z0-9_.+-]+",
    samples=r"[a-z0-9_]+",
    # A timing job's repeat: "" for the first (timing.json), "-r2", "-r3" ... for the others.
    repeat=r"(?:-r(?:[2-9]|[1-9][0-9]+))?",
    # An amax file's method: "" for the recipe's (amax.json), "-<label>" for a variant's own (amax-mse.json).
    calibration=r"(?:-[a-z0-9_.-]+)?",


# Jobs that measure speed hold the machine's one `speed_measurement` slot, so that two never run at
# once on one device. Snakemake limits a resource only where the run gives a limit (`--resources`);
# this gives 1 where the command line gives none (a `--resources` flag, also in a profile, replaces the
# whole list a workflow profile would give, and would drop the limit with it). "local": on a cluster each
# job has its own GPU (Slurm), so the limit holds within one submitted job, not across the cluster.
resource_scopes:
    speed_measurement="local",


if "speed_measurement" not in workflow.global_resources:
    workflow.register_resource("speed_measurement", 1)


def study(w):
    return RUN.studies[w.study]


def setting_params(w, name=None):
    """The setting as plain values: a rule's params, so that a changed shape reruns its jobs."""
    return study(w).setting(name or w.setting).as_params()


def served_settings(w):
    """The settings an engine is built for: its own, and those whose `engine:` names it."""
    return [setting_params(w, s) for s in study(w).served_settings(w.target, w.model, w.setting, w.variant)]


def timing_rounds(w):
    """How each timing job times (not how many jobs: raising `repeats` adds jobs, it reruns none)."""
    return study(w).timing.job_params()


def architecture(w):
    return study(w).models[w.model].architecture


def variant_spec(w):
    return study(w).variants[w.variant].spec(study(w).setting(w.setting))


def recipe_params(w):
    """The study's recipe as configured: a rule's params."""
    return study(w).recipe.as_params()


def target_params(w):
    return RUN.targets[w.target].as_params()


def local_hub_input(w):
    return {"local_hub": paths.LOCAL_HUB.format(study=w.study)} if study(w).has_local_hub else {}


def checkpoint_json(w):
    return paths.CHECKPOINT.format(study=w.study, model=w.model)


def samples_json(w, name):
    return paths.SAMPLES.format(study=w.study, samples=name)


def evaluation_samples(w):
    """The study's evaluation sample sets, by name: what the reference and evaluate jobs read."""
    return {name: samples_json(w, name) for name in study(w).evaluation_samples}


def calibration_samples(w):
    return [samples_json(w, name) for name in study(w).recipe.calibration_samples]


def study_sample_lists(w):
    """Every sample list the study's jobs read (calibration, then evaluation), each once."""
    return list(dict.fromkeys(calibration_samples(w) + list(evaluation_samples(w).values())))


def first_model_checkpoint(w):
    return paths.CHECKPOINT.format(study=w.study, model=next(iter(study(w).models)))


def amax_json(study_name, model, setting, calibration=""):
    """An amax file: the recipe's method (calibration ""), or the method a variant's calibration label names."""
    return paths.AMAX.format(study=study_name, model=model, setting=setting, calibration=paths.calibration_suffix(calibration))


def amax_input(w):
    """The variant's amax file (its setting's calibration setting, by its calibration method), only if its
    build reads one (FP8 or NVFP4 layers)."""
    s = study(w)
    variant = s.variants[w.variant]
    if variant.needs_amax(s.setting(w.setting)):
        return {"amax": amax_json(w.study, w.model, s.calibration_setting(w.model, w.setting), variant.calibration_label)}
    return {}


def calibration_method(w):
    """The method the amax file is calibrated by: the recipe's, or the variant's its {calibration} names."""
    return study(w).calibration_method(w.calibration.removeprefix("-"))


def target_traits(w):
    """The traits of the target's backend (what its build takes, whether its build measures)."""
    return backend_traits.of(RUN.targets[w.target].backend)


def export_input(w):
    """The variant's exported ONNX, for targets whose backend builds from ONNX."""
    if target_traits(w).builds_from != "onnx":
        return {}
    return {"export": paths.EXPORT.format(**dict(w.items()))}


# The workflow's own software (the pins of scripts/install.sh): the env of every rule but the
# target-specific ones. Used under --sdm conda only; a local run uses the Python that runs Snakemake.
WORKFLOW_ENV = "../envs/quantstudy.yaml"  # relative to rules/, as Snakemake reads conda paths


def target_env(w):
    """The conda env file a target's jobs run in: `env:` in its config, or the workflow's own."""
    env = RUN.targets[w.target].env
    return f"../{env}" if env else WORKFLOW_ENV


def study_title(w):
    """The study's title: its category in `snakemake --report`."""
    return study(w).title


def variant_build(w, variant=None):
    """The engines a variant is timed and evaluated on: built at its setting, or at the setting
    whose dynamic-shape engine serves it (`engine:`)."""
    return study(w).build_json(w.target, w.model, w.setting, variant or w.variant)


def evaluated_build(w, variant=None):
    """The engines evaluation job {repeat} opens: the variant's timed build, or its own rebuild (`evaluation.rebuild`)."""
    return study(w).evaluated_build_json(w.target, w.model, w.setting, variant or w.variant, repeat_index(w))


def quality_against(w):
    """The variants whose engines this variant's quality is also measured against (`quality_against`)."""
    return [v for v in study(w).quality_against if v != w.variant]


def against_builds(w):
    return {f"against_{v}": evaluated_build(w, v) for v in quality_against(w)}


def baseline_build(w):
    return variant_build(w, study(w).baseline.of(w.setting))


def reference_json(w):
    return paths.REFERENCE.format(study=w.study, model=w.model, setting=w.setting)


def reference_tensors(w):
    return paths.REFERENCE_TENSORS.format(study=w.study, model=w.model, setting=w.setting)


def variant_ident(w):
    return {"target": w.target, "model": w.model, "setting": w.setting, "variant": w.variant}


def repeat_index(w):
    return paths.repeat_number(w.repeat)


def measurement_slot(w):
    """A GPU measurement job holds the `speed_measurement` slot for its whole run. A CPU one does not: its
    measuring takes the machine's cores alone (timing.device_lock, which every other job's CPU work and its
    own opening wait for), so only the measuring is serialized, not its opening and writing."""
    return int(RUN.targets[w.target].device != "cpu")


def build_measures_speed(w):
    """A build that times candidate kernels on the device to choose them (TensorRT's tactics) holds the
    `speed_measurement` slot like a timing; other builds measure nothing."""
    return int(target_traits(w).build_times_kernels)


def engine_files(s, pattern):
    """Every per-variant artifact of a study (`pattern`: paths.BUILD, paths.TIMING, ...): each engine it
    measures (builds and their measurements records: each engine it builds; timings and kernels: not
    those of models with `timing: false`; kernels: none where `timing.profile` is false), on each of its
    targets; timings and qualities: each of the study's repeats."""
    if pattern == paths.KERNELS and not s.timing.profile:
        return []
    if pattern in (paths.BUILD, paths.MEASUREMENTS):
        engines = s.builds(RUN.targets)
    else:
        engines = s.engines(RUN.targets, quality_only=pattern == paths.QUALITY, timed_only=pattern in (paths.TIMING, paths.KERNELS))
    repeats = {paths.TIMING: s.repeats, paths.QUALITY: s.evaluation_repeats}.get(pattern, 1)
    return [
        pattern.format(study=s.name, target=t, model=m, setting=st, variant=v, repeat=paths.repeat_suffix(r))
        for t, m, st, v in engines
        for r in range(1, repeats + 1)
    ]


def fp8_variants_timed(s, target, model, setting):
    """The variants with FP8 layers that a target times at a model and setting."""
    return [
        v
        for t, m, st, v in s.engines(RUN.targets, timed_only=True)
        if (t, m, st) == (target, model, setting) and s.variants[v].has_fp8(s.setting(st))
    ]


def fp8_variant_specs(w):
    """{variant: spec} of those variants: what the gemm job times the GEMMs of."""
    s = study(w)
    return {v: s.variants[v].spec(s.setting(w.setting)) for v in fp8_variants_timed(s, w.target, w.model, w.setting)}


def gemm_files(s):
    """gemm.json of every target, model and setting where the study times an FP8 variant and profiles."""
    if not s.timing.profile:
        return []
    keys = dict.fromkeys((t, m, st) for t, m, st, _ in s.engines(RUN.targets, timed_only=True))
    return [paths.GEMM.format(study=s.name, target=t, model=m, setting=st) for t, m, st in keys if fp8_variants_timed(s, t, m, st)]


def final_targets():
    return [p.format(study=s) for s in RUN.studies for p in (paths.README, paths.AUDIT)] + [paths.DECISIONS]
