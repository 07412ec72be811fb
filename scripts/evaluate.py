"""Rule evaluate: quality against the reference and the non-finite scan."""
from quantstudy import steps

with steps.logged(snakemake.log[0]):
    steps.evaluate(checkpoint_json=snakemake.input.checkpoint, build_json=snakemake.input.build,
                   reference_json=snakemake.input.reference, reference_tensors=snakemake.input.reference_tensors,
                   sts_json=snakemake.input.sts, out=snakemake.output.quality, **snakemake.params)
