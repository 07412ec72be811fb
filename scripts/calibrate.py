"""Rule calibrate: static FP8 amax per layer (ModelOpt FP8_DEFAULT_CFG, max)."""
from quantstudy import steps

with steps.logged(snakemake.log[0]):
    steps.calibrate(checkpoint_json=snakemake.input.checkpoint, samples_json=snakemake.input.samples,
                    out=snakemake.output.amax, **snakemake.params)
