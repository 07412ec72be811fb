"""Rule evaluate: quality against the reference and the non-finite scan."""
from quantstudy import steps

with steps.logged(snakemake.log[0]):
    params = dict(snakemake.params.items())
    samples = {name: snakemake.input[name] for name in params.pop("samples")}
    steps.evaluate(checkpoint_json=snakemake.input.checkpoint, build_json=snakemake.input.build,
                   reference_json=snakemake.input.reference, reference_tensors=snakemake.input.reference_tensors,
                   samples_jsons=samples, out=snakemake.output.quality, **params)
