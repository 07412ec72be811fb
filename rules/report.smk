# Tidy tables of a study (pandas), then its README section (Jinja).


rule aggregate:
    input:
        builds=lambda w: engine_files(study(w), "build.json"),
        timings=lambda w: engine_files(study(w), "timing.json"),
        kernels=lambda w: engine_files(study(w), "kernels.json"),
        gemms=lambda w: gemm_files(study(w)),
        qualities=lambda w: engine_files(study(w), "quality.json"),
        references=lambda w: [f"results/{w.study}/{m}/{s}/reference.json" for m, s in study(w).model_settings(True)],
        amax=lambda w: [amax_json(w.study, m, s) for m in study(w).models for s in study(w).calibration_settings(m)],
        checkpoints=lambda w: [f"results/{w.study}/{m}/checkpoint.json" for m in study(w).models],
    output:
        tables="results/{study}/tables.json",
    params:
        study=lambda w: study(w).raw,
        baselines=lambda w: study(w).baselines(),
        run={"name": RUN.name, "weights": RUN.weights, "note": config["run"].get("note", "")},
        targets=lambda w: {n: vars(RUN.targets[n]) for n in study_targets(study(w))},
    log:
        "logs/{study}/aggregate.log",
    benchmark:
        "benchmarks/{study}/aggregate.tsv"
    script:
        "../scripts/aggregate.py"


rule render:
    input:
        tables="results/{study}/tables.json",
        templates=lambda w: [f"templates/{t}" for t in ("macros.md.j2", "study.md.j2", f"{study(w).family}.md.j2")],
    output:
        readme="results/{study}/README.md",
    log:
        "logs/{study}/render.log",
    benchmark:
        "benchmarks/{study}/render.tsv"
    script:
        "../scripts/render.py"


rule audit:
    input:
        tables="results/{study}/tables.json",
        readme="results/{study}/README.md",
    output:
        audit="results/{study}/audit.json",
    log:
        "logs/{study}/audit.log",
    benchmark:
        "benchmarks/{study}/audit.tsv"
    script:
        "../scripts/audit.py"
