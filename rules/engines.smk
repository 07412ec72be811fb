# Per variant and target: export, build the engines, time them beside the baseline's, profile, evaluate;
# per target, model and setting: the FP8 variants' GEMMs alone (g of the Amdahl bound beside x).
# `snakemake results/<study>/<target>/<model>/<setting>/<variant>/timing.json` reruns one chain.


rule export:
    input:
        unpack(amax_input),
        checkpoint=checkpoint_json,
    output:
        export=paths.EXPORT,
    log:
        "logs/{study}/{model}/{setting}/onnx/{variant}/export.log",
    benchmark:
        "benchmarks/{study}/{model}/{setting}/onnx/{variant}/export.tsv"
    conda:
        WORKFLOW_ENV
    params:
        ident=lambda w: {"model": w.model, "setting": w.setting, "variant": w.variant},
        family=lambda w: study(w).family,
        setting=setting_params,
        architecture=architecture,
        spec=variant_spec,
        recipe=recipe_params,
    script:
        "../scripts/export.py"


rule build:
    input:
        unpack(amax_input),
        unpack(export_input),
        checkpoint=checkpoint_json,
    output:
        build=paths.BUILD,
        measurements=paths.MEASUREMENTS,
    log:
        f"logs/{paths.VARIANT_KEY}/build.log",
    benchmark:
        f"benchmarks/{paths.VARIANT_KEY}/build.tsv"
    conda:
        target_env
    resources:
        speed_measurement=build_measures_speed,
    params:
        ident=variant_ident,
        family=lambda w: study(w).family,
        target=target_params,
        setting=setting_params,
        serves=served_settings,
        architecture=architecture,
        spec=variant_spec,
        recipe=recipe_params,
    script:
        "../scripts/build.py"


# A separate build of a variant's engine for its evaluation job -r2, -r3 ... (`evaluation.rebuild`): the
# same job as build, writing to its own folder, so that the range across evaluation jobs is build to build.
use rule build as rebuild with:
    output:
        build=paths.REBUILD,
        measurements=paths.REBUILD_MEASUREMENTS,
    log:
        f"logs/{paths.VARIANT_KEY}/rebuild{{repeat}}.log",
    benchmark:
        f"benchmarks/{paths.VARIANT_KEY}/rebuild{{repeat}}.tsv"


# One job per repeat (timing.json, timing-r2.json, ...: `timing.repeats`); each times the variant
# beside its baseline, on its own, so that x's spread across jobs is measured.
rule time:
    input:
        checkpoint=checkpoint_json,
        build=variant_build,
        baseline_build=baseline_build,
    output:
        timing=paths.TIMING,
    log:
        f"logs/{paths.VARIANT_KEY}/time{{repeat}}.log",
    benchmark:
        f"benchmarks/{paths.VARIANT_KEY}/time{{repeat}}.tsv"
    conda:
        target_env
    resources:
        speed_measurement=measurement_slot,
    params:
        ident=variant_ident,
        family=lambda w: study(w).family,
        target=target_params,
        setting=setting_params,
        recipe=recipe_params,
        # not `repeats`: asking for more repeats adds jobs and keeps those already run
        timing=timing_rounds,
        repeat=repeat_index,
    script:
        "../scripts/time.py"


rule profile:
    input:
        checkpoint=checkpoint_json,
        build=variant_build,
    output:
        kernels=paths.KERNELS,
    log:
        f"logs/{paths.VARIANT_KEY}/profile.log",
    benchmark:
        f"benchmarks/{paths.VARIANT_KEY}/profile.tsv"
    conda:
        target_env
    resources:
        speed_measurement=measurement_slot,
    params:
        ident=variant_ident,
        family=lambda w: study(w).family,
        target=target_params,
        setting=setting_params,
        recipe=recipe_params,
        calls=lambda w: study(w).timing.calls_per_round,
    script:
        "../scripts/profile.py"


rule gemm:
    input:
        checkpoint=checkpoint_json,
        amax=lambda w: amax_json(w.study, w.model, study(w).calibration_setting(w.model, w.setting)),
    output:
        gemm=paths.GEMM,
    log:
        f"logs/{paths.SETTING_KEY}/gemm.log",
    benchmark:
        f"benchmarks/{paths.SETTING_KEY}/gemm.tsv"
    conda:
        target_env
    resources:
        speed_measurement=measurement_slot,
    params:
        ident=lambda w: {"target": w.target, "model": w.model, "setting": w.setting},
        family=lambda w: study(w).family,
        target=target_params,
        setting=setting_params,
        architecture=architecture,
        specs=fp8_variant_specs,
        recipe=recipe_params,
        timing=timing_rounds,
    script:
        "../scripts/gemm.py"


# One job per repeat (quality.json, quality-r2.json, ...: `evaluation.repeats`), each opening the engine
# and measuring it again, so that a metric's spread across jobs of one engine is measured; with
# `evaluation.rebuild`, job -r2 on opens rebuild-r2/build.json, ..., and the spread is across builds.
rule evaluate:
    input:
        unpack(evaluation_samples),
        unpack(against_builds),
        checkpoint=checkpoint_json,
        build=evaluated_build,
        reference=reference_json,
        reference_tensors=reference_tensors,
    output:
        quality=paths.QUALITY,
    log:
        f"logs/{paths.VARIANT_KEY}/evaluate{{repeat}}.log",
    benchmark:
        f"benchmarks/{paths.VARIANT_KEY}/evaluate{{repeat}}.tsv"
    conda:
        target_env
    params:
        ident=variant_ident,
        family=lambda w: study(w).family,
        target=target_params,
        setting=setting_params,
        recipe=recipe_params,
        metrics=lambda w: study(w).metrics,
        seeds=lambda w: study(w).seeds,
        samples=lambda w: list(evaluation_samples(w)),
        against=quality_against,
        repeat=repeat_index,
    script:
        "../scripts/evaluate.py"
