"""Rule local_hub: tiny checkpoints and datasets into the local Hugging Face cache."""
from quantstudy.jobserver import run

run("quantstudy.steps:local_hub", snakemake.log[0], out=str(snakemake.output[0]), **snakemake.params)
