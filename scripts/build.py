"""Rule build: one engine, a variant built for a target."""
from quantstudy import steps

with steps.logged(snakemake.log[0]):
    steps.build(checkpoint_json=snakemake.input.checkpoint, amax_json=snakemake.input.get("amax"),
                export_json=snakemake.input.get("export"), out=snakemake.output.build, **snakemake.params)
