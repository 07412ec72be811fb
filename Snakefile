# quantstudy: FP8 quantization studies, from pinned checkpoints to the README section.
# A table of contents: config, one include per stage of the data flow, one target rule.
from snakemake.utils import min_version

min_version("9.0")

if not config:  # a plain `snakemake` runs the embedded default; profiles name their own config

    configfile: "config/config.yaml"


report: "report/workflow.rst"  # the front page of `snakemake --report report.html`


include: "rules/common.smk"
include: "rules/fetch.smk"
include: "rules/reference.smk"
include: "rules/engines.smk"
include: "rules/report.smk"


rule all:
    input:
        final_targets(),


# Local runs: jobs fork from one process that has imported torch once (quantstudy/jobserver.py).
from quantstudy import jobserver

JOB_SERVER = []


onstart:
    if workflow.local_exec:
        JOB_SERVER.append(jobserver.start())


onsuccess:
    jobserver.stop(JOB_SERVER.pop() if JOB_SERVER else None)


onerror:
    jobserver.stop(JOB_SERVER.pop() if JOB_SERVER else None)
