"""Rule fetch_dataset: seeded samples from a dataset at its pinned revision."""
from quantstudy.jobserver import optional, run

run("quantstudy.steps:fetch_dataset", snakemake.log[0], out=str(snakemake.output[0]),
    checkpoint_json=str(snakemake.input.checkpoint), local_hub_json=optional(snakemake.input, "local_hub"),
    **snakemake.params)
