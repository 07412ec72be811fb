"""Rule evaluate: quality against the reference and the non-finite scan."""
from quantstudy.jobserver import run

params = dict(snakemake.params.items())
run("quantstudy.steps_measure:evaluate", snakemake.log[0], checkpoint_json=str(snakemake.input.checkpoint),
    build_json=str(snakemake.input.build), reference_json=str(snakemake.input.reference),
    reference_tensors=str(snakemake.input.reference_tensors),
    samples_jsons={name: str(snakemake.input[name]) for name in params.pop("samples")},
    against_builds={v: str(snakemake.input[f"against_{v}"]) for v in params.pop("against")},
    out=str(snakemake.output.quality), **params)
