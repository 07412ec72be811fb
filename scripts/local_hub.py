"""Rule local_hub: tiny checkpoints and datasets into the local Hugging Face cache."""
from quantstudy import steps

with steps.logged(snakemake.log[0]):
    steps.local_hub(out=snakemake.output[0], **snakemake.params)
