"""Rule time: a variant and its baseline timed side by side."""
from quantstudy import steps

with steps.logged(snakemake.log[0]):
    steps.time(checkpoint_json=snakemake.input.checkpoint, build_json=snakemake.input.build,
               baseline_build_json=snakemake.input.baseline_build, out=snakemake.output.timing, **snakemake.params)
