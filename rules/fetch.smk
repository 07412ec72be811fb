# Pinned inputs: tiny fixtures (embedded default), checkpoints and sample lists.


rule local_hub:
    output:
        paths.LOCAL_HUB,
    log:
        "logs/{study}/local_hub.log",
    benchmark:
        "benchmarks/{study}/local_hub.tsv"
    conda:
        WORKFLOW_ENV
    params:
        family=lambda w: study(w).family,
        models=lambda w: study(w).local_hub_models(),
        datasets=lambda w: study(w).local_hub_datasets(),
        cache_dir=RUN.hf_cache,
        weights=RUN.weights,
    script:
        "../scripts/local_hub.py"


rule fetch_checkpoint:
    input:
        unpack(local_hub_input),
    output:
        paths.CHECKPOINT,
    log:
        "logs/{study}/{model}/fetch_checkpoint.log",
    benchmark:
        "benchmarks/{study}/{model}/fetch_checkpoint.tsv"
    conda:
        WORKFLOW_ENV
    params:
        repo=lambda w: study(w).models[w.model].repo,
        revision=lambda w: study(w).models[w.model].revision,
        cache_dir=RUN.hf_cache,
        offline=RUN.offline,
        weights=RUN.weights,
    script:
        "../scripts/fetch_checkpoint.py"


rule fetch_dataset:
    input:
        unpack(local_hub_input),
        checkpoint=first_model_checkpoint,
    output:
        paths.SAMPLES,
    log:
        "logs/{study}/data/{samples}.log",
    benchmark:
        "benchmarks/{study}/data/{samples}.tsv"
    conda:
        WORKFLOW_ENV
    params:
        name=lambda w: w.samples,
        samples_spec=lambda w: study(w).samples[w.samples].as_params(),
        dataset=lambda w: study(w).sample_dataset(w.samples).as_params(),
        family=lambda w: study(w).family,
        cache_dir=RUN.hf_cache,
        offline=RUN.offline,
    script:
        "../scripts/fetch_dataset.py"
