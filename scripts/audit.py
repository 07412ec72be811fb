"""Rule audit: the rendered README back to its artifacts and pinned inputs."""
from quantstudy.jobserver import run

run("quantstudy.audit:audit", snakemake.log[0], tables_json=str(snakemake.input.tables),
    readme=str(snakemake.input.readme), arguments=snakemake.params.arguments, out=str(snakemake.output.audit))
