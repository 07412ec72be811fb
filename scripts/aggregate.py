"""Rule aggregate: the study's tidy tables (pandas), the render's only input."""
from quantstudy.jobserver import run

run("quantstudy.aggregate:aggregate", snakemake.log[0], inputs={k: [str(p) for p in v] for k, v in snakemake.input.items()},
    out=str(snakemake.output.tables), **snakemake.params.arguments)
