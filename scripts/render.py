"""Rule render: the study's README section from its tables and the templates, and that section as an
HTML page with the plot inline (for the report)."""
from quantstudy.jobserver import run

run("quantstudy.render:render_file", snakemake.log[0], tables_json=str(snakemake.input.tables),
    out=str(snakemake.output.readme), page=str(snakemake.output.page))
