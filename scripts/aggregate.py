"""Rule aggregate: the study's tidy tables (pandas), the render's only input."""
from quantstudy import aggregate, steps

with steps.logged(snakemake.log[0]):
    aggregate.aggregate(inputs={k: list(v) for k, v in snakemake.input.items()}, out=snakemake.output.tables,
                        **snakemake.params)
