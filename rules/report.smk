# Tidy tables of a study (pandas), its speed-vs-quality plot (matplotlib), its README section (Jinja),
# the audit. `snakemake --report report.html` gathers the outputs marked report(...), captions in report/.


rule aggregate:
    input:
        builds=lambda w: engine_files(study(w), paths.BUILD),
        records=lambda w: engine_files(study(w), paths.MEASUREMENTS),
        timings=lambda w: engine_files(study(w), paths.TIMING),
        kernels=lambda w: engine_files(study(w), paths.KERNELS),
        gemms=lambda w: gemm_files(study(w)),
        qualities=lambda w: engine_files(study(w), paths.QUALITY),
        references=lambda w: [paths.REFERENCE.format(study=w.study, model=m, setting=s) for m, s in study(w).model_settings(True)],
        amax=lambda w: [
            amax_json(w.study, m, s, c)
            for m in study(w).models
            for s in study(w).calibration_settings(m)
            for c in study(w).calibration_labels(RUN.targets)
        ],
        checkpoints=lambda w: [paths.CHECKPOINT.format(study=w.study, model=m) for m in study(w).models],
        published=lambda w: [study(w).published] if study(w).published else [],
        samples=study_sample_lists,
    output:
        tables=report(paths.TABLES, caption="../report/tables.rst", category=study_title, subcategory="data"),
    log:
        "logs/{study}/aggregate.log",
    benchmark:
        "benchmarks/{study}/aggregate.tsv"
    conda:
        WORKFLOW_ENV
    params:
        # the study, its baselines, the run and its targets: what the audit compares with the config
        arguments=lambda w: RUN.aggregate_arguments(w.study),
    script:
        "../scripts/aggregate.py"


rule plot:
    input:
        tables=paths.TABLES,
    output:
        plot=report(paths.PLOT, caption="../report/speed_quality.rst", category=study_title, subcategory="plot"),
    log:
        "logs/{study}/plot.log",
    benchmark:
        "benchmarks/{study}/plot.tsv"
    conda:
        WORKFLOW_ENV
    script:
        "../scripts/plot.py"


rule render:
    input:
        tables=paths.TABLES,
        plot=paths.PLOT,
        templates=lambda w: [f"templates/{t}" for t in ("macros.md.j2", "study.md.j2", f"{study(w).family}.md.j2")],
        docs="docs/reading-a-study.md",  # linked from every README, inlined in its page
    output:
        readme=paths.README,
        page=report(paths.README_PAGE, caption="../report/readme.rst", category=study_title, subcategory="README"),
    log:
        "logs/{study}/render.log",
    benchmark:
        "benchmarks/{study}/render.tsv"
    conda:
        WORKFLOW_ENV
    script:
        "../scripts/render.py"


rule audit:
    input:
        tables=paths.TABLES,
        readme=paths.README,
    output:
        audit=report(paths.AUDIT, caption="../report/audit.rst", category=study_title, subcategory="data"),
    log:
        "logs/{study}/audit.log",
    benchmark:
        "benchmarks/{study}/audit.tsv"
    conda:
        WORKFLOW_ENV
    params:
        arguments=lambda w: RUN.aggregate_arguments(w.study),
    script:
        "../scripts/audit.py"


rule front_page:
    input:
        tables=expand(paths.TABLES, study=RUN.studies),
    output:
        rst=report(paths.DECISIONS, caption="../report/decisions.rst", category="Decisions"),
    log:
        "logs/front_page.log",
    conda:
        WORKFLOW_ENV
    script:
        "../scripts/front_page.py"
