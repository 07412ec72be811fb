"""Rule fetch_dataset: seeded samples from a dataset at its pinned revision."""
from quantstudy import steps

with steps.logged(snakemake.log[0]):
    steps.fetch_dataset(out=snakemake.output[0], checkpoint_json=snakemake.input.checkpoint,
                        local_hub_json=snakemake.input.get("local_hub"), **snakemake.params)
