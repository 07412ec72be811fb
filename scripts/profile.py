"""Rule profile: kernel time per call in the family's kernel groups."""
from quantstudy.jobserver import run

run("quantstudy.steps_measure:profile", snakemake.log[0], checkpoint_json=str(snakemake.input.checkpoint),
    build_json=str(snakemake.input.build), out=str(snakemake.output.kernels), **snakemake.params)
