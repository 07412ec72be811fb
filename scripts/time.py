"""Rule time: a variant and its baseline timed side by side."""
from quantstudy.jobserver import run

run("quantstudy.steps_measure:time", snakemake.log[0], checkpoint_json=str(snakemake.input.checkpoint),
    build_json=str(snakemake.input.build), baseline_build_json=str(snakemake.input.baseline_build),
    out=str(snakemake.output.timing), **snakemake.params)
