"""Rule profile: kernel time per call in the family's kernel groups."""
from quantstudy import steps

with steps.logged(snakemake.log[0]):
    steps.profile(checkpoint_json=snakemake.input.checkpoint, build_json=snakemake.input.build,
                  out=snakemake.output.kernels, **snakemake.params)
