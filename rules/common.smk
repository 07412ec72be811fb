# Validate the config once, into typed objects; input functions are one-liners over them.
import sys

sys.path.insert(0, workflow.basedir)  # the study package lives beside the Snakefile

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
    window=r"\d+",


VARIANT_KEY = "{study}/{target}/{model}/{setting}/{variant}"
VARIANT_DIR = "results/" + VARIANT_KEY


def study(w):
    return RUN.studies[w.study]


def target_params(w):
    return {"target": w.target, **vars(RUN.targets[w.target])}


def local_hub_input(w):
    specs = study(w).local_hub_specs()
    return {"local_hub": f"results/{w.study}/local_hub.json"} if specs["models"] or specs["datasets"] else {}


def checkpoint_json(w):
    return f"results/{w.study}/{w.model}/checkpoint.json"


def samples_json(name):
    return lambda w: f"results/{w.study}/data/{name}.json"


def first_model_checkpoint(w):
    return f"results/{w.study}/{next(iter(study(w).models))}/checkpoint.json"


def window(w):
    return study(w).setting(w.setting).window


def amax_input(w):
    """The variant's amax file, only if it has FP8 layers."""
    v = study(w).variants[w.variant]
    if any(name == "fp8" for name, _ in v.transforms_at(window(w))):
        return {"amax": f"results/{w.study}/{w.model}/calib/w{window(w)}/amax.json"}
    return {}


EXPORT_DIR = "results/{study}/{model}/{setting}/onnx/{variant}"


def export_input(w):
    """The variant's exported ONNX, for targets whose backend builds from ONNX (onnxruntime, tensorrt)."""
    if RUN.targets[w.target].backend == "torch":
        return {}
    return {"export": EXPORT_DIR.format(**dict(w.items())) + "/export.json"}


def target_env(w):
    """The conda env file a target's jobs run in (`env:` in its config), None for the workflow's own."""
    env = RUN.targets[w.target].env
    return f"../{env}" if env else None  # relative to rules/, as Snakemake reads conda paths


def baseline_build(w):
    return VARIANT_DIR.format(**{**dict(w.items()), "variant": study(w).baseline(w.setting)}) + "/build.json"


def reference_prefix(w):
    return f"results/{w.study}/{w.model}/{w.setting}/reference"


def variant_ident(w):
    return {"target": w.target, "model": w.model, "setting": w.setting, "variant": w.variant}


def engine_files(s, name):
    """Every per-variant artifact `name` of a study, over targets, models, settings and variants."""
    quality_only = name == "quality.json"
    return [f"results/{s.name}/{t}/{m}/{st}/{v}/{name}"
            for t in RUN.targets for m, st in s.model_settings(quality_only) for v in s.variants]


def final_targets():
    return [f"results/{s}/{name}" for s in RUN.studies for name in ("README.md", "audit.json")]
