"""Rule calibrate: static FP8 amax per layer (ModelOpt FP8_DEFAULT_CFG, max)."""
from quantstudy.jobserver import run

run("quantstudy.steps_reference:calibrate", snakemake.log[0], checkpoint_json=str(snakemake.input.checkpoint),
    samples_json=[str(p) for p in snakemake.input.samples], out=str(snakemake.output.amax), **snakemake.params)
