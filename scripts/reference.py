"""Rule reference: the reference model's outputs on the evaluation samples."""
from quantstudy import steps

with steps.logged(snakemake.log[0]):
    params = dict(snakemake.params.items())
    samples = {name: snakemake.input[name] for name in params.pop("samples")}
    steps.reference(checkpoint_json=snakemake.input.checkpoint, samples_jsons=samples,
                    out_json=snakemake.output.json, out_tensors=snakemake.output.tensors, **params)
