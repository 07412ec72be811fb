"""Rule reference: the reference model's outputs on the evaluation samples."""
from quantstudy.jobserver import run

params = dict(snakemake.params.items())
run("quantstudy.steps_reference:reference", snakemake.log[0], checkpoint_json=str(snakemake.input.checkpoint),
    samples_jsons={name: str(snakemake.input[name]) for name in params.pop("samples")},
    out_json=str(snakemake.output.json), out_tensors=str(snakemake.output.tensors), **params)
