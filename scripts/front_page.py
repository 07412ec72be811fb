"""Rule front_page: every study's decision, for the front page of the report (report/workflow.rst)."""
from quantstudy.jobserver import run

run("quantstudy.render:front_page", snakemake.log[0], tables_jsons=list(snakemake.input.tables),
    out=str(snakemake.output.rst))
