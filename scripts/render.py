"""Rule render: the study's README section from its tables and the templates."""
from quantstudy import render, steps

with steps.logged(snakemake.log[0]):
    render.render_file(snakemake.input.tables, snakemake.output.readme)
