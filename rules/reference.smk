# PyTorch fp32 reference outputs, and the static FP8 scales (ModelOpt calibration).


rule reference:
    input:
        checkpoint=checkpoint_json,
        heldout=samples_json("heldout"),
        sts=samples_json("sts"),
    output:
        json="results/{study}/{model}/{setting}/reference.json",
        tensors="results/{study}/{model}/{setting}/reference.safetensors",
    params:
        family=lambda w: study(w).family,
        model=lambda w: w.model,
        setting=lambda w: w.setting,
        window=window,
        metrics=lambda w: study(w).raw["metrics"],
        seed=lambda w: study(w).raw["seeds"]["masking"],
    log:
        "logs/{study}/{model}/{setting}/reference.log",
    benchmark:
        "benchmarks/{study}/{model}/{setting}/reference.tsv"
    script:
        "../scripts/reference.py"


rule calibrate:
    input:
        checkpoint=checkpoint_json,
        samples=lambda w: f"results/{w.study}/data/{study(w).recipe['activation_calibration']['samples']}.json",
    output:
        amax="results/{study}/{model}/calib/w{window}/amax.json",
    params:
        family=lambda w: study(w).family,
        model=lambda w: w.model,
        window=lambda w: int(w.window),
        recipe=lambda w: study(w).recipe,
    log:
        "logs/{study}/{model}/calib/w{window}/calibrate.log",
    benchmark:
        "benchmarks/{study}/{model}/calib/w{window}/calibrate.tsv"
    script:
        "../scripts/calibrate.py"
