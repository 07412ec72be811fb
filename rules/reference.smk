# The reference model's outputs, and the static FP8 scales (ModelOpt calibration).


rule reference:
    input:
        unpack(evaluation_samples),
        checkpoint=checkpoint_json,
    output:
        json=paths.REFERENCE,
        tensors=paths.REFERENCE_TENSORS,
    log:
        "logs/{study}/{model}/{setting}/reference.log",
    benchmark:
        "benchmarks/{study}/{model}/{setting}/reference.tsv"
    conda:
        WORKFLOW_ENV
    params:
        family=lambda w: study(w).family,
        model=lambda w: w.model,
        setting=setting_params,
        metrics=lambda w: study(w).metrics,
        seeds=lambda w: study(w).seeds,
        samples=lambda w: list(evaluation_samples(w)),
        dtype=lambda w: study(w).reference_dtype,
    script:
        "../scripts/reference.py"


rule calibrate:
    input:
        checkpoint=checkpoint_json,
        samples=calibration_samples,
    output:
        amax=paths.AMAX,
    log:
        "logs/{study}/{model}/calib/{setting}/calibrate{calibration}.log",
    benchmark:
        "benchmarks/{study}/{model}/calib/{setting}/calibrate{calibration}.tsv"
    conda:
        WORKFLOW_ENV
    params:
        family=lambda w: study(w).family,
        model=lambda w: w.model,
        setting=setting_params,
        architecture=architecture,
        recipe=recipe_params,
        method=calibration_method,
    script:
        "../scripts/calibrate.py"
