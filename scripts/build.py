"""Rules build and rebuild (`use rule build as rebuild`): one engine, a variant built for a target."""
from quantstudy.jobserver import optional, run

run("quantstudy.steps_engines:build", snakemake.log[0], checkpoint_json=str(snakemake.input.checkpoint),
    amax_json=optional(snakemake.input, "amax"), export_json=optional(snakemake.input, "export"),
    out=str(snakemake.output.build), rule=snakemake.rule,  # build or rebuild: what its provenance records
    **snakemake.params)  # measurements.json goes beside build.json
