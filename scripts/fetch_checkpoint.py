"""Rule fetch_checkpoint: a checkpoint at its pinned revision, with file hashes."""
from quantstudy import steps

with steps.logged(snakemake.log[0]):
    steps.fetch_checkpoint(out=snakemake.output[0], local_hub_json=snakemake.input.get("local_hub"),
                           **snakemake.params)
