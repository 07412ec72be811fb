"""Rule audit: the rendered README back to its artifacts and pinned inputs."""
from quantstudy import audit, steps

with steps.logged(snakemake.log[0]):
    audit.audit(snakemake.input.tables, snakemake.input.readme, snakemake.output.audit)
