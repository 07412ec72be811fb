"""Rule plot: the study's speed-vs-quality plot from its tables."""
from quantstudy.jobserver import run

run("quantstudy.plots:plot_file", snakemake.log[0], tables_json=str(snakemake.input.tables),
    out=str(snakemake.output.plot))
