"""Rule fetch_checkpoint: a checkpoint at its pinned revision, with file hashes."""
from quantstudy.jobserver import optional, run

run("quantstudy.steps:fetch_checkpoint", snakemake.log[0], out=str(snakemake.output[0]),
    local_hub_json=optional(snakemake.input, "local_hub"), **snakemake.params)
