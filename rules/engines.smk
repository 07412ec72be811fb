# Per variant and target: build the engine, time it beside its baseline, profile, evaluate.
# `snakemake results/<study>/<target>/<model>/<setting>/<variant>/timing.json` reruns one chain.


rule export:
    input:
        unpack(amax_input),
        checkpoint=checkpoint_json,
    output:
        export=EXPORT_DIR + "/export.json",
    params:
        ident=lambda w: {"model": w.model, "setting": w.setting, "variant": w.variant},
        family=lambda w: study(w).family,
        window=window,
        batch=lambda w: study(w).setting(w.setting).batch,
        spec=lambda w: study(w).variants[w.variant].spec(window(w)),
        recipe=lambda w: study(w).recipe,
    log:
        "logs/{study}/{model}/{setting}/onnx/{variant}/export.log",
    benchmark:
        "benchmarks/{study}/{model}/{setting}/onnx/{variant}/export.tsv"
    script:
        "../scripts/export.py"


rule build:
    input:
        unpack(amax_input),
        unpack(export_input),
        checkpoint=checkpoint_json,
    output:
        build=VARIANT_DIR + "/build.json",
    params:
        ident=variant_ident,
        family=lambda w: study(w).family,
        target=target_params,
        window=window,
        batch=lambda w: study(w).setting(w.setting).batch,
        spec=lambda w: study(w).variants[w.variant].spec(window(w)),
        recipe=lambda w: study(w).recipe,
    log:
        "logs/" + VARIANT_KEY + "/build.log",
    benchmark:
        "benchmarks/" + VARIANT_KEY + "/build.tsv"
    conda:
        target_env
    script:
        "../scripts/build.py"


rule time:
    input:
        checkpoint=checkpoint_json,
        build=VARIANT_DIR + "/build.json",
        baseline_build=baseline_build,
    output:
        timing=VARIANT_DIR + "/timing.json",
    params:
        ident=variant_ident,
        family=lambda w: study(w).family,
        target=target_params,
        window=window,
        batch=lambda w: study(w).setting(w.setting).batch,
        recipe=lambda w: study(w).recipe,
        timing=lambda w: study(w).raw["timing"],
    log:
        "logs/" + VARIANT_KEY + "/time.log",
    benchmark:
        "benchmarks/" + VARIANT_KEY + "/time.tsv"
    conda:
        target_env
    script:
        "../scripts/time.py"


rule profile:
    input:
        checkpoint=checkpoint_json,
        build=VARIANT_DIR + "/build.json",
    output:
        kernels=VARIANT_DIR + "/kernels.json",
    params:
        ident=variant_ident,
        family=lambda w: study(w).family,
        target=target_params,
        window=window,
        batch=lambda w: study(w).setting(w.setting).batch,
        recipe=lambda w: study(w).recipe,
        calls=lambda w: study(w).raw["timing"]["calls_per_round"],
    log:
        "logs/" + VARIANT_KEY + "/profile.log",
    benchmark:
        "benchmarks/" + VARIANT_KEY + "/profile.tsv"
    conda:
        target_env
    script:
        "../scripts/profile.py"


rule evaluate:
    input:
        checkpoint=checkpoint_json,
        build=VARIANT_DIR + "/build.json",
        reference=lambda w: reference_prefix(w) + ".json",
        reference_tensors=lambda w: reference_prefix(w) + ".safetensors",
        sts=samples_json("sts"),
    output:
        quality=VARIANT_DIR + "/quality.json",
    params:
        ident=variant_ident,
        family=lambda w: study(w).family,
        target=target_params,
        window=window,
        batch=lambda w: study(w).setting(w.setting).batch,
        recipe=lambda w: study(w).recipe,
        metrics=lambda w: study(w).raw["metrics"],
        seeds=lambda w: study(w).raw["seeds"],
    log:
        "logs/" + VARIANT_KEY + "/evaluate.log",
    benchmark:
        "benchmarks/" + VARIANT_KEY + "/evaluate.tsv"
    conda:
        target_env
    script:
        "../scripts/evaluate.py"
