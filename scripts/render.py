"""Rule render: the study's README section from its tables and the templates."""
from quantstudy.jobserver import run

run("quantstudy.render:render_file", snakemake.log[0], tables_json=str(snakemake.input.tables),
    out=str(snakemake.output.readme))
