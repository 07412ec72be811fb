"""Rule reference: PyTorch fp32 outputs on the evaluation samples."""
from quantstudy import steps

with steps.logged(snakemake.log[0]):
    steps.reference(checkpoint_json=snakemake.input.checkpoint, heldout_json=snakemake.input.heldout,
                    sts_json=snakemake.input.sts, out_json=snakemake.output.json,
                    out_tensors=snakemake.output.tensors, **snakemake.params)
